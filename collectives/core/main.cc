#include "collectives/core/main.h"

#include <fmt/format.h>

#include <cstdio>
#include <exception>
#include <new>

#include "collectives/core/error.h"
#include "collectives/core/settings.h"

namespace trn {

int run_main(const char* program, const std::function<int()>& body) {
  try {
    settings::validate();  // a bad TRN_* value ends the program before it starts (settings.h)
    return body();
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kUsage)
      fmt::print(stderr, "{}: error: {}\n", program, e.what());
    else
      fmt::print(stderr, "{}: {}: {}\n", program, to_string(e.kind()), e.what());
    return exit_code_for(e.kind());
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "{}: error: out of memory\n", program);
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: internal error (a trn bug, please report it): {}\n", program, e.what());
    return 1;
  }
}

}  // namespace trn

// The one way trn programs end. A usage error prints one line "PROGRAM: error: ..." and exits 2;
// a peer failure, timeout or abort prints one line and exits 1; anything else is a trn bug and
// says so. No stack dump reaches the user. Until the program installs its own, SIGINT and SIGTERM
// end it at once (their default action), whatever handler a library's constructor installed.
#pragma once

#include <functional>

namespace trn {

int run_main(const char* program, const std::function<int()>& body);

}  // namespace trn

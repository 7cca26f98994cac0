#include <catch2/catch.hpp>
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "launcher/agent/line_buffer.h"
#include "launcher/agent/output_pump.h"
#include "tests/support/process.h"

using namespace trn::launch;

TEST_CASE("line buffer emits whole lines only, splitting over-long ones") {
  LineBuffer b(8);
  std::vector<std::string> lines;
  auto emit = [&](std::string_view l) { lines.emplace_back(l); };
  b.feed("ab", emit);
  CHECK(lines.empty());
  b.feed("c\nde\nf", emit);
  CHECK(lines == std::vector<std::string>{"abc\n", "de\n"});
  CHECK(b.pending() == 1);
  b.feed("0123456789\n", emit);
  CHECK(lines == std::vector<std::string>{"abc\n", "de\n", "f0123456\n", "789\n"});
  b.feed("tail", emit);
  b.flush(emit);
  CHECK(lines.back() == "tail\n");
  CHECK(b.pending() == 0);
}

TEST_CASE("output pump prefixes lines, never interleaves them, and finishes log files atomically") {
  trn::test::TempDir dir;
  int console[2];
  REQUIRE(pipe(console) == 0);
  std::string console_text;
  std::thread reader([&] {
    char buf[4096];
    ssize_t n;
    while ((n = read(console[0], buf, sizeof(buf))) > 0) console_text.append(buf, static_cast<size_t>(n));
  });
  const int kWriters = 3, kLines = 2000;
  {
    OutputPump pump(console[1], console[1]);
    std::vector<std::thread> writers;
    for (int w = 0; w < kWriters; ++w) {
      int out[2], err[2];
      REQUIRE(pipe(out) == 0);
      REQUIRE(pipe(err) == 0);
      OutputSink sink{fmt::format("[rank {}] ", w), true, w == 0 ? dir.path() + "/rank0.log" : ""};
      pump.add(out[0], err[0], sink);
      writers.emplace_back([w, out1 = out[1], err1 = err[1]] {
        for (int i = 0; i < kLines; ++i) {
          // Each line goes out in two writes, so only line buffering keeps it whole.
          std::string head = fmt::format("w{} line ", w), tail = fmt::format("{} end\n", i);
          int fd = i % 10 == 0 ? err1 : out1;
          (void)!write(fd, head.data(), head.size());
          (void)!write(fd, tail.data(), tail.size());
        }
        (void)!write(out1, "no newline", 10);
        close(out1);
        close(err1);
      });
    }
    for (auto& t : writers) t.join();
    CHECK(pump.drain(trn::Deadline::after(std::chrono::seconds(20))));
  }
  close(console[1]);
  reader.join();
  close(console[0]);

  std::istringstream in(console_text);
  std::string line;
  std::map<int, int> count;
  while (std::getline(in, line)) {
    INFO(line);
    int w = line.at(6) - '0';
    REQUIRE(line.rfind(fmt::format("[rank {}] ", w), 0) == 0);
    std::string body = line.substr(9);
    REQUIRE((body == "no newline" ||
             (body.rfind(fmt::format("w{} line ", w), 0) == 0 && body.size() > 4 &&
              body.substr(body.size() - 4) == " end")));
    ++count[w];
  }
  for (int w = 0; w < kWriters; ++w) CHECK(count[w] == kLines + 1);

  // The log has rank 0's lines without a prefix, under its final name only.
  CHECK(access((dir.path() + "/rank0.log.partial").c_str(), F_OK) != 0);
  std::ifstream log(dir.path() + "/rank0.log");
  std::set<std::string> logged;
  while (std::getline(log, line)) logged.insert(line);
  CHECK(logged.size() == kLines + 1);
  CHECK(logged.count("w0 line 0 end") == 1);
  CHECK(logged.count(fmt::format("w0 line {} end", kLines - 1)) == 1);
}

# trn_add_fuzz_target(<name> SOURCES ... [LIBS ...])
#
# A fuzz target is a file defining LLVMFuzzerTestOneInput over one of trn's parsers. Its seeds
# live in tests/fuzz/corpus/<name>/ and every input that once crashed it in
# tests/fuzz/regressions/<name>/ (both checked in).
#
# Every build makes bin/fuzz_<name> and the unit test "fuzz: <name> replays its corpus", which
# runs each seed and regression input once: with libFuzzer (TRN_FUZZ, clang) through libFuzzer
# itself, otherwise through tests/fuzz/driver.cc. With TRN_FUZZ the test "fuzz: <name>" (label
# fuzz) also fuzzes for TRN_FUZZ_SECONDS, starting from the seeds and keeping what it finds in
# the build tree (build/<preset>/fuzz/<name>), never in the sources.
option(TRN_FUZZ "Build the fuzz targets with libFuzzer (needs clang)" OFF)
set(TRN_FUZZ_SECONDS 20 CACHE STRING "How long each bounded fuzz test (ctest -L fuzz) runs")
if(TRN_FUZZ AND NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  message(FATAL_ERROR "TRN_FUZZ needs clang (libFuzzer); configure with the asan preset")
endif()

function(trn_add_fuzz_target name)
  cmake_parse_arguments(F "" "" "SOURCES;LIBS" ${ARGN})
  set(exe fuzz_${name})
  set(seeds ${PROJECT_SOURCE_DIR}/tests/fuzz/corpus/${name})
  set(crashes ${PROJECT_SOURCE_DIR}/tests/fuzz/regressions/${name})
  if(TRN_FUZZ)
    add_executable(${exe} ${F_SOURCES})
    target_link_options(${exe} PRIVATE -fsanitize=fuzzer)
  else()
    add_executable(${exe} ${F_SOURCES} ${PROJECT_SOURCE_DIR}/tests/fuzz/driver.cc)
  endif()
  target_include_directories(${exe} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${exe} PRIVATE ${F_LIBS})
  set_property(GLOBAL APPEND PROPERTY TRN_UNIT_EXES ${exe})  # the unit-tests target

  # libFuzzer given -runs=0 and directories runs every file in them once and exits; the driver
  # does the same without libFuzzer.
  set(replay $<TARGET_FILE:${exe}>)
  if(TRN_FUZZ)
    list(APPEND replay -runs=0)
  endif()
  set(inputs ${seeds})
  if(EXISTS ${crashes})
    list(APPEND inputs ${crashes})
  endif()
  add_test(NAME "fuzz: ${name} replays its corpus" COMMAND ${replay} ${inputs})
  set_tests_properties("fuzz: ${name} replays its corpus" PROPERTIES LABELS "unit;fuzz-replay" TIMEOUT 300)

  if(TRN_FUZZ)
    set(work ${CMAKE_BINARY_DIR}/fuzz/${name})
    file(MAKE_DIRECTORY ${work}/corpus ${work}/artifacts)
    add_test(NAME "fuzz: ${name}"
      COMMAND $<TARGET_FILE:${exe}> -max_total_time=${TRN_FUZZ_SECONDS} -timeout=10 -rss_limit_mb=2048
              -print_final_stats=1 -artifact_prefix=${work}/artifacts/ ${work}/corpus ${inputs})
    set_tests_properties("fuzz: ${name}" PROPERTIES LABELS fuzz TIMEOUT 600)
  endif()
endfunction()

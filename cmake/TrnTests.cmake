# trn_add_test_exe(<name> COMPONENT <c> KIND <unit|integration|mpi|reference>
#                  SOURCES ... [LIBS ...] [TIMEOUT s])
#
# Builds one Catch2 executable and registers each of its test cases as its own CTest test,
# named "<component>: <test case name>" and labelled with KIND and COMPONENT. A test case tagged
# [slow], [mpi], [reference] or [integration] also gets that label, so `ctest -L slow` and
# `ctest -LE slow` work across executables. Discovery runs after every build of the executable.
set(TRN_TEST_TAG_LABELS slow mpi reference integration unit udp rails)

function(trn_add_test_exe name)
  cmake_parse_arguments(T "" "COMPONENT;KIND;TIMEOUT" "SOURCES;LIBS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  # Sanitized builds run several times slower: their tests get three times as long.
  if(TRN_SANITIZE)
    math(EXPR T_TIMEOUT "${T_TIMEOUT} * 3")
  endif()
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE trn_test_support Catch2::Catch2 ${T_LIBS})
  if(T_KIND STREQUAL "unit")
    set_property(GLOBAL APPEND PROPERTY TRN_UNIT_EXES ${name})  # the unit-tests target
  endif()
  set_property(GLOBAL APPEND PROPERTY TRN_TEST_COMPONENTS ${T_COMPONENT})  # tests-<component>
  set_property(GLOBAL APPEND PROPERTY TRN_TEST_EXES_${T_COMPONENT} ${name})
  set(ctest_file "${CMAKE_CURRENT_BINARY_DIR}/${name}_tests.cmake")
  add_custom_command(TARGET ${name} POST_BUILD
    COMMAND ${CMAKE_COMMAND}
      -D EXE=$<TARGET_FILE:${name}>
      -D OUT=${ctest_file}
      -D COMPONENT=${T_COMPONENT}
      -D KIND=${T_KIND}
      -D TIMEOUT=${T_TIMEOUT}
      -D "TAGS=${TRN_TEST_TAG_LABELS}"
      -D WORKDIR=${CMAKE_BINARY_DIR}
      -P ${PROJECT_SOURCE_DIR}/cmake/TrnDiscoverTests.cmake
    BYPRODUCTS ${ctest_file}
    VERBATIM)
  # An executable that was not built shows up as one failing test instead of vanishing.
  set(include_file "${CMAKE_CURRENT_BINARY_DIR}/${name}_include.cmake")
  file(WRITE ${include_file}
    "if(EXISTS \"${ctest_file}\")\n"
    "  include(\"${ctest_file}\")\n"
    "else()\n"
    "  add_test(${T_COMPONENT}:_${name}_NOT_BUILT ${CMAKE_COMMAND} -E false)\n"
    "  set_tests_properties(${T_COMPONENT}:_${name}_NOT_BUILT PROPERTIES LABELS \"${T_KIND};${T_COMPONENT}\")\n"
    "endif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${include_file})
endfunction()

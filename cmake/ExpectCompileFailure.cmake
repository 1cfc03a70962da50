# ctest driver for one negative compile test (cmake -P):
#   -DBUILD_DIR=<build tree> -DTARGET=<EXCLUDE_FROM_ALL object target>
#   -DSOURCE=<compile_fail/x.cpp> [-DCONFIG=<config>]
# Passes only when building TARGET fails AND the diagnostics match the regex
# given on SOURCE's first line as `// expect: <regex>`.

file(STRINGS "${SOURCE}" _first_line LIMIT_COUNT 1)
if(NOT _first_line MATCHES "^//[ \t]*expect:[ \t]*(.+)$")
  message(FATAL_ERROR "${SOURCE}: first line must be `// expect: <regex>`, got: ${_first_line}")
endif()
string(STRIP "${CMAKE_MATCH_1}" _expect)

set(_config_args)
if(CONFIG)
  set(_config_args --config "${CONFIG}")
endif()
execute_process(
  COMMAND "${CMAKE_COMMAND}" --build "${BUILD_DIR}" --target "${TARGET}" ${_config_args}
  RESULT_VARIABLE _result
  OUTPUT_VARIABLE _output
  ERROR_VARIABLE _output)

if(_result EQUAL 0)
  message(FATAL_ERROR "${SOURCE} compiled, but it must not.\n${_output}")
endif()

# Keep only the compiler's words: drop the build tool's progress lines and the
# file's own path, so a regex cannot pass by matching a file or target name.
string(REPLACE "${SOURCE}" "<source>" _diagnostics "${_output}")
string(REGEX REPLACE "(^|\n)(\\[ *[0-9]+%\\]|g?make(\\[[0-9]+\\])?:|Consolidate compiler|ninja:|FAILED:)[^\n]*" "\\1" _diagnostics "${_diagnostics}")
string(REPLACE "${TARGET}" "<target>" _diagnostics "${_diagnostics}")

if(NOT _diagnostics MATCHES "${_expect}")
  message(FATAL_ERROR
    "${SOURCE} failed to compile, but no diagnostic matches `${_expect}`:\n${_output}")
endif()
message(STATUS "${SOURCE}: failed to compile as expected (matched `${_expect}`)")

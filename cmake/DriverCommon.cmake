# Shared by the ctest drivers run with cmake -P (ConsumerTest, ConanTest,
# VcpkgLayoutTest). Set DRIVER_NAME before including: it prefixes failures.

# run_step(<what> <command...>): runs the command; a non-zero exit is a
# FATAL_ERROR "<DRIVER_NAME>: <what> failed (<code>)".
function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE _result)
  if(NOT _result EQUAL 0)
    message(FATAL_ERROR "${DRIVER_NAME}: ${what} failed (${_result})")
  endif()
endfunction()

# driver_prefix_path(<out>): the driver's PREFIX_PATH ('|'-separated: where
# Torch and the header-only dependencies live), then the environment's
# CMAKE_PREFIX_PATH, as a CMake list.
function(driver_prefix_path out)
  string(REPLACE "|" ";" _path "${PREFIX_PATH}")
  if(DEFINED ENV{CMAKE_PREFIX_PATH} AND NOT "$ENV{CMAKE_PREFIX_PATH}" STREQUAL "")
    string(REPLACE ":" ";" _env_path "$ENV{CMAKE_PREFIX_PATH}")
    list(APPEND _path ${_env_path})
  endif()
  set(${out} "${_path}" PARENT_SCOPE)
endfunction()

# use_prefix_path(<list>): puts the list in the environment's CMAKE_PREFIX_PATH
# (a ';'-list does not survive execute_process).
function(use_prefix_path path)
  string(REPLACE ";" ":" _joined "${path}")
  set(ENV{CMAKE_PREFIX_PATH} "${_joined}")
endfunction()

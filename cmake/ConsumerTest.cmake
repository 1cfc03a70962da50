# ctest driver (cmake -P) that builds and runs tests/consumer against memscale:
#   -DMODE=find_package      install BUILD_DIR to a fresh prefix, find_package it
#   -DMODE=add_subdirectory  add_subdirectory(SOURCE_DIR) as a non-top-level project
# Other inputs: SOURCE_DIR BUILD_DIR WORK_DIR CONFIG GENERATOR CXX_COMPILER
# PREFIX_PATH ('|'-separated: where Torch and range-v3 live) THIRD_PARTY_DIR.

set(DRIVER_NAME "consumer.${MODE}")
include("${CMAKE_CURRENT_LIST_DIR}/DriverCommon.cmake")

file(REMOVE_RECURSE "${WORK_DIR}")
driver_prefix_path(_prefix_path)
if(NOT CONFIG)
  set(CONFIG Release)
endif()

# The consumer builds with no build type (no -O, no -g): what it tests is the
# package (its config, targets and dependencies, a link and a run), and at -O0
# it compiles in 25 s, at -O3 in 39. memscale's own build compiles every header
# at -O3 with the same warnings, as errors in CI (scripts/run-tests.sh).
set(_configure_args
  -DMEMSCALE_CONSUMER_MODE=${MODE}
  -DCMAKE_BUILD_TYPE=)
if(MODE STREQUAL "find_package")
  run_step("install" "${CMAKE_COMMAND}" --install "${BUILD_DIR}"
    --prefix "${WORK_DIR}/prefix" --config "${CONFIG}")
  list(PREPEND _prefix_path "${WORK_DIR}/prefix")
elseif(MODE STREQUAL "add_subdirectory")
  list(APPEND _configure_args
    "-DMEMSCALE_SOURCE_DIR=${SOURCE_DIR}"
    "-DMEMSCALE_THIRD_PARTY_DIR=${THIRD_PARTY_DIR}")
else()
  message(FATAL_ERROR "unknown MODE '${MODE}'")
endif()

# Passed through the environment: a ';'-list does not survive execute_process.
use_prefix_path("${_prefix_path}")
message(STATUS "consumer.${MODE}: CMAKE_PREFIX_PATH=$ENV{CMAKE_PREFIX_PATH}")
run_step("configure" "${CMAKE_COMMAND}" -S "${SOURCE_DIR}/tests/consumer" -B "${WORK_DIR}/build"
  -G "${GENERATOR}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" ${_configure_args})
run_step("build" "${CMAKE_COMMAND}" --build "${WORK_DIR}/build" --config "${CONFIG}")
find_program(_consumer memscale_consumer
  PATHS "${WORK_DIR}/build" "${WORK_DIR}/build/${CONFIG}" NO_DEFAULT_PATH REQUIRED)
run_step("run" "${_consumer}")
message(STATUS "consumer.${MODE}: built and ran ${_consumer}")

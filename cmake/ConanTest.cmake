# ctest driver (cmake -P): `conan create` of memscale's Conan recipe
# (conanfile.py) with the Debian profile (packaging/conan/profiles/debian12),
# building and running test_package/ against the package.
# Inputs: SOURCE_DIR WORK_DIR PREFIX_PATH ('|'-separated: where Torch and
# range-v3 live). Conan: $MEMSCALE_CONAN (its path), else `conan` on PATH, else
# /work/shared/tools/conan. With none, or MEMSCALE_CONAN=OFF, the test is
# skipped: exit code 77, or on CMake < 3.29 (no cmake_language(EXIT)) the
# MEMSCALE_TEST_SKIPPED line the test's SKIP_REGULAR_EXPRESSION matches.
# CONAN_HOME lives in WORK_DIR: nothing of the user's ~/.conan2 is touched.

set(DRIVER_NAME conan)
include("${CMAKE_CURRENT_LIST_DIR}/DriverCommon.cmake")

if(DEFINED ENV{MEMSCALE_CONAN} AND NOT "$ENV{MEMSCALE_CONAN}" STREQUAL "")
  set(_conan "$ENV{MEMSCALE_CONAN}")
  if(NOT _conan)  # MEMSCALE_CONAN=OFF: skip
    set(_conan "")
  elseif(NOT EXISTS "${_conan}")
    message(FATAL_ERROR "conan: MEMSCALE_CONAN=${_conan} does not exist")
  endif()
else()
  find_program(_conan conan PATHS /work/shared/tools NO_CACHE)
endif()
if(NOT _conan)
  if(CMAKE_VERSION VERSION_GREATER_EQUAL 3.29)
    message(NOTICE "MEMSCALE_TEST_SKIPPED: no conan (set MEMSCALE_CONAN or put conan on PATH)")
    cmake_language(EXIT 77)
  endif()
  message(FATAL_ERROR "MEMSCALE_TEST_SKIPPED: no conan (set MEMSCALE_CONAN or put conan on PATH)")
endif()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(ENV{CONAN_HOME} "${WORK_DIR}/conan_home")
# LibTorch is found by memscale's CMake, not by Conan: through CMAKE_PREFIX_PATH.
driver_prefix_path(_prefix_path)
use_prefix_path("${_prefix_path}")
message(STATUS "conan: ${_conan}, CONAN_HOME=$ENV{CONAN_HOME}, CMAKE_PREFIX_PATH=$ENV{CMAKE_PREFIX_PATH}")

run_step("conan --version" "${_conan}" --version)
# test_package builds in its own folder: a copy here keeps the source tree clean.
file(COPY "${SOURCE_DIR}/test_package" DESTINATION "${WORK_DIR}")
file(REMOVE_RECURSE "${WORK_DIR}/test_package/build")
# Offline: no remote. An absolute --test-folder: Conan joins it to the
# recipe's folder, which yields it.
# The profile's Release stays (the package's own configure and install, and
# test_package's settings), but test_package's main.cpp compiles without -O3,
# as ConsumerTest.cmake's consumer does: what it tests is the package (its
# config, targets and dependencies, a link and a run), and at -O3 that one
# unit took 50 s of the test's 64 on a 2-core VM.
run_step("conan create" "${_conan}" create "${SOURCE_DIR}"
  -pr:a "${SOURCE_DIR}/packaging/conan/profiles/debian12"
  -c:a "tools.cmake.cmaketoolchain:extra_variables={'CMAKE_CXX_FLAGS_RELEASE': '-DNDEBUG'}"
  --build=missing --no-remote
  --test-folder "${WORK_DIR}/test_package")
message(STATUS "conan: created memscale and ran test_package")

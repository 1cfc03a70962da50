# ctest driver (cmake -P): what the vcpkg overlay port
# (packaging/vcpkg/ports/memscale) installs, without vcpkg. It runs the port's
# own portfile.cmake (default features) with stand-ins for the vcpkg helpers it
# calls: configure and install as vcpkg_cmake_configure/_install do (release
# only), vcpkg_cmake_config_fixup's move of lib/cmake/memscale to
# share/memscale and its path rewrites (the regexes are vcpkg-cmake-config's).
# Then it copies the package into an installed tree as vcpkg does, checks the
# layout (no absolute paths, the moved configs resolve the prefix), and builds
# and runs tests/consumer with find_package(memscale CONFIG) from that tree.
# Inputs: SOURCE_DIR WORK_DIR CONFIG GENERATOR CXX_COMPILER PREFIX_PATH
# ('|'-separated: where Torch and range-v3 live).

cmake_minimum_required(VERSION 3.21)  # policies as in vcpkg's scripts (IN_LIST)

set(DRIVER_NAME vcpkg)
include("${CMAKE_CURRENT_LIST_DIR}/DriverCommon.cmake")
function(check condition_text)
  if(NOT (${ARGN}))
    message(FATAL_ERROR "vcpkg: layout check failed: ${condition_text}")
  endif()
endfunction()

# --- what vcpkg defines for a portfile -------------------------------------------
set(PORT memscale)
set(TARGET_TRIPLET x64-linux)
set(FEATURES core)
set(CURRENT_PORT_DIR "${SOURCE_DIR}/packaging/vcpkg/ports/${PORT}")
set(CURRENT_BUILDTREES_DIR "${WORK_DIR}/buildtrees/${PORT}")
set(CURRENT_PACKAGES_DIR "${WORK_DIR}/packages/${PORT}_${TARGET_TRIPLET}")
set(CURRENT_INSTALLED_DIR "${WORK_DIR}/installed/${TARGET_TRIPLET}")
file(READ "${CURRENT_PORT_DIR}/vcpkg.json" _manifest)
string(JSON VERSION GET "${_manifest}" version)
unset(ENV{MEMSCALE_SOURCE_PATH})  # the port's default: the checkout it lives in

file(REMOVE_RECURSE "${WORK_DIR}")
driver_prefix_path(_prefix_path)
if(NOT CONFIG)
  set(CONFIG Release)
endif()

# --- stand-ins for the vcpkg helpers the portfile calls ---------------------------
function(vcpkg_check_features)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "OUT_FEATURE_OPTIONS" "FEATURES")
  set(_options "")
  while(arg_FEATURES)
    list(POP_FRONT arg_FEATURES _feature _option)
    if(_feature IN_LIST FEATURES)
      list(APPEND _options "-D${_option}=ON")
    else()
      list(APPEND _options "-D${_option}=OFF")
    endif()
  endwhile()
  set(${arg_OUT_FEATURE_OPTIONS} "${_options}" PARENT_SCOPE)
endfunction()
function(vcpkg_check_linkage)
endfunction()
function(vcpkg_cmake_configure)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "SOURCE_PATH" "OPTIONS;MAYBE_UNUSED_VARIABLES")
  if(NOT VCPKG_BUILD_TYPE STREQUAL "release")
    message(FATAL_ERROR "vcpkg: only the header-only (release-only) port is reproduced here")
  endif()
  use_prefix_path("${_prefix_path}")
  # The options of vcpkg_cmake_configure that bear on an install, less its toolchain.
  run_step("configure" "${CMAKE_COMMAND}" --no-warn-unused-cli -S "${arg_SOURCE_PATH}"
    -B "${CURRENT_BUILDTREES_DIR}/${TARGET_TRIPLET}-rel" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" -DCMAKE_BUILD_TYPE=Release
    "-DCMAKE_INSTALL_PREFIX=${CURRENT_PACKAGES_DIR}"
    -DCMAKE_INSTALL_LIBDIR:STRING=lib -DCMAKE_INSTALL_BINDIR:STRING=bin
    -DCMAKE_ERROR_ON_ABSOLUTE_INSTALL_DESTINATION=ON
    -DCMAKE_EXPORT_NO_PACKAGE_REGISTRY=ON -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON
    -DBUILD_SHARED_LIBS=OFF ${arg_OPTIONS})
endfunction()
function(vcpkg_cmake_install)
  run_step("install" "${CMAKE_COMMAND}" --build "${CURRENT_BUILDTREES_DIR}/${TARGET_TRIPLET}-rel" --target install)
endfunction()
# vcpkg_cmake_config_fixup for VCPKG_BUILD_TYPE release (no debug tree).
function(vcpkg_cmake_config_fixup)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "PACKAGE_NAME;CONFIG_PATH" "")
  set(_release_share "${CURRENT_PACKAGES_DIR}/share/${arg_PACKAGE_NAME}")
  set(_release_config "${CURRENT_PACKAGES_DIR}/${arg_CONFIG_PATH}")
  file(GLOB _files "${_release_config}/*")
  file(COPY ${_files} DESTINATION "${_release_share}")
  file(REMOVE_RECURSE "${_release_config}")
  get_filename_component(_parent "${_release_config}" DIRECTORY)
  get_filename_component(_parent_name "${_parent}" NAME)
  if(_parent_name STREQUAL "cmake")
    file(REMOVE_RECURSE "${_parent}")
  endif()
  file(GLOB_RECURSE _main_cmakes "${_release_share}/*.cmake")
  foreach(_main_cmake IN LISTS _main_cmakes)
    file(READ "${_main_cmake}" contents)
    string(REGEX REPLACE
[[get_filename_component\(_IMPORT_PREFIX "\${CMAKE_CURRENT_LIST_FILE}" PATH\)(
get_filename_component\(_IMPORT_PREFIX "\${_IMPORT_PREFIX}" PATH\))*]]
[[get_filename_component(_IMPORT_PREFIX "${CMAKE_CURRENT_LIST_FILE}" PATH)
get_filename_component(_IMPORT_PREFIX "${_IMPORT_PREFIX}" PATH)
get_filename_component(_IMPORT_PREFIX "${_IMPORT_PREFIX}" PATH)]]
      contents "${contents}")
    string(REGEX REPLACE
[[get_filename_component\(PACKAGE_PREFIX_DIR "\${CMAKE_CURRENT_LIST_DIR}/\.\./(\.\./)*" ABSOLUTE\)]]
[[get_filename_component(PACKAGE_PREFIX_DIR "${CMAKE_CURRENT_LIST_DIR}/../../" ABSOLUTE)]]
      contents "${contents}")
    string(REPLACE "${CURRENT_INSTALLED_DIR}" [[${_IMPORT_PREFIX}]] contents "${contents}")
    string(REPLACE "${CURRENT_PACKAGES_DIR}" [[${_IMPORT_PREFIX}]] contents "${contents}")
    file(WRITE "${_main_cmake}" "${contents}")
  endforeach()
endfunction()
function(vcpkg_install_copyright)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "" "FILE_LIST")
  set(_text "")
  foreach(_file IN LISTS arg_FILE_LIST)
    file(READ "${_file}" _one)
    string(APPEND _text "${_one}")
  endforeach()
  file(WRITE "${CURRENT_PACKAGES_DIR}/share/${PORT}/copyright" "${_text}")
endfunction()

# --- the port, then vcpkg's copy of the package into the installed tree -----------
include("${CURRENT_PORT_DIR}/portfile.cmake")
file(COPY "${CURRENT_PACKAGES_DIR}/" DESTINATION "${CURRENT_INSTALLED_DIR}")
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}")

# --- the layout -------------------------------------------------------------------
set(_share "${CURRENT_INSTALLED_DIR}/share/memscale")
foreach(_file IN ITEMS memscaleConfig.cmake memscaleConfigVersion.cmake memscaleTargets.cmake copyright)
  check("share/memscale/${_file} exists" EXISTS "${_share}/${_file}")
endforeach()
check("include/memscale/memscale.hpp exists" EXISTS "${CURRENT_INSTALLED_DIR}/include/memscale/memscale.hpp")
check("no lib/ (header-only)" NOT EXISTS "${CURRENT_INSTALLED_DIR}/lib")
check("no debug/ (header-only)" NOT EXISTS "${CURRENT_INSTALLED_DIR}/debug")
include("${_share}/memscaleConfigVersion.cmake")
check("vcpkg.json's version ${VERSION} is the project's ${PACKAGE_VERSION}" VERSION STREQUAL PACKAGE_VERSION)
# vcpkg's post-build check: no absolute path of the build in what is installed.
file(GLOB_RECURSE _installed_files "${CURRENT_INSTALLED_DIR}/*")
foreach(_file IN LISTS _installed_files)
  file(READ "${_file}" _text)
  foreach(_path IN ITEMS "${WORK_DIR}" "${SOURCE_DIR}")
    string(FIND "${_text}" "${_path}" _at)
    check("${_file} holds no absolute path ${_path}" _at EQUAL -1)
  endforeach()
endforeach()
# The moved configs: PACKAGE_PREFIX_DIR and _IMPORT_PREFIX must both be the prefix.
file(READ "${_share}/memscaleConfig.cmake" _text)
string(REGEX MATCH [[PACKAGE_PREFIX_DIR "\${CMAKE_CURRENT_LIST_DIR}/([./]*)" ABSOLUTE]] _match "${_text}")
check("memscaleConfig.cmake computes PACKAGE_PREFIX_DIR" _match)
get_filename_component(_prefix "${_share}/${CMAKE_MATCH_1}" ABSOLUTE)
check("PACKAGE_PREFIX_DIR (${_prefix}) is the installed prefix" _prefix STREQUAL CURRENT_INSTALLED_DIR)
file(STRINGS "${_share}/memscaleTargets.cmake" _ups
     REGEX [[^get_filename_component\(_IMPORT_PREFIX "\${_IMPORT_PREFIX}" PATH\)$]])
set(_prefix "${_share}/memscaleTargets.cmake")
foreach(_up IN ITEMS file ${_ups})
  get_filename_component(_prefix "${_prefix}" DIRECTORY)
endforeach()
check("_IMPORT_PREFIX (${_prefix}) is the installed prefix" _prefix STREQUAL CURRENT_INSTALLED_DIR)
message(STATUS "vcpkg: the port's layout in ${CURRENT_INSTALLED_DIR} checks out")

# --- a user's project against the installed tree ----------------------------------
list(PREPEND _prefix_path "${CURRENT_INSTALLED_DIR}")
use_prefix_path("${_prefix_path}")
run_step("consumer configure" "${CMAKE_COMMAND}" -S "${SOURCE_DIR}/tests/consumer" -B "${WORK_DIR}/consumer"
  -G "${GENERATOR}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" -DCMAKE_BUILD_TYPE=  # no build type: as ConsumerTest.cmake
  -DMEMSCALE_CONSUMER_MODE=find_package)
file(STRINGS "${WORK_DIR}/consumer/CMakeCache.txt" _memscale_dir REGEX "^memscale_DIR:")
check("the consumer found share/memscale (${_memscale_dir})" _memscale_dir STREQUAL "memscale_DIR:PATH=${_share}")
run_step("consumer build" "${CMAKE_COMMAND}" --build "${WORK_DIR}/consumer" --config "${CONFIG}")
find_program(_consumer memscale_consumer
  PATHS "${WORK_DIR}/consumer" "${WORK_DIR}/consumer/${CONFIG}" NO_DEFAULT_PATH NO_CACHE REQUIRED)
run_step("consumer run" "${_consumer}")
message(STATUS "vcpkg: built and ran ${_consumer} against ${CURRENT_INSTALLED_DIR}")

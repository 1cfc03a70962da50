# vcpkg portfile for memscale:
#   vcpkg install memscale --overlay-ports=<memscale>/packaging/vcpkg/ports
# Header-only (one release configuration) unless the "cuda" feature builds
# memscale::cuda. LibTorch is found by memscale's CMake (find_package(Torch)):
# on the system, or where a triplet's MEMSCALE_TORCH_DIR (LibTorch's
# share/cmake/Torch) points. cmake/VcpkgLayoutTest.cmake runs this file.

# Sources: MEMSCALE_SOURCE_PATH (a triplet or environment variable), else the
# memscale checkout this overlay port lives in. A registry port would instead use
#   vcpkg_from_github(OUT_SOURCE_PATH SOURCE_PATH REPO <owner>/memscale
#                     REF "v${VERSION}" SHA512 <sha512 of the archive> HEAD_REF main)
if(DEFINED MEMSCALE_SOURCE_PATH)
  set(SOURCE_PATH "${MEMSCALE_SOURCE_PATH}")
elseif(DEFINED ENV{MEMSCALE_SOURCE_PATH})
  set(SOURCE_PATH "$ENV{MEMSCALE_SOURCE_PATH}")
else()
  get_filename_component(SOURCE_PATH "${CURRENT_PORT_DIR}/../../../.." ABSOLUTE)
endif()
if(NOT EXISTS "${SOURCE_PATH}/include/memscale/version.hpp")
  message(FATAL_ERROR "memscale: no memscale sources at '${SOURCE_PATH}' (set MEMSCALE_SOURCE_PATH)")
endif()

vcpkg_check_features(OUT_FEATURE_OPTIONS FEATURE_OPTIONS FEATURES cuda MEMSCALE_BUILD_CUDA http MEMSCALE_WITH_HTTP)
if("cuda" IN_LIST FEATURES)
  vcpkg_check_linkage(ONLY_STATIC_LIBRARY)  # libmemscale_cuda.a
else()
  set(VCPKG_BUILD_TYPE release)  # headers only: one configuration is enough
endif()
set(torch_options "")
if(DEFINED MEMSCALE_TORCH_DIR)
  set(torch_options "-DTorch_DIR=${MEMSCALE_TORCH_DIR}")
endif()

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    ${FEATURE_OPTIONS}
    ${torch_options}
    -DMEMSCALE_BUILD_TESTS=OFF
    -DMEMSCALE_BUILD_EXAMPLES=OFF
    -DMEMSCALE_BUILD_BENCHMARKS=OFF
  MAYBE_UNUSED_VARIABLES Torch_DIR)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(PACKAGE_NAME memscale CONFIG_PATH lib/cmake/memscale)

file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug/include" "${CURRENT_PACKAGES_DIR}/debug/share")
if(NOT "cuda" IN_LIST FEATURES)
  file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/lib" "${CURRENT_PACKAGES_DIR}/debug")  # left empty
endif()

if(EXISTS "${SOURCE_PATH}/LICENSE")
  vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
else()
  # memscale has no LICENSE file yet: say so rather than invent one.
  message(WARNING "memscale: no LICENSE file in ${SOURCE_PATH}; the copyright file says so")
  file(WRITE "${CURRENT_PACKAGES_DIR}/share/${PORT}/copyright"
       "memscale ${VERSION}: no license has been published with these sources.\n")
endif()

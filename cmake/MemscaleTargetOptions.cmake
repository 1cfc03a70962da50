# Options shared by memscale's own targets (tests, examples, benchmarks):
# warnings, sanitizers, and one precompiled <torch/torch.h> they all reuse.
# Nothing here reaches users of the memscale target.
include_guard(GLOBAL)

function(memscale_target_options target)
  target_compile_options(${target} PRIVATE
    $<$<CXX_COMPILER_ID:GNU,Clang,AppleClang>:-Wall -Wextra -Wpedantic -Winvalid-pch>
    $<$<AND:$<BOOL:${MEMSCALE_WERROR}>,$<CXX_COMPILER_ID:GNU,Clang,AppleClang>>:-Werror>)
  if(MEMSCALE_SANITIZE)
    target_compile_options(${target} PRIVATE
      -fsanitize=${MEMSCALE_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all)
    target_link_options(${target} PRIVATE -fsanitize=${MEMSCALE_SANITIZE})
    # GCC's sanitizer instrumentation makes -Wmaybe-uninitialized misfire in libstdc++.
    target_compile_options(${target} PRIVATE $<$<CXX_COMPILER_ID:GNU>:-Wno-maybe-uninitialized>)
  endif()
endfunction()

# A tiny target that owns the precompiled header, so that building one example
# does not build the test suite just to get the PCH.
if(NOT TARGET memscale_torch_pch)
  set(_pch_source "${PROJECT_BINARY_DIR}/memscale_torch_pch.cpp")
  if(NOT EXISTS "${_pch_source}")
    file(WRITE "${_pch_source}" "// Owns memscale's precompiled <torch/torch.h>.\n")
  endif()
  add_library(memscale_torch_pch OBJECT "${_pch_source}")
  target_link_libraries(memscale_torch_pch PRIVATE memscale::memscale)
  memscale_target_options(memscale_torch_pch)
  target_precompile_headers(memscale_torch_pch PRIVATE <torch/torch.h>)
endif()

# Flags must match the PCH owner's, which memscale_target_options guarantees;
# -Winvalid-pch reports it if they ever drift.
function(memscale_use_torch_pch target)
  target_precompile_headers(${target} REUSE_FROM memscale_torch_pch)
endfunction()

# Programs (examples/, benchmarks/) that compile as one translation unit:
# memscale_program(<target> <source> [libraries...]) records one, and
# memscale_programs_unity(), at the end of the top-level CMakeLists.txt, makes
# them. Each source's main() is renamed <target>_main by the preprocessor and
# called from a one-line main of the target's own. Apart, the five programs
# instantiated and compiled the same LibTorch and memscale templates five times
# (249 s at -O3 on a 2-core Zen 5; together 63 s). Every program then holds all their
# code and runs only its own. MEMSCALE_UNITY_PROGRAMS=OFF compiles each on its
# own, for a quicker rebuild of one program (scripts/gpu-run.sh). A program
# someone builds alone first (train_gpt, scripts/run-example.sh) stays out,
# unless MEMSCALE_UNITY_TRAIN_GPT (CI, scripts/run-tests.sh, which builds them
# all): on CI's two cores train_gpt took 95 s alone at -O3, and added about 20 s
# to the others' unit.
option(MEMSCALE_UNITY_PROGRAMS "Compile the example and benchmark programs as one translation unit" ON)
option(MEMSCALE_UNITY_TRAIN_GPT "With MEMSCALE_UNITY_PROGRAMS, compile train_gpt in the programs' unit too" OFF)

function(memscale_program_options target)
  target_include_directories(${target} PRIVATE "${PROJECT_SOURCE_DIR}/examples")
  target_link_libraries(${target} PRIVATE memscale::memscale ${ARGN})
  if(TARGET memscale::cuda AND MEMSCALE_TORCH_HAS_CUDA)
    target_link_libraries(${target} PRIVATE memscale::cuda)  # the batched copies and the fused 8-bit step
  endif()
  memscale_target_options(${target})
endfunction()

function(memscale_program target source)
  get_filename_component(source "${source}" ABSOLUTE)
  if(NOT MEMSCALE_UNITY_PROGRAMS)
    add_executable(${target} "${source}")
    memscale_program_options(${target} ${ARGN})
    memscale_use_torch_pch(${target})
    return()
  endif()
  set(stub "${PROJECT_BINARY_DIR}/programs/${target}_main.cpp")
  file(CONFIGURE OUTPUT "${stub}" CONTENT
    "// Generated (cmake/MemscaleTargetOptions.cmake): the main() of ${source}, compiled in programs_unity.cpp.\nint ${target}_main(int argc, char** argv);\nint main(int argc, char** argv) { return ${target}_main(argc, argv); }\n")
  add_executable(${target} "${stub}")
  memscale_program_options(${target} ${ARGN})
  set_property(GLOBAL APPEND PROPERTY MEMSCALE_UNITY_PROGRAMS "${target}")
  set_property(GLOBAL PROPERTY "MEMSCALE_UNITY_PROGRAM_SOURCE_${target}" "${source}")
  set_property(GLOBAL APPEND PROPERTY MEMSCALE_UNITY_PROGRAM_LIBRARIES ${ARGN})
endfunction()

function(memscale_programs_unity)
  get_property(programs GLOBAL PROPERTY MEMSCALE_UNITY_PROGRAMS)
  if(NOT programs)
    return()
  endif()
  get_property(libraries GLOBAL PROPERTY MEMSCALE_UNITY_PROGRAM_LIBRARIES)
  if(libraries)
    list(REMOVE_DUPLICATES libraries)
  endif()
  set(unity "// Generated (cmake/MemscaleTargetOptions.cmake): memscale's programs as one translation unit.\n")
  foreach(target IN LISTS programs)
    get_property(source GLOBAL PROPERTY "MEMSCALE_UNITY_PROGRAM_SOURCE_${target}")
    string(APPEND unity "#define main ${target}_main\n#include \"${source}\"\n#undef main\n")
  endforeach()
  file(CONFIGURE OUTPUT "${PROJECT_BINARY_DIR}/programs/programs_unity.cpp" CONTENT "${unity}")
  add_library(memscale_programs OBJECT "${PROJECT_BINARY_DIR}/programs/programs_unity.cpp")
  memscale_program_options(memscale_programs ${libraries})
  memscale_use_torch_pch(memscale_programs)
  foreach(target IN LISTS programs)
    target_link_libraries(${target} PRIVATE memscale_programs ${libraries})
  endforeach()
endfunction()

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

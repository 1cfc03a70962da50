#!/usr/bin/env bash
# Usage: cmake/check_headers.sh <torch-include-root>
# Compiles every include/memscale/**/*.hpp on its own (syntax only, C++20)
# against the LibTorch headers under <torch-include-root>: proves each header is
# self-contained, and, pointed at LibTorch 2.x headers, that it builds there too.
# Then the same for the test, example and benchmark sources, which instantiate
# the templates (Function::apply, AnyModule, ...) that a header alone does not.
# Environment: CXX (g++), MEMSCALE_CHECK_JOBS (2), MEMSCALE_CHECK_FLAGS (extra
# flags, e.g. -Werror), MEMSCALE_THIRD_PARTY_DIR (vendored range-v3, nlohmann-json),
# MEMSCALE_CHECK_ONLY (an extended regex: check only the files it matches).
set -euo pipefail

if (($# != 1)) || [[ ! -d "$1/torch" ]]; then
  echo "usage: $0 <torch-include-root>   (a directory holding torch/, ATen/, c10/)" >&2
  exit 2
fi
torch_root=$(cd "$1" && pwd)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
third_party=${MEMSCALE_THIRD_PARTY_DIR:-$repo/third_party}

flags=(-std=c++20 -fsyntax-only -Wall -Wextra -Wpedantic -I "$repo/include" -I "$repo/examples")
# Re-adding a default system dir with -isystem breaks libstdc++'s #include_next.
case "$torch_root" in
  /usr/include | /usr/local/include) ;;
  *) flags+=(-isystem "$torch_root") ;;
esac
flags+=(-isystem "$torch_root/torch/csrc/api/include")
# Debian's 1.13 lacks dist-autograd's context.h, which c10d's reducer.hpp includes:
# memscale's stand-in, as the memscale::distributed target adds it (after the real one).
flags+=(-idirafter "$repo/include/memscale/distributed/c10d_shim")
for vendored in range-v3 nlohmann-json; do
  if [[ -d "$third_party/$vendored/include" ]]; then
    flags+=(-isystem "$third_party/$vendored/include")
  fi
done
read -r -a extra <<< "${MEMSCALE_CHECK_FLAGS:-}"
flags+=("${extra[@]}")

# With the CUDA Toolkit's headers present, also compile the CUDA paths
# (MEMSCALE_WITH_CUDA=1: allocator statistics, device queries, async offload
# copies, the kernel calls) syntax-only; without them, skip memscale/cuda/.
cuda_include=${CUDA_HOME:-/usr/local/cuda}/include
if [[ -f $cuda_include/cuda_runtime_api.h ]]; then
  mapfile -t headers < <(cd "$repo/include" && find memscale -name '*.hpp' | LC_ALL=C sort)
  headers+=("cuda:memscale/memscale.hpp")
else
  mapfile -t headers < <(cd "$repo/include" && find memscale -name '*.hpp' ! -path 'memscale/cuda/*' | LC_ALL=C sort)
fi
mapfile -t -O "${#headers[@]}" headers < <(cd "$repo" && find tests examples benchmarks -maxdepth 1 -name '*.cpp' \
                                             ! -name main.cpp | LC_ALL=C sort)
if [[ -n "${MEMSCALE_CHECK_ONLY:-}" ]]; then
  mapfile -t headers < <(printf '%s\n' "${headers[@]}" | grep -E -- "$MEMSCALE_CHECK_ONLY" || true)
fi
if ((${#headers[@]} == 0)); then
  echo "check-headers: no headers under $repo/include/memscale${MEMSCALE_CHECK_ONLY:+ matching $MEMSCALE_CHECK_ONLY}" >&2
  exit 1
fi
version=$(printf '#include <torch/version.h>\nTORCH_VERSION_MAJOR.TORCH_VERSION_MINOR.TORCH_VERSION_PATCH\n' \
          | "${CXX:-g++}" "${flags[@]/-fsyntax-only/-E}" -P -x c++ - 2>/dev/null | tail -n 1 | tr -d ' ' || true)
echo "check-headers: ${#headers[@]} headers and sources against LibTorch ${version:-?} in $torch_root"

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

check_one() {
  local header=$1 log start status
  log="$logs/$(echo "$header" | tr '/' '_').log"
  start=$SECONDS
  if [[ $header == cuda:* ]]; then
    # A CPU-only LibTorch lacks the generated CUDA macro header; a stand-in suffices for syntax.
    mkdir -p "$logs/cuda_stub/c10/cuda/impl"
    echo '#define C10_CUDA_BUILD_SHARED_LIBS' > "$logs/cuda_stub/c10/cuda/impl/cuda_cmake_macros.h"
    printf '#include <%s>\nint main() {\n  const c10::Device gpu("cuda:0");\n  (void)memscale::memory_tracker::current_bytes(gpu);\n  (void)memscale::memory_tracker::peak_bytes(gpu);\n  memscale::memory_tracker::reset_peak(gpu);\n  (void)memscale::detect_hardware();\n}\n' "${header#cuda:}" \
      | "${CXX:-g++}" "${flags[@]}" -DMEMSCALE_WITH_CUDA=1 -DMEMSCALE_WITH_CUDA_KERNELS=1 -idirafter "$logs/cuda_stub" -isystem "$cuda_include" \
          -x c++ - >"$log" 2>&1
  elif [[ $header == *.cpp ]]; then
    "${CXX:-g++}" "${flags[@]}" "$repo/$header" >"$log" 2>&1
  elif [[ $header == memscale/cuda/* ]]; then
    # The kernel target's C interface needs the CUDA Toolkit's headers (and nothing of LibTorch).
    printf '#include <%s>\n' "$header" | "${CXX:-g++}" "${flags[@]}" -isystem "$cuda_include" -x c++ - >"$log" 2>&1
  else
    printf '#include <%s>\n' "$header" | "${CXX:-g++}" "${flags[@]}" -x c++ - >"$log" 2>&1
  fi
  if (($? == 0)); then
    status=ok
    if [[ -s "$log" ]]; then status=warn; fi
  else
    status=FAIL
    touch "$log.failed"
  fi
  printf '  %-4s %3ss  %s\n' "$status" "$((SECONDS - start))" "$header"
}
# xargs runs check_one in child shells: hand them the function, the log dir and the flags.
flags_serialized=$(printf '%q ' "${flags[@]}")
export -f check_one
export logs CXX flags_serialized repo cuda_include

start=$SECONDS
# shellcheck disable=SC2016  # expanded by the child shell
printf '%s\0' "${headers[@]}" \
  | xargs -0 -n 1 -P "${MEMSCALE_CHECK_JOBS:-2}" \
      bash -c 'eval "flags=($flags_serialized)"; check_one "$1"' _

failed=0 warned=0
for header in "${headers[@]}"; do
  log="$logs/$(echo "$header" | tr '/' '_').log"
  if [[ -e "$log.failed" ]]; then
    failed=$((failed + 1))
  elif [[ -s "$log" ]]; then
    warned=$((warned + 1))
  else
    continue
  fi
  echo "--- $header:"
  head -n 60 "$log"
done
echo "check-headers: $((${#headers[@]} - failed))/${#headers[@]} files ok," \
     "$failed failed, $warned with warnings, LibTorch ${version:-?}, $((SECONDS - start))s"
((failed == 0))

#!/usr/bin/env bash
# Usage: cmake/check_headers.sh <torch-include-root>
# Compiles every include/memscale/**/*.hpp on its own (syntax only, C++20)
# against the LibTorch headers under <torch-include-root>: proves each header is
# self-contained, and, pointed at LibTorch 2.x headers, that it builds there too.
# Then the same for the test, example and benchmark sources, which instantiate
# the templates (Function::apply, AnyModule, ...) that a header alone does not.
#
# <torch/torch.h> is parsed once, into a precompiled header (GCC's .gch), and
# put in front of every header whose own includes reach <torch/torch.h> anyway
# (followed through memscale's headers; the sources all do): for those it adds
# nothing they do not include themselves, and it is about half of each one's
# time. Headers that do not reach it compile without it, as before. So a
# memscale header that uses LibTorch's API includes <torch/torch.h>, which every
# user's memscale.hpp brings anyway, rather than a part of it (<torch/nn/module.h>,
# ...): a part cost as much to parse as the precompiled whole costs to load (on
# CI's 2 cores, detail/modules.hpp took 17-27 s alone, 2 s in a chain behind
# it). Headers that need only c10's types (device/, predict/timeline.hpp) stay
# light: they compile in a few seconds without it.
# Headers are checked in chains, one translation unit per chain: each header
# is compiled with only headers it includes itself in front of it, which is
# what compiling it alone does (see "Chains" below); a chain that fails is
# checked again header by header. 89 headers make about 30 units.
# Environment: CXX (g++), MEMSCALE_CHECK_JOBS (2), MEMSCALE_CHECK_FLAGS (extra
# flags, e.g. -Werror), MEMSCALE_THIRD_PARTY_DIR (vendored range-v3, nlohmann-json,
# spdlog, fmt, cpp-httplib),
# MEMSCALE_CHECK_ONLY (an extended regex: check only the files it matches),
# MEMSCALE_CHECK_SOURCES (1; 0: headers only, for the LibTorch the build itself
# compiles the sources against, which checks them in full), MEMSCALE_CHECK_ALONE
# (all: every header on its own, the default; versioned: only the headers that
# do not reach <torch/torch.h> and those whose own text depends on LibTorch's
# version, see "A second LibTorch" below). GCC only for the precompiled header;
# with another compiler every file parses <torch/torch.h>.
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
for vendored in range-v3 nlohmann-json spdlog fmt cpp-httplib; do
  if [[ -d "$third_party/$vendored/include" ]]; then
    flags+=(-isystem "$third_party/$vendored/include")
  fi
done
[[ -d "$third_party/fmt/include" ]] && flags+=(-DFMT_HEADER_ONLY=1)
# The metrics endpoint's code compiles only with cpp-httplib: check it where it is.
if [[ -f "$third_party/cpp-httplib/include/httplib.h" ]]; then
  flags+=(-DMEMSCALE_WITH_HTTP=1)
elif command -v pkg-config > /dev/null && pkg-config --exists cpp-httplib; then
  read -r -a httplib_flags <<< "$(pkg-config --cflags cpp-httplib)"
  flags+=("${httplib_flags[@]}" -DMEMSCALE_WITH_HTTP=1)
fi
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
# The sources as one translation unit, "sources": the test files (no main() of
# their own) and the data parallel worker, then the programs the build compiles
# as one unit in CI (cmake/MemscaleTargetOptions.cmake: the examples, train_gpt
# among them, and the benchmarks), each main() renamed by the preprocessor as
# the build does. Each alone re-instantiated the same LibTorch and memscale
# templates, about 15 s each; together they take about two of them.
check_sources=1
if [[ ${MEMSCALE_CHECK_SOURCES:-1} != 0 ]]; then
  headers+=("sources")
else
  check_sources=0
fi
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
start=$SECONDS

# Whether a header's includes reach <torch/torch.h>: its own #include lines,
# then those of the memscale headers it includes, recursively (a conditional
# include counts; no include of <torch/torch.h> is conditional today).
declare -A reaches_torch=()
reaches() {  # reaches <memscale/...hpp>: sets reached=0/1
  local file=$1 line included
  if [[ -n "${reaches_torch[$file]:-}" ]]; then reached=${reaches_torch[$file]}; return; fi
  reaches_torch[$file]=0  # a cycle ends here
  while IFS= read -r line; do
    if [[ $line =~ ^[[:space:]]*#[[:space:]]*include[[:space:]]*\<torch/torch\.h\> ]]; then
      reaches_torch[$file]=1
      break
    fi
    if [[ $line =~ ^[[:space:]]*#[[:space:]]*include[[:space:]]*\<(memscale/[^>]+)\> ]]; then
      included=${BASH_REMATCH[1]}
      if [[ -f "$repo/include/$included" ]]; then
        reaches "$included"
        if ((reached)); then reaches_torch[$file]=1; break; fi
      fi
    fi
  done < "$repo/include/$file"
  reached=${reaches_torch[$file]}
}

use_pch=0
if "${CXX:-g++}" --version 2>/dev/null | grep -q 'Free Software Foundation'; then
  use_pch=1
  # GCC collects garbage less often with more memory: about a tenth less time.
  flags+=(--param ggc-min-expand=100 --param ggc-min-heapsize=1048576)
fi
# The work, one entry per translation unit, "pch:" in front of those compiled
# behind the precompiled header: the sources, memscale.hpp with CUDA, and every
# header that reaches <torch/torch.h>. Those without it come first, so that they
# run beside the precompiling.
plain=() behind=()
for header in "${headers[@]}"; do
  if [[ $header == memscale/cuda/* ]]; then
    plain+=("$header")  # the kernels' C interface: no LibTorch
  elif [[ $header == memscale/* ]]; then
    reaches "$header"
    if ((reached)); then behind+=("$header"); else plain+=("$header"); fi
  else
    behind+=("$header")
  fi
done
# Chains: a header is compiled with nothing in front of it but headers of its
# own include closure, so one translation unit checks a chain of them, each one
# included by the next (a in the closure of b): "#include <a>, #include <b>"
# checks b as it is checked alone, because b pulls a in anyway, before any code
# of its own (check_layers.sh keeps every #include above the first namespace).
# Built greedily, smallest closure first, each header going after the chain
# tail with the largest closure among those it includes. Headers that reach
# <torch/torch.h> and those that do not make separate chains (the precompiled
# header goes only in front of the former). A chain whose unit fails or warns is
# checked again header by header, so the report names the header.
declare -A closure=() closure_size=()
closure_of() {  # closure_of <memscale/...hpp>: sets closure[...] to " a b c " (memscale headers it includes, recursively, once each) and closure_size[...]
  local file=$1 line included member
  local -A seen=()
  [[ -n "${closure[$file]:-}" ]] && return
  closure[$file]=" " closure_size[$file]=0  # a cycle ends here
  while IFS= read -r line; do
    if [[ $line =~ ^[[:space:]]*#[[:space:]]*include[[:space:]]*\<(memscale/[^>]+)\> ]]; then
      included=${BASH_REMATCH[1]}
      [[ -f "$repo/include/$included" ]] || continue
      closure_of "$included"
      seen[$included]=1
      for member in ${closure[$included]}; do seen[$member]=1; done
    fi
  done < "$repo/include/$file"
  closure[$file]=" ${!seen[*]} " closure_size[$file]=${#seen[@]}
}
chains_of() {  # chains_of <headers...>: prints one chain per line, space-separated, bottom first
  local header tail best best_size size i
  local -a sorted=() chains=() tails=()
  for header in "$@"; do
    closure_of "$header"
    sorted+=("${closure_size[$header]} $header")
  done
  while read -r size header; do
    best=-1 best_size=-1
    for i in "${!tails[@]}"; do
      tail=${tails[$i]}
      if [[ "${closure[$header]}" == *" $tail "* ]] && ((closure_size[$tail] > best_size)); then
        best=$i best_size=${closure_size[$tail]}
      fi
    done
    if ((best >= 0)); then
      chains[best]+=" $header" tails[best]=$header
    else
      chains+=("$header") tails+=("$header")
    fi
  done < <(printf '%s\n' "${sorted[@]}" | LC_ALL=C sort -n -k1,1 -k2,2)
  printf '%s\n' "${chains[@]}"
}
# A second LibTorch (MEMSCALE_CHECK_ALONE=versioned, CI's 2.x run, after the
# 1.13 run has checked every header on its own): a header behind the
# precompiled header sees all of <torch/torch.h> in front of it, on either
# LibTorch, so whether its own includes suffice (memscale's, the standard
# library's) does not depend on the version, unless its own text does
# (TORCH_VERSION, __has_include). Those headers, and those that do not reach
# <torch/torch.h> (c10's parts, whose layout does change), are checked alone
# again; every other header compiles once, bottom-up in one unit with the
# sources, which is what "it builds there too" asks. Each unit behind the
# precompiled header costs about 9 s before its first line (LibTorch's
# deferred template instantiations), and the headers' closures overlap: on
# CI's two cores the 2.x run took 478 s header by header.
together=()
if [[ ${MEMSCALE_CHECK_ALONE:-all} == versioned ]]; then
  alone=()
  for header in "${behind[@]}"; do
    # MEMSCALE_HAS_C10D_REDUCER() and its kin (distributed/c10d.hpp) come of __has_include.
    if [[ $header != memscale/* ]] \
       || grep -qE 'TORCH_VERSION|__has_include|MEMSCALE_HAS_(C10D_REDUCER|GLOO|NCCL)' "$repo/include/$header"; then
      alone+=("$header")
    else
      closure_of "$header"
      together+=("${closure_size[$header]} $header")
    fi
  done
  behind=("${alone[@]}")
  # Bottom-up: a header's closure holds only headers of smaller closures.
  mapfile -t together < <(printf '%s\n' "${together[@]}" | LC_ALL=C sort -n -k1,1 -k2,2 | cut -d' ' -f2 | sed '/^$/d')
  if ((${#together[@]})) && [[ " ${behind[*]} " != *" sources "* ]]; then
    behind+=("sources")  # the unit the together headers compile in, here without the sources
    headers+=("sources")
    check_sources=0
  fi
elif [[ ${MEMSCALE_CHECK_ALONE:-all} != all ]]; then
  echo "check-headers: MEMSCALE_CHECK_ALONE is '$MEMSCALE_CHECK_ALONE'; valid: all, versioned" >&2
  exit 2
fi
plain_headers=() plain_other=() behind_headers=() behind_other=()
for header in "${plain[@]}"; do
  if [[ $header == memscale/* && $header != memscale/cuda/* ]]; then plain_headers+=("$header"); else plain_other+=("$header"); fi
done
for header in "${behind[@]}"; do
  if [[ $header == memscale/* ]]; then behind_headers+=("$header"); else behind_other+=("$header"); fi
done
# The sources (the largest units) first among those behind the precompiled
# header: the two workers then end at about the same time.
mapfile -t plain < <({ ((${#plain_headers[@]} == 0)) || chains_of "${plain_headers[@]}"
                       printf '%s\n' "${plain_other[@]}"; } | sed '/^$/d')
mapfile -t behind < <({ printf '%s\n' "${behind_other[@]}"
                        ((${#behind_headers[@]} == 0)) || chains_of "${behind_headers[@]}"; } | sed '/^$/d')
if ((use_pch)); then
  work=("${plain[@]}" "${behind[@]/#/pch:}")
else
  work=("${plain[@]}" "${behind[@]}")
fi

# The precompiled <torch/torch.h>, with the flags every check uses (GCC takes a
# .gch only when they match; -Winvalid-pch turns a mismatch into a warning). It
# is made in the background holding an exclusive lock, which each "pch:" entry
# waits on (shared) before it compiles.
flags+=(-Winvalid-pch)
if ((use_pch && ${#behind[@]})); then
  printf '#include <torch/torch.h>\n' > "$logs/torch_pch.hpp"
  pch_flags=()
  for flag in "${flags[@]}"; do [[ $flag == -fsyntax-only ]] || pch_flags+=("$flag"); done
  exec 9>"$logs/pch.lock"
  flock -x 9
  (
    pch_start=$SECONDS
    if "${CXX:-g++}" "${pch_flags[@]}" -x c++-header "$logs/torch_pch.hpp" -o "$logs/torch_pch.hpp.gch" \
         >"$logs/pch.log" 2>&1; then
      echo "check-headers: <torch/torch.h> precompiled in $((SECONDS - pch_start))s, for ${#behind[@]} of ${#work[@]} units"
    else
      touch "$logs/pch.failed"
      echo "check-headers: precompiling <torch/torch.h> failed:"
      head -n 60 "$logs/pch.log"
    fi
  ) 9>&9 &
  exec 9>&-  # the lock is the background job's now: released when it ends
fi

log_of() {  # log_of <header or unit name>: its log file; "<log>.done" and "<log>.failed" mark its result
  echo "$logs/$(echo "$1" | tr '/*' '_+').log"
}
check_one() {
  local header=$1 log start status pch=() member
  if [[ $header == *" "* ]]; then  # a chain: one unit, or header by header if it fails or warns
    local prefix="" members
    if [[ $header == pch:* ]]; then prefix=pch: header=${header#pch:}; fi
    read -r -a members <<< "$header"
    log="$logs/chain.$$.$RANDOM.log"
    start=$SECONDS
    if [[ -n $prefix ]]; then
      flock -s "$logs/pch.lock" true
      pch=(-include "$logs/torch_pch.hpp")
    fi
    if [[ ! -e "$logs/pch.failed" || -z $prefix ]] \
       && printf '#include <%s>\n' "${members[@]}" | "${CXX:-g++}" "${flags[@]}" "${pch[@]}" -x c++ - >"$log" 2>&1 \
       && [[ ! -s "$log" ]]; then
      for member in "${members[@]}"; do touch "$(log_of "$member").done"; done
      printf '  %-4s %3ss  %s (and %d it includes: %s)\n' ok "$((SECONDS - start))" "${members[-1]}" \
        "$((${#members[@]} - 1))" "$(printf '%s ' "${members[@]:0:${#members[@]}-1}" | sed 's|memscale/||g; s/ $//')"
    else
      for member in "${members[@]}"; do check_one "$prefix$member"; done
    fi
    return
  fi
  local unit_prefix=""  # how the together headers are checked alone, if the sources unit fails
  if [[ $header == pch:* ]]; then
    unit_prefix=pch:
    header=${header#pch:}
    flock -s "$logs/pch.lock" true
    pch=(-include "$logs/torch_pch.hpp")
  fi
  log=$(log_of "$header")
  touch "$log.done"
  start=$SECONDS
  if [[ -e "$logs/pch.failed" && ${#pch[@]} -gt 0 ]]; then
    echo "no precompiled <torch/torch.h> (see above)" >"$log"
    false
  elif [[ $header == cuda:* ]]; then
    # A CPU-only LibTorch lacks the generated CUDA macro header; a stand-in suffices for syntax.
    mkdir -p "$logs/cuda_stub/c10/cuda/impl"
    echo '#define C10_CUDA_BUILD_SHARED_LIBS' > "$logs/cuda_stub/c10/cuda/impl/cuda_cmake_macros.h"
    printf '#include <%s>\nint main() {\n  const c10::Device gpu("cuda:0");\n  (void)memscale::memory_tracker::current_bytes(gpu);\n  (void)memscale::memory_tracker::peak_bytes(gpu);\n  memscale::memory_tracker::reset_peak(gpu);\n  (void)memscale::detect_hardware();\n}\n' "${header#cuda:}" \
      | "${CXX:-g++}" "${flags[@]}" "${pch[@]}" -DMEMSCALE_WITH_CUDA=1 -DMEMSCALE_WITH_CUDA_KERNELS=1 \
          -idirafter "$logs/cuda_stub" -isystem "$cuda_include" -x c++ - >"$log" 2>&1
  elif [[ $header == sources ]]; then
    { printf '#include <%s>\n' "${together[@]}" | sed '/^#include <>$/d'
      ((check_sources)) || exit 0
      (cd "$repo" && { find tests -maxdepth 1 -name '*.cpp' ! -name main.cpp | LC_ALL=C sort
                       echo tests/distributed/worker.cpp; } \
         | sed "s|.*|#include \"$repo/&\"|")
      (cd "$repo" && { find examples -maxdepth 1 -name '*.cpp'
                       find benchmarks -name '*.cpp' ! -path 'benchmarks/studies/*'; } | LC_ALL=C sort \
         | awk -v repo="$repo" '{ printf "#define main memscale_check_main_%d\n#include \"%s/%s\"\n#undef main\n", NR, repo, $0 }')
    } | "${CXX:-g++}" "${flags[@]}" "${pch[@]}" -x c++ - >"$log" 2>&1
  elif [[ $header == memscale/cuda/* ]]; then
    # The kernel target's C interface needs the CUDA Toolkit's headers (and nothing of LibTorch).
    printf '#include <%s>\n' "$header" | "${CXX:-g++}" "${flags[@]}" -isystem "$cuda_include" -x c++ - >"$log" 2>&1
  else
    printf '#include <%s>\n' "$header" | "${CXX:-g++}" "${flags[@]}" "${pch[@]}" -x c++ - >"$log" 2>&1
  fi
  if (($? == 0)); then
    status=ok
    if [[ -s "$log" ]]; then status=warn; fi
  else
    status=FAIL
    touch "$log.failed"
  fi
  if [[ $header == sources ]] && ((${#together[@]})); then
    printf '  %-4s %3ss  %s\n' "$status" "$((SECONDS - start))" \
      "$( ((check_sources)) && echo 'sources, behind ')${#together[@]} headers together, bottom-up (not alone on this LibTorch)"
    # The together headers pass with the unit. Where it fails or warns, those the
    # compiler's messages point into are checked alone, so that the report names
    # them; a fault in a source leaves them passed, and "sources" failed.
    local named=" "
    if [[ $status != ok ]]; then
      named+=$(grep -oE "^$repo/include/memscale/[^:]+\.hpp:[0-9]+:([0-9]+:)? (error|warning)" "$log" \
                 | sed -E "s|^$repo/include/||; s|:.*||" | sort -u | tr '\n' ' ')
    fi
    for member in "${together[@]}"; do
      if [[ $named == *" $member "* ]]; then
        check_one "$unit_prefix$member"
      else
        touch "$(log_of "$member").done"
      fi
    done
    return
  fi
  printf '  %-4s %3ss  %s\n' "$status" "$((SECONDS - start))" "$header"
}
# xargs runs check_one in child shells: hand them the function, the log dir, the
# flags and the headers checked together.
flags_serialized=$(printf '%q ' "${flags[@]}")
together_serialized=""
((${#together[@]} == 0)) || together_serialized=$(printf '%q ' "${together[@]}")
export -f log_of check_one
export logs CXX flags_serialized together_serialized check_sources repo cuda_include

# shellcheck disable=SC2016  # expanded by the child shell
printf '%s\0' "${work[@]}" \
  | xargs -0 -n 1 -P "${MEMSCALE_CHECK_JOBS:-2}" \
      bash -c 'eval "flags=($flags_serialized)"; eval "together=($together_serialized)"; check_one "$1"' _
wait  # the precompiling, when no entry needed it

failed=0 warned=0
for header in "${headers[@]}"; do
  log=$(log_of "$header")
  if [[ ! -e "$log.done" ]]; then
    echo "not checked" > "$log"
    failed=$((failed + 1))
  elif [[ -e "$log.failed" ]]; then
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

#!/usr/bin/env bash
# Builds memscale and runs every check CI runs: the CTest suite (unit, static,
# compile-fail and consumer tests), the header self-containment check against
# LibTorch 1.13 (/usr/include) and 2.x (Debian unstable's headers), then the
# unit tests under AddressSanitizer + UndefinedBehaviorSanitizer and the
# threaded ones under ThreadSanitizer (the asan and tsan presets).
# MEMSCALE_SANITIZERS=0 leaves the sanitizer stages out.
#
# Stages that only compile run side by side, each with all cores (the kernel
# shares them): the header checks and the AddressSanitizer build beside the
# build, the ThreadSanitizer build beside the CTest tests that are compiles
# (labels consumer, package, compile_fail: ctest-compile). On CI's two cores
# each stage alone left a core idle at its tail (its last translation unit, its
# link, the precompiled header the others wait for). Stages that run tests run
# alone, as before: a plan measures compute rates, and what the tests check
# must not depend on a compile beside them. A stage run beside another prints its log when it ends;
# its time in the summary is its own, the stages overlapping.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

jobs=${MEMSCALE_JOBS:-$(nproc)}
failures=()
timings=()

record() {  # record <name> <seconds> <status>
  timings+=("$(printf '%-22s %4ss  %s' "$1" "$2" "$([[ $3 == 0 ]] && echo ok || echo "FAILED ($3)")")")
  if [[ $3 != 0 ]]; then failures+=("$1"); fi
}

stage() {  # stage <name> <command...>: runs it, records time, remembers failure
  local name=$1 start=$SECONDS status=0
  shift
  echo "=== $name"
  "$@" || status=$?
  record "$name" "$((SECONDS - start))" "$status"
  return 0
}

# Stages beside the one in the foreground: started with `beside`, their output
# kept in $side_logs/<name>.log and printed, and their result recorded, by `join`.
side_logs=$(mktemp -d)
trap 'rm -rf "$side_logs"' EXIT
declare -A side_pids=()
beside() {  # beside <name> <command...>
  local name=$1
  shift
  echo "=== $name (beside what follows; its log comes when it ends)"
  ( start=$SECONDS status=0
    "$@" > "$side_logs/$name.log" 2>&1 || status=$?
    echo "$((SECONDS - start)) $status" > "$side_logs/$name.result" ) &
  side_pids[$name]=$!
}
join() {  # join <name>: waits for a stage started with `beside`
  local name=$1 seconds status
  wait "${side_pids[$name]}" || true
  echo "=== $name"
  cat "$side_logs/$name.log"
  read -r seconds status < "$side_logs/$name.result" || { seconds=0 status=1; }
  record "$name" "$seconds" "$status"
}

summary() {
  echo "=== summary"
  printf '  %s\n' "${timings[@]}"
  if [[ -n "${ctest_summary:-}" ]]; then echo "  ctest: $ctest_summary"; fi
  if ((${#failures[@]})); then
    echo "FAILED: ${failures[*]}"
    exit 1
  fi
  echo "all checks passed"
}

# A sanitizer preset's unit tests: configure and build the test binary, then run it.
sanitized_build() {
  local preset=$1
  cmake --preset "$preset" >/dev/null &&
    cmake --build --preset "$preset" -j "$jobs" --target memscale_tests
}
# The sanitizer presets run each test process with one OpenMP and one OpenBLAS
# thread (CMakePresets.json): ctest runs one test per core, and a second thread
# per process only spun on a core the other test was using. Measured on CI's two
# cores (2026-11-27): the ASan tests took 219 s with LibTorch's default threads,
# 162 s with one; one file's test spent 38% of its CPU time in sched_yield.
sanitized_run() {
  ctest --preset "$1" -L unit -j "$jobs" --timeout 600
}

header_checks() {  # against 1.13, then 2.x
  local status=0
  # Against 1.13 every header on its own, and not the sources: the build
  # compiles every source against it in full, with the same warnings.
  echo "--- against LibTorch 1.13"
  MEMSCALE_CHECK_SOURCES=0 cmake/check_headers.sh /usr/include || status=$?
  # Against 2.x every header and source builds, and on its own each header whose
  # own text depends on LibTorch's version or that includes c10's parts rather
  # than <torch/torch.h> (cmake/check_headers.sh, "A second LibTorch"): the others'
  # own includes were checked against 1.13 with the same <torch/torch.h> in
  # front. Header by header, the 2.x run took 478 s on CI's two cores.
  if [[ -d .cache/libtorch2/root/usr/include/torch ]]; then  # else fetch-libtorch2 failed, and says so
    echo "--- against LibTorch 2.x"
    MEMSCALE_CHECK_ALONE=versioned cmake/check_headers.sh .cache/libtorch2/root/usr/include || status=$?
  fi
  return "$status"
}

# The CTest tests that only compile and run a small program (a consumer's
# build, the packages, the negative compile tests): 180 s of compiling on CI's
# two cores, nothing they check depends on a compile beside them, and they run
# beside the ThreadSanitizer build, which leaves a core idle at its tail. Two at
# a time (the negative compiles, which share the build tree, one after another):
# one at a time they took 415 s.
compile_labels='^(consumer|package|compile_fail)$'
run_ctest() {  # run_ctest <log name> <ctest arguments...>
  local log=build/$1.log status=0 line
  shift
  ctest --preset default "$@" 2>&1 | tee "$log" || status=$?
  line=$(grep -E 'tests passed, [0-9]+ tests? failed out of' "$log" | tail -n 1 || true)
  echo "$line" > "$log.summary"
  return "$status"
}
ctest_summaries() {  # the results of both CTest runs, once both have run
  local runs=0 failed=0 total=0 f line
  for f in build/ctest.log.summary build/ctest-compile.log.summary; do
    [[ -s $f ]] || continue
    read -r line < "$f"
    if [[ $line =~ ([0-9]+)\ tests?\ failed\ out\ of\ ([0-9]+) ]]; then
      runs=$((runs + 1)) failed=$((failed + BASH_REMATCH[1])) total=$((total + BASH_REMATCH[2]))
    fi
  done
  if ((runs)); then
    ctest_summary="$((total - failed)) of $total tests passed, $failed failed ($runs runs)"
  fi
}

total_start=$SECONDS
stage setup-deps ./scripts/setup-deps.sh --tests
stage fetch-libtorch2 cmake/fetch_libtorch2_headers.sh .cache/libtorch2
beside header-checks header_checks
# The AddressSanitizer build, whose one unit of test cases is the longest
# compile (about 200 CPU-s on CI's two cores), starts here too, beside the build
# and the header checks, rather than after the CTest tests beside the TSan build
# and the compile tests: there its unit compiled alone for the last 70 s, a core
# idle. Measured on a 2-CPU VM, a clean clone each: 918 s before, 825 s after.
if [[ ${MEMSCALE_SANITIZERS:-1} != 0 ]]; then beside asan-build sanitized_build asan; fi
# -Werror: memscale's own targets (every header, instantiated by the tests,
# examples and benchmarks) compile at -O3 without a warning. train_gpt compiles
# in the programs' one unit (cmake/MemscaleTargetOptions.cmake).
stage configure cmake --preset default -DMEMSCALE_WERROR=ON -DMEMSCALE_UNITY_TRAIN_GPT=ON
if [[ ! " ${failures[*]} " =~ " "(setup-deps|configure)" " ]]; then stage build cmake --build --preset default -j "$jobs"; fi
join header-checks
if [[ ${MEMSCALE_SANITIZERS:-1} != 0 ]]; then join asan-build; fi
if [[ " ${failures[*]} " =~ " "(setup-deps|configure|build)" " ]]; then summary; fi

# Debian's OpenBLAS (0.3.21) picks its kernels by CPU model, and on a CPU it
# does not know falls back to its generic SSE3 ones ("Prescott"): CI's Xeon is
# such a CPU (memscale::blas_advice says so to a user). As the README advises,
# the tests run with the kernels for the CPU's instruction set, unless the
# environment names some already. The generic cores and the choice are
# blas_advice's (include/memscale/device/hardware.hpp): change both together;
# SkylakeX is asked here only with the AVX-512 subsets its kernels use. Measured on CI's two cores (2026-11-27): a
# third of one file's ASan test time was Prescott's sgemm; the ASan tests took
# 162 s with it, 133 s with SkylakeX's kernels.
blas_core_for_tests() {
  local core flags
  [[ -z ${OPENBLAS_CORETYPE:-} && -x build/tests/memscale_tests ]] || return 0
  core=$(OPENBLAS_VERBOSE=2 build/tests/memscale_tests --list-tags 2>&1 >/dev/null | sed -n 's/^Core: //p' | head -n 1 || true)
  case $core in Prescott | Core2 | Penryn | Nehalem | Dunnington | Atom) ;; *) return 0 ;; esac
  flags=" $(grep -m 1 '^flags' /proc/cpuinfo 2>/dev/null) "
  if [[ $flags == *" avx512f "* && $flags == *" avx512bw "* && $flags == *" avx512vl "* && $flags == *" avx512dq "* ]]; then
    export OPENBLAS_CORETYPE=SkylakeX
  elif [[ $flags == *" avx2 "* && $flags == *" fma "* ]]; then
    export OPENBLAS_CORETYPE=Haswell
  else
    return 0
  fi
  echo "=== OpenBLAS runs its generic '$core' kernels on this CPU: the tests run with OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE"
}
blas_core_for_tests

rm -f build/ctest.log.summary build/ctest-compile.log.summary
stage ctest run_ctest ctest -j "$jobs" -LE "$compile_labels"
if [[ ${MEMSCALE_SANITIZERS:-1} != 0 ]]; then
  beside ctest-compile run_ctest ctest-compile -j "$jobs" -L "$compile_labels"
  stage tsan-build sanitized_build tsan
  join ctest-compile
  if [[ ! " ${failures[*]} " =~ " asan-build " ]]; then stage asan-ubsan sanitized_run asan; fi
  if [[ ! " ${failures[*]} " =~ " tsan-build " ]]; then stage tsan sanitized_run tsan; fi
else
  stage ctest-compile run_ctest ctest-compile -j "$jobs" -L "$compile_labels"
fi
ctest_summaries
timings+=("$(printf '%-22s %4ss' total "$((SECONDS - total_start))")")
summary

#!/usr/bin/env bash
# Builds memscale and runs every check CI runs: the CTest suite (unit, static,
# compile-fail and consumer tests), the header self-containment check against
# LibTorch 1.13 (/usr/include) and 2.x (Debian unstable's headers), then the
# unit tests under AddressSanitizer + UndefinedBehaviorSanitizer and the
# threaded ones under ThreadSanitizer (the asan and tsan presets).
# MEMSCALE_SANITIZERS=0 leaves the sanitizer stages out.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

jobs=${MEMSCALE_JOBS:-$(nproc)}
failures=()
timings=()

stage() {  # stage <name> <command...>: runs it, records time, remembers failure
  local name=$1 start=$SECONDS status=0
  shift
  echo "=== $name"
  "$@" || status=$?
  timings+=("$(printf '%-22s %4ss  %s' "$name" "$((SECONDS - start))" \
               "$([[ $status == 0 ]] && echo ok || echo "FAILED ($status)")")")
  if [[ $status != 0 ]]; then failures+=("$name"); fi
  return 0
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

# A sanitizer preset's unit tests: configure, build the test binary, run it.
sanitized() {
  local preset=$1
  cmake --preset "$preset" >/dev/null &&
    cmake --build --preset "$preset" -j "$jobs" --target memscale_tests &&
    ctest --preset "$preset" -L unit -j "$jobs" --timeout 600
}

run_ctest() {
  local log=build/ctest.log status=0
  ctest --preset default -j "$jobs" 2>&1 | tee "$log" || status=$?
  ctest_summary=$(grep -E 'tests passed, [0-9]+ tests? failed out of' "$log" | tail -n 1 || true)
  return "$status"
}

stage setup-deps ./scripts/setup-deps.sh --tests
stage configure cmake --preset default
if ((${#failures[@]} == 0)); then stage build cmake --build --preset default -j "$jobs"; fi
if ((${#failures[@]})); then summary; fi

stage ctest run_ctest
# Against 1.13 the headers only: the build compiled every source against it in
# full, with the same warnings.
stage headers-libtorch1 env MEMSCALE_CHECK_SOURCES=0 cmake/check_headers.sh /usr/include
stage fetch-libtorch2 cmake/fetch_libtorch2_headers.sh .cache/libtorch2
if [[ -d .cache/libtorch2/root/usr/include/torch ]]; then
  stage headers-libtorch2 cmake/check_headers.sh .cache/libtorch2/root/usr/include
fi
if [[ ${MEMSCALE_SANITIZERS:-1} != 0 ]]; then
  stage asan-ubsan sanitized asan
  stage tsan sanitized tsan
fi
summary

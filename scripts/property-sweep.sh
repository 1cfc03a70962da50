#!/usr/bin/env bash
# The full randomized-equality sweep (tests/test_property.cpp): N random
# models and technique combinations (default 250) from a fresh seed, each
# trained with and without memscale and compared. CI runs a fixed-seed subset of
# 40; a failing case prints the seed that replays it alone.
#   scripts/property-sweep.sh [CASES] [SEED]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cases=${1:-250}
seed=${2:-$(date +%s)}
[[ -f build/CMakeCache.txt ]] || cmake --preset default >/dev/null
cmake --build build -j "$(nproc)" --target memscale_tests >/dev/null
torch_version=$(dpkg-query -W -f='${Version}' libtorch-dev 2>/dev/null || true)
echo "property sweep: seed $seed, $cases cases, LibTorch ${torch_version:-(version not found)}"
MEMSCALE_PROPERTY_SEED=$seed MEMSCALE_PROPERTY_CASES=$cases ./build/tests/memscale_tests "[property]"

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
if [[ ! -x build/tests/memscale_tests ]]; then
  cmake --preset default >/dev/null
  cmake --build build -j "$(nproc)" --target memscale_tests
fi
torch_version=$(grep -ho 'TORCH_VERSION "[^"]*"' /usr/include/torch/csrc/api/include/torch/version.h 2>/dev/null | cut -d'"' -f2 || true)
echo "property sweep: seed $seed, $cases cases, LibTorch ${torch_version:-(version not found)}"
MEMSCALE_PROPERTY_SEED=$seed MEMSCALE_PROPERTY_CASES=$cases ./build/tests/memscale_tests "[property]"

#!/usr/bin/env bash
# Builds only the train_gpt example and runs it: scripts/run-example.sh [args...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

./scripts/setup-deps.sh
cmake --preset default
cmake --build --preset default -j "${MEMSCALE_JOBS:-$(nproc)}" --target train_gpt
exec ./build/examples/train_gpt "$@"

#!/usr/bin/env bash
# Regenerates Stage 1's trained policy in one command: measures the corpus
# (benchmarks/policy/dataset.csv: every candidate strategy's measured peak and
# step time for generated models under several budgets; about 15 minutes on 2
# cores, and its step times are the labels, so run it on an otherwise idle
# machine), fits the policy, and writes the artifact
# (benchmarks/policy/artifact.txt), the header that ships it
# (include/memscale/policy/shipped_artifact.hpp) and the evaluation
# (benchmarks/policy/evaluation.md).
#   scripts/regenerate-policy.sh [--train-only]   (--train-only: keep the dataset, refit)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

./scripts/setup-deps.sh
cmake --preset default
cmake --build --preset default -j "${MEMSCALE_JOBS:-$(nproc)}" --target memscale_policy
if [[ "${1:-}" != "--train-only" ]]; then
  ./build/benchmarks/memscale_policy corpus --out benchmarks/policy/dataset.csv
fi
./build/benchmarks/memscale_policy train

// The data parallel test job, shared by its ranks (worker.cpp) and the test that
// launches them (test_distributed.cpp): the models (a Sequential, and the example
// GPT, whose blocks are call-site units), each rank's batches, and each run's Config.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/config.hpp>

#include "gpt.hpp"

namespace dp_job {

inline constexpr std::int64_t width = 32;
inline constexpr int steps = 4;
inline constexpr int slots = 15;  ///< of make_model without the extra slot

/// (Linear, GELU, Linear, LayerNorm, Dropout) x 3, initialized differently on
/// each rank: only DataParallel's broadcast makes the ranks start alike.
inline torch::nn::Sequential make_model(int rank, bool extra_slot = false) {
  torch::manual_seed(100 + static_cast<std::uint64_t>(rank));
  torch::nn::Sequential seq;
  for (int block = 0; block < 3; ++block) {
    seq->push_back(torch::nn::Linear(width, 3 * width));
    seq->push_back(torch::nn::GELU());
    seq->push_back(torch::nn::Linear(3 * width, width));
    seq->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    seq->push_back(torch::nn::Dropout(0.1));
  }
  if (extra_slot) seq->push_back(torch::nn::Identity());
  return seq;
}

/// Each rank's own batches (input, target), the same in every run.
inline std::vector<std::pair<torch::Tensor, torch::Tensor>> batches_of(int rank) {
  torch::manual_seed(1000 + static_cast<std::uint64_t>(rank));
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int s = 0; s < steps; ++s) batches.emplace_back(torch::randn({16, 8, width}), torch::randn({16, 8, width}));
  return batches;
}

/// A small example GPT (4 blocks of width 32), initialized per rank like make_model.
inline gpt::GPT make_gpt(int rank) {
  torch::manual_seed(200 + static_cast<std::uint64_t>(rank));
  return gpt::GPT(gpt::Options{.context = 16, .d_model = 32, .heads = 4, .layers = 4, .dropout = 0.1});
}

/// Each rank's own token batches (input, next tokens) for make_gpt.
inline std::vector<std::pair<torch::Tensor, torch::Tensor>> token_batches_of(int rank) {
  torch::manual_seed(2000 + static_cast<std::uint64_t>(rank));
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int s = 0; s < steps; ++s)
    batches.emplace_back(torch::randint(0, 256, {4, 16}, torch::kInt64), torch::randint(0, 256, {4, 16}, torch::kInt64));
  return batches;
}

/// The runs of the "train" scenario, each from the same start. Compare each
/// memscale run with the baseline of its model.
enum class run { baseline, checkpoint, offload, gpt_baseline, gpt_checkpoint };
inline constexpr run runs[] = {run::baseline, run::checkpoint, run::offload, run::gpt_baseline, run::gpt_checkpoint};

inline std::string name_of(run r) {
  switch (r) {
    case run::baseline: return "baseline";
    case run::checkpoint: return "checkpoint";
    case run::offload: return "offload";
    case run::gpt_baseline: return "gpt_baseline";
    case run::gpt_checkpoint: return "gpt_checkpoint";
  }
  return "?";
}

inline bool uses_gpt(run r) { return r == run::gpt_baseline || r == run::gpt_checkpoint; }
inline bool uses_memscale(run r) { return r != run::baseline && r != run::gpt_baseline; }
inline run baseline_of(run r) { return uses_gpt(r) ? run::gpt_baseline : run::baseline; }

/// checkpoint: rank 0 plans for about 1 KiB (checkpoint all it can); rank 1's
/// own Config (no budget, no force) would plan nothing, so it checkpoints only
/// by applying rank 0's plan. offload: every saved activation to disk under `scratch`.
/// gpt_checkpoint: Aggressive, checkpointing only.
inline memscale::Config config_for(run r, int rank, const std::filesystem::path& scratch) {
  memscale::Config c;
  c.enable_logging = false;
  if (r == run::checkpoint) {
    c.enable_offloading = false;
    if (rank == 0) {
      c.force_optimize = true;
      c.memory_budget_gb = 1e-6;
    }
  } else if (r == run::gpt_checkpoint) {
    c.mode = memscale::OptimizationMode::Aggressive;
    c.enable_offloading = false;
  } else if (r == run::offload) {
    c.mode = memscale::OptimizationMode::Aggressive;
    c.enable_checkpointing = false;
    memscale::AsyncOffloadConfig offload;
    offload.min_offload_kb = 0;  // these activations are small; offload them all
    offload.disk_dir = scratch.string();
    c.async_config = offload;
  }
  return c;
}

}  // namespace dp_job

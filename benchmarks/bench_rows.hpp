// memscale benchmark (bench_memscale.cpp), the rows a workload runs: the modes
// (Conservative, Balanced at a budget, Aggressive, Balanced forced), Balanced at the
// hand-placed row's peak, and the offload rows.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <memscale/memscale.hpp>

namespace bench {

/// The memscale rows of a workload, given the Balanced budget (GB) derived from the baseline.
using row_configs = std::function<std::vector<std::pair<std::string, memscale::Config>>(double)>;

/// A memscale row's Config: `mode`, logging off (the harness prints the plans it needs).
inline memscale::Config quiet_config(memscale::OptimizationMode mode) {
  memscale::Config cfg;
  cfg.enable_logging = false;
  cfg.mode = mode;
  return cfg;
}

/// Conservative (no budget), Balanced (the 60% budget), Aggressive, and Balanced
/// with force_optimize and no budget.
inline std::vector<std::pair<std::string, memscale::Config>> mode_rows(double balanced_budget_gb) {
  std::vector<std::pair<std::string, memscale::Config>> rows;
  for (auto mode : {memscale::OptimizationMode::Conservative, memscale::OptimizationMode::Balanced,
                    memscale::OptimizationMode::Aggressive}) {
    auto cfg = quiet_config(mode);
    if (mode == memscale::OptimizationMode::Balanced) cfg.memory_budget_gb = balanced_budget_gb;
    rows.emplace_back(std::string(memscale::to_string(mode)), cfg);
  }
  // Balanced forced with no budget, where nothing presses: the light touch.
  auto forced = quiet_config(memscale::OptimizationMode::Balanced);
  forced.force_optimize = true;
  rows.emplace_back("Balanced forced", forced);
  return rows;
}

/// mode_rows, then Aggressive and Balanced forced with Config::replay_random_draws
/// off: their recomputes draw the Dropout masks again, as before 2026-11-26 (what
/// replaying them buys, side by side); and Balanced and Balanced forced with
/// Config::selective_recompute off: their checkpoints recompute the matrix
/// products too, as before 2026-11-27 (what keeping them buys); and the same two
/// with Config::pack_saved_masks, recompute_saved_outputs and pack_saved_zeros off: the
/// slots the plan leaves in place keep their saved tensors as they are, as before
/// 2026-11-27 (what compacting them buys); and Balanced forced with only
/// recompute_saved_outputs off: masks as bits, outputs kept (what computing
/// them again buys, as of 2026-11-27); and Balanced forced with only
/// pack_saved_zeros off: rows' +0 tails kept (what dropping them buys).
inline const std::string drawn_again_suffix = ", masks drawn again";
inline const std::string async_suffix = ", async offload";
inline const std::string all_recomputed_suffix = ", products recomputed";
inline const std::string saved_as_is_suffix = ", saved as they are";
inline const std::string outputs_kept_suffix = ", outputs kept";
inline const std::string zeros_kept_suffix = ", zeros kept";
inline std::vector<std::pair<std::string, memscale::Config>> mode_rows_and_variants(double balanced_budget_gb) {
  auto rows = mode_rows(balanced_budget_gb);
  const auto modes = rows;
  for (auto [name, cfg] : modes)
    if (name == "Aggressive" || name == "Balanced forced") {
      cfg.replay_random_draws = false;
      rows.emplace_back(name + drawn_again_suffix, cfg);
    }
  for (auto [name, cfg] : modes)
    if (name == "Aggressive") {
      cfg.async_offload = true;
      rows.emplace_back(name + async_suffix, cfg);
    }
  for (auto [name, cfg] : modes)
    if (name == "Balanced" || name == "Balanced forced") {
      cfg.selective_recompute = false;
      rows.emplace_back(name + all_recomputed_suffix, cfg);
    }
  for (auto [name, cfg] : modes)
    if (name == "Balanced" || name == "Balanced forced") {
      cfg.pack_saved_masks = false;
      cfg.recompute_saved_outputs = false;
      cfg.pack_saved_zeros = false;
      rows.emplace_back(name + saved_as_is_suffix, cfg);
    }
  for (auto [name, cfg] : modes)
    if (name == "Balanced forced") {
      auto outputs_kept = cfg;
      outputs_kept.recompute_saved_outputs = false;
      rows.emplace_back(name + outputs_kept_suffix, outputs_kept);
      cfg.pack_saved_zeros = false;
      rows.emplace_back(name + zeros_kept_suffix, cfg);
    }
  return rows;
}

/// Balanced planned at the hand-placed row's memory: all of the budget usable, and
/// `budget_gb` set (run_workload) so that Balanced's target, its fraction of that,
/// is the hand row's measured total (resident + a step's growth). Both are the
/// allocator's share, so the row plans with no reserve outside the allocator (a
/// process-wide figure, noisy by MiB here): the two compare on time at equal memory.
inline const std::string at_hand_row = "Balanced at hand peak";
inline memscale::Config at_hand_config(double budget_gb) {
  auto cfg = quiet_config(memscale::OptimizationMode::Balanced);
  cfg.memory_budget_gb = budget_gb;
  cfg.target_gpu_utilization = 1.0;
  return cfg;
}

/// The offload rows: Aggressive with checkpointing only, offloading only
/// (synchronous and async), and both.
inline std::vector<std::pair<std::string, memscale::Config>> offload_rows(double) {
  auto cfg = quiet_config(memscale::OptimizationMode::Aggressive);
  std::vector<std::pair<std::string, memscale::Config>> rows;
  auto checkpoint = cfg;
  checkpoint.enable_offloading = false;
  rows.emplace_back("checkpoint", checkpoint);
  auto offload = cfg;
  offload.enable_checkpointing = false;
  rows.emplace_back("offload sync", offload);
  offload.async_offload = true;
  rows.emplace_back("offload async", offload);
  auto both = cfg;
  both.async_offload = true;
  rows.emplace_back("ckpt+offload async", both);
  return rows;
}

}  // namespace bench

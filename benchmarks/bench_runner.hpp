// memscale benchmark (bench_memscale.cpp), the measurement: one Runner per row
// trains its own identically seeded model on the same batches, the rows taking
// turns step by step; each step's peak growth (tracker and process), time and
// loss are kept, and the optimal-DP yardstick set beside a memscale row's plan.
// Also run_workload, which builds a workload's rows (bench_rows.hpp; and a row that
// checkpoints each block by hand where the workload gives one) and runs them.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <memscale/core/memory_model.hpp>
#include <memscale/core/optimal_chain.hpp>
#include <memscale/memscale.hpp>

#include "bench_common.hpp"
#include "rng_stream.hpp"
#include "bench_rows.hpp"

namespace bench {

// --- measurement --------------------------------------------------------------------

struct Sample {
  torch::Tensor input, target;
};

struct RowResult {
  std::string name;
  bool memscale = false;
  bool exact_expected = true;  ///< false where the row changes the arithmetic (tiling, bf16, 8-bit state)
  std::optional<memscale::Report> report;
  std::optional<double> budget_gb;
  // memory, bytes
  double growth = 0.0;              ///< median peak growth of the measured steps
  double total_peak = 0.0;          ///< resident bytes of the row (model, gradients, AdamW) + growth
  std::int64_t first_growth = 0;    ///< warm-up step; for memscale rows, planning included
  std::int64_t planning_growth = 0; ///< optimize() alone
  // time, seconds
  double step_seconds = 0.0;
  std::vector<double> step_series;  ///< every measured step, in round order (round k of every row pairs)
  double first_seconds = 0.0;  ///< warm-up step (+ planning for memscale rows)
  double planning_seconds = 0.0;
  std::vector<float> losses;
  bool detached = true;
  // optimal-DP yardstick (projected seconds, summed over chains)
  double rule_recompute = 0.0;
  double dp_recompute = 0.0;
  bool dp_feasible = true;
  std::int64_t rule_peak = 0;  ///< projected chain peak of the rule plan (the DP's budget)
  std::int64_t dp_peak = 0;    ///< projected chain peak of the DP plan
  std::optional<memscale::offload::engine_stats> offload;  ///< the offload engine's totals over all steps
  int steps = 0;
  // what the process holds (medians; -1 where /proc/self cannot say)
  double process_growth = -1.0;  ///< a step's resident peak over its start
  double process_total = -1.0;   ///< a step's resident peak over the process before the model was built
};

/// A DP budget rounded up to a multiple of the bucket count: optimal_segmentation
/// indexes past its table when live bytes fall in a last, partial bucket
/// (levels = budget / quantum + 1 truncates), so the harness never makes one.
inline std::int64_t dp_budget(std::int64_t bytes) { return (bytes + dp_buckets - 1) / dp_buckets * dp_buckets; }

/// Whether a row's plan uses more than checkpointing (the DP knows only that).
inline bool beyond_checkpointing(const RowResult& row) {
  return row.report && (row.report->offloaded_units() > 0 || row.report->tiled_segments() > 0);
}

/// The optimal-DP yardstick for a memscale row's plan (projected figures). The
/// DP knows checkpointing only: plans that offload or tile get no yardstick.
inline void add_yardstick(RowResult& row) {
  if (!row.report || beyond_checkpointing(row)) return;
  const auto& r = *row.report;
  for (std::size_t c = 0; c < r.chains.size() && c < r.plan.units.size(); ++c) {
    const auto& slots = r.chains[c].slots;
    const auto& units = r.plan.units[c];
    const auto rule_peak = memscale::core::project_chain(slots, units).peak;
    // The DP rounds live bytes up to budget / buckets, once per unit: at a budget of
    // exactly rule_peak it can reject the rule plan itself. Give it that rounding as
    // slack (at most n quanta, n / buckets of the budget), so every plan within
    // rule_peak is feasible for it; its plan's exact peak is reported beside it.
    const auto n = static_cast<std::int64_t>(slots.size());
    const auto budget = dp_budget((rule_peak * dp_buckets + (dp_buckets - n - 2)) / (dp_buckets - n - 1));
    const auto dp = memscale::core::optimal_segmentation(slots, budget, static_cast<int>(dp_buckets));
    row.rule_recompute += memscale::core::recompute_seconds(slots, units);
    row.rule_peak += rule_peak;
    if (dp.feasible) {
      row.dp_recompute += dp.recompute_seconds;
      row.dp_peak += dp.peak;
    } else {
      row.dp_feasible = false;
    }
  }
}

/// One row: a fresh model (seeded identically for every row), its AdamW, its
/// memscale guard (unless baseline) and its own copy of the CPU RNG stream, so rows
/// can take turns step by step and still each see the baseline's dropout masks.
template <class Model>
class Runner {
 public:
  using loss_fn = std::function<torch::Tensor(Model&, const Sample&)>;

  /// Builds the model, plans (memscale rows), then runs the warm-up step and one
  /// calibration step, both unmeasured for the medians.
  Runner(std::string name, const std::function<Model()>& make_model, loss_fn loss_of,
         const std::vector<Sample>& data, const std::optional<memscale::Config>& config)
      : loss_of_(std::move(loss_of)), data_(data) {
    row.name = std::move(name);
    row.memscale = config.has_value();
    if (config) {
      row.budget_gb = config->memory_budget_gb;
      autocast_ = config->use_mixed_precision;
    }
    const auto live_before_model = memscale::memory_tracker::current_bytes();
    if (const auto m = memscale::detail::read_process_memory()) process_base_ = m->resident_bytes;
    torch::manual_seed(init_seed);
    model_ = make_model();
    model_->train();
    memscale::optimizer_options adamw;
    adamw.lr = learning_rate;
    optimizer_ = memscale::make_optimizer(config.value_or(memscale::Config{}), model_->parameters(), adamw);
    torch::manual_seed(train_seed);
    rng_ = run_rng::stream{};
    {
      // Warm-up step; its scope opens before planning so that it includes it.
      memscale::memory_tracker::peak_scope first;
      const auto start = clock_type::now();
      if (config) {
        // Rows take turns on one thread, so a row opens autocast around its own
        // steps (as the guard would for its lifetime) rather than through the guard.
        auto planned = *config;
        planned.use_mixed_precision = false;
        guard_.emplace(memscale::optimize(model_, data_.front().input, planned));
        row.planning_seconds = std::chrono::duration<double>(clock_type::now() - start).count();
        row.planning_growth = first.peak_growth();
        row.report = guard_->report();
        // Tiling (where the plan tiles), bf16 and 8-bit state change the arithmetic.
        row.exact_expected = row.report->tiled_segments() == 0 && !config->use_mixed_precision &&
                             !config->use_8bit_optimizer;
      }
      row.losses.push_back(step());
      row.first_seconds = std::chrono::duration<double>(clock_type::now() - start).count();
      row.first_growth = first.peak_growth();
    }
    {
      memscale::memory_tracker::peak_scope calibration;
      row.losses.push_back(step());
      calibration_growth = calibration.peak_growth();
    }
    resident = memscale::memory_tracker::current_bytes() - live_before_model;
  }

  /// A row's turn: two steps, the second measured. It starts from the heap its own
  /// row's step left, as in a training loop, not from a row of smaller peak (whose
  /// follower paid the faults of growing the heap back: RESULTS.md). Both losses
  /// are kept: every row takes the same steps.
  void take_turn() {
    row.losses.push_back(step());
    measure();
  }

 private:
  /// One measured step.
  void measure() {
    memscale::memory_tracker::process_peak_scope process;
    memscale::memory_tracker::peak_scope scope;
    const auto start = clock_type::now();
    row.losses.push_back(step());
    seconds_.push_back(std::chrono::duration<double>(clock_type::now() - start).count());
    growth_.push_back(scope.peak_growth());
    if (process.active() && process_base_ >= 0) {
      process_growth_.push_back(process.peak_growth());
      process_total_.push_back(process.peak() - process_base_);
    }
  }

 public:
  /// Medians, detach, yardstick.
  RowResult finish() {
    if (guard_) row.offload = guard_->offload_stats();
    row.steps = steps_taken_;
    row.growth = median(growth_);
    row.total_peak = static_cast<double>(resident) + row.growth;
    row.step_seconds = median(seconds_);
    row.step_series = seconds_;
    if (!process_total_.empty()) {
      row.process_growth = median(process_growth_);
      row.process_total = median(process_total_);
    }
    guard_.reset();
    row.detached = !memscale::is_optimized(model_);
    add_yardstick(row);
    return row;
  }

  RowResult row;
  std::int64_t calibration_growth = 0;
  std::int64_t resident = 0;  ///< live bytes the row keeps between steps (parameters, gradients, AdamW state)

 private:
  float step() {
    return rng_.run([&] {  // the row's own dropout masks, whichever row stepped before
      const auto& sample = data_[static_cast<std::size_t>(steps_taken_++) % data_.size()];
      optimizer_->zero_grad();
      torch::Tensor loss;
      {
        std::optional<memscale::autocast_scope> bf16;
        if (autocast_) bf16.emplace(c10::kCPU);
        loss = loss_of_(model_, sample);
        loss.backward();
      }
      optimizer_->step();
      return loss.item<float>();
    });
  }

  loss_fn loss_of_;
  const std::vector<Sample>& data_;
  Model model_{nullptr};
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  bool autocast_ = false;
  std::optional<memscale::OptimizationGuard> guard_;
  run_rng::stream rng_;
  int steps_taken_ = 0;
  std::vector<std::int64_t> growth_;
  std::vector<double> seconds_;
  std::int64_t process_base_ = -1;  ///< resident bytes before the model was built
  std::vector<std::int64_t> process_growth_, process_total_;
};

struct Workload {
  std::string title;
  std::string description;
  std::vector<RowResult> rows;
  double baseline_total = 0.0;
  double balanced_budget_gb = 0.0;
  double at_hand_budget_gb = 0.0;  ///< the "Balanced at hand peak" row's budget (0: no hand-placed row)
  std::int64_t dp_min_peak = 0;  ///< lowest projected chain peak the DP reaches (single-chain workloads)
};

/// The lowest projected peak any one-level segmentation of `slots` reaches (to
/// 0.1%), by bisection on the DP's budget; 0 when `slots` is empty.
inline std::int64_t dp_min_peak(const std::vector<memscale::slot_cost>& slots) {
  if (slots.empty()) return 0;
  std::int64_t hi = memscale::core::project_chain(slots, memscale::core::keep_all(slots.size())).peak;
  std::int64_t lo = 0, best = hi;
  while (hi - lo > hi / 1000 + 1) {
    const auto mid = dp_budget(lo + (hi - lo) / 2);
    if (mid >= hi) break;
    const auto dp = memscale::core::optimal_segmentation(slots, mid, static_cast<int>(dp_buckets));
    if (dp.feasible) {
      hi = mid;
      best = std::min(best, dp.peak);
    } else {
      lo = mid;
    }
  }
  return best;
}

/// The rows on the model with one level of units (run_workload's make_coarse).
inline const std::string coarse_suffix = ", blocks only";

/// Builds the baseline row, sets the Balanced budget from its measured total peak,
/// builds the memscale rows (and the hand-placed row with Balanced at its peak),
/// then measures `steps` rounds in which every row takes a turn (so a change in
/// machine load hits all rows alike).
template <class Model>
Workload run_workload(const std::string& title, const std::string& description,
                      const std::function<Model()>& make_model,
                      const std::function<torch::Tensor(Model&, const Sample&)>& loss_of,
                      const std::vector<Sample>& data, int steps, const row_configs& rows_for = mode_rows,
                      const std::function<torch::Tensor(Model&, const Sample&)>& hand_placed = {},
                      const std::function<Model()>& make_coarse = {}) {
  Workload w;
  w.title = title;
  w.description = description;
  std::vector<std::unique_ptr<Runner<Model>>> runners;
  if (!solo().row.empty()) {  // a child process: the one row, alone
    const auto& name = solo().row;
    w.balanced_budget_gb = solo().budget_gb;
    std::optional<memscale::Config> config, coarse_config;
    for (const auto& [row_name, cfg] : rows_for(w.balanced_budget_gb)) {
      if (row_name == name) config = cfg;
      if (make_coarse && row_name + coarse_suffix == name) coarse_config = cfg;
    }
    if (name == "baseline" || config)
      runners.push_back(std::make_unique<Runner<Model>>(name, make_model, loss_of, data, config));
    else if (coarse_config)
      runners.push_back(std::make_unique<Runner<Model>>(name, make_coarse, loss_of, data, coarse_config));
    else if (name == "hand ckpt/block" && hand_placed)
      runners.push_back(std::make_unique<Runner<Model>>(name, make_model, hand_placed, data, std::nullopt));
    else if (name == at_hand_row && hand_placed) {
      memscale::core::profile_scale_scope no_reserve(1.0, 0);  // as in the interleaved run
      runners.push_back(std::make_unique<Runner<Model>>(name, make_model, loss_of, data, at_hand_config(w.balanced_budget_gb)));
    }
    else
      throw std::invalid_argument("--solo: " + title + " has no row named '" + name + "'");
    for (int s = 0; s < steps; ++s) runners.front()->take_turn();  // the interleaved run's turns, alone
    w.rows.push_back(runners.front()->finish());
    return w;
  }
  std::cerr << "[bench] " << title << ": baseline\n";
  runners.push_back(std::make_unique<Runner<Model>>("baseline", make_model, loss_of, data, std::nullopt));
  w.baseline_total = static_cast<double>(runners.front()->resident + runners.front()->calibration_growth);
  w.balanced_budget_gb = balanced_budget_fraction * w.baseline_total / gib;

  for (const auto& [name, cfg] : rows_for(w.balanced_budget_gb)) {
    std::cerr << "[bench] " << title << ": " << name << "\n";
    runners.push_back(std::make_unique<Runner<Model>>(name, make_model, loss_of, data, cfg));
  }
  // The same Balanced rows on the model whose blocks are its only units: what
  // planning the finer level buys, side by side.
  if (make_coarse)
    for (const auto& [name, cfg] : rows_for(w.balanced_budget_gb)) {
      if (name != "Balanced" && name != "Balanced forced") continue;
      std::cerr << "[bench] " << title << ": " << name << coarse_suffix << "\n";
      runners.push_back(std::make_unique<Runner<Model>>(name + coarse_suffix, make_coarse, loss_of, data, cfg));
    }
  if (hand_placed) {
    // No memscale guard: the loss's own forward checkpoints each block with
    // memscale::checkpoint, as a user would by hand (torch.utils.checkpoint per block).
    std::cerr << "[bench] " << title << ": hand-placed checkpoint per block\n";
    runners.push_back(
        std::make_unique<Runner<Model>>("hand ckpt/block", make_model, hand_placed, data, std::nullopt));
    const auto& hand = *runners.back();
    w.at_hand_budget_gb = static_cast<double>(hand.resident + hand.calibration_growth) / gib /
                          memscale::core::policy_for(memscale::OptimizationMode::Balanced).target_fraction;
    std::cerr << "[bench] " << title << ": " << at_hand_row << "\n";
    memscale::core::profile_scale_scope no_reserve(1.0, 0);
    runners.push_back(
        std::make_unique<Runner<Model>>(at_hand_row, make_model, loss_of, data, at_hand_config(w.at_hand_budget_gb)));
  }
  for (int s = 0; s < steps; ++s) {
    std::cerr << "[bench] " << title << ": round " << s + 1 << "/" << steps << "\n";
    // Each round starts at the next row: what a position costs falls on every row alike.
    for (std::size_t i = 0; i < runners.size(); ++i) runners[(i + static_cast<std::size_t>(s)) % runners.size()]->take_turn();
  }
  for (auto& r : runners) w.rows.push_back(r->finish());
  for (const auto& r : w.rows)
    if (r.report && r.report->chains.size() == 1) w.dp_min_peak = dp_min_peak(r.report->chains.front().slots);
  return w;
}

/// The planner's projection of the un-optimized step, from a memscale row's profile.
inline std::int64_t projected_baseline(const Workload& w) {
  for (const auto& r : w.rows)
    if (r.report && r.report->planned) return r.report->baseline_peak_bytes();
  return 0;
}

/// A memscale row's projected step time: its chains' profiled forward and
/// backward, the plan's recompute and the offload transfer its runs cannot
/// overlap (Report); 0 for a row without a plan.
inline double projected_step_seconds(const RowResult& r) {
  if (!r.report) return 0.0;
  return r.report->profiled_step_seconds() + r.report->recompute_seconds() + r.report->offload_wait_seconds();
}

/// The un-optimized step's projected time, from a memscale row's profile.
inline double projected_baseline_seconds(const Workload& w) {
  for (const auto& r : w.rows)
    if (r.report && r.report->planned) return r.report->profiled_step_seconds();
  return 0.0;
}

}  // namespace bench

// memscale benchmark: measured memory and time of a training step, without
// memscale and with each OptimizationMode, for three workloads:
//   - the example GPT (a bit larger than the example's default),
//   - a ResNet-style CNN (residual blocks, BatchNorm, in-place ReLU), and
//   - a flat Sequential of primitive layers: (Linear(256,1024), GELU,
//     Linear(1024,256), LayerNorm(256), Dropout(0.1)) x 8 on input [32,128,256].
// Rows: baseline, Conservative (no budget), Balanced (memory_budget_gb = 60% of
// the measured baseline total peak), Aggressive. Every row trains its own
// identically seeded model on the same batches with its own copy of the RNG
// stream, and the rows take turns step by step, so load changes on the machine
// hit them alike and the losses must match the baseline's bit for bit. Per row:
// peak memory growth of a training step (memory_tracker::peak_scope around
// forward + backward + AdamW step; median over the measured steps after one
// warm-up and one calibration step, planning excluded), the first step
// including profiling + planning, the planner's
// projected peak next to the measured total peak, the number of checkpointed
// segments, the step time (median), and the optimal-DP yardstick: the recompute
// time of the rule engine's plan against the least recompute any one-level
// segmentation needs to reach the same projected peak (core::optimal_segmentation).
//
// A third workload shows the offload engine's disk tier on this CPU host: the
// flat Sequential with checkpointing only, offloading only (synchronous, and
// async with prefetch), and both; plus the engine's transfer statistics.
// A fourth tiles a stack of the example's MLP blocks (checkpointing alone vs
// checkpointing + tiling); a fifth trains a LayerNorm-free flat Sequential in
// bfloat16 autocast and with the 8-bit AdamW (memscale::make_optimizer), alone
// and combined. Rows that change the arithmetic (tiling, bf16, 8-bit) report
// their largest relative loss difference from the baseline instead of bit-exactness.
// Last, the optimizer on its own (benchmarks/bench_optim8bit.hpp).
//
// The GPT and a ResNet-style CNN keep their blocks in a ModuleList and call them
// through memscale::forward (call-site units); last, what memscale::forward
// costs over a direct call.
//
//   memscale_bench [--steps N] [--only gpt|cnn|flat|offload|tile|precision|optimizer|calls] [--csv]
#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <dlfcn.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <memscale/core/memory_model.hpp>
#include <memscale/core/optimal_chain.hpp>
#include <memscale/memscale.hpp>

#include "bench_optim8bit.hpp"
#include "gpt.hpp"
#include "host_info.hpp"
#include "resnet.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
constexpr double gib = 1024.0 * 1024.0 * 1024.0;
constexpr std::uint64_t init_seed = 42;
constexpr std::uint64_t train_seed = 1234;
constexpr double learning_rate = 3e-4;
constexpr double balanced_budget_fraction = 0.6;
constexpr std::int64_t dp_buckets = 8192;  ///< live-byte resolution of the optimal-DP yardstick

// --- machine information ---------------------------------------------------------

template <class Fn>
Fn* symbol(const char* name) {
  return reinterpret_cast<Fn*>(::dlsym(RTLD_DEFAULT, name));
}

std::string blas_details() {
  std::ostringstream os;
  if (auto* threads = symbol<int()>("openblas_get_num_threads")) os << "OpenBLAS threads " << threads();
  if (auto* config = symbol<char*()>("openblas_get_config")) os << ", config: " << config();
  return os.str();
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

std::string utc_now() {
  const auto t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

// --- formatting -----------------------------------------------------------------------

std::string mib(double bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << bytes / (1024.0 * 1024.0) << " MiB";
  return os.str();
}

std::string ms(double seconds, int precision = 1) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(precision) << seconds * 1e3 << " ms";
  return os.str();
}

std::string ratio(double num, double den) {
  if (!(den > 0.0)) return num > 0.0 ? "inf" : "-";
  std::ostringstream os;
  os << std::fixed << std::setprecision(3) << num / den << "x";
  return os.str();
}

template <class T>
double median(std::vector<T> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 == 1 ? static_cast<double>(v[n / 2])
                    : (static_cast<double>(v[n / 2 - 1]) + static_cast<double>(v[n / 2])) / 2.0;
}

/// A plain-text table: right-aligned columns except the first.
class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print(std::ostream& os) const {
    std::vector<std::size_t> width(rows_.front().size(), 0);
    for (const auto& r : rows_)
      for (std::size_t i = 0; i < r.size() && i < width.size(); ++i) width[i] = std::max(width[i], r[i].size());
    for (std::size_t k = 0; k < rows_.size(); ++k) {
      const auto& r = rows_[k];
      for (std::size_t i = 0; i < r.size(); ++i) {
        if (i == 0) os << std::left << std::setw(static_cast<int>(width[i])) << r[i] << std::right;
        else os << "  " << std::setw(static_cast<int>(width[i])) << r[i];
      }
      os << "\n";
      if (k == 0) {
        std::size_t total = 0;
        for (auto w : width) total += w + 2;
        os << std::string(total - 2, '-') << "\n";
      }
    }
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

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
};

/// A DP budget rounded up to a multiple of the bucket count: optimal_segmentation
/// indexes past its table when live bytes fall in a last, partial bucket
/// (levels = budget / quantum + 1 truncates), so the harness never makes one.
std::int64_t dp_budget(std::int64_t bytes) { return (bytes + dp_buckets - 1) / dp_buckets * dp_buckets; }

/// Whether a row's plan uses more than checkpointing (the DP knows only that).
bool beyond_checkpointing(const RowResult& row) {
  return row.report && (row.report->offloaded_units() > 0 || row.report->tiled_segments() > 0);
}

/// The optimal-DP yardstick for a memscale row's plan (projected figures). The
/// DP knows checkpointing only: plans that offload or tile get no yardstick.
void add_yardstick(RowResult& row) {
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
    torch::manual_seed(init_seed);
    model_ = make_model();
    model_->train();
    memscale::optimizer_options adamw;
    adamw.lr = learning_rate;
    optimizer_ = memscale::make_optimizer(config.value_or(memscale::Config{}), model_->parameters(), adamw);
    torch::manual_seed(train_seed);
    rng_ = at::detail::getDefaultCPUGenerator().get_state();
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

  /// One measured step.
  void measure() {
    memscale::memory_tracker::peak_scope scope;
    const auto start = clock_type::now();
    row.losses.push_back(step());
    seconds_.push_back(std::chrono::duration<double>(clock_type::now() - start).count());
    growth_.push_back(scope.peak_growth());
  }

  /// Medians, detach, yardstick.
  RowResult finish() {
    if (guard_) row.offload = guard_->offload_stats();
    row.steps = steps_taken_;
    row.growth = median(growth_);
    row.total_peak = static_cast<double>(resident) + row.growth;
    row.step_seconds = median(seconds_);
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
    at::Generator gen = at::detail::getDefaultCPUGenerator();  // a handle to the global generator
    gen.set_state(rng_);
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
    rng_ = gen.get_state();
    return loss.item<float>();
  }

  loss_fn loss_of_;
  const std::vector<Sample>& data_;
  Model model_{nullptr};
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  bool autocast_ = false;
  std::optional<memscale::OptimizationGuard> guard_;
  torch::Tensor rng_;
  int steps_taken_ = 0;
  std::vector<std::int64_t> growth_;
  std::vector<double> seconds_;
};

struct Workload {
  std::string title;
  std::string description;
  std::vector<RowResult> rows;
  double baseline_total = 0.0;
  double balanced_budget_gb = 0.0;
  std::int64_t dp_min_peak = 0;  ///< lowest projected chain peak the DP reaches (single-chain workloads)
};

/// The lowest projected peak any one-level segmentation of `slots` reaches (to
/// 0.1%), by bisection on the DP's budget; 0 when `slots` is empty.
std::int64_t dp_min_peak(const std::vector<memscale::slot_cost>& slots) {
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

/// Builds the baseline row, sets the Balanced budget from its measured total peak,
/// builds the memscale rows, then measures `steps` rounds in which every row takes
/// one step in turn (so a change in machine load hits all rows alike).
/// The memscale rows of a workload, given the Balanced budget (GB) derived from the baseline.
using row_configs = std::function<std::vector<std::pair<std::string, memscale::Config>>(double)>;

/// A memscale row's Config: `mode`, logging off (the harness prints the plans it needs).
memscale::Config quiet_config(memscale::OptimizationMode mode) {
  memscale::Config cfg;
  cfg.enable_logging = false;
  cfg.mode = mode;
  return cfg;
}

/// Conservative (no budget), Balanced (the 60% budget), Aggressive.
std::vector<std::pair<std::string, memscale::Config>> mode_rows(double balanced_budget_gb) {
  std::vector<std::pair<std::string, memscale::Config>> rows;
  for (auto mode : {memscale::OptimizationMode::Conservative, memscale::OptimizationMode::Balanced,
                    memscale::OptimizationMode::Aggressive}) {
    auto cfg = quiet_config(mode);
    if (mode == memscale::OptimizationMode::Balanced) cfg.memory_budget_gb = balanced_budget_gb;
    rows.emplace_back(std::string(memscale::to_string(mode)), cfg);
  }
  return rows;
}

/// The offload rows: Aggressive with checkpointing only, offloading only
/// (synchronous and async), and both.
std::vector<std::pair<std::string, memscale::Config>> offload_rows(double) {
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

template <class Model>
Workload run_workload(const std::string& title, const std::string& description,
                      const std::function<Model()>& make_model,
                      const std::function<torch::Tensor(Model&, const Sample&)>& loss_of,
                      const std::vector<Sample>& data, int steps, const row_configs& rows_for = mode_rows) {
  Workload w;
  w.title = title;
  w.description = description;
  std::vector<std::unique_ptr<Runner<Model>>> runners;
  std::cerr << "[bench] " << title << ": baseline\n";
  runners.push_back(std::make_unique<Runner<Model>>("baseline", make_model, loss_of, data, std::nullopt));
  w.baseline_total = static_cast<double>(runners.front()->resident + runners.front()->calibration_growth);
  w.balanced_budget_gb = balanced_budget_fraction * w.baseline_total / gib;

  for (const auto& [name, cfg] : rows_for(w.balanced_budget_gb)) {
    std::cerr << "[bench] " << title << ": " << name << "\n";
    runners.push_back(std::make_unique<Runner<Model>>(name, make_model, loss_of, data, cfg));
  }
  for (int s = 0; s < steps; ++s) {
    std::cerr << "[bench] " << title << ": round " << s + 1 << "/" << steps << "\n";
    for (auto& r : runners) r->measure();
  }
  for (auto& r : runners) w.rows.push_back(r->finish());
  for (const auto& r : w.rows)
    if (r.report && r.report->chains.size() == 1) w.dp_min_peak = dp_min_peak(r.report->chains.front().slots);
  return w;
}

bool same_losses(const RowResult& a, const RowResult& b) {
  if (a.losses.size() != b.losses.size()) return false;
  for (std::size_t i = 0; i < a.losses.size(); ++i)
    if (std::bit_cast<std::uint32_t>(a.losses[i]) != std::bit_cast<std::uint32_t>(b.losses[i])) return false;
  return true;
}

/// The largest |loss - baseline loss| / |baseline loss| over the steps.
double loss_gap(const RowResult& a, const RowResult& b) {
  double worst = 0.0;
  for (std::size_t i = 0; i < a.losses.size() && i < b.losses.size(); ++i)
    if (!std::isfinite(a.losses[i])) return std::numeric_limits<double>::infinity();  // diverged
  for (std::size_t i = 0; i < a.losses.size() && i < b.losses.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(a.losses[i]) - b.losses[i]) /
                                std::max(1e-30, std::abs(static_cast<double>(b.losses[i]))));
  return worst;
}

/// The bit-exact column: yes/NO for rows that keep the arithmetic, else the loss gap.
std::string exactness(const RowResult& r, const RowResult& base) {
  if (&r == &base) return "ref";
  if (r.exact_expected) return same_losses(r, base) ? "yes" : "NO";
  std::ostringstream os;
  os << "n/a, loss " << std::scientific << std::setprecision(1) << loss_gap(r, base);
  return os.str();
}

/// The planner's projection of the un-optimized step, from a memscale row's profile.
std::int64_t projected_baseline(const Workload& w) {
  for (const auto& r : w.rows)
    if (r.report && r.report->planned) return r.report->baseline_peak_bytes();
  return 0;
}

void print_workload(const Workload& w, int steps, std::ostream& os) {
  const auto& base = w.rows.front();
  const auto base_projection = projected_baseline(w);

  os << "\n== " << w.title << " ==\n" << w.description << "\n";
  os << "Balanced budget: memory_budget_gb = " << std::fixed << std::setprecision(4) << w.balanced_budget_gb
     << " (" << mib(w.balanced_budget_gb * gib) << ") = " << std::setprecision(0) << balanced_budget_fraction * 100
     << "% of the measured baseline total peak " << mib(w.baseline_total) << "\n\n";

  Table mem({"memory", "ckpt segs", "tiled", "offl units", "peak growth", "vs base", "1st step+plan", "planning", "total peak",
             "projected", "proj/meas"});
  for (const auto& r : w.rows) {
    const double projected = static_cast<double>(r.report ? r.report->planned_peak_bytes() : base_projection);
    mem.add({r.name, r.report ? std::to_string(r.report->checkpointed_segments()) : "-",
             r.report ? std::to_string(r.report->tiled_segments()) : "-",
             r.report ? std::to_string(r.report->offloaded_units()) : "-", mib(r.growth),
             ratio(r.growth, base.growth), mib(static_cast<double>(r.first_growth)),
             r.memscale ? mib(static_cast<double>(r.planning_growth)) : "-", mib(r.total_peak),
             projected > 0.0 ? mib(projected) : "-", projected > 0.0 ? ratio(projected, r.total_peak) : "-"});
  }
  mem.print(os);
  if (w.dp_min_peak > 0) {
    os << "lowest projected chain peak any one-level segmentation reaches (optimal DP): " << mib(static_cast<double>(w.dp_min_peak));
    for (const auto& r : w.rows) {
      if (r.name != "Aggressive" && r.name != "checkpoint") continue;
      if (beyond_checkpointing(r))
        os << "; " << r.name << " also offloads or tiles (the DP knows checkpointing only)";
      else
        os << "; " << r.name << "'s rule plan: " << mib(static_cast<double>(r.rule_peak));
    }
    os << "\n";
  }
  os << "\n";

  Table time({"time", "step", "vs base", "1st step+plan", "planning", "recompute rule", "recompute DP-opt",
              "rule/DP", "DP peak", "bit-exact"});
  for (const auto& r : w.rows) {
    std::string rule = "-", dp = "-", gap = "-", dp_peak = "-";
    if (beyond_checkpointing(r)) {
      rule = ms(r.report->recompute_seconds(), 2);
      dp = r.report->offloaded_units() > 0 ? "n/a (offload)" : "n/a (tiling)";
    } else if (r.report) {
      rule = ms(r.rule_recompute, 2);
      dp = r.dp_feasible ? ms(r.dp_recompute, 2) : "infeasible";
      if (r.dp_feasible) {
        gap = r.rule_recompute == 0.0 && r.dp_recompute == 0.0 ? "1.000x" : ratio(r.rule_recompute, r.dp_recompute);
        std::ostringstream os;
        os << std::showpos << std::fixed << std::setprecision(2)
           << 100.0 * static_cast<double>(r.dp_peak - r.rule_peak) / static_cast<double>(r.rule_peak) << "%";
        dp_peak = os.str();
      }
    }
    time.add({r.name, ms(r.step_seconds), ratio(r.step_seconds, base.step_seconds), ms(r.first_seconds),
              r.memscale ? ms(r.planning_seconds) : "-", rule, dp, gap, dp_peak,
              exactness(r, base)});
  }
  time.print(os);
  os << "\n";
  if (std::any_of(w.rows.begin(), w.rows.end(), [](const RowResult& r) { return r.offload.has_value(); })) {
    Table off({"offload", "written/step", "read/step", "disk peak", "transfer/step", "waited/step", "hidden",
               "prefetch hit/miss", "batches/step", "warnings"});
    for (const auto& r : w.rows) {
      if (!r.offload) continue;
      const auto& o = *r.offload;
      const double n = std::max(1, r.steps);
      off.add({r.name, mib(static_cast<double>(o.bytes_written) / n), mib(static_cast<double>(o.bytes_read) / n),
               mib(static_cast<double>(o.at(memscale::offload::tier::disk).peak)), ms(o.transfer_seconds / n),
               ms(o.wait_seconds / n), ratio(o.hidden_fraction(), 1.0),
               std::to_string(o.prefetch_hits) + "/" + std::to_string(o.prefetch_misses),
               std::to_string(o.batches / static_cast<std::int64_t>(n)), std::to_string(o.warnings.size())});
    }
    off.print(os);
    os << "offload: the engine's totals over every step of the row (warm-up included) divided by the steps taken.\n"
          "transfer: time spent writing and reading (in I/O jobs or inline); waited: the part the step blocked on\n"
          "(inline copies in forward, loads in backward that had to read or wait);\n"
          "hidden = 1 - waited/transfer (the share of transfer time prefetching and async writes overlapped).\n\n";
    for (const auto& r : w.rows)
      if (r.offload)
        for (const auto& warning : r.offload->warnings) os << "warning: " << r.name << ": " << warning << "\n";
  }
  os << "peak growth / step: medians over " << steps
     << " measured steps per row (rows take turns step by step), after one warm-up and\n"
        "one calibration step; planning excluded. 1st step+plan: the warm-up step (AdamW state created) plus, for\n"
        "memscale rows, profiling + planning (also shown alone). total peak: what the row keeps between steps\n"
        "(parameters, gradients, AdamW state) + peak growth. projected: the planner's projected step peak (static\n"
        "bytes + the chain; the baseline row shows the un-optimized projection). recompute: the planner's projected\n"
        "recompute per step, for the rule plan and for the least any one-level segmentation needs to reach the same\n"
        "projected chain peak (core::optimal_segmentation, given its live-byte rounding as slack; DP peak: its plan's\n"
        "projected chain peak vs the rule plan's). bit-exact: every loss equal to the baseline's, bit for bit;\n"
        "rows that change the arithmetic (tiling: summation order; bf16; 8-bit optimizer state) show instead the\n"
        "largest relative difference of their losses from the baseline's.\n";
  for (const auto& r : w.rows) {
    if (!r.detached) os << "ERROR: " << r.name << ": model still optimized after its guard ended\n";
    if (r.report && !beyond_checkpointing(r) && !r.dp_feasible) os << "note: " << r.name << ": the DP found no plan within the rule plan's peak\n";
  }
}

void print_csv(const std::vector<Workload>& all, std::ostream& os) {
  os << std::defaultfloat << std::setprecision(6);
  os << "\nworkload,row,checkpointed_segments,peak_growth_bytes,growth_vs_baseline,first_step_bytes,"
        "planning_bytes,total_peak_bytes,projected_peak_bytes,step_seconds,time_vs_baseline,first_step_seconds,"
        "planning_seconds,rule_recompute_seconds,dp_recompute_seconds,rule_chain_peak_bytes,dp_chain_peak_bytes,"
        "budget_gb,bit_exact\n";
  for (const auto& w : all) {
    const auto& base = w.rows.front();
    for (const auto& r : w.rows) {
      os << '"' << w.title << "\"," << r.name << ',' << (r.report ? r.report->checkpointed_segments() : 0) << ','
         << static_cast<std::int64_t>(r.growth) << ',' << r.growth / base.growth << ',' << r.first_growth << ','
         << r.planning_growth << ',' << static_cast<std::int64_t>(r.total_peak) << ','
         << (r.report ? r.report->planned_peak_bytes() : projected_baseline(w)) << ',' << r.step_seconds << ','
         << r.step_seconds / base.step_seconds << ',' << r.first_seconds << ',' << r.planning_seconds << ','
         << r.rule_recompute << ',' << (r.dp_feasible ? r.dp_recompute : -1.0) << ',' << r.rule_peak << ','
         << (r.dp_feasible ? r.dp_peak : -1) << ','
         << (r.budget_gb ? *r.budget_gb : 0.0) << ','
         << (r.exact_expected ? (same_losses(r, base) ? "1" : "0") : "n/a") << "\n";
    }
  }
}

// --- workloads ----------------------------------------------------------------------

Workload bench_gpt(int steps) {
  gpt::Options o;
  o.context = 128;
  o.d_model = 192;
  o.heads = 4;
  o.layers = 6;
  o.dropout = 0.1;
  const std::int64_t batch = 16;
  const auto text = gpt::encode(gpt::training_text());
  std::mt19937_64 rng(7);
  std::vector<Sample> data;
  for (int s = 0; s <= steps; ++s) {
    auto b = gpt::sample_batch(text, batch, o.context, rng);
    data.push_back({b.input, b.target});
  }
  std::ostringstream desc;
  desc << "GPT (examples/gpt.hpp): " << o.layers
       << " x TransformerBlock in a ModuleList, each called through memscale::forward (call-site units), d_model "
       << o.d_model
       << ", " << o.heads << " heads, context " << o.context << ", dropout " << o.dropout << "; batch " << batch
       << "; cross-entropy, AdamW lr " << learning_rate;
  return run_workload<gpt::GPT>(
      "GPT", desc.str(), [o] { return gpt::GPT(o); },
      [](gpt::GPT& m, const Sample& s) { return gpt::loss(m->forward(s.input), s.target); }, data, steps);
}

Workload bench_cnn(int steps) {
  static constexpr int blocks = 4;
  static constexpr std::int64_t channels = 64, batch = 16, side = 32;
  torch::manual_seed(95);
  std::vector<Sample> data;
  for (int s = 0; s <= steps; ++s)
    data.push_back({torch::randn({batch, 3, side, side}), torch::randint(10, {batch}, torch::kLong)});
  std::ostringstream desc;
  desc << "ResNet-style CNN (examples/resnet.hpp): stem conv + BatchNorm, " << blocks << " x BasicBlock (conv3x3, "
       << "BatchNorm, in-place ReLU, conv3x3, BatchNorm, residual add, in-place ReLU) in a ModuleList called "
          "through memscale::forward, "
       << channels << " channels, input [" << batch << ",3," << side << "," << side
       << "]; global average pool, Linear, cross-entropy, AdamW lr " << learning_rate;
  return run_workload<resnet::ResNet>(
      "ResNet-style CNN", desc.str(), [] { return resnet::ResNet(blocks, channels); },
      [](resnet::ResNet& m, const Sample& s) { return torch::cross_entropy_loss(m->forward(s.input), s.target); },
      data, steps);
}

/// What memscale::forward costs over a direct call, per call, on a module that
/// does nothing (torch::nn::Identity): without any guard, and with a guard
/// active on another model (the call then looks its module up).
void bench_call_overhead(std::ostream& out) {
  torch::nn::Identity identity;
  auto x = torch::ones({1});
  constexpr int calls = 1'000'000;
  auto per_call_ns = [&](auto&& call) {
    double best = 1e300;
    for (int round = 0; round < 5; ++round) {
      const auto start = clock_type::now();
      for (int i = 0; i < calls; ++i) {
        auto y = call();
        asm volatile("" : : "r"(y.unsafeGetTensorImpl()) : "memory");
      }
      best = std::min(best, std::chrono::duration<double>(clock_type::now() - start).count() * 1e9 / calls);
    }
    return best;
  };
  const auto direct = per_call_ns([&] { return identity->forward(x); });
  const auto unguarded = per_call_ns([&] { return memscale::forward(identity, x); });
  torch::nn::Sequential other(torch::nn::Linear(8, 8));
  auto guard = memscale::optimize(other, torch::ones({2, 8}), quiet_config(memscale::OptimizationMode::Conservative));
  const auto guarded_elsewhere = per_call_ns([&] { return memscale::forward(identity, x); });
  out << "\n## memscale::forward call overhead (torch::nn::Identity, best of 5 x " << calls << " calls)\n"
      << std::fixed << std::setprecision(1) << "direct call " << direct << " ns; memscale::forward with no guard "
      << unguarded << " ns (+" << unguarded - direct << "); with a guard on another model " << guarded_elsewhere
      << " ns (+" << guarded_elsewhere - direct << ", one locked index lookup)\n";
}

/// The flat Sequential workload: (Linear(256,1024), GELU, Linear(1024,256),
/// LayerNorm(256), Dropout(0.1)) x 8 on data drawn from `data_seed`.
Workload flat_workload(const std::string& title, const std::string& description, std::uint64_t data_seed,
                       int steps, const row_configs& rows_for) {
  static constexpr int repeats = 8;
  static constexpr std::int64_t width = 256, hidden = 1024;
  torch::manual_seed(data_seed);
  std::vector<Sample> data;
  for (int s = 0; s <= steps; ++s) data.push_back({torch::randn({32, 128, width}), torch::randn({32, 128, width})});
  auto make = [] {
    torch::nn::Sequential seq;
    for (int i = 0; i < repeats; ++i) {
      seq->push_back(torch::nn::Linear(width, hidden));
      seq->push_back(torch::nn::GELU());
      seq->push_back(torch::nn::Linear(hidden, width));
      seq->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
      seq->push_back(torch::nn::Dropout(0.1));
    }
    return seq;
  };
  return run_workload<torch::nn::Sequential>(
      title, description, make,
      [](torch::nn::Sequential& m, const Sample& s) { return torch::mse_loss(m->forward(s.input), s.target); }, data,
      steps, rows_for);
}

Workload bench_flat(int steps) {
  return flat_workload(
      "flat Sequential",
      "(Linear(256,1024), GELU, Linear(1024,256), LayerNorm(256), Dropout(0.1)) x 8 = 40 slots; input [32,128,256]; "
      "MSE loss, AdamW lr 3e-4",
      99, steps, mode_rows);
}

Workload bench_offload(int steps) {
  std::error_code ec;
  const auto tmp = std::filesystem::temp_directory_path(ec);
  return flat_workload(
      "offload to the disk tier (CPU)",
      "the flat Sequential above, Aggressive, saved activations offloaded to the disk tier (memory-mapped files "
      "under " + (ec ? std::string("?") : tmp.string()) + "); rows: checkpointing only, offloading only "
      "(synchronous; async with prefetch), both",
      98, steps, offload_rows);
}

/// Aggressive with checkpointing only, and with tiling as well.
std::vector<std::pair<std::string, memscale::Config>> tile_rows(double) {
  auto cfg = quiet_config(memscale::OptimizationMode::Aggressive);
  cfg.enable_offloading = false;
  std::vector<std::pair<std::string, memscale::Config>> rows{{"checkpoint", cfg}};
  cfg.enable_tiling = true;
  rows.emplace_back("checkpoint+tile", cfg);
  return rows;
}

Workload bench_tile(int steps) {
  gpt::Options o;
  o.d_model = 256;
  o.dropout = 0.0;  // drawing dropout would keep the blocks untiled (tile_rules.hpp)
  static constexpr int blocks = 8;
  torch::manual_seed(97);
  std::vector<Sample> data;
  for (int s = 0; s <= steps; ++s) data.push_back({torch::randn({16, 256, o.d_model}), torch::randn({16, 256, o.d_model})});
  std::ostringstream desc;
  desc << "the example's MLP block (LayerNorm, Linear(256,1024), GELU, Linear(1024,256), residual) x " << blocks
       << " in a Sequential; input [16,256,256]; MSE loss, AdamW lr " << learning_rate
       << "; rows: Aggressive with checkpointing only, and with enable_tiling";
  return run_workload<torch::nn::Sequential>(
      "tiling", desc.str(),
      [o] {
        torch::nn::Sequential seq;
        for (int i = 0; i < blocks; ++i) seq->push_back(gpt::MLP(o));
        return seq;
      },
      [](torch::nn::Sequential& m, const Sample& s) { return torch::mse_loss(m->forward(s.input), s.target); }, data,
      steps, tile_rows);
}

/// bf16 autocast (memscale plans nothing under Conservative here: autocast alone),
/// the 8-bit AdamW, both, and both with Aggressive.
std::vector<std::pair<std::string, memscale::Config>> precision_rows(double) {
  auto cfg = quiet_config(memscale::OptimizationMode::Conservative);
  std::vector<std::pair<std::string, memscale::Config>> rows;
  auto bf16 = cfg;
  bf16.use_mixed_precision = true;
  rows.emplace_back("bf16 autocast", bf16);
  auto eight = cfg;
  eight.use_8bit_optimizer = true;
  rows.emplace_back("8-bit AdamW", eight);
  auto both = bf16;
  both.use_8bit_optimizer = true;
  rows.emplace_back("bf16+8-bit", both);
  both.mode = memscale::OptimizationMode::Aggressive;
  rows.emplace_back("Aggressive+bf16+8-bit", both);
  return rows;
}

Workload bench_precision(int steps) {
  static constexpr int repeats = 8;
  static constexpr std::int64_t width = 256, hidden = 1024;
  torch::manual_seed(96);
  std::vector<Sample> data;
  for (int s = 0; s <= steps; ++s) data.push_back({torch::randn({32, 128, width}), torch::randn({32, 128, width})});
  return run_workload<torch::nn::Sequential>(
      "bf16 autocast and the 8-bit optimizer",
      "(Linear(256,1024), GELU, Linear(1024,256), Dropout(0.1)) x 8 = 32 slots (no LayerNorm: LibTorch 1.13's CPU "
      "LayerNorm refuses bf16 input under autocast); input [32,128,256]; MSE loss (computed in float32), "
      "AdamW lr 3e-4 or memscale::optim::AdamW8bit with the same hyperparameters",
      [] {
        torch::nn::Sequential seq;
        for (int i = 0; i < repeats; ++i) {
          seq->push_back(torch::nn::Linear(width, hidden));
          seq->push_back(torch::nn::GELU());
          seq->push_back(torch::nn::Linear(hidden, width));
          seq->push_back(torch::nn::Dropout(0.1));
        }
        return seq;
      },
      [](torch::nn::Sequential& m, const Sample& s) {
        return torch::mse_loss(m->forward(s.input).to(torch::kFloat), s.target);
      },
      data, steps, precision_rows);
}

int parse_steps(std::string_view text) {
  int value = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc{} || ptr != text.data() + text.size() || value < 1)
    throw std::invalid_argument("--steps needs an integer >= 1, got '" + std::string(text) + "'");
  return value;
}

}  // namespace

int main(int argc, char** argv) {
  memscale::memory_tracker::install();
  gpt::register_memscale_rule();
  int steps = 5;
  bool csv = false;
  std::string only;
  constexpr std::array<std::string_view, 8> parts{"gpt", "cnn", "flat", "offload", "tile", "precision", "optimizer",
                                                 "calls"};
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string_view arg = argv[i];
      if (arg == "--csv") csv = true;
      else if (arg == "--steps" && i + 1 < argc) steps = parse_steps(argv[++i]);
      else if (arg == "--only" && i + 1 < argc &&
               std::find(parts.begin(), parts.end(), std::string_view(argv[i + 1])) != parts.end())
        only = argv[++i];
      else if (arg == "-h" || arg == "--help") {
        std::cout << "usage: memscale_bench [--steps N (measured steps after 1 warm-up, default 5)] "
                     "[--only gpt|cnn|flat|offload|tile|precision|optimizer|calls] [--csv]\n";
        return 0;
      } else {
        std::cerr << "memscale_bench: unknown or incomplete argument '" << arg << "' (see --help)\n";
        return 2;
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "memscale_bench: " << e.what() << "\n";
    return 2;
  }

  const auto start = clock_type::now();
  std::cout << "memscale benchmark (memscale " << memscale::version_major << '.' << memscale::version_minor << '.'
            << memscale::version_patch << ")\n";
  std::cout << "date:     " << utc_now() << "\n";
  std::cout << "cpu:      " << host_info::cpu_model() << ", " << std::thread::hardware_concurrency() << " logical CPUs\n";
  const auto hw = memscale::detect_hardware();
  std::cout << "memory:   " << mib(static_cast<double>(hw.host_total_bytes)) << " RAM; gpus: "
            << (hw.gpus.empty() ? "none (CPU-only host)" : std::to_string(hw.gpus.size())) << "\n";
  std::cout << "threads:  torch intra-op " << torch::get_num_threads() << ", interop "
            << at::get_num_interop_threads() << "\n";
  std::cout << "blas:     " << host_info::blas_in_use() << "\n";
  if (const auto details = blas_details(); !details.empty()) std::cout << "          " << details << "\n";
  std::cout << "libtorch: " << TORCH_VERSION << " (CPU)\n";
  std::cout << "load avg: " << load_average() << " (1/5/15 min, at start)\n";

  std::vector<Workload> all;
  try {
    if (only.empty() || only == "gpt") all.push_back(bench_gpt(steps));
    if (only.empty() || only == "cnn") all.push_back(bench_cnn(steps));
    if (only.empty() || only == "flat") all.push_back(bench_flat(steps));
    if (only.empty() || only == "offload") all.push_back(bench_offload(steps));
    if (only.empty() || only == "tile") all.push_back(bench_tile(steps));
    if (only.empty() || only == "precision") all.push_back(bench_precision(steps));
  } catch (const std::exception& e) {
    std::cerr << "memscale_bench: error: " << e.what() << "\n";
    return 1;
  }
  int status = 0;
  for (const auto& w : all) {
    print_workload(w, steps, std::cout);
    for (const auto& r : w.rows)
      if (!r.detached || (r.exact_expected ? !same_losses(r, w.rows.front())
                                           : !std::isfinite(loss_gap(r, w.rows.front()))))
        status = 1;
  }
  if (csv) print_csv(all, std::cout);
  if (only.empty() || only == "optimizer") bench_optimizer(std::cout, steps, csv);
  if (only.empty() || only == "calls") bench_call_overhead(std::cout);
  std::cout << "\nload avg: " << load_average() << " (at end); total wall time "
            << std::fixed << std::setprecision(1)
            << std::chrono::duration<double>(clock_type::now() - start).count() << " s\n";
  return status;
}

// memscale — what memscale::predict() answers: a step's peak by kind
// (MemoryBreakdown) and the Prediction, baseline and with the plan, with its
// fit, largest batches, method and notes, and its printing (str(), <<).
// predict/run.hpp fills it; predict/predict.hpp is the entry point.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iomanip>
#include <ostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <memscale/core/plan.hpp>
#include <memscale/device/hardware.hpp>

namespace memscale {

/// What one training step holds at its peak, by kind.
struct MemoryBreakdown {
  std::int64_t parameter_bytes = 0;
  std::int64_t buffer_bytes = 0;
  std::int64_t gradient_bytes = 0;  ///< LibTorch 1.x: all (kept between steps); 2.x: at most those the peak holds
  std::int64_t optimizer_state_bytes = 0;
  std::int64_t activation_bytes = 0;         ///< what the forward keeps for backward (live at its end)
  std::int64_t transient_bytes = 0;          ///< the rest of the allocator's peak (workspace, gradients in flight)
  std::int64_t outside_allocator_bytes = 0;  ///< CPU: native buffers and malloc's retention; CUDA: reserve + context

  /// What LibTorch's allocator holds at the peak.
  [[nodiscard]] std::int64_t allocator_bytes() const noexcept {
    return parameter_bytes + buffer_bytes + gradient_bytes + optimizer_state_bytes + activation_bytes +
           transient_bytes;
  }
  /// What the process (CPU) or the device (CUDA) holds at the peak.
  [[nodiscard]] std::int64_t total_bytes() const noexcept { return allocator_bytes() + outside_allocator_bytes; }
};

/// memscale::predict's answer. Byte figures are for the model's device: on CPU
/// what the process holds for the model's training (its resident size above what
/// it held before the model existed), on CUDA the device memory in use.
struct Prediction {
  std::string device;
  std::int64_t batch_size = 0;  ///< the example's first dimension
  std::string optimizer;        ///< the type sized

  std::int64_t baseline_peak_bytes = 0;  ///< without memscale
  std::int64_t peak_bytes = 0;           ///< with the plan `config` would apply
  MemoryBreakdown baseline;
  MemoryBreakdown planned;

  std::int64_t budget_bytes = 0;  ///< Config::memory_budget_gb, or the device's memory
  bool baseline_fits = false;
  bool fits = false;
  std::int64_t baseline_headroom_bytes = 0;  ///< budget - baseline peak (negative: short by that much)
  std::int64_t headroom_bytes = 0;           ///< budget - peak with the plan
  /// The largest batch (the example's first dimension scaled) whose step fits the
  /// budget; 0 when not even batch 1 does. With the plan: the same plan applied
  /// at that batch (the planner would plan a larger batch anew).
  std::int64_t baseline_max_batch_size = 0;
  std::int64_t max_batch_size = 0;

  /// CPU: the part of outside_allocator_bytes that grows with the batch, the
  /// BLAS library's buffers (predict/blas_workspace.hpp), measured at these
  /// (batch, bytes) points in increasing batch order: none at or below the
  /// first, linear between them, and past the last at the rate of the last two.
  std::vector<std::pair<std::int64_t, std::int64_t>> outside_growth;
  /// That part at batch `batch`.
  [[nodiscard]] std::int64_t outside_growth_at(std::int64_t batch) const noexcept {
    if (outside_growth.size() < 2 || batch <= outside_growth.front().first) return 0;
    std::size_t i = 1;
    while (i + 1 < outside_growth.size() && batch > outside_growth[i].first) ++i;
    const auto [b0, v0] = outside_growth[i - 1];
    const auto [b1, v1] = outside_growth[i];
    const double rate = static_cast<double>(v1 - v0) / static_cast<double>(b1 - b0);
    return std::max<std::int64_t>(0, v0 + static_cast<std::int64_t>(rate * static_cast<double>(batch - b0)));
  }
  /// What the breakdown's outside_allocator_bytes would read at batch `batch`
  /// with the BLAS buffers' growth (CPU, as the largest-batch search counts it).
  /// On CUDA the search also replays the caching allocator's reserve at each
  /// batch (or grows it, predict/timeline.hpp), which this does not.
  [[nodiscard]] std::int64_t outside_allocator_bytes_at(std::int64_t batch, bool with_plan = false) const noexcept {
    return (with_plan ? planned : baseline).outside_allocator_bytes - outside_growth_at(batch_size) +
           outside_growth_at(batch);
  }

  Report plan;               ///< the plan `config` applies at the full batch
  bool plan_applies = false;  ///< false: the plan changes nothing, peak == baseline
  std::vector<std::int64_t> calibration_batches;  ///< the batches the step ran at
  /// The two of them whose timelines the extrapolation fits (without the plan).
  std::pair<std::int64_t, std::int64_t> fitted_batches{0, 0};
  /// The calibration steps ran shape-only (outputs allocated, nothing computed;
  /// LibTorch 1.x on CPU), not for real: see `notes` for why not when false.
  bool shape_only = false;
  /// The plan's profile ran shape-only: its byte figures are a real run's, its
  /// times estimated (see `method`), not measured.
  bool plan_profile_shape_only = false;
  std::string method;                             ///< how the figures were obtained
  std::vector<std::string> notes;                 ///< assumptions and what could not be measured
  double seconds = 0.0;                           ///< time predict() took

  [[nodiscard]] std::string str() const {
    using detail::format_bytes;
    std::ostringstream os;
    const auto line = [&](const char* what, std::int64_t base, std::int64_t plan) {
      os << "  " << std::left << std::setw(26) << what << std::right << std::setw(12) << format_bytes(base)
         << std::setw(12) << format_bytes(plan) << "\n";
    };
    os << "memscale prediction: one training step at batch " << batch_size << " on " << device << " (" << optimizer
       << ")\n";
    os << "  " << std::left << std::setw(26) << "" << std::right << std::setw(12) << "baseline" << std::setw(12)
       << "with plan" << "\n";
    line("parameters", baseline.parameter_bytes, planned.parameter_bytes);
    line("buffers", baseline.buffer_bytes, planned.buffer_bytes);
    line("gradients", baseline.gradient_bytes, planned.gradient_bytes);
    line("optimizer state", baseline.optimizer_state_bytes, planned.optimizer_state_bytes);
    line("saved activations", baseline.activation_bytes, planned.activation_bytes);
    line("transient workspace", baseline.transient_bytes, planned.transient_bytes);
    line("allocator peak", baseline.allocator_bytes(), planned.allocator_bytes());
    line("outside the allocator", baseline.outside_allocator_bytes, planned.outside_allocator_bytes);
    line("peak", baseline_peak_bytes, peak_bytes);
    os << "  budget " << format_bytes(budget_bytes) << ": baseline " << (baseline_fits ? "fits" : "does NOT fit")
       << " (headroom " << format_bytes(baseline_headroom_bytes) << "), with the plan "
       << (fits ? "fits" : "does NOT fit") << " (headroom " << format_bytes(headroom_bytes) << ")\n";
    os << "  largest batch that fits: baseline " << baseline_max_batch_size << ", with the plan " << max_batch_size
       << "\n";
    os << "  plan: " << (plan_applies ? "" : "applies nothing; ") << plan.checkpointed_segments()
       << " checkpointed segment(s), " << plan.offloaded_units() << " offloaded unit(s), " << plan.tiled_segments()
       << " tiled segment(s)\n";
    os << "  method: " << method << "\n";
    for (const auto& n : notes) os << "  note: " << n << "\n";
    os << "  predicted in " << std::fixed << std::setprecision(3) << seconds << " s";
    return os.str();
  }
  friend std::ostream& operator<<(std::ostream& os, const Prediction& p) { return os << p.str(); }
};

}  // namespace memscale

// memscale — the execution plan as the user sees it: a Report holding the
// hardware, the profile, the memory pressure and, per chain, each run of slots
// with the technique applied and the rule that chose it. Printable line by line.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iomanip>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <memscale/config.hpp>
#include <memscale/core/decision_engine.hpp>
#include <memscale/core/graph.hpp>
#include <memscale/device/hardware.hpp>
#include <memscale/core/memory_model.hpp>
#include <memscale/offload/engine_options.hpp>
#include <memscale/policy/decision.hpp>

namespace memscale {

/// What Config::verify_correctness found: one step of the example input (forward,
/// the loss mean(output²), backward; no optimizer step) run unoptimized, then
/// optimized, from the same RNG state, buffers and (cleared) gradients.
struct CorrectnessCheck {
  bool passed = false;
  double tolerance = 0.0;        ///< relative L2 difference allowed; 0: bit-identical
  std::string tolerance_reason;  ///< why that tolerance
  int parameters = 0;            ///< gradients compared
  int buffers = 0;               ///< buffers compared after the step (BatchNorm statistics, ...)
  double loss_baseline = 0.0;
  double loss_optimized = 0.0;
  double max_relative_difference = 0.0;  ///< over the loss, the gradients and the buffers
  std::string largest_at;                ///< where it is ("the loss", "parameter 'fc.weight'")

  [[nodiscard]] std::string str() const {
    std::ostringstream os;
    os << (passed ? "verified" : "FAILED verification") << ": loss, " << parameters << " gradient(s) and "
       << buffers << " buffer(s) of one example step vs the unoptimized step, ";
    if (tolerance == 0.0) {
      os << (max_relative_difference == 0.0 && passed ? "bit-identical" : "bit-identity required");
    } else {
      os << "relative difference at most " << std::setprecision(2) << std::scientific << tolerance;
    }
    os << " (" << tolerance_reason << ")";
    if (max_relative_difference != 0.0)
      os << "; largest " << std::setprecision(2) << std::scientific << max_relative_difference << " at "
         << largest_at;
    return os.str();
  }
  friend std::ostream& operator<<(std::ostream& os, const CorrectnessCheck& c) { return os << c.str(); }
};

/// A unit boundary of a traced step (OptimizationGuard::trace_step): the device's
/// allocated bytes, as growth from the step's start, when the unit's forward
/// returned (backward false) or when backward reached it (its output's gradient
/// ready). `chain` indexes Report::chains, `unit` the chain's plan units.
struct measured_point {
  int chain = 0;
  int unit = 0;
  bool backward = false;
  std::int64_t bytes = 0;
};

struct Report {
  HardwareInfo hardware;
  OptimizationMode mode = OptimizationMode::Balanced;
  std::string device = "cpu";         ///< the device planned for
  bool planned = false;               ///< false while planning waits for the first forward
  std::int64_t budget_bytes = 0;      ///< Config::memory_budget_gb, or the device's memory
  std::int64_t usable_bytes = 0;      ///< budget x target_gpu_utilization
  std::int64_t parameter_bytes = 0;
  std::int64_t gradient_bytes = 0;
  std::int64_t optimizer_reserve_bytes = 0;  ///< AdamW's state (2 x trainable parameters), or AdamW8bit's
  std::int64_t buffer_bytes = 0;
  std::int64_t earlier_chains_bytes = 0;     ///< kept by chains planned before (lazy planning)
  /// CPU: what the process came to hold beyond LibTorch's allocator while
  /// memscale ran the model at the full batch to plan it (OpenMP and BLAS worker
  /// threads' buffers, oneDNN's scratchpads, malloc's retention): reserved in the
  /// budget, so that the budget holds for the process. About 0 in a process that
  /// has trained before (they exist already). CUDA: the device memory in use
  /// outside the caching allocator when planned (the CUDA context, cuBLAS's and
  /// cuDNN's handles).
  std::int64_t outside_allocator_bytes = 0;
  /// Call sites planned one level finer than their outermost (nested calls):
  /// what the outer calls keep outside the inner calls, which no unit can free.
  std::int64_t outside_units_bytes = 0;
  bool offload_async = false;  ///< Config::async_offload: offloaded runs overlap their transfer with compute
  /// The one-way rate the plan costed an offload transfer at (0: offloading was not weighed), and whether it was
  /// measured in this process (the disk tier's, or a CUDA device's link to pinned host memory) or nominal.
  double offload_bytes_per_second = 0.0;
  bool offload_rate_measured = false;
  /// A CUDA plan's: the pinned pool's bytes the offloads were costed at that rate (-1: no such limit), and the
  /// one-way rate of the rest, which goes through pageable host memory, synchronously (0: not weighed).
  std::int64_t offload_fast_bytes = -1;
  double offload_spill_bytes_per_second = 0.0;
  bool offload_spill_rate_measured = false;
  std::vector<chain_profile> chains;
  core::engine_plan plan;
  std::vector<std::string> notes;
  std::optional<CorrectnessCheck> verification;  ///< with Config::verify_correctness
  StrategyDecision strategy;  ///< Stage 1: who chose the mode and techniques, and the Config planned with
  std::string metrics_endpoint;  ///< with Config::observability_port: the URL serving Prometheus metrics ("" if none)
  // Measured so far, filled each time a live attachment's Report is read:
  std::optional<offload::engine_stats> offload;  ///< the offload engine's traffic by tier (unset: it has none)
  std::int64_t measured_peak_bytes = -1;  ///< the allocator's peak on the device so far (CUDA; CPU with the counting allocator); -1: unknown
  std::int64_t process_peak_bytes = -1;   ///< CPU: the process's resident high-water mark (VmHWM); -1: unknown
  std::vector<measured_point> measured_timeline;  ///< the last trace_step()'s unit boundaries (empty: none traced)

  [[nodiscard]] std::int64_t static_bytes() const noexcept {
    return parameter_bytes + gradient_bytes + optimizer_reserve_bytes + buffer_bytes + earlier_chains_bytes +
           outside_allocator_bytes + outside_units_bytes;
  }
  [[nodiscard]] double memory_pressure() const noexcept { return plan.pressure; }
  [[nodiscard]] std::int64_t baseline_peak_bytes() const noexcept { return plan.baseline_peak; }
  [[nodiscard]] std::int64_t planned_peak_bytes() const noexcept { return plan.planned_peak; }
  /// Number of checkpointed segments over all chains.
  [[nodiscard]] int checkpointed_segments() const { return core::count_units(plan.units, &core::unit::checkpointed); }
  /// Number of offloaded units (single slots or checkpointed runs) over all chains.
  [[nodiscard]] int offloaded_units() const { return core::count_units(plan.units, &core::unit::offloaded); }
  /// Number of tiled segments over all chains.
  [[nodiscard]] int tiled_segments() const {
    int n = 0;
    for (const auto& units : plan.units)
      for (const auto& u : units) n += u.tiles > 1 ? 1 : 0;
    return n;
  }
  /// Projected recompute seconds the plan adds to a step.
  [[nodiscard]] double recompute_seconds() const {
    double s = 0.0;
    for (std::size_t c = 0; c < chains.size() && c < plan.units.size(); ++c)
      s += core::recompute_seconds(chains[c].slots, plan.units[c]);
    return s;
  }

  /// Projected seconds a step spends in the planned chains unoptimized: every
  /// profiled slot's forward and backward (measured, or for a slot a static rule
  /// covers with use_empirical_fallback off, from the machine's measured compute
  /// rates). Beside recompute_seconds(), the plan's projected time overhead.
  [[nodiscard]] double profiled_step_seconds() const {
    double s = 0.0;
    for (const auto& chain : chains)
      for (const auto& slot : chain.slots) s += slot.forward_seconds + slot.backward_seconds;
    return s;
  }

  /// Projected seconds a step waits on offload transfers, per offloaded run at
  /// the tier's rate (out and back; offload_bytes_per_second): with
  /// asynchronous offload, the part
  /// its own forward and backward cannot hide (the engine's writes and
  /// prefetches overlap them); synchronous offload waits the whole transfer.
  [[nodiscard]] double offload_wait_seconds() const { return offload_wait_seconds(offload_async); }
  /// The same for the plan's offloads run synchronously (false) or asynchronously (true). A spill past the
  /// pinned pool (offload_fast_bytes; the step stores its offloads in forward order, the pool taking the first)
  /// is copied synchronously either way: waited whole.
  [[nodiscard]] double offload_wait_seconds(bool async) const {
    double s = 0.0;
    std::int64_t before = 0;
    for (const auto* d : core::offloads_in_forward_order(plan)) {
      if (!async || offload_fast_bytes < 0 || !(offload_bytes_per_second > 0) || !(offload_spill_bytes_per_second > 0)) {
        s += async ? std::max(0.0, d->recompute_seconds - d->compute_seconds) : d->recompute_seconds;
        continue;
      }
      const auto moved = std::clamp<std::int64_t>(d->freed_bytes, 0, std::int64_t{1} << 50);
      const auto fast = core::pool_share(offload_fast_bytes, moved, before);
      before += moved;
      s += 2.0 * static_cast<double>(moved - fast) / offload_spill_bytes_per_second +
           std::max(0.0, 2.0 * static_cast<double>(fast) / offload_bytes_per_second - d->compute_seconds);
    }
    return s;
  }

  [[nodiscard]] std::string str() const {
    std::ostringstream os;
    print(os);
    return os.str();
  }

  /// Prints through a string, so the caller's stream formatting stays as it was.
  friend std::ostream& operator<<(std::ostream& os, const Report& r) { return os << r.str(); }

  /// Every field, each plan line as str() prints it and the figures str()
  /// derives, as JSON (schema "memscale.report", version 1: report/report_json.hpp,
  /// which memscale.hpp includes, defines it; a template only so that it can).
  template <class Self = Report>
  [[nodiscard]] std::string to_json(int indent = 2) const {
    return report_json(static_cast<const Self&>(*this), indent);
  }
  /// One self-contained HTML page (no network): the step's memory unit by unit,
  /// baseline and planned, the plan table, offload traffic, hardware and Config
  /// (report/report_html.hpp, which memscale.hpp includes, defines it).
  template <class Self = Report>
  [[nodiscard]] std::string to_html() const {
    return report_html(static_cast<const Self&>(*this));
  }
  /// The Report to_json() wrote; throws memscale::Error naming what is wrong.
  template <class Self = Report>
  [[nodiscard]] static Self from_json(std::string_view text) {
    return report_from_json(text, static_cast<const Self*>(nullptr));
  }

  /// A decision's line of the plan, after its slots, technique and rule: what it
  /// frees or moves, for what, and the peak before and after.
  [[nodiscard]] std::string decision_text(const core::segment_decision& d) const {
    using detail::format_bytes;
    if (d.chain < 0 || static_cast<std::size_t>(d.chain) >= chains.size()) return {};
    std::ostringstream os;
    os << std::fixed;
    const auto& chain = chains[static_cast<std::size_t>(d.chain)];
    switch (d.rule) {
      case core::rule_id::checkpoint_segment:
      case core::rule_id::refine_segment:
        os << "frees " << format_bytes(d.freed_bytes) << " for " << std::setprecision(3)
           << d.recompute_seconds * 1e3 << " ms recompute; peak " << format_bytes(d.peak_before) << " -> "
           << format_bytes(d.peak_after) << linear_tail_note(chain, d);
        break;
      case core::rule_id::optimal_schedule:
        if (d.checkpointed)
          os << "optimal schedule: frees " << format_bytes(d.freed_bytes) << " for " << std::setprecision(3)
             << d.recompute_seconds * 1e3 << " ms recompute; peak " << format_bytes(d.peak_before) << " -> "
             << format_bytes(d.peak_after) << linear_tail_note(chain, d);
        else
          os << "optimal schedule: kept, the budget holds without recomputing it";
        break;
      case core::rule_id::keep_no_gain:
        if (is_whole_model(chain)) {
          os << "offloading would free " << format_bytes(d.freed_bytes) << " of the "
             << format_bytes(chain.slots.front().saved_bytes)
             << " its forward saves, no more than backward would hold of them at once: the peak stays "
             << format_bytes(d.peak_before);
          break;
        }
        if (d.compute_seconds > 0.0) {  // an offload the offload phase declined (checkpoints carry no compute)
          os << "offloading would move " << format_bytes(d.freed_bytes) << " (" << std::setprecision(3)
             << d.recompute_seconds * 1e3 << " ms transfer behind " << d.compute_seconds * 1e3
             << " ms compute) for a fall of " << format_bytes(d.peak_before - d.peak_after) << " in the peak ("
             << format_bytes(d.peak_before) << "), under 1/";
          if (core::offload_gain_divisor * (d.peak_before - d.peak_after) < d.freed_bytes)
            os << core::offload_gain_divisor << " of what it moves";
          else
            os << core::least_gain_divisor << " of the step's growth";
          break;
        }
        os << "would free " << format_bytes(d.freed_bytes) << " but the peak stays "
           << format_bytes(d.peak_before);
        if (d.peak_after < d.peak_before)
          os << " (it would fall " << format_bytes(d.peak_before - d.peak_after) << ", under 1/"
             << core::least_gain_divisor << " of the step's growth)";
        break;
      case core::rule_id::keep_fits:
        os << "projected peak " << format_bytes(d.peak_before) << " <= target " << format_bytes(plan.target_bytes);
        break;
      case core::rule_id::low_pressure_skip:
        os << "pressure " << std::setprecision(2) << plan.pressure << " < "
           << core::policy_for(mode).act_at_pressure << " (" << mode << "); force_optimize is off";
        break;
      case core::rule_id::checkpointing_disabled:
        if (is_whole_model(chain))
          os << "no unit boundaries to recompute between (no Sequential, no memscale::forward call that is a unit): "
              "offload only";
        else
          os << "checkpointing excluded by Config::enable_checkpointing or the Strategy";
        break;
      case core::rule_id::unsupported_chain: os << chain.unsupported_reason; break;
      case core::rule_id::tile_segment:
        os << d.tiles << " chunks of input dimension " << d.tile_dim << ": one chunk's intermediates live in "
           << "backward, saves " << format_bytes(d.freed_bytes) << "; peak " << format_bytes(d.peak_before)
           << " -> " << format_bytes(d.peak_after);
        break;
      case core::rule_id::offload_segment:
      case core::rule_id::offload_no_room:
        os << (d.rule == core::rule_id::offload_no_room ? "would move " : "moves ") << format_bytes(d.freed_bytes)
           << " (" << std::setprecision(3) << d.recompute_seconds * 1e3 << " ms transfer behind "
           << d.compute_seconds * 1e3 << " ms compute); peak " << format_bytes(d.peak_before) << " -> "
           << format_bytes(d.peak_after)
           << (d.rule == core::rule_id::offload_no_room ? ", but the offload tiers have no room left" : "");
        break;
    }
    return os.str();
  }

  /// "checkpoint", "ckpt+offl", "offload", "tile" or "none".
  [[nodiscard]] static const char* technique_of(const core::segment_decision& d) {
    return d.rule == core::rule_id::tile_segment ? "tile"
           : d.checkpointed                      ? (d.offloaded ? "ckpt+offl" : "checkpoint")
                                                 : (d.offloaded ? "offload" : "none");
  }

 private:
  void print(std::ostream& os) const {
    using detail::format_bytes;
    os << "memscale plan (mode " << mode << ", device " << device << ")\n" << hardware;
    if (!planned) {
      os << "planning: deferred to the first forward call (no example input given)\n";
      print_notes(os);
      return;
    }
    os << strategy.str() << "\n";
    os << "budget " << format_bytes(budget_bytes) << ", usable " << format_bytes(usable_bytes) << "\n";
    os << "static " << format_bytes(static_bytes()) << " = parameters " << format_bytes(parameter_bytes)
       << " + gradients " << format_bytes(gradient_bytes) << " + optimizer reserve "
       << format_bytes(optimizer_reserve_bytes) << " + buffers " << format_bytes(buffer_bytes);
    if (earlier_chains_bytes != 0) os << " + earlier chains " << format_bytes(earlier_chains_bytes);
    if (outside_units_bytes != 0) os << " + outside the finer units " << format_bytes(outside_units_bytes);
    if (device == "cpu")
      os << " + outside the allocator " << format_bytes(outside_allocator_bytes)
         << " (the process's growth beyond LibTorch's allocator while memscale ran the model to plan it)";
    else if (outside_allocator_bytes != 0)
      os << " + outside the caching allocator " << format_bytes(outside_allocator_bytes) << " (the CUDA context)";
    os << "\n";
    os << "projected peak: baseline " << format_bytes(plan.baseline_peak) << " (pressure " << std::fixed
       << std::setprecision(2) << plan.pressure << "), planned " << format_bytes(plan.planned_peak)
       << ", target " << format_bytes(plan.target_bytes) << ", recompute +" << std::setprecision(2)
       << recompute_seconds() * 1e3 << " ms/step over the chains' " << profiled_step_seconds() * 1e3
       << " ms of forward and backward as profiled\n";
    std::vector<std::vector<slot_cost>> costs;
    for (const auto& chain : chains) costs.push_back(chain.slots);
    os << "applied: " << checkpointed_segments() << " checkpointed segment(s) (" << tiled_segments()
       << " of them tiled), " << offloaded_units()
       << " offloaded unit(s) moving " << format_bytes(core::offloaded_bytes(costs, plan.units)) << " per step";
    if (offloaded_units() > 0) {  // what the step waits on them, and what the engine's other mode would
      os << ", projected wait " << std::setprecision(1) << offload_wait_seconds() * 1e3 << " ms/step";
      if (offload_async)
        os << " (async_offload)";
      else
        os << " (synchronous; " << offload_wait_seconds(true) * 1e3 << " ms with Config::async_offload)";
      if (offload_bytes_per_second > 0)
        os << ", transfers costed at " << std::setprecision(0) << offload_bytes_per_second / 1e6 << " MB/s one way ("
           << (offload_rate_measured ? "measured in this process" : "nominal") << ")";
      if (offload_fast_bytes >= 0 && offload_spill_bytes_per_second > 0 &&
          core::offloaded_bytes(costs, plan.units) > offload_fast_bytes)
        os << ", past the pinned pool's " << format_bytes(offload_fast_bytes) << " through pageable memory at "
           << std::setprecision(0) << offload_spill_bytes_per_second / 1e6 << " MB/s (" << (offload_spill_rate_measured ? "measured" : "nominal")
           << ", synchronous)";
    }
    os << "\n";
    if (offload && offload->bytes_written + offload->bytes_read > 0) {  // what the engine measured so far
      os << "offloaded so far: " << format_bytes(offload->bytes_written) << " out, "
         << format_bytes(offload->bytes_read) << " back; the timed copies took " << std::setprecision(1)
         << offload->transfer_seconds * 1e3 << " ms";
      if (const double rate = offload->timed_bytes_per_second(); rate > 0)
        os << " (" << std::setprecision(0) << rate / 1e6 << " MB/s one way)";
      if (offload->some_untimed()) os << "; asynchronous copies between a GPU and pinned memory untimed";
      os << ", training waited " << std::setprecision(1) << offload->wait_seconds * 1e3 << " ms on copies\n";
    }
    if (verification) os << verification->str() << "\n";
    for (std::size_t c = 0; c < chains.size(); ++c) print_chain(os, static_cast<int>(c));
    print_notes(os);
  }

  /// Prints through a string, so the caller's stream formatting stays as it was.
  void print_notes(std::ostream& os) const {
    if (!metrics_endpoint.empty()) os << "metrics: " << metrics_endpoint << "\n";
    for (const auto& note : notes) os << "note: " << note << "\n";
  }

  /// The one chain of a model with no unit boundaries (its slot: memscale::WholeModel).
  static bool is_whole_model(const chain_profile& chain) {
    return chain.slot_names.size() == 1 && chain.slot_names.front().find("memscale::WholeModel") != std::string::npos;
  }

  /// For a checkpointed run ending in a plain Linear: that its forward is not recomputed.
  static std::string linear_tail_note(const chain_profile& chain, const core::segment_decision& d) {
    if (d.last < 0 || static_cast<std::size_t>(d.last) >= chain.slots.size() ||
        !chain.slots[static_cast<std::size_t>(d.last)].backward_from_input)
      return "";
    return "; its last slot, a Linear, is not recomputed (its gradients come from its recomputed input)";
  }

  void print_chain(std::ostream& os, int c) const {
    using detail::format_bytes;
    const auto& chain = chains[c];
    os << "chain '" << (chain.path.empty() ? "<root>" : chain.path) << "': " << chain.slots.size()
       << " slots, input [";
    for (std::size_t i = 0; i < chain.input_shape.size(); ++i) os << (i ? ", " : "") << chain.input_shape[i];
    os << "]";
    if (c < static_cast<int>(plan.segment_length.size())) os << ", segment length " << plan.segment_length[c];
    if (!chain.slots.empty() && chain.slots.front().made_before_bytes > 0)
      os << "; the model's code before it held " << format_bytes(chain.slots.front().made_before_bytes)
         << " more as it began (its input made there, temporaries), counted live through its backward";
    os << "\n";
    if (!chain.supported) os << "  not optimized: " << chain.unsupported_reason << "\n";
    for (const auto& caveat : chain.caveats) os << "  note: " << caveat << "\n";
    os << "  profile:\n";
    for (std::size_t k = 0; k < chain.slots.size(); ++k) {
      const auto& s = chain.slots[k];
      os << "    " << std::left << std::setw(34) << chain.slot_names[k] << std::right << " "
         << std::setw(9) << to_string(chain.sources[k]) << "  out " << std::setw(10)
         << format_bytes(s.output_is_view ? 0 : s.output_bytes) << "  saved " << std::setw(10)
         << format_bytes(s.saved_bytes) << (s.saves_input ? "  +input" : "")
         << (s.saves_output ? "  +output" : "");
      if (s.offload_kept_bytes > 0)
        os << "  (if offloaded, " << format_bytes(s.offload_kept_bytes) << " of it would stay: small saved "
           << "views keep their storages, or something else holds them)";
      os << "\n";
    }
    os << "  plan:\n";
    for (const auto& d : plan.decisions) {
      if (d.chain != c) continue;
      std::ostringstream slots;
      slots << d.first;
      if (d.last != d.first) slots << ".." << d.last;
      os << "    slots " << std::left << std::setw(8) << slots.str() << std::setw(11) << technique_of(d)
         << std::setw(26) << to_string(d.rule) << std::right << decision_text(d) << "\n";
    }
  }
};

}  // namespace memscale

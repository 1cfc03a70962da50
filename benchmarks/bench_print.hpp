// memscale benchmark (bench_memscale.cpp), the output: per workload a table of
// its rows (memory, time, exactness, plan, projected vs measured, the optimal-DP
// yardstick) with the ratios to the baseline, and the same as CSV.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <memscale/memscale.hpp>

#include "bench_common.hpp"
#include "bench_runner.hpp"

namespace bench {

/// Whether two runs' losses are equal bit for bit.
inline bool same_losses(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::bit_cast<std::uint32_t>(a[i]) != std::bit_cast<std::uint32_t>(b[i])) return false;
  return true;
}

/// The largest |loss - baseline loss| / |baseline loss| over the steps.
inline double loss_gap(const RowResult& a, const RowResult& b) {
  double worst = 0.0;
  for (std::size_t i = 0; i < a.losses.size() && i < b.losses.size(); ++i)
    if (!std::isfinite(a.losses[i])) return std::numeric_limits<double>::infinity();  // diverged
  for (std::size_t i = 0; i < a.losses.size() && i < b.losses.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(a.losses[i]) - b.losses[i]) /
                                std::max(1e-30, std::abs(static_cast<double>(b.losses[i]))));
  return worst;
}

/// Each round's step time over the baseline's in the same round: the rows take
/// turns, so a slow stretch of the host falls on both terms of a pair.
inline std::vector<double> paired_ratios(const RowResult& r, const RowResult& base) {
  std::vector<double> out;
  for (std::size_t i = 0; i < r.step_series.size() && i < base.step_series.size(); ++i)
    if (base.step_series[i] > 0.0) out.push_back(r.step_series[i] / base.step_series[i]);
  return out;
}

/// "median (lower quartile-upper quartile)" of the paired ratios; "-" for the baseline or without pairs.
inline std::string paired_column(const RowResult& r, const RowResult& base) {
  const auto pairs = paired_ratios(r, base);
  if (&r == &base || pairs.empty()) return "-";
  std::ostringstream os;
  os << std::fixed << std::setprecision(3) << quantile(pairs, 0.5) << "x (" << std::setprecision(2)
     << quantile(pairs, 0.25) << "-" << quantile(pairs, 0.75) << ")";
  return os.str();
}

/// The bit-exact column: yes/NO for rows that keep the arithmetic, else the loss gap.
inline std::string exactness(const RowResult& r, const RowResult& base) {
  if (&r == &base) return "ref";
  if (r.exact_expected) return same_losses(r.losses, base.losses) ? "yes" : "NO";
  std::ostringstream os;
  os << "n/a, loss " << std::scientific << std::setprecision(1) << loss_gap(r, base);
  return os.str();
}


inline void print_workload(const Workload& w, int steps, std::ostream& os) {
  const auto& base = w.rows.front();
  const auto base_projection = projected_baseline(w);

  os << "\n== " << w.title << " ==\n" << w.description << "\n";
  os << "Balanced budget: memory_budget_gb = " << std::fixed << std::setprecision(4) << w.balanced_budget_gb
     << " (" << mib(w.balanced_budget_gb * gib) << ") = " << std::setprecision(0) << balanced_budget_fraction * 100
     << "% of the measured baseline total peak " << mib(w.baseline_total) << "\n";
  if (w.at_hand_budget_gb > 0.0)
    os << at_hand_row << ": memory_budget_gb = " << std::setprecision(4) << w.at_hand_budget_gb << " ("
       << mib(w.at_hand_budget_gb * gib)
       << "), target_gpu_utilization 1: Balanced's target (" << std::setprecision(0)
       << memscale::core::policy_for(memscale::OptimizationMode::Balanced).target_fraction * 100
       << "% of it) is the hand-placed row's measured total peak, planned with no reserve outside the "
          "allocator (both figures are the allocator's)\n";
  os << "\n";

  Table mem({"memory", "ckpt segs", "tiled", "offl units", "peak growth", "vs base", "1st step+plan", "planning", "total peak",
             "projected", "proj/meas"});
  for (const auto& r : w.rows) {
    // The baseline row shows the un-optimized projection; a hand-placed row has none.
    const double projected =
        static_cast<double>(r.report ? r.report->planned_peak_bytes() : &r == &base ? base_projection : 0);
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

  Table time({"time", "step", "vs base", "paired (IQR)", "projected", "proj/meas", "proj vs base", "1st step+plan", "planning",
              "recompute rule", "recompute DP-opt", "rule/DP", "DP peak", "bit-exact"});
  const double base_projected = projected_baseline_seconds(w);
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
    const double projected = &r == &base ? base_projected : projected_step_seconds(r);
    const bool has_projection = projected > 0.0 && base_projected > 0.0;
    time.add({r.name, ms(r.step_seconds), ratio(r.step_seconds, base.step_seconds),
              paired_column(r, base),
              has_projection ? ms(projected) : "-", has_projection ? ratio(projected, r.step_seconds) : "-",
              has_projection ? ratio(projected, base_projected) : "-", ms(r.first_seconds),
              r.memscale ? ms(r.planning_seconds) : "-", rule, dp, gap, dp_peak,
              exactness(r, base)});
  }
  time.print(os);
  os << "\n";
  if (std::any_of(w.rows.begin(), w.rows.end(), [](const RowResult& r) { return r.offload.has_value(); })) {
    Table off({"offload", "written/step", "read/step", "disk peak", "transfer/step", "projected", "waited/step",
               "projected", "hidden", "prefetch hit/miss", "batches/step", "warnings"});
    for (const auto& r : w.rows) {
      if (!r.offload) continue;
      const auto& o = *r.offload;
      const double n = std::max(1, r.steps);
      const bool planned = r.report && r.report->offloaded_units() > 0;
      off.add({r.name, mib(static_cast<double>(o.bytes_written) / n), mib(static_cast<double>(o.bytes_read) / n),
               mib(static_cast<double>(o.at(memscale::offload::tier::disk).peak)), ms(o.transfer_seconds / n),
               planned ? ms(r.report->offload_wait_seconds(false)) : "-", ms(o.wait_seconds / n),
               planned ? ms(r.report->offload_wait_seconds()) : "-", ratio(o.hidden_fraction(), 1.0),
               std::to_string(o.prefetch_hits) + "/" + std::to_string(o.prefetch_misses),
               std::to_string(o.batches / static_cast<std::int64_t>(n)), std::to_string(o.warnings.size())});
    }
    off.print(os);
    os << "offload: the engine's totals over every step of the row (warm-up included) divided by the steps taken.\n"
          "transfer: time spent writing and reading (in I/O jobs or inline); waited: the part the step blocked on\n"
          "(inline copies in forward, loads in backward that had to read or wait);\n"
          "hidden = 1 - waited/transfer (the share of transfer time prefetching and async writes overlapped).\n"
          "projected: the plan's (Report::offload_wait_seconds): the transfer, each unit's bytes out and back at the\n"
          "disk rate measured in the process; the wait, all of it where offload is synchronous, else what exceeds the\n"
          "unit's own compute.\n\n";
    for (const auto& r : w.rows)
      if (r.offload)
        for (const auto& warning : r.offload->warnings) os << "warning: " << r.name << ": " << warning << "\n";
  }
  os << "peak growth / step: medians over " << steps
     << " measured steps per row (rows take turns of two steps, the second measured), after one warm-up and\n"
        "one calibration step; planning excluded. vs base: the ratio of the two medians; paired (IQR): the median of\n"
        "each round's step over the baseline's step in that round (the rows take turns, so a slow stretch of the host\n"
        "falls on both), with its lower and upper quartiles. One process's rows share its heap and caches, so the\n"
        "baseline's neighbours change its times too: read both columns.\n"
        "1st step+plan: the warm-up step (AdamW state created) plus, for memscale rows, profiling + planning (also\n"
        "shown alone). total peak: what the row keeps between steps\n"
        "(parameters, gradients, AdamW state) + peak growth. projected: the planner's projected step peak (static\n"
        "bytes + the chain; the baseline row shows the un-optimized projection). recompute: the planner's projected\n"
        "recompute per step, for the rule plan and for the least any one-level segmentation needs to reach the same\n"
        "projected chain peak (core::optimal_segmentation, given its live-byte rounding as slack; DP peak: its plan's\n"
        "projected chain peak vs the rule plan's). projected (time): the chains' forward and backward as profiled\n"
        "(Report::profiled_step_seconds: measured per slot) + the plan's recompute + the offload transfer its runs'\n"
        "compute cannot hide (Report::offload_wait_seconds, at the tier's measured rate); proj/meas against the measured\n"
        "step (which also holds the loss, the optimizer step and what runs outside the chains); proj vs base: the\n"
        "projected overhead, to read beside the measured vs base. bit-exact: every loss equal to the baseline's, bit for bit;\n"
        "rows that change the arithmetic (tiling: summation order; bf16; 8-bit optimizer state) show instead the\n"
        "largest relative difference of their losses from the baseline's.\n";
  for (const auto& r : w.rows) {
    if (!r.detached) os << "ERROR: " << r.name << ": model still optimized after its guard ended\n";
    if (r.report && !beyond_checkpointing(r) && !r.dp_feasible) os << "note: " << r.name << ": the DP found no plan within the rule plan's peak\n";
  }
}

inline void print_csv(const std::vector<Workload>& all, std::ostream& os) {
  os << std::defaultfloat << std::setprecision(6);
  os << "\nworkload,row,checkpointed_segments,peak_growth_bytes,growth_vs_baseline,first_step_bytes,"
        "planning_bytes,total_peak_bytes,projected_peak_bytes,step_seconds,time_vs_baseline,"
        "paired_time_vs_baseline,projected_step_seconds,"
        "first_step_seconds,"
        "planning_seconds,rule_recompute_seconds,dp_recompute_seconds,rule_chain_peak_bytes,dp_chain_peak_bytes,"
        "budget_gb,bit_exact\n";
  for (const auto& w : all) {
    const auto& base = w.rows.front();
    for (const auto& r : w.rows) {
      os << '"' << w.title << "\"," << r.name << ',' << (r.report ? r.report->checkpointed_segments() : 0) << ','
         << static_cast<std::int64_t>(r.growth) << ',' << r.growth / base.growth << ',' << r.first_growth << ','
         << r.planning_growth << ',' << static_cast<std::int64_t>(r.total_peak) << ','
         << (r.report ? r.report->planned_peak_bytes() : &r == &base ? projected_baseline(w) : 0) << ','
         << r.step_seconds << ','
         << r.step_seconds / base.step_seconds << ','
         << (paired_ratios(r, base).empty() ? -1.0 : quantile(paired_ratios(r, base), 0.5)) << ','
         << (&r == &base ? projected_baseline_seconds(w) : projected_step_seconds(r)) << ',' << r.first_seconds << ',' << r.planning_seconds << ','
         << r.rule_recompute << ',' << (r.dp_feasible ? r.dp_recompute : -1.0) << ',' << r.rule_peak << ','
         << (r.dp_feasible ? r.dp_peak : -1) << ','
         << (r.budget_gb ? *r.budget_gb : 0.0) << ','
         << (r.exact_expected ? (same_losses(r.losses, base.losses) ? "1" : "0") : "n/a") << "\n";
    }
  }
}

}  // namespace bench

// memscale — the rule engine's phases (core/decision_engine.hpp runs them in
// this order): checkpoint segmenting (which runs of slots, how long a segment),
// the order candidates are expanded in (bytes freed per recompute second), then,
// while the projected peak is still above the target, tiling and offload.
// constexpr throughout, like the engine.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include <memscale/core/decisions.hpp>
#include <memscale/core/graph.hpp>
#include <memscale/core/memory_model.hpp>
#include <memscale/core/optimal_chain.hpp>

namespace memscale::core {

/// A checkpoint or an offload must lower the projected peak by at least this
/// fraction (1/n) of the step's growth.
inline constexpr std::int64_t least_gain_divisor = 1024;

/// The least a checkpoint or an offload must lower the projected peak by to be
/// taken: a 1024th of the step's growth (least_gain_divisor; at least a byte).
/// Less counts as none: a U-Net's BatchNorm-ReLU runs, whose input and output
/// stay kept, freed 128 B each for milliseconds of recompute.
[[nodiscard]] constexpr std::int64_t least_gain(const engine_plan& plan, const engine_input& in) {
  return std::max<std::int64_t>(1, (plan.baseline_peak - in.static_bytes) / least_gain_divisor);
}

/// An offload must lower the projected peak by at least this fraction (1/n) of what it moves.
inline constexpr std::int64_t offload_gain_divisor = 16;

/// The least an offload moving `moved` bytes must lower the projected peak by:
/// least_gain, and a 16th of what it moves (offload_gain_divisor). Moving bytes
/// costs transfer time (on a CPU host, disk traffic); a move that returns before
/// the peak buys little: on a U-Net, a BatchNorm's saved input, 4.5 MiB a step,
/// for 96 KiB.
[[nodiscard]] constexpr std::int64_t least_offload_gain(const engine_plan& plan, const engine_input& in,
                                                        std::int64_t moved) {
  return std::max(least_gain(plan, in), moved / offload_gain_divisor);
}

/// Forward bytes that slots [a, b] keep when run plainly, minus what a checkpoint
/// of them keeps (its output and its random masks): what checkpointing the run frees.
[[nodiscard]] constexpr std::int64_t checkpoint_frees(std::span<const slot_cost> s, int a, int b) {
  const auto plain = project_plain_range(s, a, b, 0);
  return plain.forward_end - s[b].output_bytes - run_replay_kept_bytes(s, a, b);
}

/// Segments of `length` slots, checkpointed, except that a segment is extended
/// rather than let the next one start at a slot that modifies its input in place
/// (its recompute would read the modified input); a chain starting with such a
/// slot keeps that first segment. With `limit` (the most slots a segment may
/// span), a segment is never extended past it: such a slot is then kept.
[[nodiscard]] constexpr std::vector<unit> segments_of_length(std::span<const slot_cost> s, int length,
                                                             int limit = 0) {
  const int n = static_cast<int>(s.size());
  if (limit > 0) length = std::min(length, limit);
  std::vector<unit> units;
  for (int first = 0; first < n;) {
    int last = std::min(first + length, n) - 1;
    while (last + 1 < n && s[last + 1].mutates_input && (limit <= 0 || last + 1 - first < limit)) ++last;
    units.push_back({first, last, !s[first].mutates_input, false});
    first = last + 1;
  }
  return units;
}

/// Segment length whose all-checkpointed plan has the lowest projected peak:
/// one length for blocks (1), about sqrt(n) for runs of primitive layers. Ties
/// go to the shorter segment: finer candidates let the greedy expansion stop sooner.
[[nodiscard]] constexpr int choose_segment_length(std::span<const slot_cost> s, int limit = 0) {
  const int n = limit > 0 ? std::min(limit, static_cast<int>(s.size())) : static_cast<int>(s.size());
  int best_length = 1;
  std::int64_t best_peak = -1;
  for (int length = 1; length <= n; ++length) {
    const auto units = segments_of_length(s, length, limit);
    const auto peak = project_chain(s, units).peak;
    if (best_peak < 0 || peak < best_peak) {
      best_peak = peak;
      best_length = length;
    }
  }
  return best_length;
}

namespace detail_engine {
struct candidate {
  int chain;
  int first;
  int last;
  std::int64_t frees;
  double seconds;
};

/// Higher freed bytes per recompute second first; ties by position (deterministic).
constexpr bool better(const candidate& x, const candidate& y) {
  const double sx = static_cast<double>(x.frees) * (y.seconds + 1e-12);
  const double sy = static_cast<double>(y.frees) * (x.seconds + 1e-12);
  if (sx != sy) return sx > sy;
  if (x.chain != y.chain) return x.chain < y.chain;
  return x.first < y.first;
}
}  // namespace detail_engine

/// The largest tile count the planner considers: beyond it chunks get small
/// enough that per-chunk overhead outweighs what one more halving saves.
inline constexpr int max_tiles = 64;

/// Input dimension a tiled run [a, b] is chunked along for `tiles` chunks: the
/// first dimension every slot treats row by row that has at least `tiles` rows
/// (dimension 0 first: its chunks are contiguous); -1 when there is none.
[[nodiscard]] constexpr int tile_dimension(std::span<const slot_cost> s, int a, int b, int tiles) {
  int dims = s[a].row_dims;
  for (int k = a; k <= b; ++k) dims = std::min(dims, s[k].row_dims);
  for (int d = 0; d < std::min<int>(dims, static_cast<int>(s[a].input_extents.size())); ++d)
    if (s[a].input_extents[static_cast<std::size_t>(d)] >= tiles) return d;
  return -1;
}

/// Tiling phase, when the projected peak is still above the target: the units
/// of row-independent slots (checkpointed runs, or kept slots, which tiling also
/// checkpoints) run over chunks. One count for all first: the smallest power of
/// two that meets the target, or, when none does, the smallest that reaches 90%
/// of the most any count saves (more chunks add per-chunk overhead for little).
/// Then each unit, first to last, takes the fewest chunks that keep that peak (or
/// the target): the peak is a maximum, and most units do not set it. Nothing is
/// tiled when it would save under 1% of the step's growth (the peak less the
/// static bytes, as for least_gain: on CUDA those hold the context, 0.8 GiB,
/// which no plan changes).
constexpr void assign_tiling(const std::vector<std::vector<slot_cost>>& chains, const std::vector<bool>& supported,
                             const engine_input& in, engine_plan& plan) {
  if (!in.tiling_allowed || plan.planned_peak <= plan.target_bytes) return;
  struct place {
    int chain;
    std::size_t index;
  };
  std::vector<place> places;
  for (int c = 0; c < static_cast<int>(chains.size()); ++c) {
    if (!supported[c]) continue;
    // A run of call-site units (a group, one outer call) is not tiled: the
    // outer call may do more than its units, row by row or not.
    const bool call_sites = static_cast<std::size_t>(c) < in.segment_limit.size() && in.segment_limit[c] == 1;
    for (std::size_t i = 0; i < plan.units[c].size(); ++i) {
      const auto& u = plan.units[c][i];
      if (call_sites && u.last > u.first) continue;
      if (!u.offloaded && !chains[c][u.first].mutates_input && tile_dimension(chains[c], u.first, u.last, 2) >= 0)
        places.push_back({c, i});
    }
  }
  // Unit p tiled `tiles` ways, or as far as its rows allow (1: as planned before).
  auto tiled = [&](std::vector<std::vector<unit>> units, place p, int tiles) {
    const auto& s = chains[p.chain];
    auto& u = units[p.chain][p.index];
    while (tiles > 1 && tile_dimension(s, u.first, u.last, tiles) < 0) tiles /= 2;
    if (tiles > 1) {
      u.checkpointed = true;
      u.tiles = tiles;
      u.tile_dim = tile_dimension(s, u.first, u.last, tiles);
    } else {
      u = plan.units[p.chain][p.index];
    }
    return units;
  };
  if (places.empty()) return;
  int counts[8] = {};
  std::int64_t peaks[8] = {};
  int n = 0;
  std::int64_t lowest = plan.planned_peak;
  for (int tiles = 2; tiles <= max_tiles && n < 8; tiles *= 2, ++n) {
    auto trial = plan.units;
    for (const auto& p : places) trial = tiled(std::move(trial), p, tiles);
    counts[n] = tiles;
    peaks[n] = project_model_peak(chains, trial, in.static_bytes);
    lowest = std::min(lowest, peaks[n]);
  }
  const auto most = plan.planned_peak - lowest;
  if (100 * most < plan.planned_peak - in.static_bytes) return;
  int pick = -1;
  for (int j = 0; j < n && pick < 0; ++j)
    if (peaks[j] <= plan.target_bytes) pick = j;
  for (int j = 0; j < n && pick < 0; ++j)
    if (10 * (plan.planned_peak - peaks[j]) >= 9 * most) pick = j;
  // Every unit at the chosen count, then each as few chunks as that peak allows.
  auto chosen = plan.units;
  std::vector<int> tiles_of(places.size(), counts[pick]);
  for (const auto& p : places) chosen = tiled(std::move(chosen), p, counts[pick]);
  for (std::size_t k = 0; k < places.size(); ++k) {
    while (tiles_of[k] > 1) {
      auto fewer = tiled(chosen, places[k], tiles_of[k] / 2);
      if (project_model_peak(chains, fewer, in.static_bytes) > std::max(peaks[pick], plan.target_bytes)) break;
      chosen = std::move(fewer);
      tiles_of[k] /= 2;
    }
  }
  // One decision per tiled unit, applied in chain order: each line's peak is the
  // plan's peak once it and the units before it are tiled.
  for (const auto& p : places) {
    const auto& u = chosen[p.chain][p.index];
    if (u.tiles <= 1) continue;
    const auto& s = chains[p.chain];
    auto next = plan.units;
    next[p.chain][p.index] = u;
    const auto peak = project_model_peak(chains, next, in.static_bytes);
    // What the unit's own backward no longer holds: (n - 1)/n of its run's working set.
    const auto r = project_plain_range(s, u.first, u.last, 0);
    const auto working = std::max(r.forward_peak, r.backward_peak);
    // A kept slot tiled is recomputed now; a checkpointed run was already, but
    // for a last slot whose backward needed only its input (each chunk runs it).
    const double recompute =
        run_forward_seconds(s, u.first, u.last) - unit_recompute_seconds(s, plan.units[p.chain][p.index]);
    plan.decisions.push_back({p.chain, u.first, u.last, true, rule_id::tile_segment, working - working / u.tiles,
                              recompute, plan.planned_peak, peak, false, 0.0, u.tiles, u.tile_dim});
    plan.units = std::move(next);
    plan.planned_peak = peak;
    plan.overall = rule_id::tile_segment;
  }
}

/// Each offload the plan applies, costed where the engine puts its bytes: a
/// step stores its offloads in forward order (chain, then slot), so the pinned
/// pool (engine_input::offload_fast_bytes) takes the first ones and the later
/// ones spill past it. The greedy phase takes them in another order (the
/// cheapest per second of compute first); this sets each one's transfer
/// (segment_decision::recompute_seconds) to its share in forward order. The
/// total is the same either way.
constexpr void cost_offloads_in_forward_order(const engine_input& in, engine_plan& plan) {
  std::int64_t before = 0;
  for (auto* d : offloads_in_forward_order(plan)) {
    const auto moved = std::max<std::int64_t>(0, d->freed_bytes);
    d->recompute_seconds = in.offload_transfer_seconds(moved, before);
    before += moved;
  }
}

/// Offload phase: while the projected peak is above the target, offload the
/// units (checkpointed runs or single slots) whose transfer is cheapest relative
/// to the compute it can hide behind, as long as that lowers the peak (by
/// least_offload_gain: R6 says where it would lower it by less) and the tiers
/// have room. Two passes, as for checkpointing.
constexpr void assign_offload(const std::vector<std::vector<slot_cost>>& chains, const std::vector<bool>& supported,
                              const engine_input& in, engine_plan& plan) {
  if (!in.offload_allowed || plan.planned_peak <= plan.target_bytes) return;
  struct option {
    int chain;
    std::size_t index;  // into plan.units[chain] (stable: offloading does not split units)
    double ratio;       // transfer seconds / compute seconds
    double transfer;
    double compute;
  };
  std::vector<option> options;
  for (int c = 0; c < static_cast<int>(chains.size()); ++c) {
    if (!supported[c]) continue;
    const auto& s = chains[c];
    for (std::size_t i = 0; i < plan.units[c].size(); ++i) {
      const auto& u = plan.units[c][i];
      auto alone = plan.units[c];
      alone[i].offloaded = true;
      const auto moved = project_chain(s, alone).offloaded_bytes - project_chain(s, plan.units[c]).offloaded_bytes;
      if (moved <= 0 || moved < in.offload_min_bytes) continue;  // nothing of its own the engine would move
      double compute = unit_recompute_seconds(s, u);
      for (int k = u.first; k <= u.last; ++k) compute += s[k].forward_seconds + s[k].backward_seconds;
      const double transfer = in.offload_transfer_seconds(moved);  // alone: ranks the options
      options.push_back({c, i, transfer / (compute + 1e-12), transfer, compute});
    }
  }
  std::sort(options.begin(), options.end(), [](const option& x, const option& y) {
    if (x.ratio != y.ratio) return x.ratio < y.ratio;
    if (x.chain != y.chain) return x.chain < y.chain;
    return x.index < y.index;
  });
  std::vector<bool> settled(options.size(), false);
  for (int pass = 0; pass < 2 && plan.planned_peak > plan.target_bytes; ++pass) {
    for (std::size_t o = 0; o < options.size() && plan.planned_peak > plan.target_bytes; ++o) {
      if (settled[o]) continue;
      const auto& opt = options[o];
      const unit u = plan.units[opt.chain][opt.index];
      auto trial = plan.units;
      trial[opt.chain][opt.index].offloaded = true;
      const auto peak = project_model_peak(chains, trial, in.static_bytes);
      const auto total = offloaded_bytes(chains, trial);
      const auto moved = total - offloaded_bytes(chains, plan.units);
      // On top of what the plan offloads already (cost_offloads_in_forward_order attributes it at the end).
      const double transfer = in.offload_transfer_seconds(moved, total - moved);
      if (plan.planned_peak - peak < least_offload_gain(plan, in, moved)) {
        if (pass == 1 && peak < plan.planned_peak)  // said once, where it would lower the peak at all
          plan.decisions.push_back({opt.chain, u.first, u.last, u.checkpointed, rule_id::keep_no_gain, moved,
                                    transfer, plan.planned_peak, peak, false, opt.compute});
        continue;
      }
      settled[o] = true;
      if (total > in.offload_budget_bytes) {
        plan.decisions.push_back({opt.chain, u.first, u.last, u.checkpointed, rule_id::offload_no_room, moved,
                                  transfer, plan.planned_peak, peak, false, opt.compute});
        continue;
      }
      plan.decisions.push_back({opt.chain, u.first, u.last, u.checkpointed, rule_id::offload_segment, moved,
                                transfer, plan.planned_peak, peak, true, opt.compute});
      plan.units = std::move(trial);
      plan.planned_peak = peak;
      plan.overall = rule_id::offload_segment;
    }
  }
  cost_offloads_in_forward_order(in, plan);
}

/// Offload of a model with no unit boundaries: one unit, the whole forward,
/// whose saved tensors go to the tiers as they are saved and come back in
/// backward as it needs them, so the step keeps at most
/// engine_input::whole_model_held_bytes of them (the groups in use and fetched
/// ahead) instead of all. What leaves is what offloading frees (its saved bytes
/// less slot_cost::offload_kept_bytes); where that is no more than the step
/// would hold, it is kept (R6).
constexpr void assign_whole_model_offload(const std::vector<std::vector<slot_cost>>& chains,
                                          const engine_input& in, engine_plan& plan) {
  if (!in.offload_allowed || plan.planned_peak <= plan.target_bytes || chains.size() != 1 || chains[0].size() != 1)
    return;
  const auto& s = chains[0][0];
  const auto moved = s.saved_bytes - std::min(s.offload_kept_bytes, s.saved_bytes);  // what leaves the device
  if (moved <= in.offload_min_bytes) return;
  const auto held = std::min(moved, in.whole_model_held_bytes);
  const auto peak = plan.planned_peak - (moved - held);
  const double transfer = in.offload_transfer_seconds(moved);
  const double compute = s.forward_seconds + s.backward_seconds;
  if (held >= moved) {  // backward would hold at once as much as offloading frees
    plan.decisions.push_back({0, 0, 0, false, rule_id::keep_no_gain, moved, transfer, plan.planned_peak,
                              plan.planned_peak, false, compute});
    return;
  }
  if (moved > in.offload_budget_bytes) {
    plan.decisions.push_back({0, 0, 0, false, rule_id::offload_no_room, moved, transfer, plan.planned_peak, peak,
                              false, compute});
    return;
  }
  plan.decisions.push_back({0, 0, 0, false, rule_id::offload_segment, moved, transfer, plan.planned_peak, peak, true,
                            compute});
  plan.units[0][0].offloaded = true;
  plan.planned_peak = peak;
  plan.overall = rule_id::offload_segment;
}

}  // namespace memscale::core

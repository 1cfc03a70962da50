// memscale — the memory model shared by the decision engine, the optimal-chain
// solver and the OOM predictor: given per-slot costs and which runs of slots are
// checkpointed, project a chain's live bytes through forward and backward.
// Everything here is constexpr over plain data (tests check it with static_assert).
#pragma once

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <span>
#include <vector>

#include <memscale/core/graph.hpp>

namespace memscale::core {

/// A run of consecutive slots [first, last] of one chain; checkpointed or kept
/// as is, and offloaded or not. An offloaded unit's saved tensors (for a
/// checkpoint: the input it keeps) leave the device after its forward and come
/// back for its backward. A checkpointed unit with tiles > 1 runs over that many
/// chunks of input dimension tile_dim, so one chunk's intermediates live at a time.
struct unit {
  int first = 0;
  int last = 0;
  bool checkpointed = false;
  bool offloaded = false;
  int tiles = 1;
  int tile_dim = 0;
  friend constexpr bool operator==(const unit&, const unit&) = default;
  friend std::ostream& operator<<(std::ostream& os, const unit& u) {
    os << (u.checkpointed ? "checkpoint " : "keep ") << u.first << ".." << u.last;
    if (u.tiles > 1) os << " x" << u.tiles << " tiles (dim " << u.tile_dim << ")";
    return os << (u.offloaded ? " +offload" : "");
  }
};

/// How many units of every chain have `flag` set (&unit::checkpointed, &unit::offloaded).
[[nodiscard]] constexpr int count_units(const std::vector<std::vector<unit>>& chains, bool unit::*flag) {
  int n = 0;
  for (const auto& units : chains)
    for (const auto& u : units) n += u.*flag ? 1 : 0;
  return n;
}

/// Bytes live (relative to the chain's start) at the end of forward, the peak,
/// and the bytes offloaded units move off the device per step.
struct chain_projection {
  std::int64_t forward_end = 0;
  std::int64_t peak = 0;
  std::int64_t offloaded_bytes = 0;
};

/// The plan that checkpoints nothing.
[[nodiscard]] constexpr std::vector<unit> keep_all(std::size_t slot_count) {
  std::vector<unit> units;
  for (int k = 0; k < static_cast<int>(slot_count); ++k) units.push_back({k, k, false, false, 1, 0});
  return units;
}

/// Slot k's input dies when k runs (not checkpointed) unless something keeps it:
/// k itself, the previous slot (saving its output, or k's input being a view),
/// or the caller (the chain's input, k == 0).
[[nodiscard]] constexpr std::int64_t freed_input_bytes(std::span<const slot_cost> s, int k,
                                                      bool previous_keeps_output) {
  if (k == 0 || previous_keeps_output || s[k].saves_input || s[k].output_is_view) return 0;
  return s[k].input_bytes;
}

/// Whether slot k, run un-checkpointed, keeps its output's storage alive for the next slot.
[[nodiscard]] constexpr bool keeps_output(const slot_cost& s) noexcept {
  return s.saves_output || s.output_is_view;
}

/// Whether slot k's output is still live while k runs its backward: k keeps it
/// (saves it, or returns a view), or it reaches the chain's end through views
/// only (an in-place ReLU, a Flatten: a caller may hold the model's output
/// through backward). Else the slot after it saved it and has freed it once its
/// own backward was done, or never saved it.
[[nodiscard]] constexpr bool output_held_in_backward(std::span<const slot_cost> s, int k) {
  if (keeps_output(s[static_cast<std::size_t>(k)])) return true;
  for (auto j = static_cast<std::size_t>(k) + 1; j < s.size(); ++j)
    if (!s[j].output_is_view) return false;
  return true;
}

/// Bytes live while slot k, kept as it is, runs its backward, from `after`
/// (live once its forward was done): its output's gradient, its input's, its
/// workspace, and its output itself only where output_held_in_backward (on a
/// double-convolution block, counting it always was one activation over).
[[nodiscard]] constexpr std::int64_t kept_backward_peak(std::span<const slot_cost> s, int k, std::int64_t after) {
  const auto& c = s[static_cast<std::size_t>(k)];
  return after - (output_held_in_backward(s, k) ? 0 : c.output_bytes) + c.output_bytes + c.input_bytes +
         c.backward_extra_bytes();
}

/// Live-memory figures of running slots [a, b] as a plain (un-checkpointed) chain
/// starting at `live` bytes, with slot a's input held by someone else.
struct range_projection {
  std::int64_t forward_end = 0;
  std::int64_t forward_peak = 0;
  std::int64_t backward_peak = 0;
};

[[nodiscard]] constexpr range_projection project_plain_range(std::span<const slot_cost> s, int a, int b,
                                                            std::int64_t live) {
  range_projection r{live, live, live};
  bool previous_keeps = true;  // slot a's input is held (by the caller or a checkpoint)
  for (int k = a; k <= b; ++k) {
    r.forward_peak = std::max(r.forward_peak, live + s[k].kept_bytes() + s[k].workspace_bytes);
    live += s[k].kept_bytes() - freed_input_bytes(s, k, previous_keeps);
    previous_keeps = keeps_output(s[k]);
    // Backward of k runs while everything up to k is alive, plus the incoming
    // and outgoing gradients (later slots are freed by then).
    r.backward_peak =
        std::max(r.backward_peak, live + s[k].output_bytes + s[k].input_bytes + s[k].backward_extra_bytes());
  }
  r.forward_end = live;
  return r;
}

/// Forward peak of a checkpointed run: under no-grad only one slot's input,
/// output and workspace are alive at a time.
[[nodiscard]] constexpr std::int64_t checkpointed_forward_extra(std::span<const slot_cost> s, int a, int b) {
  std::int64_t extra = 0;
  for (int k = a; k <= b; ++k)
    extra = std::max(extra, (k > a ? s[k].input_bytes : 0) + s[k].output_bytes + s[k].workspace_bytes);
  return extra;
}

/// What a checkpointed run [a, b] keeps of its forward for its recompute, from
/// its forward to its backward: its random draws (slot_cost::replay_kept_bytes)
/// and, where its slots keep products, their outputs but the one the run
/// returns (a tiled run keeps none).
[[nodiscard]] constexpr std::int64_t run_replay_kept_bytes(std::span<const slot_cost> s, int a, int b) {
  std::int64_t bytes = 0;
  for (int k = a; k <= b; ++k) bytes += s[k].replay_kept_bytes + (s[k].keeps_products ? s[k].product_kept_bytes : 0);
  if (s[b].keeps_products) bytes -= s[b].returned_product_bytes;
  return bytes;
}

/// Peak of a checkpointed run's backward (its recompute with grad, then its
/// gradients), from `live` bytes that hold its input. A last slot with
/// backward_from_input is not run again; what its backward holds instead: its
/// output's gradient throughout, and, from when its own gradients are taken,
/// its recomputed input and that input's gradient through the backward of the
/// slots before it. (Not modelled, here as for any run: the parameters'
/// gradients, held until the run's backward returns.)
[[nodiscard]] constexpr std::int64_t checkpoint_backward_peak(std::span<const slot_cost> s, int a, int b,
                                                              std::int64_t live) {
  if (!s[b].backward_from_input) {
    const auto r = project_plain_range(s, a, b, live);
    return std::max(r.forward_peak, r.backward_peak);
  }
  const std::int64_t output_grad = s[b].output_bytes;
  std::int64_t end = live, peak = live;
  if (b > a) {
    const auto r = project_plain_range(s, a, b - 1, live);
    end = r.forward_end;
    // Slot b - 1's backward: its output (b's input) and its gradient are in
    // project_plain_range's figure; before it they are held on top.
    const auto& p = s[b - 1];
    peak = std::max({r.forward_peak, end + p.output_bytes + p.input_bytes + p.backward_extra_bytes()});
    if (b - 1 > a)
      peak = std::max(peak, project_plain_range(s, a, b - 2, live).backward_peak + 2 * s[b].input_bytes);
    peak += output_grad;
  }
  // Its own backward: a kept slot's, from its forward's end with the run's
  // output made, so a run of the Linear alone frees nothing.
  return std::max(peak, kept_backward_peak(s, b, end + s[b].output_bytes));
}

/// One unit's forward or backward in a projected step: the bytes live while it
/// runs at most (`peak`) and once it is done (`after`), from the chain's start.
struct step_point {
  int unit = 0;
  bool backward = false;
  std::int64_t peak = 0;
  std::int64_t after = 0;
};

/// Projects one chain under a plan. `units` must cover the slots in order.
/// Offloaded units keep nothing on the device after their forward but their
/// output; in backward their saved bytes return, and (prefetching) so do those
/// of the offloaded unit before them. `trace`: also each unit's step_points,
/// forward in order, then backward in reverse (the Report's timeline).
[[nodiscard]] constexpr chain_projection project_chain(std::span<const slot_cost> s, std::span<const unit> units,
                                                       std::vector<step_point>* trace = nullptr) {
  std::int64_t live = s.empty() ? 0 : s[0].made_before_bytes;
  std::int64_t peak = 0;
  std::int64_t moved = 0;
  bool previous_keeps = true;
  std::vector<std::int64_t> before(units.size(), 0);
  std::vector<std::int64_t> restored(units.size(), 0);  // bytes an offloaded unit moves out and back
  std::vector<std::int64_t> returned(units.size(), 0);  // ... of which forward's live count no longer holds
  for (std::size_t i = 0; i < units.size(); ++i) {
    const auto& u = units[i];
    before[i] = live;
    const auto peak_before_unit = peak;
    peak = 0;  // this unit's own, merged below
    if (u.checkpointed) {
      // Tiled: the whole output is allocated up front, one chunk's work at a time.
      const auto extra = u.tiles > 1 ? s[u.last].output_bytes + checkpointed_forward_extra(s, u.first, u.last) / u.tiles
                                     : checkpointed_forward_extra(s, u.first, u.last);
      const auto masks = u.tiles > 1 ? 0 : run_replay_kept_bytes(s, u.first, u.last);
      peak = std::max(peak, live + extra + masks);
      live += s[u.last].output_bytes + masks;  // only the run's output (and its masks) survive forward
      // Offloaded, the kept input leaves too, unless someone else holds it.
      if (u.offloaded && u.first > 0 && !previous_keeps) {
        restored[i] = returned[i] = s[u.first].input_bytes;
        live -= restored[i];
      }
      previous_keeps = false;  // a checkpoint does not save its output
    } else {
      const int k = u.first;
      peak = std::max(peak, live + s[k].kept_bytes() + s[k].workspace_bytes);
      if (u.offloaded) {
        // What it saved leaves but for what offloading cannot free (views the
        // engine keeps, storages held elsewhere); its input dies unless the
        // previous slot keeps it.
        const std::int64_t freed = (k > 0 && !previous_keeps && !s[k].output_is_view) ? s[k].input_bytes : 0;
        const auto stays = std::min(s[k].offload_kept_bytes, s[k].saved_bytes);
        live += (s[k].output_is_view ? 0 : s[k].output_bytes) + stays - freed;
        restored[i] = s[k].saved_bytes - stays + (s[k].saves_input ? s[k].input_bytes : 0) +
                      (s[k].saves_output ? s[k].output_bytes : 0);
        // The output (and an input nobody freed) still count as live below.
        returned[i] = s[k].saved_bytes - stays + (s[k].saves_input ? freed : 0);
        previous_keeps = false;
      } else {
        live += s[k].kept_bytes() - freed_input_bytes(s, k, previous_keeps);
        previous_keeps = keeps_output(s[k]);
      }
    }
    moved += restored[i];
    if (trace) trace->push_back({static_cast<int>(i), false, std::max(peak, live), live});
    peak = std::max(peak, peak_before_unit);
  }
  const std::int64_t forward_end = live;
  for (std::size_t i = units.size(); i-- > 0;) {
    const auto& u = units[i];
    const std::int64_t prefetched = (i > 0 && units[i - 1].offloaded) ? returned[i - 1] : 0;
    const auto peak_before_unit = peak;
    peak = 0;
    if (u.checkpointed) {
      // Backward of a checkpoint recomputes the run with grad, then runs its
      // backward; before[i] counts its input, offloaded or not (it is back).
      if (u.tiles > 1) {
        // Per chunk: its recompute and gradients, a tiles-th of the run's; beside
        // them the whole output gradient and the input gradient being filled.
        const auto r = project_plain_range(s, u.first, u.last, 0);
        peak = std::max(peak, before[i] + prefetched + s[u.last].output_bytes + s[u.first].input_bytes +
                                  std::max(r.forward_peak, r.backward_peak) / u.tiles);
      } else {
        peak = std::max(peak, checkpoint_backward_peak(s, u.first, u.last, before[i]) + prefetched +
                                  run_replay_kept_bytes(s, u.first, u.last));
      }
    } else {
      const int k = u.first;
      const std::int64_t after = (i + 1 < units.size()) ? before[i + 1] : forward_end;
      peak = std::max(peak, kept_backward_peak(s, k, after) + returned[i] + prefetched);
    }
    if (trace) trace->push_back({static_cast<int>(i), true, peak, before[i]});
    peak = std::max(peak, peak_before_unit);
  }
  return {forward_end, peak, moved};
}

/// Bytes a plan's offloaded units move off the device (and back) per step.
[[nodiscard]] constexpr std::int64_t offloaded_bytes(const std::vector<std::vector<slot_cost>>& chains,
                                                    const std::vector<std::vector<unit>>& plans) {
  std::int64_t bytes = 0;
  for (std::size_t c = 0; c < chains.size(); ++c) bytes += project_chain(chains[c], plans[c]).offloaded_bytes;
  return bytes;
}

/// Peak of the whole step: chains run one after another; what earlier chains
/// keep stays alive while later ones run. `static_bytes`: parameters, gradients,
/// optimizer state, buffers.
[[nodiscard]] constexpr std::int64_t project_model_peak(const std::vector<std::vector<slot_cost>>& chains,
                                                       const std::vector<std::vector<unit>>& plans,
                                                       std::int64_t static_bytes) {
  std::int64_t kept_by_earlier = 0;
  std::int64_t peak = 0;
  for (std::size_t c = 0; c < chains.size(); ++c) {
    const auto p = project_chain(chains[c], plans[c]);
    peak = std::max(peak, kept_by_earlier + p.peak);
    kept_by_earlier += p.forward_end;
  }
  return static_bytes + peak;
}

/// Forward time of slots [first, last]: what recomputing them costs.
[[nodiscard]] constexpr double run_forward_seconds(std::span<const slot_cost> s, int first, int last) {
  double seconds = 0.0;
  for (int k = first; k <= last; ++k) seconds += s[k].forward_seconds;
  return seconds;
}

/// Forward time a checkpointed run [first, last] spends recomputing in backward:
/// every slot's recompute_seconds but that of a last slot with
/// backward_from_input, whose gradients come from its recomputed input.
[[nodiscard]] constexpr double checkpoint_recompute_seconds(std::span<const slot_cost> s, int first, int last) {
  double seconds = 0.0;
  for (int k = first; k <= (s[last].backward_from_input ? last - 1 : last); ++k)
    seconds += k == last ? s[k].last_recompute_seconds() : s[k].recompute_seconds();
  return seconds;
}

/// What a unit recomputes: nothing kept; a tiled run all of its slots (each
/// chunk runs them all); a checkpointed run checkpoint_recompute_seconds.
[[nodiscard]] constexpr double unit_recompute_seconds(std::span<const slot_cost> s, const unit& u) {
  if (!u.checkpointed) return 0.0;
  return u.tiles > 1 ? run_forward_seconds(s, u.first, u.last) : checkpoint_recompute_seconds(s, u.first, u.last);
}

/// Extra forward time a plan spends recomputing checkpointed runs.
[[nodiscard]] constexpr double recompute_seconds(std::span<const slot_cost> s, std::span<const unit> units) {
  double seconds = 0.0;
  for (const auto& u : units) seconds += unit_recompute_seconds(s, u);
  return seconds;
}

/// The same over every chain of a model (`units` indexed like `chains`).
[[nodiscard]] constexpr double recompute_seconds(const std::vector<std::vector<slot_cost>>& chains,
                                                 const std::vector<std::vector<unit>>& units) {
  double seconds = 0.0;
  for (std::size_t c = 0; c < chains.size() && c < units.size(); ++c) seconds += recompute_seconds(chains[c], units[c]);
  return seconds;
}

/// Replaces the units covering [first, last] by one checkpointed unit (not
/// offloaded). The range must not overlap another checkpointed unit.
[[nodiscard]] constexpr std::vector<unit> with_checkpoint(std::span<const unit> units, int first, int last) {
  std::vector<unit> out;
  for (const auto& u : units) {
    if (u.last < first || u.first > last) {
      out.push_back(u);
    } else if (u.first == first) {
      out.push_back({first, last, true, false, 1, 0});
    }
  }
  return out;
}

}  // namespace memscale::core

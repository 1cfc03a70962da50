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

/// A run of consecutive slots [first, last] of one chain; checkpointed or kept as is.
struct unit {
  int first = 0;
  int last = 0;
  bool checkpointed = false;
  friend constexpr bool operator==(const unit&, const unit&) = default;
  friend std::ostream& operator<<(std::ostream& os, const unit& u) {
    return os << (u.checkpointed ? "checkpoint " : "keep ") << u.first << ".." << u.last;
  }
};

/// Bytes live (relative to the chain's start) at the end of forward, and the peak.
struct chain_projection {
  std::int64_t forward_end = 0;
  std::int64_t peak = 0;
};

/// The plan that checkpoints nothing.
[[nodiscard]] constexpr std::vector<unit> keep_all(std::size_t slot_count) {
  std::vector<unit> units;
  for (int k = 0; k < static_cast<int>(slot_count); ++k) units.push_back({k, k, false});
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
        std::max(r.backward_peak, live + s[k].output_bytes + s[k].input_bytes + s[k].workspace_bytes);
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

/// Projects one chain under a plan. `units` must cover the slots in order.
[[nodiscard]] constexpr chain_projection project_chain(std::span<const slot_cost> s,
                                                       std::span<const unit> units) {
  std::int64_t live = 0;
  std::int64_t peak = 0;
  bool previous_keeps = true;
  std::vector<std::int64_t> before(units.size(), 0);
  for (std::size_t i = 0; i < units.size(); ++i) {
    const auto& u = units[i];
    before[i] = live;
    if (u.checkpointed) {
      peak = std::max(peak, live + checkpointed_forward_extra(s, u.first, u.last));
      live += s[u.last].output_bytes;  // only the run's output survives forward
      previous_keeps = false;          // a checkpoint does not save its output
    } else {
      const int k = u.first;
      peak = std::max(peak, live + s[k].kept_bytes() + s[k].workspace_bytes);
      live += s[k].kept_bytes() - freed_input_bytes(s, k, previous_keeps);
      previous_keeps = keeps_output(s[k]);
    }
  }
  const std::int64_t forward_end = live;
  for (std::size_t i = units.size(); i-- > 0;) {
    const auto& u = units[i];
    if (u.checkpointed) {
      // Backward of a checkpoint recomputes the run with grad, then runs its backward.
      const auto r = project_plain_range(s, u.first, u.last, before[i]);
      peak = std::max({peak, r.forward_peak, r.backward_peak});
    } else {
      const int k = u.first;
      const std::int64_t after = (i + 1 < units.size()) ? before[i + 1] : forward_end;
      peak = std::max(peak, after + s[k].output_bytes + s[k].input_bytes + s[k].workspace_bytes);
    }
  }
  return {forward_end, peak};
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

/// Extra forward time a plan spends recomputing checkpointed runs.
[[nodiscard]] constexpr double recompute_seconds(std::span<const slot_cost> s, std::span<const unit> units) {
  double seconds = 0.0;
  for (const auto& u : units)
    if (u.checkpointed)
      for (int k = u.first; k <= u.last; ++k) seconds += s[k].forward_seconds;
  return seconds;
}

/// Replaces the units covering [first, last] by one checkpointed unit. The range
/// must not overlap another checkpointed unit.
[[nodiscard]] constexpr std::vector<unit> with_checkpoint(std::span<const unit> units, int first, int last) {
  std::vector<unit> out;
  for (const auto& u : units) {
    if (u.last < first || u.first > last) {
      out.push_back(u);
    } else if (u.first == first) {
      out.push_back({first, last, true});
    }
  }
  return out;
}

}  // namespace memscale::core

// memscale — the yardstick for the rule engine: the optimal segmentation of one
// chain under a memory budget (the dynamic program of Rotor, "Optimal
// checkpointing for heterogeneous chains", restricted to the one-level
// segment checkpointing the executor can apply). It minimizes recompute time
// subject to the projected peak of core/memory_model.hpp staying within budget.
// Live bytes are rounded up to `budget / buckets` after every unit, so a plan it
// returns always fits, but a plan whose exact peak is within n x (budget / buckets)
// of the budget may be missed: give that much slack, or buckets = budget (exact).
// With max_run > 0 no checkpointed run spans more than max_run slots (a chain of
// call sites has 1: user code runs between its units), except the runs
// group_end allows: where group_end[i] > i, the run [i, group_end[i]] (a group of
// units one outer call holds, checkpointed as that call).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include <memscale/core/memory_model.hpp>

namespace memscale::core {

struct optimal_plan {
  bool feasible = false;
  double recompute_seconds = 0.0;
  std::vector<unit> units;
  std::int64_t peak = 0;  ///< exact projected peak of `units`
};

[[nodiscard]] constexpr optimal_plan optimal_segmentation(std::span<const slot_cost> s, std::int64_t budget,
                                                         int buckets = 1024, int max_run = 0,
                                                         std::span<const int> group_end = {}) {
  constexpr double infeasible = std::numeric_limits<double>::infinity();
  const int n = static_cast<int>(s.size());
  optimal_plan result;
  if (n == 0) {
    result.feasible = true;
    return result;
  }
  if (budget <= 0) return result;
  const std::int64_t quantum = budget / buckets > 0 ? budget / buckets : 1;
  const int levels = static_cast<int>((budget + quantum - 1) / quantum) + 1;  // covers a partial last bucket
  auto level_of = [&](std::int64_t live) {
    return live <= 0 ? 0 : static_cast<int>((live + quantum - 1) / quantum);
  };

  // Checkpointed run [a, b] starting at live = 0; shifting by the live bytes is
  // exact. plain_peak (the run as if its last slot were recomputed too) only
  // grows with b and bounds every longer run's peak from below; run_peak is
  // lower where the last slot's backward needs only its input.
  std::vector<std::int64_t> run_peak(static_cast<std::size_t>(n) * n, 0);
  std::vector<std::int64_t> plain_peak(static_cast<std::size_t>(n) * n, 0);
  std::vector<double> run_seconds(static_cast<std::size_t>(n) * n, 0.0);
  for (int a = 0; a < n; ++a) {
    double seconds = 0.0;  // the recomputes of a..b-1
    for (int b = a; b < n; ++b) {
      const auto r = project_plain_range(s, a, b, 0);
      const auto forward_extra = checkpointed_forward_extra(s, a, b);
      plain_peak[a * n + b] = std::max({forward_extra, r.forward_peak, r.backward_peak});
      run_peak[a * n + b] = std::max(forward_extra, checkpoint_backward_peak(s, a, b, 0)) + run_replay_kept_bytes(s, a, b);
      run_seconds[a * n + b] = s[b].backward_from_input ? seconds : seconds + s[b].last_recompute_seconds();
      seconds += s[b].recompute_seconds();
    }
  }

  // cost[i][level][previous keeps output] = least recompute for slots i.., given live bytes.
  auto index = [&](int i, int level, int keeps) {
    return (static_cast<std::size_t>(i) * levels + level) * 2 + keeps;
  };
  std::vector<double> cost(static_cast<std::size_t>(n + 1) * levels * 2, infeasible);
  std::vector<int> choice(cost.size(), -2);  // -1: keep slot i; j >= i: checkpoint [i, j]
  for (int level = 0; level < levels; ++level)
    for (int keeps = 0; keeps < 2; ++keeps) cost[index(n, level, keeps)] = 0.0;

  for (int i = n - 1; i >= 0; --i) {
    for (int level = 0; level < levels; ++level) {
      const std::int64_t live = static_cast<std::int64_t>(level) * quantum;
      for (int keeps = 0; keeps < 2; ++keeps) {
        double best = infeasible;
        int best_choice = -2;
        // Keep slot i as it is.
        const auto& slot = s[i];
        const std::int64_t after = live + slot.kept_bytes() - freed_input_bytes(s, i, keeps == 1);
        const std::int64_t keep_peak =
            std::max(live + slot.kept_bytes() + slot.workspace_bytes, kept_backward_peak(s, i, after));
        if (keep_peak <= budget && after <= budget) {
          const double c = cost[index(i + 1, level_of(after), keeps_output(slot) ? 1 : 0)];
          if (c < best) {
            best = c;
            best_choice = -1;
          }
        }
        // Checkpoint [i, j], unless slot i modifies its input in place. Every
        // run longer than [i, j - 1] recomputes all of it: once that is over
        // budget, the search ends.
        const int end = max_run > 0 ? std::min(n, i + max_run) : n;
        const auto try_run = [&](int j) {
          if (live + run_peak[i * n + j] > budget) return;
          const std::int64_t next = live + s[j].output_bytes + run_replay_kept_bytes(s, i, j);
          if (next > budget) return;
          const double c = run_seconds[i * n + j] + cost[index(j + 1, level_of(next), 0)];
          if (c < best) {
            best = c;
            best_choice = j;
          }
        };
        for (int j = i; j < end && !s[i].mutates_input; ++j) {
          if (j > i && live + plain_peak[i * n + j - 1] > budget) break;
          try_run(j);
        }
        // A group's run, where the runs above stop short of it.
        if (static_cast<std::size_t>(i) < group_end.size() && !s[i].mutates_input) {
          const int g = group_end[static_cast<std::size_t>(i)];
          if (g >= end && g < n && live + plain_peak[i * n + g - 1] <= budget) try_run(g);
        }
        cost[index(i, level, keeps)] = best;
        choice[index(i, level, keeps)] = best_choice;
      }
    }
  }

  // The chain starts with what the model's code made before it held.
  const std::int64_t start = s[0].made_before_bytes;
  if (start > budget || cost[index(0, level_of(start), 1)] == infeasible) return result;
  std::int64_t live = start;
  int keeps = 1;
  for (int i = 0; i < n;) {
    const int c = choice[index(i, level_of(live), keeps)];
    live = static_cast<std::int64_t>(level_of(live)) * quantum;
    if (c == -1) {
      result.units.push_back({i, i, false, false});
      live += s[i].kept_bytes() - freed_input_bytes(s, i, keeps == 1);
      keeps = keeps_output(s[i]) ? 1 : 0;
      ++i;
    } else {
      result.units.push_back({i, c, true, false});
      live += s[c].output_bytes + run_replay_kept_bytes(s, i, c);
      keeps = 0;
      i = c + 1;
    }
  }
  result.feasible = true;
  result.recompute_seconds = recompute_seconds(s, result.units);
  result.peak = project_chain(s, result.units).peak;
  return result;
}

}  // namespace memscale::core

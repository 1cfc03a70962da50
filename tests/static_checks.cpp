// Compile-time checks: compiling this file is passing. The decision rules, the
// memory model and the optimal-chain DP run in constexpr on synthetic chains;
// the Technique concept accepts techniques and rejects other types.
#include <memscale/core/decision_engine.hpp>
#include <memscale/core/memory_model.hpp>
#include <memscale/core/optimal_chain.hpp>
#include <memscale/techniques/concepts.hpp>
#include <memscale/techniques/strategy.hpp>

namespace {

using namespace memscale::core;
using memscale::slot_cost;

// A block keeps its input (10) and 90 bytes inside; its output is 10 bytes.
constexpr slot_cost block{.input_bytes = 10, .output_bytes = 10, .saved_bytes = 90, .saves_input = true,
                          .forward_seconds = 1.0};
// A primitive layer keeps its input only.
constexpr slot_cost primitive{.input_bytes = 10, .output_bytes = 10, .saves_input = true, .forward_seconds = 1.0};

constexpr std::vector<slot_cost> chain_of(slot_cost s, int n) { return std::vector<slot_cost>(n, s); }

constexpr std::int64_t baseline_peak(slot_cost s, int n) {
  const auto c = chain_of(s, n);
  return project_chain(c, keep_all(c.size())).peak;
}
constexpr std::int64_t all_checkpointed_peak(slot_cost s, int n, int length) {
  const auto c = chain_of(s, n);
  return project_chain(c, segments_of_length(c, length)).peak;
}

// Four blocks kept: 4 x (10 + 90) = 400 live at the end of forward, plus the
// last block's incoming and outgoing gradients (10 + 10).
static_assert(baseline_peak(block, 4) == 420);
// Checkpointing every block: three 10-byte outputs live while the last block is
// recomputed (100) with its gradients (20).
static_assert(all_checkpointed_peak(block, 4, 1) == 30 + 100 + 20);
// Blocks are checkpointed one by one. Nine primitives: one-slot segments save
// nothing (110, as the baseline), one nine-slot segment neither; lengths 2 to 5
// tie at 70 and the shortest wins.
static_assert([] { auto c = chain_of(block, 4); return choose_segment_length(c); }() == 1);
static_assert(all_checkpointed_peak(primitive, 9, 1) == baseline_peak(primitive, 9));
static_assert(all_checkpointed_peak(primitive, 9, 9) == baseline_peak(primitive, 9));
static_assert(all_checkpointed_peak(primitive, 9, 3) == 70);
static_assert([] { auto c = chain_of(primitive, 9); return choose_segment_length(c); }() == 2);
// A chain of call sites (segment limit 1): user code runs between units, so no
// segment spans two, not even in the refinement that extends kept runs.
static_assert([] { auto c = chain_of(primitive, 9); return choose_segment_length(c, 1); }() == 1);
static_assert([] {
  engine_input in{memscale::OptimizationMode::Aggressive, true, true, 1000, 0};
  in.segment_limit = {1};
  const auto p = decide({chain_of(primitive, 9)}, {true}, in);
  for (const auto& u : p.units[0])
    if (u.first != u.last) return false;
  return true;
}());
// A whole model (no boundaries) offloads as one unit and keeps what backward
// holds of its saved bytes at once: 90 saved, 40 held (two prefetch groups of 20) -> 50 fewer at the peak.
static_assert([] {
  engine_input in{memscale::OptimizationMode::Aggressive, false, true, 1000, 0};
  in.offload_allowed = true;
  in.offload_budget_bytes = 1000;
  in.whole_model_held_bytes = 40;
  const auto p = decide({chain_of(block, 1)}, {true}, in);
  return p.units[0][0].offloaded && p.baseline_peak - p.planned_peak == 50;
}());

constexpr engine_plan plan_for(memscale::OptimizationMode mode, std::int64_t usable, bool force = false) {
  return decide({chain_of(block, 4)}, {true}, engine_input{mode, true, force, usable, 0});
}
// Pressure 420 / 1000 = 0.42: Balanced skips, Aggressive acts, force_optimize overrides.
static_assert(plan_for(memscale::OptimizationMode::Balanced, 1000).overall == rule_id::low_pressure_skip);
static_assert(plan_for(memscale::OptimizationMode::Aggressive, 1000).overall == rule_id::checkpoint_segment);
static_assert(plan_for(memscale::OptimizationMode::Balanced, 1000, true).overall == rule_id::checkpoint_segment);
// ... and forced where nothing presses it is the light touch, not nothing: Balanced
// at least halves the growth (static bytes are 0 here), Conservative cuts it to 3/4.
static_assert([] {
  const auto p = plan_for(memscale::OptimizationMode::Balanced, 1000, true);
  int segments = 0;
  for (const auto& u : p.units[0]) segments += u.checkpointed ? 1 : 0;
  return segments > 0 && p.planned_peak <= p.baseline_peak / 2 && p.target_bytes == p.baseline_peak / 2;
}());
static_assert([] {
  const auto p = plan_for(memscale::OptimizationMode::Conservative, 1000, true);
  return p.planned_peak < p.baseline_peak && p.planned_peak <= p.baseline_peak * 3 / 4;
}());
// Under pressure the forced plan aims at the lower of the mode's target (400)
// and the light touch's (3/4 of 420): no lighter than the unforced plan.
static_assert(plan_for(memscale::OptimizationMode::Conservative, 400, true).target_bytes == 315);
static_assert(plan_for(memscale::OptimizationMode::Conservative, 400, true).planned_peak <=
              plan_for(memscale::OptimizationMode::Conservative, 400).planned_peak);
// Aggressive checkpoints every block but the last (recomputing it first thing in
// backward would lower nothing): peak 30 + 100 + 20 = 150 -> here 3 x 10 + 100 + 20.
static_assert(plan_for(memscale::OptimizationMode::Aggressive, 1000).planned_peak == 150);
static_assert([] {
  const auto p = plan_for(memscale::OptimizationMode::Aggressive, 1000);
  int segments = 0;
  for (const auto& u : p.units[0]) segments += u.checkpointed ? 1 : 0;
  return segments;
}() == 3);
// Under pressure 1.05 Conservative stops once the projected peak fits.
static_assert([] {
  const auto p = plan_for(memscale::OptimizationMode::Conservative, 400);
  return p.planned_peak <= 400 && p.planned_peak > 150;
}());

// Offload (R8/R9): it acts only after checkpointing, only while above the target.
constexpr engine_plan offload_plan(memscale::OptimizationMode mode, std::int64_t usable, bool checkpointing,
                                   std::int64_t room) {
  engine_input in{mode, checkpointing, false, usable, 0};
  in.offload_allowed = true;
  in.offload_budget_bytes = room;
  in.offload_bytes_per_second = 100.0;
  return decide({chain_of(block, 4)}, {true}, in);
}
constexpr int offloaded(const engine_plan& p) {
  int n = 0;
  for (const auto& u : p.units[0]) n += u.offloaded ? 1 : 0;
  return n;
}
constexpr bool has_rule(const engine_plan& p, rule_id r) {
  for (const auto& d : p.decisions)
    if (d.rule == r) return true;
  return false;
}
// Of what it saves, what offloading cannot free stays (slot_cost::offload_kept_bytes,
// the profile's census): 30 of the 90 stay, 60 leave, 40 held -> 20 fewer; with 60
// staying, the 30 that leave are no more than backward holds: kept, R6 says why.
constexpr engine_plan whole_model_plan(std::int64_t kept) {
  engine_input in{memscale::OptimizationMode::Aggressive, false, true, 1000, 0};
  in.offload_allowed = true;
  in.offload_budget_bytes = 1000;
  in.whole_model_held_bytes = 40;
  auto s = block;
  s.offload_kept_bytes = kept;
  return decide({chain_of(s, 1)}, {true}, in);
}
static_assert(whole_model_plan(30).units[0][0].offloaded);
static_assert(whole_model_plan(30).baseline_peak - whole_model_plan(30).planned_peak == 20);
static_assert(!whole_model_plan(60).units[0][0].offloaded);
static_assert(whole_model_plan(60).planned_peak == whole_model_plan(60).baseline_peak);
static_assert(has_rule(whole_model_plan(60), rule_id::keep_no_gain));
// In a chain, an offloaded block keeps what offloading cannot free live through
// the forward: four blocks with the last two offloaded end forward 2 x 30 higher
// with 30 of their 90 staying, and move 2 x 60 instead of 2 x 90 (their inputs
// return as well: 2 x 10).
constexpr chain_projection last_two_offloaded(std::int64_t kept) {
  auto s = block;
  s.offload_kept_bytes = kept;
  const auto c = chain_of(s, 4);
  auto units = keep_all(c.size());
  units[2].offloaded = units[3].offloaded = true;
  return project_chain(c, units);
}
static_assert(last_two_offloaded(30).forward_end - last_two_offloaded(0).forward_end == 60);
static_assert(last_two_offloaded(0).offloaded_bytes - last_two_offloaded(30).offloaded_bytes == 60);
// Aggressive: checkpointing reaches 150, offloading the kept block inputs goes lower.
static_assert(offloaded(offload_plan(memscale::OptimizationMode::Aggressive, 1000, true, 1 << 20)) > 0);
static_assert(offload_plan(memscale::OptimizationMode::Aggressive, 1000, true, 1 << 20).planned_peak < 150);
static_assert(has_rule(offload_plan(memscale::OptimizationMode::Aggressive, 1000, true, 1 << 20),
                       rule_id::offload_segment));
// No room in the tiers: nothing offloaded, R9 says why, the checkpoint plan stands.
static_assert(offloaded(offload_plan(memscale::OptimizationMode::Aggressive, 1000, true, 0)) == 0);
static_assert(has_rule(offload_plan(memscale::OptimizationMode::Aggressive, 1000, true, 0), rule_id::offload_no_room));
static_assert(offload_plan(memscale::OptimizationMode::Aggressive, 1000, true, 0).planned_peak == 150);
// Balanced where checkpointing meets the target (pressure 0.84, target 450): no offload.
static_assert(offloaded(offload_plan(memscale::OptimizationMode::Balanced, 500, true, 1 << 20)) == 0);
// Checkpointing excluded: offloading alone lowers the peak below the baseline 420.
static_assert([] {
  const auto p = offload_plan(memscale::OptimizationMode::Aggressive, 1000, false, 1 << 20);
  for (const auto& u : p.units[0])
    if (u.checkpointed) return false;
  return offloaded(p) > 0 && p.planned_peak < 420;
}());

// Tiling (R10): blocks whose rows are independent along two dimensions of
// extents 8 and 16. Tiling also takes the kept last block, whose backward is the
// checkpointed plan's peak (150).
constexpr slot_cost row_block{.input_bytes = 10, .output_bytes = 10, .saved_bytes = 90, .saves_input = true,
                              .forward_seconds = 1.0, .row_dims = 2, .input_extents = {8, 16, 0, 0}};
static_assert(tile_dimension(chain_of(row_block, 1), 0, 0, 8) == 0);   // dimension 0 first
static_assert(tile_dimension(chain_of(row_block, 1), 0, 0, 16) == 1);  // ... else the next with the rows
static_assert(tile_dimension(chain_of(row_block, 1), 0, 0, 32) == -1);
static_assert(tile_dimension(chain_of(block, 1), 0, 0, 2) == -1);      // rows not independent
constexpr engine_plan tile_plan(memscale::OptimizationMode mode, std::int64_t usable, bool tiling,
                                slot_cost s = row_block) {
  engine_input in{mode, true, false, usable, 0};
  in.tiling_allowed = tiling;
  return decide({chain_of(s, 4)}, {true}, in);
}
constexpr int tiled(const engine_plan& p) {
  int n = 0;
  for (const auto& u : p.units[0]) n += u.tiles > 1 && u.checkpointed ? 1 : 0;
  return n;
}
static_assert(has_rule(tile_plan(memscale::OptimizationMode::Aggressive, 1000, true), rule_id::tile_segment));
static_assert(tiled(tile_plan(memscale::OptimizationMode::Aggressive, 1000, true)) == 4);
static_assert(tile_plan(memscale::OptimizationMode::Aggressive, 1000, true).planned_peak < 100);
// Only with enable_tiling, only row-independent slots, only above the target.
static_assert(tiled(tile_plan(memscale::OptimizationMode::Aggressive, 1000, false)) == 0);
static_assert(tile_plan(memscale::OptimizationMode::Aggressive, 1000, false).planned_peak == 150);
static_assert(tiled(tile_plan(memscale::OptimizationMode::Aggressive, 1000, true, block)) == 0);
static_assert(tiled(tile_plan(memscale::OptimizationMode::Balanced, 500, true)) == 0);
// A target checkpointing misses by a little: the smallest count that meets it.
static_assert([] {
  const auto p = tile_plan(memscale::OptimizationMode::Conservative, 145, true);
  return p.planned_peak <= 145 && tiled(p) == 1 && p.decisions.back().tiles == 2;
}());

// The DP: with a budget of 150 the optimum checkpoints three blocks (3 s).
static_assert([] {
  const auto c = chain_of(block, 4);
  const auto best = optimal_segmentation(c, 150, 150);
  return best.feasible && best.recompute_seconds == 3.0 && best.peak <= 150;
}());
// A run ending in a Linear-like slot (backward_from_input) does not recompute it:
// [pointwise 1 s, Linear 4 s] costs 1 s (tiled, each chunk runs it: 5 s).
constexpr slot_cost pointwise{.input_bytes = 40, .output_bytes = 40, .saves_input = true, .forward_seconds = 1.0};
constexpr slot_cost product{.input_bytes = 40, .output_bytes = 100, .saves_input = true,
                            .backward_from_input = true, .forward_seconds = 4.0};
static_assert(checkpoint_recompute_seconds(std::array{pointwise, product}, 0, 1) == 1.0);
static_assert(checkpoint_recompute_seconds(std::array{product, pointwise}, 0, 1) == 5.0);
static_assert(unit_recompute_seconds(std::array{pointwise, product}, unit{0, 1, true, false, 2, 0}) == 5.0);  // tiled
constexpr slot_cost product_recomputed{.input_bytes = 40, .output_bytes = 100, .saves_input = true,
                                       .forward_seconds = 4.0};
static_assert(checkpoint_backward_peak(std::array{pointwise, product}, 0, 1, 0) <=
              checkpoint_backward_peak(std::array{pointwise, product_recomputed}, 0, 1, 0));
// A run of the Linear alone is counted as holding what a recomputed one does: it frees nothing.
static_assert(checkpoint_backward_peak(std::array{product}, 0, 0, 0) ==
              checkpoint_backward_peak(std::array{product_recomputed}, 0, 0, 0));
// Nor before another slot, where neither holds the Linear's output in its
// backward (the slot after it saved it and has freed it): 140 = gradients 100 + 40.
static_assert(checkpoint_backward_peak(std::array{product, pointwise}, 0, 0, 0) == 140);
static_assert(kept_backward_peak(std::array{product, pointwise}, 0, product.kept_bytes()) == 140);
// A kept slot's output counts through its own backward where it saves it, where
// it ends the chain, or where only views follow it (an in-place ReLU).
constexpr slot_cost saves_out{.input_bytes = 40, .output_bytes = 40, .saves_output = true};
constexpr slot_cost in_place{.input_bytes = 40, .output_bytes = 40, .output_is_view = true};
static_assert(!output_held_in_backward(std::array{pointwise, pointwise}, 0));
static_assert(output_held_in_backward(std::array{pointwise, pointwise}, 1));
static_assert(output_held_in_backward(std::array{saves_out, pointwise}, 0));
static_assert(output_held_in_backward(std::array{pointwise, in_place}, 0));
static_assert(!output_held_in_backward(std::array{pointwise, in_place, pointwise}, 0));
static_assert(kept_backward_peak(std::array{pointwise, pointwise}, 0, 40) == 80);  // 40 - 40 + 40 + 40
static_assert(kept_backward_peak(std::array{pointwise, in_place}, 0, 40) == 120);

// Below the lowest possible peak there is no plan.
static_assert(!optimal_segmentation(chain_of(block, 4), 100, 100).feasible);

// Techniques and strategies.
static_assert(memscale::Technique<memscale::Checkpoint>);
static_assert(memscale::Technique<memscale::Offload>);
static_assert(memscale::Technique<memscale::Tile>);
static_assert(!memscale::Technique<int>);
struct no_name {
  static constexpr memscale::technique_id id = memscale::technique_id::checkpoint;
  static constexpr bool available = true;
};
static_assert(!memscale::Technique<no_name>);
using checkpoint_only = memscale::Strategy<memscale::Checkpoint>;
static_assert(checkpoint_only::contains(memscale::technique_id::checkpoint));
static_assert(!checkpoint_only::contains(memscale::technique_id::offload));
static_assert(memscale::DefaultStrategy::contains(memscale::technique_id::tile));
static_assert(memscale::DefaultStrategy::applies(memscale::technique_id::tile));
static_assert(memscale::StrategyType<memscale::DefaultStrategy>);
static_assert(!memscale::StrategyType<memscale::Checkpoint>);

}  // namespace

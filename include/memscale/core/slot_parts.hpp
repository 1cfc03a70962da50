// memscale — profiler, measuring a slot within the room a budget leaves:
// measure_slot runs a slot's forward and backward at the full batch, which
// holds what the slot keeps for backward, its workspace and its gradients at
// once. Under a budget that the plan meets only by checkpointing, that can be
// more than the planned step will ever hold (the example GPT at batch 32: 102
// MiB to measure a whole block, where its Aggressive step's allocator peak is
// 78 MiB above the built model, optimizer state included),
// so planning itself would break the budget, or run out of memory on a full
// GPU. Where measuring the slot whole would not fit the room, it is measured
// on the first eighth, quarter and three eighths of the batch's rows, and its
// byte figures, where they grow linearly with the rows, are extrapolated to
// the full batch (its times scaled from the largest part, as time_static_slot
// scales a covered slot's). So measuring holds at most about three eighths of
// what measuring it whole would. Its output, which the next slot is profiled
// on, is computed without autograd (nothing saved), three eighths of the rows
// at a time.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <memscale/core/slot_measurement.hpp>
#include <memscale/device/hardware.hpp>

namespace memscale::detail {

/// A byte figure measured at `r` and `3r` rows, extrapolated to `n` rows along
/// the line through them (never below the larger part's figure).
inline std::int64_t extrapolate_rows(std::int64_t at_r, std::int64_t at_3r, std::int64_t r, std::int64_t n) {
  const double slope = static_cast<double>(at_3r - at_r) / static_cast<double>(2 * r);
  const auto v = static_cast<double>(at_3r) + slope * static_cast<double>(n - 3 * r);
  return std::max(at_3r, static_cast<std::int64_t>(v));
}

/// measure_slot within `room` bytes above what lives when it starts (negative:
/// no limit, the slot is measured whole). `note` says how it was measured where
/// that was not whole, or why whole although over the room.
inline measured_slot measure_slot_within(torch::nn::AnyModule& slot, const torch::Tensor& input, int passes,
                                         const memory_tracker::reporting_scope* reporting, bool products,
                                         saved_compaction compaction, std::int64_t room, std::string& note) {
  const auto whole = [&] { return measure_slot(slot, input, passes, reporting, products, compaction); };
  constexpr std::int64_t min_rows = 16;  // an eighth of fewer rows is too few to see a line through
  if (room < 0 || input.dim() == 0 || input.size(0) < min_rows) return whole();
  const auto n = input.size(0), r = n / 8;
  const auto part = [&](std::int64_t rows, int k) {
    return measure_slot(slot, input.narrow(0, 0, rows), k, reporting, products, compaction);
  };
  auto p1 = part(r, 1);
  if (!p1.tensor_output || p1.bytes != byte_source::allocations || p1.output.dim() == 0 ||
      p1.output.size(0) != r)
    return whole();  // not measured by allocations, or rows are not its output's first dimension
  // Linear from nothing: never less than what grows with the rows.
  const auto scaled = static_cast<std::int64_t>(static_cast<double>(p1.peak_bytes) * static_cast<double>(n) /
                                                static_cast<double>(r));
  if (scaled <= room) return whole();
  const auto mib = [](std::int64_t b) { return format_bytes(b); };
  const auto p2 = part(2 * r, 1);
  auto p3 = part(3 * r, passes);
  // Linear in the rows: the three parts' saved bytes and peaks lie on a line
  // (within 2%, or 64 KiB for small figures: allocator rounding).
  const auto on_line = [&](std::int64_t a, std::int64_t b, std::int64_t c) {
    return std::llabs(c - 2 * b + a) <= std::max<std::int64_t>(std::int64_t{64} << 10, c / 50);
  };
  if (!on_line(p1.cost.saved_bytes, p2.cost.saved_bytes, p3.cost.saved_bytes) ||
      !on_line(p1.peak_bytes, p2.peak_bytes, p3.peak_bytes)) {
    note = "measured whole (about " + mib(scaled) + ", over the room of " + mib(room) +
           " the budget leaves): its bytes do not grow linearly with the rows";
    return whole();
  }
  measured_slot out = p3;
  auto& c = out.cost;
  const auto line = [&](std::int64_t slot_cost::*field) {
    c.*field = extrapolate_rows(p1.cost.*field, p3.cost.*field, r, n);
  };
  for (auto field : {&slot_cost::saved_bytes, &slot_cost::workspace_bytes, &slot_cost::backward_workspace_bytes,
                     &slot_cost::replay_kept_bytes, &slot_cost::product_kept_bytes, &slot_cost::returned_product_bytes,
                     &slot_cost::compact_bytes, &slot_cost::compact_transient_bytes})
    line(field);
  c.compact_bytes = std::min(c.compact_bytes, c.saved_bytes);
  c.compact_transient_bytes = std::min(c.compact_transient_bytes, c.compact_bytes);
  const double time_scale = static_cast<double>(n) / static_cast<double>(3 * r);
  for (auto field : {&slot_cost::forward_seconds, &slot_cost::backward_seconds, &slot_cost::replay_saved_seconds,
                     &slot_cost::product_saved_seconds, &slot_cost::compact_seconds})
    c.*field *= time_scale;
  {  // The output at the full batch, for the next slot: its rows a part at a
     // time, nothing saved, no visible draw.
    torch::NoGradGuard no_grad;
    rng_fork no_visible_draws({input.device()});
    std::vector<torch::Tensor> rows;
    for (std::int64_t at = 0; at < n; at += 3 * r)
      rows.push_back(slot.any_forward(input.detach().narrow(0, at, std::min(3 * r, n - at))).get<torch::Tensor>());
    out.output = torch::cat(rows);
  }
  c.input_bytes = static_cast<std::int64_t>(input.nbytes());
  c.output_bytes = static_cast<std::int64_t>(out.output.nbytes());
  note = "measured on " + std::to_string(r) + ", " + std::to_string(2 * r) + " and " + std::to_string(3 * r) +
         " of " + std::to_string(n) + " rows, its bytes extrapolated along their line and its times scaled: whole, "
         "about " + mib(scaled) + " at once, over the room of " + mib(room) + " the budget leaves";
  return out;
}

}  // namespace memscale::detail

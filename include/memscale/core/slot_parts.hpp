// memscale — profiler, measuring a slot within the room a budget leaves: a
// slot that measure_slot would measure at more than the room (its forward and
// backward at the full batch, un-optimized) is measured on parts of the rows
// and its figures extrapolated, so planning keeps to the budget it plans for.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cmath>
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
/// no limit). Where measuring the slot whole would hold more (its first eighth
/// of the rows, scaled linearly, says so), it is measured on 1/8, 2/8 and 3/8 of
/// the rows, each as often as whole, and where its saved bytes and peaks lie on
/// a line through them (below), its byte figures are extrapolated along the
/// line through the outer two and its times scaled from the largest (as
/// time_static_slot scales a covered slot's). The output the next slot is
/// profiled on is computed without autograd, 3/8 of the rows at a time, from
/// copies (an in-place slot leaves `input` as it was). Where the parts do not
/// lie on a line, or a part fails other than for memory, the slot is measured
/// whole. `note` says how it was measured where that was not whole, or why
/// whole although over the room.
inline measured_slot measure_slot_within(torch::nn::AnyModule& slot, const torch::Tensor& input, int passes,
                                         const memory_tracker::reporting_scope* reporting, bool products,
                                         saved_compaction compaction, std::int64_t room, std::string& note) {
  const auto whole = [&] { return measure_slot(slot, input, passes, reporting, products, compaction); };
  constexpr std::int64_t min_rows = 16;  // an eighth of fewer rows is too few to see a line through
  if (room < 0 || input.dim() == 0 || input.size(0) < min_rows) return whole();
  const auto n = input.size(0), r = n / 8;
  const auto part = [&](std::int64_t rows) {
    return measure_slot(slot, input.narrow(0, 0, rows), passes, reporting, products, compaction);
  };
  measured_slot p1, p2, p3;
  std::int64_t scaled = 0;
  bool parts = false;
  try {
    p1 = part(r);
    // Measured by allocations, its output's first dimension the rows.
    if (p1.tensor_output && p1.bytes == byte_source::allocations && p1.output.dim() > 0 && p1.output.size(0) == r) {
      // Linear from nothing: never less than what grows with the rows.
      scaled = static_cast<std::int64_t>(static_cast<double>(p1.peak_bytes) * static_cast<double>(n) /
                                         static_cast<double>(r));
      parts = scaled > room;
    }
    if (parts) {
      p2 = part(2 * r);
      p3 = part(3 * r);
    }
  } catch (const c10::Error& e) {
    if (is_out_of_memory(e)) throw;
    note = "measured whole (over the room of " + format_bytes(room) + " the budget leaves): it fails on a part of the "
           "rows (" + e.what_without_backtrace() + ")";
    parts = false;
  }
  if (!parts) return whole();
  // Through (r, a), (2r, b), (3r, c), the line misses a curve's value at n rows
  // by (c - 2b + a)(t - 1)(t - 3)/2, t = n / r: within 2% of the figure for the
  // saved bytes (what a term in the rows' square, as attention over a first
  // dimension that is the sequence, would show in). The peaks, whose workspace
  // moves by some KiB with the allocator's and the libraries' choices, lie on
  // a line within 2% of the largest part's.
  const double t = static_cast<double>(n) / static_cast<double>(r);
  const auto curve = [](std::int64_t a, std::int64_t b, std::int64_t c) {
    return std::abs(static_cast<double>(c - 2 * b + a));
  };
  const bool saved_on_line =
      curve(p1.cost.saved_bytes, p2.cost.saved_bytes, p3.cost.saved_bytes) * (t - 1.0) * (t - 3.0) / 2.0 <=
      std::max(0.02 * static_cast<double>(extrapolate_rows(p1.cost.saved_bytes, p3.cost.saved_bytes, r, n)),
               256.0 * 1024.0);
  const bool peaks_on_line = curve(p1.peak_bytes, p2.peak_bytes, p3.peak_bytes) <=
                             std::max(0.02 * static_cast<double>(p3.peak_bytes), 64.0 * 1024.0);
  if (!saved_on_line || !peaks_on_line) {
    note = "measured whole (about " + format_bytes(scaled) + ", over the room of " + format_bytes(room) +
           " the budget leaves): its bytes do not grow linearly with the rows";
    return whole();
  }
  measured_slot out = std::move(p3);
  auto& c = out.cost;
  for (auto field : {&slot_cost::saved_bytes, &slot_cost::workspace_bytes, &slot_cost::backward_workspace_bytes,
                     &slot_cost::replay_kept_bytes, &slot_cost::product_kept_bytes, &slot_cost::returned_product_bytes,
                     &slot_cost::compact_bytes, &slot_cost::compact_transient_bytes})
    c.*field = extrapolate_rows(p1.cost.*field, c.*field, r, n);
  c.compact_bytes = std::min(c.compact_bytes, c.saved_bytes);
  c.compact_transient_bytes = std::min(c.compact_transient_bytes, c.compact_bytes);
  for (auto field : {&slot_cost::forward_seconds, &slot_cost::backward_seconds, &slot_cost::replay_saved_seconds,
                     &slot_cost::product_saved_seconds, &slot_cost::compact_seconds})
    c.*field *= t / 3.0;
  out.peak_bytes = extrapolate_rows(p1.peak_bytes, out.peak_bytes, r, n);
  p1 = p2 = measured_slot{};
  auto shape = out.output.sizes().vec();
  shape[0] = n;
  const auto options = out.output.options();
  out.output = torch::Tensor();
  {  // Nothing saved, no visible draw; the rows a part at a time, each from a copy.
    torch::NoGradGuard no_grad;
    rng_fork no_visible_draws({input.device()});
    auto output = torch::empty(shape, options);
    for (std::int64_t at = 0; at < n; at += 3 * r) {
      const auto rows = std::min(3 * r, n - at);
      output.narrow(0, at, rows).copy_(
          slot.any_forward(input.detach().narrow(0, at, rows).clone()).get<torch::Tensor>());
    }
    out.output = std::move(output);
  }
  c.input_bytes = static_cast<std::int64_t>(input.nbytes());
  c.output_bytes = static_cast<std::int64_t>(out.output.nbytes());
  note = "measured on " + std::to_string(r) + ", " + std::to_string(2 * r) + " and " + std::to_string(3 * r) +
         " of " + std::to_string(n) + " rows, its bytes extrapolated along their line and its times scaled: whole, "
         "about " + format_bytes(scaled) + " at once, over the room of " + format_bytes(room) + " the budget leaves";
  return out;
}

}  // namespace memscale::detail

// memscale — profiler, measuring a slot on a part of its input and scaling the
// figures up: a slot a static rule covers is timed on an eighth of its rows
// (time_static_slot), and a slot that measure_slot would measure at more than
// the room a budget leaves (its forward and backward at the full batch) is
// measured on parts of the rows, or of the sequence where the rows are too few
// to cut, its figures extrapolated: planning keeps to the budget it plans for.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <memscale/core/graph.hpp>
#include <memscale/core/slot_measurement.hpp>
#include <memscale/detail/bound_call.hpp>
#include <memscale/device/hardware.hpp>

namespace memscale::detail {

/// Profiling within a room cuts an input into eighths (of its rows, or of a
/// sequence's positions), and only an extent of at least 16 (a line or a
/// parabola through parts of fewer is too coarse to extrapolate along).
inline constexpr std::int64_t parts_per_whole = 8;
inline constexpr std::int64_t min_cut_extent = 16;

/// What timing a slot a static rule covers found (time_static_slot): the
/// measured cost, its times and the bytes a rule does not know (kept draws and
/// products, compaction, the workspace where seen) scaled to the full input
/// (its other bytes are the part's: the rule gives those), and its part.
struct static_slot_times {
  slot_cost cost;
  std::int64_t rows = 0;       ///< the first extent it ran at
  std::int64_t positions = 0;  ///< the second, where it ran on fewer positions of a sequence (else 0)
  bool workspace_seen = false;  ///< the workspace is measured: allocations seen, on the whole's kernels
};

/// Times a slot a static rule covers, the bytes being the rule's but for the
/// workspace (measured, grown as the rule's or the input; where it does not
/// run, the rule's): forward and backward as measure_slot times them, on the
/// input's first rows where it exceeds 1 MiB (an eighth of them, at least one
/// and the rows a convolution needs for the whole's kernels: same_kernel_rows),
/// then scaled to the full input by the rule's work at both shapes (flops and
/// bytes at the measured `rates`; quadratic where attention is): an eighth of
/// a step's compute (times the passes), more where a convolution's rows are
/// over an eighth of the batch. `input` is the real input, or undefined (a
/// synthetic one of the shape is made). nullopt where the slot fails on that
/// input or returns another shape than the rule says, and where the input it
/// would run on still exceeds 32 MiB. Within `room` bytes
/// (profile_options::room_bytes; negative: no limit): where the run would hold
/// more by the rule's figures, it runs on an eighth of the rows, however small
/// the input, then on half as many down to one row, then, for a sequence
/// (`[rows, positions, features]`, or token ids `[rows, positions]`), on half
/// as many positions down to an eighth of them; where even that holds more,
/// not at all (nullopt, `over_room` saying why): the caller keeps the rates'
/// times. A part cut along the sequence scales the bytes it measured (masks,
/// compaction) as the rule's saved bytes grow; one of fewer rows than
/// same_kernel_rows leaves the workspace unknown.
inline std::optional<static_slot_times> time_static_slot(torch::nn::AnyModule& slot, const layer_input& in,
                                                         const torch::Tensor& input, const c10::Device& device,
                                                         const layer_estimate& full, const compute_rates& rates,
                                                         int passes, const memory_tracker::reporting_scope* reporting,
                                                         bool products = true, saved_compaction compaction = {},
                                                         std::int64_t room = -1, std::string* over_room = nullptr) {
  constexpr std::int64_t small_input_bytes = std::int64_t{1} << 20;
  constexpr std::int64_t large_part_bytes = std::int64_t{32} << 20;
  layer_input part = in;
  std::optional<layer_estimate> part_estimate;
  // Rows enough for the whole's kernels; an eighth where those would exceed 32 MiB.
  const std::int64_t batch = in.shape.empty() ? 1 : in.shape[0];
  const auto kernel_rows = std::min(batch, same_kernel_rows(*slot.ptr()));
  if (batch >= 2 && in.bytes() > small_input_bytes) {
    const auto eighth = std::max<std::int64_t>(1, batch / parts_per_whole);
    part.shape[0] = std::max(eighth, kernel_rows);
    if (part.shape[0] > eighth && part.bytes() > large_part_bytes) part.shape[0] = eighth;
    if (part.shape[0] < batch) part_estimate = estimate_layer(*slot.ptr(), part);
  }
  // What the run holds at most by the rule: its input, workspace, what it saves
  // and returns, and the backward's gradients of as much again.
  const auto run_bytes = [&] {
    const auto& e = part_estimate ? *part_estimate : full;
    return (part_estimate ? part : in).bytes() + std::max(e.workspace_bytes, e.backward_workspace_bytes) +
           2 * (e.saved_bytes + e.output_bytes());
  };
  bool along_sequence = false;
  if (room >= 0 && run_bytes() > room && !in.shape.empty()) {
    const auto take = [&](std::int64_t rows, std::int64_t positions) {  // false: the rule refuses that shape
      layer_input candidate = in;
      candidate.shape[0] = rows;
      if (positions > 0) candidate.shape[1] = positions;
      auto e = estimate_layer(*slot.ptr(), candidate);
      // Positions only where the rule's output keeps them (a convolution's
      // second dimension is its channels).
      if (!e || (positions > 0 && (e->output_shape.size() < 2 || e->output_shape[1] != positions))) return false;
      part = std::move(candidate);
      part_estimate = std::move(e);
      along_sequence = positions > 0;
      return true;
    };
    for (auto rows = part_estimate ? part.shape[0] : in.shape[0]; run_bytes() > room && rows > 1;)
      if (!take(rows = part_estimate ? rows / 2 : std::max<std::int64_t>(1, rows / parts_per_whole), 0)) break;
    const bool sequence = in.shape.size() == 3 || (in.shape.size() == 2 && !c10::isFloatingType(in.dtype));
    if (sequence && (part_estimate ? part.shape[0] : in.shape[0]) == 1 && in.shape[1] >= min_cut_extent)
      for (auto positions = in.shape[1]; run_bytes() > room && positions / 2 >= in.shape[1] / parts_per_whole;)
        if (!take(1, positions /= 2)) break;
    if (run_bytes() > room) {
      if (over_room != nullptr)
        *over_room = "timing it on " + std::to_string(part_estimate ? part.shape[0] : in.shape[0]) + " of " +
                     std::to_string(in.shape[0]) + " rows" +
                     (along_sequence ? " and " + std::to_string(part.shape[1]) + " of " + std::to_string(in.shape[1]) +
                                           " positions"
                                     : std::string()) +
                     " would hold about " + format_bytes(run_bytes()) + ", over the room of " + format_bytes(room) +
                     " the budget leaves";
      return std::nullopt;
    }
  }
  // An input that cannot be cut small (a batch of one long sequence): the
  // caller keeps the rates' times rather than run it whole to time it.
  if ((part_estimate ? part.bytes() : in.bytes()) > large_part_bytes) return std::nullopt;
  double forward_scale = 1.0, backward_scale = 1.0;
  if (part_estimate) {
    // The rule's work at the full input over its work at the part.
    const rate_model_seconds whole(full, in.bytes(), rates), cut(*part_estimate, part.bytes(), rates);
    forward_scale = whole.forward / std::max(1e-30, cut.forward);
    backward_scale = whole.backward / std::max(1e-30, cut.backward);
  } else {
    part = in;
  }
  const auto& expected_shape = part_estimate ? part_estimate->output_shape : full.output_shape;
  try {
    torch::Tensor x;
    if (!input.defined())
      x = synthetic_input(part, device);
    else
      x = part.shape.empty() || part.shape[0] == in.shape[0] ? input : input.narrow(0, 0, part.shape[0]);
    if (along_sequence && x.defined() && x.size(1) != part.shape[1]) x = x.narrow(1, 0, part.shape[1]);
    auto timed = measure_slot(slot, x, passes, reporting, products, compaction);
    if (!timed.tensor_output || timed.output.sizes().vec() != expected_shape) return std::nullopt;
    // Masks have as many elements as the activations: they scale with the input's
    // bytes, or along a sequence (attention's scores) as the rule's saved bytes.
    const double input_scale =
        static_cast<double>(in.bytes()) / static_cast<double>(std::max<std::int64_t>(1, part.bytes()));
    const double bytes_scale =
        along_sequence ? std::max(input_scale, static_cast<double>(full.saved_bytes) /
                                                   static_cast<double>(std::max<std::int64_t>(1, part_estimate->saved_bytes)))
                       : input_scale;
    const auto scaled = [&](std::int64_t bytes) {
      return static_cast<std::int64_t>(static_cast<double>(bytes) * bytes_scale);
    };
    auto cost = timed.cost;
    scale_measured(cost, forward_scale, backward_scale, scaled);
    // Workspace grows as the rule's does (a wide convolution's holds a part
    // the weight's size at any batch), else with the input.
    const auto grown = [&](std::int64_t measured, std::int64_t layer_estimate::*rule) {
      const auto at_part = part_estimate ? (*part_estimate).*rule : 0;
      return at_part > 0 ? static_cast<std::int64_t>(static_cast<double>(measured) * static_cast<double>(full.*rule) /
                                                     static_cast<double>(at_part))
                         : scaled(measured);
    };
    cost.workspace_bytes = grown(cost.workspace_bytes, &layer_estimate::workspace_bytes);
    cost.backward_workspace_bytes = grown(cost.backward_workspace_bytes, &layer_estimate::backward_workspace_bytes);
    const auto run = part.shape.empty() ? 0 : part.shape[0];
    const bool seen = timed.bytes == byte_source::allocations && (part.shape.empty() || run >= kernel_rows);
    return static_slot_times{cost, run, along_sequence ? part.shape[1] : 0, seen};
  } catch (const std::exception&) {
    return std::nullopt;  // it cannot run on an input of that shape: the caller keeps the rates' times
  }
}

/// The largest part's figures made the whole's, once its bytes are: its times
/// scaled by `time_scale`, and its output computed again at the input's full
/// extent along `dim` without autograd (nothing saved, no visible draw),
/// `chunk` of it at a time, each from a copy (an in-place slot leaves `input`
/// as it was), into one tensor.
inline void finish_from_parts(measured_slot& out, torch::nn::AnyModule& slot, const torch::Tensor& input,
                              std::int64_t dim, std::int64_t chunk, double time_scale) {
  auto& c = out.cost;
  for (auto field : {&slot_cost::forward_seconds, &slot_cost::backward_seconds, &slot_cost::replay_saved_seconds,
                     &slot_cost::product_saved_seconds, &slot_cost::compact_seconds})
    c.*field *= time_scale;
  const auto n = input.size(dim);
  auto shape = out.output.sizes().vec();
  shape[static_cast<std::size_t>(dim)] = n;
  const auto options = out.output.options();
  out.output = torch::Tensor();
  {
    torch::NoGradGuard no_grad;
    rng_fork no_visible_draws({input.device()});
    auto output = torch::empty(shape, options);
    for (std::int64_t at = 0; at < n; at += chunk) {
      const auto extent = std::min(chunk, n - at);
      output.narrow(dim, at, extent)
          .copy_(slot.any_forward(input.detach().narrow(dim, at, extent).clone()).get<torch::Tensor>());
    }
    out.output = std::move(output);
  }
  c.input_bytes = static_cast<std::int64_t>(input.nbytes());
  c.output_bytes = static_cast<std::int64_t>(out.output.nbytes());
}

/// Why a slot over the room is measured whole after all: a part of `what` (the
/// rows, its sequence) failed with `e`. Rethrows an allocation failure.
inline std::string part_failed_note(const std::exception& e, std::int64_t room, const char* what) {
  if (is_out_of_memory(e)) throw;
  return "measured whole (over the room of " + format_bytes(room) + " the budget leaves): it fails on a part of " +
         what + " (" + message_of(e) + ")";
}

/// The offload census's threshold for a part of `part` of `whole` rows: a saved
/// view there is as many times smaller as in the whole slot.
inline std::int64_t part_min_bytes(std::int64_t min_bytes, std::int64_t part, std::int64_t whole) {
  if (min_bytes <= 0 || whole <= 0) return min_bytes;
  return static_cast<std::int64_t>(static_cast<double>(min_bytes) * static_cast<double>(part) /
                                   static_cast<double>(whole));
}

/// measure_slot_within for a slot whose first dimension is too few rows to cut
/// (a few long sequences, as [batch, sequence, features]): measured on 1/8 to
/// 4/8 of the sequence (the second dimension), where its output keeps it. The
/// bytes of attention over the sequence grow with its square: the figures are
/// extrapolated along the parabola through the last three parts where the first
/// lies on it (a cubic term's miss carried to the whole, within 2% of the saved
/// bytes; the peaks within 2% of the largest part's). The times are the largest
/// part's, scaled as the saved bytes grow and at least as the sequence. The
/// output the next slot is profiled on is computed without autograd half of the
/// sequence at a time, from copies: its shape and type are the slot's; its
/// second half is what the slot makes of that half alone (for a causal model
/// the first half is exact).
inline measured_slot measure_slot_along_sequence(torch::nn::AnyModule& slot, const torch::Tensor& input, int passes,
                                                 const memory_tracker::reporting_scope* reporting, bool products,
                                                 saved_compaction compaction, std::int64_t room, std::string& note,
                                                 std::int64_t offload_min_bytes = -1) {
  const auto whole = [&] {
    return measure_slot(slot, input, passes, reporting, products, compaction, offload_min_bytes);
  };
  const auto n = input.size(1), s = n / parts_per_whole;
  const double t = static_cast<double>(n) / static_cast<double>(s);
  const auto part = [&](std::int64_t positions) {
    // The census's threshold stays: a saved view need not span the sequence (a
    // recurrent step's does not), while nearly every one spans the rows.
    return measure_slot(slot, input.narrow(1, 0, positions), passes, reporting, products, compaction,
                        offload_min_bytes);
  };
  std::vector<measured_slot> p;
  p.reserve(4);
  bool parts = false;
  try {
    p.push_back(part(s));
    const auto& first = p.front();
    // Measured by allocations, its output [rows, positions, ...] as its input's;
    // quadratic from nothing, never less than what grows with the sequence or its square.
    parts = first.tensor_output && first.bytes == byte_source::allocations && first.output.dim() >= 2 &&
            first.output.size(0) == input.size(0) && first.output.size(1) == s &&
            static_cast<double>(first.peak_bytes) * t * t > static_cast<double>(room);
    for (std::int64_t k = 2; parts && k <= 4; ++k) {
      p.back().output = torch::Tensor();  // only the largest part's output is wanted (its shape)
      p.push_back(part(k * s));
    }
  } catch (const std::exception& e) {
    note = part_failed_note(e, room, "its sequence");
    parts = false;
  }
  if (!parts) return whole();
  const auto at = [&](auto field) {
    return std::array<std::int64_t, 4>{p[0].cost.*field, p[1].cost.*field, p[2].cost.*field, p[3].cost.*field};
  };
  const auto saved = at(&slot_cost::saved_bytes);
  const auto saved_whole = extrapolate_parabola(saved[1], saved[2], saved[3], t);
  const bool saved_on_curve = parabola_miss(saved[0], saved[1], saved[2], saved[3], t) <=
                              std::max(0.02 * static_cast<double>(saved_whole), 256.0 * 1024.0);
  const bool peaks_on_curve = parabola_miss(p[0].peak_bytes, p[1].peak_bytes, p[2].peak_bytes, p[3].peak_bytes, 1.0) <=
                              std::max(0.02 * static_cast<double>(p[3].peak_bytes), 64.0 * 1024.0);
  const auto peak = extrapolate_parabola(p[1].peak_bytes, p[2].peak_bytes, p[3].peak_bytes, t);
  if (!saved_on_curve || !peaks_on_curve) {
    note = "measured whole (over the room of " + format_bytes(room) + " the budget leaves): its bytes do not grow "
           "with its sequence and its square alone";
    return whole();
  }
  if (peak <= room) return whole();  // the parabola says it fits: measured as without a budget
  measured_slot out = std::move(p[3]);
  auto& c = out.cost;
  for (auto field : {&slot_cost::saved_bytes, &slot_cost::workspace_bytes, &slot_cost::backward_workspace_bytes,
                     &slot_cost::replay_kept_bytes, &slot_cost::product_kept_bytes, &slot_cost::returned_product_bytes,
                     &slot_cost::compact_bytes, &slot_cost::compact_transient_bytes, &slot_cost::offload_kept_bytes}) {
    const auto f = at(field);
    c.*field = extrapolate_parabola(f[1], f[2], f[3], t);
  }
  c.compact_bytes = std::min(c.compact_bytes, c.saved_bytes);
  c.compact_transient_bytes = std::min(c.compact_transient_bytes, c.compact_bytes);
  c.offload_kept_bytes = std::min(c.offload_kept_bytes, c.saved_bytes);
  out.peak_bytes = peak;
  p.clear();
  // Half of the sequence at a time; the times at least linear in it.
  finish_from_parts(out, slot, input, 1, (n + 1) / 2,
                    std::max(t / 4.0, saved[3] > 0 ? static_cast<double>(c.saved_bytes) / static_cast<double>(saved[3])
                                                   : 0.0));
  note = "measured on " + std::to_string(s) + ", " + std::to_string(2 * s) + ", " + std::to_string(3 * s) + " and " +
         std::to_string(4 * s) + " of " + std::to_string(n) + " positions of its sequence (" +
         std::to_string(input.size(0)) + " rows are too few to cut), its bytes extrapolated along their parabola "
         "and its times scaled as its saved bytes: whole, about " + format_bytes(peak) + " at once, over the room of " +
         format_bytes(room) + " the budget leaves";
  return out;
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
/// whole. Fewer than 16 rows of [rows, sequence, features] are cut along the
/// sequence instead (measure_slot_along_sequence). `note` says how it was
/// measured where that was not whole, or why whole although over the room.
inline measured_slot measure_slot_within(torch::nn::AnyModule& slot, const torch::Tensor& input, int passes,
                                         const memory_tracker::reporting_scope* reporting, bool products,
                                         saved_compaction compaction, std::int64_t room, std::string& note,
                                         std::int64_t offload_min_bytes = -1) {
  const auto whole = [&] {
    return measure_slot(slot, input, passes, reporting, products, compaction, offload_min_bytes);
  };
  if (room < 0 || input.dim() == 0) return whole();
  // A call's arguments after its input (a mask) are not cut with its rows: whole.
  if (dynamic_cast<const bound_slot*>(slot.ptr().get()) != nullptr) return whole();
  if (input.size(0) < min_cut_extent) {
    if (input.dim() == 3 && input.size(1) >= min_cut_extent)
      return measure_slot_along_sequence(slot, input, passes, reporting, products, compaction, room, note,
                                         offload_min_bytes);
    return whole();
  }
  const auto n = input.size(0), r = n / parts_per_whole;
  const auto part = [&](std::int64_t rows) {
    return measure_slot(slot, input.narrow(0, 0, rows), passes, reporting, products, compaction,
                        part_min_bytes(offload_min_bytes, rows, n));
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
  } catch (const std::exception& e) {
    note = part_failed_note(e, room, "the rows");
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
                     &slot_cost::compact_bytes, &slot_cost::compact_transient_bytes, &slot_cost::offload_kept_bytes})
    c.*field = extrapolate_rows(p1.cost.*field, c.*field, r, n);
  c.compact_bytes = std::min(c.compact_bytes, c.saved_bytes);
  c.compact_transient_bytes = std::min(c.compact_transient_bytes, c.compact_bytes);
  c.offload_kept_bytes = std::min(c.offload_kept_bytes, c.saved_bytes);
  out.peak_bytes = extrapolate_rows(p1.peak_bytes, out.peak_bytes, r, n);
  p1 = p2 = measured_slot{};
  finish_from_parts(out, slot, input, 0, 3 * r, t / 3.0);  // three eighths of the rows at a time
  note = "measured on " + std::to_string(r) + ", " + std::to_string(2 * r) + " and " + std::to_string(3 * r) +
         " of " + std::to_string(n) + " rows, its bytes extrapolated along their line and its times scaled: whole, "
         "about " + format_bytes(scaled) + " at once, over the room of " + format_bytes(room) + " the budget leaves";
  return out;
}

}  // namespace memscale::detail

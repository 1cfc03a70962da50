// memscale — predict()'s calibration: the step (forward, loss, backward) run at
// a small batch, for real or shape-only, while a timeline_scope records its
// allocations (calibration), and two aligned timelines at consecutive batches
// found and fitted (fit_timelines; fit_shape_only_or_real prefers shape-only
// steps and says why when it ran them for real; off the CPU, fit_near_target
// runs them near the example's batch; naming_the_example turns a step LibTorch
// refuses into memscale's error). predict/run.hpp drives them;
// predict/predict.hpp's header says how the prediction works.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#include <memscale/device/hardware.hpp>
#include <memscale/device/memory_tracker.hpp>
#include <memscale/errors.hpp>
#include <memscale/execute/verify.hpp>
#include <memscale/predict/blas_workspace.hpp>
#include <memscale/predict/op_workspace.hpp>
#include <memscale/predict/shape_only_scope.hpp>
#include <memscale/predict/timeline.hpp>
#include <memscale/techniques/checkpoint_recompute.hpp>

namespace memscale::predictor::detail {

/// The example's rows 0, 1, ... repeated to `batch` rows (row i is row i % N):
/// how predict() and autotune() make a batch of another size.
[[nodiscard]] inline torch::Tensor rows_of(const torch::Tensor& example, std::int64_t batch) {
  const auto rows = example.size(0);
  if (batch == rows) return example;
  torch::NoGradGuard no_grad;
  const auto index = torch::arange(batch, torch::TensorOptions().dtype(torch::kLong).device(example.device())) % rows;
  return example.index_select(0, index).contiguous();
}

/// Recorded calibration steps (forward, loss, backward; no optimizer step), the sandbox's state put back first.
struct calibration {
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::function<torch::Tensor(const torch::Tensor&)> loss;
  torch::Tensor example;
  c10::Device device = c10::kCPU;
  bool gradients_kept = TORCH_VERSION_MAJOR < 2;  // what Optimizer::zero_grad() does by default
  std::vector<torch::Tensor> trainable;
  core::verify::sandbox* box = nullptr;
  /// Real steps run near the example's batch first (fit_near_target): off the
  /// CPU, and on it where the test seam near_target_on_cpu() asks.
  bool near_target = false;

  [[nodiscard]] torch::Tensor batch_of(std::int64_t batch) const { return rows_of(example, batch); }

  /// How the step runs: for real, or shape-only (predict/shape_only.hpp), with
  /// each operator's first call real (census) or none.
  enum class execution : std::uint8_t { real, shape_only, census };
  execution how = execution::real;

  /// The matrix products of each batch's latest run on the CPU, in call order
  /// (for the BLAS workspace probe, predict/blas_workspace.hpp).
  std::map<std::int64_t, std::vector<matrix_product>> products{};

  /// The batch whose real step records its calls of workspace_operators() into
  /// op_calls (0: none), for measure_workspaces.
  std::int64_t op_batch = 0;
  std::vector<op_call> op_calls{};
  /// The leaves the first step's backward gives a gradient (reachable_leaves).
  std::optional<std::unordered_set<const c10::TensorImpl*>> reached{};

  /// Kept gradients (1.x: zero_grad() zeroes them) as a later step finds them: zeros for a real step; a
  /// shape-only step never reads them (no zeros to write and fault in).
  void keep_gradients(bool real) {
    if (!gradients_kept) return;
    torch::NoGradGuard no_grad;
    for (auto& p : trainable) p.mutable_grad() = real ? torch::zeros_like(p) : torch::empty_like(p);
  }

  timeline run(std::int64_t batch) {
    box->reset();
    keep_gradients(how == execution::real);
    const auto x = batch_of(batch);
    timeline_scope recorder(device);
    // The matrix products: from the tally where shape-only (no cost), else
    // recorded (every operator call then packs its inputs for the callback).
    std::optional<product_recorder> products_seen;
    if (device.is_cpu() && how == execution::real) products_seen.emplace();
    {
      std::optional<shape_only_scope> shapes_only;
      if (how != execution::real) shapes_only.emplace(how == execution::census);
      std::optional<op_call_recorder> calls;
      if (batch == op_batch && how == execution::real) calls.emplace(recorder, batch);
      torch::AutoGradMode grad_on(true);
      auto output = forward(x);
      recorder.mark();
      auto value = loss(output);
      if (!value.defined() || value.numel() != 1)
        throw Error("memscale::predict(): loss_fn must return a scalar tensor, got " +
                    (value.defined() ? std::string("one of shape ") + c10::str(value.sizes()) : "an undefined one") +
                    " (on the example's first " + std::to_string(batch) + " rows, as predict() runs it)");
      recorder.mark();
      if (!reached) {
        reached.emplace();
        for (const auto& leaf : memscale::detail::reachable_leaves({value}, {}))
          reached->insert(leaf.unsafeGetTensorImpl());
      }
      value.backward();
      if (shapes_only && shapes_only->values_read() > 0)
        throw Error("the step reads tensor values (item(), a data-dependent shape), which shape-only execution "
                    "leaves uninitialised");
      if (shapes_only && device.is_cpu()) products[batch] = shapes_only->tally().products;
      if (calls) op_calls = calls->take();
    }
    auto recorded = recorder.finish();
    if (products_seen) products[batch] = products_seen->take();
    // Operators without a meta kernel (batch norm) ran for real on uninitialised
    // values: their buffers are put back now, not only before the next step.
    if (how != execution::real) box->reset();
    return recorded;
  }
};

/// The smallest calibration batch. Batch 1 is avoided: there operators take
/// other paths than at larger batches (matrix products of one row, oneDNN
/// convolutions from batch 2; measured in benchmarks/studies/README.md).
inline constexpr std::int64_t first_calibration_batch = 2;

/// A test seam: calibrate near the example's batch on the CPU too (real steps),
/// as predict() does off it. Internal; process-wide.
inline std::atomic<bool>& near_target_on_cpu() {
  static std::atomic<bool> on{false};
  return on;
}

/// A timeline reduced to its forward end, its peak and its end: what is
/// extrapolated where two calibrations do not align event by event.
[[nodiscard]] inline timeline whole_step(const timeline& t) {
  timeline r;
  r.live = {t.at_mark(0), t.peak(), t.end()};
  r.allocation = {true, true, false};
  r.marks = {1, 2};
  r.reserved_peak = t.reserved_peak;
  r.allocated_peak = t.allocated_peak;
  return r;
}

/// The smallest middle batch (3H/4) fit_near_target runs at (its low one, H/2,
/// can be below it: at T = 16, batches 8, 4 and 6); below it, the small batches.
inline constexpr std::int64_t smallest_near_batch = first_calibration_batch + 4;

/// Real steps near the example's batch T, where the step's operators take the
/// paths they take at T: a reduction over more rows splits over more blocks
/// with buffers of their own, cuBLAS and cuDNN choose algorithms (and
/// workspaces) by shape. Extrapolated from batches 2 to 5, an MLP's step on an
/// H200 was predicted 11-20% short of its allocations at batches 4096 to 65536,
/// a ResNet's 18-38% over (benchmarks/RESULTS.md). Runs batches H, H/2 and 3H/4,
/// for H = T/2, and fits (H/2, H) where those align and the pair gives the step
/// at 3H/4 (each event within 1% of its peak), else (3H/4, H): an operator's
/// sizes can change slope between batches with the same allocations (a deep
/// CNN's on an H200: (32, 64) was 31 MiB off at 48 and 120 MiB at 128, 14% of
/// the step; (48, 64) 4 MiB at 128). Where neither aligns, one step more at 7H/8
/// and (7H/8, H) where that aligns (no third step shares its path: its peak is
/// bounded by the others', bound_close_pair). The example GPT on an H200 takes
/// another path between batches 24 and 30: at T = 64 neither 16 nor 24 aligned
/// with 32, and (28, 32) replays the caching allocator's reserve at 64 to 2 MiB,
/// but its allocations came out 10% short there (benchmarks/RESULTS.md,
/// 2026-11-30, second session). Where a step at H runs
/// out of memory, H = T/4, T/8, ... while 3H/4 >= smallest_near_batch (the cache
/// emptied before each step, so that each step's reserve is its own). Where no
/// pair aligns, the larger of the first two as a whole (whole_step), with `note`
/// saying so. Nothing where no H ran (3T/8 under smallest_near_batch, or out of
/// memory at each); `note` then names the batches that ran out of memory.
[[nodiscard]] inline std::optional<timeline_fit> fit_near_target(calibration& c, std::vector<std::int64_t>& batches,
                                                                 std::string& note, std::int64_t& allocator_growth) {
  // A step at batch `b`, or nothing where it ran out of memory (any other failure propagates).
  const auto step_at = [&](std::int64_t b) -> std::optional<timeline> {
    try {
      return c.run(b);
    } catch (const c10::Error& e) {
      if (!memscale::detail::is_out_of_memory(e)) throw;
    } catch (const std::bad_alloc&) {
    }
    c.box->reset();
    memscale::detail::release_cached_device_memory(c.device);
    return std::nullopt;
  };
  std::string short_of_memory;
  const auto run = [&](std::int64_t b) {
    c.box->reset();  // the last step's gradients freed before the cache is emptied
    memscale::detail::release_cached_device_memory(c.device);
    auto t = step_at(b);
    if (t) {
      allocator_growth = std::max(allocator_growth, t->peak());
      batches.push_back(b);
    } else {
      short_of_memory += (short_of_memory.empty() ? "" : ", ") + std::to_string(b);
    }
    return t;
  };
  // What to say: which steps ran out of memory, then `more`.
  const auto said = [&](const std::string& more) {
    const auto ran_out = short_of_memory.empty() ? std::string()
                                                 : "a step at batch(es) " + short_of_memory + " ran out of memory";
    return ran_out.empty() || more.empty() ? ran_out + more : ran_out + "; " + more;
  };
  if (3 * (c.example.size(0) / 2) / 4 < smallest_near_batch) return std::nullopt;
  // An unrecorded step first: what a process's first step allocates once (cuBLAS's
  // workspaces, for the caller's thread and autograd's) is then not in one timeline
  // of a pair only. Where even it runs out of memory, the steps below say so.
  (void)step_at(first_calibration_batch);
  // The calls whose workspaces are measured at the example's batch, from the step at `high` (predict/op_workspace.hpp).
  std::vector<op_call> calls;
  const auto measured = [&](timeline_fit fit, const timeline& top, const std::string& more = {}) {
    const auto workspaces = measure_workspaces(fit, top, calls, c.example.size(0), c.device);
    note = said(workspaces.empty() || more.empty() ? workspaces + more : workspaces + "; " + more);
    return fit;
  };
  for (std::int64_t high = c.example.size(0) / 2; 3 * high / 4 >= smallest_near_batch; high /= 2) {
    const auto ran_before = batches.size();
    c.op_batch = workspace_operators().empty() ? 0 : high;
    const auto top = run(high);
    c.op_batch = 0;
    calls = std::exchange(c.op_calls, {});
    if (!top) continue;
    const auto low = run(high / 2);
    const auto mid_batch = 3 * high / 4;
    const auto mid = run(mid_batch);
    const bool mid_aligned = mid && aligned(*mid, *top);
    if (low && aligned(*low, *top)) {
      timeline_fit wide(*low, high / 2, *top, high);
      if (!mid_aligned || wide.gives(*mid, mid_batch, 0.01)) return measured(std::move(wide), *top);
    }
    if (mid_aligned) return measured(timeline_fit(*mid, mid_batch, *top, high), *top);
    if (!mid && !low) {  // only the step at `high` ran: not a pair
      batches.resize(ran_before);
      continue;
    }
    const auto near_batch = high - high / 8;  // between mid_batch and high: high >= 8 here
    const auto near = mid ? run(near_batch) : std::nullopt;
    if (near && aligned(*near, *top)) {
      timeline_fit fit(*near, near_batch, *top, high);
      std::vector<std::pair<std::int64_t, const timeline*>> others{{mid_batch, &*mid}};
      if (low) others.emplace_back(high / 2, &*low);
      const auto bounded = bound_close_pair(fit, std::move(others), c.example.size(0));
      return measured(std::move(fit), *top, bounded);
    }
    note = said("the step's allocations differ between batches " + std::to_string(high / 2) + ", " +
                std::to_string(mid_batch) + (near ? ", " + std::to_string(near_batch) : std::string()) + " and " +
                std::to_string(high) +
                " (an operator takes another path at some batch size): the peak is extrapolated from " +
                std::to_string(mid ? mid_batch : high / 2) + " and " + std::to_string(high) +
                " as a whole, not event by event");
    return mid ? timeline_fit(whole_step(*mid), mid_batch, whole_step(*top), high)
               : timeline_fit(whole_step(*low), high / 2, whole_step(*top), high);
  }
  if (!short_of_memory.empty()) note = said("so it was calibrated at the smallest batches");
  return std::nullopt;
}

/// Two aligned calibration timelines: near the example's batch where
/// `c.near_target` and the steps are real (fit_near_target), else batches
/// (2, 3), else (3, 4), else (4, 5). Sets `note` when none align (the fit is
/// then of the last two, phase by phase) or a near-target step ran out of memory.
inline timeline_fit fit_timelines(calibration& c, std::vector<std::int64_t>& batches, std::string& note,
                                  std::int64_t& allocator_growth) {
  std::string near_note;
  if (c.near_target && c.how == calibration::execution::real) {
    if (auto fit = fit_near_target(c, batches, near_note, allocator_growth)) {
      note = near_note;
      return *fit;
    }
  }
  const auto with_near_note = [&](std::string text) {
    return near_note.empty() ? text : text.empty() ? near_note : near_note + "; " + text;
  };
  std::vector<timeline> runs;
  for (std::int64_t b = first_calibration_batch; b <= first_calibration_batch + 3; ++b) {
    runs.push_back(c.run(b));
    // A census once: its real first calls made what they make; the next steps
    // only need the timeline.
    if (c.how == calibration::execution::census) c.how = calibration::execution::shape_only;
    allocator_growth = std::max(allocator_growth, runs.back().peak());
    batches.push_back(b);
    const auto n = runs.size();
    if (n >= 2 && aligned(runs[n - 2], runs[n - 1])) {
      note = with_near_note("");
      return {runs[n - 2], b - 1, runs[n - 1], b};
    }
  }
  note = with_near_note("the step's allocations differ between each two consecutive batches from " +
         std::to_string(first_calibration_batch) + " to " + std::to_string(first_calibration_batch + 3) +
         " (an operator takes another path at some batch size): the peak is extrapolated from the last two as a "
         "whole, not event by event");
  return {whole_step(runs[2]), first_calibration_batch + 2, whole_step(runs[3]), first_calibration_batch + 3};
}

/// fit_timelines with the step run shape-only (`how`: census or not) where that
/// can be done, else for real: LibTorch 2.x, a model off the CPU (unverified on
/// CUDA), an operator that threw on uninitialised values, or shape-only
/// timelines that align at no two batches. Returns an empty string when it ran
/// shape-only, else why not. On a fallback, `batches` and `allocator_growth`
/// are the real run's.
inline std::string fit_shape_only_or_real(calibration& c, calibration::execution how, timeline_fit& fit,
                                          std::vector<std::int64_t>& batches, std::string& note,
                                          std::int64_t& allocator_growth) {
  std::string why;
  if (!c.device.is_cpu()) {
    why = "the model is on " + c.device.str() + " (shape-only calibration is used on CPU only)";
  } else if (c.near_target) {
    why = "calibration near the example's batch was asked for (a test seam)";
  } else if (!shape_only_available()) {
    why = TORCH_VERSION_MAJOR < 2 ? "shape-only execution is unavailable (another library registered a fallback "
                                    "for DispatchKey::Fake)"
                                  : "shape-only execution needs LibTorch 1.x";
  } else {
    std::vector<std::int64_t> tried;
    std::string misaligned;
    std::int64_t growth = allocator_growth;
    c.how = how;
    try {
      fit = fit_timelines(c, tried, misaligned, growth);
      if (misaligned.empty()) {
        c.how = calibration::execution::real;
        batches.insert(batches.end(), tried.begin(), tried.end());
        allocator_growth = growth;
        return {};
      }
      why = "shape-only timelines did not align at any two batches from 2 to 5";
    } catch (const std::exception& e) {
      why = "a shape-only step failed (" + memscale::detail::message_of(e) + ")";
    }
    c.how = calibration::execution::real;
  }
  fit = fit_timelines(c, batches, note, allocator_growth);
  return why;
}

/// Runs `calibrate` (the first calibration, the first steps predict() runs);
/// a step LibTorch refuses (an example of another shape, type or device than
/// the forward takes) becomes memscale's error, saying what ran.
template <class Calibrate>
auto naming_the_example(std::int64_t batch, Calibrate&& calibrate) {
  try {
    return calibrate();
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    while (!what.empty() && (what.back() == '.' || what.back() == ' ' || what.back() == '\n')) what.pop_back();
    throw Error(
        "memscale::predict(): a training step on the example's leading rows (of its " + std::to_string(batch) +
        ") failed: " + what +
        ". predict() runs the forward, loss_fn and backward on the example's first rows as given: pass the batch "
        "the forward takes in training (its shape, dtype and device), and a loss_fn that takes the first "
        "output.size(0) rows of its targets");
  }
}

/// What blas_growth found: the (batch, bytes) points of Prediction::outside_growth
/// (empty when nothing was measured) and what to say about it.
struct blas_growth_result {
  std::vector<std::pair<std::int64_t, std::int64_t>> points;
  std::string note;
};

/// The BLAS library's buffers that the step's matrix products hold beyond the
/// calibration's (predict/blas_workspace.hpp), from the products of the fit's
/// two calibration batches: measured at half of `batch`, then at `batch` (so
/// that the pages stay within what a step at `batch` holds anyway), none at
/// `real_batch` (the largest batch the products ran at for real).
inline blas_growth_result blas_growth(calibration& c, const timeline_fit& fit, std::int64_t real_batch,
                                      std::int64_t batch) {
  blas_growth_result out;
  if (batch <= real_batch) return out;
  const auto& at_a = c.products[fit.first_batch()];
  const auto& at_b = c.products[fit.second_batch()];
  const auto at = [&](std::int64_t b) { return products_at(at_a, fit.first_batch(), at_b, fit.second_batch(), b); };
  const auto full = at(batch);
  if (full.empty()) {
    if (!at_b.empty())
      out.note = "the BLAS library's buffers at batch " + std::to_string(batch) +
                 " are not included: the step's matrix products differ between the calibration batches";
    return out;
  }
  try {
    const auto half = batch / 2;
    // Both batches' products on one set of operands (probe_product_runs), half first.
    auto runs = half > real_batch ? probe_product_runs({at(half), full}) : probe_product_runs({full});
    const auto at_half = runs.size() == 2 ? runs.front().bytes : std::int64_t{0};
    const auto probe = runs.back();
    out.points = {{real_batch, 0}};
    if (half > real_batch) out.points.emplace_back(half, at_half);
    out.points.emplace_back(batch, at_half + probe.bytes);
    out.note = "outside the allocator includes " + memscale::detail::format_bytes(at_half + probe.bytes) +
               " at batch " + std::to_string(batch) + " that the BLAS library's buffers hold beyond the " +
               "calibration's: the " + std::to_string(probe.products) + " distinct matrix product(s) of the step, " +
               "run once for real on " +
               (memscale::openblas_threads() == 1 ? "their columns (up to 512: OpenBLAS runs on one thread)"
                                                  : "16 columns") +
               " at half the batch and at the batch" +
               (probe.scaled ? " (those over the operand cap on fewer rows, extended to all)" : "") +
               "; for other batches, linear between those and beyond at the rate of the last two (an over-estimate "
               "where a product's buffer stops growing past this batch)";
  } catch (const std::exception& e) {
    out.points.clear();
    out.note = "the BLAS library's buffers are not included: running the step's matrix products failed (" +
               memscale::detail::message_of(e) + ")";
  }
  return out;
}

}  // namespace memscale::predictor::detail

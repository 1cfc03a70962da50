// memscale — the prediction run, predictor::run(): the checks predict() and
// autotune() share (predict/inputs.hpp), the static bytes, the
// optimizer sized, the calibration without and with the plan
// (predict/calibration.hpp), the memory outside the allocator, and the
// Prediction (predict/prediction.hpp) extrapolated to the full batch, for the
// memscale::predict() overloads (predict/predict.hpp says how it predicts).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#include <memscale/observability/metrics.hpp>
#include <memscale/observability/telemetry.hpp>
#include <memscale/config.hpp>
#include <memscale/errors.hpp>
#include <memscale/device/hardware.hpp>
#include <memscale/device/memory_tracker.hpp>
#include <memscale/device/process_memory.hpp>
#include <memscale/core/plan.hpp>
#include <memscale/execute/attach.hpp>
#include <memscale/execute/verify.hpp>
#include <memscale/predict/calibration.hpp>
#include <memscale/predict/inputs.hpp>
#include <memscale/predict/cuda_reserve.hpp>
#include <memscale/predict/malloc_heap.hpp>
#include <memscale/predict/op_workspace.hpp>
#include <memscale/predict/optimizer_state.hpp>
#include <memscale/predict/outside_memo.hpp>
#include <memscale/predict/prediction.hpp>
#include <memscale/predict/shape_only_scope.hpp>
#include <memscale/predict/step_code.hpp>
#include <memscale/predict/timeline.hpp>

namespace memscale::predictor {

/// predict() with the model's forward and the loss as functions (what the
/// public overloads call).
template <StrategyType S, Model M>
Prediction run(M& model, const torch::Tensor& example_input, const torch::optim::Optimizer& optimizer,
               std::function<torch::Tensor(const torch::Tensor&)> loss_fn, bool loss_given, const Config& config) {
  const auto started = std::chrono::steady_clock::now();
  config.validate();
  const telemetry::mute_scope sizing_sends_nothing;  // its wraps are memscale's own
  const observability::own_work_scope sizing_trains_nothing;
  const auto inputs = detail::training_inputs(model, example_input, "memscale::predict()",
                                              "predict() sizes a model as it is without memscale and with a plan: "
                                              "detach it first");
  const auto& root = inputs.first;
  const auto& forward = inputs.second;

  Prediction out;
  out.batch_size = example_input.size(0);
  // Each tensor once: LibTorch lists a weight registered under two names (tied
  // the way register_parameter ties it) twice, where the step holds it, its
  // gradient and its state once.
  const auto parameters = memscale::detail::unique_tensors(root->parameters());
  const auto device = detail::model_device(parameters, example_input);
  out.device = device.str();

  // The static part: parameters, buffers, gradients, optimizer state.
  MemoryBreakdown fixed;
  std::vector<torch::Tensor> trainable;
  for (const auto& p : parameters) {
    fixed.parameter_bytes += static_cast<std::int64_t>(p.nbytes());
    if (p.requires_grad()) {
      fixed.gradient_bytes += static_cast<std::int64_t>(p.nbytes());
      trainable.push_back(p);
    }
  }
  for (const auto& b : root->buffers())
    if (b.defined() && b.device() == device) fixed.buffer_bytes += static_cast<std::int64_t>(b.nbytes());

  // CPU, shape-only: the resident size from before the optimizer's shadow step
  // (see below); without the counting allocator, the sandbox and the shadow put
  // back what they made, taken as no change.
  std::optional<memscale::detail::process_memory> resident_before;
  std::int64_t allocator_before = 0;
  std::optional<std::int64_t> heap_free_before;  // glibc's free heap bytes
  std::int64_t heap_left = 0;                     // ... that a shape-only calibration added
  if (device.is_cpu()) {
    (void)shape_only_available();  // its one-time set-up (a fallback) before the measuring
    resident_before = memscale::detail::read_process_memory();
    heap_free_before = memscale::detail::malloc_heap_free_bytes();
    if (memory_tracker::installed()) allocator_before = memory_tracker::current_bytes();
  }

  auto own = size_optimizer(optimizer, device);  // throws for a type it cannot size, before any calibration
  out.optimizer = own.name;
  auto plan_sizing = plan_optimizer(optimizer, device, own, config.use_8bit_optimizer);
  if (!plan_sizing.note.empty()) out.notes.push_back(plan_sizing.note);
  auto& planned_optimizer = plan_sizing.footprint;

  // Calibration: the model as it is, then with the plan.
  core::verify::sandbox box(*root);  // gradients, buffers and RNG back at the end
  detail::calibration c{forward, loss_fn, example_input, device, TORCH_VERSION_MAJOR < 2, trainable, &box};
  c.near_target = !device.is_cpu() || detail::near_target_on_cpu();
  std::string misaligned;
  // What the process holds outside the allocator (code read in, oneDNN and BLAS buffers, malloc's retention),
  // measured over the calibration without the plan. Real steps: the resident high-water mark's growth beyond the
  // allocator's largest step. Shape-only steps write no output (whose pages are then not resident): the resident
  // size's growth beyond the allocator's from before the optimizer's shadow step (a training step's optimizer step
  // pages in that code too) to after the calibration (its kernels' threads and buffers; glibc's heap's gain, which
  // `beneath` takes off), with a real step's code pages for the calibration's (predict/step_code.hpp).
  std::int64_t process_growth = -1, allocator_growth = 0;
  std::optional<memory_tracker::process_peak_scope> process;
  if (device.is_cpu()) process.emplace();
  // The code pages resident before it (detail::step_code_swap); not where an earlier call measured the model: this
  // one then reads in no code, and the memo's figure stands in (remembered_outside).
  const auto memo_key = device.is_cpu() ? detail::outside_memo_key(*root, example_input) : std::string();
  const auto code_before = device.is_cpu() && detail::outside_memo::process().base(memo_key) == 0
                               ? memscale::detail::resident_code_pages()
                               : std::nullopt;
  timeline_fit base_fit;
  const auto base_real_why = detail::naming_the_example(out.batch_size, [&] {
    return detail::fit_shape_only_or_real(c, detail::calibration::execution::census, base_fit,
                                          out.calibration_batches, misaligned, allocator_growth);
  });
  const bool base_shape_only = base_real_why.empty();
  out.fitted_batches = {base_fit.first_batch(), base_fit.second_batch()};
  out.shape_only = base_shape_only;
  if (!base_shape_only) out.notes.push_back("calibration ran for real: " + base_real_why);
  if (base_shape_only) {
    const auto resident_after = resident_before ? memscale::detail::read_process_memory() : std::nullopt;
    if (const auto after = memscale::detail::malloc_heap_free_bytes(); heap_free_before && after)
      heap_left = std::max<std::int64_t>(0, *after - *heap_free_before);  // see `beneath`
    // The resident size can fall over the calibration (pages given back): then 0, not "not measured" (-1).
    if (resident_after) {
      process_growth = allocator_growth + resident_after->resident_bytes - resident_before->resident_bytes -
                       (memory_tracker::installed() ? memory_tracker::current_bytes() - allocator_before : 0);
      process_growth += detail::step_code_swap(c, code_before, out.calibration_batches,
                                               base_fit.peak(out.batch_size) + fixed.total_bytes() + own.state_bytes);
      process_growth = std::max<std::int64_t>(0, process_growth);
    }
  } else if (process && process->active()) {
    // Kept gradients (1.x) are made before each recorded step, as zeros: resident, yet outside
    // its timeline. They are the breakdown's gradients row, not memory outside the allocator.
    process_growth = std::max<std::int64_t>(0, process->peak_growth() - (c.gradients_kept ? fixed.gradient_bytes : 0));
  }
  process.reset();
  if (c.reached) {  // parameters the forward does not reach
    auto note = drop_idle(trainable, *c.reached, optimizer, device, fixed.gradient_bytes, own, plan_sizing);
    if (!note.empty()) out.notes.push_back(std::move(note));
  }
  std::int64_t persistent = 0;  // CUDA: what stays allocated that is not the model's (cuBLAS's workspaces, ...)
  if (device.is_cuda()) {
    box.reset();  // the caller's gradients set aside: named, as the step's gradients have their own row
    persistent = detail::unnamed_allocations(device, memscale::detail::allocated_on_device(device), parameters,
                                             root->buffers(), held_state_bytes(optimizer, device), example_input,
                                             box.saved_gradients());
  }
  // CPU: what the process holds beyond the allocator (-1: not measured).
  std::int64_t outside_cpu =
      device.is_cpu() && process_growth >= 0 ? std::max<std::int64_t>(0, process_growth - allocator_growth) : -1;
  if (!misaligned.empty()) out.notes.push_back("baseline: " + misaligned);

  // CPU: the BLAS library's packing buffers, which the full batch's matrix
  // products touch beyond the calibration's (predict/blas_workspace.hpp).
  std::int64_t blas_bytes = 0;
  if (device.is_cpu() && outside_cpu >= 0) {
    const std::int64_t real_batch = base_shape_only ? detail::first_calibration_batch : base_fit.second_batch();
    auto blas = detail::blas_growth(c, base_fit, real_batch, out.batch_size);
    out.outside_growth = std::move(blas.points);
    blas_bytes = out.outside_growth_at(out.batch_size);
    if (!blas.note.empty()) out.notes.push_back(std::move(blas.note));
    outside_cpu =
        detail::remembered_outside(memo_key, out.batch_size, outside_cpu, blas_bytes, out.notes, heap_left);
  }

  timeline_fit plan_fit = base_fit;
  std::int64_t plan_code = 0;  // CPU: memscale's own code a step with the plan reads in (detail::own_plan_code)
  {
    const auto code_unplanned = code_before ? memscale::detail::resident_code_pages() : std::nullopt;
    Config planning = config;
    planning.verify_correctness = false;
    planning.enable_logging = false;
    // One profiling pass per measured layer, not warmup_steps + 1: the bytes
    // (what the plan turns on) are the same in each pass; only the times are noisier.
    planning.warmup_steps = 0;
    const std::int64_t profile_batch = std::min(detail::first_calibration_batch, out.batch_size);
    const auto example_small = c.batch_of(profile_batch);
    std::shared_ptr<core::attachment> attached;
    {
      // The plan reserves, in a CPU budget, what the process holds beyond the
      // allocator: the figure the calibration measured (profiling at batch 2
      // would see little of it).
      core::profile_scale_scope scale(static_cast<double>(out.batch_size) / static_cast<double>(profile_batch),
                                      outside_cpu < 0 ? outside_cpu : outside_cpu + blas_bytes);
      if (out.shape_only) {
        // Profiled shape-only too: the bytes each unit keeps are what a real
        // run allocates; its times are estimated (matrix products' arithmetic
        // and bytes moved at rates measured once, operators that run for real
        // timed), so the plan ranks recomputation by those.
        try {
          (void)measured_shape_only_rates();  // before the span: the profile would see their allocations
          shape_only_scope shapes_only;
          memscale::detail::profile_clock_scope clock([&shapes_only] { return shapes_only.estimated_seconds(); });
          attached = memscale::detail::attach<S>(model, planning, &example_small);
          if (shapes_only.values_read() > 0) {
            core::detach(root.get(), attached.get());
            attached.reset();
            throw Error("the forward reads tensor values (item(), a data-dependent shape), which shape-only "
                        "execution leaves uninitialised");
          }
          out.plan_profile_shape_only = true;
        } catch (const std::exception& e) {
          out.notes.push_back("the plan was profiled for real: profiling shape-only failed (" +
                              memscale::detail::message_of(e) + ")");
        }
        box.reset();  // operators without a meta kernel wrote buffers from uninitialised values
      }
      if (!attached) attached = memscale::detail::attach<S>(model, planning, &example_small);
    }
    struct detach_at_exit {
      std::shared_ptr<torch::nn::Module> root;
      core::attachment* attached;
      ~detach_at_exit() { core::detach(root.get(), attached); }
    } detach_guard{root, attached.get()};
    out.plan = attached->report();
    out.plan_applies = out.plan.checkpointed_segments() + out.plan.offloaded_units() + out.plan.tiled_segments() > 0 ||
                       config.use_mixed_precision;
    if (blas_bytes > 0 && (out.plan.tiled_segments() > 0 || config.use_mixed_precision))
      out.notes.push_back("with the plan, the BLAS library's buffers are counted as without it: its tiled or "
                          "bf16 products hold less (an over-estimate)");
    if (out.plan_applies) {
      // The plan's first training forward does one-time work (each checkpointed
      // segment's probe for the tensors it reads): done here, unrecorded (and
      // shape-only where the calibration is), so that both calibration steps
      // are steady-state ones and align (the first had a block's forward more,
      // and a third step was needed).
      {
        torch::AutoGradMode grad_on(true);
        const auto x = c.batch_of(detail::first_calibration_batch);
        bool done = false;
        if (out.shape_only) {
          try {
            shape_only_scope shapes_only;
            (void)forward(x);
            done = true;
          } catch (const std::exception&) {  // the calibration below then says why, or runs for real
            box.reset();                     // and the forward runs for real from where it began
          }
        }
        if (!done) (void)forward(x);
      }
      box.reset();
      std::vector<std::int64_t> batches;
      std::string plan_misaligned;
      std::int64_t unused = 0;
      if (!out.shape_only) {
        plan_fit = detail::fit_timelines(c, batches, plan_misaligned, unused);
      } else if (const auto why = detail::fit_shape_only_or_real(c, detail::calibration::execution::shape_only,
                                                                 plan_fit, batches, plan_misaligned, unused);
                 !why.empty()) {
        out.shape_only = false;
        out.notes.push_back("calibration with the plan ran for real: " + why);
      }
      if (!plan_misaligned.empty()) out.notes.push_back("with the plan: " + plan_misaligned);
      if (device.is_cpu() && outside_cpu >= 0) plan_code = detail::own_plan_code(code_unplanned);
    }
  }

  // Outside the allocator.
  std::int64_t outside = 0;
  if (device.is_cpu()) {
    if (outside_cpu >= 0) {
      outside = outside_cpu;
      detail::malloc_notes(out.notes);
    } else {
      out.notes.push_back("the process's resident high-water mark could not be reset or read (/proc/self): memory "
                          "outside LibTorch's allocator is not included");
    }
  } else if (device.is_cuda()) {
    outside = memscale::detail::memory_outside_caching_allocator(device);  // the reserve: per timeline and batch, below
    out.notes.push_back(cuda_outside_note);
  }
  auto resident = detail::resident_blocks(parameters, root->buffers(), trainable, c.gradients_kept, device);
  if (persistent > 0) resident.push_back(persistent);
  const auto base_state = detail::state_blocks(trainable, own.state_bytes);
  const auto plan_state = detail::state_blocks(trainable, planned_optimizer.state_bytes);
  // What the allocator beneath holds beyond the live bytes: CUDA's caching allocator's reserve; glibc's heap
  // with its threshold fixed (predict/malloc_heap.hpp), less what the calibration saw of it: the real steps'
  // estimate; shape-only, what the heap gained free over it, but the share it keeps at the batch.
  const auto beneath = [&, threshold = heap_estimate_threshold()](const timeline_fit& fit,
                                                                  const optimizer_footprint& opt, std::int64_t batch) {
    const auto& state = &opt == &own ? base_state : plan_state;
    if (device.is_cuda()) {
      const auto r = replay_reserve(fit, batch, resident, state, opt.transient_bytes);
      return r ? std::max<std::int64_t>(0, r->reserved - r->allocated) : fit.reserved_overhead(batch);
    }
    const auto heap = [&](std::int64_t n) {
      return heap_retention(fit, n, resident, state, opt.transient_bytes, threshold).value_or(0);
    };
    if (outside_cpu < 0 || threshold <= 0) return std::int64_t{0};
    const auto at = heap(batch);
    if (!base_shape_only) return std::max<std::int64_t>(0, at - heap(fit.second_batch()));
    return at - static_cast<std::int64_t>(static_cast<double>(heap_left) *
                                          (1.0 - heap_share_kept(fit, fit.first_batch(), batch, threshold)));
  };
  const bool kept = c.gradients_kept;
  const auto breakdown = [&](const timeline_fit& fit, const optimizer_footprint& opt, std::int64_t batch) {
    MemoryBreakdown b = fixed;
    b.optimizer_state_bytes = opt.state_bytes;
    const auto dynamic = std::max(fit.peak(batch), fit.end(batch) + opt.transient_bytes);
    b.activation_bytes = std::max<std::int64_t>(0, fit.at_mark(0, batch));
    // What the step holds at its peak beyond the forward's saved activations.
    // LibTorch 1.x: the gradients live between steps (zero_grad() zeroes them),
    // outside `dynamic`. 2.x: zero_grad() frees them and backward makes them,
    // inside `dynamic`; a peak in backward holds only those made by then (the
    // activations they free go at the same time), so the breakdown counts no
    // more of them than the peak holds: its figures add up to the allocator's peak.
    const auto beyond_activations = std::max<std::int64_t>(0, dynamic - b.activation_bytes);
    if (!kept) b.gradient_bytes = std::min(fixed.gradient_bytes, beyond_activations);
    b.transient_bytes = beyond_activations - (kept ? 0 : b.gradient_bytes) + persistent;
    b.outside_allocator_bytes =
        std::max<std::int64_t>(0, outside + (&fit == &plan_fit ? plan_code : 0) + out.outside_growth_at(batch) +
                                      beneath(fit, opt, batch));
    return b;
  };
  for (const auto& [fit, which] : {std::pair{&base_fit, "without"}, std::pair{&plan_fit, "with"}})
    if (device.is_cuda() && !fit->has_blocks() && (fit == &base_fit || out.plan_applies))
      out.notes.push_back(unaligned_reserve_note(*fit, which));
  out.baseline = breakdown(base_fit, own, out.batch_size);
  if (const auto heap = device.is_cpu() ? beneath(base_fit, own, out.batch_size) : 0; heap != 0)
    out.notes.push_back("outside the allocator " + std::string(heap > 0 ? "includes " : "takes off ") +
                        memscale::detail::format_bytes(std::abs(heap)) + " at batch " + std::to_string(out.batch_size) +
                        " for glibc's heap: what it holds at the step's peak (tensors under its mmap threshold, freed "
                        "before it, stay resident), less what the calibration's batches left it holding that this "
                        "batch does not (predict/malloc_heap.hpp)");
  out.planned = breakdown(plan_fit, planned_optimizer, out.batch_size);
  out.baseline_peak_bytes = out.baseline.total_bytes();
  out.peak_bytes = out.planned.total_bytes();

  out.budget_bytes = out.plan.budget_bytes;
  out.baseline_headroom_bytes = out.budget_bytes - out.baseline_peak_bytes;
  out.headroom_bytes = out.budget_bytes - out.peak_bytes;
  out.baseline_fits = out.baseline_headroom_bytes >= 0;
  out.fits = out.headroom_bytes >= 0;
  out.baseline_max_batch_size = detail::agreeing(base_fit, out.baseline_fits, out.batch_size, detail::largest_fitting(
      [&](std::int64_t n) { return breakdown(base_fit, own, n).total_bytes(); }, out.budget_bytes));
  out.max_batch_size = detail::agreeing(plan_fit, out.fits, out.batch_size, detail::largest_fitting(
      [&](std::int64_t n) { return breakdown(plan_fit, planned_optimizer, n).total_bytes(); }, out.budget_bytes));

  std::ostringstream method;
  method << "the step (forward, loss, backward) ran at batches";
  for (auto b : out.calibration_batches) method << " " << b;
  method << (out.shape_only ? " shape-only (every operator's outputs allocated as the real step allocates them, "
                              "nothing computed; without the plan each operator's first call ran for real)"
                            : " for real")
         << " with every allocation on " << out.device << " recorded; those at " << out.fitted_batches.first << " and "
         << out.fitted_batches.second << " extrapolated to batch " << out.batch_size << "; the optimizer's state from "
         << "its type and options, its step's temporaries measured on a shadow copy; gradients "
         << (kept ? "kept between steps (LibTorch 1.13's zero_grad() zeroes them)"
                  : "freed between steps (LibTorch 2.x's zero_grad() sets them to None)")
         << "; the plan made as wrap() makes it at batch " << out.batch_size << " (profiled at batch "
         << std::min(detail::first_calibration_batch, out.batch_size) << ", scaled"
         << (out.plan_profile_shape_only
                 ? "; shape-only: each unit's bytes as allocated, its times estimated from its matrix products' "
                   "arithmetic and the bytes its operators move, at rates measured once per process"
                 : "")
         << ")";
  if (device.is_cpu())
    method << "; outside the allocator: "
           << (base_shape_only ? "the resident size's growth over the calibration without the plan, beyond the "
                                "allocator's (what its real first calls left: code read in, kernels' buffers)"
                              : "the resident high-water mark's growth over the calibration without the plan, "
                                "beyond the allocator's largest step")
           << (blas_bytes > 0 ? ", plus the BLAS library's buffers for the full batch's matrix products" : "");
  out.method = method.str();
  if (!loss_given)
    out.notes.push_back("no loss_fn: the loss is taken as output.sum(), whose memory is negligible; pass the "
                        "training loss for its own share");
  if (!root->is_training())
    out.notes.push_back("the model is in eval mode: the step was sized as it runs in that mode");
  out.notes.push_back("the input batch itself (" + memscale::detail::format_bytes(static_cast<std::int64_t>(
                          example_input.nbytes())) + " at batch " + std::to_string(out.batch_size) +
                      ") is not counted: it is the data pipeline's");
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return out;
}

}  // namespace memscale::predictor

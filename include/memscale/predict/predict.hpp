// memscale — the OOM predictor: memscale::predict(model, example_input, optimizer,
// loss_fn, config) says what one steady-state training step (forward, loss,
// backward, optimizer step) will hold at the example's batch size, without
// running it at that size: baseline and with the plan `config` would apply, a
// breakdown, whether it fits the budget and the largest batch that does.
//
// How: the step (forward, loss, backward) runs at batches 2 and 3 (each a copy
// of the example's leading rows) while a timeline_scope records every
// allocation and free on the model's device. The two timelines hold the same
// events in the same order, and each event's live bytes are affine in the
// batch, so the timeline at any batch is their event-by-event extrapolation,
// and its maximum is the step's peak. Where the two do not align (an operator
// that takes another path at some batch), batches 3 and 4, then 4 and 5 are
// tried. Off the CPU the steps run for real near the example's batch T first
// (batches T/4 and T/2, or lower where a step runs out of memory: predict/
// calibration.hpp's fit_near_target), where CUDA's operators take the paths
// they take at T. On CPU with LibTorch 1.x these steps run shape-only
// (predict/shape_only.hpp: every output allocated as the real step allocates
// it, nothing computed), the first without the plan in census mode (each
// operator's first call in the process also runs for real, so that its code and
// buffers are made and measured); elsewhere, or when a shape-only step fails or
// its timelines do not align, they run for real (Prediction::shape_only, and a
// note saying why). The optimizer's state comes from its type and options, its
// step's temporaries from a shadow optimizer (predict/optimizer_state.hpp). The
// plan is made as wrap() would make it at the full batch (profiled at batch 2,
// the profile scaled to the full batch; shape-only where the calibration was,
// with each unit's times estimated: Prediction::plan_profile_shape_only),
// applied, run through one forward (its one-time work) and its two
// calibration steps, and removed. On CPU the process holds more than
// LibTorch's allocator sees (libtorch's code read in at first use, oneDNN and
// BLAS buffers, malloc's retention): that share is measured over the
// calibration without the plan (shape-only: the resident size's growth beyond
// the allocator's, with the code pages a real step reads in for those the
// calibration read in: predict/step_code.hpp; real: the resident high-water
// mark's growth beyond the allocator's peak) and added, with, where glibc's mmap threshold is fixed,
// what its heap keeps at the full batch of the small tensors the step frees
// before its peak (the step's allocations replayed: predict/malloc_heap.hpp);
// on CUDA the caching allocator's reserve above its allocations and the CUDA
// context are.
//
// Nothing predict() touches stays changed: parameters are not stepped (the
// optimizer is only read), gradients, buffers and the RNG state are put back.
//
// Its parts, bottom-up (beside predict/timeline.hpp, predict/optimizer_state.hpp
// and predict/shape_only.hpp):
//   predict/prediction.hpp   MemoryBreakdown and Prediction, and their printing
//   predict/calibration.hpp  the calibration steps and their timelines' fit
//   predict/step_code.hpp    a real step's code pages for the calibration's
//   predict/inputs.hpp       the checks predict() and autotune() share
//   predict/run.hpp          predictor::run(), the prediction itself
// This header holds the public memscale::predict() overloads.
#pragma once

#include <concepts>
#include <functional>
#include <utility>

#include <torch/torch.h>

#include <memscale/config.hpp>
#include <memscale/execute/attach.hpp>
#include <memscale/predict/calibration.hpp>
#include <memscale/predict/prediction.hpp>
#include <memscale/predict/run.hpp>

namespace memscale {

/// Predicts one steady-state training step's peak memory at the example's
/// batch size (baseline and with the plan `config` would apply), its breakdown,
/// whether it fits and the largest batch that does, without running the step at
/// that size (see the header comment for how). `loss_fn` maps the model's
/// output to the scalar training loss; predict() runs the model at small
/// batches, so a loss that uses targets must take the first output.size(0)
/// rows of them. Leaves the model, its gradients, buffers, the RNG state and the
/// optimizer as they were; throws (changing nothing) for a model memscale
/// manages now or an optimizer type it cannot size.
template <StrategyType S = DefaultStrategy, Model M, class LossFn>
  requires std::invocable<LossFn&, const torch::Tensor&>
Prediction predict(M& model, const torch::Tensor& example_input, const torch::optim::Optimizer& optimizer,
                   LossFn&& loss_fn, const Config& config = {}) {
  std::function<torch::Tensor(const torch::Tensor&)> loss = [&loss_fn](const torch::Tensor& output) {
    return torch::Tensor(loss_fn(output));
  };
  return predictor::run<S>(model, example_input, optimizer, std::move(loss), true, config);
}

/// predict() without a loss function: the loss is output.sum(), of negligible
/// memory (the Prediction says so).
template <StrategyType S = DefaultStrategy, Model M>
Prediction predict(M& model, const torch::Tensor& example_input, const torch::optim::Optimizer& optimizer,
                   const Config& config = {}) {
  return predictor::run<S>(
      model, example_input, optimizer, [](const torch::Tensor& output) { return output.sum(); }, false, config);
}

}  // namespace memscale

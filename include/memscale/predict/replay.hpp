// memscale::predict — a step's extrapolated timeline replayed through a model
// of an allocator (predict/cuda_reserve.hpp's of CUDA's caching allocator,
// predict/malloc_heap.hpp's of glibc's malloc), over steady training steps:
// what the allocator holds beyond the live bytes depends on the order of the
// allocations and frees, and on what lives across steps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <vector>

#include <memscale/predict/timeline.hpp>

namespace memscale::predictor {

/// The step of `fit` at `batch` replayed through `model` (allocate(key, bytes),
/// free(key)) `passes` times (3: a warm-up and two steady steps), after the blocks
/// that live across steps (`resident`: parameters, buffers, gradients kept
/// between steps), with the optimizer's `state` allocated after the first step
/// and its `transient` bytes taken and given back at each step's end; blocks a
/// step leaves allocated (LibTorch 2.x's gradients) are freed before the next
/// (zero_grad). The events' keys are their block numbers; the fit must have them
/// (has_blocks()). Fewer passes where the model has settled() and it says,
/// after a steady pass, that the pass left it where it began.
template <class Model>
void replay_steps(Model& model, const timeline_fit& fit, std::int64_t batch, const std::vector<std::int64_t>& resident,
                  const std::vector<std::int64_t>& state, std::int64_t transient, int passes = 3) {
  constexpr std::uint64_t resident_keys = std::uint64_t{1} << 40, state_keys = std::uint64_t{2} << 40,
                          transient_key = std::uint64_t{3} << 40;  // a step's blocks: their numbers
  for (std::size_t i = 0; i < resident.size(); ++i) model.allocate(resident_keys + i, resident[i]);
  std::set<std::uint32_t> left;
  for (int pass = 0; pass < passes; ++pass) {
    for (const auto b : left) model.free(b);
    left.clear();
    for (std::size_t e = 0; e < fit.events(); ++e) {
      const auto b = fit.block(e);
      if (fit.allocation(e)) {
        model.allocate(b, fit.bytes(e, batch));
        left.insert(b);
      } else {
        model.free(b);
        left.erase(b);
      }
    }
    if (pass == 0)
      for (std::size_t i = 0; i < state.size(); ++i) model.allocate(state_keys + i, state[i]);
    if (transient > 0) {
      model.allocate(transient_key, transient);
      model.free(transient_key);
    }
    // A model that says a pass changed nothing the next one starts from: the next is the same.
    if constexpr (requires { model.settled(); })
      if (model.settled() && pass > 0) break;
  }
}

}  // namespace memscale::predictor

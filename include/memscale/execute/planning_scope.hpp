// memscale — planning's thread-local state and its scopes: whether planning
// runs on this thread (chain probes and call sites then run as they are), the
// batch scale and outside-allocator figure memscale::predict plans with, the
// probe that measures what the process holds outside LibTorch's allocator, and
// scale_profile, which reads a small-batch profile at the full batch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#include <torch/torch.h>

#include <memscale/core/graph.hpp>
#include <memscale/device/memory_tracker.hpp>

namespace memscale::core {

/// While planning runs on this thread, chain probes and call sites run as they are.
inline bool& planning_on_this_thread() {
  thread_local bool planning = false;
  return planning;
}

/// The factor by which planning on this thread scales the per-sample figures of
/// each profile (bytes and times of activations, the leading extent of each
/// shape) before deciding: memscale::predict profiles at a small batch and plans
/// for the full one. 1 outside a profile_scale_scope.
inline double& profile_batch_scale() {
  thread_local double scale = 1.0;
  return scale;
}

/// What planning on this thread takes as the bytes the process holds outside
/// LibTorch's allocator (CPU), instead of measuring them (attachment's
/// outside_allocator_probe): memscale::predict passes the figure it measured over
/// its calibration steps, as the profile it plans from ran at a small batch. -1
/// (measure) outside a profile_scale_scope that sets it.
inline std::int64_t& profile_outside_allocator_bytes() {
  thread_local std::int64_t bytes = -1;
  return bytes;
}

/// Sets profile_batch_scale() (and, when given, profile_outside_allocator_bytes())
/// for its lifetime, then puts back what it found.
class profile_scale_scope {
 public:
  explicit profile_scale_scope(double scale, std::int64_t outside_allocator_bytes = -1)
      : before_(profile_batch_scale()), outside_before_(profile_outside_allocator_bytes()) {
    profile_batch_scale() = scale;
    profile_outside_allocator_bytes() = outside_allocator_bytes;
  }
  profile_scale_scope(const profile_scale_scope&) = delete;
  profile_scale_scope& operator=(const profile_scale_scope&) = delete;
  ~profile_scale_scope() {
    profile_batch_scale() = before_;
    profile_outside_allocator_bytes() = outside_before_;
  }

 private:
  double before_;
  std::int64_t outside_before_;
};

/// What the process comes to hold beyond LibTorch's allocator while memscale
/// runs the model to plan it on CPU (verify's unoptimized step, the example
/// forward, the profiling at the full batch): the growth of the process's
/// resident peak over the span minus the growth of the allocator's peak. Most of
/// it is made once, at the first operations of that size (OpenMP and OpenBLAS
/// worker threads' stacks and buffers, oneDNN's scratchpads), so it is measured
/// in the process where training will run; a process that has trained before
/// made it already and reads about 0 (nothing new to reserve). With glibc's
/// dynamic mmap threshold it also holds what malloc keeps of freed blocks.
/// Thread-bound: open and close it on one thread, inside any reporting scope
/// open around it.
class outside_allocator_probe {
 public:
  outside_allocator_probe() {
    if (!process_.active()) return;
    if (!memory_tracker::installed()) {
      reporting_.emplace();
      if (!reporting_->active()) return;
    }
    allocator_.emplace(c10::kCPU);
  }
  outside_allocator_probe(const outside_allocator_probe&) = delete;
  outside_allocator_probe& operator=(const outside_allocator_probe&) = delete;

  /// The bytes so far (>= 0), or -1 where the process's or the allocator's
  /// peak cannot be read (no /proc/self, or a LibTorch profiler holds the slot).
  [[nodiscard]] std::int64_t bytes() {
    if (!allocator_) return -1;
    const auto process = process_.peak_growth();
    if (process < 0) return -1;
    return std::max<std::int64_t>(0, process - allocator_->peak_growth());
  }

 private:
  memory_tracker::process_peak_scope process_;
  std::optional<memory_tracker::reporting_scope> reporting_;
  std::optional<memory_tracker::peak_scope> allocator_;  // closes before reporting_
};

/// A profile measured at batch b, as the profile at batch b * scale would read:
/// activation bytes and times scale with the batch (what the activations are),
/// and so does the first extent of each shape. A workspace's fixed part (a
/// convolution's weight-sized buffer) does not: the forward's is it plus the
/// rest scaled, the backward's the larger of it and the rest scaled, the rest
/// being, where the fixed part was all there was, the input's and output's
/// bytes (the rule's: core/layer_rules.hpp).
inline void scale_profile(chain_profile& profile, double scale) {
  const auto times = [scale](std::int64_t bytes) {
    return static_cast<std::int64_t>(std::llround(static_cast<double>(bytes) * scale));
  };
  for (auto& slot : profile.slots) {
    if (const auto fixed = slot.fixed_workspace_bytes; fixed > 0) {
      slot.workspace_bytes = fixed + times(std::max<std::int64_t>(0, slot.workspace_bytes - fixed));
      slot.backward_workspace_bytes = std::max(
          fixed, times(slot.backward_workspace_bytes > fixed ? slot.backward_workspace_bytes
                                                              : slot.input_bytes + slot.output_bytes));
    } else {
      slot.workspace_bytes = times(slot.workspace_bytes);
      slot.backward_workspace_bytes = times(slot.backward_workspace_bytes);
    }
    slot.input_bytes = times(slot.input_bytes);
    slot.made_before_bytes = times(slot.made_before_bytes);
    slot.output_bytes = times(slot.output_bytes);
    slot.saved_bytes = times(slot.saved_bytes);
    scale_measured(slot, scale, scale, times);
    if (slot.input_extents[0] > 0) slot.input_extents[0] = std::max<std::int64_t>(1, times(slot.input_extents[0]));
  }
  if (!profile.input_shape.empty()) profile.input_shape[0] = std::max<std::int64_t>(1, times(profile.input_shape[0]));
}

/// Sets planning_on_this_thread() for its lifetime (when `on`; else leaves it
/// as it is), then puts back what it found.
class planning_scope {
 public:
  explicit planning_scope(bool on = true) : before_(planning_on_this_thread()) {
    planning_on_this_thread() = on || before_;
  }
  planning_scope(const planning_scope&) = delete;
  planning_scope& operator=(const planning_scope&) = delete;
  ~planning_scope() { planning_on_this_thread() = before_; }

 private:
  bool before_;
};

}  // namespace memscale::core

// memscale — a traced training step (OptimizationGuard::trace_step): for one
// step the caller runs, a TraceMark around every unit records the device's
// allocated bytes when the unit's forward returns and when backward reaches
// it (its output's gradient is ready, the units after it done). The Report's
// measured_timeline holds them, growth from the step's start; the HTML page
// draws them beside the projection.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/core/plan.hpp>
#include <memscale/detail/modules.hpp>
#include <memscale/device/memory_tracker.hpp>
#include <memscale/techniques/checkpoint_recompute.hpp>

namespace memscale::core {

/// The bytes of one traced step, in the order they were taken.
class step_recorder {
 public:
  explicit step_recorder(c10::Device device) : device_(device) {}

  /// Takes the step's starting bytes (before its first forward).
  void start() noexcept { start_ = memory_tracker::current_bytes_if(device_).value_or(0); }

  void record(int chain, int unit, bool backward) noexcept {
    const auto now = memory_tracker::current_bytes_if(device_);
    if (!now) return;
    try {
      std::lock_guard<std::mutex> lock(mutex_);
      points_.push_back({chain, unit, backward, *now - start_});
    } catch (...) {
    }
  }

  [[nodiscard]] std::vector<measured_point> points() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return points_;
  }

 private:
  c10::Device device_;
  std::int64_t start_ = 0;
  mutable std::mutex mutex_;
  std::vector<measured_point> points_;
};

/// Wraps a unit's slot (or call) for one traced step; records around it.
class TraceMarkImpl : public memscale::detail::wrapper_module {
 public:
  TraceMarkImpl(torch::nn::AnyModule inner, int chain, int unit, std::shared_ptr<step_recorder> recorder)
      : wrapper_module("memscale::TraceMark"),
        inner_(std::move(inner)),
        chain_(chain),
        unit_(unit),
        recorder_(std::move(recorder)) {}

  torch::Tensor forward(torch::Tensor x) {
    auto y = inner_.forward<torch::Tensor>(std::move(x));
    if (detail::recompute_scope::current() != nullptr) return y;  // a recompute inside backward
    recorder_->record(chain_, unit_, /*backward=*/false);
    if (y.requires_grad()) {
      y.register_hook([recorder = recorder_, chain = chain_, unit = unit_](const torch::Tensor&) {
        recorder->record(chain, unit, /*backward=*/true);
      });
    }
    return y;
  }

 private:
  torch::nn::AnyModule inner_;
  int chain_;
  int unit_;
  std::shared_ptr<step_recorder> recorder_;
};

}  // namespace memscale::core

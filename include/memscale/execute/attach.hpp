// memscale — attaching to a model: the technique set a strategy allows, the
// example forward that profiling runs, the executor's attach() for a user's model
// type, and OptimizationGuard, which owns an attachment and detaches it when it
// ends. The public entry points (api.hpp) and autotune/predict are built on it.
#pragma once

#include <concepts>
#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

#include <torch/torch.h>

#include <memscale/config.hpp>
#include <memscale/core/plan.hpp>
#include <memscale/detail/modules.hpp>
#include <memscale/execute/executor.hpp>
#include <memscale/techniques/strategy.hpp>

namespace memscale {

namespace detail {

template <StrategyType S>
core::technique_set techniques_for(const Config& config) {
  core::technique_set set;
  if constexpr (S::applies(technique_id::checkpoint)) set.checkpoint = &Checkpoint::wrap;
  if constexpr (S::applies(technique_id::offload))
    if (config.enable_offloading) set.offload = &Offload::wrap;
  if constexpr (S::applies(technique_id::tile))
    if (config.enable_tiling) set.tile = &Tile::wrap;
  return set;
}

/// Runs the example input through the model, when the model's forward takes one Tensor.
template <class M>
std::function<void()> example_forward(M& model, const torch::Tensor& example) {
  if constexpr (requires(M& m, const torch::Tensor& x) { m->forward(x); }) {
    return [model = M(model), example]() mutable { (void)model->forward(example); };
  } else {
    return {};  // no forward(Tensor) to call: planning waits for the first forward
  }
}

/// The one way the entry points attach: `example` empty means plan at the first call.
/// The model's forward as a Tensor -> Tensor function, when it is one (a model
/// with no unit boundaries is then profiled and offloaded as a whole).
template <class M>
std::function<torch::Tensor(const torch::Tensor&)> whole_forward(M& model) {
  if constexpr (requires(M& m, const torch::Tensor& x) {
                  { m->forward(x) } -> std::same_as<torch::Tensor>;
                }) {
    // A weak reference: the attachment must not keep the model alive.
    using Contained = std::remove_cvref_t<decltype(*model)>;
    std::weak_ptr<Contained> typed = std::dynamic_pointer_cast<Contained>(root_of(model));
    return [typed](const torch::Tensor& x) -> torch::Tensor {
      auto m = typed.lock();
      if (!m) throw Error("memscale: the model was destroyed while still wrapped");
      return m->forward(x);
    };
  } else {
    return {};
  }
}

/// `agree` (data parallel): turns this process's plan into the one every rank applies.
template <StrategyType S, class M>
std::shared_ptr<core::attachment> attach(M& model, const Config& config, const torch::Tensor* example,
                                         core::plan_agreement agree = {}) {
  return core::attach(root_of(model), config, techniques_for<S>(config),
                      example ? example_forward(model, *example) : std::function<void()>{}, std::move(agree),
                      whole_forward(model), example);
}

}  // namespace detail

/// Scope of an optimization: detaches in its destructor (which never throws).
/// It detaches only what it attached: after detach() and a new wrap() of the
/// same model, ending an old guard leaves the new attachment alone.
class [[nodiscard]] OptimizationGuard {
 public:
  OptimizationGuard(const OptimizationGuard&) = delete;
  OptimizationGuard& operator=(const OptimizationGuard&) = delete;
  OptimizationGuard(OptimizationGuard&& other) noexcept
      : root_(std::move(other.root_)), attachment_(std::move(other.attachment_)) {}
  OptimizationGuard& operator=(OptimizationGuard&& other) noexcept {
    if (this != &other) {
      release();
      root_ = std::move(other.root_);
      attachment_ = std::move(other.attachment_);
    }
    return *this;
  }
  ~OptimizationGuard() { release(); }

  /// Adopts what attach() returned for `root`.
  OptimizationGuard(std::shared_ptr<torch::nn::Module> root, std::shared_ptr<core::attachment> attachment)
      : root_(std::move(root)), attachment_(std::move(attachment)) {}

  /// The current plan (complete once every chain has seen its first training input).
  [[nodiscard]] Report report() const { return attachment_ ? attachment_->report() : Report{}; }
  /// What the offload engine did so far (tiers, bytes, prefetch hits, warnings);
  /// nullopt until a plan offloads something.
  [[nodiscard]] std::optional<offload::engine_stats> offload_stats() const {
    auto engine = attachment_ ? attachment_->offload_engine() : nullptr;
    if (!engine) return std::nullopt;
    return engine->stats();
  }
  /// Runs `step`, one training step of yours (forward, loss, backward, optimizer),
  /// measuring the device's allocated bytes at every planned unit's boundary
  /// (forward and backward); returns the Report with its measured_timeline, which
  /// to_html() draws beside the projection. Throws memscale::Error before the
  /// model is planned; whatever `step` throws passes through, the plan intact.
  Report trace_step(const std::function<void()>& step) {
    if (!attachment_) throw Error("memscale: trace_step on a released guard");
    return attachment_->trace_step(step);
  }
  /// Whether the guard's attachment still manages its model.
  [[nodiscard]] bool active() const {
    return root_ && attachment_ && core::registry::global().find(root_.get()) == attachment_;
  }
  /// Detaches now instead of at the end of the scope.
  void release() noexcept {
    // Refused while another thread's step is in flight (detail/step_gate.hpp):
    // the model stays registered, so a later memscale::detach(model) restores it.
    if (root_ && !core::detach(root_.get(), attachment_.get()) && attachment_ &&
        core::registry::global().find(root_.get()) == attachment_)
      attachment_->guard_detach_refused(root_->name());
    root_.reset();
    attachment_.reset();
  }

 private:
  std::shared_ptr<torch::nn::Module> root_;
  std::shared_ptr<core::attachment> attachment_;
};

}  // namespace memscale

// memscale — checkpointing as a technique: CheckpointSegment, the chain slot that
// runs consecutive original slots as one checkpointed segment, the slot helpers
// it shares with TileSegment (slots_body, parameters_of, slot_wrapper), and the
// Checkpoint tag the executor wraps a run of slots with.
#pragma once

#include <memory>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/techniques/checkpoint_function.hpp>
#include <memscale/techniques/checkpoint_recompute.hpp>
#include <memscale/techniques/concepts.hpp>

namespace memscale {
namespace detail {

/// A body that runs chain slots in order on one tensor. Under a recompute it
/// restores their buffers afterwards: BatchNorm statistics must not move twice.
inline c10::intrusive_ptr<checkpoint_body> slots_body(std::vector<torch::nn::AnyModule> slots) {
  return c10::make_intrusive<checkpoint_body>([slots = std::move(slots)](const std::vector<torch::Tensor>& in) mutable {
    if (auto* recompute = recompute_scope::current()) recompute->restore_on_close(slots);
    torch::Tensor x = in[0];
    for (auto& slot : slots) x = slot.forward<torch::Tensor>(std::move(x));
    return std::vector<torch::Tensor>{x};
  });
}

/// The parameters the slots read, each once (a module shared by two slots, or a
/// tied weight, would otherwise get its gradient twice).
inline std::vector<torch::Tensor> parameters_of(const std::vector<torch::nn::AnyModule>& slots) {
  std::vector<torch::Tensor> params;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& slot : slots)
    for (const auto& p : slot.ptr()->parameters())
      if (seen.insert(p.unsafeGetTensorImpl()).second) params.push_back(p);
  return params;
}

/// A memscale wrapper that runs original chain slots it does not register
/// (CheckpointSegment, TileSegment): what owns parameters is in slots().
class slot_wrapper {
 public:
  virtual ~slot_wrapper() = default;
  [[nodiscard]] virtual const std::vector<torch::nn::AnyModule>& slots() const noexcept = 0;
};

}  // namespace detail

/// A chain slot that runs consecutive original slots as one checkpointed segment.
/// The originals stay registered in their Sequential; this wrapper registers
/// nothing, so parameters() and state-dict names do not change.
class CheckpointSegmentImpl : public torch::nn::Module, public detail::slot_wrapper {
 public:
  explicit CheckpointSegmentImpl(std::vector<torch::nn::AnyModule> slots)
      : torch::nn::Module("memscale::CheckpointSegment"), slots_(std::move(slots)) {
    params_ = detail::parameters_of(slots_);
    body_ = detail::slots_body(slots_);
  }

  torch::Tensor forward(torch::Tensor x) {
    if (!detail::needs_checkpoint(x, params_)) return body_->fn({std::move(x)})[0];
    if (!probed_) {
      runs_plainly_ = detail::adopt_reads(*body_, x.detach(), params_, slots_, "checkpointed");
      probed_ = true;
    }
    if (runs_plainly_) return body_->fn({std::move(x)})[0];
    return detail::checkpoint_function::apply(body_, at::TensorList(x), at::TensorList(params_))[0];
  }

  [[nodiscard]] const std::vector<torch::nn::AnyModule>& slots() const noexcept override { return slots_; }
  /// The tensors whose gradients flow through this segment: the slots'
  /// parameters, then (after the first training forward) leaves read beyond them.
  [[nodiscard]] const std::vector<torch::Tensor>& gradient_inputs() const noexcept { return params_; }

 private:
  std::vector<torch::nn::AnyModule> slots_;
  std::vector<torch::Tensor> params_;
  c10::intrusive_ptr<detail::checkpoint_body> body_;
  bool probed_ = false;
  bool runs_plainly_ = false;  // reads a non-leaf from outside: checkpointing it would be wrong
};

/// The checkpointing technique: a run of slots becomes one CheckpointSegment.
struct Checkpoint {
  static constexpr technique_id id = technique_id::checkpoint;
  static constexpr std::string_view name = "checkpoint";
  static constexpr bool available = true;
  static torch::nn::AnyModule wrap(std::vector<torch::nn::AnyModule> slots, const wrap_context& = {}) {
    return torch::nn::AnyModule(std::make_shared<CheckpointSegmentImpl>(std::move(slots)));
  }
};

}  // namespace memscale

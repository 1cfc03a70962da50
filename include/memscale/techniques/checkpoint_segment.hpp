// memscale — checkpointing as a technique: CheckpointSegment, the chain slot that
// runs consecutive original slots as one checkpointed segment, the slot helpers
// it shares with TileSegment (slots_body, parameters_of, slot_wrapper), and the
// Checkpoint tag the executor wraps a run of slots with. A run that ends in a
// plain torch::nn::Linear recomputes only up to the Linear's input (linear_tail).
#pragma once

#include <memory>
#include <optional>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/detail/modules.hpp>
#include <memscale/techniques/checkpoint_function.hpp>
#include <memscale/techniques/checkpoint_recompute.hpp>
#include <memscale/techniques/concepts.hpp>

namespace memscale {
namespace detail {

/// A function that runs chain slots in order on one tensor. Under a recompute it
/// restores their buffers afterwards: BatchNorm statistics must not move twice.
inline tensors_fn run_slots(std::vector<torch::nn::AnyModule> slots) {
  return [slots = std::move(slots)](const std::vector<torch::Tensor>& in) mutable {
    if (auto* recompute = recompute_scope::current()) recompute->restore_on_close(slots);
    torch::Tensor x = in[0];
    for (auto& slot : slots) x = slot.forward<torch::Tensor>(std::move(x));
    return std::vector<torch::Tensor>{x};
  };
}

/// A body that runs chain slots in order on one tensor (run_slots).
inline c10::intrusive_ptr<checkpoint_body> slots_body(std::vector<torch::nn::AnyModule> slots) {
  return c10::make_intrusive<checkpoint_body>(run_slots(std::move(slots)));
}

/// Where a checkpointed run of slots ends in a plain Linear: backward runs the
/// slots before it and the Linear's gradients from their output (linear_tail).
/// `params`: the checkpoint's parameters, the Linear's among them.
inline std::optional<linear_tail> linear_tail_of(const std::vector<torch::nn::AnyModule>& slots,
                                                 const std::vector<torch::Tensor>& params) {
  if (slots.empty() || plain_linear(*slots.back().ptr()) == nullptr) return std::nullopt;
  linear_tail tail;
  tail.linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(slots.back().ptr());
  tail.weight = tail.linear->weight;
  tail.bias = tail.linear->bias;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].unsafeGetTensorImpl() == tail.linear->weight.unsafeGetTensorImpl()) tail.weight_param = i;
    if (tail.linear->bias.defined() && params[i].unsafeGetTensorImpl() == tail.linear->bias.unsafeGetTensorImpl())
      tail.bias_param = i;
  }
  if (tail.weight_param == linear_tail::none || (tail.linear->bias.defined() && tail.bias_param == linear_tail::none))
    return std::nullopt;
  tail.prefix = run_slots({slots.begin(), slots.end() - 1});
  return tail;
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
class CheckpointSegmentImpl : public memscale::detail::wrapper_module, public detail::slot_wrapper, public detail::gated {
 public:
  /// `replay_random_draws`: the recompute writes back the forward's random masks
  /// rather than drawing them again (Config::replay_random_draws).
  /// `keep_products`: the forward keeps its matrix products' outputs and the
  /// recompute takes them back (selective recompute, Config::selective_recompute).
  explicit CheckpointSegmentImpl(std::vector<torch::nn::AnyModule> slots, bool replay_random_draws = true,
                                 bool keep_products = false)
      : wrapper_module("memscale::CheckpointSegment"), slots_(std::move(slots)) {
    params_ = detail::parameters_of(slots_);
    body_ = detail::slots_body(slots_);
    body_->tail = detail::linear_tail_of(slots_, params_);
    body_->replay_draws = replay_random_draws;
    body_->keep_products = keep_products;
  }

  torch::Tensor forward(torch::Tensor x) {
    if (!detail::needs_checkpoint(x, params_)) return body_->fn({std::move(x)})[0];
    const detail::step_scope step(gate());  // one training step at a time (a second thread is refused)
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
  static torch::nn::AnyModule wrap(std::vector<torch::nn::AnyModule> slots, const wrap_context& context = {}) {
    return torch::nn::AnyModule(std::make_shared<CheckpointSegmentImpl>(std::move(slots), context.replay_random_draws,
                                                                          context.keep_products));
  }
};

}  // namespace memscale

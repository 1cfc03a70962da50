// memscale — what the public functions accept as a model or a module: a
// torch::nn::ModuleHolder (torch::nn::Sequential, a TORCH_MODULE type) or a
// std::shared_ptr to a torch::nn::Module; the shared_ptr behind either; and
// plain_linear, the module kinds checkpointing treats specially.
#pragma once

#include <concepts>
#include <memory>
#include <type_traits>
#include <typeinfo>

#include <torch/torch.h>

#include <memscale/errors.hpp>

namespace memscale {
namespace detail {

template <class M>
concept module_holder = requires(const M& m) {
  typename M::ContainedType;
  { m.ptr() } -> std::convertible_to<std::shared_ptr<torch::nn::Module>>;
};

template <class M>
concept module_pointer = requires { typename M::element_type; } &&
                         std::is_base_of_v<torch::nn::Module, typename M::element_type> &&
                         std::convertible_to<M, std::shared_ptr<torch::nn::Module>>;

template <class M>
std::shared_ptr<torch::nn::Module> root_of(const M& model) {
  if constexpr (module_holder<M>) {
    return model.is_empty() ? nullptr : std::shared_ptr<torch::nn::Module>(model.ptr());
  } else {
    return std::shared_ptr<torch::nn::Module>(model);
  }
}

/// The module as a plain torch::nn::Linear, or null: not a subclass, whose
/// forward may do more than the product. Its backward needs only its input and
/// parameters, so a checkpointed run ending at it never runs it again
/// (linear_tail in techniques/checkpoint_recompute.hpp; backward_from_input in
/// core/graph.hpp).
inline const torch::nn::LinearImpl* plain_linear(const torch::nn::Module& m) noexcept {
  return typeid(m) == typeid(torch::nn::LinearImpl) ? dynamic_cast<const torch::nn::LinearImpl*>(&m) : nullptr;
}

/// The base of memscale's slot wrappers (memscale::CheckpointSegment, ...): a
/// Sequential's slots hold them while a guard or wrap() is attached, and
/// LibTorch's Sequential::clone() clones slot by slot. Their clone() says what
/// to do instead.
class wrapper_module : public torch::nn::Module {
 public:
  using torch::nn::Module::Module;
  std::shared_ptr<torch::nn::Module> clone(const c10::optional<c10::Device>& = c10::nullopt) const override {
    throw Error("memscale: clone() reached " + name() +
                ", which stands in a Sequential's slot while memscale is attached to the model (a guard from "
                "optimize() or wrap(), until it ends or memscale::detach); clone the model before or after, or "
                "copy its state with torch::save and torch::load");
  }
};

}  // namespace detail

/// Satisfied by what wrap/optimize/detach accept: a module holder or a shared_ptr to a Module.
template <class M>
concept Model = detail::module_holder<M> || detail::module_pointer<M>;

}  // namespace memscale

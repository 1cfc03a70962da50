// memscale — what the public functions accept as a model or a module: a
// torch::nn::ModuleHolder (torch::nn::Sequential, a TORCH_MODULE type) or a
// std::shared_ptr to a torch::nn::Module; the shared_ptr behind either;
// plain_linear, the module kinds checkpointing treats specially; and a model's
// structure as text (what a step's memory depends on besides its input).
#pragma once

#include <concepts>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <unordered_set>
#include <vector>

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

/// A tensor's shape and type, as "[2, 3] Float".
inline std::string shape_of(const torch::Tensor& t) {
  std::ostringstream os;
  os << t.sizes() << " " << t.scalar_type();
  return os.str();
}

/// A model's structure: each module's path and type ("blocks.0:torch::nn::LinearImpl"),
/// each parameter's path, shape and type (" frozen" where it needs no
/// gradient), each defined buffer's path, shape and type.
struct module_structure {
  std::vector<std::string> modules, parameters, buffers;
};
inline module_structure structure_of(torch::nn::Module& root) {
  module_structure out;
  for (const auto& m : root.named_modules("", /*include_self=*/true))
    out.modules.push_back(m.key() + ":" + m.value()->name());
  for (const auto& p : root.named_parameters(/*recurse=*/true))
    out.parameters.push_back(p.key() + ":" + shape_of(p.value()) + (p.value().requires_grad() ? "" : " frozen"));
  for (const auto& b : root.named_buffers(/*recurse=*/true))
    if (b.value().defined()) out.buffers.push_back(b.key() + ":" + shape_of(b.value()));
  return out;
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

/// A module's tensors without repeats (LibTorch lists a tensor registered
/// under two names, a tied weight, twice), in their order.
inline std::vector<at::Tensor> unique_tensors(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<const void*> seen;
  std::vector<at::Tensor> out;
  for (const auto& t : tensors)
    if (seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
  return out;
}

}  // namespace detail

/// Satisfied by what wrap/optimize/detach accept: a module holder or a shared_ptr to a Module.
template <class M>
concept Model = detail::module_holder<M> || detail::module_pointer<M>;

}  // namespace memscale

// memscale::detail — outputs backward can compute again from tensors it keeps
// anyway (Config::recompute_saved_outputs). A LayerNorm's output, a GELU's or
// SiLU's, a Dropout's product (input * noise, on CPU) is kept for backward by the
// op that consumes it (a Linear's product, attention's matmul), while every input
// it was computed from is kept as well, by its own op's backward: LayerNorm keeps
// its input and parameters, GELU and SiLU their input, Dropout's product its
// noise, softmax its output. Stored as a recipe (the op and those saved inputs)
// and computed again when backward asks for it, the output's bytes are free
// between forward and backward for one pass over it, bit for bit (the same
// kernel on the same inputs). Megatron's selective recompute and PyTorch's
// selective checkpoint policies pick such ops by hand; here the saved-tensor
// hooks of techniques/saved_compaction.hpp decide per tensor.
//
// How: kernels for aten::gelu, aten::silu, aten::native_layer_norm and
// aten::mul.Tensor on DispatchKey::ADInplaceOrView, as product_replay.hpp's for
// products (LibTorch 1.13 and 2.x register only in-place and view operators on
// that key). Below the autograd key the op's own node has already saved its
// inputs when the kernel runs (detail/output_frames.hpp has the frames). While
// an output_frame is open on this thread,
// grad mode is on and an input requires grad, the kernel tells the frame what
// the op computed and from what; otherwise it hands straight on. Registration
// is made at the first frame; where LibTorch or another library registered for
// these operators on that key, nothing is registered (outputs_recomputable()
// is false) and every output is saved as it is; likewise where product_replay's
// _unsafe_view kernel, which reports aliases with version counters of their
// own, is not registered.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/gelu_ops.h>
#include <ATen/ops/mul_ops.h>
#include <ATen/ops/native_layer_norm_ops.h>
#include <ATen/ops/silu_ops.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <memscale/detail/output_frames.hpp>
#include <memscale/detail/product_replay.hpp>

namespace memscale::detail {

/// The op of `recipe` on `inputs` again, under no-grad: bit for bit the
/// forward's output where the inputs are the forward's.
inline at::Tensor recompute_output(const output_recipe& recipe, const std::vector<at::Tensor>& inputs) {
  at::NoGradGuard no_grad;
  const auto optional = [](const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; };
  switch (recipe.op) {
    case output_op::gelu: return at::gelu(inputs.at(0), recipe.approximate);
    case output_op::silu: return at::silu(inputs.at(0));
    case output_op::layer_norm:
      return std::get<0>(at::native_layer_norm(inputs.at(0), recipe.normalized_shape, optional(inputs.at(1)),
                                               optional(inputs.at(2)), recipe.eps));
    case output_op::mul: return at::mul(inputs.at(0), inputs.at(1));
  }
  TORCH_CHECK(false, "memscale: unknown recomputable op");
  return {};  // not reached (TORCH_CHECK throws); some builds cannot tell
}

/// Runs `compute` and, inside a frame, tells the frame what it computed.
template <class Compute>
auto through_output_frame(output_recipe recipe, std::vector<at::Tensor> inputs, Compute&& compute) {
  auto* frame = output_frames().back();
  bool activation = false;
  for (const auto& t : inputs) activation = activation || (t.defined() && t.requires_grad());
  if (!activation || !c10::GradMode::is_enabled()) return compute();
  const bool timed = frame->timed();
  const bool cuda = timed && inputs.front().is_cuda();
  if (cuda) torch::cuda::synchronize(inputs.front().device().index());
  const auto start = std::chrono::steady_clock::now();
  auto result = compute();
  if (cuda) torch::cuda::synchronize(inputs.front().device().index());
  if (timed) recipe.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const at::Tensor* out = nullptr;
  if constexpr (std::is_same_v<std::decay_t<decltype(result)>, at::Tensor>)
    out = &result;
  else
    out = &std::get<0>(result);
  if (out->defined() && out->layout() == c10::kStrided) {
    recipe.sizes = out->sizes().vec();
    recipe.strides = out->strides().vec();
    frame->computed(std::move(recipe), *out, inputs);
  }
  return result;
}

inline bool output_frame_open() { return !output_frames().empty(); }

/// Registers the kernels once per process; false where the key already has
/// kernels for these operators (then nothing is registered).
inline bool outputs_recomputable() {
  static const bool registered = [] {
    if (!product_replay_available()) return false;  // its _unsafe_view kernel reports aliases
    try {
      auto& dispatcher = c10::Dispatcher::singleton();
      const std::pair<const char*, const char*> ops[] = {
          {"aten::gelu", ""}, {"aten::silu", ""}, {"aten::native_layer_norm", ""}, {"aten::mul", "Tensor"}};
      for (const auto& [name, overload] : ops)
        if (dispatcher.findSchemaOrThrow(name, overload).hasKernelForDispatchKey(c10::DispatchKey::ADInplaceOrView))
          return false;
      // Kept for the process's lifetime: a registration is undone when its Library is destroyed.
      static auto* kernels =
          new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::ADInplaceOrView, __FILE__, __LINE__);
      // Lambdas, not TORCH_FN (product_replay.hpp says why).
      kernels->impl("gelu", [](c10::DispatchKeySet keys, const at::Tensor& self, c10::string_view approximate) {
        const auto compute = [&] {
          return at::_ops::gelu::redispatch(keys & c10::after_ADInplaceOrView_keyset, self, approximate);
        };
        if (!output_frame_open()) return compute();
        output_recipe r;
        r.op = output_op::gelu;
        r.approximate = std::string(approximate);
        return through_output_frame(std::move(r), {self}, compute);
      });
      kernels->impl("silu", [](c10::DispatchKeySet keys, const at::Tensor& self) {
        const auto compute = [&] { return at::_ops::silu::redispatch(keys & c10::after_ADInplaceOrView_keyset, self); };
        if (!output_frame_open()) return compute();
        output_recipe r;
        r.op = output_op::silu;
        return through_output_frame(std::move(r), {self}, compute);
      });
      kernels->impl("native_layer_norm", [](c10::DispatchKeySet keys, const at::Tensor& input,
                                            c10::SymIntArrayRef normalized_shape,
                                            const c10::optional<at::Tensor>& weight,
                                            const c10::optional<at::Tensor>& bias, double eps) {
        const auto compute = [&] {
          return at::_ops::native_layer_norm::redispatch(keys & c10::after_ADInplaceOrView_keyset, input,
                                                         normalized_shape, weight, bias, eps);
        };
        if (!output_frame_open()) return compute();
        output_recipe r;
        r.op = output_op::layer_norm;
        for (const auto& s : normalized_shape) r.normalized_shape.push_back(s.expect_int());
        r.eps = eps;
        return through_output_frame(std::move(r),
                                    {input, weight.has_value() ? *weight : at::Tensor(),
                                     bias.has_value() ? *bias : at::Tensor()},
                                    compute);
      });
      kernels->impl("mul.Tensor", [](c10::DispatchKeySet keys, const at::Tensor& self, const at::Tensor& other) {
        const auto compute = [&] {
          return at::_ops::mul_Tensor::redispatch(keys & c10::after_ADInplaceOrView_keyset, self, other);
        };
        if (!output_frame_open()) return compute();
        output_recipe r;
        r.op = output_op::mul;
        return through_output_frame(std::move(r), {self, other}, compute);
      });
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return registered;
}

/// While alive, `frame` hears the outputs computed on this thread (innermost
/// wins). Opens nothing where the kernels are not registered.
class output_frame_scope {
 public:
  explicit output_frame_scope(output_frame& frame) : open_(outputs_recomputable()) {
    if (open_) output_frames().push_back(&frame);
  }
  output_frame_scope(const output_frame_scope&) = delete;
  output_frame_scope& operator=(const output_frame_scope&) = delete;
  ~output_frame_scope() {
    if (open_ && !output_frames().empty()) output_frames().pop_back();
  }

 private:
  bool open_;
};

}  // namespace memscale::detail

// memscale — the per-operator shape rules of shape-only execution: the
// outputs (output_spec) of the operators LibTorch 1.13 has no meta kernel for
// (layer norm, embedding, batch norm; rule_outputs), made as their CPU kernels
// make them, from arguments read and checked through rule_args. The fallback
// (predict/shape_only_fallback.hpp) allocates what a rule returns. LibTorch 1.x
// only. Part of shape-only execution (predict/shape_only.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#if TORCH_VERSION_MAJOR < 2
#include <c10/util/strides.h>
#endif

namespace memscale::predictor::detail {

#if TORCH_VERSION_MAJOR < 2

/// An output a shape rule makes: its sizes, strides and type (undefined: the
/// operator returns no tensor there).
struct output_spec {
  bool defined = false;
  std::vector<std::int64_t> sizes;
  std::vector<std::int64_t> strides;
  caffe2::TypeMeta dtype;
};

inline output_spec contiguous_spec(std::vector<std::int64_t> sizes, caffe2::TypeMeta dtype) {
  const auto strides = c10::contiguous_strides(sizes);
  return {true, std::move(sizes), {strides.begin(), strides.end()}, dtype};
}

/// The arguments a rule reads, checked: the i-th argument as a defined CPU
/// float or double tensor in the default contiguous layout (what the rules
/// cover: the kernels then copy nothing and make contiguous outputs), an
/// optional one, integers, flags.
struct rule_args {
  c10::ArrayRef<c10::IValue> args;
  bool ok = true;

  const torch::Tensor* dense(std::size_t i) {
    if (i >= args.size() || !args[i].isTensor()) return fail();
    const auto& t = args[i].toTensor();
    if (!t.defined() || !t.device().is_cpu() || t.layout() != c10::kStrided || !t.is_contiguous() ||
        (t.scalar_type() != c10::kFloat && t.scalar_type() != c10::kDouble))
      return fail();
    return &t;
  }
  /// Absent (None or undefined): nullptr and still ok.
  const torch::Tensor* optional(std::size_t i) {
    if (i >= args.size()) return fail();
    if (args[i].isNone() || (args[i].isTensor() && !args[i].toTensor().defined())) return nullptr;
    return dense(i);
  }
  const torch::Tensor* indices(std::size_t i) {
    if (i >= args.size() || !args[i].isTensor()) return fail();
    const auto& t = args[i].toTensor();
    if (!t.defined() || !t.device().is_cpu() || !t.is_contiguous() ||
        (t.scalar_type() != c10::kLong && t.scalar_type() != c10::kInt))
      return fail();
    return &t;
  }
  std::vector<std::int64_t> ints(std::size_t i) {
    if (i < args.size() && args[i].isIntList()) return args[i].toIntVector();
    ok = false;
    return {};
  }
  std::int64_t integer(std::size_t i) {
    if (i < args.size() && args[i].isInt()) return args[i].toInt();
    ok = false;
    return 0;
  }
  bool flag(std::size_t i) {
    if (i < args.size() && args[i].isBool()) return args[i].toBool();
    ok = false;
    return false;
  }
  std::vector<bool> mask(std::size_t i) {
    if (i < args.size() && args[i].isBoolList()) {
      std::vector<bool> m;
      for (const bool b : args[i].toBoolList()) m.push_back(b);
      return m;
    }
    ok = false;
    return {};
  }

 private:
  const torch::Tensor* fail() {
    ok = false;
    return nullptr;
  }
};

/// Output shapes for operators LibTorch 1.13 has no meta kernel for, made as
/// their CPU kernels make them (the same outputs, contiguous): layer norm,
/// embedding and batch norm, forward and backward. nullopt where a rule does
/// not cover the call (another type or layout): the operator then runs for
/// real. Batch norm's update of the running statistics, like every value, is
/// skipped. Convolution has none: its CPU kernels allocate temporaries of the
/// output's size beside it (measured on a ResNet-style CNN: a shape-only step
/// with a rule for it peaked two activations short of the real step), which a
/// rule would miss. Checked against the real kernels and steps in
/// tests/test_predict.cpp.
inline std::optional<std::vector<output_spec>> rule_outputs(const c10::FunctionSchema& schema,
                                                           c10::ArrayRef<c10::IValue> args) {
  const auto& name = schema.name();
  if (!schema.overload_name().empty()) return std::nullopt;
  rule_args a{args};
  std::vector<output_spec> out;
  const auto absent = output_spec{};
  if (name == "aten::native_layer_norm") {
    // (input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd)
    const auto* input = a.dense(0);
    const auto normalized = a.ints(1);
    (void)a.optional(2);
    (void)a.optional(3);
    if (!a.ok || normalized.size() > static_cast<std::size_t>(input->dim())) return std::nullopt;
    const auto axis = static_cast<std::size_t>(input->dim()) - normalized.size();
    std::vector<std::int64_t> stat(input->sizes().begin(), input->sizes().begin() + static_cast<std::ptrdiff_t>(axis));
    stat.resize(static_cast<std::size_t>(input->dim()), 1);
    out = {contiguous_spec(input->sizes().vec(), input->dtype()), contiguous_spec(stat, input->dtype()),
           contiguous_spec(stat, input->dtype())};
  } else if (name == "aten::native_layer_norm_backward") {
    // (grad_out, input, normalized_shape, mean, rstd, weight?, bias?, output_mask) -> (dX, dgamma, dbeta)
    (void)a.dense(0);
    const auto* input = a.dense(1);
    (void)a.ints(2);
    const auto* weight = a.optional(5);
    const auto* bias = a.optional(6);
    const auto mask = a.mask(7);
    if (!a.ok || mask.size() != 3 || (mask[1] && weight == nullptr) || (mask[2] && bias == nullptr)) return std::nullopt;
    out = {mask[0] ? contiguous_spec(input->sizes().vec(), input->dtype()) : absent,
           mask[1] ? contiguous_spec(weight->sizes().vec(), weight->dtype()) : absent,
           mask[2] ? contiguous_spec(bias->sizes().vec(), bias->dtype()) : absent};
  } else if (name == "aten::embedding") {
    // (weight, indices, padding_idx, scale_grad_by_freq, sparse) -> out
    const auto* weight = a.dense(0);
    const auto* indices = a.indices(1);
    if (!a.ok || weight->dim() != 2) return std::nullopt;
    auto sizes = indices->sizes().vec();
    sizes.push_back(weight->size(1));
    out = {contiguous_spec(sizes, weight->dtype())};
  } else if (name == "aten::embedding_dense_backward") {
    // (grad_output, indices, num_weights, padding_idx, scale_grad_by_freq) -> grad_weight
    const auto* grad = a.dense(0);
    (void)a.indices(1);
    const auto rows = a.integer(2);
    if (!a.ok || grad->dim() < 1) return std::nullopt;
    out = {contiguous_spec({rows, grad->size(-1)}, grad->dtype())};
  } else if (name == "aten::native_batch_norm") {
    // (input, weight?, bias?, running_mean?, running_var?, training, momentum, eps) -> (out, save_mean, save_invstd)
    const auto* input = a.dense(0);
    for (std::size_t i = 1; i <= 4; ++i) {
      const auto* p = a.optional(i);
      if (p != nullptr && p->scalar_type() != input->scalar_type()) return std::nullopt;  // mixed types
    }
    const bool training = a.flag(5);
    if (!a.ok || input->dim() < 2) return std::nullopt;
    const std::vector<std::int64_t> stats{training ? input->size(1) : 0};
    out = {contiguous_spec(input->sizes().vec(), input->dtype()), contiguous_spec(stats, input->dtype()),
           contiguous_spec(stats, input->dtype())};
  } else if (name == "aten::native_batch_norm_backward") {
    // (grad_out, input, weight?, running_mean?, running_var?, save_mean?, save_invstd?, train, eps, output_mask)
    (void)a.dense(0);
    const auto* input = a.dense(1);
    for (std::size_t i = 2; i <= 6; ++i) {
      const auto* p = a.optional(i);
      if (p != nullptr && p->scalar_type() != input->scalar_type()) return std::nullopt;
    }
    const auto mask = a.mask(9);
    if (!a.ok || mask.size() != 3 || input->dim() < 2) return std::nullopt;
    const std::vector<std::int64_t> channels{input->size(1)};
    out = {mask[0] ? contiguous_spec(input->sizes().vec(), input->dtype()) : absent,
           mask[1] ? contiguous_spec(channels, input->dtype()) : absent,
           mask[2] ? contiguous_spec(channels, input->dtype()) : absent};
  } else {
    return std::nullopt;
  }
  return out;
}

#endif  // TORCH_VERSION_MAJOR < 2

}  // namespace memscale::predictor::detail

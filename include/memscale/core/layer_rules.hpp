// memscale — static profiling rules: for each known layer type, the output shape
// and the bytes its backward keeps, from the input shape alone (no forward run).
// The figures follow what LibTorch's CPU kernels save (checked against
// measurement by tests/test_profiler.cpp). Custom modules add a rule with
// memscale::register_layer_rule<Impl>(...); a type with no rule is measured.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <typeindex>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/detail/compat.hpp>

namespace memscale {

/// A slot's input as static profiling sees it.
struct layer_input {
  std::vector<std::int64_t> shape;
  c10::ScalarType dtype = c10::kFloat;
  bool training = true;
  c10::DeviceType device = c10::kCPU;  ///< kernels differ (CUDA dropout keeps a 1-byte mask)

  [[nodiscard]] std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
  [[nodiscard]] std::int64_t bytes() const {
    return numel() * static_cast<std::int64_t>(c10::elementSize(dtype));
  }
};

/// What a rule says about one layer for one input.
struct layer_estimate {
  std::vector<std::int64_t> output_shape;
  c10::ScalarType output_dtype = c10::kFloat;
  bool output_is_view = false;
  std::int64_t saved_bytes = 0;  ///< kept for backward beyond input and output
  bool saves_input = false;
  bool saves_output = false;
  std::int64_t workspace_bytes = 0;
  /// What its backward holds beyond the gradients it returns, where no run
  /// measures it (a run's figure replaces it: profiler.hpp, with_measured).
  std::int64_t backward_workspace_bytes = 0;
  std::int64_t fixed_workspace_bytes = 0;  ///< slot_cost::fixed_workspace_bytes
  double flops = 0.0;  ///< forward floating-point operations (recompute cost)

  [[nodiscard]] std::int64_t output_bytes() const {
    std::int64_t n = 1;
    for (auto d : output_shape) n *= d;
    return n * static_cast<std::int64_t>(c10::elementSize(output_dtype));
  }
};

using layer_rule = std::function<std::optional<layer_estimate>(const torch::nn::Module&, const layer_input&)>;

namespace detail {

inline std::int64_t pool_or_conv_length(std::int64_t length, std::int64_t kernel, std::int64_t stride,
                                        std::int64_t padding, std::int64_t dilation, bool ceil_mode = false) {
  const auto span = length + 2 * padding - dilation * (kernel - 1) - 1;
  auto out = (ceil_mode ? (span + stride - 1) / stride : span / stride) + 1;
  if (ceil_mode && (out - 1) * stride >= length + padding) --out;
  return out;
}

template <std::size_t D, class Options>
std::optional<std::vector<std::int64_t>> conv_output_shape(const Options& o, const layer_input& in) {
  if (in.shape.size() != D + 2) return std::nullopt;
  std::vector<std::int64_t> out{in.shape[0], o.out_channels()};
  const auto& padding = o.padding();
  for (std::size_t i = 0; i < D; ++i) {
    const auto length = in.shape[2 + i];
    const auto k = (*o.kernel_size())[i], s = (*o.stride())[i], d = (*o.dilation())[i];
    if (const auto* p = compat::get_if<torch::ExpandingArray<D>>(&padding)) {
      out.push_back(pool_or_conv_length(length, k, s, (**p)[i], d));
    } else if (compat::holds_alternative<torch::enumtype::kSame>(padding)) {
      out.push_back(length);
    } else {
      out.push_back(pool_or_conv_length(length, k, s, 0, d));
    }
  }
  return out;
}

template <std::size_t D, class Impl>
std::optional<layer_estimate> conv_rule(const Impl& m, const layer_input& in) {
  const auto& o = m.options;
  auto shape = conv_output_shape<D>(o, in);
  if (!shape) return std::nullopt;
  layer_estimate e;
  e.output_shape = *shape;
  e.output_dtype = in.dtype;
  e.saves_input = true;
  std::int64_t out_positions = 1;
  for (std::size_t i = 2; i < shape->size(); ++i) out_positions *= (*shape)[i];
  std::int64_t kernel = 1;
  for (std::size_t i = 0; i < D; ++i) kernel *= (*o.kernel_size())[i];
  e.flops = 2.0 * static_cast<double>(in.shape[0] * out_positions * o.out_channels() *
                                      (o.in_channels() / o.groups()) * kernel);
  // oneDNN's on CPU (measured, 1.13): forward, the weight's bytes and the
  // larger of the input's and output's; backward, the input's and output's, or
  // the weight's where larger. cuDNN's on CUDA is not known here.
  const auto weight = static_cast<std::int64_t>(m.weight.defined() ? m.weight.nbytes() : 0);
  e.workspace_bytes = weight + std::max(in.bytes(), e.output_bytes());
  e.backward_workspace_bytes = std::max(weight, in.bytes() + e.output_bytes());
#if TORCH_VERSION_MAJOR >= 2
  // LibTorch 2.x (2.14.1, one thread): a strided, ungrouped convolution's
  // backward holds a second buffer of the input's bytes less the weight's
  // (33.3 MB for 64 rows of 64x32x32 to 128 channels at stride 2, where 1.13
  // held 25.2, the input's and output's). From 8 input channels up: a 3- or
  // 4-channel stem's differs in either version, and its input needs no gradient.
  bool strided = false;
  for (std::size_t i = 0; i < D; ++i) strided = strided || (*o.stride())[i] > 1;
  if (strided && o.groups() == 1 && o.in_channels() >= 8)
    e.backward_workspace_bytes = std::max(e.backward_workspace_bytes, 2 * in.bytes() - weight);
#endif
  e.fixed_workspace_bytes = weight;
  return e;
}

template <std::size_t D, class Impl>
std::optional<layer_estimate> max_pool_rule(const Impl& m, const layer_input& in) {
  const auto& o = m.options;
  if (in.shape.size() != D + 2 && in.shape.size() != D + 1) return std::nullopt;
  const auto lead = in.shape.size() - D;
  std::vector<std::int64_t> shape(in.shape.begin(), in.shape.begin() + static_cast<std::ptrdiff_t>(lead));
  for (std::size_t i = 0; i < D; ++i)
    shape.push_back(pool_or_conv_length(in.shape[lead + i], (*o.kernel_size())[i], (*o.stride())[i],
                                        (*o.padding())[i], (*o.dilation())[i], o.ceil_mode()));
  layer_estimate e;
  e.output_shape = shape;
  e.output_dtype = in.dtype;
  e.saves_input = true;
  // With grad, LibTorch runs max_pool*_with_indices and keeps the int64 indices.
  e.saved_bytes = e.output_bytes() / static_cast<std::int64_t>(c10::elementSize(in.dtype)) * 8;
  e.flops = static_cast<double>(in.numel());
  return e;
}

template <std::size_t D, class Impl>
std::optional<layer_estimate> avg_pool_rule(const Impl& m, const layer_input& in) {
  const auto& o = m.options;
  if (in.shape.size() != D + 2 && in.shape.size() != D + 1) return std::nullopt;
  const auto lead = in.shape.size() - D;
  std::vector<std::int64_t> shape(in.shape.begin(), in.shape.begin() + static_cast<std::ptrdiff_t>(lead));
  for (std::size_t i = 0; i < D; ++i)
    shape.push_back(pool_or_conv_length(in.shape[lead + i], (*o.kernel_size())[i], (*o.stride())[i],
                                        (*o.padding())[i], 1, o.ceil_mode()));
  layer_estimate e;
  e.output_shape = shape;
  e.output_dtype = in.dtype;
  e.saves_input = true;
  e.flops = static_cast<double>(in.numel());
  return e;
}

/// Elementwise layer: same shape; which side its backward keeps.
inline layer_estimate elementwise(const layer_input& in, bool saves_input, bool saves_output, double flops_per) {
  layer_estimate e;
  e.output_shape = in.shape;
  e.output_dtype = in.dtype;
  e.saves_input = saves_input;
  e.saves_output = saves_output;
  e.flops = flops_per * static_cast<double>(in.numel());
  return e;
}

inline layer_estimate identity_view(const layer_input& in) {
  layer_estimate e;
  e.output_shape = in.shape;
  e.output_dtype = in.dtype;
  e.output_is_view = true;
  return e;
}

std::optional<layer_estimate> estimate_sequential(const torch::nn::SequentialImpl& seq, const layer_input& in);

/// Per-module-type rules `Result(const Impl&, const layer_input&)`, thread-safe;
/// a rule set for a type replaces the one it had. The static profiling rules
/// (below) and the row-independence rules (core/tile_rules.hpp) are two of them.
template <class Result>
class rules_by_type {
 public:
  using rule = std::function<Result(const torch::nn::Module&, const layer_input&)>;

  /// Sets the rule for modules of type Impl: `fn(const Impl&, const layer_input&)`.
  template <class Impl, class Fn>
  void set(Fn fn) {
    rule erased = [fn = std::move(fn)](const torch::nn::Module& m, const layer_input& in) mutable -> Result {
      return fn(dynamic_cast<const Impl&>(m), in);
    };
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [t, r] : rules_)
      if (t == std::type_index(typeid(Impl))) {
        r = std::move(erased);
        return;
      }
    rules_.emplace_back(std::type_index(typeid(Impl)), std::move(erased));
  }

  /// The rule for `module`'s type (a copy, to run outside the lock), or empty.
  [[nodiscard]] rule find(const torch::nn::Module& module) const {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [t, r] : rules_)
      if (t == std::type_index(typeid(module))) return r;
    return {};
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::pair<std::type_index, rule>> rules_;
};

/// Registry of static profiling rules keyed by module type; built-ins first, user rules may override.
class rule_registry {
 public:
  static rule_registry& global() {
    static rule_registry registry;
    return registry;
  }

  template <class Impl, class Fn>
  void add(Fn fn) {
    rules_.template set<Impl>(std::move(fn));
  }

  [[nodiscard]] std::optional<layer_estimate> estimate(const torch::nn::Module& module,
                                                       const layer_input& in) const {
    if (auto rule = rules_.find(module)) return rule(module, in);
    // A Sequential can only be a slot as a subclass with a concrete forward (the
    // LibTorch idiom for nesting); such a slot is estimated as the chain it runs.
    if (const auto* seq = dynamic_cast<const torch::nn::SequentialImpl*>(&module))
      return estimate_sequential(*seq, in);
    return std::nullopt;
  }

  [[nodiscard]] bool knows(const torch::nn::Module& module) const {
    return static_cast<bool>(rules_.find(module)) || dynamic_cast<const torch::nn::SequentialImpl*>(&module) != nullptr;
  }

 private:
  rule_registry();
  template <class Impl>
  void builtin(std::function<std::optional<layer_estimate>(const Impl&, const layer_input&)> rule) {
    add<Impl>(std::move(rule));
  }

  rules_by_type<std::optional<layer_estimate>> rules_;
};

inline rule_registry::rule_registry() {
  namespace nn = torch::nn;
  builtin<nn::LinearImpl>([](const nn::LinearImpl& m, const layer_input& in) -> std::optional<layer_estimate> {
    if (in.shape.empty() || in.shape.back() != m.options.in_features()) return std::nullopt;
    layer_estimate e;
    e.output_shape = in.shape;
    e.output_shape.back() = m.options.out_features();
    e.output_dtype = in.dtype;
    e.saves_input = true;  // for the weight gradient
    e.flops = 2.0 * static_cast<double>(in.numel() / in.shape.back() * m.options.in_features() *
                                        m.options.out_features());
    return e;
  });
  builtin<nn::Conv1dImpl>([](const nn::Conv1dImpl& m, const layer_input& in) { return conv_rule<1>(m, in); });
  builtin<nn::Conv2dImpl>([](const nn::Conv2dImpl& m, const layer_input& in) { return conv_rule<2>(m, in); });
  auto batch_norm = [](std::int64_t features, const layer_input& in) -> std::optional<layer_estimate> {
    if (in.shape.size() < 2 || in.shape[1] != features) return std::nullopt;
    auto e = elementwise(in, true, false, 4.0);
    if (in.training) {
      e.saved_bytes = 2 * features * 4;  // save_mean, save_invstd (float)
      e.backward_workspace_bytes = e.output_bytes();  // measured on CPU, at any batch
    }
    return e;
  };
  builtin<nn::BatchNorm1dImpl>([batch_norm](const nn::BatchNorm1dImpl& m, const layer_input& in) {
    return batch_norm(m.options.num_features(), in);
  });
  builtin<nn::BatchNorm2dImpl>([batch_norm](const nn::BatchNorm2dImpl& m, const layer_input& in) {
    return batch_norm(m.options.num_features(), in);
  });
  builtin<nn::LayerNormImpl>([](const nn::LayerNormImpl& m, const layer_input& in) -> std::optional<layer_estimate> {
    const auto& normalized = m.options.normalized_shape();
    if (in.shape.size() < normalized.size()) return std::nullopt;
    std::int64_t row = 1;
    for (std::size_t i = 0; i < normalized.size(); ++i) {
      if (in.shape[in.shape.size() - normalized.size() + i] != normalized[i]) return std::nullopt;
      row *= normalized[i];
    }
    auto e = elementwise(in, true, false, 8.0);
    e.saved_bytes = 2 * (in.numel() / row) * 4;  // mean and rstd per row (float)
    return e;
  });
  builtin<nn::DropoutImpl>([](const nn::DropoutImpl& m, const layer_input& in) -> std::optional<layer_estimate> {
    if (m.options.inplace()) return std::nullopt;  // measured: it modifies its input
    if (!in.training || m.options.p() == 0.0) return identity_view(in);
    // On CPU, dropout is input * noise and the multiply keeps the noise tensor; on
    // CUDA the fused kernel keeps a boolean mask.
    auto e = elementwise(in, false, false, 3.0);
    e.saved_bytes = in.device == c10::kCUDA ? in.numel() : in.bytes();
    return e;
  });
  builtin<nn::ReLUImpl>([](const nn::ReLUImpl& m, const layer_input& in) -> std::optional<layer_estimate> {
    if (m.options.inplace()) return std::nullopt;
    return elementwise(in, false, true, 1.0);
  });
  builtin<nn::GELUImpl>([](const nn::GELUImpl&, const layer_input& in) -> std::optional<layer_estimate> {
    return elementwise(in, true, false, 8.0);
  });
  builtin<nn::SiLUImpl>([](const nn::SiLUImpl&, const layer_input& in) -> std::optional<layer_estimate> {
    return elementwise(in, true, false, 4.0);
  });
  builtin<nn::TanhImpl>([](const nn::TanhImpl&, const layer_input& in) -> std::optional<layer_estimate> {
    return elementwise(in, false, true, 4.0);
  });
  builtin<nn::SigmoidImpl>([](const nn::SigmoidImpl&, const layer_input& in) -> std::optional<layer_estimate> {
    return elementwise(in, false, true, 4.0);
  });
  builtin<nn::IdentityImpl>([](const nn::IdentityImpl&, const layer_input& in) -> std::optional<layer_estimate> {
    return identity_view(in);
  });
  builtin<nn::EmbeddingImpl>([](const nn::EmbeddingImpl& m, const layer_input& in) -> std::optional<layer_estimate> {
    if (c10::isFloatingType(in.dtype)) return std::nullopt;
    layer_estimate e;
    e.output_shape = in.shape;
    e.output_shape.push_back(m.options.embedding_dim());
    e.output_dtype = m.weight.scalar_type();
    e.saves_input = true;  // the indices, for the sparse weight gradient
    e.flops = static_cast<double>(in.numel() * m.options.embedding_dim());
    return e;
  });
  builtin<nn::FlattenImpl>([](const nn::FlattenImpl& m, const layer_input& in) -> std::optional<layer_estimate> {
    const auto rank = static_cast<std::int64_t>(in.shape.size());
    auto start = m.options.start_dim(), end = m.options.end_dim();
    if (start < 0) start += rank;
    if (end < 0) end += rank;
    if (rank == 0 || start < 0 || end >= rank || start > end) return std::nullopt;
    layer_estimate e = identity_view(in);
    e.output_shape.assign(in.shape.begin(), in.shape.begin() + start);
    std::int64_t merged = 1;
    for (auto i = start; i <= end; ++i) merged *= in.shape[static_cast<std::size_t>(i)];
    e.output_shape.push_back(merged);
    e.output_shape.insert(e.output_shape.end(), in.shape.begin() + end + 1, in.shape.end());
    return e;  // a view of a contiguous input
  });
  builtin<nn::MaxPool1dImpl>([](const nn::MaxPool1dImpl& m, const layer_input& in) { return max_pool_rule<1>(m, in); });
  builtin<nn::MaxPool2dImpl>([](const nn::MaxPool2dImpl& m, const layer_input& in) { return max_pool_rule<2>(m, in); });
  builtin<nn::AvgPool1dImpl>([](const nn::AvgPool1dImpl& m, const layer_input& in) { return avg_pool_rule<1>(m, in); });
  builtin<nn::AvgPool2dImpl>([](const nn::AvgPool2dImpl& m, const layer_input& in) { return avg_pool_rule<2>(m, in); });
}

/// A nested Sequential as one slot: its children composed as a chain.
inline std::optional<layer_estimate> estimate_sequential(const torch::nn::SequentialImpl& seq,
                                                         const layer_input& in) {
  if (seq.is_empty()) return std::nullopt;
  layer_input current = in;
  layer_estimate whole;
  std::int64_t live = 0;
  bool previous_keeps = true;
  bool first = true;
  std::int64_t peak_extra = 0;
  for (const auto& slot : const_cast<torch::nn::SequentialImpl&>(seq)) {
    auto e = rule_registry::global().estimate(*slot.ptr(), current);
    if (!e) return std::nullopt;
    const auto out = e->output_is_view ? 0 : e->output_bytes();
    peak_extra = std::max(peak_extra, live + out + e->saved_bytes + e->workspace_bytes);
    const bool freed = !first && !previous_keeps && !e->saves_input && !e->output_is_view;
    live += out + e->saved_bytes - (freed ? current.bytes() : 0);
    if (first) {
      whole.saves_input = e->saves_input;
      whole.output_is_view = e->output_is_view;
    } else {
      whole.output_is_view = whole.output_is_view && e->output_is_view;
    }
    previous_keeps = e->saves_output || e->output_is_view;
    whole.saves_output = e->saves_output;
    whole.flops += e->flops;
    whole.backward_workspace_bytes = std::max(whole.backward_workspace_bytes, e->backward_workspace_bytes);
    whole.fixed_workspace_bytes = std::max(whole.fixed_workspace_bytes, e->fixed_workspace_bytes);
    whole.output_shape = e->output_shape;
    whole.output_dtype = e->output_dtype;
    current = layer_input{e->output_shape, e->output_dtype, in.training, in.device};
    first = false;
  }
  const auto out = whole.output_is_view ? 0 : whole.output_bytes();
  whole.saved_bytes = std::max<std::int64_t>(0, live - out);
  whole.workspace_bytes = std::max<std::int64_t>(0, peak_extra - live);
  return whole;
}

}  // namespace detail

/// Adds (or replaces) the static rule for module type `Impl`, e.g. a custom block:
/// `memscale::register_layer_rule<BlockImpl>([](const BlockImpl& m, const layer_input& in) {...})`.
/// Return std::nullopt for inputs the rule cannot handle; the slot is then measured.
template <class Impl, class Rule>
void register_layer_rule(Rule rule) {
  detail::rule_registry::global().add<Impl>(std::move(rule));
}

/// The static estimate for one module, or nullopt when no rule covers it.
[[nodiscard]] inline std::optional<layer_estimate> estimate_layer(const torch::nn::Module& module,
                                                                  const layer_input& in) {
  return detail::rule_registry::global().estimate(module, in);
}

}  // namespace memscale

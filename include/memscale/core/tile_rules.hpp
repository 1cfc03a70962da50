// memscale — which layers may be tiled: for a module and its input, the number
// of leading input dimensions along which it treats rows independently (row i of
// the output depends on row i of the input only), so it can run over chunks of
// any of them and give the same result. Built in: Linear, LayerNorm, the
// elementwise activations, Dropout when it draws nothing, Embedding, Flatten, and
// per sample (dimension 0 only) the convolutions and pools. Never: BatchNorm
// (batch statistics), Dropout that draws masks, and anything without a rule
// (attention mixes positions). Users extend it per type with
// memscale::register_tileable<Impl>(...) and per instance with
// memscale::mark_tileable(module, dims) / mark_not_tileable(module).
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <typeindex>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/core/layer_rules.hpp>
#include <memscale/detail/modules.hpp>
#include <memscale/errors.hpp>

namespace memscale {

namespace detail {

class tile_registry {
 public:
  static tile_registry& global() {
    static tile_registry registry;
    return registry;
  }

  /// Sets how many leading input dimensions modules of type Impl treat row by
  /// row: `fn(const Impl&, const layer_input&) -> int`.
  template <class Impl, class Fn>
  void add_type(Fn fn) {
    types_.template set<Impl>(std::move(fn));
  }

  void mark(const std::shared_ptr<torch::nn::Module>& module, int dims) {
    if (!module) throw Error("memscale: cannot mark an empty module (a null holder) tileable or not");
    std::lock_guard<std::mutex> lock(mutex_);
    std::erase_if(marks_, [&](const instance_mark& m) { return m.module.expired() || m.raw == module.get(); });
    marks_.push_back({module.get(), module, dims});
  }

  /// The instance mark, else the type's rule, else (a Sequential subclass) the
  /// smallest over its children; 0 for anything unknown.
  [[nodiscard]] int row_dims(const torch::nn::Module& module, const layer_input& in) const {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& m : marks_)
        if (m.raw == &module && !m.module.expired()) return std::min<int>(m.dims, static_cast<int>(in.shape.size()));
    }
    if (auto rule = types_.find(module)) return std::clamp(rule(module, in), 0, static_cast<int>(in.shape.size()));
    if (const auto* seq = dynamic_cast<const torch::nn::SequentialImpl*>(&module)) return sequence_dims(*seq, in);
    return 0;
  }

 private:
  struct instance_mark {
    const torch::nn::Module* raw;
    std::weak_ptr<torch::nn::Module> module;
    int dims;
  };

  tile_registry();

  template <class Impl, class Rule>
  void builtin(Rule rule) {
    add_type<Impl>(std::move(rule));
  }

  /// Children in order, each on the shape the one before produced (while static
  /// rules can tell it); rows stay independent only if every child keeps them so.
  int sequence_dims(const torch::nn::SequentialImpl& seq, const layer_input& in) const {
    if (seq.is_empty()) return 0;
    int dims = static_cast<int>(in.shape.size());
    layer_input current = in;
    for (const auto& child : const_cast<torch::nn::SequentialImpl&>(seq)) {
      dims = std::min(dims, row_dims(*child.ptr(), current));
      if (dims == 0) return 0;
      if (auto e = estimate_layer(*child.ptr(), current)) current.shape = e->output_shape;
    }
    return dims;
  }

  rules_by_type<int> types_;
  mutable std::mutex mutex_;  // guards marks_
  std::vector<instance_mark> marks_;
};

inline tile_registry::tile_registry() {
  namespace nn = torch::nn;
  auto rank = [](const layer_input& in) { return static_cast<int>(in.shape.size()); };
  // Rows are every dimension but the features.
  builtin<nn::LinearImpl>([rank](const nn::LinearImpl&, const layer_input& in) { return rank(in) - 1; });
  builtin<nn::LayerNormImpl>([rank](const nn::LayerNormImpl& m, const layer_input& in) {
    return rank(in) - static_cast<int>(m.options.normalized_shape().size());
  });
  // Elementwise: every dimension.
  builtin<nn::GELUImpl>([rank](const nn::GELUImpl&, const layer_input& in) { return rank(in); });
  builtin<nn::SiLUImpl>([rank](const nn::SiLUImpl&, const layer_input& in) { return rank(in); });
  builtin<nn::TanhImpl>([rank](const nn::TanhImpl&, const layer_input& in) { return rank(in); });
  builtin<nn::SigmoidImpl>([rank](const nn::SigmoidImpl&, const layer_input& in) { return rank(in); });
  builtin<nn::IdentityImpl>([rank](const nn::IdentityImpl&, const layer_input& in) { return rank(in); });
  // In place, a chunk would modify the input the recompute reads.
  builtin<nn::ReLUImpl>([rank](const nn::ReLUImpl& m, const layer_input& in) {
    return m.options.inplace() ? 0 : rank(in);
  });
  // A drawing Dropout is row-independent, but chunks draw other masks than one
  // whole-tensor draw, so a tiled step would differ from the untiled one. Users
  // who accept that mark the module (mark_tileable). Judged whatever the mode:
  // a plan made in evaluation runs in training later.
  builtin<nn::DropoutImpl>([rank](const nn::DropoutImpl& m, const layer_input& in) {
    return m.options.inplace() || m.options.p() > 0.0 ? 0 : rank(in);
  });
  builtin<nn::EmbeddingImpl>([rank](const nn::EmbeddingImpl&, const layer_input& in) { return rank(in); });
  builtin<nn::FlattenImpl>([rank](const nn::FlattenImpl& m, const layer_input& in) {
    auto start = m.options.start_dim();
    if (start < 0) start += rank(in);
    return static_cast<int>(std::max<std::int64_t>(0, start));
  });
  // Per sample: batched input only, dimension 0.
  auto per_sample = [](std::size_t unbatched_rank) {
    return [unbatched_rank](const auto&, const layer_input& in) { return in.shape.size() > unbatched_rank ? 1 : 0; };
  };
  builtin<nn::Conv1dImpl>(per_sample(2));
  builtin<nn::Conv2dImpl>(per_sample(3));
  builtin<nn::MaxPool1dImpl>(per_sample(2));
  builtin<nn::MaxPool2dImpl>(per_sample(3));
  builtin<nn::AvgPool1dImpl>(per_sample(2));
  builtin<nn::AvgPool2dImpl>(per_sample(3));
  // Batch statistics mix the samples in training; per sample in evaluation, but
  // a plan made in evaluation runs in training later: never.
  auto batch_norm = [](const auto&, const layer_input&) { return 0; };
  builtin<nn::BatchNorm1dImpl>(batch_norm);
  builtin<nn::BatchNorm2dImpl>(batch_norm);
}

inline void check_dims(int dims, const char* what) {
  if (dims < 0)
    throw Error(std::string("memscale::") + what + ": leading_dims must be >= 0 (0 marks the module as never tiled), "
                "got " + std::to_string(dims));
}

}  // namespace detail

/// Declares every module of type `Impl` row-independent along its first
/// `leading_dims` input dimensions (0: never tiled). `rule` form: a callable
/// `int(const Impl&, const layer_input&)` deciding per input (training, shape).
template <class Impl>
void register_tileable(int leading_dims) {
  detail::check_dims(leading_dims, "register_tileable");
  detail::tile_registry::global().add_type<Impl>([leading_dims](const Impl&, const layer_input&) {
    return leading_dims;
  });
}
template <class Impl, class Rule>
  requires std::is_invocable_r_v<int, Rule&, const Impl&, const layer_input&>
void register_tileable(Rule rule) {
  detail::tile_registry::global().add_type<Impl>(std::move(rule));
}

/// Marks one module (a holder such as torch::nn::Linear, or a shared_ptr to a
/// Module) row-independent along its first `leading_dims` input dimensions; it
/// overrides the type's rule. Takes effect at the next plan.
template <Model M>
void mark_tileable(const M& module, int leading_dims = 1) {
  detail::check_dims(leading_dims, "mark_tileable");
  detail::tile_registry::global().mark(detail::root_of(module), leading_dims);
}

/// Marks one module as never tiled, whatever its type's rule says.
template <Model M>
void mark_not_tileable(const M& module) {
  detail::tile_registry::global().mark(detail::root_of(module), 0);
}

/// Leading input dimensions along which `module` treats rows independently (0: none).
[[nodiscard]] inline int row_independent_dims(const torch::nn::Module& module, const layer_input& in) {
  return detail::tile_registry::global().row_dims(module, in);
}

}  // namespace memscale

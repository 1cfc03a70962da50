// memscale — tiling: a run of row-independent layers (core/tile_rules.hpp) runs
// over N chunks of one input dimension (batch or sequence), each chunk
// checkpointed, the outputs written into one tensor. Forward keeps only the
// input; backward recomputes one chunk at a time, so one chunk's intermediates
// are alive instead of the whole run's. The executor puts a TileSegment in a
// chain slot (rule R10); custom forward code calls memscale::tile(fn, x, tiles).
// Gradients equal the untiled ones up to summation order: parameter gradients
// are summed over chunks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/detail/draw_replay.hpp>
#include <memscale/detail/fault_injection.hpp>
#include <memscale/detail/modules.hpp>
#include <memscale/detail/step_gate.hpp>
#include <memscale/errors.hpp>
#include <memscale/observability/metrics.hpp>
#include <memscale/techniques/checkpoint.hpp>
#include <memscale/techniques/concepts.hpp>

namespace memscale {
namespace detail {

/// [start, length) of chunk i when `rows` rows are split into `tiles` chunks as
/// evenly as possible (the first rows % tiles chunks get one row more).
inline std::pair<std::int64_t, std::int64_t> chunk_of(std::int64_t rows, std::int64_t tiles, std::int64_t i) {
  const auto base = rows / tiles, extra = rows % tiles;
  return {i * base + std::min(i, extra), base + (i < extra ? 1 : 0)};
}

/// Checks chunk output `y` (of a `rows`-row chunk) against the whole output `out`
/// allocated from the first chunk (undefined for the first chunk itself).
inline void check_tile_output(const torch::Tensor& y, const torch::Tensor& x, std::int64_t dim, std::int64_t rows,
                              const torch::Tensor& out) {
  if (y.dim() <= dim || y.size(dim) != rows)
    throw Error("memscale::tile: the tiled function is not row-independent along input dimension " +
                std::to_string(dim) + ": a chunk of " + std::to_string(rows) + " rows of an input of shape " +
                c10::str(x.sizes()) + " gave an output of shape " + c10::str(y.sizes()) +
                "; tile only layers whose output keeps the input's leading dimensions (mark_not_tileable it)");
  if (out.defined()) {
    auto expected = out.sizes().vec();
    expected[static_cast<std::size_t>(dim)] = rows;
    if (y.sizes().vec() != expected || y.scalar_type() != out.scalar_type())
      throw Error("memscale::tile: chunks of one input gave outputs of different shapes or types (the first "
                  "makes a whole output of shape " + c10::str(out.sizes()) + ", then a chunk of " +
                  std::to_string(rows) + " rows gave " + c10::str(y.sizes()) + ")");
  }
}

/// Inputs: the body (not differentiable), the input, the dimension and the chunk
/// count, and the parameters the body reads (their gradients flow through here).
struct tile_function : torch::autograd::Function<tile_function> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<checkpoint_body> body, const torch::Tensor& x,
                                                std::int64_t dim, std::int64_t tiles, at::TensorList params) {
    auto context = forward_context::now(devices_of(x));
    std::vector<torch::Tensor> to_save{x};
    to_save.insert(to_save.end(), params.begin(), params.end());
    ctx->save_for_backward(to_save);
    ctx->saved_data["body"] = c10::IValue::make_capsule(body);
    ctx->saved_data["context"] = c10::IValue::make_capsule(context);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["tiles"] = tiles;
    const auto version = x._version();
    torch::Tensor out;
    for (std::int64_t i = 0; i < tiles; ++i) {
      const auto [start, rows] = chunk_of(x.size(dim), tiles, i);
      auto y = body->fn({x.narrow(dim, start, rows)})[0];  // grad mode is off here
      check_tile_output(y, x, dim, rows, out);
      if (!out.defined()) {
        auto shape = y.sizes().vec();
        shape[static_cast<std::size_t>(dim)] = x.size(dim);
        out = at::empty(shape, y.options());
      }
      out.narrow(dim, start, rows).copy_(y);
      fault_point(pipeline_stage::tile_forward);  // after `passes` chunks
    }
    if (x._version() != version)
      throw Error("memscale::tile: the tiled function modified its input in place, so backward could not "
                  "recompute it; tile only layers that leave their input unchanged");
    return {out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const std::vector<torch::Tensor> params(saved.begin() + 1, saved.end());
    auto body = c10::static_intrusive_pointer_cast<checkpoint_body>(ctx->saved_data["body"].toCapsule());
    auto context = c10::static_intrusive_pointer_cast<forward_context>(ctx->saved_data["context"].toCapsule());
    context->step.reset();  // the step's forward state is done with here
    const auto dim = ctx->saved_data["dim"].toInt();
    const auto tiles = ctx->saved_data["tiles"].toInt();

    torch::autograd::variable_list result(4 + params.size());  // [body, x, dim, tiles, params...]
    const auto& grad_out = grad_outputs[0];
    if (!grad_out.defined()) return result;
    // The engine runs backward functions in grad mode exactly under create_graph.
    if (torch::GradMode::is_enabled())
      throw Error("memscale::tile: double backward (create_graph=true, e.g. a gradient penalty) through a tiled "
                  "segment is not supported: its chunked backward does not record a graph. Checkpointing "
                  "supports it: leave enable_tiling off (or drop Tile from the Strategy) for such training");
    const bool input_grad = x.requires_grad();
    torch::Tensor grad_x = input_grad ? at::empty_like(x) : torch::Tensor();
    std::vector<torch::Tensor> param_grads(params.size());

    recompute_scope recompute;
    rng_fork keep_training_stream(context->devices);  // backward must not shift the RNG sequence
    isolating_span draws_apart;  // its chunks draw, never replay another's masks
    restore_rng(context->state);                      // the chunks draw in forward's order
    bool searched = false;
    for (std::int64_t i = 0; i < tiles; ++i) {
      const auto [start, rows] = chunk_of(x.size(dim), tiles, i);
      auto chunk = x.narrow(dim, start, rows).detach();
      if (input_grad) chunk.requires_grad_(true);
      torch::Tensor y;
      {
        const observability::recompute_timer timed;
        compat::autocast_as same_casts(context->autocast);  // the recompute casts as forward did
        torch::AutoGradMode grad_on(true);
        y = body->fn({chunk})[0];
        fault_point(pipeline_stage::tile_backward);  // after `passes` chunks: part of grad_x written
      }
      if (!y.requires_grad()) {
        if (input_grad) grad_x.narrow(dim, start, rows).zero_();
        continue;
      }
      std::vector<torch::Tensor> targets;
      if (input_grad) targets.push_back(chunk);
      std::vector<std::size_t> param_slot;
      for (std::size_t p = 0; p < params.size(); ++p)
        if (params[p].requires_grad()) {
          targets.push_back(params[p]);
          param_slot.push_back(p);
        }
      // Every leaf the body reads must be one this node was given (see checkpoint).
      if (!searched) {
        std::vector<torch::Tensor> known(params);
        known.push_back(chunk);
        if (const auto unlisted = reachable_leaves({y}, known); !unlisted.empty())
          throw unlisted_leaves_error("memscale::tile", unlisted);
        searched = true;
      }
      const auto own = targets.size();
      if (targets.empty()) continue;
      std::vector<torch::Tensor> grads;
      {
        tensor_hooks_set_aside hooks_run_in_autograd(targets);
        grads = torch::autograd::grad({y}, targets, {grad_out.narrow(dim, start, rows)}, /*retain_graph=*/false,
                                      /*create_graph=*/false, /*allow_unused=*/true);
      }
      torch::NoGradGuard no_grad;
      std::size_t t = 0;
      if (input_grad) {
        auto slice = grad_x.narrow(dim, start, rows);
        if (grads[t].defined()) slice.copy_(grads[t]);
        else slice.zero_();
        ++t;
      }
      // The first chunk's gradient is copied: autograd may hand out a view of
      // its incoming gradient, which the sum must not write into.
      auto accumulate = [tiles](torch::Tensor& sum, const torch::Tensor& g) {
        if (!g.defined()) return;
        if (sum.defined()) sum.add_(g);
        else sum = tiles > 1 ? g.clone() : g;
      };
      for (std::size_t j = 0; t < own; ++t, ++j) accumulate(param_grads[param_slot[j]], grads[t]);
    }
    result[1] = grad_x;
    for (std::size_t p = 0; p < params.size(); ++p) result[4 + p] = param_grads[p];
    return result;
  }
};

inline void check_tile_arguments(const torch::Tensor& x, std::int64_t tiles, std::int64_t dim) {
  if (tiles < 1) throw Error("memscale::tile: tiles must be >= 1, got " + std::to_string(tiles));
  if (!x.defined() || dim < 0 || dim >= x.dim())
    throw Error("memscale::tile: dim must name a dimension of the input (0.." +
                                std::to_string(x.defined() ? x.dim() - 1 : -1) + "), got " + std::to_string(dim));
}

/// Runs `body` over min(tiles, rows) chunks of `x` along `dim` under tile_function
/// when anything needs a gradient, else in one piece.
inline torch::Tensor run_tiled(const c10::intrusive_ptr<checkpoint_body>& body, const torch::Tensor& x,
                               std::int64_t tiles, std::int64_t dim, const std::vector<torch::Tensor>& params) {
  check_tile_arguments(x, tiles, dim);
  if (!needs_checkpoint(x, params)) return body->fn({x})[0];
  tiles = std::clamp<std::int64_t>(tiles, 1, std::max<std::int64_t>(1, x.size(dim)));
  return tile_function::apply(body, x, dim, tiles, at::TensorList(params))[0];
}

}  // namespace detail

/// Runs `fn(x)` over `tiles` chunks of `x` along `dim`, each checkpointed, and
/// returns the whole output: backward holds one chunk's intermediates at a time.
/// `fn` must treat rows along `dim` independently (Linear, LayerNorm, an MLP).
/// `params`: every parameter `fn` reads, so their gradients flow through here.
/// Without grad mode or anything requiring grad, `fn` simply runs.
template <class Fn>
  requires(!detail::module_handle<std::remove_cvref_t<Fn>>) && std::invocable<Fn&, const torch::Tensor&>
torch::Tensor tile(Fn&& fn, const torch::Tensor& x, std::int64_t tiles, std::int64_t dim = 0,
                   std::vector<torch::Tensor> params = {}) {
  auto body = c10::make_intrusive<detail::checkpoint_body>(
      [f = std::forward<Fn>(fn)](const std::vector<torch::Tensor>& in) mutable {
        return std::vector<torch::Tensor>{std::invoke(f, in[0])};
      });
  return detail::run_tiled(body, x, tiles, dim, params);
}

/// Module form: tiles `module->forward(x)` with the module's parameters.
template <class ModuleHolder>
  requires requires(ModuleHolder& m, const torch::Tensor& x) {
    { m->forward(x) } -> std::convertible_to<torch::Tensor>;
    m->parameters();
  }
torch::Tensor tile(ModuleHolder& module, const torch::Tensor& x, std::int64_t tiles, std::int64_t dim = 0) {
  return tile([module](const torch::Tensor& t) mutable -> torch::Tensor { return module->forward(t); }, x, tiles, dim,
              module->parameters());
}

/// A chain slot that runs consecutive original slots tiled. Like
/// CheckpointSegment it registers nothing: parameters() and names do not change.
class TileSegmentImpl : public memscale::detail::wrapper_module, public detail::slot_wrapper, public detail::gated {
 public:
  TileSegmentImpl(std::vector<torch::nn::AnyModule> slots, int tiles, int dim)
      : wrapper_module("memscale::TileSegment"),
        slots_(std::move(slots)),
        params_(detail::parameters_of(slots_)),
        body_(detail::slots_body(slots_)),
        tiles_(tiles),
        dim_(dim) {}

  torch::Tensor forward(torch::Tensor x) {
    if (x.defined() && dim_ >= x.dim())
      throw Error("memscale::TileSegment: planned to chunk input dimension " + std::to_string(dim_) +
                  " but got an input of shape " + c10::str(x.sizes()) +
                  "; the chain's input rank changed after planning: detach and wrap again");
    std::optional<detail::step_scope> step;  // one training step at a time (a second thread is refused)
    if (detail::needs_checkpoint(x, params_)) step.emplace(gate());
    if (!probed_ && x.defined() && x.size(dim_) > 0 && detail::needs_checkpoint(x, params_)) {
      // Once, on the first chunk: leaves the slots read beyond their parameters join them.
      const auto rows = detail::chunk_of(x.size(dim_), std::clamp<std::int64_t>(tiles_, 1, x.size(dim_)), 0).second;
      runs_plainly_ = detail::adopt_reads(*body_, x.narrow(dim_, 0, rows).detach(), params_, slots_, "tiled");
      probed_ = true;
    }
    if (runs_plainly_) return body_->fn({std::move(x)})[0];
    return detail::run_tiled(body_, x, tiles_, dim_, params_);
  }

  [[nodiscard]] int tiles() const noexcept { return tiles_; }
  [[nodiscard]] int dim() const noexcept { return dim_; }
  [[nodiscard]] const std::vector<torch::nn::AnyModule>& slots() const noexcept override { return slots_; }

 private:
  std::vector<torch::nn::AnyModule> slots_;
  std::vector<torch::Tensor> params_;
  c10::intrusive_ptr<detail::checkpoint_body> body_;
  int tiles_;
  int dim_;
  bool probed_ = false;
  bool runs_plainly_ = false;  // reads a non-leaf from outside: recomputing it would be wrong
};

/// The tiling technique: a run of slots becomes one TileSegment over
/// context.tiles chunks of input dimension context.tile_dim (rule R10).
struct Tile {
  static constexpr technique_id id = technique_id::tile;
  static constexpr std::string_view name = "tile";
  static constexpr bool available = true;
  static torch::nn::AnyModule wrap(std::vector<torch::nn::AnyModule> slots, const wrap_context& context = {}) {
    return torch::nn::AnyModule(
        std::make_shared<TileSegmentImpl>(std::move(slots), std::max(1, context.tiles), context.tile_dim));
  }
};

}  // namespace memscale

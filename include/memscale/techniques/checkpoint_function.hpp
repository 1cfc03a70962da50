// memscale — activation checkpointing: a custom autograd function that runs a
// segment without keeping its intermediates and recomputes it in backward, with
// the RNG state of the forward restored so Dropout draws the same masks (on CPU
// the forward keeps them, a bit an element, and the recompute writes them back
// instead of drawing: detail/draw_replay.hpp). The
// executor puts a CheckpointSegment in a chain's slot; custom forward code can call
// memscale::checkpoint(fn, inputs, params) directly.
//
// Here: the autograd function and the memscale::checkpoint() calls. What the
// recompute relies on is in checkpoint_recompute.hpp; CheckpointSegment and the
// Checkpoint technique in checkpoint_segment.hpp.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/detail/assert.hpp>
#include <memscale/detail/compat.hpp>
#include <memscale/detail/draw_replay.hpp>
#include <memscale/detail/fault_injection.hpp>
#include <memscale/detail/modules.hpp>
#include <memscale/detail/product_replay.hpp>
#include <memscale/detail/rng.hpp>
#include <memscale/errors.hpp>
#include <memscale/observability/metrics.hpp>
#include <memscale/techniques/checkpoint_recompute.hpp>

namespace memscale {
namespace detail {

/// Inputs: the body (not differentiable), the segment inputs, and the parameters
/// the body uses. Passing the parameters makes the outputs require grad even when
/// no input does (the classic reentrant-checkpoint pitfall) and routes their
/// gradients through this node.
struct checkpoint_function : torch::autograd::Function<checkpoint_function> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<checkpoint_body> body, at::TensorList inputs,
                                                at::TensorList params) {
    auto context = forward_context::now(devices_of(inputs));
    std::vector<torch::Tensor> to_save(inputs.begin(), inputs.end());
    to_save.insert(to_save.end(), params.begin(), params.end());
    ctx->save_for_backward(to_save);
    ctx->saved_data["inputs"] = static_cast<int64_t>(inputs.size());
    ctx->saved_data["body"] = c10::IValue::make_capsule(body);
    ctx->saved_data["context"] = c10::IValue::make_capsule(context);
    std::vector<torch::Tensor> args(inputs.begin(), inputs.end());
    std::vector<std::int64_t> versions;
    for (const auto& x : args) versions.push_back(x.defined() ? static_cast<std::int64_t>(x._version()) : 0);
    // On CPU the forward keeps its random masks (a bit an element) for the recompute to replay.
    std::optional<draw_span> keep_draws;
    if (body->replay_draws && context->devices.empty()) keep_draws.emplace(context->draws, draw_mode::record);
    // Selective recompute: the matrix products' outputs are kept for the recompute.
    std::optional<product_span> keep_products;
    if (body->keep_products) keep_products.emplace(context->draws, draw_mode::record);
    auto outputs = body->fn(args);  // grad mode is off here: nothing inside is kept
    keep_products.reset();
    keep_draws.reset();
    if (body->keep_products) drop_returned_products(context->draws, outputs);
    fault_point(pipeline_stage::checkpoint_forward);
    for (std::size_t i = 0; i < args.size(); ++i)
      if (args[i].defined() && static_cast<std::int64_t>(args[i]._version()) != versions[i])
        throw Error("memscale::checkpoint: the checkpointed function modified its input " + std::to_string(i) +
                    " in place, so backward could not recompute it; start the checkpoint before the in-place "
                    "operation (or make it out of place)");
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto input_count = static_cast<std::size_t>(ctx->saved_data["inputs"].toInt());
    auto body = c10::static_intrusive_pointer_cast<checkpoint_body>(ctx->saved_data["body"].toCapsule());
    auto context = c10::static_intrusive_pointer_cast<forward_context>(ctx->saved_data["context"].toCapsule());
    context->step.reset();  // the step's forward state is done with here
    // The engine runs backward functions in grad mode exactly when the caller
    // asked for create_graph (double backward, gradient penalties): then the
    // recompute runs on the inputs themselves, so the gradients it returns keep
    // their history back through them, and the recomputed graph is kept.
    const bool create_graph = torch::GradMode::is_enabled();
    // A run ending in a plain Linear recomputes up to the Linear's input. Not
    // under autocast (the Linear's casts would have to be redone), for a double
    // backward (its gradients need the Linear's graph), for an output gradient
    // that is not contiguous, or where the input is not one
    // linear_tail::applies_to (checked on the recompute's result).
    const linear_tail* tail = body->tail && !create_graph && !context->autocast.cpu && !context->autocast.cuda &&
                                      grad_outputs.size() == 1 && grad_outputs[0].defined() &&
                                      grad_outputs[0].is_contiguous()
                                  ? &*body->tail
                                  : nullptr;

    std::vector<torch::Tensor> inputs;
    for (std::size_t i = 0; i < input_count; ++i) {
      if (create_graph) {
        inputs.push_back(saved[i]);
        continue;
      }
      auto x = saved[i].detach();
      if (saved[i].requires_grad()) x.requires_grad_(true);
      inputs.push_back(std::move(x));
    }
    std::vector<torch::Tensor> outputs;
    recompute_scope recompute;
    // The kept masks and products go when the recompute is done (below), or
    // where it throws, with this.
    struct free_log {
      draw_log& log;
      ~free_log() { log.release(); }
    } const free_kept{context->draws};
    {
      const observability::recompute_timer timed;  // the forward run again: memscale_recompute_seconds_total
      rng_fork keep_training_stream(context->devices);  // backward must not shift the RNG sequence
      if (!technique_fault_injected(technique_fault::checkpoint_skips_rng_restore)) restore_rng(context->state);
      compat::autocast_as same_casts(context->autocast);
      const bound_scope same_arguments(bound_scope::reopen_t{}, context->bound);
      torch::AutoGradMode grad_on(true);
      // Replayed where the forward recorded; otherwise (and under the fault,
      // which draws again from the wrong state) the draws are hidden from any
      // span outside this recompute.
      const auto draws = body->replay_draws && context->devices.empty() &&
                                 !technique_fault_injected(technique_fault::checkpoint_skips_rng_restore)
                             ? draw_mode::replay
                             : draw_mode::isolate;
      std::optional<draw_span> replayed(std::in_place, context->draws, draws);
      std::optional<product_span> products;  // the kept products taken back, not multiplied again
      if (body->keep_products) products.emplace(context->draws, draw_mode::replay);
      if (tail != nullptr) {
        outputs = tail->prefix(inputs);
        if (!tail->applies_to(outputs.at(0))) {
          // Recomputed whole instead, from the forward's RNG state again (the
          // buffers the prefix moved go back when the scope closes).
          tail = nullptr;
          outputs.clear();
          if (!technique_fault_injected(technique_fault::checkpoint_skips_rng_restore)) restore_rng(context->state);
          products.reset();
          replayed.reset();
          replayed.emplace(context->draws, draws);
          if (body->keep_products) products.emplace(context->draws, draw_mode::replay);
        }
      }
      if (tail == nullptr) outputs = body->fn(inputs);
      products.reset();
      replayed.reset();
      // Freed now, not with the graph: a backward that runs again (retain_graph)
      // finds no log, draws from the restored state and multiplies again.
      context->draws.release();
      fault_point(pipeline_stage::checkpoint_backward);  // inside the RNG fork and the recompute scope
      if (technique_fault_injected(technique_fault::checkpoint_recompute_scaled))
        for (auto& o : outputs)
          if (o.defined() && o.is_floating_point()) o = o * (1.0 + 1.0 / (1 << 20));
    }

    std::vector<torch::Tensor> differentiable_outputs, output_grads;
    linear_gradients tail_grads;
    if (tail != nullptr) {
      const auto& h = outputs.at(0);  // the Linear's input
      tail_grads = linear_backward(*tail->linear, h.detach(), grad_outputs[0], h.requires_grad());
      if (h.requires_grad()) {
        differentiable_outputs.push_back(h);
        output_grads.push_back(tail_grads.input);
      }
    } else {
      for (std::size_t i = 0; i < outputs.size() && i < grad_outputs.size(); ++i) {
        if (outputs[i].requires_grad() && grad_outputs[i].defined()) {
          differentiable_outputs.push_back(outputs[i]);
          output_grads.push_back(grad_outputs[i]);
        }
      }
    }
    std::vector<torch::Tensor> targets;
    std::vector<std::size_t> target_slot;  // position in saved
    for (std::size_t i = 0; i < saved.size(); ++i) {
      const bool wants = i < input_count ? inputs[i].requires_grad() : saved[i].requires_grad();
      if (!wants) continue;
      targets.push_back(i < input_count ? inputs[i] : saved[i]);
      target_slot.push_back(i);
    }
    // Every leaf the recompute reaches must be one this node was given, so its
    // gradient flows through autograd (hooks, reducers) and not behind its back.
    std::vector<torch::Tensor> known(saved.begin() + static_cast<std::ptrdiff_t>(input_count), saved.end());
    known.insert(known.end(), inputs.begin(), inputs.end());
    if (const auto unlisted = reachable_leaves(differentiable_outputs, known, inputs); !unlisted.empty())
      throw unlisted_leaves_error("memscale::checkpoint", unlisted);

    torch::autograd::variable_list result(1 + saved.size());  // [body, inputs..., params...]
    if (!differentiable_outputs.empty() && !targets.empty()) {
      std::vector<torch::Tensor> grads;
      {
        tensor_hooks_set_aside hooks_run_in_autograd(targets);
        grads = torch::autograd::grad(differentiable_outputs, targets, output_grads,
                                      /*retain_graph=*/create_graph, create_graph, /*allow_unused=*/true);
      }
      for (std::size_t t = 0; t < targets.size(); ++t) result[1 + target_slot[t]] = grads[t];
    }
    if (tail != nullptr) {
      // The Linear's own gradients, added where the slots before it read the same parameter.
      const auto add = [&](std::size_t param, const torch::Tensor& grad) {
        if (!grad.defined() || param == linear_tail::none) return;
        MEMSCALE_ASSERT(input_count + param < saved.size(), "a checkpointed Linear's parameter is not the segment's");
        auto& r = result[1 + input_count + param];
        r = r.defined() ? r + grad : grad;
      };
      add(tail->weight_param, tail_grads.weight);
      add(tail->bias_param, tail_grads.bias);
    }
    return result;
  }
};

/// Module holders (torch::nn::Linear, ...) and shared_ptrs to modules: the
/// module forms of checkpoint().
template <class T>
concept module_handle = requires(T& m) { m->parameters(); };

/// `fn`, with `module`'s buffers put back once a recompute has computed the
/// gradients: the recompute runs the forward a second time, and BatchNorm's
/// running statistics must move once a step, as without the checkpoint.
template <class Fn>
auto restoring_buffers(Fn fn, std::shared_ptr<torch::nn::Module> module) {
  return [fn = std::move(fn), module = std::move(module)](const std::vector<torch::Tensor>& inputs) mutable {
    if (auto* recompute = recompute_scope::current()) recompute->restore_on_close(*module);
    return std::invoke(fn, inputs);
  };
}

/// A one-tensor `fn` as a function of the inputs' vector.
template <class Fn>
auto of_first_input(Fn fn) {
  return [fn = std::move(fn)](const std::vector<torch::Tensor>& inputs) mutable {
    return std::vector<torch::Tensor>{std::invoke(fn, inputs[0])};
  };
}

inline bool needs_checkpoint(at::TensorList inputs, at::TensorList params) {
  if (!torch::GradMode::is_enabled()) return false;
  for (const auto& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  for (const auto& p : params)
    if (p.requires_grad()) return true;
  return false;
}

}  // namespace detail

/// Runs `fn(inputs)` keeping only `inputs` for backward; backward recomputes it.
/// `params`: every parameter `fn` reads, so their gradients flow. Without grad
/// mode or anything requiring grad, `fn` simply runs.
template <class Fn>
  requires(!detail::module_handle<std::remove_cvref_t<Fn>>) && std::invocable<Fn&, const std::vector<torch::Tensor>&>
std::vector<torch::Tensor> checkpoint(Fn&& fn, std::vector<torch::Tensor> inputs,
                                      std::vector<torch::Tensor> params = {}) {
  if (!detail::needs_checkpoint(inputs, params)) return std::invoke(fn, inputs);
  auto body = c10::make_intrusive<detail::checkpoint_body>(detail::tensors_fn(std::forward<Fn>(fn)));
  return detail::checkpoint_function::apply(body, at::TensorList(inputs), at::TensorList(params));
}

/// Single-tensor form: `fn(x)` with the parameters it reads.
template <class Fn>
  requires(!detail::module_handle<std::remove_cvref_t<Fn>>) && std::invocable<Fn&, const torch::Tensor&>
torch::Tensor checkpoint(Fn&& fn, const torch::Tensor& input, std::vector<torch::Tensor> params = {}) {
  return checkpoint(detail::of_first_input(std::forward<Fn>(fn)), std::vector<torch::Tensor>{input},
                    std::move(params))[0];
}

/// `fn(inputs)` reading `module` (a holder such as torch::nn::Sequential, or a
/// shared_ptr to a module): its parameters are passed on as `params` above, and
/// the buffers the recompute changes (BatchNorm's running statistics) are put
/// back after it, so they move once a step, as without the checkpoint. With
/// `params` alone they move twice, as they do under PyTorch's checkpoint.
template <class Fn, class Handle>
  requires(!detail::module_handle<std::remove_cvref_t<Fn>>) && detail::module_handle<const Handle> &&
          std::invocable<Fn&, const std::vector<torch::Tensor>&>
std::vector<torch::Tensor> checkpoint(Fn&& fn, std::vector<torch::Tensor> inputs, const Handle& module) {
  auto held = detail::root_of(module);
  auto params = held->parameters();
  return checkpoint(detail::restoring_buffers(std::forward<Fn>(fn), std::move(held)), std::move(inputs),
                    std::move(params));
}

/// Single-tensor form of the above.
template <class Fn, class Handle>
  requires(!detail::module_handle<std::remove_cvref_t<Fn>>) && detail::module_handle<const Handle> &&
          std::invocable<Fn&, const torch::Tensor&>
torch::Tensor checkpoint(Fn&& fn, const torch::Tensor& input, const Handle& module) {
  return checkpoint(detail::of_first_input(std::forward<Fn>(fn)), std::vector<torch::Tensor>{input}, module)[0];
}

/// Module form: checkpoints `module->forward(x)`, as the form above.
template <class ModuleHolder>
  requires requires(ModuleHolder& m, const torch::Tensor& x) {
    { m->forward(x) } -> std::convertible_to<torch::Tensor>;
    m->parameters();
  }
torch::Tensor checkpoint(ModuleHolder& module, const torch::Tensor& input) {
  return checkpoint([module](const torch::Tensor& x) mutable -> torch::Tensor { return module->forward(x); },
                    input, module);
}

}  // namespace memscale

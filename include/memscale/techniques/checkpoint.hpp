// memscale — activation checkpointing: a custom autograd function that runs a
// segment without keeping its intermediates and recomputes it in backward, with
// the RNG state of the forward restored so Dropout draws the same masks. The
// executor puts a CheckpointSegment in a chain's slot; custom forward code can call
// memscale::checkpoint(fn, inputs, params) directly.
#pragma once

#include <algorithm>
#include <concepts>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <memscale/detail/buffers.hpp>
#include <memscale/detail/compat.hpp>
#include <memscale/detail/fault_injection.hpp>
#include <memscale/detail/rng.hpp>
#include <memscale/errors.hpp>
#include <memscale/offload/hooks.hpp>
#include <memscale/techniques/concepts.hpp>

namespace memscale {
namespace detail {

using tensors_fn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// What a checkpoint keeps between forward and backward besides its inputs.
struct checkpoint_body : torch::CustomClassHolder {
  explicit checkpoint_body(tensors_fn f) : fn(std::move(f)) {}
  tensors_fn fn;
};

/// What the recompute must reproduce of the forward: RNG and autocast state.
struct forward_context : torch::CustomClassHolder {
  rng_state state;
  std::vector<c10::Device> devices;
  compat::autocast_state autocast;
};

/// Open while a checkpoint's backward recomputes its forward and computes the
/// gradients; state the recompute must not change (BatchNorm statistics) is put
/// back when it closes, after the gradients, so no saved tensor sees a new
/// version. Thread-local: the autograd engine runs a CPU backward on the thread
/// that called it.
class recompute_scope {
 public:
  recompute_scope() : previous_(current()) { current() = this; }
  recompute_scope(const recompute_scope&) = delete;
  recompute_scope& operator=(const recompute_scope&) = delete;
  ~recompute_scope() {
    while (!restores_.empty()) restores_.pop_back();  // restores, in reverse order of registration
    current() = previous_;
  }
  /// Snapshots the slots' buffers, once per scope: a tiled backward recomputes
  /// the same slots chunk after chunk, and the state to return to is the first's.
  void restore_on_close(const std::vector<torch::nn::AnyModule>& slots) {
    if (slots.empty()) return;
    const auto* first = slots.front().ptr().get();
    if (std::find(registered_.begin(), registered_.end(), first) != registered_.end()) return;
    registered_.push_back(first);
    restores_.push_back(std::make_unique<buffer_restore>(slots));
  }
  static recompute_scope*& current() {
    thread_local recompute_scope* scope = nullptr;
    return scope;
  }

 private:
  recompute_scope* previous_;
  std::vector<std::unique_ptr<buffer_restore>> restores_;
  std::vector<const torch::nn::Module*> registered_;
};

/// Leaf tensors requiring grad that the graph behind `outputs` reaches, other
/// than `known`: the same tensor, or one sharing its gradient accumulator (a
/// saved leaf unpacked through saved-tensor hooks is a new tensor object). The
/// walk does not go past `stop` (the inputs' own histories).
inline std::vector<torch::Tensor> reachable_leaves(const std::vector<torch::Tensor>& outputs,
                                                   const std::vector<torch::Tensor>& known,
                                                   const std::vector<torch::Tensor>& stop = {}) {
  std::unordered_set<const torch::autograd::Node*> known_accumulators;
  for (const auto& k : known)
    if (k.defined())
      if (auto acc = torch::autograd::impl::try_get_grad_accumulator(k)) known_accumulators.insert(acc.get());
  std::unordered_set<const torch::autograd::Node*> seen;
  for (const auto& s : stop)
    if (s.defined() && s.grad_fn()) seen.insert(s.grad_fn().get());
  std::vector<torch::autograd::Node*> stack;
  for (const auto& o : outputs)
    if (o.grad_fn()) stack.push_back(o.grad_fn().get());
  std::vector<torch::Tensor> leaves;
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      const auto& leaf = acc->variable;
      const bool is_known = known_accumulators.count(acc) != 0 ||
                            std::any_of(known.begin(), known.end(), [&](const torch::Tensor& k) {
                              return k.unsafeGetTensorImpl() == leaf.unsafeGetTensorImpl();
                            });
      if (!is_known && leaf.requires_grad()) leaves.push_back(leaf);
      continue;
    }
    for (const auto& edge : node->next_edges())
      if (edge.function) stack.push_back(edge.function.get());
  }
  return leaves;
}

/// LibTorch 2.x runs a tensor's hooks (Tensor::register_hook, retain_grad)
/// whenever autograd::grad captures its gradient; 1.13 only when the gradient
/// is accumulated or flows on. A recompute's own grad() captures the gradients
/// of the segment's inputs and parameters, which then flow on through this
/// node into autograd, where those hooks run as they would without memscale:
/// running them in the capture too would apply a gradient-modifying hook twice.
/// So for one internal grad() they are set aside, and put back after.
class tensor_hooks_set_aside {
 public:
  explicit tensor_hooks_set_aside(const std::vector<torch::Tensor>& targets) {
#if TORCH_VERSION_MAJOR >= 2
    aside_.reserve(targets.size());  // nothing below allocates once a hook has moved
    for (const auto& t : targets) {
      if (!t.defined() || !t.requires_grad()) continue;
      auto node = torch::autograd::impl::gradient_edge(t).function;
      if (!node || (node->tensor_pre_hooks().empty() && node->retains_grad_hooks().empty())) continue;
      if (std::any_of(aside_.begin(), aside_.end(), [&](const entry& e) { return e.node.get() == node.get(); }))
        continue;
      auto& e = aside_.emplace_back();
      e.node = std::move(node);
      std::swap(e.pre, e.node->tensor_pre_hooks());
      std::swap(e.retains, e.node->retains_grad_hooks());
    }
#else
    (void)targets;
#endif
  }
  tensor_hooks_set_aside(const tensor_hooks_set_aside&) = delete;
  tensor_hooks_set_aside& operator=(const tensor_hooks_set_aside&) = delete;
  ~tensor_hooks_set_aside() {
#if TORCH_VERSION_MAJOR >= 2
    for (auto& e : aside_) {
      auto& pre = e.node->tensor_pre_hooks();
      for (auto& h : pre) e.pre.push_back(std::move(h));  // registered meanwhile: after the originals
      pre = std::move(e.pre);
      for (auto& [index, h] : e.node->retains_grad_hooks()) e.retains.emplace(index, std::move(h));
      e.node->retains_grad_hooks() = std::move(e.retains);
    }
#endif
  }

 private:
#if TORCH_VERSION_MAJOR >= 2
  struct entry {
    // shared_ptr up to LibTorch 2.12, intrusive_ptr from 2.13
    decltype(torch::autograd::impl::gradient_edge(std::declval<const torch::Tensor&>()).function) node;
    std::vector<std::unique_ptr<torch::autograd::FunctionPreHook>> pre;
    std::unordered_map<std::size_t, std::unique_ptr<torch::autograd::FunctionPreHook>> retains;
  };
  std::vector<entry> aside_;
#endif
};

/// "LinearImpl -> GELUImpl": the slots' module names, for messages.
inline std::string slot_names(const std::vector<torch::nn::AnyModule>& slots) {
  std::string names;
  for (const auto& slot : slots) names += (names.empty() ? "" : " -> ") + slot.ptr()->name();
  return names;
}

/// What a segment's forward reads that needs a gradient, beyond its own parameters.
struct segment_reads {
  std::vector<torch::Tensor> leaves;  ///< leaves requiring grad (a tied weight, a captured tensor)
  bool outer_history = false;         ///< a non-leaf computed before the segment (its graph is not ours)
};

/// What `body` reads on `probe` beyond `known`. Found by one run with grad mode
/// on and every saved tensor dropped as it is saved, so it costs a forward but
/// keeps nothing (with memscale's engine in charge; without it the run holds
/// what autograd saves until it returns); RNG draws and the slots' buffers
/// (BatchNorm statistics) are put back. Passing the leaves into the autograd
/// function makes their gradients flow through autograd itself: one
/// accumulation per backward, with every tensor hook, post-accumulate hook and
/// c10d Reducer hook firing exactly as without memscale. A node older than the
/// probe belongs to a tensor computed outside the segment: its gradient would
/// have to flow into a graph the recompute does not own, so it is reported.
inline segment_reads leaves_read_by(checkpoint_body& body, const std::vector<torch::Tensor>& probe,
                                    const std::vector<torch::Tensor>& known,
                                    const std::vector<torch::nn::AnyModule>& slots) {
  rng_fork no_visible_draws(devices_of(probe));
  buffer_restore keep_buffers(slots);
  torch::AutoGradMode grad_on(true);
  offload::saved_tensors_hooks drop_saved([](const at::Tensor&) { return 0; },
                                          [](int&) -> at::Tensor {
                                            TORCH_CHECK(false, "memscale: a probe's saved tensor was unpacked");
                                            return {};
                                          });
  const auto first_node = at::sequence_number::peek();  // nodes the probe creates on this thread come after
  const auto outputs = body.fn(probe);
  segment_reads reads;
  reads.leaves = reachable_leaves(outputs, known);
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& o : outputs)
    if (o.defined() && o.grad_fn()) stack.push_back(o.grad_fn().get());
  while (!stack.empty() && !reads.outer_history) {
    auto* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second || dynamic_cast<torch::autograd::AccumulateGrad*>(node)) continue;
    if (node->sequence_nr() < first_node) {
      reads.outer_history = true;
      break;
    }
    for (const auto& edge : node->next_edges())
      if (edge.function) stack.push_back(edge.function.get());
  }
  return reads;
}

/// A segment's first training forward: leaves its slots read beyond `params`
/// join them; returns true (with a warning naming `technique`) when the slots
/// read a tensor computed before the segment, which must then run plainly.
inline bool adopt_reads(checkpoint_body& body, const torch::Tensor& probe, std::vector<torch::Tensor>& params,
                        const std::vector<torch::nn::AnyModule>& slots, const char* technique) {
  auto reads = leaves_read_by(body, {probe}, params, slots);
  for (auto& leaf : reads.leaves) params.push_back(std::move(leaf));
  if (reads.outer_history)
    std::clog << "[memscale] warning: a " << technique << " segment (" << slot_names(slots)
              << ") reads a tensor computed before it that needs a gradient; its gradient cannot flow back "
                 "through a recompute, so the segment runs as it is\n";
  return reads.outer_history;
}

/// The error for leaves a recompute found that the autograd function was not
/// given: their gradients would bypass autograd's hooks, so none are written.
inline Error unlisted_leaves_error(const char* what, const std::vector<torch::Tensor>& leaves) {
  std::string shapes;
  for (const auto& l : leaves) shapes += (shapes.empty() ? "" : ", ") + c10::str(l.sizes());
  return Error(std::string(what) + ": the function read " + std::to_string(leaves.size()) +
               " tensor(s) requiring grad that were not passed in `params` (shapes " + shapes +
               "); their gradients could only be written into .grad behind autograd's back, skipping tensor "
               "hooks, gradient-clipping hooks and data-parallel reducers. Pass every tensor the function reads "
               "that needs a gradient in `params` (the module forms do this for the module's parameters)");
}

/// Inputs: the body (not differentiable), the segment inputs, and the parameters
/// the body uses. Passing the parameters makes the outputs require grad even when
/// no input does (the classic reentrant-checkpoint pitfall) and routes their
/// gradients through this node.
struct checkpoint_function : torch::autograd::Function<checkpoint_function> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<checkpoint_body> body, at::TensorList inputs,
                                                at::TensorList params) {
    auto context = c10::make_intrusive<forward_context>();
    context->devices = devices_of(inputs);
    context->state = capture_rng(context->devices);
    context->autocast = compat::current_autocast();
    std::vector<torch::Tensor> to_save(inputs.begin(), inputs.end());
    to_save.insert(to_save.end(), params.begin(), params.end());
    ctx->save_for_backward(to_save);
    ctx->saved_data["inputs"] = static_cast<int64_t>(inputs.size());
    ctx->saved_data["body"] = c10::IValue::make_capsule(body);
    ctx->saved_data["context"] = c10::IValue::make_capsule(context);
    std::vector<torch::Tensor> args(inputs.begin(), inputs.end());
    std::vector<std::int64_t> versions;
    for (const auto& x : args) versions.push_back(x.defined() ? static_cast<std::int64_t>(x._version()) : 0);
    auto outputs = body->fn(args);  // grad mode is off here: nothing inside is kept
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
    // The engine runs backward functions in grad mode exactly when the caller
    // asked for create_graph (double backward, gradient penalties): then the
    // recompute runs on the inputs themselves, so the gradients it returns keep
    // their history back through them, and the recomputed graph is kept.
    const bool create_graph = torch::GradMode::is_enabled();

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
    {
      rng_fork keep_training_stream(context->devices);  // backward must not shift the RNG sequence
      if (!technique_fault_injected(technique_fault::checkpoint_skips_rng_restore)) restore_rng(context->state);
      compat::autocast_as same_casts(context->autocast);
      torch::AutoGradMode grad_on(true);
      outputs = body->fn(inputs);
      if (technique_fault_injected(technique_fault::checkpoint_recompute_scaled))
        for (auto& o : outputs)
          if (o.defined() && o.is_floating_point()) o = o * (1.0 + 1.0 / (1 << 20));
    }

    std::vector<torch::Tensor> differentiable_outputs, output_grads;
    for (std::size_t i = 0; i < outputs.size() && i < grad_outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grad_outputs[i].defined()) {
        differentiable_outputs.push_back(outputs[i]);
        output_grads.push_back(grad_outputs[i]);
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
    if (differentiable_outputs.empty() || targets.empty()) return result;
    std::vector<torch::Tensor> grads;
    {
      tensor_hooks_set_aside hooks_run_in_autograd(targets);
      grads = torch::autograd::grad(differentiable_outputs, targets, output_grads,
                                    /*retain_graph=*/create_graph, create_graph, /*allow_unused=*/true);
    }
    for (std::size_t t = 0; t < targets.size(); ++t) result[1 + target_slot[t]] = grads[t];
    return result;
  }
};

/// Module holders (torch::nn::Linear, ...) take the module form of checkpoint().
template <class T>
concept module_handle = requires(T& m) { m->parameters(); };

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
  auto outputs = checkpoint(
      [f = std::forward<Fn>(fn)](const std::vector<torch::Tensor>& in) mutable {
        return std::vector<torch::Tensor>{std::invoke(f, in[0])};
      },
      std::vector<torch::Tensor>{input}, std::move(params));
  return outputs[0];
}

/// Module form: checkpoints `module->forward(x)` with the module's parameters.
template <class ModuleHolder>
  requires requires(ModuleHolder& m, const torch::Tensor& x) {
    { m->forward(x) } -> std::convertible_to<torch::Tensor>;
    m->parameters();
  }
torch::Tensor checkpoint(ModuleHolder& module, const torch::Tensor& input) {
  return checkpoint([module](const torch::Tensor& x) mutable -> torch::Tensor { return module->forward(x); },
                    input, module->parameters());
}

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

// memscale — what a checkpoint's recompute relies on (internal, memscale::detail):
// the body and forward context an autograd node keeps, the recompute scope that
// puts buffers back, the walks that find the leaves a segment reads (so their
// gradients flow through autograd), and the set-aside of tensor hooks for the
// recompute's own grad(). The autograd function is in checkpoint_function.hpp.
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
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

#include <memscale/detail/bound_call.hpp>
#include <memscale/detail/buffers.hpp>
#include <memscale/detail/compat.hpp>
#include <memscale/detail/draw_replay.hpp>
#include <memscale/detail/rng.hpp>
#include <memscale/detail/step_gate.hpp>
#include <memscale/errors.hpp>
#include <memscale/observability/log.hpp>
#include <memscale/offload/hooks.hpp>

namespace memscale {
namespace detail {

using tensors_fn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// A checkpointed run whose last slot is a plain torch::nn::Linear: backward
/// recomputes the slots before it (`prefix`) and takes the Linear's gradients
/// from that recomputed input (linear_gradients), never running its forward again.
struct linear_tail {
  static constexpr std::size_t none = static_cast<std::size_t>(-1);
  tensors_fn prefix;
  std::shared_ptr<torch::nn::LinearImpl> linear;
  torch::Tensor weight, bias;       ///< the Linear's parameters when the run was built
  std::size_t weight_param = none;  ///< the weight's place among the checkpoint's parameters
  std::size_t bias_param = none;    ///< the bias's (none without one)

  /// Whether the gradients can come from `input`, the recomputed input, the way
  /// autograd's own backward of the Linear computes them, bit for bit: real
  /// floating point (complex products conjugate), row-major rows and weight
  /// (other layouts take other branches of the matrix products' backward, or a
  /// batched product), at least one row, and the parameters it was built with
  /// (a weight reassigned since is another tensor). Otherwise the run is
  /// recomputed whole.
  [[nodiscard]] bool applies_to(const torch::Tensor& input) const {
    const auto& w = linear->weight;
    const auto& b = linear->bias;
    return input.defined() && input.is_floating_point() && input.dim() >= 2 && input.numel() > 0 &&
           input.is_contiguous() && w.defined() && w.is_contiguous() && w.numel() > 0 &&
           w.unsafeGetTensorImpl() == weight.unsafeGetTensorImpl() &&
           b.defined() == bias.defined() && (!b.defined() || b.unsafeGetTensorImpl() == bias.unsafeGetTensorImpl());
  }
};

/// A Linear's gradients from its input x and its output's gradient g: the
/// products autograd's backward of torch::nn::Linear computes (addmm's and mm's
/// on the rows flattened; bit-identical to it, tested), without its forward.
struct linear_gradients {
  torch::Tensor input, weight, bias;  // undefined where not wanted
};

inline linear_gradients linear_backward(const torch::nn::LinearImpl& linear, const torch::Tensor& x,
                                        const torch::Tensor& g, bool want_input) {
  const auto out = g.size(-1), in = x.size(-1);
  const auto rows = g.reshape({-1, out});
  linear_gradients r;
  if (want_input) r.input = rows.mm(linear.weight).view(x.sizes());
  if (linear.weight.requires_grad()) r.weight = rows.t().mm(x.reshape({-1, in}));
  if (linear.bias.defined() && linear.bias.requires_grad()) r.bias = rows.sum(0);
  return r;
}

/// What a checkpoint keeps between forward and backward besides its inputs.
struct checkpoint_body : torch::CustomClassHolder {
  explicit checkpoint_body(tensors_fn f) : fn(std::move(f)) {}
  tensors_fn fn;
  std::optional<linear_tail> tail;
  bool replay_draws = true;  ///< the recompute replays the forward's random masks (detail/draw_replay.hpp)
  /// The forward keeps its matrix products and the recompute takes them back
  /// (selective recompute, detail/product_replay.hpp).
  bool keep_products = false;
};

/// What the recompute must reproduce of the forward: RNG and autocast state.
struct forward_context : torch::CustomClassHolder {
  rng_state state;
  std::vector<c10::Device> devices;
  compat::autocast_state autocast;
  std::shared_ptr<step_token> step;  ///< the step in flight (detail/step_gate.hpp), until backward reaches here
  draw_log draws;                    ///< the forward's random masks, where it kept them
  /// The call-site calls open at the forward (their arguments after the first),
  /// reopened for the recompute (detail/bound_call.hpp).
  std::shared_ptr<const bound_call> bound;

  /// What a forward on `devices` runs under now.
  static c10::intrusive_ptr<forward_context> now(std::vector<c10::Device> devices) {
    auto context = c10::make_intrusive<forward_context>();
    context->state = capture_rng(devices);
    context->devices = std::move(devices);
    context->autocast = compat::current_autocast();
    context->step = current_step_token();
    context->bound = bound_calls_now();
    return context;
  }
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
    restore_once(slots.front().ptr().get(), slots);
  }
  /// The same for one module (memscale::checkpoint's module forms), once per scope.
  void restore_on_close(const torch::nn::Module& module) { restore_once(&module, module); }
  static recompute_scope*& current() {
    thread_local recompute_scope* scope = nullptr;
    return scope;
  }

 private:
  /// Snapshots `what`'s buffers unless `key` has been registered in this scope.
  template <class What>
  void restore_once(const torch::nn::Module* key, const What& what) {
    if (std::find(registered_.begin(), registered_.end(), key) != registered_.end()) return;
    registered_.push_back(key);
    restores_.push_back(std::make_unique<buffer_restore>(what));
  }

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
  isolating_span draws_apart;  // nor seen by a recompute it runs inside
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
    observability::warn(std::string("a ") + technique + " segment (" + slot_names(slots) +
                        ") reads a tensor computed before it that needs a gradient; its gradient cannot flow back "
                        "through a recompute, so the segment runs as it is");
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

}  // namespace detail
}  // namespace memscale

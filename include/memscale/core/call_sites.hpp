// memscale — call-site units. Most LibTorch models keep their blocks in a
// ModuleList and loop over them in a hand-written forward, where nothing can be
// swapped. There the user marks the call: `x = memscale::forward(*blocks[i], x)`.
// With no active guard on the model that owns the module it is a direct call
// (one relaxed atomic load more). Under a guard, the calls of the example (or
// first training) forward are recorded in order; the executor plans over that
// sequence as one more source of chain units (executor.hpp) and each later call
// runs its unit's technique wrapper.
//
// The rules, in one place:
// - A unit is one call, identified by its position in the forward's sequence of
//   calls at the planning level; a module called at several sites, or several
//   times, is one unit per call, each planned on its own input.
// - Level: calls nest (a block calling memscale::forward on its sub-layers). The
//   plan uses the outermost depth with at least two calls (whole blocks), or the
//   next depth with at least two (their parts) where its plan reaches the same
//   target with less recompute (execute/attachment_levels.hpp); calls at the
//   other depths then run directly, but for the outer calls a plan at the parts'
//   depth checkpoints whole (all their parts one run): those are in the
//   sequence too, and their parts run directly inside them.
// - A forward that leaves the recorded sequence (another module than recorded,
//   or more calls) runs the rest of that forward unoptimized and is counted and
//   logged; a new forward starts after a backward (seen by memscale's engine) or
//   when a completed sequence is followed by a call to its first module. Every
//   unit's technique is correct for any call of its module, so a wrong guess
//   costs memory, never correctness.
// - Calls `Tensor forward(Tensor x, arguments...)` of modules owned by a
//   std::shared_ptr become units: the unit's technique runs on `x`, and the
//   module on `x` with the call's own arguments after it (BoundCallImpl: an
//   attention mask, a position table, a flag), copied for the call and, where
//   the unit is checkpointed, kept until its recompute, which refuses to run
//   on a tensor argument changed in place since. A call whose arguments after
//   the first include a tensor that needs a gradient runs directly (a
//   recompute could not pass that gradient back), as do calls that return
//   anything but one Tensor; those split the sequence into chains. Units with
//   arguments after the first are never tiled (their rows would need cutting
//   too).
#pragma once

#include <algorithm>
#include <atomic>
#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/detail/bound_call.hpp>
#include <memscale/detail/modules.hpp>
#include <memscale/errors.hpp>

namespace memscale::core {

/// What a call asks of the model that owns its module: whether to run a
/// technique wrapper (`runner`) instead of the module itself.
struct call_ticket {
  torch::nn::AnyModule runner;  ///< empty: call the module directly
  /// The runner stands for the call's inner calls too (an outer call
  /// checkpointed whole): memscale::forward calls inside it run directly.
  bool inner_calls_direct = false;
  /// The plan's unit takes the call's arguments after its input
  /// (call_sites::BoundCallImpl): a call of the module made without them opens
  /// one that has none; a call with them and a unit without is run directly.
  bool bound = false;
};

/// The side of an attachment that memscale::forward talks to.
class call_site_host {
 public:
  virtual ~call_site_host() = default;
  /// A call at nesting `depth` of `module`. `make_slot` (null for calls that
  /// cannot be units) builds the module's Tensor -> Tensor AnyModule; `input` is
  /// the call's tensor; `why_not` says why the call cannot be a unit.
  virtual call_ticket begin_call(torch::nn::Module& module, int depth,
                                 const std::function<torch::nn::AnyModule()>* make_slot, const torch::Tensor* input,
                                 const char* why_not) = 0;
};

namespace call_sites {

/// Models with call sites under a guard: zero means every memscale::forward is
/// a direct call after one relaxed load.
inline std::atomic<int>& active_hosts() {
  static std::atomic<int> count{0};
  return count;
}

/// Which host each module of a guarded model belongs to (the latest wrap of a
/// model containing it wins).
class index {
 public:
  static index& global() {
    static index instance;
    return instance;
  }
  void add(const torch::nn::Module* module, const std::shared_ptr<call_site_host>& host) {
    std::lock_guard<std::mutex> lock(mutex_);
    hosts_[module] = host;
  }
  void remove_host(const call_site_host* host) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = hosts_.begin(); it != hosts_.end();) {
      auto live = it->second.lock();
      it = (!live || live.get() == host) ? hosts_.erase(it) : std::next(it);
    }
  }
  [[nodiscard]] std::shared_ptr<call_site_host> find(const torch::nn::Module* module) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = hosts_.find(module);
    return it == hosts_.end() ? nullptr : it->second.lock();
  }

 private:
  std::mutex mutex_;
  std::unordered_map<const torch::nn::Module*, std::weak_ptr<call_site_host>> hosts_;
};

/// How deep in memscale::forward calls this thread is.
inline int& depth() {
  thread_local int d = 0;
  return d;
}

struct depth_scope {
  int at;
  depth_scope() : at(depth()++) {}
  depth_scope(const depth_scope&) = delete;
  depth_scope& operator=(const depth_scope&) = delete;
  ~depth_scope() { --depth(); }
};

/// The unit of a call that passes arguments after its tensor: runs
/// `module.forward(x, arguments...)` with the arguments of the call of the
/// module open on this thread (memscale::forward opens it around the unit's
/// technique; a checkpoint's recompute reopens the forward's), or, with none
/// open (profiling on the recorded input), with the recorded call's. Registers
/// the module, so parameters() and buffers() are its own; the model does not
/// register this wrapper.
class BoundCallImpl : public torch::nn::Module, public detail::bound_slot {
 public:
  BoundCallImpl(const std::shared_ptr<torch::nn::Module>& module, std::shared_ptr<const detail::bound_call> recorded)
      : torch::nn::Module("memscale::BoundCall"), module_(module.get()), recorded_(std::move(recorded)) {
    register_module("call", module);
  }

  torch::Tensor forward(torch::Tensor x) {
    const auto& open = detail::bound_calls_now();
    const detail::bound_call* call = open ? open->find(module_) : nullptr;
    if (call == nullptr) {
      // Only profiling runs the unit outside a call of its module, before forget_recorded().
      if (recorded_ == nullptr)
        throw Error("memscale: internal error: the unit of a call to " + module_->name() +
                    " ran outside any call of it; please report this");
      return recorded_->run(x);
    }
    if (const int changed = call->changed_argument(); changed > 0)
      throw Error("memscale::forward: argument " + std::to_string(changed) + " after the input of the call to " +
                  module_->name() + " (a tensor) changed in place between its forward and this recompute of it (a "
                  "checkpointed unit runs its forward again in backward, on the arguments of the call); leave it "
                  "unchanged until backward (pass a copy), or keep the call out of the plan");
    return call->run(x);
  }
  /// Drops the recorded call's arguments once the plan is made (they may be a
  /// batch's tensors).
  void forget_recorded() noexcept { recorded_.reset(); }

 private:
  const torch::nn::Module* module_;
  std::shared_ptr<const detail::bound_call> recorded_;
};

/// Open while a runner that stands for its inner calls runs on this thread
/// (call_ticket::inner_calls_direct): those calls are direct calls.
inline int& direct() {
  thread_local int d = 0;
  return d;
}
struct direct_scope {
  direct_scope() { ++direct(); }
  direct_scope(const direct_scope&) = delete;
  direct_scope& operator=(const direct_scope&) = delete;
  ~direct_scope() { --direct(); }
};

}  // namespace call_sites
}  // namespace memscale::core

namespace memscale {
namespace detail {

/// The module a call site names: a module, a ModuleHolder, or a shared_ptr to one.
template <class M>
decltype(auto) module_of(M& m) {
  if constexpr (std::is_base_of_v<torch::nn::Module, std::remove_cvref_t<M>>)
    return (m);
  else
    return (*m);
}

template <class Impl, class... Args>
concept unit_call = sizeof...(Args) == 1 && (std::is_convertible_v<Args, const torch::Tensor&> && ...) &&
                    requires(Impl& m, const torch::Tensor& x) {
                      { m.forward(x) } -> std::same_as<torch::Tensor>;
                      &Impl::forward;  // one forward: AnyModule needs it unambiguous
                    };

/// The arguments a unit's call may pass after its input: values a copy keeps
/// whole (a tensor's copy shares its data, whose version is checked), so that a
/// recompute reads what the call read. Views of memory the caller owns (an
/// ArrayRef, a string_view, a pointer) and containers whose tensors memscale
/// cannot see are not.
template <class T>
inline constexpr bool bindable_argument_v =
    std::is_arithmetic_v<T> || std::is_enum_v<T> || std::is_same_v<T, torch::Tensor> ||
    std::is_same_v<T, std::optional<torch::Tensor>> || std::is_same_v<T, c10::optional<torch::Tensor>> ||
    std::is_same_v<T, std::string> || std::is_same_v<T, std::vector<std::int64_t>> ||
    std::is_same_v<T, std::vector<double>>;

/// Adds the tensors among a call's arguments to `out`, each with its position.
template <class T>
void tensors_of(const T& value, int argument, std::vector<bound_call::tensor_argument>& out) {
  if constexpr (std::is_same_v<T, torch::Tensor>) {
    if (value.defined()) out.push_back({value, value._version(), argument});
  } else if constexpr (std::is_same_v<T, std::optional<torch::Tensor>> ||
                       std::is_same_v<T, c10::optional<torch::Tensor>>) {
    if (value.has_value()) tensors_of(*value, argument, out);
  }
}

/// A call `m.forward(x, arguments...)` that can be a unit with its arguments
/// bound (call_sites::BoundCallImpl): a tensor first, bindable arguments after,
/// each passed by value or const reference (a forward that writes to one
/// would write to the unit's copy), one Tensor out.
template <class Impl, class X, class... Rest>
inline constexpr bool bound_unit_call_v =
    std::is_convertible_v<X, const torch::Tensor&> && (bindable_argument_v<std::decay_t<Rest>> && ...) &&
    requires(Impl& m, const torch::Tensor& x, const std::decay_t<Rest>&... rest) {
      { m.forward(x, rest...) } -> std::same_as<torch::Tensor>;
      &Impl::forward;
    };
template <class Impl, class... Args>
concept bound_unit_call = sizeof...(Args) >= 2 && bound_unit_call_v<Impl, Args...>;

/// Opens a call of `impl` without arguments after its input, where the plan's
/// unit takes them (ticket.bound): the module's own defaults apply.
template <class Impl>
std::optional<bound_scope> open_plain_call(const core::call_ticket& ticket, Impl& impl) {
  if (!ticket.bound) return std::nullopt;
  auto call = std::make_shared<bound_call>();
  call->module = &impl;
  call->run = [&impl](const torch::Tensor& in) -> torch::Tensor { return impl.forward(in); };
  return std::optional<bound_scope>(std::in_place, std::move(call));
}

template <class Impl, class X, class... Rest>
torch::Tensor bound_unit(core::call_site_host& host, Impl& impl, int depth, X&& first, Rest&&... rest) {
  const torch::Tensor& x = first;
  auto call = std::make_shared<bound_call>();
  call->module = &impl;
  int argument = 0;
  (tensors_of(static_cast<const std::decay_t<Rest>&>(rest), ++argument, call->tensors), ...);
  const bool needs_grad = std::any_of(call->tensors.begin(), call->tensors.end(),
                                     [](const auto& t) { return t.tensor.requires_grad(); });
  if (needs_grad) {
    (void)host.begin_call(impl, depth, nullptr, nullptr,
                          "an argument after its input is a tensor that needs a gradient (a checkpoint's recompute "
                          "could not pass that gradient back)");
    return impl.forward(std::forward<X>(first), std::forward<Rest>(rest)...);
  }
  call->run = [&impl, ... bound = std::decay_t<Rest>(rest)](const torch::Tensor& in) -> torch::Tensor {
    return impl.forward(in, bound...);
  };
  const std::shared_ptr<const bound_call> recorded = call;
  const std::function<torch::nn::AnyModule()> make_slot = [&impl, &recorded]() {
    return torch::nn::AnyModule(std::make_shared<core::call_sites::BoundCallImpl>(impl.shared_from_this(), recorded));
  };
  auto ticket = host.begin_call(impl, depth, &make_slot, &x, nullptr);
  // A unit planned from a call without these arguments would drop them.
  if (ticket.runner.is_empty() || !ticket.bound)
    return impl.forward(std::forward<X>(first), std::forward<Rest>(rest)...);
  std::optional<core::call_sites::direct_scope> inner_direct;
  if (ticket.inner_calls_direct) inner_direct.emplace();
  const bound_scope open(std::move(call));
  return ticket.runner.template forward<torch::Tensor>(x);
}

}  // namespace detail

/// Calls `module.forward(args...)`: a module reference, a ModuleHolder, or a
/// std::shared_ptr to a module. Under an active guard on a model that contains
/// the module, the call is a unit of that model's plan (see core/call_sites.hpp
/// for the rules); otherwise it is exactly a direct call.
template <class M, class... Args>
decltype(auto) forward(M&& module, Args&&... args) {
  auto& impl = detail::module_of(module);
  using Impl = std::remove_cvref_t<decltype(impl)>;
  if (core::call_sites::active_hosts().load(std::memory_order_relaxed) == 0)
    return impl.forward(std::forward<Args>(args)...);
  if (core::call_sites::direct() > 0) return impl.forward(std::forward<Args>(args)...);
  auto host = core::call_sites::index::global().find(&impl);
  if (!host) return impl.forward(std::forward<Args>(args)...);
  core::call_sites::depth_scope nested;
  if constexpr (detail::unit_call<Impl, Args...>) {
    const torch::Tensor& x = (args, ...);
    const std::function<torch::nn::AnyModule()> make_slot = [&impl]() {
      return torch::nn::AnyModule(std::dynamic_pointer_cast<Impl>(impl.shared_from_this()));
    };
    auto ticket = host->begin_call(impl, nested.at, &make_slot, &x, nullptr);
    if (!ticket.runner.is_empty()) {
      std::optional<core::call_sites::direct_scope> inner_direct;
      if (ticket.inner_calls_direct) inner_direct.emplace();
      const auto plain = detail::open_plain_call(ticket, impl);
      return ticket.runner.template forward<torch::Tensor>(x);
    }
    return impl.forward(std::forward<Args>(args)...);
  } else if constexpr (detail::bound_unit_call<Impl, Args...>) {
    return detail::bound_unit(*host, impl, nested.at, std::forward<Args>(args)...);
  } else {
    (void)host->begin_call(impl, nested.at, nullptr, nullptr,
                           "its forward is not `Tensor forward(Tensor, arguments...)` (a Tensor first; after it, "
                           "by value or const reference, Tensors, optional Tensors, numbers, enums, strings or "
                           "vectors of numbers; one Tensor out; one overload)");
    return impl.forward(std::forward<Args>(args)...);
  }
}

}  // namespace memscale

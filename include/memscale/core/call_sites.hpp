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
// - Only `Tensor forward(Tensor)` calls of modules owned by a std::shared_ptr
//   become units; other calls run directly and split the sequence into chains.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include <torch/torch.h>

#include <memscale/detail/modules.hpp>

namespace memscale::core {

/// What a call asks of the model that owns its module: whether to run a
/// technique wrapper (`runner`) instead of the module itself.
struct call_ticket {
  torch::nn::AnyModule runner;  ///< empty: call the module directly
  /// The runner stands for the call's inner calls too (an outer call
  /// checkpointed whole): memscale::forward calls inside it run directly.
  bool inner_calls_direct = false;
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
      return ticket.runner.template forward<torch::Tensor>(x);
    }
    return impl.forward(std::forward<Args>(args)...);
  } else {
    (void)host->begin_call(impl, nested.at, nullptr, nullptr,
                           "its forward is not `Tensor forward(Tensor)` (one Tensor in, one Tensor out, one "
                           "overload)");
    return impl.forward(std::forward<Args>(args)...);
  }
}

}  // namespace memscale

// memscale — saved-tensor hooks in pure C++. LibTorch exposes context-wide
// pack/unpack hooks to Python only; what it offers C++ is the autograd Engine's
// virtual get_default_saved_variable_hooks(), which every SavedVariable consults
// (built-in ops, Function<T>::save_for_backward, autograd::grad) on 1.13 and 2.x
// alike. memscale installs an Engine subclass whose hooks come from a
// thread-local, RAII-scoped stack: the innermost saved_tensors_hooks scope on the
// thread that runs a forward decides how each tensor autograd saves is stored.
// With no scope open the engine returns no hooks, exactly as the base engine does.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <concepts>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>
#include <torch/torch.h>

#include <memscale/observability/metrics.hpp>

namespace memscale::offload {

namespace detail {

/// Makes the per-tensor hooks object of one scope.
class hooks_factory {
 public:
  virtual ~hooks_factory() = default;
  [[nodiscard]] virtual std::unique_ptr<torch::autograd::SavedVariableHooks> make() const = 0;
  /// Set when its scope closed on another thread than the one whose stack holds it.
  mutable std::atomic<bool> closed_elsewhere{false};
};

inline std::vector<std::shared_ptr<const hooks_factory>>& hook_stack() {
  thread_local std::vector<std::shared_ptr<const hooks_factory>> stack;
  return stack;
}

/// Set when a saved_tensors_hooks scope closed while an inner one was still
/// open (a scope moved to the heap, or destroyed out of order): the next tensor
/// saved on this thread fails with this message instead of going through
/// hooks the program no longer means. Thread-local, like the stack.
inline std::string& hook_stack_error() {
  thread_local std::string error;
  return error;
}

/// The autograd engine with hooks: identical to the base engine but for
/// get_default_saved_variable_hooks(). Engine() is protected, so a subclass may
/// construct it; stop() must run before the base destructor (see engine.h).
class hooks_engine final : public torch::autograd::Engine {
 public:
  hooks_engine() = default;
  ~hooks_engine() override { stop(); }

  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (auto& error = hook_stack_error(); !error.empty()) {
      const std::string message = std::move(error);
      error.clear();
      TORCH_CHECK(false, message);
    }
    auto& stack = hook_stack();
    if (!stack.empty() && stack.back()->closed_elsewhere.load()) {
      while (!stack.empty() && stack.back()->closed_elsewhere.load()) stack.pop_back();
      TORCH_CHECK(false,
                  "memscale: a saved_tensors_hooks scope opened on this thread was closed on another thread; "
                  "scopes are thread-local and must be destroyed where they were created");
    }
    return stack.empty() ? nullptr : stack.back()->make();
  }

  /// Counts every backward this engine runs (backward(), autograd::grad, a
  /// checkpoint's internal grad): call sites use it to tell training steps apart.
  /// One that starts outside any other backward or recompute of its thread is a
  /// training step for the metrics (observability/metrics.hpp).
  torch::autograd::variable_list execute(const torch::autograd::edge_list& roots,
                                         const torch::autograd::variable_list& inputs, bool keep_graph,
                                         bool create_graph, bool accumulate_grad,
                                         const torch::autograd::edge_list& outputs = {}) override {
    backwards_.fetch_add(1, std::memory_order_relaxed);
    // Top level: outside any graph task (a reentrant backward, on CPU or on a
    // CUDA device thread, runs inside one), and outside memscale's own work.
    if (torch::autograd::get_current_graph_task_exec_info() == nullptr && observability::own_work_scope::depth() == 0)
      observability::counters().step_started();
    return torch::autograd::Engine::execute(roots, inputs, keep_graph, create_graph, accumulate_grad, outputs);
  }
  [[nodiscard]] std::uint64_t backwards() const noexcept { return backwards_.load(std::memory_order_relaxed); }

  static hooks_engine& self() {
    static hooks_engine engine;  // one per process, as the Engine requires
    return engine;
  }
  /// The engine stub set_default_engine_stub takes.
  static torch::autograd::Engine& instance() { return self(); }

 private:
  std::atomic<std::uint64_t> backwards_{0};
};

inline std::atomic<bool>& engine_installed() {
  static std::atomic<bool> installed{false};
  return installed;
}

}  // namespace detail

/// Makes memscale's engine LibTorch's default autograd engine (once per process;
/// later calls do nothing). Programs that include this header get it while they
/// load (see below), before any backward can run, whenever LibTorch's base
/// engine is the default then: LibTorch starts the autograd device threads once
/// per process, for whichever engine runs a backward first, and an engine that
/// comes second cannot run CUDA backwards at all (measured on LibTorch 2.11;
/// hooks_unavailable_reason() detects it). Results do not change: without an
/// open scope it behaves as the base engine. Nothing else installs it: a process
/// whose default engine is another (Python's) keeps it, and gets no C++ hooks.
inline void install_hooks_engine() {
  static const bool once = [] {
    torch::autograd::set_default_engine_stub(&detail::hooks_engine::instance);
    detail::engine_installed() = true;
    return true;
  }();
  (void)once;
}

namespace detail {
/// Installs the engine during static initialization of any program that
/// includes memscale, so it is the first engine to run a backward; but only
/// over LibTorch's base engine: inside Python (an extension that includes
/// memscale) Python's engine stays, with the hooks Python gives.
inline const bool hooks_engine_installed_at_load = [] {
  if (&torch::autograd::Engine::get_default_engine() == &torch::autograd::Engine::get_base_engine())
    install_hooks_engine();
  return true;
}();
}  // namespace detail

/// Whether LibTorch's default engine is memscale's (false before install, or
/// after another library replaced it).
[[nodiscard]] inline bool hooks_engine_active() {
  if (!detail::engine_installed()) return false;
  return &torch::autograd::Engine::get_default_engine() == &detail::hooks_engine::instance();
}

/// How many backwards memscale's engine has started (0 while it is not the
/// default engine: then nothing counts them).
[[nodiscard]] inline std::uint64_t backwards_started() {
  return hooks_engine_active() ? detail::hooks_engine::self().backwards() : 0;
}

/// Why saved-tensor hooks cannot work for tensors on `device` (empty: they can).
/// They need memscale's engine to be the default one, and, on CUDA, to own the
/// autograd device threads: a one-element CUDA backward through it finds out
/// once per process, and on failure puts LibTorch's base engine back.
[[nodiscard]] inline std::string hooks_unavailable_reason(const c10::Device& device) {
  if (!hooks_engine_active())
    return "LibTorch's default autograd engine is not memscale's (another library, or libtorch_python, replaced "
           "it with torch::autograd::set_default_engine_stub), so saved-tensor hooks would never be called";
  if (!device.is_cuda()) return {};
  static std::mutex mutex;
  static std::string cuda_reason;
  static bool probed = false;
  std::lock_guard<std::mutex> lock(mutex);
  if (!probed) {
    try {
      auto x = torch::ones({1}, torch::TensorOptions().device(device).requires_grad(true));
      (x * 2).sum().backward();
    } catch (const c10::Error& e) {
      // Left in place, memscale's engine would fail every CUDA backward of the
      // process: the base engine, which owns the device threads, comes back.
      torch::autograd::set_default_engine_stub(&torch::autograd::Engine::get_base_engine);
      detail::engine_installed() = false;
      cuda_reason = std::string("memscale's autograd engine cannot run a CUDA backward in this process (") +
                    e.what_without_backtrace() +
                    "): another engine ran a CUDA backward before it became the default, so LibTorch's base "
                    "engine was put back. Do not replace the engine with set_default_engine_stub";
    }
    probed = true;
  }
  return cuda_reason;
}

/// Pack: `const at::Tensor&` -> P (any movable type); Unpack: `P&` -> at::Tensor.
template <class Pack>
using packed_t = std::decay_t<std::invoke_result_t<Pack&, const at::Tensor&>>;

template <class Pack, class Unpack>
concept hook_pair = std::invocable<Pack&, const at::Tensor&> && std::movable<packed_t<Pack>> &&
                    requires(Unpack& u, packed_t<Pack>& p) {
                      { u(p) } -> std::convertible_to<at::Tensor>;
                    };

/// For its lifetime, on this thread, every tensor autograd saves goes through
/// `pack` when saved and `unpack` when backward needs it (possibly on another
/// thread, and more than once under retain_graph; both must be thread-safe).
/// Scopes nest; the innermost wins. The pack hook runs under no-grad and must
/// not modify its argument; it sees parameters too, so it decides what to keep.
/// The callables live as long as the last tensor saved under them.
template <class Pack, class Unpack>
  requires hook_pair<Pack, Unpack>
class saved_tensors_hooks {
 public:
  saved_tensors_hooks(Pack pack, Unpack unpack)
      : factory_(std::make_shared<const factory>(std::move(pack), std::move(unpack))) {
    detail::hook_stack().push_back(factory_);
  }
  saved_tensors_hooks(const saved_tensors_hooks&) = delete;
  saved_tensors_hooks& operator=(const saved_tensors_hooks&) = delete;
  /// Scopes close innermost first (RAII does that). One closed out of order is
  /// taken off the stack all the same, so no stale hook stays behind, and the
  /// next tensor saved on this thread fails with an error that says so.
  ~saved_tensors_hooks() {
    auto& stack = detail::hook_stack();
    if (!stack.empty() && stack.back() == factory_) {
      stack.pop_back();
      return;
    }
    const auto it = std::find(stack.begin(), stack.end(), factory_);
    if (it == stack.end()) {
      // Closed on another thread: the opening thread's next save finds it.
      factory_->closed_elsewhere = true;
      return;
    }
    stack.erase(it);
    detail::hook_stack_error() =
        "memscale: a saved_tensors_hooks scope was closed while a scope opened after it was still open; "
        "scopes must be destroyed innermost first (keep them as local RAII objects)";
  }

 private:
  using packed = packed_t<Pack>;
  struct callables {
    Pack pack;
    Unpack unpack;
  };

  class hooks final : public torch::autograd::SavedVariableHooks {
   public:
    explicit hooks(std::shared_ptr<callables> fns) : fns_(std::move(fns)) {}
    void call_pack_hook(const at::Tensor& tensor) override { data_.emplace(fns_->pack(tensor)); }
    at::Tensor call_unpack_hook() override {
      TORCH_CHECK(data_.has_value(), "memscale: a saved tensor was unpacked before it was packed");
      return fns_->unpack(*data_);
    }

   private:
    std::shared_ptr<callables> fns_;
    std::optional<packed> data_;
  };

  class factory final : public detail::hooks_factory {
   public:
    factory(Pack pack, Unpack unpack)
        : fns_(std::make_shared<callables>(callables{std::move(pack), std::move(unpack)})) {}
    [[nodiscard]] std::unique_ptr<torch::autograd::SavedVariableHooks> make() const override {
      return std::make_unique<hooks>(fns_);
    }

   private:
    std::shared_ptr<callables> fns_;
  };

  std::shared_ptr<const factory> factory_;
};

template <class Pack, class Unpack>
saved_tensors_hooks(Pack, Unpack) -> saved_tensors_hooks<Pack, Unpack>;

/// The storages autograd saves while it is open (on this thread), through
/// memscale's saved-tensor hooks; the tensors themselves are saved as usual.
class saved_storage_log {
 public:
  struct entry {
    const void* storage;
    std::int64_t bytes;
  };

  [[nodiscard]] std::vector<entry> entries() const {
    std::lock_guard<std::mutex> lock(record_->mutex);
    return record_->entries;
  }

 private:
  struct record {
    std::mutex mutex;
    std::vector<entry> entries;
  };
  struct pack {
    std::shared_ptr<record> log;
    at::Tensor operator()(const at::Tensor& t) const {
      if (t.defined() && t.has_storage()) {
        std::lock_guard<std::mutex> lock(log->mutex);
        log->entries.push_back({t.storage().unsafeGetStorageImpl(), static_cast<std::int64_t>(t.storage().nbytes())});
      }
      // Without its history: a saved output's grad_fn owns this hook (a cycle
      // that would keep the graph alive; offload::engine::store says the same).
      return t.detach();
    }
  };
  struct unpack {
    at::Tensor operator()(at::Tensor& t) const { return t; }
  };

  std::shared_ptr<record> record_ = std::make_shared<record>();
  offload::saved_tensors_hooks<pack, unpack> hooks_{pack{record_}, unpack{}};
};

}  // namespace memscale::offload

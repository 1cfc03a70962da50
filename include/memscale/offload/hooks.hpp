// memscale — saved-tensor hooks in pure C++. LibTorch exposes context-wide
// pack/unpack hooks to Python only; what it offers C++ is the autograd Engine's
// virtual get_default_saved_variable_hooks(), which every SavedVariable consults
// (built-in ops, Function<T>::save_for_backward, autograd::grad) on 1.13 and 2.x
// alike. memscale installs an Engine subclass whose hooks come from a
// thread-local, RAII-scoped stack: the innermost saved_tensors_hooks scope on the
// thread that runs a forward decides how each tensor autograd saves is stored.
// With no scope open the engine returns no hooks, exactly as the base engine does.
#pragma once

#include <atomic>
#include <concepts>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>
#include <torch/torch.h>

namespace memscale::offload {

namespace detail {

/// Makes the per-tensor hooks object of one scope.
class hooks_factory {
 public:
  virtual ~hooks_factory() = default;
  [[nodiscard]] virtual std::unique_ptr<torch::autograd::SavedVariableHooks> make() const = 0;
};

inline std::vector<std::shared_ptr<const hooks_factory>>& hook_stack() {
  thread_local std::vector<std::shared_ptr<const hooks_factory>> stack;
  return stack;
}

/// The autograd engine with hooks: identical to the base engine but for
/// get_default_saved_variable_hooks(). Engine() is protected, so a subclass may
/// construct it; stop() must run before the base destructor (see engine.h).
class hooks_engine final : public torch::autograd::Engine {
 public:
  hooks_engine() = default;
  ~hooks_engine() override { stop(); }

  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    const auto& stack = hook_stack();
    return stack.empty() ? nullptr : stack.back()->make();
  }

  static torch::autograd::Engine& instance() {
    static hooks_engine engine;  // one per process, as the Engine requires
    return engine;
  }
};

inline std::atomic<bool>& engine_installed() {
  static std::atomic<bool> installed{false};
  return installed;
}

}  // namespace detail

/// Makes memscale's engine LibTorch's default autograd engine (once per process;
/// later calls do nothing). Install it before the first backward that should see
/// hooks; saved_tensors_hooks does so itself. Results do not change: without an
/// open scope it behaves as the base engine. A process that later loads
/// libtorch_python gets Python's engine back, and with it no C++ hooks.
inline void install_hooks_engine() {
  static const bool once = [] {
    torch::autograd::set_default_engine_stub(&detail::hooks_engine::instance);
    detail::engine_installed() = true;
    return true;
  }();
  (void)once;
}

/// Whether LibTorch's default engine is memscale's (false before install, or
/// after another library replaced it).
[[nodiscard]] inline bool hooks_engine_active() {
  if (!detail::engine_installed()) return false;
  return &torch::autograd::Engine::get_default_engine() == &detail::hooks_engine::instance();
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
    install_hooks_engine();
    detail::hook_stack().push_back(factory_);
  }
  saved_tensors_hooks(const saved_tensors_hooks&) = delete;
  saved_tensors_hooks& operator=(const saved_tensors_hooks&) = delete;
  ~saved_tensors_hooks() {
    auto& stack = detail::hook_stack();
    // Scopes are RAII objects, so they close innermost first.
    if (!stack.empty() && stack.back() == factory_) stack.pop_back();
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

}  // namespace memscale::offload

// memscale::detail — a call-site unit's arguments after the first. A call
// `memscale::forward(block, x, mask, ...)` is a unit of the plan like
// `memscale::forward(block, x)`: its technique wrapper runs on `x` alone, and
// the wrapped module (core::call_sites::BoundCallImpl) runs `block.forward(x,
// mask, ...)` with the arguments of the call in flight, which memscale::forward
// binds here for the span of the call (bound_scope). A checkpoint's forward
// keeps the bound calls open on its thread (bound_calls_now) and its recompute
// reopens them, so the recompute reads the arguments of the forward it
// recomputes, not those of a later call. Internal; not part of the public
// surface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <torch/torch.h>

namespace memscale::detail {

/// One call's arguments after the first, bound: `run(x)` is `module.forward(x,
/// arguments...)` with the arguments the call was made with.
struct bound_call {
  const torch::nn::Module* module = nullptr;
  std::function<torch::Tensor(const torch::Tensor&)> run;
  /// A tensor among the arguments, with its version at the call: a recompute
  /// that finds one changed in place refuses to run on it.
  struct tensor_argument {
    at::Tensor tensor;
    std::int64_t version = 0;
    int argument = 0;  ///< its position among the arguments after the input, from 1
  };
  std::vector<tensor_argument> tensors;
  /// The call this one runs inside (a unit's module calling memscale::forward).
  std::shared_ptr<const bound_call> outer;

  /// The innermost open call of `m`, or null.
  [[nodiscard]] const bound_call* find(const torch::nn::Module* m) const noexcept {
    for (const bound_call* c = this; c != nullptr; c = c->outer.get())
      if (c->module == m) return c;
    return nullptr;
  }
  /// The position (from 1, after the input) of the first tensor argument
  /// changed in place since the call, or 0.
  [[nodiscard]] int changed_argument() const noexcept {
    for (const auto& t : tensors)
      if (t.tensor.defined() && t.tensor._version() != t.version) return t.argument;
    return 0;
  }
};

/// What a unit runs with a call's arguments bound derives from (the profiler
/// measures such a unit on its recorded call whole, never on part of its rows).
class bound_slot {
 public:
  virtual ~bound_slot() = default;
};

/// The calls open on this thread, innermost first.
inline std::shared_ptr<const bound_call>& bound_calls_now() {
  thread_local std::shared_ptr<const bound_call> open;
  return open;
}

/// Opens `call` (whose `outer` it sets to the calls open now) for its span, or
/// reopens calls a forward kept (`reopen`), and restores what was open after.
class bound_scope {
 public:
  explicit bound_scope(std::shared_ptr<bound_call> call) : previous_(bound_calls_now()) {
    call->outer = previous_;
    bound_calls_now() = std::move(call);
  }
  struct reopen_t {};
  bound_scope(reopen_t, std::shared_ptr<const bound_call> kept) : previous_(bound_calls_now()) {
    bound_calls_now() = std::move(kept);
  }
  bound_scope(const bound_scope&) = delete;
  bound_scope& operator=(const bound_scope&) = delete;
  ~bound_scope() { bound_calls_now() = std::move(previous_); }

 private:
  std::shared_ptr<const bound_call> previous_;
};

}  // namespace memscale::detail

// memscale::detail — save and restore module buffers (BatchNorm running
// statistics, ...): a profiling pass or a checkpoint's recompute in training mode
// must not update them a second time. And whether this thread runs shape-only
// (predict's span), with the guard that computes for real inside it. Internal.
#pragma once

#include <utility>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#if TORCH_VERSION_MAJOR < 2
#include <c10/core/impl/LocalDispatchKeySet.h>
#endif

namespace memscale::detail {

/// Computes what runs in its scope for real even inside predict's shape-only
/// execution (predict/shape_only.hpp, LibTorch 1.x: DispatchKey::Fake): for
/// memscale's own bookkeeping, whose values must be right. Nothing on 2.x.
class computing_guard {
 public:
  computing_guard() = default;
  computing_guard(const computing_guard&) = delete;
  computing_guard& operator=(const computing_guard&) = delete;
  ~computing_guard() {}  // user-provided: a scope guard, even where it holds nothing (2.x)

 private:
#if TORCH_VERSION_MAJOR < 2
  c10::impl::ExcludeDispatchKeyGuard no_fake_{c10::DispatchKey::Fake};
#endif
};

/// Whether operators on this thread run shape-only (memscale::predict's span
/// includes LibTorch 1.x's Fake key, and no computing_guard excludes it): they
/// compute nothing, so timing them measures nothing and the bytes they leave
/// are no values. Always false on LibTorch 2.x, where predict has no such span.
[[nodiscard]] inline bool shape_only_dispatch() {
#if TORCH_VERSION_MAJOR < 2
  return c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Fake) &&
         !c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Fake);
#else
  return false;
#endif
}

/// Restores every buffer of the given modules to its value at construction.
class buffer_restore {
 public:
  explicit buffer_restore(const std::vector<torch::nn::AnyModule>& slots) {
    for (const auto& slot : slots) add(*slot.ptr());
  }
  explicit buffer_restore(const torch::nn::Module& module) { add(module); }
  buffer_restore(const buffer_restore&) = delete;
  buffer_restore& operator=(const buffer_restore&) = delete;
  ~buffer_restore() {
    try {
      restore();
    } catch (...) {  // never throw from a destructor
    }
  }

  /// Puts the buffers back now (and again at the end), in place and with no
  /// new version: a graph kept for a double backward (a checkpoint's recompute
  /// under create_graph) saved BatchNorm's running statistics at the version the
  /// recompute left, and its backward, which does not read them in training,
  /// refused the gradient penalty's backward when the copy counted as a write.
  void restore() {
    torch::NoGradGuard no_grad;
    const computing_guard computing;
    const at::AutoDispatchBelowADInplaceOrView no_new_version;
    for (auto& [live, copy] : saved_)
      if (!live.equal(copy)) live.copy_(copy);  // only what changed
  }

 private:
  void add(const torch::nn::Module& module) {
    torch::NoGradGuard no_grad;
    const computing_guard computing;
    for (const auto& b : module.buffers())
      if (b.defined()) saved_.emplace_back(b, b.clone());
  }

  std::vector<std::pair<torch::Tensor, torch::Tensor>> saved_;
};

}  // namespace memscale::detail

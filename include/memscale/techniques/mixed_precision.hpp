// memscale — mixed precision: an RAII autocast scope (bfloat16 on CPU; float16
// or bfloat16 on CUDA) and a dynamic loss scaler usable with any
// torch::optim::Optimizer. With Config::use_mixed_precision the executor runs
// the layers of the chains it manages under autocast (AutocastSlot).
//
//   memscale::amp::loss_scaler scaler;
//   scaler.scale(loss).backward();
//   scaler.step(optimizer);   // unscales, skips the step on inf/NaN gradients
//   scaler.update();          // backs off after an overflow, grows after a clean run
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <memscale/detail/compat.hpp>
#include <memscale/detail/fault_injection.hpp>
#include <memscale/detail/modules.hpp>
#include <memscale/errors.hpp>
#include <memscale/techniques/checkpoint.hpp>  // detail::slot_wrapper

namespace memscale {

namespace detail {
/// LibTorch 1.x's CPU autocast has no policy for layer_norm, whose CPU kernel
/// refuses a bfloat16 input with float32 weights ("expected scalar type
/// BFloat16 but found Float"): a model with a LayerNorm after a Linear failed
/// its first forward under use_mixed_precision. Registers for it, once per
/// process and where the key has no kernel of its own, autocast's fp32 policy
/// (each floating tensor of another precision than float32 or double cast to
/// float32, then layer_norm without autocast). 2.x's kernel takes the mix.
inline bool cpu_autocast_layer_norm_in_fp32() {
#if TORCH_VERSION_MAJOR >= 2
  return false;
#else
  static const bool registered = [] {
    try {
      if (c10::Dispatcher::singleton().findSchemaOrThrow("aten::layer_norm", "").hasKernelForDispatchKey(
              c10::DispatchKey::AutocastCPU))
        return false;
      // Kept for the process's lifetime: a registration is undone when its Library is destroyed.
      static auto* kernels =
          new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::AutocastCPU, __FILE__, __LINE__);
      kernels->impl("layer_norm", [](const at::Tensor& input, at::IntArrayRef shape,
                                     const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
                                     double eps, bool cudnn_enable) {
        c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
        const auto fp32 = [](const at::Tensor& t) {
          return t.defined() && t.is_floating_point() && t.scalar_type() != at::kFloat &&
                         t.scalar_type() != at::kDouble
                     ? t.to(at::kFloat)
                     : t;
        };
        const auto maybe = [&](const c10::optional<at::Tensor>& t) {
          return t ? c10::optional<at::Tensor>(fp32(*t)) : t;
        };
        return at::layer_norm(fp32(input), shape, maybe(weight), maybe(bias), eps, cudnn_enable);
      });
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }();
  return registered;
#endif
}
}  // namespace detail

/// Autocast for one device type for the scope's lifetime, on the thread that
/// opens it (autocast is thread-local in LibTorch). The previous state comes
/// back at the end; the cast cache is cleared when the outermost scope closes.
/// A scope spanning several optimizer steps must not cache casts of weights
/// the optimizer changes in place: `cache_casts` is off by default for that.
class autocast_scope {
 public:
  explicit autocast_scope(c10::DeviceType device = c10::kCPU, std::optional<at::ScalarType> dtype = {},
                          bool cache_casts = false)
      : previous_(detail::compat::current_autocast()), previous_cache_(at::autocast::is_autocast_cache_enabled()) {
    auto next = previous_;
    if (device == c10::kCPU) {
      (void)detail::cpu_autocast_layer_norm_in_fp32();
      next.cpu = true;
      next.cpu_dtype = dtype.value_or(at::kBFloat16);
      check_dtype(device, next.cpu_dtype);
    } else if (device == c10::kCUDA) {
      next.cuda = true;
      next.cuda_dtype = dtype.value_or(at::kHalf);
      check_dtype(device, next.cuda_dtype);
    } else {
      throw Error("memscale::autocast_scope: autocast is supported on cpu and cuda, got device type " +
                  c10::DeviceTypeName(device));
    }
    detail::compat::set_autocast(next);
    at::autocast::set_autocast_cache_enabled(cache_casts);
    at::autocast::increment_nesting();
  }
  autocast_scope(const autocast_scope&) = delete;
  autocast_scope& operator=(const autocast_scope&) = delete;
  ~autocast_scope() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_cache_enabled(previous_cache_);
    detail::compat::set_autocast(previous_);
  }

 private:
  static void check_dtype(c10::DeviceType device, at::ScalarType dtype) {
    const bool cpu = device == c10::kCPU;
#if TORCH_VERSION_MAJOR >= 2
    const bool ok = dtype == at::kBFloat16 || dtype == at::kHalf;
    const char* valid = "bfloat16 or float16";
#else
    const bool ok = cpu ? dtype == at::kBFloat16 : (dtype == at::kBFloat16 || dtype == at::kHalf);
    const char* valid = cpu ? "bfloat16 (LibTorch 1.13's CPU autocast has no other)" : "bfloat16 or float16";
#endif
    if (!ok)
      throw Error(std::string("memscale::autocast_scope: autocast on ") + (cpu ? "cpu" : "cuda") + " takes " +
                  valid + ", got " + c10::toString(dtype));
  }

  detail::compat::autocast_state previous_;
  bool previous_cache_;
};

/// A chain slot that runs its original (or memscale wrapper) under autocast:
/// with Config::use_mixed_precision the executor puts one in every slot of a
/// chain it manages, so autocast covers the forward of those layers and
/// nothing else: backward, the optimizer step and code outside the chains run
/// as the user wrote them (LibTorch's guidance: autocast the forward and the
/// loss, not backward). Registers nothing, like the other wrappers.
class AutocastSlotImpl : public memscale::detail::wrapper_module, public detail::slot_wrapper {
 public:
  explicit AutocastSlotImpl(torch::nn::AnyModule inner)
      : wrapper_module("memscale::AutocastSlot"), slots_{std::move(inner)} {}

  torch::Tensor forward(torch::Tensor x) {
    // CUDA autocast only for CUDA inputs: a CPU-only LibTorch has no CUDA casts.
    autocast_scope scope(x.defined() && x.is_cuda() ? c10::kCUDA : c10::kCPU);
    auto y = slots_.front().forward<torch::Tensor>(std::move(x));
    detail::fault_point(detail::pipeline_stage::autocast_forward);  // the scope must still close
    return y;
  }

  [[nodiscard]] const std::vector<torch::nn::AnyModule>& slots() const noexcept override { return slots_; }

 private:
  std::vector<torch::nn::AnyModule> slots_;
};

namespace amp {

struct loss_scaler_options {
  double init_scale = 65536.0;   ///< 2^16, as PyTorch's GradScaler
  double growth_factor = 2.0;    ///< after growth_interval steps without inf/NaN
  double backoff_factor = 0.5;   ///< after a step with inf/NaN
  int growth_interval = 2000;
  bool enabled = true;           ///< false: scale() and step() pass through (a bf16 run needs no scaling)
};

/// Dynamic loss scaling for float16 training, for any torch::optim::Optimizer:
/// scale the loss before backward, unscale the gradients before the step, skip
/// the step when any gradient is inf/NaN, then adjust the scale. On CUDA the
/// gradients are checked and unscaled by ATen's fused AMP kernel; on CPU by
/// plain tensor ops (LibTorch 1.13 has the fused kernel for CUDA only).
class loss_scaler {
 public:
  explicit loss_scaler(loss_scaler_options options = {}) : options_(options), scale_(options.init_scale) {
    if (!(options.init_scale > 0.0) || !std::isfinite(options.init_scale))
      throw Error("memscale::amp::loss_scaler: init_scale must be a finite number > 0, got " +
                  std::to_string(options.init_scale));
    if (!(options.growth_factor > 1.0))
      throw Error("memscale::amp::loss_scaler: growth_factor must be > 1, got " +
                  std::to_string(options.growth_factor));
    if (!(options.backoff_factor > 0.0 && options.backoff_factor < 1.0))
      throw Error("memscale::amp::loss_scaler: backoff_factor must be in (0, 1), got " +
                  std::to_string(options.backoff_factor));
    if (options.growth_interval < 1)
      throw Error("memscale::amp::loss_scaler: growth_interval must be >= 1, got " +
                  std::to_string(options.growth_interval));
  }

  /// The loss times the current scale (the loss itself when disabled).
  [[nodiscard]] torch::Tensor scale(const torch::Tensor& loss) const {
    return options_.enabled ? loss * scale_ : loss;
  }

  /// Divides the gradients of `optimizer`'s parameters by the scale, once per
  /// step, and records whether any is inf/NaN. step() calls it when needed;
  /// call it yourself to clip gradients before the step.
  void unscale(torch::optim::Optimizer& optimizer) {
    if (!options_.enabled || unscaled_.count(&optimizer) != 0) return;
    unscaled_.insert(&optimizer);
    const double inverse = 1.0 / scale_;
    // CUDA gradients by device and type: ATen's fused check-and-unscale takes
    // one device's tensors of one type (as torch.amp.GradScaler groups them).
    std::vector<std::vector<torch::Tensor>> cuda_groups;
    for (auto& group : optimizer.param_groups())
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto& g = p.mutable_grad();
        if (g.is_cuda()) {
          auto same = std::find_if(cuda_groups.begin(), cuda_groups.end(), [&](const auto& gs) {
            return gs.front().device() == g.device() && gs.front().scalar_type() == g.scalar_type();
          });
          if (same == cuda_groups.end()) same = cuda_groups.insert(cuda_groups.end(), std::vector<torch::Tensor>{});
          same->push_back(g);
          continue;
        }
        g.mul_(inverse);
        if (!found_inf_ && !torch::isfinite(g).all().item<bool>()) found_inf_ = true;
      }
    for (auto& grads : cuda_groups) {
      auto found = torch::zeros({1}, grads.front().options().dtype(torch::kFloat));
      auto inv = torch::full({1}, inverse, grads.front().options().dtype(torch::kFloat));
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found, inv);
      if (found.item<float>() != 0.0f) found_inf_ = true;
    }
  }

  /// Unscales (if not yet) and runs optimizer.step() unless a gradient was
  /// inf/NaN. Returns whether the step ran.
  bool step(torch::optim::Optimizer& optimizer) {
    if (!options_.enabled) {
      optimizer.step();
      return true;
    }
    unscale(optimizer);
    if (found_inf_) {
      ++skipped_;
      return false;
    }
    optimizer.step();
    return true;
  }

  /// Ends the step: backs the scale off after inf/NaN, grows it after
  /// growth_interval clean steps in a row.
  void update() {
    if (!options_.enabled) return;
    if (found_inf_) {
      scale_ *= options_.backoff_factor;
      clean_steps_ = 0;
    } else if (++clean_steps_ >= options_.growth_interval) {
      const double grown = scale_ * options_.growth_factor;
      if (std::isfinite(grown)) scale_ = grown;
      clean_steps_ = 0;
    }
    found_inf_ = false;
    unscaled_.clear();
  }

  [[nodiscard]] double current_scale() const noexcept { return scale_; }
  [[nodiscard]] bool found_inf() const noexcept { return found_inf_; }
  [[nodiscard]] std::int64_t skipped_steps() const noexcept { return skipped_; }
  [[nodiscard]] const loss_scaler_options& options() const noexcept { return options_; }

 private:
  loss_scaler_options options_;
  double scale_;
  int clean_steps_ = 0;
  bool found_inf_ = false;
  std::int64_t skipped_ = 0;
  std::unordered_set<const torch::optim::Optimizer*> unscaled_;
};

}  // namespace amp

}  // namespace memscale

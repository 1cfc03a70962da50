// memscale::detail — spellings that differ between LibTorch 1.13 and 2.x.
// Internal; see ../shared/LIBTORCH_NOTES.md for what each line papers over.
#pragma once

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#if TORCH_VERSION_MAJOR >= 2
#include <variant>
#else
#include <c10/util/variant.h>
#endif

namespace memscale::detail::compat {

// Module options hold c10::variant in 1.13 and std::variant in 2.x.
#if TORCH_VERSION_MAJOR >= 2
using std::get_if;
using std::holds_alternative;
#else
using c10::get_if;
using c10::holds_alternative;
#endif

/// Autocast switches for CPU and CUDA: LibTorch 2.4 replaced the per-device
/// functions with ones taking a DeviceType (the old ones are deprecated).
struct autocast_state {
  bool cpu = false;
  bool cuda = false;
  at::ScalarType cpu_dtype = at::kBFloat16;
  at::ScalarType cuda_dtype = at::kHalf;
};

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
inline autocast_state current_autocast() {
  return {at::autocast::is_autocast_enabled(at::kCPU), at::autocast::is_autocast_enabled(at::kCUDA),
          at::autocast::get_autocast_dtype(at::kCPU), at::autocast::get_autocast_dtype(at::kCUDA)};
}
inline void set_autocast(const autocast_state& s) {
  at::autocast::set_autocast_enabled(at::kCPU, s.cpu);
  at::autocast::set_autocast_enabled(at::kCUDA, s.cuda);
  at::autocast::set_autocast_dtype(at::kCPU, s.cpu_dtype);
  at::autocast::set_autocast_dtype(at::kCUDA, s.cuda_dtype);
}
#else
inline autocast_state current_autocast() {
  return {at::autocast::is_cpu_enabled(), at::autocast::is_enabled(), at::autocast::get_autocast_cpu_dtype(),
          at::autocast::get_autocast_gpu_dtype()};
}
inline void set_autocast(const autocast_state& s) {
  at::autocast::set_cpu_enabled(s.cpu);
  at::autocast::set_enabled(s.cuda);
  at::autocast::set_autocast_cpu_dtype(s.cpu_dtype);
  at::autocast::set_autocast_gpu_dtype(s.cuda_dtype);
}
#endif

/// Sets an autocast state for a scope and puts the previous one back at its end.
/// Casts are not cached inside it: a recompute runs after optimizer steps may
/// have changed the weights in place, often on an autograd device thread whose
/// cache nothing else ever clears, so a cached cast could be stale.
class autocast_as {
 public:
  explicit autocast_as(const autocast_state& state)
      : previous_(current_autocast()), previous_cache_(at::autocast::is_autocast_cache_enabled()) {
    set_autocast(state);
    at::autocast::set_autocast_cache_enabled(false);
  }
  autocast_as(const autocast_as&) = delete;
  autocast_as& operator=(const autocast_as&) = delete;
  ~autocast_as() {
    at::autocast::set_autocast_cache_enabled(previous_cache_);
    set_autocast(previous_);
  }

 private:
  autocast_state previous_;
  bool previous_cache_;
};

}  // namespace memscale::detail::compat

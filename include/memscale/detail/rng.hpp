// memscale::detail — capture and restore random-number-generator state, so a
// recomputed forward draws the same Dropout masks and profiling draws none that
// training would see. Internal; not part of the public surface.
#pragma once

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace memscale::detail {

struct rng_state {
  std::vector<std::pair<c10::Device, at::Tensor>> generators;
};

inline at::Generator default_generator(c10::Device device) {
  if (device.is_cpu()) return at::detail::getDefaultCPUGenerator();
  return at::globalContext().defaultGenerator(device);
}

/// The non-CPU devices the tensors live on, each once: whose generators to capture.
inline std::vector<c10::Device> devices_of(at::TensorList tensors) {
  std::vector<c10::Device> devices;
  for (const auto& t : tensors)
    if (t.defined() && !t.device().is_cpu() &&
        std::find(devices.begin(), devices.end(), t.device()) == devices.end())
      devices.push_back(t.device());
  return devices;
}

/// The CPU generator's state plus that of each listed non-CPU device.
inline rng_state capture_rng(const std::vector<c10::Device>& devices = {}) {
  rng_state state;
  std::vector<c10::Device> all{c10::Device(c10::kCPU)};
  for (const auto& d : devices)
    if (!d.is_cpu() && std::find(all.begin(), all.end(), d) == all.end()) all.push_back(d);
  for (const auto& d : all) {
    auto gen = default_generator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    state.generators.emplace_back(d, gen.get_state());
  }
  return state;
}

inline void restore_rng(const rng_state& state) {
  for (const auto& [device, saved] : state.generators) {
    auto gen = default_generator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(saved);
  }
}

/// Restores the generators to their state at construction when it ends.
class rng_fork {
 public:
  explicit rng_fork(const std::vector<c10::Device>& devices = {}) : saved_(capture_rng(devices)) {}
  rng_fork(const rng_fork&) = delete;
  rng_fork& operator=(const rng_fork&) = delete;
  ~rng_fork() {
    try {
      restore_rng(saved_);
    } catch (...) {  // never throw from a destructor; the state stays as it is
    }
  }

 private:
  rng_state saved_;
};

}  // namespace memscale::detail

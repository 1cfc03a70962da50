// memscale::detail — how fast this machine computes and moves bytes, measured
// once per process and device: a float matrix product's arithmetic rate and a
// copy's byte rate. They turn an operator's matrix-product flops and the bytes
// it reads and writes into seconds where memscale does not run it for real:
// the profiler's static rules when empirical profiling is off
// (core/slot_measurement.hpp, static_cost) and memscale::predict's shape-only
// execution (predict/shape_only_tally.hpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include <torch/cuda.h>
#include <torch/torch.h>

#include <memscale/detail/buffers.hpp>
#include <memscale/device/scratch_pages.hpp>

namespace memscale::detail {

/// A machine's rates: seconds = flops / flops_per_second + bytes / bytes_per_second.
struct compute_rates {
  double flops_per_second = 0.0;  ///< a float matrix product's
  double bytes_per_second = 0.0;  ///< a copy's, counting the bytes read and those written
  [[nodiscard]] double seconds(double flops, double bytes) const {
    return (flops_per_second > 0.0 ? flops / flops_per_second : 0.0) +
           (bytes_per_second > 0.0 ? bytes / bytes_per_second : 0.0);
  }
};

/// Rates to fall back on where measuring failed (an accelerator out of memory):
/// a nominal figure per device kind, to rank layers against each other.
inline compute_rates nominal_compute_rates(const c10::Device& device) {
  return device.is_cuda() ? compute_rates{5e13, 1e12} : compute_rates{5e10, 1e10};
}

/// Measures the rates on `device` now: a square float matrix product and a
/// copy, each the fastest of nine at the thread count set then (on CPU 256^3
/// and 4 MiB each way, on scratch_pages: a few milliseconds, past a core's L2
/// on usual CPUs; on CUDA 1024^3 and 16 MiB, about 44 MiB in all). Real work
/// even inside memscale::predict's shape-only span (LibTorch 1.x: the Fake key
/// is excluded), without autograd. Its operands are held while it runs (on
/// CUDA through the allocator, on CPU mapped): measure before opening a scope
/// that watches allocations or the resident size. Throws what LibTorch throws
/// (out of memory).
inline compute_rates measure_compute_rates(const c10::Device& device) {
  const computing_guard computing;  // inside predict's shape-only span too
  torch::NoGradGuard no_grad;
  const auto sync = [&device] {
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  };
  const auto fastest = [&sync](const auto& work) {
    double best = 1e300;
    for (int i = 0; i < 9; ++i) {  // fastest of nine: a pool thread descheduled under load costs a run ms (2.x)
      sync();
      const auto start = std::chrono::steady_clock::now();
      work();
      sync();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    return std::max(best, 1e-9);
  };
  const auto options = torch::TensorOptions().dtype(torch::kFloat).device(device);
  // On CPU every operand in one scratch_pages mapping (8.75 MiB in five 2 MiB
  // pages), resident first: in 4 KiB pages their first touches took 30-40 ms
  // of a fresh process's first predict() on the 2-CPU VM, for a millisecond
  // of copying. Not the allocator's: a caller watching it sees none of it.
  const std::int64_t n = device.is_cuda() ? 1024 : 256;
  const std::int64_t copied = device.is_cuda() ? std::int64_t{1} << 22 : std::int64_t{1} << 20;
  std::optional<scratch_pages> pages;
  std::int64_t used = 0;  // floats of `pages` handed out
  if (device.is_cpu()) pages.emplace(static_cast<std::size_t>(3 * n * n + 2 * copied) * sizeof(float));
  const auto buffer = [&](std::int64_t elements, float value) {
    if (!pages) return torch::full({elements}, value, options);
    auto t = torch::from_blob(static_cast<float*>(pages->data()) + used, {elements}, options);
    used += elements;
    return t.fill_(value);
  };
  const auto a = buffer(n * n, 0.5f).view({n, n});
  const auto b = buffer(n * n, 0.25f).view({n, n});
  auto product = buffer(n * n, 0.0f).view({n, n});
  const double gemm = fastest([&] { (void)at::mm_out(product, a, b); });
  // On the 2-core build machine 4 MiB read 30 GB/s against 69 on another,
  // both within L3: a rate to weigh arithmetic against traffic, not a memory
  // bandwidth.
  const auto source = buffer(copied, 1.0f);
  auto target = buffer(copied, 0.0f);
  const double copy = fastest([&] { target.copy_(source); });
  return {2.0 * static_cast<double>(n * n * n) / gemm, 2.0 * static_cast<double>(source.nbytes()) / copy};
}

/// The rates of `device`'s type and index, measured at the first call in the
/// process (measure_compute_rates), the same afterwards; the nominal ones where
/// measuring failed (tried again at the next call). Thread-safe.
inline compute_rates measured_compute_rates(const c10::Device& device) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, compute_rates> measured;
  const std::pair<int, int> key{static_cast<int>(device.type()), device.has_index() ? device.index() : -1};
  std::lock_guard<std::mutex> lock(mutex);
  if (const auto found = measured.find(key); found != measured.end()) return found->second;
  try {
    return measured.emplace(key, measure_compute_rates(device)).first->second;
  } catch (const std::exception&) {
    return nominal_compute_rates(device);
  }
}

}  // namespace memscale::detail

// memscale — what the machine has. GPUs and their memory when
// LibTorch has CUDA, host RAM always; a CPU-only host is a first-class target.
#pragma once

#include <cstdint>
#include <fstream>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <unistd.h>

#include <torch/cuda.h>

#include <memscale/detail/format.hpp>
#include <memscale/device/memory_tracker.hpp>

#if MEMSCALE_HAS_CUDA()
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

namespace memscale {

struct gpu_info {
  int index = 0;
  std::string name;
  std::int64_t total_bytes = 0;
  std::int64_t free_bytes = -1;  ///< -1: not queried (only the current device is)
};

struct HardwareInfo {
  std::int64_t host_total_bytes = 0;
  std::int64_t host_available_bytes = 0;
  int cpu_threads = 0;
  std::vector<gpu_info> gpus;
  /// OpenBLAS's kernel set for this CPU (openblas_get_corename: "Haswell",
  /// "SkylakeX", ...), "" where LibTorch's products do not run on OpenBLAS.
  std::string blas_core;
  /// What blas_advice() says about blas_core on this CPU ("" where nothing).
  std::string blas_warning;

  [[nodiscard]] bool has_gpu() const noexcept { return !gpus.empty(); }
};

/// Advice where OpenBLAS runs its generic x86-64 kernels on a CPU with AVX2 or
/// AVX-512: it picks kernels by CPU model, and an OpenBLAS older than the CPU
/// (Debian 12's 0.3.21 on an Intel model 207, read "Intel(R) Xeon(R) Processor")
/// falls back to "Prescott", SSE3 only. Measured on such a host, the benchmark
/// GPT's step took 896 ms with Prescott's kernels, 423 ms with
/// OPENBLAS_CORETYPE=Cooperlake (benchmarks/RESULTS.md). "" where the core is
/// fine, unknown, or the CPU has neither.
[[nodiscard]] inline std::string blas_advice(const std::string& core, bool avx2, bool avx512) {
  const bool generic = core == "Prescott" || core == "Core2" || core == "Penryn" || core == "Nehalem" ||
                       core == "Dunnington" || core == "Atom";
  if (!generic || !(avx2 || avx512)) return {};
  return "OpenBLAS runs its generic '" + core + "' kernels on this CPU, which has " +
         std::string(avx512 ? "AVX-512" : "AVX2") +
         " (the OpenBLAS build does not know the CPU's model): matrix products run at a fraction of the CPU's "
         "speed, and profiles and plans see them so; set OPENBLAS_CORETYPE=" +
         std::string(avx512 ? "SkylakeX" : "Haswell") + " in the environment before the process starts";
}

namespace detail {

/// /proc/cpuinfo's first "model name", or "unknown".
inline std::string cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line))
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(" \t", colon + 1));
    }
  return "unknown";
}

/// MemAvailable from /proc/meminfo; the physical total where it cannot be read.
inline std::int64_t host_available_bytes(std::int64_t fallback) {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return fallback;
}

}  // namespace detail

/// OpenBLAS's core name when its symbols are in the process, else "".
inline std::string openblas_core() {
  auto* fn = detail::process_symbol<char*()>("openblas_get_corename");
  const char* name = fn != nullptr ? fn() : nullptr;
  return name != nullptr ? std::string(name) : std::string();
}

/// OpenBLAS's thread count when its symbols are in the process, else 0.
inline int openblas_threads() {
  auto* fn = detail::process_symbol<int()>("openblas_get_num_threads");
  return fn != nullptr ? fn() : 0;
}

/// Detects the host and, when LibTorch has CUDA, every visible GPU.
inline HardwareInfo detect_hardware() {
  HardwareInfo info;
  info.blas_core = openblas_core();
#if defined(__x86_64__) || defined(__i386__)
  info.blas_warning = blas_advice(info.blas_core, __builtin_cpu_supports("avx2") != 0,
                                  __builtin_cpu_supports("avx512f") != 0);
#endif
  const auto pages = ::sysconf(_SC_PHYS_PAGES);
  const auto page_size = ::sysconf(_SC_PAGESIZE);
  info.host_total_bytes = (pages > 0 && page_size > 0) ? static_cast<std::int64_t>(pages) * page_size : 0;
  info.host_available_bytes = detail::host_available_bytes(info.host_total_bytes);
  info.cpu_threads = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
#if MEMSCALE_HAS_CUDA()
  if (torch::cuda::is_available()) {
    const auto count = static_cast<int>(torch::cuda::device_count());
    // Free memory only for the current device: asking another one would create a
    // CUDA context (hundreds of MiB) on it.
    int current = 0;
    cudaGetDevice(&current);
    for (int i = 0; i < count; ++i) {
      cudaDeviceProp prop{};
      cudaGetDeviceProperties(&prop, i);
      std::int64_t free_bytes = -1;
      if (i == current) {
        std::size_t free_now = 0, total = 0;
        if (cudaMemGetInfo(&free_now, &total) == cudaSuccess) free_bytes = static_cast<std::int64_t>(free_now);
      }
      info.gpus.push_back({i, prop.name, static_cast<std::int64_t>(prop.totalGlobalMem), free_bytes});
    }
  }
#endif
  return info;
}

/// The memory a plan must fit on `device`: `budget_gb` (Config::memory_budget_gb)
/// when set, else the GPU's total memory, else the host's.
[[nodiscard]] inline std::int64_t memory_budget_bytes(const std::optional<double>& budget_gb, const HardwareInfo& hw,
                                                      c10::Device device) {
  if (budget_gb) return static_cast<std::int64_t>(*budget_gb * 1024.0 * 1024.0 * 1024.0);
  if (device.is_cuda())
    for (const auto& g : hw.gpus)
      if (g.index == (device.has_index() ? device.index() : 0)) return g.total_bytes;
  return hw.host_total_bytes;
}

namespace detail {

/// CUDA: the device memory in use outside the caching allocator now (the CUDA
/// context, cuBLAS's and cuDNN's handles, other processes' memory) on `device`,
/// current or not; 0 elsewhere, where memscale was built without CUDA, or where
/// the runtime cannot answer.
[[nodiscard]] inline std::int64_t memory_outside_caching_allocator([[maybe_unused]] c10::Device device) {
#if MEMSCALE_HAS_CUDA()
  if (!device.is_cuda()) return 0;
  const auto index = cuda_allocator_index(device);
  std::size_t free_now = 0, total = 0;
  {  // cudaMemGetInfo answers for the current device: `device` (whose tensors made its context) while it runs
    const c10::cuda::CUDAGuard on_device(index);
    if (cudaMemGetInfo(&free_now, &total) != cudaSuccess) return 0;
  }
  const auto reserved =
      static_cast<std::int64_t>(c10::cuda::CUDACachingAllocator::getDeviceStats(index).reserved_bytes[0].current);
  return std::max<std::int64_t>(0, static_cast<std::int64_t>(total) - static_cast<std::int64_t>(free_now) - reserved);
#else
  return 0;
#endif
}

}  // namespace detail

inline std::ostream& operator<<(std::ostream& os, const HardwareInfo& hw) {
  os << "host: " << hw.cpu_threads << " CPU threads, " << detail::format_bytes(hw.host_total_bytes)
     << " RAM (" << detail::format_bytes(hw.host_available_bytes) << " available)\n";
  if (!hw.blas_core.empty())
    os << "blas: OpenBLAS, " << hw.blas_core << " kernels"
       << (hw.blas_warning.empty() ? ""
                                   : " (generic for this CPU: set OPENBLAS_CORETYPE; HardwareInfo::blas_warning "
                                     "says which)")
       << "\n";
  if (hw.gpus.empty()) os << "gpus: none (CPU-only host)\n";
  for (const auto& g : hw.gpus)
    os << "gpu " << g.index << ": " << g.name << ", " << detail::format_bytes(g.total_bytes)
       << (g.free_bytes >= 0 ? " (" + detail::format_bytes(g.free_bytes) + " free)" : std::string()) << "\n";
  return os;
}

}  // namespace memscale

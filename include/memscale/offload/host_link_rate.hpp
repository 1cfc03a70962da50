// memscale — the host link's transfer rate as measured on this machine: what
// the planner budgets a CUDA tensor's offload to host memory with, in place of
// a nominal rate (16 GB/s, a PCIe 4 link's pinned copies). Measured links
// differ by more than that figure's own size: an H100's pinned copies of 256
// MiB ran at 55 GB/s each way (2026-11-23), its pageable ones at 9-15, so a
// plan costed at the nominal rate could weigh a transfer there at up to 3.4
// times what it takes, against the recompute it would replace (the sizes a
// plan moves, 1-16 MiB, are not measured there yet). Measured once per process,
// device, transfer size and host memory: to and from pinned memory (the tier
// the engine offloads to first, offload::pinned_pool), as the engine copies,
// and pageable memory, which takes what outgrows the pinned pool.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>
#include <mutex>
#include <optional>
#include <utility>

#include <torch/torch.h>

#include <memscale/device/memory_tracker.hpp>
#include <memscale/offload/disk_rate.hpp>

#if MEMSCALE_HAS_CUDA()
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <sys/mman.h>
#endif

namespace memscale::offload {

/// The host memory a CUDA tensor's offload is copied to: the engine's pinned
/// pool first, then pageable memory (synchronous copies, slower).
enum class host_memory : std::uint8_t { pinned, pageable };

/// How many times this process measured a host link's rate (tests read it).
inline std::atomic<int>& host_link_rate_measurements() {
  static std::atomic<int> count{0};
  return count;
}

#if MEMSCALE_HAS_CUDA()
namespace detail {
/// A device buffer and, for pinned memory, a host buffer of `bytes` for the measurement,
/// taken from the CUDA runtime rather than LibTorch's caching allocators, and
/// freed when it ends: a block left cached there would stay in the device's
/// reserved bytes, which predict() and the memory tracker count as the
/// process's.
struct link_buffers {
  void* device = nullptr;
  void* host = nullptr;
  bool pinned = true;
  link_buffers(std::size_t bytes, host_memory memory) : pinned(memory == host_memory::pinned) {
    if (cudaMalloc(&device, bytes) != cudaSuccess) {
      device = nullptr;
      (void)cudaGetLastError();  // out of memory: the error is this call's, not the next kernel's
      return;
    }
    if (pinned && cudaMallocHost(&host, bytes) != cudaSuccess) {
      host = nullptr;
      (void)cudaGetLastError();
    }
  }
  link_buffers(const link_buffers&) = delete;
  link_buffers& operator=(const link_buffers&) = delete;
  ~link_buffers() {
    if (host != nullptr) (void)cudaFreeHost(host);
    if (device != nullptr) (void)cudaFree(device);
  }
  [[nodiscard]] bool ok() const { return device != nullptr && (host != nullptr || !pinned); }
};

/// Fresh pageable pages for one round: the engine copies each pageable offload
/// into a tensor of its own, whose pages are touched first by that copy. Mapped
/// rather than malloc'd: freeing a mapped malloc block moves glibc's mmap
/// threshold for the whole process (offload/disk_rate.hpp says what that did).
struct fresh_pages {
  void* data = nullptr;
  std::size_t bytes = 0;
  explicit fresh_pages(std::size_t n) : bytes(n) {
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    data = p == MAP_FAILED ? nullptr : p;
  }
  fresh_pages(const fresh_pages&) = delete;
  fresh_pages& operator=(const fresh_pages&) = delete;
  ~fresh_pages() {
    if (data != nullptr) (void)::munmap(data, bytes);
  }
};
}  // namespace detail
#endif

/// One-way bytes per second between `device` (CUDA) and `memory` (the pinned
/// pool's, or pageable memory, which the engine copies to synchronously) for
/// transfers of about `typical_bytes` (rounded up to a power of two within 1-16
/// MiB, as the disk tier's rate is): one copy out and back untimed, then three
/// timed on the device's current stream (cudaMemcpyAsync, which the engine's
/// copies to and from pinned blocks also come to, on side streams when
/// asynchronous), the rate taken from the median, so
/// that 2 * bytes / rate is one copy out and its copy back, as for the disk.
/// The work queued on the stream before is waited for first, outside the timed
/// span. nullopt for a device that is not CUDA, without CUDA in the build, or
/// where a buffer cannot be had (out of memory) or a copy fails; a failure is
/// not remembered. A plan whose offload outgrows the pinned pool
/// (AsyncOffloadConfig::pinned_pool_mb) moves the rest through pageable memory,
/// at a lower rate (an H100: 9-15 GB/s against 55): measured with
/// host_memory::pageable.
[[nodiscard]] inline std::optional<double> measured_host_link_bytes_per_second(
    const c10::Device& device, std::int64_t typical_bytes = disk_rate_max_bytes,
    host_memory memory = host_memory::pinned) {
#if MEMSCALE_HAS_CUDA()
  if (!device.is_cuda()) return std::nullopt;
  static std::mutex mutex;
  static std::map<std::tuple<int, std::int64_t, host_memory>, double> measured;
  const std::lock_guard<std::mutex> lock(mutex);
  const std::int64_t bytes = disk_rate_transfer_bytes(typical_bytes);
  try {
    const auto index = device.has_index() ? device.index() : c10::cuda::current_device();
    const std::tuple<int, std::int64_t, host_memory> key{static_cast<int>(index), bytes, memory};
    if (const auto known = measured.find(key); known != measured.end()) return known->second;
    const c10::cuda::CUDAGuard guard(index);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(index).stream();
    // The work queued before is not the link's. An error it left is the caller's to see: not cleared here.
    if (cudaStreamSynchronize(stream) != cudaSuccess) return std::nullopt;
    const detail::link_buffers buffers(static_cast<std::size_t>(bytes), memory);
    if (!buffers.ok()) return std::nullopt;
    host_link_rate_measurements().fetch_add(1, std::memory_order_relaxed);
    const auto size = static_cast<std::size_t>(bytes);
    const auto rate = median_round_trip_rate(bytes, [&] {
      std::optional<detail::fresh_pages> pageable;
      if (!buffers.pinned) pageable.emplace(size);
      void* host = pageable ? pageable->data : buffers.host;
      return host != nullptr &&
             cudaMemcpyAsync(host, buffers.device, size, cudaMemcpyDeviceToHost, stream) == cudaSuccess &&
             cudaMemcpyAsync(buffers.device, host, size, cudaMemcpyHostToDevice, stream) == cudaSuccess &&
             cudaStreamSynchronize(stream) == cudaSuccess;
    });
    if (!rate) {
      (void)cudaGetLastError();
      return std::nullopt;
    }
    return measured[key] = *rate;
  } catch (const c10::Error&) {  // no such device
    return std::nullopt;
  }
#else
  (void)device;
  (void)typical_bytes;
  (void)memory;
  return std::nullopt;
#endif
}

}  // namespace memscale::offload

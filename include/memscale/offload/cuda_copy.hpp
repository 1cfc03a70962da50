// memscale — asynchronous device<->host copies for the offload engine, on side
// streams ordered by events, so a transfer overlaps the compute stream. Only
// with CUDA (MEMSCALE_WITH_CUDA); the engine copies synchronously otherwise.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include <torch/torch.h>

#include <memscale/device/memory_tracker.hpp>

#if MEMSCALE_HAS_CUDA()
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace memscale::offload::detail {

#if MEMSCALE_HAS_CUDA()

/// A finished-or-pending copy: wait on the host, or make a stream wait.
using cuda_ready = std::shared_ptr<at::cuda::CUDAEvent>;

/// The side stream for one direction on one device (created once, from LibTorch's pool).
inline c10::cuda::CUDAStream side_stream(c10::DeviceIndex device, bool to_host) {
  static std::mutex mutex;
  static std::map<std::pair<int, bool>, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(static_cast<int>(device), to_host);
  auto it = streams.find(key);
  if (it == streams.end())
    it = streams.emplace(key, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device)).first;
  return it->second;
}

/// Copies `src` into `dst` on the side stream of `device_tensor`'s device (one
/// per direction), after `after` (if pending) and after the work the current
/// stream has queued: that work produced `src` (to host), or may still use the
/// block the caching allocator just gave `dst` (to device). The allocator is
/// told that the side stream uses `device_tensor`, so dropping it now is safe.
inline cuda_ready copy_on_side_stream(const at::Tensor& src, at::Tensor& dst, const at::Tensor& device_tensor,
                                      bool to_host, const cuda_ready& after) {
  const auto device = device_tensor.device().index();
  c10::cuda::CUDAGuard guard(device);
  auto side = side_stream(device, to_host);
  if (after) after->block(side);
  at::cuda::CUDAEvent queued;
  queued.record(c10::cuda::getCurrentCUDAStream(device));
  queued.block(side);
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    dst.copy_(src, /*non_blocking=*/true);
  }
  c10::cuda::CUDACachingAllocator::recordStream(device_tensor.storage().data_ptr(), side);
  auto done = std::make_shared<at::cuda::CUDAEvent>();
  done->record(side);
  return done;
}

/// Copies `src` (CUDA) into `dst` (host, pinned for a real overlap) on a side stream.
inline cuda_ready copy_to_host_async(const at::Tensor& src, at::Tensor& dst) {
  return copy_on_side_stream(src, dst, src, /*to_host=*/true, {});
}

/// Copies `src` (host) into `dst` (CUDA, allocated on the current stream) on a
/// side stream, after `after` (the copy that filled `src`, if still pending);
/// the caller makes its stream wait on the result before reading `dst`.
inline cuda_ready copy_to_device_async(const at::Tensor& src, at::Tensor& dst, const cuda_ready& after = {}) {
  return copy_on_side_stream(src, dst, dst, /*to_host=*/false, after);
}

/// Makes the current stream of `device` wait for `ready` (no host blocking).
inline void stream_waits(const cuda_ready& ready, c10::DeviceIndex device) {
  if (ready) ready->block(c10::cuda::getCurrentCUDAStream(device));
}

/// Blocks the host until `ready` completed.
inline void host_waits(const cuda_ready& ready) {
  if (ready) ready->synchronize();
}

#else

/// Without CUDA there is nothing to wait for.
using cuda_ready = std::shared_ptr<void>;
inline void stream_waits(const cuda_ready&, c10::DeviceIndex) {}
inline void host_waits(const cuda_ready&) {}

#endif

}  // namespace memscale::offload::detail

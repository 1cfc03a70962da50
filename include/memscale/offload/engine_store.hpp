// memscale — the offload engine's store side, out of line: store() tries each
// tier in order (engine_placement.hpp places it), store_or_defer() holds small
// tensors back, and flush() gathers them into one staging buffer per device
// (with the memscale::cuda kernel when linked) stored as one tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/offload/cuda_copy.hpp>
#include <memscale/offload/engine_class.hpp>
#include <memscale/offload/engine_placement.hpp>

#if MEMSCALE_HAS_CUDA() && defined(MEMSCALE_WITH_CUDA_KERNELS)
#include <memscale/cuda/kernels.hpp>
#endif

namespace memscale::offload {

inline stored_handle engine::store(const at::Tensor& tensor, std::optional<tier> first) {
  // Without its autograd history: a saved output's grad_fn owns the saved
  // variable that owns this record, and that cycle would keep a graph alive.
  const at::Tensor t = tensor.detach();
  auto rec = std::make_shared<stored_tensor>(core_, t, group_.load());
  const auto order = tiers_for(t.device(), first);
  const auto start = detail::clock::now();
  // The placement functions fill `rec` before an I/O job may see it; after
  // one was queued (async disk write), only local values are read here.
  std::optional<tier> placed;
  for (std::size_t i = 0; i < order.size() && !placed; ++i) {
    bool ok = false;
    try {
      switch (order[i]) {
        case tier::device: ok = keep(*rec, t); break;
        case tier::pinned_host: ok = to_pinned(*rec, t); break;
        case tier::pageable_host: ok = to_pageable(*rec, t); break;
        case tier::disk: ok = to_disk(rec, t); break;
      }
    } catch (const std::exception& e) {
      // Each placement undoes its own reservations before rethrowing; here
      // the failure only moves the tensor on to the next tier.
      core_->warn(std::string("offload to the ") + std::string(to_string(order[i])) + " tier failed (" +
                  e.what() + "); trying the next tier");
    }
    if (ok) placed = order[i];
    if (ok && i > 0) core_->update([](engine_stats& s) { ++s.spills; });
  }
  if (!placed || (*placed == tier::device && order.front() != tier::device))
    core_->warn("the offload tiers are full (or refused): tensors stay on the device, so the step may use more "
                "memory than planned; raise max_cpu_offload_gb or async_config.max_disk_offload_gb");
  if (!placed) {
    keep(*rec, t);
    return rec;
  }
  if (*placed == tier::device) return rec;
  const bool written_by_job = *placed == tier::disk && io_ && !rec->uncomputed_;
  const bool async_copy = *placed == tier::pinned_host && core_->options.async && t.is_cuda();
  if (!written_by_job) {
    const double took = detail::seconds_since(start);
    core_->update([&](engine_stats& s) {
      s.add_written(*placed, rec->layout_.bytes);
      if (!async_copy) {
        s.transfer_seconds += took;
        s.timed_bytes += rec->layout_.bytes;
        s.wait_seconds += took;  // an inline copy is time the forward waited for
      }
    });
  }
  track(rec);
  return rec;
}

inline stored_handle engine::store_or_defer(const at::Tensor& t) {
  const auto bytes = static_cast<std::int64_t>(t.nbytes());
  if (bytes >= core_->options.batch_below_bytes) return store(t);
  auto rec = std::make_shared<stored_tensor>(core_, t, group_.load());
  rec->held_ = t.detach();  // see store()
  rec->pending_batch_ = true;
  rec->aliases_source_ = true;
  std::lock_guard<std::mutex> lock(pending_mutex_);
  pending_.push_back(rec);
  return rec;
}

inline void engine::flush() {
  std::vector<stored_handle> waiting;
  {
    std::lock_guard<std::mutex> lock(pending_mutex_);
    waiting.swap(pending_);
  }
  while (!waiting.empty()) {
    const auto device = waiting.front()->device_;
    std::vector<stored_handle> same, rest;
    for (auto& r : waiting) (r->device_ == device ? same : rest).push_back(std::move(r));
    waiting = std::move(rest);
    try {
      flush_one_device(same);
    } catch (const std::exception& e) {
      core_->warn(std::string("batched offload failed (") + e.what() + "); those tensors stay where they are");
      for (auto& r : same) {
        std::lock_guard<std::mutex> lock(r->mutex_);
        r->pending_batch_ = false;  // held_ keeps the tensor on its device
      }
    }
  }
}

inline void engine::flush_one_device(const std::vector<stored_handle>& waiting) {
  // One modified in place since it was saved is not gathered (its bytes are
  // not the saved ones): it stays, and load() refuses it.
  std::vector<stored_handle> members;
  for (const auto& r : waiting) {
    std::lock_guard<std::mutex> lock(r->mutex_);
    if (r->source_modified())
      r->pending_batch_ = false;
    else
      members.push_back(r);
  }
  if (members.empty()) return;
  std::vector<std::int64_t> offsets;
  std::vector<at::Tensor> sources;
  std::int64_t total = 0;
  for (const auto& r : members) {
    offsets.push_back(total);
    sources.push_back(r->layout_.dense_copy(r->held_));
    total += detail::aligned(r->layout_.bytes);
  }
  at::Tensor staging = at::empty({total}, members.front()->held_.options().dtype(at::kByte));
  if (!gather_with_kernel(members, sources, offsets, staging))
    for (std::size_t i = 0; i < members.size(); ++i)
      staging.narrow(0, offsets[i], members[i]->layout_.bytes)
          .copy_(detail::byte_view(sources[i], members[i]->layout_.bytes));
  auto shared = std::make_shared<detail::batch>();
  shared->blob = store(staging);
  shared->members = static_cast<std::int64_t>(members.size());
  core_->update([&](engine_stats& s) {
    ++s.batches;
    s.batched_tensors += shared->members;
  });
  for (std::size_t i = 0; i < members.size(); ++i) {
    std::lock_guard<std::mutex> lock(members[i]->mutex_);
    members[i]->batch_ = shared;
    members[i]->batch_offset_ = offsets[i];
    members[i]->pending_batch_ = false;
    members[i]->aliases_source_ = false;
    members[i]->held_ = at::Tensor();  // the staging buffer (or its copy) has the bytes now
  }
}

inline bool engine::gather_with_kernel(const std::vector<stored_handle>& members,
                                       const std::vector<at::Tensor>& sources,
                                       const std::vector<std::int64_t>& offsets, at::Tensor& staging) {
#if MEMSCALE_HAS_CUDA() && defined(MEMSCALE_WITH_CUDA_KERNELS)
  if (!staging.is_cuda() || static_cast<int>(members.size()) > memscale::cuda::max_spans_per_launch) return false;
  static_assert(sizeof(memscale_copy_span) == 3 * sizeof(std::int64_t));
  at::Tensor table = at::empty({static_cast<std::int64_t>(members.size()), 3}, at::kLong);
  auto* spans = reinterpret_cast<memscale_copy_span*>(table.data_ptr<std::int64_t>());
  auto* base = static_cast<unsigned char*>(staging.data_ptr());
  for (std::size_t i = 0; i < members.size(); ++i)
    spans[i] = {sources[i].data_ptr(), base + offsets[i], members[i]->layout_.bytes};
  c10::cuda::CUDAGuard on_device_of_staging(staging.device());
  at::Tensor on_device = table.to(staging.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(staging.device().index());
  const auto status = memscale_cuda_batched_copy(
      reinterpret_cast<const memscale_copy_span*>(on_device.data_ptr<std::int64_t>()),
      static_cast<int>(members.size()), stream.stream());
  if (status != cudaSuccess) {
    // A launch error means nothing ran: ATen copies do the gather instead.
    cudaGetLastError();
    core_->warn(std::string("the batched copy kernel could not launch (") + cudaGetErrorString(status) +
                "); gathering with ATen copies");
    return false;
  }
  core_->update([](engine_stats& s) { ++s.kernel_gathers; });
  return true;
#else
  (void)members;
  (void)sources;
  (void)offsets;
  (void)staging;
  return false;
#endif
}

}  // namespace memscale::offload

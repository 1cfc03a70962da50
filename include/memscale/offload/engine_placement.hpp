// memscale — the offload engine's tier placement, out of line: keep() on the
// device, to_pinned(), to_pageable() and to_disk() each take their tier's budget
// or return false so store() spills to the next tier; an async disk write runs
// as an I/O job that keeps the bytes in memory when it fails.
#pragma once

#include <cstddef>
#include <exception>
#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>
#include <utility>

#include <torch/torch.h>

#include <memscale/detail/buffers.hpp>

#include <memscale/offload/cuda_copy.hpp>
#include <memscale/offload/engine_class.hpp>

namespace memscale::offload {

inline bool engine::keep(stored_tensor& rec, const at::Tensor& t) {
  rec.where_ = tier::device;
  rec.held_ = t;
  rec.aliases_source_ = true;
  rec.core_->update([&](engine_stats& s) { ++s.tiers[static_cast<std::size_t>(tier::device)].tensors; });
  return true;
}

inline void engine::copy_to_host(stored_tensor& rec, const at::Tensor& t, at::Tensor& dst, bool pinned) {
#if MEMSCALE_HAS_CUDA()
  if (t.is_cuda() && pinned && core_->options.async) {
    rec.ready_ = detail::copy_to_host_async(t, dst);
    rec.aliases_source_ = true;  // the side stream may copy after a later in-place op on the compute stream
    return;
  }
#endif
  (void)rec;
  (void)pinned;
  dst.copy_(t);
}

inline bool engine::to_pinned(stored_tensor& rec, const at::Tensor& t) {
  const auto bytes = rec.layout_.bytes;
  if (!core_->reserve(tier::pinned_host, bytes)) return false;
  bool failed = false;
  auto block = core_->pool.acquire(bytes, failed);
  if (!block) {
    core_->release(tier::pinned_host, bytes);
    if (failed) {
      core_->update([](engine_stats& s) { ++s.pinned_failures; });
      core_->warn("pinned host memory could not be allocated; offloading to pageable host memory instead");
    }
    return false;
  }
  try {
    // A typed view of the block with the tensor's layout.
    at::Tensor host = at::from_blob(block->data_ptr(), rec.layout_.sizes, rec.layout_.strides,
                                    rec.layout_.options.device(c10::kCPU).pinned_memory(false));
    copy_to_host(rec, t, host, /*pinned=*/true);
    rec.held_ = host;
  } catch (...) {
    core_->pool.release(std::move(*block));
    core_->release(tier::pinned_host, bytes);
    throw;
  }
  rec.pinned_block_ = std::move(block);
  rec.where_ = tier::pinned_host;
  return true;
}

inline bool engine::to_pageable(stored_tensor& rec, const at::Tensor& t) {
  if (!core_->reserve(tier::pageable_host, rec.layout_.bytes)) return false;
  try {
    at::Tensor host = rec.layout_.empty_on(c10::kCPU);
    host.copy_(t);
    rec.held_ = host;
  } catch (...) {
    core_->release(tier::pageable_host, rec.layout_.bytes);
    throw;
  }
  rec.where_ = tier::pageable_host;
  return true;
}

inline at::Tensor engine::dense_host_source(const stored_tensor& rec, const at::Tensor& t) {
  if (t.is_cpu() && rec.layout_.dense) return t;
  at::Tensor host = rec.layout_.empty_on(c10::kCPU);
  host.copy_(t);
  return host;
}

inline bool engine::to_disk(const stored_handle& rec, const at::Tensor& t) {
  std::string ram_backed;
  if (const auto why = core_->disk.prepare(&ram_backed); !why.empty()) {
    core_->update([](engine_stats& s) { ++s.disk_failures; });
    core_->warn("disk offload tier unavailable (" + why + "); tensors stay where they are");
    return false;
  }
  if (!ram_backed.empty()) core_->warn(ram_backed);
  const auto bytes = rec->layout_.bytes;
  if (!core_->reserve(tier::disk, bytes)) return false;
  at::Tensor source;
  try {
    source = dense_host_source(*rec, t);
  } catch (...) {
    core_->release(tier::disk, bytes);
    throw;
  }
  if (memscale::detail::shape_only_dispatch()) {
    // Inside predict's shape-only span the bytes were never computed: nothing
    // is written (no file), nothing will be read, and the source goes where
    // the caller drops it, as a synchronous write leaves it. The engine's
    // stats count the bytes as moved (store() does): what the step would move.
    rec->uncomputed_ = true;
    rec->where_ = tier::disk;
    return true;
  }
  rec->file_ = core_->disk.next_file();
  if (io_) {
    if (const double waited = core_->begin_write(bytes); waited > 0.0)
      core_->update([&](engine_stats& s) { s.wait_seconds += waited; });
    rec->where_ = tier::disk;
    rec->held_ = source;  // alive (and loadable) until written
    rec->writing_ = true;
    rec->aliases_source_ = source.is_alias_of(t);  // read after store() returned
    auto job = [rec, core = core_, source] {
      const auto start = detail::clock::now();
      std::string error;
      try {
        detail::io_job_fault_point();
        error = disk_store::write(rec->file_, source.data_ptr(), rec->layout_.bytes, core->options.disk_write_through);
      } catch (const std::exception& e) {
        error = e.what();
      } catch (...) {
        error = "an unknown exception";
      }
      const double took = detail::seconds_since(start);
      core->end_write(rec->layout_.bytes);
      const detail::notify_at_exit notify{rec->changed_};
      std::lock_guard<std::mutex> lock(rec->mutex_);
      rec->writing_ = false;
      if (error.empty()) {
        rec->held_ = at::Tensor();  // the bytes are on disk: the memory goes
        core->update([&](engine_stats& s) {
          s.add_written(tier::disk, rec->layout_.bytes);
          s.transfer_seconds += took;
          s.timed_bytes += rec->layout_.bytes;
        });
      } else {
        // Nothing is lost: the bytes stay in memory. A CPU tensor is where it
        // was; a CUDA tensor's host copy counts as pageable host memory (over
        // the cap if need be), so load() still brings it back to its device.
        core->release(tier::disk, rec->layout_.bytes);
        rec->where_ = rec->device_.is_cpu() ? tier::device : tier::pageable_host;
        if (rec->where_ != tier::device) core->reserve(rec->where_, rec->layout_.bytes, /*force=*/true);
        std::error_code ignored;
        std::filesystem::remove(rec->file_, ignored);  // in case the failure came after the file
        rec->file_.clear();
        core->update([](engine_stats& s) {
          ++s.disk_failures;
          ++s.tiers[static_cast<std::size_t>(tier::device)].tensors;
        });
        core->warn("disk offload write failed (" + error + "); the tensor stays in memory");
      }
    };
    try {
      io_->submit(std::move(job));
    } catch (...) {
      core_->end_write(bytes);
      core_->release(tier::disk, bytes);
      rec->where_ = tier::device;
      rec->writing_ = false;
      rec->aliases_source_ = false;
      rec->held_ = at::Tensor();
      rec->file_.clear();
      throw;
    }
    return true;
  }
  if (const auto error = disk_store::write(rec->file_, source.data_ptr(), bytes, core_->options.disk_write_through);
      !error.empty()) {
    core_->release(tier::disk, bytes);
    rec->file_.clear();
    core_->update([](engine_stats& s) { ++s.disk_failures; });
    core_->warn("disk offload write failed (" + error + "); the tensor stays where it is");
    return false;
  }
  rec->where_ = tier::disk;
  return true;
}

}  // namespace memscale::offload

// memscale — the offload engine's load side, out of line: load() checks the
// record, serves batch members from their staging buffer, fetches from each
// tier (reading the disk or taking a prefetch) and copies back to the device;
// prefetch_before() queues the next groups' reads ahead of backward.
#pragma once

#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/offload/cuda_copy.hpp>
#include <memscale/offload/engine_class.hpp>

namespace memscale::offload {

inline at::Tensor engine::load(const stored_handle& rec) {
  std::shared_ptr<detail::batch> in_batch;
  {
    std::lock_guard<std::mutex> lock(rec->mutex_);
    rec->check_unmodified();
    if (rec->pending_batch_) {  // not flushed yet: still here
      core_->update([](engine_stats& s) { ++s.served_before_written; });
      return rec->held_;
    }
    in_batch = rec->batch_;
  }
  if (in_batch) return from_batch(*rec, *in_batch);
  at::Tensor out = fetch(*rec);
  prefetch_before(rec->group_);
  return out;
}

inline at::Tensor engine::from_batch(const stored_tensor& rec, detail::batch& b) {
  at::Tensor staging;
  {
    std::lock_guard<std::mutex> lock(b.mutex);
    if (!b.staging.defined()) b.staging = load(b.blob);
    staging = b.staging;
    if (++b.served >= b.members) {
      b.staging = at::Tensor();  // every member has been served once
      b.served = 0;
    }
  }
  at::Tensor out = rec.layout_.empty_on(rec.device_);
  if (rec.layout_.bytes > 0)
    detail::byte_view(out, rec.layout_.bytes).copy_(staging.narrow(0, rec.batch_offset_, rec.layout_.bytes));
  return out;
}

inline at::Tensor engine::read_back(const stored_tensor& rec, bool through) {
  at::Tensor host = rec.layout_.empty_on(c10::kCPU);
  if (rec.uncomputed_) return host;  // nothing was written (stored_tensor::uncomputed_)
  if (const auto error = disk_store::read(rec.file_, host.data_ptr(), rec.layout_.bytes, through); !error.empty())
    TORCH_CHECK(false, "memscale: an offloaded tensor could not be read back from disk (", error,
                "); was the offload directory removed while training?");
  return host;
}

inline at::Tensor engine::fetch(stored_tensor& rec) {
  std::unique_lock<std::mutex> lock(rec.mutex_);
  at::Tensor host;
  switch (rec.where_) {
    case tier::device: return rec.held_;
    case tier::pinned_host:
    case tier::pageable_host:
#if MEMSCALE_HAS_CUDA()
      if (rec.prefetched_.defined() && rec.device_.is_cuda()) {
        // Already copied back on the side stream ahead of backward: only order it.
        at::Tensor out = std::move(rec.prefetched_);
        rec.prefetched_ = at::Tensor();
        detail::stream_waits(rec.prefetch_ready_, rec.device_.index());
        core_->update([](engine_stats& s) { ++s.prefetch_hits; });
        return out;
      }
#endif
      host = rec.held_;
      break;
    case tier::disk: {
      if (rec.writing_) {
        host = rec.held_;  // still in memory
        core_->update([](engine_stats& s) { ++s.served_before_written; });
      } else if (rec.prefetched_.defined() || rec.reading_) {
        const auto start = detail::clock::now();
        rec.changed_.wait(lock, [&] { return !rec.reading_; });
        const double waited = detail::seconds_since(start);
        host = std::move(rec.prefetched_);
        rec.prefetched_ = at::Tensor();
        core_->update([&](engine_stats& s) {
          ++s.prefetch_hits;
          s.wait_seconds += waited;
        });
      }
      if (!host.defined()) {
        const auto start = detail::clock::now();
        host = read_back(rec, core_->options.disk_write_through);
        const double took = detail::seconds_since(start);
        core_->update([&](engine_stats& s) {
          ++s.prefetch_misses;
          s.wait_seconds += took;
          s.transfer_seconds += took;
          s.timed_bytes += rec.layout_.bytes;
          s.add_read(tier::disk, rec.layout_.bytes);
        });
      }
      break;
    }
  }
  if (rec.device_.is_cpu()) return host;
  return to_device(rec, host);
}

inline at::Tensor engine::to_device(stored_tensor& rec, const at::Tensor& host) {
  at::Tensor out = rec.layout_.empty_on(rec.device_);
#if MEMSCALE_HAS_CUDA()
  if (rec.device_.is_cuda() && core_->options.async && rec.where_ == tier::pinned_host) {
    auto done = detail::copy_to_device_async(host, out, rec.ready_);  // after the offload copy
    detail::stream_waits(done, rec.device_.index());
    rec.last_read_ = done;
    core_->update([&](engine_stats& s) { s.add_read(tier::pinned_host, rec.layout_.bytes); });
    return out;
  }
  detail::host_waits(rec.ready_);
#endif
  const auto start = detail::clock::now();
  out.copy_(host);
  const double took = detail::seconds_since(start);
  core_->update([&](engine_stats& s) {
    s.wait_seconds += took;
    s.transfer_seconds += took;
    s.timed_bytes += rec.layout_.bytes;
    // From disk, fetch() counted the read already; this is its host-to-device copy.
    if (rec.where_ != tier::disk) s.add_read(rec.where_, rec.layout_.bytes);
  });
  return out;
}

inline void engine::prefetch_before(int group) {
  const bool device_prefetch = MEMSCALE_HAS_CUDA() && core_->options.async;
  if (!io_ && !device_prefetch) return;
  std::vector<stored_handle> wanted;
  {
    std::lock_guard<std::mutex> lock(groups_mutex_);
    for (auto it = groups_.lower_bound(group - core_->options.prefetch_depth); it != groups_.end() && it->first < group;
         ++it)
      for (auto& w : it->second)
        if (auto r = w.lock()) wanted.push_back(std::move(r));
  }
  for (auto& rec : wanted) {
    {
      std::lock_guard<std::mutex> lock(rec->mutex_);
#if MEMSCALE_HAS_CUDA()
      // Pinned host -> device: an async copy on the side stream, now.
      if (device_prefetch && rec->where_ == tier::pinned_host && rec->device_.is_cuda() &&
          !rec->prefetched_.defined()) {
        at::Tensor out = rec->layout_.empty_on(rec->device_);
        rec->prefetch_ready_ = detail::copy_to_device_async(rec->held_, out, rec->ready_);
        rec->last_read_ = rec->prefetch_ready_;
        rec->prefetched_ = out;
        core_->update([&](engine_stats& s) { s.add_read(tier::pinned_host, rec->layout_.bytes); });
        continue;
      }
#endif
      if (!io_ || rec->where_ != tier::disk || rec->writing_ || rec->reading_ || rec->prefetched_.defined())
        continue;
      rec->reading_ = true;
    }
    auto job = [rec, core = core_] {
      const auto start = detail::clock::now();
      at::Tensor host;
      std::string error;
      try {
        detail::io_job_fault_point();
        host = read_back(*rec, core->options.disk_write_through);
      } catch (const std::exception& e) {
        error = e.what();  // load() reads again inline and reports it there
      } catch (...) {
        error = "an unknown exception";
      }
      const double took = detail::seconds_since(start);
      {
        const detail::notify_at_exit notify{rec->changed_};
        std::lock_guard<std::mutex> lock(rec->mutex_);
        rec->prefetched_ = host;
        rec->reading_ = false;
      }
      if (!error.empty()) {
        core->warn("a disk prefetch failed (" + error + "); backward reads the tensor when it needs it");
        return;
      }
      core->update([&](engine_stats& s) {
        s.transfer_seconds += took;
        s.timed_bytes += rec->layout_.bytes;
        s.add_read(tier::disk, rec->layout_.bytes);
      });
    };
    try {
      io_->submit(std::move(job));
    } catch (const std::exception& e) {
      {
        const detail::notify_at_exit notify{rec->changed_};
        std::lock_guard<std::mutex> lock(rec->mutex_);
        rec->reading_ = false;  // nobody will read it ahead: load() reads it inline
      }
      core_->warn(std::string("a disk prefetch could not be queued (") + e.what() + ")");
      return;
    }
  }
}

}  // namespace memscale::offload

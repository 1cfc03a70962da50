// memscale — the offload engine's class: construction, statistics, groups,
// wait_idle(), and the declarations of its store, load and placement members.
// Their bodies are out of line: engine_store.hpp (store, defer and flush into
// batches), engine_placement.hpp (each tier's placement, spilling to the next,
// the async disk write), engine_load.hpp (load, fetch, prefetch).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include <torch/torch.h>

#include <memscale/offload/engine_core.hpp>
#include <memscale/offload/engine_options.hpp>
#include <memscale/offload/io_pool.hpp>
#include <memscale/offload/stored_tensor.hpp>
#include <memscale/offload/tiers.hpp>

namespace memscale::offload {

class engine {
 public:
  explicit engine(engine_options options = {})
      : core_(std::make_shared<detail::engine_core>(options)),
        io_(options.async ? std::make_unique<io_pool>(options.io_threads) : nullptr) {}
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;
  ~engine() { io_.reset(); }  // finishes queued writes and reads first

  [[nodiscard]] const engine_options& options() const noexcept { return core_->options; }
  [[nodiscard]] engine_stats stats() const { return core_->snapshot(); }
  /// The disk tier's directory (empty until first used, or when it could not be created).
  [[nodiscard]] std::filesystem::path disk_directory() const { return core_->disk.directory(); }

  /// Tiers a tensor on `device` can go to, in order, starting at `first` when given.
  [[nodiscard]] static std::vector<tier> tiers_for(const c10::Device& device, std::optional<tier> first) {
    std::vector<tier> order;
    if (first) {
      for (int t = static_cast<int>(*first); t < tier_count; ++t) order.push_back(static_cast<tier>(t));
      return order;
    }
    if (device.is_cpu()) return {tier::disk};  // host memory is where it already is
    return {tier::pinned_host, tier::pageable_host, tier::disk};
  }

  /// Moves `t` to the first tier with room (or `first` and after). Never throws
  /// for lack of room or an I/O failure: the tensor then stays where it is.
  stored_handle store(const at::Tensor& tensor, std::optional<tier> first = {});

  /// The tensor `rec` holds, on its own device, with its dtype, sizes and (dense) strides.
  at::Tensor load(const stored_handle& rec);

  /// Like store(), but a tensor below batch_below_bytes waits for flush(), which
  /// sends all waiting tensors in one staging buffer (one transfer).
  stored_handle store_or_defer(const at::Tensor& t);

  /// Gathers the deferred tensors (per device) into staging buffers and stores
  /// each buffer as one tensor. CUDA tensors are gathered by one memscale::cuda
  /// kernel launch when that target is linked, by ATen copies otherwise. On any
  /// failure the deferred tensors simply stay where they are.
  void flush();

  /// Saved tensors stored between begin_group() calls form a group (one wrapped
  /// layer's forward); backward prefetches groups in reverse order.
  void begin_group() {
    ++group_;
    std::lock_guard<std::mutex> lock(groups_mutex_);
    for (auto it = groups_.begin(); it != groups_.end();) {
      const bool alive = std::any_of(it->second.begin(), it->second.end(), [](const auto& w) { return !w.expired(); });
      it = alive ? std::next(it) : groups_.erase(it);
    }
  }

  /// Blocks until every queued disk write and prefetch finished (tests,
  /// benchmarks). Rethrows what an I/O job let escape (the engine's own jobs
  /// fall back instead: a failed write keeps the tensor in memory).
  void wait_idle() {
    if (io_) io_->wait();
    std::vector<stored_handle> alive;
    {
      std::lock_guard<std::mutex> lock(groups_mutex_);
      for (auto& [g, members] : groups_)
        for (auto& w : members)
          if (auto r = w.lock()) alive.push_back(std::move(r));
    }
    for (auto& r : alive) {
      std::unique_lock<std::mutex> lock(r->mutex_);
      r->changed_.wait(lock, [&] { return !r->writing_ && !r->reading_; });
    }
  }

 private:
  void flush_one_device(const std::vector<stored_handle>& waiting);

  /// One launch of memscale_cuda_batched_copy for CUDA members, when linked.
  bool gather_with_kernel(const std::vector<stored_handle>& members, const std::vector<at::Tensor>& sources,
                          const std::vector<std::int64_t>& offsets, at::Tensor& staging);

  /// A batch member: the staging buffer comes back once (one transfer), each
  /// member is copied out of it, and the buffer goes when the last one was.
  at::Tensor from_batch(const stored_tensor& rec, detail::batch& b);

  static bool keep(stored_tensor& rec, const at::Tensor& t);

  /// The host copy of `t` in `dst`: asynchronous from CUDA when async, else synchronous.
  void copy_to_host(stored_tensor& rec, const at::Tensor& t, at::Tensor& dst, bool pinned);

  bool to_pinned(stored_tensor& rec, const at::Tensor& t);

  bool to_pageable(stored_tensor& rec, const at::Tensor& t);

  /// The bytes to write: `t` itself when it is a dense CPU tensor, else a dense host copy.
  static at::Tensor dense_host_source(const stored_tensor& rec, const at::Tensor& t);

  bool to_disk(const stored_handle& rec, const at::Tensor& t);

  /// Reads `rec`'s file into a new host tensor of its layout (`through`: disk_store::read's).
  static at::Tensor read_back(const stored_tensor& rec, bool through);

  /// The host tensor (or the device tensor) `rec` holds, without moving it back yet.
  at::Tensor fetch(stored_tensor& rec);

  /// Brings a host copy back to `rec`'s device; the current stream waits for it.
  at::Tensor to_device(stored_tensor& rec, const at::Tensor& host);

  void track(const stored_handle& rec) {
    std::lock_guard<std::mutex> lock(groups_mutex_);
    groups_[rec->group_].push_back(rec);
  }

  /// Queues reads of the disk-tier tensors of the `prefetch_depth` groups before `group`.
  void prefetch_before(int group);

  std::shared_ptr<detail::engine_core> core_;
  std::atomic<int> group_{0};
  std::mutex groups_mutex_;
  std::map<int, std::vector<std::weak_ptr<stored_tensor>>> groups_;
  std::mutex pending_mutex_;
  std::vector<stored_handle> pending_;  // deferred small tensors of the open group
  std::unique_ptr<io_pool> io_;  // last: destroyed first, after its queue drained
};

}  // namespace memscale::offload

// memscale — the tier-aware offload engine. store() moves a tensor to the first
// tier with room (CUDA tensors: pinned host, pageable host, disk; CPU tensors:
// disk), load() brings it back bit-identical on its own device. A full or
// failing tier spills to the next; when none is left the tensor stays where it
// is, so a step never fails for want of offload room.
//
// With async (Config::async_offload), device->host copies run on side streams
// ordered by events, disk writes and reads on a small I/O pool, and load()
// prefetches the groups (wrapped layers) that backward needs next. Without it
// every copy is synchronous.
//
// In-place checks: autograd does not check hooked saved tensors, so a record
// remembers the version of the tensor it was given, and load() refuses one
// whose bytes it still read from that tensor's memory (kept, waiting for its
// batch, written to disk asynchronously) after that tensor was modified in place.
//
// Ownership: hooks own the engine, records (stored_tensor) own only the shared
// core (budgets, statistics, pinned pool, disk directory). I/O jobs own records
// and the core, never the engine, so the engine (and its I/O pool) is never
// destroyed on one of its own threads. The disk directory goes with the core.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/config.hpp>
#include <memscale/core/hardware.hpp>
#include <memscale/offload/cuda_copy.hpp>
#include <memscale/offload/io_pool.hpp>
#include <memscale/offload/tiers.hpp>

#if MEMSCALE_HAS_CUDA() && defined(MEMSCALE_WITH_CUDA_KERNELS)
#include <memscale/cuda/kernels.hpp>
#endif

namespace memscale::offload {

/// What the engine may use. options_from(Config) fills it from the user's Config.
struct engine_options {
  std::int64_t min_bytes = 64 * 1024;           ///< smaller saved tensors stay where they are
  std::int64_t batch_below_bytes = 1 << 20;     ///< smaller ones travel together: one transfer per group
  std::int64_t pinned_bytes = 256LL << 20;      ///< pinned pool capacity
  std::optional<std::int64_t> host_bytes{};     ///< pinned + pageable together; unset: no cap
  std::optional<std::int64_t> disk_bytes{};     ///< unset: as much as the file system takes
  std::optional<std::string> disk_dir{};        ///< parent of the disk tier's directory; unset: disk_parent_candidates
  bool async = false;
  int io_threads = 2;
  int prefetch_depth = 2;                       ///< groups fetched ahead of backward
  std::int64_t max_inflight_bytes = 256LL << 20;  ///< async: bytes queued for writing before store() waits
  bool log_warnings = true;                     ///< also print each distinct warning once to stderr
};

inline std::int64_t physical_host_bytes() {
  const auto pages = ::sysconf(_SC_PHYS_PAGES);
  const auto page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::int64_t>(pages) * page : 0;
}

/// The engine settings a Config asks for. Host tiers: max_cpu_offload_gb, or
/// half the host's available RAM when unset; disk: max_disk_offload_gb, or half
/// the free space of its directory. The planner budgets with the same caps.
inline engine_options options_from(const Config& config) {
  constexpr double gib = 1024.0 * 1024.0 * 1024.0;
  const AsyncOffloadConfig async = config.async_config.value_or(AsyncOffloadConfig{});
  engine_options o;
  o.min_bytes = static_cast<std::int64_t>(async.min_offload_kb * 1024.0);
  o.batch_below_bytes = static_cast<std::int64_t>(async.batch_below_kb * 1024.0);
  o.pinned_bytes = static_cast<std::int64_t>(async.pinned_pool_mb * 1024.0 * 1024.0);
  o.host_bytes = config.max_cpu_offload_gb ? static_cast<std::int64_t>(*config.max_cpu_offload_gb * gib)
                                           : memscale::detail::host_available_bytes(physical_host_bytes()) / 2;
  if (async.max_disk_offload_gb) {
    o.disk_bytes = static_cast<std::int64_t>(*async.max_disk_offload_gb * gib);
  } else {
    o.disk_bytes = 0;  // no directory to measure: the disk tier takes nothing
    for (const auto& dir : disk_parent_candidates(async.disk_dir)) {  // the disk tier's own choice
      std::error_code ec;
      const auto space = std::filesystem::space(dir, ec);
      if (ec) continue;
      o.disk_bytes = static_cast<std::int64_t>(space.available / 2);
      break;
    }
  }
  o.disk_dir = async.disk_dir;
  o.async = config.async_offload;
  o.io_threads = async.io_threads;
  o.prefetch_depth = async.prefetch_depth;
  o.max_inflight_bytes = o.pinned_bytes;  // the staging memory the engine may hold, pinned or queued
  o.log_warnings = config.enable_logging;
  return o;
}

struct tier_usage {
  std::int64_t bytes = 0;    ///< held now
  std::int64_t peak = 0;     ///< most ever held at once
  std::int64_t tensors = 0;  ///< tensors ever placed here
};

struct engine_stats {
  std::array<tier_usage, tier_count> tiers{};  ///< indexed by tier; device: kept for lack of room
  std::int64_t spills = 0;                     ///< tensors that went past their first tier
  std::int64_t pinned_failures = 0;            ///< pinned allocations that failed (-> pageable)
  std::int64_t disk_failures = 0;              ///< disk directory or writes that failed (-> stays)
  std::int64_t bytes_written = 0;              ///< to host tiers and disk
  std::int64_t bytes_read = 0;
  double transfer_seconds = 0.0;               ///< time spent copying, in jobs or inline
  double wait_seconds = 0.0;                   ///< time store()/load() blocked on a copy
  std::int64_t prefetch_hits = 0;              ///< loads served by a prefetch
  std::int64_t prefetch_misses = 0;            ///< loads that had to read inline
  std::int64_t batches = 0;                    ///< staging buffers that carried small tensors together
  std::int64_t batched_tensors = 0;            ///< tensors that travelled in one
  std::int64_t kernel_gathers = 0;             ///< batches gathered by the memscale::cuda kernel
  std::vector<std::string> warnings;           ///< each distinct warning once

  [[nodiscard]] const tier_usage& at(tier t) const { return tiers[static_cast<std::size_t>(t)]; }
  /// Share of the transfer time nobody waited for (1 when nothing was transferred).
  [[nodiscard]] double hidden_fraction() const {
    if (transfer_seconds <= 0.0) return 1.0;
    return std::clamp(1.0 - wait_seconds / transfer_seconds, 0.0, 1.0);
  }
};

namespace detail {

using clock = std::chrono::steady_clock;
inline double seconds_since(clock::time_point start) {
  return std::chrono::duration<double>(clock::now() - start).count();
}

/// What records share with the engine: budgets, statistics, the pinned pool and
/// the disk directory. Outlives the engine while records remain.
class engine_core {
 public:
  explicit engine_core(const engine_options& o) : options(o), pool(o.pinned_bytes), disk(o.disk_dir) {}

  /// Takes `bytes` of tier `t`'s budget; false when it has no room (unless forced).
  bool reserve(tier t, std::int64_t bytes, bool force = false) {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool host = t == tier::pinned_host || t == tier::pageable_host;
    if (!force && host && options.host_bytes && host_used_ + bytes > *options.host_bytes) return false;
    if (!force && t == tier::disk && options.disk_bytes &&
        stats_.at(tier::disk).bytes + bytes > *options.disk_bytes)
      return false;
    if (host) host_used_ += bytes;
    auto& u = stats_.tiers[static_cast<std::size_t>(t)];
    u.bytes += bytes;
    u.peak = std::max(u.peak, u.bytes);
    ++u.tensors;
    return true;
  }

  void release(tier t, std::int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (t == tier::pinned_host || t == tier::pageable_host) host_used_ -= bytes;
    stats_.tiers[static_cast<std::size_t>(t)].bytes -= bytes;
  }

  /// Records a warning once (and prints it once when logging is on).
  void warn(const std::string& message) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (std::find(stats_.warnings.begin(), stats_.warnings.end(), message) != stats_.warnings.end()) return;
    stats_.warnings.push_back(message);
    if (options.log_warnings) std::clog << "[memscale] warning: " << message << "\n";
  }

  /// Backpressure for async writes: waits while `bytes` more would exceed
  /// max_inflight_bytes (one write always proceeds); returns the seconds waited.
  double begin_write(std::int64_t bytes) {
    const auto start = clock::now();
    std::unique_lock<std::mutex> lock(inflight_mutex_);
    drained_.wait(lock, [&] { return inflight_ == 0 || inflight_ + bytes <= options.max_inflight_bytes; });
    inflight_ += bytes;
    return seconds_since(start);
  }
  void end_write(std::int64_t bytes) {
    {
      std::lock_guard<std::mutex> lock(inflight_mutex_);
      inflight_ -= bytes;
    }
    drained_.notify_all();
  }

  template <class F>
  void update(F&& f) {
    std::lock_guard<std::mutex> lock(mutex_);
    f(stats_);
  }

  [[nodiscard]] engine_stats snapshot() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  const engine_options options;
  pinned_pool pool;
  disk_store disk;

 private:
  mutable std::mutex mutex_;
  engine_stats stats_;
  std::int64_t host_used_ = 0;
  std::mutex inflight_mutex_;
  std::condition_variable drained_;
  std::int64_t inflight_ = 0;
};

}  // namespace detail

class stored_tensor;

namespace detail {
/// Small tensors of one group, gathered into one staging buffer that is stored
/// (one transfer) as `blob`; each member knows its offset in it.
struct batch {
  std::shared_ptr<stored_tensor> blob;
  std::int64_t members = 0;
  std::mutex mutex;
  at::Tensor staging;  // the blob back on its device while members are being loaded
  std::int64_t served = 0;
};

/// Offsets in a staging buffer keep every member 64-byte aligned.
constexpr std::int64_t staging_alignment = 64;
constexpr std::int64_t aligned(std::int64_t bytes) {
  return (bytes + staging_alignment - 1) / staging_alignment * staging_alignment;
}

/// The bytes of a dense tensor as a flat uint8 tensor on its device (no copy).
inline at::Tensor byte_view(const at::Tensor& dense, std::int64_t bytes) {
  return at::from_blob(dense.data_ptr(), {bytes}, dense.options().dtype(at::kByte));
}

/// Autograd's own words for a saved tensor modified in place since it was saved.
inline std::string modified_in_place(const tensor_layout& layout, std::uint32_t current, std::uint32_t expected) {
  return c10::str("one of the variables needed for gradient computation has been modified by an inplace operation: [",
                  c10::toString(layout.options.backend()), c10::toString(layout.options.dtype().toScalarType()),
                  "Type ", c10::IntArrayRef(layout.sizes), "] is at version ", current, "; expected version ", expected,
                  " instead.");
}

/// A test seam: the engine's I/O jobs throw from inside when a test asks.
inline void io_job_fault_point() {
  if (memscale::detail::offload_fault_injected(memscale::detail::offload_fault::io_job_throws))
    throw std::runtime_error("I/O job failure injected by a test");
}

/// Wakes the waiters of a record on every way out of an I/O job (after its lock is released).
struct notify_at_exit {
  std::condition_variable& changed;
  ~notify_at_exit() { changed.notify_all(); }
};
}  // namespace detail

/// One tensor in the engine's care. Destroying it frees its tier (budget, pinned
/// block, file). Thread-safe: loads may come from autograd worker threads.
class stored_tensor {
 public:
  stored_tensor(std::shared_ptr<detail::engine_core> core, const at::Tensor& t, int group)
      : core_(std::move(core)),
        layout_(detail::tensor_layout::of(t)),
        device_(t.device()),
        group_(group),
        source_version_(torch::autograd::impl::version_counter(t)),
        saved_version_(source_version_.enabled() ? source_version_.current_version() : 0) {}
  stored_tensor(const stored_tensor&) = delete;
  stored_tensor& operator=(const stored_tensor&) = delete;
  ~stored_tensor() {
    if (where_ != tier::device) core_->release(where_, layout_.bytes);
    if (pinned_block_) {
      // Copies on side streams may still read or write the block: another
      // record (another device's stream) must not get it before they finish.
      detail::host_waits(ready_);
      detail::host_waits(last_read_);
      core_->pool.release(std::move(*pinned_block_));
    }
    if (!file_.empty()) {
      std::error_code ignored;
      std::filesystem::remove(file_, ignored);
    }
  }

  [[nodiscard]] tier where() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return batch_ ? batch_->blob->where() : where_;
  }
  /// Whether it travelled inside a batch's staging buffer.
  [[nodiscard]] bool batched() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return batch_ != nullptr;
  }
  [[nodiscard]] std::int64_t bytes() const noexcept { return layout_.bytes; }
  [[nodiscard]] int group() const noexcept { return group_; }
  [[nodiscard]] c10::Device device() const noexcept { return device_; }
  /// Dtype, sizes and (dense) strides of the tensor it holds.
  [[nodiscard]] const detail::tensor_layout& layout() const noexcept { return layout_; }

 private:
  friend class engine;

  /// Whether the tensor given to store() was modified in place since (false
  /// when it has no version counter: an inference tensor).
  [[nodiscard]] bool source_modified() const {
    return source_version_.enabled() && source_version_.current_version() != saved_version_;
  }

  /// Refuses to return bytes read from a tensor modified since it was stored. Under mutex_.
  void check_unmodified() const {
    if (!aliases_source_ || !source_modified()) return;
    const auto current = source_version_.current_version();
    TORCH_CHECK(false, "memscale: ", detail::modified_in_place(layout_, current, saved_version_),
                " The offload engine was still reading that tensor's own memory (it was kept, waiting for its "
                "batch, or being written to disk), so it would return the modified values; make that operation "
                "out of place.");
  }

  std::shared_ptr<detail::engine_core> core_;
  detail::tensor_layout layout_;
  c10::Device device_;
  int group_;
  c10::VariableVersion source_version_;  // shares the version counter of the tensor given to store()
  std::uint32_t saved_version_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  tier where_ = tier::device;
  at::Tensor held_;                      // device: the tensor; host tiers: the copy; disk: the source while writing
  std::optional<at::Tensor> pinned_block_;
  detail::cuda_ready ready_;             // the device->host copy into held_ (async CUDA)
  detail::cuda_ready last_read_;         // the latest host->device copy out of held_ (async CUDA)
  detail::cuda_ready prefetch_ready_;    // the host->device copy into prefetched_ (pinned tier)
  std::filesystem::path file_;
  bool writing_ = false;
  bool reading_ = false;
  at::Tensor prefetched_;
  bool pending_batch_ = false;           // deferred: waits in held_ for the group's flush
  std::shared_ptr<detail::batch> batch_;
  std::int64_t batch_offset_ = 0;
  bool aliases_source_ = false;          // what load() returns is (or was read from) the source's memory
};

using stored_handle = std::shared_ptr<stored_tensor>;

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
  stored_handle store(const at::Tensor& tensor, std::optional<tier> first = {}) {
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
    if (!placed) {
      keep(*rec, t);
      return rec;
    }
    if (*placed == tier::device) return rec;
    const bool written_by_job = *placed == tier::disk && io_;
    const bool async_copy = *placed == tier::pinned_host && core_->options.async && t.is_cuda();
    if (!written_by_job) {
      const double took = detail::seconds_since(start);
      core_->update([&](engine_stats& s) {
        s.bytes_written += rec->layout_.bytes;
        if (!async_copy) {
          s.transfer_seconds += took;
          s.wait_seconds += took;  // an inline copy is time the forward waited for
        }
      });
    }
    track(rec);
    return rec;
  }

  /// The tensor `rec` holds, on its own device, with its dtype, sizes and (dense) strides.
  at::Tensor load(const stored_handle& rec) {
    std::shared_ptr<detail::batch> in_batch;
    {
      std::lock_guard<std::mutex> lock(rec->mutex_);
      rec->check_unmodified();
      if (rec->pending_batch_) return rec->held_;  // not flushed yet: still here
      in_batch = rec->batch_;
    }
    if (in_batch) return from_batch(*rec, *in_batch);
    at::Tensor out = fetch(*rec);
    prefetch_before(rec->group_);
    return out;
  }

  /// Like store(), but a tensor below batch_below_bytes waits for flush(), which
  /// sends all waiting tensors in one staging buffer (one transfer).
  stored_handle store_or_defer(const at::Tensor& t) {
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

  /// Gathers the deferred tensors (per device) into staging buffers and stores
  /// each buffer as one tensor. CUDA tensors are gathered by one memscale::cuda
  /// kernel launch when that target is linked, by ATen copies otherwise. On any
  /// failure the deferred tensors simply stay where they are.
  void flush() {
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
  void flush_one_device(const std::vector<stored_handle>& waiting) {
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
      sources.push_back(r->layout_.dense ? r->held_ : r->held_.contiguous());
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

  /// One launch of memscale_cuda_batched_copy for CUDA members, when linked.
  bool gather_with_kernel(const std::vector<stored_handle>& members, const std::vector<at::Tensor>& sources,
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

  /// A batch member: the staging buffer comes back once (one transfer), each
  /// member is copied out of it, and the buffer goes when the last one was.
  at::Tensor from_batch(const stored_tensor& rec, detail::batch& b) {
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

  static bool keep(stored_tensor& rec, const at::Tensor& t) {
    rec.where_ = tier::device;
    rec.held_ = t;
    rec.aliases_source_ = true;
    rec.core_->update([&](engine_stats& s) { ++s.tiers[static_cast<std::size_t>(tier::device)].tensors; });
    return true;
  }

  /// The host copy of `t` in `dst`: asynchronous from CUDA when async, else synchronous.
  void copy_to_host(stored_tensor& rec, const at::Tensor& t, at::Tensor& dst, bool pinned) {
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

  bool to_pinned(stored_tensor& rec, const at::Tensor& t) {
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

  bool to_pageable(stored_tensor& rec, const at::Tensor& t) {
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

  /// The bytes to write: `t` itself when it is a dense CPU tensor, else a dense host copy.
  static at::Tensor dense_host_source(const stored_tensor& rec, const at::Tensor& t) {
    if (t.is_cpu() && rec.layout_.dense) return t;
    at::Tensor host = rec.layout_.empty_on(c10::kCPU);
    host.copy_(t);
    return host;
  }

  bool to_disk(const stored_handle& rec, const at::Tensor& t) {
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
          error = disk_store::write(rec->file_, source.data_ptr(), rec->layout_.bytes);
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
            s.bytes_written += rec->layout_.bytes;
            s.transfer_seconds += took;
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
    if (const auto error = disk_store::write(rec->file_, source.data_ptr(), bytes); !error.empty()) {
      core_->release(tier::disk, bytes);
      rec->file_.clear();
      core_->update([](engine_stats& s) { ++s.disk_failures; });
      core_->warn("disk offload write failed (" + error + "); the tensor stays where it is");
      return false;
    }
    rec->where_ = tier::disk;
    return true;
  }

  /// Reads `rec`'s file into a new host tensor of its layout.
  static at::Tensor read_back(const stored_tensor& rec) {
    at::Tensor host = rec.layout_.empty_on(c10::kCPU);
    if (const auto error = disk_store::read(rec.file_, host.data_ptr(), rec.layout_.bytes); !error.empty())
      TORCH_CHECK(false, "memscale: an offloaded tensor could not be read back from disk (", error,
                  "); was the offload directory removed while training?");
    return host;
  }

  /// The host tensor (or the device tensor) `rec` holds, without moving it back yet.
  at::Tensor fetch(stored_tensor& rec) {
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
          host = read_back(rec);
          const double took = detail::seconds_since(start);
          core_->update([&](engine_stats& s) {
            ++s.prefetch_misses;
            s.wait_seconds += took;
            s.transfer_seconds += took;
            s.bytes_read += rec.layout_.bytes;
          });
        }
        break;
      }
    }
    if (rec.device_.is_cpu()) return host;
    return to_device(rec, host);
  }

  /// Brings a host copy back to `rec`'s device; the current stream waits for it.
  at::Tensor to_device(stored_tensor& rec, const at::Tensor& host) {
    at::Tensor out = rec.layout_.empty_on(rec.device_);
#if MEMSCALE_HAS_CUDA()
    if (rec.device_.is_cuda() && core_->options.async && rec.where_ == tier::pinned_host) {
      auto done = detail::copy_to_device_async(host, out, rec.ready_);  // after the offload copy
      detail::stream_waits(done, rec.device_.index());
      rec.last_read_ = done;
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
      s.bytes_read += rec.layout_.bytes;
    });
    return out;
  }

  void track(const stored_handle& rec) {
    std::lock_guard<std::mutex> lock(groups_mutex_);
    groups_[rec->group_].push_back(rec);
  }

  /// Queues reads of the disk-tier tensors of the `prefetch_depth` groups before `group`.
  void prefetch_before(int group) {
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
          host = read_back(*rec);
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
          s.bytes_read += rec->layout_.bytes;
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

  std::shared_ptr<detail::engine_core> core_;
  std::atomic<int> group_{0};
  std::mutex groups_mutex_;
  std::map<int, std::vector<std::weak_ptr<stored_tensor>>> groups_;
  std::mutex pending_mutex_;
  std::vector<stored_handle> pending_;  // deferred small tensors of the open group
  std::unique_ptr<io_pool> io_;  // last: destroyed first, after its queue drained
};

}  // namespace memscale::offload

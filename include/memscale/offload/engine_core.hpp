// memscale — internal: the offload engine's shared state (detail::engine_core):
// tier budgets, statistics and warnings, the pinned pool, the disk directory and
// the backpressure on async writes. The engine and every record (stored_tensor)
// and I/O job share it, so it outlives the engine while records remain.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include <memscale/offload/engine_options.hpp>
#include <memscale/offload/tiers.hpp>

namespace memscale::offload {

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
    options.log.warn(message);
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

}  // namespace memscale::offload

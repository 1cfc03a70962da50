// memscale — what the offload engine may use and what it reports: engine_options
// (filled from the user's Config by options_from, with the host and disk caps the
// planner budgets with too) and engine_stats (per-tier usage, spills, failures,
// transfer and wait time, prefetch and batching counts, warnings).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include <unistd.h>

#include <memscale/config.hpp>
#include <memscale/observability/log.hpp>
#include <memscale/device/hardware.hpp>
#include <memscale/offload/tiers.hpp>

namespace memscale::offload {

/// What the engine may use. options_from(Config) fills it from the user's Config.
struct engine_options {
  std::int64_t min_bytes = 64 * 1024;           ///< smaller saved tensors stay where they are
  std::int64_t batch_below_bytes = 1 << 20;     ///< smaller ones travel together: one transfer per group
  std::int64_t pinned_bytes = 256LL << 20;      ///< pinned pool capacity
  std::optional<std::int64_t> host_bytes{};     ///< pinned + pageable together; unset: no cap
  std::optional<std::int64_t> disk_bytes{};     ///< unset: as much as the file system takes
  std::optional<std::string> disk_dir{};        ///< parent of the disk tier's directory; unset: disk_parent_candidates
  bool disk_write_through = true;               ///< AsyncOffloadConfig::disk_write_through
  bool async = false;
  int io_threads = 2;
  int prefetch_depth = 2;                       ///< groups fetched ahead of backward
  std::int64_t max_inflight_bytes = 256LL << 20;  ///< async: bytes queued for writing before store() waits
  /// Where each distinct warning is also logged once (at warn): the "memscale"
  /// logger; an attachment lends its wrap's channel (enable_logging, log_file).
  observability::log_channel log = observability::log_channel::process();
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
  o.disk_write_through = async.disk_write_through;
  o.async = config.async_offload;
  o.io_threads = async.io_threads;
  o.prefetch_depth = async.prefetch_depth;
  o.max_inflight_bytes = o.pinned_bytes;  // the staging memory the engine may hold, pinned or queued
  return o;
}

struct tier_usage {
  std::int64_t bytes = 0;    ///< held now
  std::int64_t peak = 0;     ///< most ever held at once
  std::int64_t tensors = 0;  ///< tensors ever placed here
  std::int64_t written = 0;  ///< bytes ever copied here (offload)
  std::int64_t read = 0;     ///< bytes ever copied back from here
};

struct engine_stats {
  std::array<tier_usage, tier_count> tiers{};  ///< indexed by tier; device: kept for lack of room
  std::int64_t spills = 0;                     ///< tensors that went past their first tier
  std::int64_t pinned_failures = 0;            ///< pinned allocations that failed (-> pageable)
  std::int64_t disk_failures = 0;              ///< disk directory or writes that failed (-> stays)
  std::int64_t bytes_written = 0;              ///< to host tiers and disk
  std::int64_t bytes_read = 0;
  double transfer_seconds = 0.0;               ///< time spent copying, in jobs or inline
  /// The bytes those timed copies moved: a CUDA tensor's asynchronous copies to and from pinned memory run on
  /// side streams, untimed, so timed_bytes / transfer_seconds is the rate the timed copies ran at.
  std::int64_t timed_bytes = 0;
  double wait_seconds = 0.0;                   ///< time store()/load() blocked on a copy
  std::int64_t prefetch_hits = 0;              ///< loads served by a prefetch
  std::int64_t prefetch_misses = 0;            ///< loads that had to read inline
  /// Loads served from memory because the tensor had not left yet (its write,
  /// or its small-tensor batch, was still in flight): nothing read back. With
  /// async_offload a short step's backward can reach a tensor before its write ends.
  std::int64_t served_before_written = 0;
  std::int64_t batches = 0;                    ///< staging buffers that carried small tensors together
  std::int64_t batched_tensors = 0;            ///< tensors that travelled in one
  std::int64_t kernel_gathers = 0;             ///< batches gathered by the memscale::cuda kernel
  std::vector<std::string> warnings;           ///< each distinct warning once

  [[nodiscard]] const tier_usage& at(tier t) const { return tiers[static_cast<std::size_t>(t)]; }
  /// Counts a copy to tier `t` (in the totals and the tier's own).
  void add_written(tier t, std::int64_t bytes) {
    bytes_written += bytes;
    tiers[static_cast<std::size_t>(t)].written += bytes;
  }
  /// Counts a copy back from tier `t`.
  void add_read(tier t, std::int64_t bytes) {
    bytes_read += bytes;
    tiers[static_cast<std::size_t>(t)].read += bytes;
  }
  /// The rate the timed copies ran at, one way (0 when none was timed).
  [[nodiscard]] double timed_bytes_per_second() const {
    return transfer_seconds > 0.0 && timed_bytes > 0 ? static_cast<double>(timed_bytes) / transfer_seconds : 0.0;
  }
  /// Whether some copies went untimed (a GPU's asynchronous copies to and from pinned memory).
  [[nodiscard]] bool some_untimed() const { return timed_bytes < bytes_written + bytes_read; }
  /// Share of the transfer time nobody waited for (1 when nothing was transferred).
  [[nodiscard]] double hidden_fraction() const {
    if (transfer_seconds <= 0.0) return 1.0;
    return std::clamp(1.0 - wait_seconds / transfer_seconds, 0.0, 1.0);
  }
};

}  // namespace memscale::offload

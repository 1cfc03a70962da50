// memscale — the disk tier's transfer rate as measured on this machine: what
// the planner budgets a disk offload's write and read with, in place of a
// nominal rate (a local SSD's 1 GB/s; this 2-core VM wrote through at about a
// third of it). Measured once per process for each directory, setting and
// transfer size: at the size of the tensors a plan would move, since each
// transfer is a file of its own, created, written, synced and read, and a
// small one moves fewer bytes a second (a 2-CPU VM on 2026-12-03, written
// through: about 1,000 MB/s one way for 16 MiB, 650-750 for 1 MiB).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include <unistd.h>

#include <memscale/device/scratch_pages.hpp>
#include <memscale/offload/tiers.hpp>

namespace memscale::offload {

/// How many times this process measured a disk tier's rate (tests read it).
inline std::atomic<int>& disk_rate_measurements() {
  static std::atomic<int> count{0};
  return count;
}

/// The transfer sizes measured: a power of two from 1 to 16 MiB.
inline constexpr std::int64_t disk_rate_min_bytes = std::int64_t{1} << 20;
inline constexpr std::int64_t disk_rate_max_bytes = std::int64_t{16} << 20;
[[nodiscard]] constexpr std::int64_t disk_rate_transfer_bytes(std::int64_t typical) {
  std::int64_t bytes = disk_rate_min_bytes;
  while (bytes < typical && bytes < disk_rate_max_bytes) bytes *= 2;
  return bytes;
}

/// One-way bytes per second of a tier's round trip of `bytes` (out and back,
/// `round_trip()` returning false on a failure): one run untimed, then three
/// timed, the rate taken from the median, so that 2 * bytes / rate is one copy
/// out and its copy back. nullopt where a run failed or took no time.
template <class RoundTrip>
[[nodiscard]] std::optional<double> median_round_trip_rate(std::int64_t bytes, RoundTrip&& round_trip) {
  bool ok = round_trip();  // the first: untimed
  std::array<double, 3> took{};
  for (auto& seconds : took) {
    const auto start = std::chrono::steady_clock::now();
    ok = ok && round_trip();
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  std::sort(took.begin(), took.end());
  if (!ok || took[1] <= 0.0) return std::nullopt;
  return 2.0 * static_cast<double>(bytes) / took[1];
}

/// One-way bytes per second of the disk tier under `parent` (where disk_store would put its directory;
/// AsyncOffloadConfig::disk_dir) for transfers of about `typical_bytes` (rounded up to a power of two within 1-16
/// MiB): one such transfer written and read back as the tier does (`through`:
/// AsyncOffloadConfig::disk_write_through) untimed, then three timed, the rate taken from the median (a VM's disk
/// has slow stretches: the same GPT's probe read 380-760 MB/s in four processes), so that 2 * bytes / rate is one
/// write and its read. The untimed one because a process's first write to a new file often takes several times a
/// later one's: measured on the 2-CPU VM of 2026-12-03, 16 MiB written through in 60-65 ms first, 11-14 ms after,
/// read in 17-22 ms either way. Timed alone, that first transfer read 237-580 MB/s in five of six fresh processes
/// where the next one read 720-1,100, and a GPT's projected offload wait came out 1.7 times the measured (49.6 ms a
/// step against 29.6). nullopt where no file can be written there; a failure is not remembered (an injected test
/// fault, a full disk freed since).
[[nodiscard]] inline std::optional<double> measured_disk_bytes_per_second(
    const std::optional<std::string>& parent, bool through, std::int64_t typical_bytes = disk_rate_max_bytes) {
  static std::mutex mutex;
  static std::map<std::tuple<std::string, bool, std::int64_t>, double> measured;
  const std::lock_guard<std::mutex> lock(mutex);
  const std::int64_t bytes = disk_rate_transfer_bytes(typical_bytes);
  for (const auto& dir : disk_parent_candidates(parent)) {
    const std::tuple<std::string, bool, std::int64_t> key{dir.string(), through, bytes};
    if (const auto known = measured.find(key); known != measured.end()) return known->second;
    // Mapped, not malloc'd: glibc raises its mmap threshold to the size of
    // the largest mapped block a program frees (up to 32 MiB), and from then
    // on keeps freed blocks under it in its heaps: freeing a 16 MiB vector
    // changes how the user's process holds memory. Measured before a
    // predict() of the example GPT at batch 16, the vector moved its predicted
    // peak from 162.4 to 157.8 MiB; mapped, 161.2 MiB.
    // In 2 MiB pages where the kernel gives them (scratch_pages): in 4 KiB ones
    // their 4096 first touches took about 45 ms on the 2-CPU VM of 2026-11-30,
    // outside the timed span but inside the caller's first plan.
    std::optional<memscale::detail::scratch_pages> mapped;
    try {
      mapped.emplace(static_cast<std::size_t>(bytes));
    } catch (const std::bad_alloc&) {
      return std::nullopt;
    }
    auto* data = static_cast<char*>(mapped->data());
    for (std::int64_t i = 0; i < bytes; ++i) data[i] = static_cast<char>(i * 131 + 7);  // not all zeros
    const auto file = dir / ("memscale-disk-rate-" + std::to_string(::getpid()) + ".bin");
    disk_rate_measurements().fetch_add(1, std::memory_order_relaxed);
    const auto rate = median_round_trip_rate(bytes, [&] {
      return disk_store::write(file, data, bytes, through).empty() &&
             disk_store::read(file, data, bytes, through).empty();
    });
    mapped.reset();
    std::error_code ignored;
    std::filesystem::remove(file, ignored);
    if (!rate) continue;  // the next directory the tier would try
    return measured[key] = *rate;
  }
  return std::nullopt;
}

}  // namespace memscale::offload

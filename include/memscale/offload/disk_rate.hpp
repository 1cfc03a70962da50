// memscale — the disk tier's transfer rate as measured on this machine: what
// the planner budgets a disk offload's write and read with, in place of a
// nominal rate (a local SSD's 1 GB/s; this 2-core VM wrote through at about a
// third of it). Measured once per process for each directory and setting.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
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

/// One-way bytes per second of the disk tier under `parent` (where disk_store
/// would put its directory; AsyncOffloadConfig::disk_dir): 16 MiB written and
/// read back as the tier does (`through`: AsyncOffloadConfig::disk_write_through),
/// so that 2 * bytes / rate is one write and its read. nullopt where no file
/// can be written there; a failure is not remembered (an injected test fault,
/// a full disk freed since).
[[nodiscard]] inline std::optional<double> measured_disk_bytes_per_second(const std::optional<std::string>& parent,
                                                                          bool through) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, bool>, double> measured;
  const std::lock_guard<std::mutex> lock(mutex);
  for (const auto& dir : disk_parent_candidates(parent)) {
    const std::pair<std::string, bool> key{dir.string(), through};
    if (const auto known = measured.find(key); known != measured.end()) return known->second;
    constexpr std::int64_t bytes = std::int64_t{16} << 20;
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
    const auto start = std::chrono::steady_clock::now();
    const bool ok =
        disk_store::write(file, data, bytes, through).empty() && disk_store::read(file, data, bytes, through).empty();
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    mapped.reset();
    std::error_code ignored;
    std::filesystem::remove(file, ignored);
    if (!ok || took.count() <= 0.0) continue;  // the next directory the tier would try
    return measured[key] = 2.0 * static_cast<double>(bytes) / took.count();
  }
  return std::nullopt;
}

}  // namespace memscale::offload

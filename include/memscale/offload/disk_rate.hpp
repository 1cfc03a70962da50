// memscale — the disk tier's transfer rate as measured on this machine: what
// the planner budgets a disk offload's write and read with, in place of a
// nominal rate (a local SSD's 1 GB/s; this 2-core VM wrote through at about a
// third of it). Measured once per process for each directory and setting.
#pragma once

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

#include <memscale/offload/tiers.hpp>

namespace memscale::offload {

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
    std::vector<char> data(static_cast<std::size_t>(bytes));
    for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 131 + 7);  // not all zeros
    const auto file = dir / ("memscale-disk-rate-" + std::to_string(::getpid()) + ".bin");
    const auto start = std::chrono::steady_clock::now();
    const bool ok = disk_store::write(file, data.data(), bytes, through).empty() &&
                    disk_store::read(file, data.data(), bytes, through).empty();
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    std::error_code ignored;
    std::filesystem::remove(file, ignored);
    if (!ok || took.count() <= 0.0) continue;  // the next directory the tier would try
    return measured[key] = 2.0 * static_cast<double>(bytes) / took.count();
  }
  return std::nullopt;
}

}  // namespace memscale::offload

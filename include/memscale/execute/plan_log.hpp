// memscale — logging: one summary per plan (hardware, pressure, what was applied)
// to stderr, and the full report to Config::log_file when set.
#pragma once

#include <fstream>
#include <iostream>
#include <string>

#include <memscale/config.hpp>
#include <memscale/core/plan.hpp>

namespace memscale::observability {

inline std::string summary_line(const Report& r) {
  std::string line = "[memscale] mode " + std::string(to_string(r.mode)) + ", device " + r.device;
  if (!r.planned) return line + ": planning deferred to the first forward call";
  return line + ": pressure " + std::to_string(r.memory_pressure()).substr(0, 5) + ", " +
         std::to_string(r.checkpointed_segments()) + " checkpointed segment(s), " +
         std::to_string(r.offloaded_units()) + " offloaded unit(s), projected peak " +
         detail::format_bytes(r.baseline_peak_bytes()) + " -> " + detail::format_bytes(r.planned_peak_bytes());
}

/// Logs a report as the Config asks; never throws (logging must not fail a wrap).
inline void log_report(const Config& config, const Report& r) noexcept {
  if (!config.enable_logging) return;
  try {
    std::clog << summary_line(r) << "\n";
    if (config.log_file) {
      std::ofstream out(*config.log_file, std::ios::app);
      if (out) out << r << "\n";
      else std::clog << "[memscale] cannot write log_file " << *config.log_file << "\n";
    }
  } catch (...) {
  }
}

}  // namespace memscale::observability

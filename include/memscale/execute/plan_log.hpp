// memscale — what a plan logs (observability/log.hpp has the channel): at info,
// one line (hardware, mode, pressure, projected and planned peak, techniques);
// at debug, the whole Report, line by line.
#pragma once

#include <sstream>
#include <string>

#include <memscale/core/plan.hpp>
#include <memscale/observability/log.hpp>

namespace memscale::observability {

/// "a GPU name, 80 GiB" or "CPU, 16 threads, 62 GiB RAM": the device the plan is for.
inline std::string hardware_line(const Report& r) {
  for (const auto& g : r.hardware.gpus)
    if (r.device.rfind("cuda", 0) == 0 && (r.device == "cuda" || r.device == "cuda:" + std::to_string(g.index)))
      return g.name + ", " + detail::format_bytes(g.total_bytes);
  return "CPU, " + std::to_string(r.hardware.cpu_threads) + " threads, " +
         detail::format_bytes(r.hardware.host_total_bytes) + " RAM";
}

inline std::string summary_line(const Report& r) {
  std::string line = "mode " + std::string(to_string(r.mode)) + ", device " + r.device + " (" + hardware_line(r) + ")";
  if (!r.planned) return line + ": planning deferred to the first forward call";
  std::ostringstream os;
  os << line << ": pressure " << std::fixed;
  os.precision(2);
  os << r.memory_pressure() << ", projected peak " << detail::format_bytes(r.baseline_peak_bytes()) << " -> planned "
     << detail::format_bytes(r.planned_peak_bytes()) << "; " << r.checkpointed_segments()
     << " checkpointed segment(s) (" << r.tiled_segments() << " tiled), " << r.offloaded_units()
     << " offloaded unit(s)";
  if (r.strategy.decision_source != DecisionSource::user_config)
    os << "; Stage 1: " << to_string(r.strategy.decision_source);
  return os.str();
}

/// Logs a plan: the summary at info, the whole Report at debug. Never throws.
inline void log_report(const log_channel& log, const Report& r) noexcept {
  try {
    log.info(summary_line(r));
    if (log.wants(spdlog::level::debug)) {
      std::istringstream lines(r.str());
      for (std::string line; std::getline(lines, line);) log.debug(line);
    }
  } catch (...) {
  }
}

}  // namespace memscale::observability

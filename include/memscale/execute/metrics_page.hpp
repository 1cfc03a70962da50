// memscale — what the metrics endpoint serves for a wrapped model: its plan
// (planned and baseline peak, budget, units per technique), the memory the
// device holds as measured now and at its peak, the offload engine's traffic
// by direction and tier, and the process's training steps, their period and
// the recompute time (observability/metrics.hpp), in the Prometheus text format.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include <torch/torch.h>
#include <torch/version.h>

#include <memscale/core/plan.hpp>
#include <memscale/device/memory_tracker.hpp>
#include <memscale/device/process_memory.hpp>
#include <memscale/observability/metrics.hpp>
#include <memscale/offload/engine_options.hpp>
#include <memscale/offload/tiers.hpp>
#include <memscale/version.hpp>

namespace memscale::observability {

namespace page_detail {

/// "pinned host" -> "pinned_host": a label value as Prometheus users write them.
inline std::string tier_label(offload::tier t) {
  std::string s(offload::to_string(t));
  for (auto& c : s)
    if (c == ' ') c = '_';
  return s;
}

/// Measured memory of `device` now and at its peak, by kind: CUDA, the caching
/// allocator's allocated and reserved bytes; CPU, the process's resident bytes
/// (VmRSS, VmHWM), and the counting allocator's bytes where it is installed.
inline void memory_samples(exposition& out, const std::string& device, bool peak) {
  const auto device_of = [&](const char* kind) { return exposition::labels{{"device", device}, {"kind", kind}}; };
  const c10::Device d(device);
  if (d.is_cpu()) {
    if (const auto m = memscale::detail::read_process_memory())
      out.sample(peak ? "memscale_memory_peak_bytes" : "memscale_memory_bytes", device_of("process_resident"),
                 static_cast<double>(peak ? m->peak_bytes : m->resident_bytes));
    if (memory_tracker::installed())
      out.sample(peak ? "memscale_memory_peak_bytes" : "memscale_memory_bytes", device_of("allocated"),
                 static_cast<double>(peak ? memory_tracker::peak_bytes(d) : memory_tracker::current_bytes(d)));
    return;
  }
#if MEMSCALE_HAS_CUDA()
  if (d.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d.has_index() ? d.index()
                                                                                     : c10::cuda::current_device());
    const auto& allocated = stats.allocated_bytes[0];
    const auto& reserved = stats.reserved_bytes[0];
    const char* name = peak ? "memscale_memory_peak_bytes" : "memscale_memory_bytes";
    out.sample(name, device_of("allocated"), static_cast<double>(peak ? allocated.peak : allocated.current));
    out.sample(name, device_of("reserved"), static_cast<double>(peak ? reserved.peak : reserved.current));
  }
#endif
}

}  // namespace page_detail

/// The allocator's peak on `device` so far (CUDA; CPU with the counting
/// allocator installed) and, on CPU, the process's resident peak; -1 where unknown.
inline std::pair<std::int64_t, std::int64_t> measured_peaks(const std::string& device) noexcept {
  std::pair<std::int64_t, std::int64_t> peaks{-1, -1};
  try {
    const c10::Device d(device);
    if (d.is_cpu()) {
      if (memory_tracker::installed()) peaks.first = memory_tracker::peak_bytes(d);
      if (const auto m = memscale::detail::read_process_memory()) peaks.second = m->peak_bytes;
    } else if (d.is_cuda()) {
      peaks.first = memory_tracker::peak_bytes(d);
    }
  } catch (...) {
  }
  return peaks;
}

/// The page for one wrapped model (its Report as a live attachment gives it: offload traffic included).
inline std::string metrics_page(const Report& r) {
  exposition out;
  const exposition::labels device{{"device", r.device}};

  out.family("memscale_build_info", "gauge", "memscale and LibTorch versions (always 1)");
  out.sample("memscale_build_info", {{"version", version_string}, {"libtorch", TORCH_VERSION}}, 1);

  out.family("memscale_planned_peak_bytes", "gauge", "Projected peak of a training step with memscale's plan");
  out.sample("memscale_planned_peak_bytes", device, static_cast<double>(r.planned_peak_bytes()));
  out.family("memscale_baseline_peak_bytes", "gauge", "Projected peak of a training step without memscale");
  out.sample("memscale_baseline_peak_bytes", device, static_cast<double>(r.baseline_peak_bytes()));
  out.family("memscale_usable_bytes", "gauge", "The budget the plan keeps to: memory budget x target utilization");
  out.sample("memscale_usable_bytes", device, static_cast<double>(r.usable_bytes));

  out.family("memscale_memory_bytes", "gauge", "Memory measured now, by kind (allocated, reserved, process_resident)");
  try {
    page_detail::memory_samples(out, r.device, /*peak=*/false);
  } catch (...) {
  }
  out.family("memscale_memory_peak_bytes", "gauge",
             "Memory measured at its peak so far, by kind (allocated, reserved, process_resident)");
  try {
    page_detail::memory_samples(out, r.device, /*peak=*/true);
  } catch (...) {
  }

  out.family("memscale_plan_units", "gauge", "Units of the plan by technique (checkpoint, tile, offload)");
  out.sample("memscale_plan_units", {{"device", r.device}, {"technique", "checkpoint"}}, r.checkpointed_segments());
  out.sample("memscale_plan_units", {{"device", r.device}, {"technique", "tile"}}, r.tiled_segments());
  out.sample("memscale_plan_units", {{"device", r.device}, {"technique", "offload"}}, r.offloaded_units());
  out.family("memscale_plan_recompute_seconds", "gauge", "Projected recompute time the plan adds to a step");
  out.sample("memscale_plan_recompute_seconds", device, r.recompute_seconds());

  const auto& c = counters();
  out.family("memscale_training_steps_total", "counter",
             "Training steps (top-level backward passes) this process ran");
  out.sample("memscale_training_steps_total", {}, static_cast<double>(c.steps()));
  out.family("memscale_step_seconds", "histogram", "Time from one training step's backward start to the next");
  out.histogram_samples("memscale_step_seconds", {}, c.step_seconds());
  out.family("memscale_recomputes_total", "counter", "Forwards of checkpointed or tiled units run again in backward");
  out.sample("memscale_recomputes_total", {}, static_cast<double>(c.recomputes()));
  out.family("memscale_recompute_seconds_total", "counter", "Time spent running those forwards again");
  out.sample("memscale_recompute_seconds_total", {}, c.recompute_seconds());

  const offload::engine_stats s = r.offload.value_or(offload::engine_stats{});
  constexpr offload::tier tiers[] = {offload::tier::pinned_host, offload::tier::pageable_host, offload::tier::disk};
  out.family("memscale_offload_bytes_total", "counter",
             "Bytes the offload engine copied out to a tier (direction out) and back (direction in)");
  for (const auto t : tiers) {
    out.sample("memscale_offload_bytes_total", {{"direction", "out"}, {"tier", page_detail::tier_label(t)}},
               static_cast<double>(s.at(t).written));
    out.sample("memscale_offload_bytes_total", {{"direction", "in"}, {"tier", page_detail::tier_label(t)}},
               static_cast<double>(s.at(t).read));
  }
  out.family("memscale_offload_held_bytes", "gauge", "Bytes the offload engine holds in each tier now");
  for (const auto t : tiers)
    out.sample("memscale_offload_held_bytes", {{"tier", page_detail::tier_label(t)}}, static_cast<double>(s.at(t).bytes));
  out.family("memscale_offload_transfer_seconds_total", "counter", "Time the offload engine spent copying");
  out.sample("memscale_offload_transfer_seconds_total", {}, s.transfer_seconds);
  out.family("memscale_offload_wait_seconds_total", "counter", "Time training waited on offload copies");
  out.sample("memscale_offload_wait_seconds_total", {}, s.wait_seconds);
  return out.str();
}

}  // namespace memscale::observability

// memscale::detail — test seams: make one pipeline stage throw (wrap's stages,
// each technique's forward and backward, offload writes and reads, detach), to
// show that a failing wrap() leaves the model exactly as it was and a failing
// step leaves nothing behind (tests/test_faults.cpp); and make one offload-tier
// operation fail (pinned allocation, disk directory, disk space, an I/O job or
// thread), to show that the offload engine degrades without losing a tensor
// and that its I/O pool never terminates the process; and plant a wrong
// technique, for verify_correctness to catch. Internal; process-wide.
#pragma once

#include <atomic>
#include <string>

#include <memscale/errors.hpp>

namespace memscale::detail {

enum class pipeline_stage : int {
  none,
  capture,
  profile,
  plan,
  apply,
  commit,
  reserve,              // the allocation before a slot swap
  checkpoint_forward,   // a checkpointed segment's forward, after its body ran
  checkpoint_backward,  // its recompute in backward, after the body ran again
  tile_forward,         // a tiled segment's forward, after its chunks ran
  tile_backward,        // its chunked backward, after a chunk's recompute
  offload_write,        // the pack hook, after the engine stored the tensor
  offload_read,         // the unpack hook, after the engine loaded it back
  autocast_forward,     // a mixed-precision slot's forward, inside its autocast scope
  optimizer_step,       // AdamW8bit::step, after the first parameter's update
  detach                // detach(), before it unregisters the model
};

inline const char* stage_name(pipeline_stage s) {
  switch (s) {
    case pipeline_stage::none: return "none";
    case pipeline_stage::capture: return "capture";
    case pipeline_stage::profile: return "profile";
    case pipeline_stage::plan: return "plan";
    case pipeline_stage::apply: return "apply";
    case pipeline_stage::commit: return "commit";
    case pipeline_stage::reserve: return "reserve";
    case pipeline_stage::checkpoint_forward: return "checkpoint forward";
    case pipeline_stage::checkpoint_backward: return "checkpoint backward";
    case pipeline_stage::tile_forward: return "tile forward";
    case pipeline_stage::tile_backward: return "tile backward";
    case pipeline_stage::offload_write: return "offload write";
    case pipeline_stage::offload_read: return "offload read";
    case pipeline_stage::autocast_forward: return "autocast forward";
    case pipeline_stage::optimizer_step: return "optimizer step";
    case pipeline_stage::detach: return "detach";
  }
  return "?";
}

inline std::atomic<int>& injected_fault() {
  static std::atomic<int> stage{0};
  return stage;
}

/// Times the injected stage is passed before it throws.
inline std::atomic<int>& injected_fault_passes() {
  static std::atomic<int> passes{0};
  return passes;
}

/// Throws when a test injected a fault at this stage (after its passes).
inline void fault_point(pipeline_stage s) {
  if (injected_fault().load() == static_cast<int>(s) && injected_fault_passes().fetch_sub(1) <= 0)
    throw Error(std::string("memscale: fault injected at stage '") + stage_name(s) + "'");
}

/// Offload-tier operations a test can make fail. io_job_throws: the engine's
/// disk write and prefetch jobs throw from inside; thread_start_fails: an I/O
/// pool cannot start its second thread.
enum class offload_fault : int { none, pinned_alloc, disk_unwritable, disk_full, io_job_throws, thread_start_fails };

inline std::atomic<int>& injected_offload_fault() {
  static std::atomic<int> fault{0};
  return fault;
}

/// Whether a test made `f` fail.
[[nodiscard]] inline bool offload_fault_injected(offload_fault f) noexcept {
  return injected_offload_fault().load() == static_cast<int>(f);
}

/// Wrong techniques a test can plant, for verify_correctness to catch:
/// checkpoint_skips_rng_restore: a checkpoint's recompute draws fresh random
/// numbers (other Dropout masks than its forward); checkpoint_recompute_scaled:
/// a recompute's outputs come out scaled by 1 + 2^-20.
enum class technique_fault : int { none, checkpoint_skips_rng_restore, checkpoint_recompute_scaled };

inline std::atomic<int>& injected_technique_fault() {
  static std::atomic<int> fault{0};
  return fault;
}

/// Whether a test planted `f`.
[[nodiscard]] inline bool technique_fault_injected(technique_fault f) noexcept {
  return injected_technique_fault().load() == static_cast<int>(f);
}

/// Injects a fault (at one pipeline stage, in one offload-tier operation, or
/// in a technique) for the guard's lifetime.
class inject_fault {
 public:
  /// A fault at stage `s`, reached `passes` times without failing first.
  explicit inject_fault(pipeline_stage s, int passes = 0) : slot_(injected_fault()) {
    injected_fault_passes() = passes;
    slot_ = static_cast<int>(s);
  }
  explicit inject_fault(offload_fault f) : slot_(injected_offload_fault()) { slot_ = static_cast<int>(f); }
  explicit inject_fault(technique_fault f) : slot_(injected_technique_fault()) { slot_ = static_cast<int>(f); }
  inject_fault(const inject_fault&) = delete;
  inject_fault& operator=(const inject_fault&) = delete;
  ~inject_fault() { slot_ = 0; }

 private:
  std::atomic<int>& slot_;
};

}  // namespace memscale::detail

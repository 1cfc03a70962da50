// memscale — the user's knobs: OptimizationMode and the Config aggregate.
// Field names, order and defaults follow the Python original; validate() rejects
// values outside their range with a ConfigError that names the field.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>

#include <memscale/errors.hpp>

namespace memscale {

/// How hard the decision engine pushes (thresholds live in core/decision_engine.hpp).
enum class OptimizationMode {
  Conservative,  ///< act only when the model would not fit; stop as soon as it fits
  Balanced,      ///< act under moderate pressure; keep a safety margin below the budget
  Aggressive,    ///< always act; minimize the projected peak
};

[[nodiscard]] constexpr std::string_view to_string(OptimizationMode mode) noexcept {
  switch (mode) {
    case OptimizationMode::Conservative: return "Conservative";
    case OptimizationMode::Balanced: return "Balanced";
    case OptimizationMode::Aggressive: return "Aggressive";
  }
  return "?";
}

inline std::ostream& operator<<(std::ostream& os, OptimizationMode mode) {
  return os << to_string(mode);
}

/// Settings of the asynchronous offload engine (used when Config::async_offload is set).
struct AsyncOffloadConfig {
  int prefetch_depth = 2;                  ///< layers fetched ahead of backward
  double pinned_pool_mb = 256.0;           ///< reusable pinned staging buffers
  int io_threads = 2;                      ///< disk-tier worker threads
  std::optional<std::string> disk_dir{};   ///< disk tier directory (default: $TMPDIR, else /var/tmp unless on tmpfs, else the temp dir)
  /// memscale additions (not in the Python original):
  std::optional<double> max_disk_offload_gb{};  ///< cap on the disk tier; unset = what the disk takes
  double min_offload_kb = 64.0;                 ///< saved tensors smaller than this stay where they are
  double batch_below_kb = 1024.0;               ///< smaller ones travel together, one transfer per layer
  /// The disk tier waits for each write to reach the disk and drops the file's
  /// pages from the page cache, so the bytes leave host memory when written (and
  /// again once read back). false: they stay in the page cache, dirty, until the
  /// kernel writes them back (measured: 256 MiB written, 256 MiB more cached);
  /// writes return sooner where the disk is slower than memory.
  bool disk_write_through = true;

  void validate() const {
    if (prefetch_depth < 1)
      throw ConfigError("async_config.prefetch_depth",
                        "must be >= 1, got " + std::to_string(prefetch_depth));
    if (!(pinned_pool_mb >= 0.0) || !std::isfinite(pinned_pool_mb))
      throw ConfigError("async_config.pinned_pool_mb",
                        "must be a finite number >= 0, got " + std::to_string(pinned_pool_mb));
    if (io_threads < 1)
      throw ConfigError("async_config.io_threads", "must be >= 1, got " + std::to_string(io_threads));
    if (disk_dir && disk_dir->empty())
      throw ConfigError("async_config.disk_dir", "must be a directory path or unset, got \"\"");
    if (max_disk_offload_gb && (!std::isfinite(*max_disk_offload_gb) || *max_disk_offload_gb < 0.0))
      throw ConfigError("async_config.max_disk_offload_gb",
                        "must be a finite number of GB >= 0 or unset, got " + std::to_string(*max_disk_offload_gb));
    if (!(batch_below_kb >= 0.0) || !std::isfinite(batch_below_kb))
      throw ConfigError("async_config.batch_below_kb",
                        "must be a finite number >= 0, got " + std::to_string(batch_below_kb));
    if (!(min_offload_kb >= 0.0) || !std::isfinite(min_offload_kb))
      throw ConfigError("async_config.min_offload_kb",
                        "must be a finite number >= 0, got " + std::to_string(min_offload_kb));
  }
};

/// Stage 1's policy, with Config::auto_policy (include/memscale/policy/).
enum class PolicyKind {
  trained,  ///< the trained policy: the artifact shipped in the headers, or Config::policy_artifact's
  rule,     ///< the rule policy (policy/rule_policy.hpp)
};

struct Config {
  OptimizationMode mode = OptimizationMode::Balanced;
  bool enable_checkpointing = true;
  bool enable_offloading = true;
  bool enable_tiling = false;
  bool use_mixed_precision = false;
  bool use_8bit_optimizer = false;
  std::optional<double> max_cpu_offload_gb{};  ///< cap on host offload tiers; unset = no cap
  double target_gpu_utilization = 0.85;        ///< fraction of device memory (or budget) to plan for
  /// Optimize even when memory pressure is low. Where nothing presses (the step
  /// already fits the mode's target), the light touch, cheapest memory first:
  /// Balanced halves the step's growth above the static bytes, Conservative cuts
  /// it to 3/4, Aggressive minimizes the peak as always (core::forced_target).
  /// Where something presses, the lower of that and the mode's target: a tighter
  /// budget never gets a lighter plan.
  bool force_optimize = false;
  /// A checkpoint's recompute writes back the random masks its forward drew
  /// (Dropout's, on CPU), kept a bit an element, instead of drawing them again:
  /// the same values bit for bit, without the draws' time, which the planner
  /// counts (detail/draw_replay.hpp). false: drawn again from the forward's state.
  bool replay_random_draws = true;
  /// Selective recompute: a checkpoint may keep the outputs of its matrix
  /// products (a Linear's, a plain mm) and recompute only the rest (norms,
  /// activations, softmax, dropout), as Megatron does by hand. The planner plans
  /// with and without it and takes it where it reaches the target with less
  /// recompute (detail/product_replay.hpp). false: checkpoints recompute everything.
  bool selective_recompute = true;
  /// Units the plan leaves in place keep their saved masks (a Dropout's scaled
  /// noise on CPU: every element +0 or one value) a bit an element, written back
  /// exactly in backward (techniques/mask_packing.hpp, saved_compaction.hpp). The planner plans with
  /// and without it and takes it where the plan gets better at the same target.
  /// false: saved masks stay as they are.
  bool pack_saved_masks = true;
  /// Units the plan leaves in place keep no copy of an output that backward can
  /// compute again, bit for bit, from inputs it keeps anyway (a LayerNorm's
  /// output from its input and parameters, a GELU's or SiLU's from its input,
  /// a Dropout's product from its saved noise and input): the output is
  /// computed again when backward needs it (detail/output_recipes.hpp,
  /// techniques/saved_compaction.hpp). Planned with pack_saved_masks, taken
  /// where the plan gets better at the same target. false: outputs are kept.
  bool recompute_saved_outputs = true;
  /// Units the plan leaves in place keep a saved tensor whose rows end in runs
  /// of +0 without them (causal attention's softmax output: each row is +0 past
  /// its position), written back exactly in backward where that frees at least
  /// a quarter of it (techniques/zero_tails.hpp). Planned with the two above.
  /// false: such tensors are kept as they are.
  bool pack_saved_zeros = true;
  bool use_static_profiling = true;
  bool use_empirical_fallback = true;
  int warmup_steps = 2;  ///< instrumented passes per layer when profiling empirically
  /// memscale's log (spdlog's logger "memscale", to stderr at info): a summary at
  /// each plan, the per-layer plan at debug, warnings. false: this wrap logs nothing.
  bool enable_logging = true;
  /// With enable_logging, also append this wrap's log, from debug up (the whole
  /// plan), to this file (missing directories are created); one that cannot be
  /// opened is a ConfigError. Without enable_logging it is not opened.
  std::optional<std::string> log_file{};
  /// While the guard is active, serve Prometheus metrics at
  /// http://<observability_bind_address>:<port>/metrics (0: any free port; the
  /// Report's metrics_endpoint says which). A port that cannot be bound is a warning.
  std::optional<int> observability_port{};
  std::string observability_bind_address = "127.0.0.1";  ///< loopback only unless changed
  /// Opt-in telemetry (observability/telemetry.hpp): bucketed, non-identifying
  /// events (architecture class, parameter-count bucket, techniques, versions),
  /// sent asynchronously; never a name, path, host or shape. Also on with the
  /// environment's MEMSCALE_TELEMETRY=1.
  bool telemetry = false;
  /// Where events go: a JSON-lines file (default: $XDG_STATE_HOME or
  /// ~/.local/state, memscale/telemetry.jsonl; or MEMSCALE_TELEMETRY_FILE) ...
  std::optional<std::string> telemetry_file{};
  /// ... or an http:// URL each event is POSTed to (or MEMSCALE_TELEMETRY_ENDPOINT).
  std::optional<std::string> telemetry_endpoint{};
  bool verify_correctness = false;
  bool async_offload = false;
  std::optional<AsyncOffloadConfig> async_config{};
  /// Stage 1: choose the mode and the eligible techniques from the profile and the
  /// memory limit (a GPU or memory_budget_gb), then plan with that effective copy
  /// of this Config (Report::strategy). Without a limit it keeps this Config.
  bool auto_policy = false;
  PolicyKind policy = PolicyKind::trained;       ///< with auto_policy: which policy decides
  std::optional<std::string> policy_artifact{};  ///< a trained policy's artifact to load instead of the shipped one
  /// Explicit device memory budget ("fit in N GB"), in units of 2^30 bytes (GiB,
  /// as the Report prints it: 0.2 is 214,748,364 B). Unset: the detected device
  /// memory (or host RAM on a CPU-only host). Makes planning testable on a CPU host.
  std::optional<double> memory_budget_gb{};

  /// "http://" and a host (without user info or spaces); the port, if any, 1-65535.
  [[nodiscard]] static bool telemetry_endpoint_valid(const std::string& url) {
    constexpr std::string_view scheme = "http://";
    if (url.rfind(scheme, 0) != 0) return false;
    const auto authority = url.substr(scheme.size(), url.find('/', scheme.size()) - scheme.size());
    const auto colon = authority.rfind(':');
    const auto host = authority.substr(0, colon);
    if (host.empty() || host.find_first_of("@ \t") != std::string::npos) return false;
    if (colon == std::string::npos) return true;
    const auto digits = authority.substr(colon + 1);
    if (digits.empty() || digits.size() > 5 || digits.find_first_not_of("0123456789") != std::string::npos) return false;
    const int port = std::stoi(digits);
    return port >= 1 && port <= 65535;
  }

  /// Throws ConfigError naming the first field outside its valid range.
  void validate() const {
    switch (mode) {
      case OptimizationMode::Conservative:
      case OptimizationMode::Balanced:
      case OptimizationMode::Aggressive: break;
      default:
        throw ConfigError("mode", "must be Conservative, Balanced or Aggressive, got value " +
                                      std::to_string(static_cast<int>(mode)));
    }
    if (max_cpu_offload_gb && (!std::isfinite(*max_cpu_offload_gb) || *max_cpu_offload_gb < 0.0))
      throw ConfigError("max_cpu_offload_gb", "must be a finite number of GB >= 0 or unset, got " +
                                                  std::to_string(*max_cpu_offload_gb));
    if (!(target_gpu_utilization > 0.0 && target_gpu_utilization <= 1.0))
      throw ConfigError("target_gpu_utilization",
                        "must be in (0, 1], got " + std::to_string(target_gpu_utilization));
    if (warmup_steps < 0)
      throw ConfigError("warmup_steps", "must be >= 0, got " + std::to_string(warmup_steps));
    if (log_file && log_file->empty())
      throw ConfigError("log_file", "must be a file path or unset, got \"\"");
    if (observability_port && (*observability_port < 0 || *observability_port > 65535))
      throw ConfigError("observability_port", "must be in [0, 65535] (0: any free port) or unset, got " +
                                                  std::to_string(*observability_port));
    if (observability_bind_address.empty())
      throw ConfigError("observability_bind_address",
                        "must be an address to bind, such as \"127.0.0.1\" (the default) or \"0.0.0.0\", got \"\"");
    if (telemetry_file && telemetry_file->empty())
      throw ConfigError("telemetry_file", "must be a file path or unset, got \"\"");
    if (telemetry_endpoint && telemetry_file)
      throw ConfigError("telemetry_endpoint", "and telemetry_file are two sinks; set one of them");
    if (telemetry_endpoint && !telemetry_endpoint_valid(*telemetry_endpoint))
      throw ConfigError("telemetry_endpoint", "must be a URL of the form http://host[:port][/path], got \"" +
                                                  *telemetry_endpoint + "\"");
    if (async_config) async_config->validate();
    if (memory_budget_gb && (!std::isfinite(*memory_budget_gb) || *memory_budget_gb <= 0.0))
      throw ConfigError("memory_budget_gb", "must be a finite number of GB > 0 or unset, got " +
                                                std::to_string(*memory_budget_gb));
    if (policy != PolicyKind::trained && policy != PolicyKind::rule)
      throw ConfigError("policy", "must be PolicyKind::trained or PolicyKind::rule, got value " +
                                      std::to_string(static_cast<int>(policy)));
    if (policy_artifact && policy_artifact->empty())
      throw ConfigError("policy_artifact", "must be a file path or unset, got \"\"");
    if (policy_artifact && policy == PolicyKind::rule)
      throw ConfigError("policy_artifact", "must be unset with policy = PolicyKind::rule (it names a trained "
                                           "policy's artifact, which the rule policy would ignore)");
    if (!use_static_profiling && !use_empirical_fallback)
      throw ConfigError("use_empirical_fallback",
                        "at least one of use_static_profiling and use_empirical_fallback must be "
                        "true, otherwise no layer can be profiled");
  }
};

}  // namespace memscale

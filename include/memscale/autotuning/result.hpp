// memscale::autotune — what the AutoTuner is asked (TuneOptions) and what it
// answers (TuneResult: the best Config and batch, and one TuneTrial per
// candidate), printable as a table and convertible to and from JSON (the
// cache file and the export use the same form).
#pragma once

#include <cstdint>
#include <iomanip>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include <memscale/config.hpp>
#include <memscale/observability/config_json.hpp>
#include <memscale/device/hardware.hpp>
#include <memscale/errors.hpp>

namespace memscale {

/// When autotune() shows its progress line.
enum class TuneProgress {
  automatic,  ///< on a terminal (stderr is a TTY), quiet otherwise
  always,
  never,
};

/// What autotune() searches and how long it may take. The techniques it may
/// turn on are the ones the base Config enables (enable_checkpointing,
/// enable_offloading, enable_tiling, use_mixed_precision, use_8bit_optimizer):
/// each is tried on and off; the rest of the base Config is kept as written.
struct TuneOptions {
  std::vector<OptimizationMode> modes{OptimizationMode::Conservative, OptimizationMode::Balanced,
                                      OptimizationMode::Aggressive};
  /// Batch sizes to try (the example's rows repeated); empty: the example's own.
  std::vector<std::int64_t> batch_sizes{};
  double time_budget_seconds = 300.0;  ///< no trial starts after this
  int max_trials = 24;                 ///< trials run (pruned and duplicate candidates do not count)
  int warmup_steps = 1;                ///< untimed training steps of a trial (the plan's and state's first use)
  int timed_steps = 2;                 ///< timed training steps of a trial (their median is the step time)
  bool prune_with_predictor = true;    ///< skip candidates memscale::predict says do not fit
  /// The cache file; unset: $XDG_CACHE_HOME/memscale/autotune.json, else
  /// ~/.cache/memscale/autotune.json.
  std::optional<std::string> cache_file{};
  bool use_cache = true;  ///< false: neither read nor write the cache
  TuneProgress progress = TuneProgress::automatic;

  void validate() const {
    if (modes.empty()) throw ConfigError("TuneOptions::modes", "must name at least one OptimizationMode");
    for (auto b : batch_sizes)
      if (b < 1) throw ConfigError("TuneOptions::batch_sizes", "must be >= 1 each, got " + std::to_string(b));
    if (!(time_budget_seconds > 0.0))
      throw ConfigError("TuneOptions::time_budget_seconds",
                        "must be > 0 seconds, got " + std::to_string(time_budget_seconds));
    if (max_trials < 1) throw ConfigError("TuneOptions::max_trials", "must be >= 1, got " + std::to_string(max_trials));
    if (warmup_steps < 0)
      throw ConfigError("TuneOptions::warmup_steps", "must be >= 0, got " + std::to_string(warmup_steps));
    if (timed_steps < 1)
      throw ConfigError("TuneOptions::timed_steps", "must be >= 1, got " + std::to_string(timed_steps));
    if (cache_file && cache_file->empty())
      throw ConfigError("TuneOptions::cache_file", "must be a file path or unset, got \"\"");
  }
};

/// What became of one candidate.
enum class TrialOutcome {
  fits,           ///< ran; its measured peak is within the budget
  over_budget,    ///< ran; its measured peak is above the budget
  out_of_memory,  ///< an allocation failed during the trial (caught; the trial's memory freed)
  failed,         ///< another error during the trial (its message is the trial's detail)
  pruned,         ///< not run: predicted not to fit
  duplicate,      ///< not run: the same plan as an earlier candidate at this batch
  not_run,        ///< not run: the time or trial budget was spent
};

[[nodiscard]] constexpr std::string_view to_string(TrialOutcome o) noexcept {
  switch (o) {
    case TrialOutcome::fits: return "fits";
    case TrialOutcome::over_budget: return "over_budget";
    case TrialOutcome::out_of_memory: return "out_of_memory";
    case TrialOutcome::failed: return "failed";
    case TrialOutcome::pruned: return "pruned";
    case TrialOutcome::duplicate: return "duplicate";
    case TrialOutcome::not_run: return "not_run";
  }
  return "?";
}

/// One candidate: its configuration and batch, the predictor's peak, and (when
/// it ran) the measured peak and speed.
struct TuneTrial {
  Config config;
  std::int64_t batch_size = 0;
  std::string label;                       ///< mode and techniques, e.g. "Balanced checkpoint+offload"
  std::int64_t predicted_peak_bytes = -1;  ///< memscale::predict's peak_bytes; -1: not predicted
  /// The step's peak as the budget counts it: on CPU what the process holds for
  /// the model's training (parameters and buffers plus the resident
  /// high-water mark's growth over the trial, and no less than the allocator's
  /// peak plus predict's share outside it), on CUDA the device's allocator.
  std::int64_t measured_peak_bytes = -1;
  std::int64_t allocator_peak_bytes = -1;  ///< LibTorch's allocator alone (parameters and buffers plus its growth)
  double step_seconds = 0.0;               ///< median of the timed steps
  double samples_per_second = 0.0;
  TrialOutcome outcome = TrialOutcome::not_run;
  std::string detail;  ///< why it was not run, or what failed

  [[nodiscard]] bool ran() const noexcept {
    return outcome == TrialOutcome::fits || outcome == TrialOutcome::over_budget ||
           outcome == TrialOutcome::out_of_memory || outcome == TrialOutcome::failed;
  }
  /// (predicted - measured) / measured, when both are known.
  [[nodiscard]] std::optional<double> prediction_error() const noexcept {
    if (predicted_peak_bytes < 0 || measured_peak_bytes <= 0) return std::nullopt;
    return static_cast<double>(predicted_peak_bytes - measured_peak_bytes) / static_cast<double>(measured_peak_bytes);
  }
};

/// autotune()'s answer.
struct TuneResult {
  bool found = false;              ///< some trial fits the budget
  Config best;                     ///< the fastest configuration that fits (the base Config when none does)
  std::int64_t best_batch_size = 0;
  int best_trial = -1;             ///< its index in `trials`
  std::int64_t budget_bytes = 0;   ///< what a trial's measured peak must stay within
  std::vector<TuneTrial> trials;   ///< every candidate, in the order considered
  bool from_cache = false;         ///< true: returned from the cache, no trial ran now
  std::string cache_file;          ///< empty when the cache was not used
  std::string cache_key;           ///< the key's digest (see autotuning/cache.hpp)
  std::vector<std::string> notes;
  double seconds = 0.0;            ///< time autotune() took

  [[nodiscard]] const TuneTrial* winner() const noexcept {
    return best_trial >= 0 && best_trial < static_cast<int>(trials.size()) ? &trials[static_cast<std::size_t>(best_trial)]
                                                                           : nullptr;
  }

  [[nodiscard]] std::string str() const {
    using detail::format_bytes;
    std::ostringstream os;
    const auto bytes = [](std::int64_t b) { return b < 0 ? std::string("-") : format_bytes(b); };
    os << "memscale autotune: " << trials.size() << " candidate(s), budget " << format_bytes(budget_bytes)
       << (from_cache ? " (from the cache)" : "") << "\n";
    os << "  " << std::right << std::setw(3) << "#" << "  " << std::left << std::setw(40) << "configuration"
       << std::right << std::setw(7) << "batch" << std::setw(12) << "predicted" << std::setw(12) << "measured"
       << std::setw(8) << "error" << std::setw(10) << "step ms" << std::setw(11) << "samples/s" << "  outcome\n";
    for (std::size_t i = 0; i < trials.size(); ++i) {
      const auto& t = trials[i];
      std::ostringstream error;
      if (const auto e = t.prediction_error()) error << std::showpos << std::fixed << std::setprecision(1) << 100.0 * *e << "%";
      else error << "-";
      os << "  " << std::right << std::setw(3) << i << (static_cast<int>(i) == best_trial ? "* " : "  ") << std::left
         << std::setw(40) << t.label.substr(0, 39) << std::right << std::setw(7) << t.batch_size << std::setw(12)
         << bytes(t.predicted_peak_bytes) << std::setw(12) << bytes(t.measured_peak_bytes) << std::setw(8)
         << error.str() << std::setw(10);
      if (t.step_seconds > 0.0) os << std::fixed << std::setprecision(1) << 1e3 * t.step_seconds;
      else os << "-";
      os << std::setw(11);
      if (t.samples_per_second > 0.0) os << std::fixed << std::setprecision(1) << t.samples_per_second;
      else os << "-";
      os << "  " << to_string(t.outcome) << (t.detail.empty() ? "" : ": " + t.detail) << "\n";
    }
    if (const auto* w = winner())
      os << "  best: #" << best_trial << " " << w->label << " at batch " << best_batch_size << ", "
         << std::fixed << std::setprecision(1) << w->samples_per_second << " samples/s, peak "
         << format_bytes(w->measured_peak_bytes) << " of " << format_bytes(budget_bytes) << "\n";
    else
      os << "  best: none of the trials fits the budget\n";
    for (const auto& n : notes) os << "  note: " << n << "\n";
    if (!cache_file.empty()) os << "  cache: " << cache_file << " (key " << cache_key << ")\n";
    os << "  tuned in " << std::fixed << std::setprecision(2) << seconds << " s";
    return os.str();
  }
  friend std::ostream& operator<<(std::ostream& os, const TuneResult& r) { return os << r.str(); }

  /// The result as JSON (what the cache stores), pretty-printed with `indent`
  /// spaces, or on one line with -1.
  [[nodiscard]] std::string to_json(int indent = 2) const;
  /// A result from to_json()'s form. Throws memscale::Error naming what is
  /// missing or malformed.
  [[nodiscard]] static TuneResult from_json(std::string_view text);
};

// --- JSON ------------------------------------------------------------------
// Field names are the C++ ones. Reading is strict about types and lenient
// about absent optional fields; Config::validate() runs on what was read.

NLOHMANN_JSON_SERIALIZE_ENUM(TrialOutcome, {{TrialOutcome::not_run, "not_run"},
                                            {TrialOutcome::fits, "fits"},
                                            {TrialOutcome::over_budget, "over_budget"},
                                            {TrialOutcome::out_of_memory, "out_of_memory"},
                                            {TrialOutcome::failed, "failed"},
                                            {TrialOutcome::pruned, "pruned"},
                                            {TrialOutcome::duplicate, "duplicate"}})


inline void to_json(nlohmann::json& j, const TuneTrial& t) {
  j = {{"config", t.config},
       {"batch_size", t.batch_size},
       {"label", t.label},
       {"predicted_peak_bytes", t.predicted_peak_bytes},
       {"measured_peak_bytes", t.measured_peak_bytes},
       {"allocator_peak_bytes", t.allocator_peak_bytes},
       {"step_seconds", t.step_seconds},
       {"samples_per_second", t.samples_per_second},
       {"outcome", t.outcome},
       {"detail", t.detail}};
  if (const auto e = t.prediction_error()) j["prediction_error"] = *e;
}

inline void from_json(const nlohmann::json& j, TuneTrial& t) {
  using detail::get_if_present;
  t = TuneTrial{};
  t.config = j.at("config").get<Config>();
  t.batch_size = memscale::detail::read_as<std::int64_t>(j.at("batch_size"), "batch_size");
  get_if_present(j, "label", t.label);
  get_if_present(j, "predicted_peak_bytes", t.predicted_peak_bytes);
  get_if_present(j, "measured_peak_bytes", t.measured_peak_bytes);
  get_if_present(j, "allocator_peak_bytes", t.allocator_peak_bytes);
  get_if_present(j, "step_seconds", t.step_seconds);
  get_if_present(j, "samples_per_second", t.samples_per_second);
  const auto& outcome = j.at("outcome");
  t.outcome = outcome.get<TrialOutcome>();
  if (t.outcome == TrialOutcome::not_run && outcome != "not_run")
    throw Error("memscale: unknown trial outcome " + outcome.dump());
  get_if_present(j, "detail", t.detail);
}

inline std::string TuneResult::to_json(int indent) const {
  nlohmann::json j = {{"found", found},
                      {"best", best},
                      {"best_batch_size", best_batch_size},
                      {"best_trial", best_trial},
                      {"budget_bytes", budget_bytes},
                      {"trials", trials},
                      {"from_cache", from_cache},
                      {"cache_file", cache_file},
                      {"cache_key", cache_key},
                      {"notes", notes},
                      {"seconds", seconds}};
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);  // an exception's text may not be UTF-8
}

namespace autotuning::detail {

/// A TuneResult from its JSON value; throws memscale::Error saying what is wrong.
inline TuneResult result_from(const nlohmann::json& j) {
  using memscale::detail::get_if_present;
  try {
    TuneResult r;
    if (!j.is_object()) throw Error("expected an object, got " + std::string(j.type_name()));
    r.found = memscale::detail::read_as<bool>(j.at("found"), "found");
    r.best = j.at("best").get<Config>();
    r.best_batch_size = memscale::detail::read_as<std::int64_t>(j.at("best_batch_size"), "best_batch_size");
    r.best_trial = memscale::detail::read_as<int>(j.at("best_trial"), "best_trial");
    r.budget_bytes = memscale::detail::read_as<std::int64_t>(j.at("budget_bytes"), "budget_bytes");
    r.trials = j.at("trials").get<std::vector<TuneTrial>>();
    get_if_present(j, "from_cache", r.from_cache);
    get_if_present(j, "cache_file", r.cache_file);
    get_if_present(j, "cache_key", r.cache_key);
    get_if_present(j, "notes", r.notes);
    get_if_present(j, "seconds", r.seconds);
    if (r.found && r.best_batch_size < 1)
      throw Error("best_batch_size must be >= 1, got " + std::to_string(r.best_batch_size));
    if (r.found && r.winner() == nullptr)
      throw Error("best_trial " + std::to_string(r.best_trial) + " is not one of the " +
                  std::to_string(r.trials.size()) + " trials");
    if (r.found && r.winner()->outcome != TrialOutcome::fits)
      throw Error("the best trial's outcome is " + std::string(to_string(r.winner()->outcome)) + ", not fits");
    return r;
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("memscale: malformed autotune result: ") + e.what());
  } catch (const Error& e) {
    throw Error(std::string("memscale: malformed autotune result: ") + e.what());
  }
}

}  // namespace autotuning::detail

inline TuneResult TuneResult::from_json(std::string_view text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("memscale: an autotune result is not valid JSON: ") + e.what());
  }
  return autotuning::detail::result_from(j);
}

}  // namespace memscale

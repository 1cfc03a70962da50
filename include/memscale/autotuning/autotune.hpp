// memscale::autotune(model, example_input, optimizer, loss_fn, config, options):
// the fastest configuration that fits, found by running real training steps.
//
// The candidates are the modes in TuneOptions::modes crossed with the technique
// sets the base Config allows (all of them, and each alone), plus the plan
// that uses none, each with and without mixed precision and the 8-bit
// optimizer where the base Config allows those, at each batch size asked for.
// Each is first sized by memscale::predict: one predicted not to fit is pruned,
// one whose plan is the same as an earlier candidate's at that batch is a
// duplicate. The rest run as trials: the model optimized with the candidate
// (memscale::optimize), warm-up and timed steps of forward, loss, backward and
// a step of a shadow optimizer (the user's type and options over the same
// parameters), under the tracker's hard limit at the budget where the counting
// allocator is installed. The winner is the trial with the most samples per
// second whose measured peak fits the budget.
//
// A trial that runs out of memory is caught, its memory freed and the outcome
// recorded; the search goes on. The model's parameters (restored from a
// snapshot), gradients, buffers and the RNG state are as they were after each
// trial; the user's optimizer is never stepped. Results are cached by the key
// of autotuning/cache.hpp.
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/execute/attach.hpp>
#include <memscale/autotuning/cache.hpp>
#include <memscale/autotuning/result.hpp>
#include <memscale/autotuning/trial.hpp>
#include <memscale/config.hpp>
#include <memscale/device/memory_tracker.hpp>
#include <memscale/execute/verify.hpp>
#include <memscale/errors.hpp>
#include <memscale/observability/metrics.hpp>
#include <memscale/observability/telemetry.hpp>
#include <memscale/predict/cuda_reserve.hpp>
#include <memscale/predict/optimizer_state.hpp>
#include <memscale/predict/predict.hpp>

namespace memscale {
namespace autotuning::detail {

/// `tuned` with the caller's fields that do not decide a result (and are not in
/// the cache key): logging, the metrics port, verify_correctness.
inline Config with_callers_fields(Config tuned, const Config& base) {
  tuned.enable_logging = base.enable_logging;
  tuned.log_file = base.log_file;
  tuned.observability_port = base.observability_port;
  tuned.observability_bind_address = base.observability_bind_address;
  tuned.telemetry = base.telemetry;
  tuned.telemetry_file = base.telemetry_file;
  tuned.telemetry_endpoint = base.telemetry_endpoint;
  tuned.verify_correctness = base.verify_correctness;
  return tuned;
}

/// "Balanced checkpoint+offload, mixed precision, 8-bit optimizer"; "no technique".
inline std::string label_of(const Config& c) {
  std::string techniques;
  const auto add = [&](bool on, const char* name) {
    if (!on) return;
    if (!techniques.empty()) techniques += "+";
    techniques += name;
  };
  add(c.enable_checkpointing, "checkpoint");
  add(c.enable_offloading, "offload");
  add(c.enable_tiling, "tile");
  std::string out = techniques.empty() ? "no technique" : std::string(to_string(c.mode)) + " " + techniques;
  if (c.use_mixed_precision) out += ", mixed precision";
  if (c.use_8bit_optimizer) out += ", 8-bit optimizer";
  return out;
}

/// The configurations to try, cheapest first: no technique, then each mode with
/// every allowed technique and (when several are allowed) with each alone;
/// each with and without mixed precision and the 8-bit optimizer where allowed.
inline std::vector<Config> candidate_configs(const Config& base, const TuneOptions& options, bool eight_bit_possible) {
  struct techniques {
    bool checkpoint, offload, tile;
  };
  const techniques allowed{base.enable_checkpointing, base.enable_offloading, base.enable_tiling};
  std::vector<techniques> sets;
  if (allowed.checkpoint || allowed.offload || allowed.tile) sets.push_back(allowed);
  if (static_cast<int>(allowed.checkpoint) + static_cast<int>(allowed.offload) + static_cast<int>(allowed.tile) > 1) {
    if (allowed.checkpoint) sets.push_back({true, false, false});
    if (allowed.offload) sets.push_back({false, true, false});
    if (allowed.tile) sets.push_back({false, false, true});
  }
  std::vector<Config> structural;
  Config none = base;
  none.enable_checkpointing = none.enable_offloading = none.enable_tiling = false;
  structural.push_back(none);
  for (const auto mode : options.modes)
    for (const auto& s : sets) {
      Config c = base;
      c.mode = mode;
      c.enable_checkpointing = s.checkpoint;
      c.enable_offloading = s.offload;
      c.enable_tiling = s.tile;
      structural.push_back(c);
    }
  std::vector<Config> out;
  for (const bool mixed : {false, true}) {
    if (mixed && !base.use_mixed_precision) continue;
    for (const bool eight_bit : {false, true}) {
      if (eight_bit && !(base.use_8bit_optimizer && eight_bit_possible)) continue;
      for (auto c : structural) {
        c.use_mixed_precision = mixed;
        c.use_8bit_optimizer = eight_bit;
        c.verify_correctness = false;
        c.auto_policy = false;  // each candidate is the strategy tried: Stage 1 must not replace it
        out.push_back(c);
      }
    }
  }
  return out;
}

/// What identifies a plan's effect: its units per chain, mixed precision and
/// the optimizer it uses.
inline std::string plan_signature(const Prediction& p, const Config& c) {
  std::ostringstream os;
  if (p.plan_applies)
    for (const auto& units : p.plan.plan.units) {
      for (const auto& u : units) os << u << ";";
      os << "|";
    }
  else
    os << "nothing";
  os << (c.use_mixed_precision ? " mp" : "") << (c.use_8bit_optimizer ? " 8bit" : "");
  return os.str();
}

}  // namespace autotuning::detail

namespace autotuning {

/// autotune() with the model's forward and the loss as functions.
template <StrategyType S, Model M>
TuneResult run(M& model, const torch::Tensor& example_input, const torch::optim::Optimizer& optimizer,
               std::function<torch::Tensor(const torch::Tensor&)> loss_fn, const Config& base,
               const TuneOptions& options) {
  using namespace autotuning::detail;
  const auto started = std::chrono::steady_clock::now();
  const auto elapsed = [&] { return memscale::detail::seconds_since(started); };
  base.validate();
  options.validate();
  // autotune_finished for the caller; the trials' own wraps send nothing.
  const auto events = telemetry::channel::open(base);
  const telemetry::mute_scope trials_send_nothing;
  const observability::own_work_scope trials_are_no_training_steps;
  c10::Device device = c10::kCPU;
  const auto finished = [&](const TuneResult& r) {
    if (!events.on()) return;
    auto e = telemetry::event("autotune_finished", device.is_cuda() ? "cuda" : device.is_cpu() ? "cpu" : "other");
    e["found"] = r.found;
    e["from_cache"] = r.from_cache;
    e["trials_bucket"] = telemetry::count_bucket(static_cast<std::int64_t>(r.trials.size()));
    e["chosen_mode"] = r.best.mode;
    events.emit(e);
  };
  const auto inputs =
      predictor::detail::training_inputs(model, example_input, "memscale::autotune()", "detach it first");
  const auto& root = inputs.first;
  const auto& forward = inputs.second;
  const auto own = predictor::sizing_of(optimizer);  // throws for a type it cannot run, before anything changes
  const auto parameters = root->parameters();
  device = predictor::detail::model_device(parameters, example_input);

  TuneResult result;
  trial_context context{forward, loss_fn, &optimizer, parameters, device};
  for (const auto& p : parameters) context.static_bytes += static_cast<std::int64_t>(p.nbytes());
  for (const auto& b : root->buffers())
    if (b.defined() && b.device() == device) context.static_bytes += static_cast<std::int64_t>(b.nbytes());
  context.warmup_steps = options.warmup_steps;
  context.timed_steps = options.timed_steps;
  // CUDA: a trial measures what the device holds at its peak, less what only the
  // trials hold (trial_context::trial_only_bytes; the caller's gradients and
  // optimizer state wait on the host meanwhile: host_parking).
  if (device.is_cuda()) {
    std::set<const void*> seen;  // a buffer shared by two modules once
    const auto add = [&](const torch::Tensor& t) {
      if (t.defined() && t.device() == device && seen.insert(t.unsafeGetTensorImpl()).second)
        context.trial_only_bytes += static_cast<std::int64_t>(t.nbytes());
    };
    for (const auto& b : root->buffers()) add(b);  // the sandbox's copies
    add(example_input);
    context.example = example_input;
  }

  // The budget, as predict() and the planner count it.
  const auto hardware = detect_hardware();
  result.budget_bytes = memory_budget_bytes(base.memory_budget_gb, hardware, device);
  context.budget_bytes = result.budget_bytes;

  auto batches = options.batch_sizes;
  if (batches.empty()) batches.push_back(example_input.size(0));
  std::sort(batches.begin(), batches.end(), std::greater<>());
  batches.erase(std::unique(batches.begin(), batches.end()), batches.end());

  // The cache.
  const auto key = make_key(*root, example_input, device, hardware, optimizer, own, base, options, result.budget_bytes);
  result.cache_key = key.digest();
  if (options.use_cache) {
    result.cache_file = options.cache_file.value_or(default_cache_file());
    if (result.cache_file.empty()) {
      result.notes.push_back("no cache: neither XDG_CACHE_HOME nor HOME is set and TuneOptions::cache_file is unset");
    } else {
      const auto contents = read_cache(result.cache_file);
      if (!contents.problem.empty()) result.notes.push_back(contents.problem);
      std::string problem;
      if (auto cached = lookup(contents, key, problem)) {
        cached->from_cache = true;
        cached->best = with_callers_fields(cached->best, base);
        cached->cache_file = result.cache_file;
        cached->cache_key = result.cache_key;
        cached->notes.insert(cached->notes.begin(), result.notes.begin(), result.notes.end());
        cached->seconds = elapsed();
        finished(*cached);
        return *cached;
      }
      if (!problem.empty()) result.notes.push_back(problem);
    }
  }

  // The candidates, each batch size (largest first) by each configuration.
  const bool eight_bit_possible = own.name == "torch::optim::AdamW";
  for (const auto batch : batches)
    for (const auto& config : candidate_configs(base, options, eight_bit_possible)) {
      TuneTrial t;
      t.config = config;
      t.config.enable_logging = false;
      t.batch_size = batch;
      t.label = label_of(config);
      result.trials.push_back(std::move(t));
    }

  core::verify::sandbox box(*root);  // gradients (set aside), buffers and RNG: back at the end
  parameter_snapshot snapshot(parameters);
  progress_line progress(options.progress);
  std::map<std::pair<std::int64_t, std::string>, std::size_t> plans;  // (batch, plan signature) -> the trial that ran it
  int run_count = 0;
  bool cut_by_time = false;
  const auto best_so_far = [&]() -> const TuneTrial* {
    const TuneTrial* best = nullptr;
    for (const auto& t : result.trials)
      if (t.outcome == TrialOutcome::fits && (best == nullptr || t.samples_per_second > best->samples_per_second))
        best = &t;
    return best;
  };

  for (std::size_t i = 0; i < result.trials.size(); ++i) {
    auto& t = result.trials[i];
    const auto out_of_time = [&] {
      if (elapsed() < options.time_budget_seconds) return false;
      t.outcome = TrialOutcome::not_run;
      t.detail = "the time budget (" + std::to_string(options.time_budget_seconds) + " s) was spent";
      cut_by_time = true;
      return true;
    };
    if (out_of_time()) continue;
    if (run_count >= options.max_trials) {
      t.detail = "the trial budget (" + std::to_string(options.max_trials) + " trials) was spent";
      continue;
    }
    progress.show(i + 1, result.trials.size(), "predicting " + t.label + " @" + std::to_string(t.batch_size),
                  best_so_far(), options.time_budget_seconds - elapsed());
    torch::Tensor x;
    try {
      x = predictor::detail::rows_of(example_input, t.batch_size);
    } catch (...) {
      record_exception(t);  // a batch too large to make is this candidate's failure
      continue;
    }
    std::string signature;
    std::int64_t outside = -1;  // CPU: predict's share outside the allocator, for the trial's measure
    try {
      const auto p = predictor::run<S>(model, x, optimizer, loss_fn, true, t.config);
      t.predicted_peak_bytes = p.peak_bytes;
      if (device.is_cpu()) outside = p.planned.outside_allocator_bytes;
      signature = plan_signature(p, t.config);
    } catch (...) {
      TuneTrial failed;
      record_exception(failed);
      t.detail = "not predicted (" + failed.detail + ")";
    }
    box.reset();
    if (out_of_time()) continue;
    if (!signature.empty()) {
      if (const auto same = plans.find({t.batch_size, signature}); same != plans.end()) {
        t.outcome = TrialOutcome::duplicate;
        t.detail = "the same plan as #" + std::to_string(same->second);
        continue;
      }
    }
    if (options.prune_with_predictor && t.predicted_peak_bytes > result.budget_bytes) {
      t.outcome = TrialOutcome::pruned;
      t.detail = "predicted " + memscale::detail::format_bytes(t.predicted_peak_bytes) + " > budget";
      continue;
    }
    progress.show(i + 1, result.trials.size(), "running " + t.label + " @" + std::to_string(t.batch_size),
                  best_so_far(), options.time_budget_seconds - elapsed());
    ++run_count;
    if (!signature.empty()) plans.emplace(std::make_pair(t.batch_size, signature), i);
    std::optional<host_parking> parked;
    try {  // a host without room for the state fails this trial, not the search
      parked.emplace(box, optimizer, device.is_cuda() ? std::optional(device) : std::nullopt);
    } catch (...) {
      record_exception(t);
    }
    if (parked) {
      run_trial(t, x, context, *parked, outside, [&model, outside](const Config& config, const torch::Tensor& input) {
        // CPU: planned with the share predict planned with (in a warm process the
        // attach's own probe reads about 0, and the plan would be predict's no more).
        const core::profile_scale_scope reserve(1.0, outside);
        return OptimizationGuard(memscale::detail::root_of(model), memscale::detail::attach<S>(model, config, &input));
      });
      parked->put_back();  // throws where the caller's state could not go back on the device
      parked.reset();
    }
    box.reset();
    snapshot.restore();
  }

  if (const auto* best = best_so_far()) {
    result.found = true;
    result.best_trial = static_cast<int>(best - result.trials.data());
    result.best = with_callers_fields(best->config, base);
    result.best_batch_size = best->batch_size;
  } else {
    result.best = base;
    result.best_batch_size = example_input.size(0);
    // Every candidate ran (none pruned) and failed with an error other than
    // memory: the model's or the loss's own, whatever the configuration. Not a
    // search result, and not one to cache, where the next call would return it.
    // (With candidates pruned, the ones that ran may fail for their own
    // techniques, e.g. mixed precision on 1.13's LayerNorm: a result.)
    const auto count = [&](auto pred) { return std::count_if(result.trials.begin(), result.trials.end(), pred); };
    const auto pruned = count([](const TuneTrial& t) { return t.outcome == TrialOutcome::pruned; });
    const auto failed = count([](const TuneTrial& t) { return t.outcome == TrialOutcome::failed; });
    const auto ran = count([](const TuneTrial& t) {
      return t.outcome == TrialOutcome::fits || t.outcome == TrialOutcome::over_budget ||
             t.outcome == TrialOutcome::out_of_memory || t.outcome == TrialOutcome::failed;
    });
    const auto first_failed = std::find_if(result.trials.begin(), result.trials.end(),
                                           [](const TuneTrial& t) { return t.outcome == TrialOutcome::failed; });
    if (pruned == 0 && ran > 0 && failed == ran)
      throw Error("memscale::autotune: every trial failed, each with an error that is not a lack of memory "
                  "(nothing was cached; the model and optimizer are as they were). The first, " +
                  first_failed->label + " at batch " + std::to_string(first_failed->batch_size) + ": " +
                  first_failed->detail);
  }
  if (device.is_cpu()) {
    if (!memory_tracker::installed())
      result.notes.push_back("the counting CPU allocator is not installed (memscale::memory_tracker::install()): "
                             "trials ran without the hard limit, so one over the budget ran to its end");
    if (!process_memory_follows_allocator())
      result.notes.push_back(malloc_retention_advice() +
                             "; until then the trials' measured peaks include what malloc retains and vary run "
                             "to run");
  }
  result.seconds = elapsed();
  if (options.use_cache && !result.cache_file.empty()) {
    // A search the clock cut short depends on the machine's speed that day; one
    // the trial budget cut is what the same key gives again.
    if (cut_by_time)
      result.notes.push_back("not cached: the time budget ended the search before every candidate was considered");
    else if (const auto problem = store(result.cache_file, key, result); !problem.empty())
      result.notes.push_back(problem);
  }
  finished(result);
  return result;
}

}  // namespace autotuning

/// Finds the fastest configuration (and batch size, among
/// TuneOptions::batch_sizes) whose measured training step fits the budget
/// (Config::memory_budget_gb, or the device's memory), by running real trial
/// steps, pruned by memscale::predict. `loss_fn` maps the model's output to the
/// scalar loss; a loss that uses targets must take the first output.size(0)
/// rows of them (trials run at other batch sizes). The techniques tried are
/// those `config` enables. Leaves the model, its gradients, buffers, the RNG
/// state and `optimizer` as they were, whatever a trial does (an out-of-memory
/// is caught and recorded). A second call with the same key returns the cached
/// result without trials. Throws (changing nothing) for a model memscale
/// manages now, an optimizer type it cannot run, or invalid options.
template <StrategyType S = DefaultStrategy, Model M, class LossFn>
  requires std::invocable<LossFn&, const torch::Tensor&>
TuneResult autotune(M& model, const torch::Tensor& example_input, const torch::optim::Optimizer& optimizer,
                    LossFn&& loss_fn, const Config& config = {}, const TuneOptions& options = {}) {
  std::function<torch::Tensor(const torch::Tensor&)> loss = [&loss_fn](const torch::Tensor& output) {
    return torch::Tensor(loss_fn(output));
  };
  return autotuning::run<S>(model, example_input, optimizer, std::move(loss), config, options);
}

}  // namespace memscale

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
#include <iomanip>
#include <iostream>
#include <memory>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include <torch/torch.h>
#include <torch/version.h>

#include <memscale/api.hpp>
#include <memscale/autotuning/cache.hpp>
#include <memscale/autotuning/result.hpp>
#include <memscale/config.hpp>
#include <memscale/core/memory_tracker.hpp>
#include <memscale/core/profiler.hpp>
#include <memscale/core/verify.hpp>
#include <memscale/detail/process_memory.hpp>
#include <memscale/errors.hpp>
#include <memscale/predict/optimizer_state.hpp>
#include <memscale/predict/predict.hpp>

#if MEMSCALE_HAS_CUDA()
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace memscale {
namespace autotuning::detail {

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

/// Whether `e` is an allocation failure (LibTorch 2.x and the tracker's hard
/// limit throw c10::OutOfMemoryError; 1.13's CUDA and CPU allocators a c10::Error).
inline bool is_out_of_memory(const c10::Error& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return true;
  const std::string what = e.what_without_backtrace();
  return what.find("out of memory") != std::string::npos || what.find("not enough memory") != std::string::npos;
}

/// A shadow of `optimizer` (its type and every group's options) over the same
/// parameters, or memscale's AdamW8bit with an AdamW's hyperparameters.
inline std::unique_ptr<torch::optim::Optimizer> shadow_optimizer(const torch::optim::Optimizer& optimizer,
                                                                 bool as_eight_bit) {
  const auto sizing = as_eight_bit ? predictor::adamw8bit_sizing() : predictor::sizing_of(optimizer);
  std::unique_ptr<torch::optim::Optimizer> shadow;
  for (const auto& group : optimizer.param_groups()) {
    std::unique_ptr<torch::optim::OptimizerOptions> options;
    if (as_eight_bit) options = std::make_unique<optim::AdamW8bitOptions>(predictor::detail::as_eight_bit(group.options()));
    else options = group.options().clone();
    if (!shadow) shadow = sizing.shadow(group.params(), *options);
    else shadow->add_param_group(torch::optim::OptimizerParamGroup(group.params(), std::move(options)));
  }
  return shadow;
}

/// The model's parameters as they were, put back after each trial.
class parameter_snapshot {
 public:
  explicit parameter_snapshot(const std::vector<torch::Tensor>& parameters) : parameters_(parameters) {
    torch::NoGradGuard no_grad;
    for (const auto& p : parameters_) saved_.push_back(p.detach().clone());
  }
  void restore() {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < parameters_.size(); ++i) parameters_[i].detach().copy_(saved_[i]);
  }

 private:
  std::vector<torch::Tensor> parameters_;
  std::vector<torch::Tensor> saved_;
};

/// Shows "trial k of n, best ..., time left" on one terminal line.
class progress_line {
 public:
  explicit progress_line(TuneProgress mode)
      : on_(mode == TuneProgress::always || (mode == TuneProgress::automatic && ::isatty(STDERR_FILENO) == 1)) {}
  progress_line(const progress_line&) = delete;
  progress_line& operator=(const progress_line&) = delete;
  ~progress_line() {
    if (on_ && shown_) std::cerr << "\n" << std::flush;
  }
  void show(std::size_t k, std::size_t n, const std::string& what, const TuneTrial* best, double seconds_left) {
    if (!on_) return;
    std::ostringstream os;
    os << "\r\033[K[memscale autotune] " << k << "/" << n << " " << what << " | best: ";
    if (best != nullptr)
      os << best->label << " @" << best->batch_size << " " << std::fixed << std::setprecision(1)
         << best->samples_per_second << " samples/s";
    else
      os << "none yet";
    os << " | " << std::fixed << std::setprecision(0) << std::max(0.0, seconds_left) << " s left";
    std::cerr << os.str() << std::flush;
    shown_ = true;
  }

 private:
  bool on_;
  bool shown_ = false;
};

/// Live bytes the trial's peak is measured from, and its peak: the counting
/// allocator (or a reporting scope) on CPU, the caching allocator on CUDA.
class trial_meter {
 public:
  explicit trial_meter(c10::Device device) : device_(device) {
    if (device.is_cpu() && !memory_tracker::installed()) {
      reporting_.emplace();
      if (!reporting_->active()) reporting_.reset();
    }
    if (device.is_cuda() || memory_tracker::installed() || reporting_) peak_.emplace(device);
#if MEMSCALE_HAS_CUDA()
    if (device.is_cuda()) {
      const auto index = device.has_index() ? device.index() : c10::DeviceIndex{0};
      reserved_before_ = static_cast<std::int64_t>(
          c10::cuda::CUDACachingAllocator::getDeviceStats(index).reserved_bytes[0].current);
    }
#endif
    if (device.is_cpu() && memscale::detail::reset_process_peak())
      if (const auto m = memscale::detail::read_process_memory()) resident_before_ = m->resident_bytes;
  }
  /// Growth of the allocator's live bytes over the scope, or -1 when nothing measures it.
  [[nodiscard]] std::int64_t allocator_growth() const { return peak_ ? peak_->peak_growth() : -1; }
  /// Growth of what the process (CPU: resident high-water mark) or the device
  /// (CUDA: the caching allocator's reserve) holds, or -1.
  [[nodiscard]] std::int64_t held_growth() const {
    if (device_.is_cpu() && resident_before_ >= 0)
      if (const auto m = memscale::detail::read_process_memory()) return m->peak_bytes - resident_before_;
#if MEMSCALE_HAS_CUDA()
    if (device_.is_cuda()) {
      const auto index = device_.has_index() ? device_.index() : c10::DeviceIndex{0};
      return static_cast<std::int64_t>(c10::cuda::CUDACachingAllocator::getDeviceStats(index).reserved_bytes[0].peak) -
             reserved_before_;
    }
#endif
    return -1;
  }

 private:
  c10::Device device_;
  std::optional<memory_tracker::reporting_scope> reporting_;
  std::optional<memory_tracker::peak_scope> peak_;
  std::int64_t resident_before_ = -1;
  std::int64_t reserved_before_ = 0;
};

/// What a trial needs of the model and the caller.
struct trial_context {
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::function<torch::Tensor(const torch::Tensor&)> loss;
  const torch::optim::Optimizer* optimizer = nullptr;
  std::vector<torch::Tensor> parameters;
  c10::Device device = c10::kCPU;
  std::int64_t static_bytes = 0;  ///< parameters and buffers, live before any trial
  std::int64_t budget_bytes = 0;
  int warmup_steps = 1;
  int timed_steps = 2;
};

/// Runs trial `t` (already sized) with `attach_guard` making the guard; fills in
/// the measurements and the outcome. The caller restores the model afterwards.
template <class AttachGuard>
void run_trial(TuneTrial& t, const torch::Tensor& x, const trial_context& c, AttachGuard&& attach_guard) {
  try {
    auto shadow = shadow_optimizer(*c.optimizer, t.config.use_8bit_optimizer && !dynamic_cast<const optim::AdamW8bit*>(c.optimizer));
    std::optional<memory_tracker::hard_limit_scope> hard;
    if (c.device.is_cpu() && memory_tracker::installed())
      hard.emplace(memory_tracker::current_bytes() + std::max<std::int64_t>(0, c.budget_bytes - c.static_bytes));
    trial_meter meter(c.device);
    std::vector<double> times;
    {
      auto guard = attach_guard(t.config, x);
      for (int step = 0; step < c.warmup_steps + c.timed_steps; ++step) {
        const auto started = std::chrono::steady_clock::now();
        shadow->zero_grad();
        {
          torch::AutoGradMode grad_on(true);
          auto value = c.loss(c.forward(x));
          value.backward();
        }
        shadow->step();
        memscale::detail::synchronize(c.device);
        if (step >= c.warmup_steps) times.push_back(memscale::detail::seconds_since(started));
      }
      shadow->zero_grad();
    }
    const auto allocator = meter.allocator_growth();
    const auto held = meter.held_growth();
    t.allocator_peak_bytes = allocator >= 0 ? c.static_bytes + allocator : -1;
    t.measured_peak_bytes = std::max(t.allocator_peak_bytes, held >= 0 ? c.static_bytes + held : -1);
    std::sort(times.begin(), times.end());
    const auto n = times.size();
    t.step_seconds = n % 2 == 1 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2]);
    t.samples_per_second = t.step_seconds > 0.0 ? static_cast<double>(t.batch_size) / t.step_seconds : 0.0;
    if (t.measured_peak_bytes < 0) {
      t.outcome = TrialOutcome::fits;
      t.detail = "peak not measured (no CPU allocator statistics): counted as fitting";
    } else {
      t.outcome = t.measured_peak_bytes <= c.budget_bytes ? TrialOutcome::fits : TrialOutcome::over_budget;
    }
  } catch (const c10::Error& e) {
    t.outcome = is_out_of_memory(e) ? TrialOutcome::out_of_memory : TrialOutcome::failed;
    t.detail = e.what_without_backtrace();
    t.detail = t.detail.substr(0, t.detail.find('\n'));
  } catch (const std::bad_alloc&) {
    t.outcome = TrialOutcome::out_of_memory;
    t.detail = "std::bad_alloc";
  } catch (const std::exception& e) {
    t.outcome = TrialOutcome::failed;
    t.detail = e.what();
    t.detail = t.detail.substr(0, t.detail.find('\n'));
  }
#if MEMSCALE_HAS_CUDA()
  if (c.device.is_cuda() && t.outcome == TrialOutcome::out_of_memory) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
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
  const auto inputs =
      predictor::detail::training_inputs(model, example_input, "memscale::autotune()", "detach it first");
  const auto& root = inputs.first;
  const auto& forward = inputs.second;
  const auto own = predictor::sizing_of(optimizer);  // throws for a type it cannot run, before anything changes
  const auto parameters = root->parameters();
  const auto device = predictor::detail::model_device(parameters, example_input);

  TuneResult result;
  trial_context context{forward, loss_fn, &optimizer, parameters, device};
  for (const auto& p : parameters) context.static_bytes += static_cast<std::int64_t>(p.nbytes());
  for (const auto& b : root->buffers())
    if (b.defined() && b.device() == device) context.static_bytes += static_cast<std::int64_t>(b.nbytes());
  context.warmup_steps = options.warmup_steps;
  context.timed_steps = options.timed_steps;

  // The budget, as predict() and the planner count it.
  result.budget_bytes = memory_budget_bytes(base.memory_budget_gb, detect_hardware(), device);
  context.budget_bytes = result.budget_bytes;

  auto batches = options.batch_sizes;
  if (batches.empty()) batches.push_back(example_input.size(0));
  std::sort(batches.begin(), batches.end(), std::greater<>());
  batches.erase(std::unique(batches.begin(), batches.end()), batches.end());

  // The cache.
  const auto key = make_key(*root, example_input, device, optimizer, own.name, base, options, result.budget_bytes);
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
        cached->cache_file = result.cache_file;
        cached->cache_key = result.cache_key;
        cached->notes.insert(cached->notes.begin(), result.notes.begin(), result.notes.end());
        cached->seconds = elapsed();
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
  predictor::detail::calibration rows{forward, loss_fn, example_input, device, TORCH_VERSION_MAJOR < 2, {}, nullptr};
  progress_line progress(options.progress);
  std::vector<std::pair<std::int64_t, std::string>> plans;  // (batch, signature) of the candidates that ran
  std::vector<std::size_t> plan_trial;
  int run_count = 0;
  const auto best_so_far = [&]() -> const TuneTrial* {
    const TuneTrial* best = nullptr;
    for (const auto& t : result.trials)
      if (t.outcome == TrialOutcome::fits && (best == nullptr || t.samples_per_second > best->samples_per_second))
        best = &t;
    return best;
  };

  for (std::size_t i = 0; i < result.trials.size(); ++i) {
    auto& t = result.trials[i];
    if (elapsed() >= options.time_budget_seconds) {
      t.detail = "the time budget (" + std::to_string(options.time_budget_seconds) + " s) was spent";
      continue;
    }
    if (run_count >= options.max_trials) {
      t.detail = "the trial budget (" + std::to_string(options.max_trials) + " trials) was spent";
      continue;
    }
    progress.show(i + 1, result.trials.size(), "predicting " + t.label + " @" + std::to_string(t.batch_size),
                  best_so_far(), options.time_budget_seconds - elapsed());
    const auto x = rows.batch_of(t.batch_size);
    std::string signature;
    try {
      Config predicting = t.config;
      const auto p = predictor::run<S>(model, x, optimizer, loss_fn, true, predicting);
      t.predicted_peak_bytes = p.peak_bytes;
      signature = plan_signature(p, t.config);
    } catch (const std::exception& e) {
      std::string what = e.what();
      t.detail = "not predicted (" + what.substr(0, what.find('\n')) + ")";
    }
    box.reset();
    if (!signature.empty()) {
      const auto same = std::find(plans.begin(), plans.end(), std::make_pair(t.batch_size, signature));
      if (same != plans.end()) {
        t.outcome = TrialOutcome::duplicate;
        t.detail = "the same plan as #" + std::to_string(plan_trial[static_cast<std::size_t>(same - plans.begin())]);
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
    if (!signature.empty()) {
      plans.emplace_back(t.batch_size, signature);
      plan_trial.push_back(i);
    }
    run_trial(t, x, context, [&model](const Config& config, const torch::Tensor& input) {
      return memscale::optimize<S>(model, input, config);
    });
    box.reset();
    snapshot.restore();
  }

  if (const auto* best = best_so_far()) {
    result.found = true;
    result.best_trial = static_cast<int>(best - result.trials.data());
    result.best = best->config;
    result.best.enable_logging = base.enable_logging;
    result.best.verify_correctness = base.verify_correctness;
    result.trials[static_cast<std::size_t>(result.best_trial)].config = result.best;
    result.best_batch_size = best->batch_size;
  } else {
    result.best = base;
    result.best_batch_size = example_input.size(0);
  }
  if (device.is_cpu()) {
    if (!memory_tracker::installed())
      result.notes.push_back("the counting CPU allocator is not installed (memscale::memory_tracker::install()): "
                             "trials ran without the hard limit, so one over the budget ran to its end");
    if (!fixed_malloc_mmap_threshold())
      result.notes.push_back("glibc's mmap threshold is not fixed (memscale::fix_malloc_mmap_threshold()): the "
                             "process's measured peaks include what malloc retains and vary run to run");
  }
  result.seconds = elapsed();
  if (options.use_cache && !result.cache_file.empty()) {
    const bool complete = std::none_of(result.trials.begin(), result.trials.end(),
                                       [](const TuneTrial& t) { return t.outcome == TrialOutcome::not_run; });
    if (!complete)
      result.notes.push_back("not cached: the time or trial budget ended the search before every candidate was "
                             "considered");
    else if (const auto problem = store(result.cache_file, key, result); !problem.empty())
      result.notes.push_back(problem);
  }
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

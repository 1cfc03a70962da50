// memscale::autotune's trials: one candidate run as real training steps under
// memscale::optimize, stepping a shadow of the user's optimizer, measured
// (the allocator's peak, the process's or the device's, the median step time)
// and held to the budget by the tracker's hard limit, an out-of-memory caught.
// Also what puts the model back after each trial (the parameter snapshot) and
// the terminal progress line. Internal to autotune().
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <iomanip>
#include <iostream>
#include <memory>
#include <new>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include <torch/torch.h>

#include <memscale/autotuning/result.hpp>
#include <memscale/device/hardware.hpp>
#include <memscale/device/memory_tracker.hpp>
#include <memscale/core/profiler.hpp>
#include <memscale/errors.hpp>
#include <memscale/execute/verify.hpp>
#include <memscale/predict/optimizer_state.hpp>
#include <memscale/predict/predict.hpp>
#include <memscale/techniques/optim8bit.hpp>

#if MEMSCALE_HAS_CUDA()
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace memscale::autotuning::detail {

/// Records the exception in flight as the trial's outcome: an allocation
/// failure as out_of_memory, anything else as failed, with its first line.
inline void record_exception(TuneTrial& t) noexcept {
  const auto first_line = [](std::string what) { return what.substr(0, what.find('\n')); };
  try {
    throw;
  } catch (const c10::Error& e) {
    t.outcome = memscale::detail::is_out_of_memory(e) ? TrialOutcome::out_of_memory : TrialOutcome::failed;
    t.detail = first_line(e.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    t.outcome = TrialOutcome::out_of_memory;
    t.detail = "std::bad_alloc";
  } catch (const std::exception& e) {
    t.outcome = TrialOutcome::failed;
    t.detail = first_line(e.what());
  } catch (...) {
    t.outcome = TrialOutcome::failed;
    t.detail = "an exception of a type not derived from std::exception";
  }
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
    else {
      // Added without options, then given them: LibTorch 2.x's add_param_group merges a group's own
      // options into the defaults (built-in types) or drops them (AdamW8bitOptions).
      shadow->add_param_group(torch::optim::OptimizerParamGroup(group.params()));
      shadow->param_groups().back().set_options(std::move(options));
    }
  }
  return shadow;
}

/// The model's parameters as they were, put back after each trial and, whatever
/// happens, at the end. Kept on the host, so a GPU trial has the room real
/// training would have.
class parameter_snapshot {
 public:
  explicit parameter_snapshot(const std::vector<torch::Tensor>& parameters) : parameters_(parameters) {
    torch::NoGradGuard no_grad;
    for (const auto& p : parameters_) saved_.push_back(p.detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true));
  }
  parameter_snapshot(const parameter_snapshot&) = delete;
  parameter_snapshot& operator=(const parameter_snapshot&) = delete;
  ~parameter_snapshot() {
    try {
      restore();
    } catch (...) {  // never throw from a destructor
    }
  }
  void restore() {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < parameters_.size(); ++i) parameters_[i].detach().copy_(saved_[i]);
  }

 private:
  std::vector<torch::Tensor> parameters_;
  std::vector<torch::Tensor> saved_;
};

/// For a GPU trial: what the caller's model and optimizer hold on the device
/// that training with the winner would not, moved to the host for the trial:
/// the gradients the sandbox set aside (a training step on LibTorch 2.x drops
/// them at zero_grad(); on 1.13 its own take their place) and the optimizer's
/// state of the parameters on `device`, each state through its own serialize()
/// in turn. put_back() returns them bit-identical (new tensors: references the
/// caller kept to the old ones see them no more), and says if it could not; the
/// destructor tries where put_back() was not reached. seed() gives the shadow
/// optimizer a copy on the device, as training has its state before its step.
/// `device` empty: nothing moves.
class host_parking {
 public:
  host_parking(core::verify::sandbox& box, const torch::optim::Optimizer& optimizer,
               std::optional<c10::Device> device)
      : box_(box), device_(device) {
    if (!device_) return;
    try {
      box_.park_gradients_on_host();
      std::set<optim::state_key_type> on_device;  // state lives with its parameter
      for (const auto& group : optimizer.param_groups())
        for (const auto& p : group.params())
          if (p.defined() && p.device() == *device_) on_device.insert(optim::state_key(p));
      for (const auto& item : optimizer.state()) {
        if (!item.second || on_device.count(item.first) == 0) continue;
        states_.push_back({item.first, item.second.get()});
        load(*item.second, bytes_of(*item.second), torch::kCPU);
      }
    } catch (...) {
      try {
        put_back();
      } catch (...) {  // the first error is the one to report
      }
      throw;
    }
  }
  host_parking(const host_parking&) = delete;
  host_parking& operator=(const host_parking&) = delete;
  ~host_parking() {
    try {
      put_back();
    } catch (...) {  // never throw from a destructor
    }
  }

  /// Every parked state and gradient back on the device (each one tried); throws
  /// memscale::Error naming what stayed on the host.
  void put_back() {
    std::string failed;
    for (auto& p : states_) {
      try {
        load(*p.state, bytes_of(*p.state), *device_);
      } catch (const std::exception& e) {
        if (failed.empty()) failed = e.what();
        continue;
      }
      p.state = nullptr;
    }
    const auto left = std::count_if(states_.begin(), states_.end(), [](const parked& p) { return p.state; });
    states_.clear();
    try {
      box_.unpark_gradients();
    } catch (const std::exception& e) {
      if (failed.empty()) failed = e.what();
    }
    if (!failed.empty())
      throw Error("memscale::autotune(): the optimizer's state (" + std::to_string(left) +
                  " parameter(s)) or the gradients set aside could not be put back on " + device_->str() +
                  " after a trial and are on the host: " + failed);
  }

  /// Gives `shadow` (the caller's type over the same parameters) a copy of the
  /// parked state on the device, in place of any it made itself (Adagrad's, at
  /// construction), before the trial's first step, as training holds its state
  /// then. A shadow that made its state in its first step put it in blocks that
  /// step had just freed, and on an H200 the trial then measured 90 MB less than
  /// training with the winner held (1.84 GB; benchmarks/RESULTS.md).
  void seed(torch::optim::Optimizer& shadow) const {
    for (const auto& p : states_) {
      auto copy = p.state->clone();  // its type; every tensor the bytes hold replaced below
      load(*copy, bytes_of(*p.state), *device_);
      shadow.state()[p.key] = std::move(copy);
    }
  }

 private:
  struct parked {
    optim::state_key_type key;
    torch::optim::OptimizerParamState* state;  ///< null once put back
  };
  static std::string bytes_of(const torch::optim::OptimizerParamState& state) {
    torch::serialize::OutputArchive out;
    state.serialize(out);
    std::ostringstream bytes;
    out.save_to(bytes);
    return bytes.str();
  }
  static void load(torch::optim::OptimizerParamState& state, const std::string& bytes, c10::Device device) {
    torch::serialize::InputArchive in;
    in.load_from(bytes.data(), bytes.size(), device);
    state.serialize(in);
  }

  core::verify::sandbox& box_;
  std::optional<c10::Device> device_;
  std::vector<parked> states_;
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
    if (device.is_cpu()) process_.emplace();
  }
  /// Growth of the allocator's live bytes over the scope, or -1 when nothing measures it.
  [[nodiscard]] std::int64_t allocator_growth() const { return peak_ ? peak_->peak_growth() : -1; }
  /// CPU: growth of the process's resident high-water mark over the scope, or -1.
  [[nodiscard]] std::int64_t held_growth() {
    return process_ && process_->active() ? process_->peak_growth() : -1;
  }
  /// CUDA: the caching allocator's peak reserved bytes over the scope (the
  /// peak_scope reset it), every segment it holds counted, those from before
  /// the scope too; else -1.
  [[nodiscard]] std::int64_t reserved_peak() const {
#if MEMSCALE_HAS_CUDA()
    if (device_.is_cuda()) {
      const auto index = device_.has_index() ? device_.index() : c10::DeviceIndex{0};
      return static_cast<std::int64_t>(c10::cuda::CUDACachingAllocator::getDeviceStats(index).reserved_bytes[0].peak);
    }
#endif
    return -1;
  }

 private:
  c10::Device device_;
  std::optional<memory_tracker::reporting_scope> reporting_;
  std::optional<memory_tracker::peak_scope> peak_;
  std::optional<memory_tracker::process_peak_scope> process_;  // CPU
};

/// What a trial needs of the model and the caller.
struct trial_context {
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::function<torch::Tensor(const torch::Tensor&)> loss;
  const torch::optim::Optimizer* optimizer = nullptr;
  std::vector<torch::Tensor> parameters;
  c10::Device device = c10::kCPU;
  std::int64_t static_bytes = 0;  ///< parameters and buffers, live before any trial
  /// CUDA: what lives on the device through the trials that training with the
  /// winner would not hold: the buffers the sandbox keeps aside and the example
  /// input (the data pipeline's, which predict() does not count either). The
  /// gradients it set aside and the optimizer's state wait on the host meanwhile
  /// (host_parking).
  std::int64_t trial_only_bytes = 0;
  torch::Tensor example{};  ///< CUDA: the example input (a trial at another batch makes its own input beside it)
  std::int64_t budget_bytes = 0;
  int warmup_steps = 1;
  int timed_steps = 2;
};

/// Runs trial `t` (already sized) with `attach_guard` making the guard, its
/// shadow optimizer seeded from `parked`; fills in the measurements and the
/// outcome. `outside` (CPU; -1: unknown): what the process holds outside the
/// allocator for this step, as predict() measured it. The caller restores the
/// model afterwards.
template <class AttachGuard>
void run_trial(TuneTrial& t, const torch::Tensor& x, const trial_context& c, const host_parking& parked,
               std::int64_t outside, AttachGuard&& attach_guard) {
  try {
    const bool as_eight_bit =
        t.config.use_8bit_optimizer && dynamic_cast<const optim::AdamW8bit*>(c.optimizer) == nullptr;
    auto shadow = shadow_optimizer(*c.optimizer, as_eight_bit);
    if (!as_eight_bit) parked.seed(*shadow);  // CUDA: the caller's state, as training starts with it
    // CUDA: no earlier trial's reserve reused, nor what seed() freed (the state Adagrad's constructor made).
    memscale::detail::release_cached_device_memory(c.device);
    // The budget as a hard limit (never looser than one the caller set).
    std::optional<memory_tracker::hard_limit_scope> hard;
    if (c.device.is_cpu() && memory_tracker::installed()) {
      auto limit = memory_tracker::current_bytes() + std::max<std::int64_t>(0, c.budget_bytes - c.static_bytes);
      if (const auto outer = memory_tracker::hard_limit()) limit = std::min(limit, *outer);
      hard.emplace(limit);
    }
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
    t.allocator_peak_bytes = allocator >= 0 ? c.static_bytes + allocator : -1;
    if (const auto reserved = meter.reserved_peak(); reserved >= 0) {
      // CUDA: what the device held at the trial's peak, as training holds it: every
      // segment the caching allocator reserved (the slack of those made before the
      // trial too), less what only a trial holds, plus the memory in use outside it
      // (the context). Counting the trial's growth over the model's bytes instead
      // missed 116 MB of 1.46 GB on an H200: the winner, measured to fit, held 4%
      // more than the budget when trained (benchmarks/RESULTS.md).
      const auto own_input = x.is_same(c.example) ? std::int64_t{0} : static_cast<std::int64_t>(x.nbytes());
      t.measured_peak_bytes =
          reserved - c.trial_only_bytes - own_input + memscale::detail::memory_outside_caching_allocator(c.device);
    } else {
      // CPU: the resident high-water mark's growth over the trial, but no less
      // than the allocator's peak plus what predict() measured outside it. The
      // growth alone missed what earlier trials, predict's calibration or
      // training had made resident before this trial (the code, OpenMP's and
      // oneDNN's buffers): a winner measured at 31.6 MB held 46.1 MB when
      // trained in a fresh process (benchmarks/RESULTS.md).
      const auto held = meter.held_growth();
      t.measured_peak_bytes = std::max({t.allocator_peak_bytes, held >= 0 ? c.static_bytes + held : -1,
                                        t.allocator_peak_bytes >= 0 && outside > 0 ? t.allocator_peak_bytes + outside
                                                                                   : -1});
    }
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
  } catch (...) {
    record_exception(t);
  }
  if (t.outcome == TrialOutcome::out_of_memory) memscale::detail::release_cached_device_memory(c.device);
}

}  // namespace memscale::autotuning::detail

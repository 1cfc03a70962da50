// memscale — executor, part 3: the Executor. It swaps forward slots of each torch::nn::Sequential chain
// for technique wrappers and puts the originals back on detach. The chain's
// registered children never change, so parameters(), named_parameters(), state
// dicts and optimizers see the same tensors under the same names. An attachment
// is registered against the model's root module so detach() can find it. Every
// step either completes or is rolled back: a throwing wrap leaves the model as it was.
// Threads: wrap/detach/is_optimized may be called from any thread, but not while
// the model runs a forward elsewhere; without an example input, the first
// training forward plans and swaps slots, so make it from one thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <iostream>
#include <iomanip>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#include <memscale/config.hpp>
#include <memscale/core/call_sites.hpp>
#include <memscale/core/decision_engine.hpp>
#include <memscale/core/hardware.hpp>
#include <memscale/core/memory_tracker.hpp>
#include <memscale/core/plan.hpp>
#include <memscale/core/profiler.hpp>
#include <memscale/core/registry.hpp>
#include <memscale/core/slots.hpp>
#include <memscale/core/verify.hpp>
#include <memscale/detail/assert.hpp>
#include <memscale/detail/fault_injection.hpp>
#include <memscale/detail/rng.hpp>
#include <memscale/errors.hpp>
#include <memscale/observability/log.hpp>
#include <memscale/offload/engine.hpp>
#include <memscale/offload/hooks.hpp>
#include <memscale/techniques/checkpoint.hpp>
#include <memscale/techniques/mixed_precision.hpp>
#include <memscale/techniques/offload.hpp>
#include <memscale/techniques/optim8bit.hpp>
#include <memscale/techniques/tile.hpp>

namespace memscale::core {

/// What the Strategy and the Config allow: the Strategy's way to wrap a run of
/// slots per technique (empty when the Strategy or the Config excludes it).
struct technique_set {
  using wrap_fn = std::function<torch::nn::AnyModule(std::vector<torch::nn::AnyModule>, const wrap_context&)>;
  wrap_fn checkpoint;
  wrap_fn offload;
  wrap_fn tile;
};

/// Nominal one-way rates the planner assumes for an offload transfer (the
/// engine's statistics report what a step really took).
inline constexpr double nominal_host_link_bytes_per_second = 16e9;  // pinned PCIe copies
inline constexpr double nominal_disk_bytes_per_second = 1e9;        // a local SSD

class attachment;

/// Runs after this process decided a plan and before anything is applied: gets
/// the chains just profiled and the local plan, returns the plan to apply.
/// Data parallel training sets it so every rank applies rank 0's plan
/// (memscale/distributed.hpp); it may throw (nothing has changed yet).
using plan_agreement = std::function<engine_plan(const std::vector<chain_profile>& profiles, engine_plan local)>;

/// Slot 0 of a chain whose plan waits for its first input (wrap without an example).
class PlanningProbeImpl : public torch::nn::Module {
 public:
  PlanningProbeImpl(std::weak_ptr<attachment> owner, std::size_t chain, torch::nn::AnyModule original)
      : torch::nn::Module("memscale::PlanningProbe"),
        owner_(std::move(owner)),
        chain_(chain),
        original_(std::move(original)) {}
  torch::Tensor forward(torch::Tensor x);

 private:
  std::weak_ptr<attachment> owner_;
  std::size_t chain_;
  torch::nn::AnyModule original_;
};

/// Whether a slot holds one of memscale's wrappers.
inline bool is_memscale_slot(const torch::nn::AnyModule& slot) {
  const auto& p = slot.ptr();
  return std::dynamic_pointer_cast<CheckpointSegmentImpl>(p) || std::dynamic_pointer_cast<OffloadSegmentImpl>(p) ||
         std::dynamic_pointer_cast<TileSegmentImpl>(p) ||
         std::dynamic_pointer_cast<PassThroughImpl>(p) || std::dynamic_pointer_cast<AutocastSlotImpl>(p) ||
         std::dynamic_pointer_cast<PlanningProbeImpl>(p) || std::dynamic_pointer_cast<InputCaptureImpl>(p);
}

/// Where a chain's units come from.
enum class chain_source : std::uint8_t {
  sequential,   ///< the slots of a torch::nn::Sequential (swapped in place)
  call_sites,   ///< recorded memscale::forward calls (run through the call sequence)
  whole_model,  ///< no unit boundaries: the whole forward, one unit (offload only)
};

struct managed_chain {
  chain_ref ref;  ///< ref.sequential is null unless source is sequential
  std::vector<torch::nn::AnyModule> originals;
  bool planned = false;
  chain_source source = chain_source::sequential;
  std::vector<std::string> unit_names;     ///< call sites: "blocks.3 (Block)"
  std::vector<torch::Tensor> unit_inputs;  ///< call sites: what each call received (until planned)
  std::vector<std::size_t> positions;      ///< call sites: each unit's place in the call sequence
  bool inside_call_site = false;           ///< a Sequential first run inside a memscale::forward call
};

/// One memscale::forward call seen while recording.
struct call_record {
  const torch::nn::Module* module = nullptr;
  torch::nn::AnyModule slot;  ///< empty: the call cannot be a unit (why_not says why)
  std::string why_not;
  torch::Tensor input;        ///< detached
  int depth = 0;
};

/// A call of the planned sequence and what runs for it (empty: the module itself).
struct planned_call {
  const torch::nn::Module* module = nullptr;
  torch::nn::AnyModule runner;
};

/// While planning runs on this thread, chain probes and call sites run as they are.
inline bool& planning_on_this_thread() {
  thread_local bool planning = false;
  return planning;
}

/// The factor by which planning on this thread scales the per-sample figures of
/// each profile (bytes and times of activations, the leading extent of each
/// shape) before deciding: memscale::predict profiles at a small batch and plans
/// for the full one. 1 outside a profile_scale_scope.
inline double& profile_batch_scale() {
  thread_local double scale = 1.0;
  return scale;
}

/// What planning on this thread takes as the bytes the process holds outside
/// LibTorch's allocator (CPU), instead of measuring them (attachment's
/// outside_allocator_probe): memscale::predict passes the figure it measured over
/// its calibration steps, as the profile it plans from ran at a small batch. -1
/// (measure) outside a profile_scale_scope that sets it.
inline std::int64_t& profile_outside_allocator_bytes() {
  thread_local std::int64_t bytes = -1;
  return bytes;
}

/// Sets profile_batch_scale() (and, when given, profile_outside_allocator_bytes())
/// for its lifetime, then puts back what it found.
class profile_scale_scope {
 public:
  explicit profile_scale_scope(double scale, std::int64_t outside_allocator_bytes = -1)
      : before_(profile_batch_scale()), outside_before_(profile_outside_allocator_bytes()) {
    profile_batch_scale() = scale;
    profile_outside_allocator_bytes() = outside_allocator_bytes;
  }
  profile_scale_scope(const profile_scale_scope&) = delete;
  profile_scale_scope& operator=(const profile_scale_scope&) = delete;
  ~profile_scale_scope() {
    profile_batch_scale() = before_;
    profile_outside_allocator_bytes() = outside_before_;
  }

 private:
  double before_;
  std::int64_t outside_before_;
};

/// What the process comes to hold beyond LibTorch's allocator while memscale
/// runs the model to plan it on CPU (verify's unoptimized step, the example
/// forward, the profiling at the full batch): the growth of the process's
/// resident peak over the span minus the growth of the allocator's peak. Most of
/// it is made once, at the first operations of that size (OpenMP and OpenBLAS
/// worker threads' stacks and buffers, oneDNN's scratchpads), so it is measured
/// in the process where training will run; a process that has trained before
/// made it already and reads about 0 (nothing new to reserve). With glibc's
/// dynamic mmap threshold it also holds what malloc keeps of freed blocks.
/// Thread-bound: open and close it on one thread, inside any reporting scope
/// open around it.
class outside_allocator_probe {
 public:
  outside_allocator_probe() {
    if (!process_.active()) return;
    if (!memory_tracker::installed()) {
      reporting_.emplace();
      if (!reporting_->active()) return;
    }
    allocator_.emplace(c10::kCPU);
  }
  outside_allocator_probe(const outside_allocator_probe&) = delete;
  outside_allocator_probe& operator=(const outside_allocator_probe&) = delete;

  /// The bytes so far (>= 0), or -1 where the process's or the allocator's
  /// peak cannot be read (no /proc/self, or a LibTorch profiler holds the slot).
  [[nodiscard]] std::int64_t bytes() {
    if (!allocator_) return -1;
    const auto process = process_.peak_growth();
    if (process < 0) return -1;
    return std::max<std::int64_t>(0, process - allocator_->peak_growth());
  }

 private:
  memory_tracker::process_peak_scope process_;
  std::optional<memory_tracker::reporting_scope> reporting_;
  std::optional<memory_tracker::peak_scope> allocator_;  // closes before reporting_
};

/// A profile measured at batch b, as the profile at batch b * scale would read:
/// activation bytes and times scale with the batch (what the activations are),
/// and so does the first extent of each shape.
inline void scale_profile(chain_profile& profile, double scale) {
  const auto times = [scale](std::int64_t bytes) {
    return static_cast<std::int64_t>(std::llround(static_cast<double>(bytes) * scale));
  };
  for (auto& slot : profile.slots) {
    slot.input_bytes = times(slot.input_bytes);
    slot.output_bytes = times(slot.output_bytes);
    slot.saved_bytes = times(slot.saved_bytes);
    slot.workspace_bytes = times(slot.workspace_bytes);
    slot.forward_seconds *= scale;
    slot.backward_seconds *= scale;
    if (slot.input_extents[0] > 0) slot.input_extents[0] = std::max<std::int64_t>(1, times(slot.input_extents[0]));
  }
  if (!profile.input_shape.empty()) profile.input_shape[0] = std::max<std::int64_t>(1, times(profile.input_shape[0]));
}

/// Sets planning_on_this_thread() for its lifetime (when `on`; else leaves it
/// as it is), then puts back what it found.
class planning_scope {
 public:
  explicit planning_scope(bool on = true) : before_(planning_on_this_thread()) {
    planning_on_this_thread() = on || before_;
  }
  planning_scope(const planning_scope&) = delete;
  planning_scope& operator=(const planning_scope&) = delete;
  ~planning_scope() { planning_on_this_thread() = before_; }

 private:
  bool before_;
};

class attachment;

/// Lends attach()'s outside_allocator_probe to an attachment's planning for the
/// binding's lifetime.
class outside_probe_binding {
 public:
  outside_probe_binding(attachment& attached, outside_allocator_probe* probe);
  outside_probe_binding(const outside_probe_binding&) = delete;
  outside_probe_binding& operator=(const outside_probe_binding&) = delete;
  ~outside_probe_binding();

 private:
  attachment& attached_;
};

class attachment : public std::enable_shared_from_this<attachment>, public call_site_host {
  friend class outside_probe_binding;

 public:
  attachment(const std::shared_ptr<torch::nn::Module>& root, std::vector<chain_ref> chains, Config config,
             technique_set techniques, plan_agreement agree = {},
             std::function<torch::Tensor(const torch::Tensor&)> whole_forward = {})
      : root_(root),
        config_(std::move(config)),
        techniques_(techniques),
        agree_(std::move(agree)),
        whole_forward_(std::move(whole_forward)) {
    for (auto& ref : chains) {
      managed_chain chain;
      chain.ref = std::move(ref);
      for (const auto& slot : *chain.ref.sequential) chain.originals.push_back(slot);
      chains_.push_back(std::move(chain));
    }
    for (const auto& item : root->named_modules(/*name_prefix=*/"", /*include_self=*/true))
      paths_.emplace(item.value().get(), item.key());
    report_.mode = config_.mode;
    report_.hardware = detect_hardware();
    add_technique_notes();
  }

  attachment(const attachment&) = delete;
  attachment& operator=(const attachment&) = delete;
  /// A model dropped without detach() takes its attachment with it: its call
  /// sites stop reaching it.
  ~attachment() override { stop_listening(); }

  [[nodiscard]] Report report() const {
    Report r;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      r = report_;
    }
    const auto diverged = diverged_forwards_.load();
    const auto short_ones = short_forwards_.load();
    if (diverged != 0 || short_ones != 0)
      r.notes.push_back("call sites: " + std::to_string(diverged) +
                        " forward(s) left the recorded call sequence (each ran unoptimized from there on), " +
                        std::to_string(short_ones) + " ended before its last recorded call");
    return r;
  }

  /// Makes memscale::forward calls on the model's modules reach this attachment
  /// (undone by restore()).
  void listen_to_call_sites() {
    auto self = shared_from_this();
    for (const auto& [module, path] : paths_) call_sites::index::global().add(module, self);
    if (!listening_.exchange(true)) call_sites::active_hosts().fetch_add(1);
  }

  void stop_listening() noexcept {
    if (!listening_.exchange(false)) return;
    call_sites::index::global().remove_host(this);
    call_sites::active_hosts().fetch_sub(1);
  }

  /// memscale::forward: records, plans (lazily) or runs a call (call_sites.hpp).
  call_ticket begin_call(torch::nn::Module& module, int depth, const std::function<torch::nn::AnyModule()>* make_slot,
                         const torch::Tensor* input, const char* why_not) override {
    if (detail::recompute_scope::current() != nullptr || planning_on_this_thread()) return {};
    switch (sites_.load()) {
      case sites_state::waiting: {
        // Without an example input, record the first training forward.
        if (!training_call() || !torch::GradMode::is_enabled() || c10::InferenceMode::is_enabled()) return {};
        std::lock_guard<std::mutex> planning(plan_mutex_);
        if (sites_.load() == sites_state::waiting) {
          recording_epoch_ = offload::backwards_started();
          sites_ = sites_state::recording_lazily;
        }
        [[fallthrough]];
      }
      case sites_state::recording_lazily:
        if (recording_complete(module, depth)) {
          plan_recorded_calls();
          return sites_.load() == sites_state::active ? next_call(module, depth) : call_ticket{};
        }
        [[fallthrough]];
      case sites_state::recording:
        record(module, depth, make_slot, input, why_not);
        return {};
      case sites_state::active: return next_call(module, depth);
      case sites_state::off: return {};
    }
    return {};
  }

  /// The offload engine, once a plan offloaded something (else null).
  [[nodiscard]] std::shared_ptr<offload::engine> offload_engine() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return engine_;
  }

  /// Runs `forward` once (no grad, no visible RNG draws, buffers restored) to learn
  /// what each chain receives. Chains the forward never reaches get no input.
  std::vector<torch::Tensor> capture_inputs(const std::function<void()>& forward) {
    detail::fault_point(detail::pipeline_stage::capture);
    sites_ = sites_state::recording;  // memscale::forward calls of the example forward are recorded
    std::vector<std::shared_ptr<InputCaptureImpl>> probes;
    slot_transaction probes_in_place;  // always rolled back: capture changes nothing
    for (auto& chain : chains_) {
      probes.push_back(std::make_shared<InputCaptureImpl>(chain.originals.front()));
      probes_in_place.replace(*chain.ref.sequential, 0, torch::nn::AnyModule(probes.back()));
    }
    {
      auto root = root_.lock();
      MEMSCALE_ASSERT(root != nullptr, "the model outlived its wrap() call");
      torch::NoGradGuard no_grad;
      detail::rng_fork no_visible_draws(detail::devices_of(root->parameters()));
      detail::buffer_restore keep_buffers(*root);
      try {
        forward();
      } catch (const c10::Error& e) {
        throw UnsupportedModelError(
            "memscale: running the example input through the model failed: " +
            std::string(e.what_without_backtrace()) +
            ". memscale needs each Sequential's first slot to take one Tensor; if the error is about the "
            "number or type of arguments, that Sequential cannot be optimized");
      }
    }
    std::vector<torch::Tensor> inputs;
    for (std::size_t c = 0; c < probes.size(); ++c) {
      // A Sequential first reached inside a memscale::forward call is part of that unit.
      if (probes[c]->inside_call_site()) {
        chains_[c].planned = true;
        chains_[c].inside_call_site = true;
        inputs.emplace_back();
        continue;
      }
      inputs.push_back(probes[c]->captured());
    }
    return inputs;
  }

  /// Profiles, plans and applies the chains with a defined input; the others get
  /// a planning probe. Nothing changes in the model unless all of it succeeds.
  void plan_and_apply(std::vector<torch::Tensor> inputs) {
    inputs.resize(chains_.size());
    std::vector<std::size_t> ready;
    for (std::size_t c = 0; c < chains_.size(); ++c)
      if (inputs[c].defined()) ready.push_back(c);
    const bool captured = sites_.load() == sites_state::recording;
    if (captured) {
      for (auto c : add_call_chains(/*lazy=*/false)) {
        ready.push_back(c);
        inputs.push_back(chains_[c].unit_inputs.front());
      }
    }
    // No Sequential and no call site: what needs no unit boundaries, from the example.
    if (captured && chains_.empty() && allows_whole_model_offload() && whole_input_.defined()) {
      add_whole_model_chain();
      ready.push_back(0);
      inputs.push_back(whole_input_);
    }
    if (!captured && chains_.empty())
      report_.notes.emplace_back(
          "no torch::nn::Sequential: the units will be the memscale::forward calls of the first training forward "
          "(recorded then, planned at the next forward). A model with neither gets whole-model offload only when "
          "wrapped with an example input");
    if (captured && chains_.empty())
      throw UnsupportedModelError(
          "memscale: the model (" + root_name() + ") has no unit boundaries (no torch::nn::Sequential, and its "
          "example forward made no memscale::forward call), and what needs none cannot apply: " +
          (whole_forward_ ? std::string("offload is disabled (Config::enable_offloading, the Strategy, or "
                                        "memscale's autograd engine is not the default one)")
                          : std::string("its forward does not take and return one Tensor, so it cannot be profiled")) +
          ". Mark the blocks your forward loops over with `x = memscale::forward(*blocks[i], x);` (or keep them "
          "in a torch::nn::Sequential) to get checkpointing, tiling and per-unit offload");
    commit_plan(ready, inputs, /*probe_the_others=*/true);
    if (captured && sites_.load() == sites_state::recording) sites_ = sites_state::off;  // no call sites
  }

  /// The example input, for a model planned as one whole-forward unit.
  void set_whole_input(const torch::Tensor& x) { whole_input_ = x.detach(); }

  /// Called by a chain's planning probe on its first training input. The probe
  /// runs inside slot 0's AnyModule holder, which planning replaces: the holder
  /// moves to `displaced` and lives until this call (and the probe's) returns.
  torch::Tensor plan_on_first_call(std::size_t c, const torch::Tensor& x, torch::nn::AnyModule& displaced) {
    std::lock_guard<std::mutex> planning(plan_mutex_);
    if (!chains_[c].planned) {
      std::vector<torch::Tensor> inputs(chains_.size());
      inputs[c] = x.detach();
      try {
        commit_plan({c}, inputs, /*probe_the_others=*/false, &displaced);
      } catch (...) {
        // Leave the chain as it was before wrap(), then report the failure.
        auto slot0 = chains_[c].ref.sequential->begin();
        if (slot0->ptr().get() != chains_[c].originals.front().ptr().get()) {
          if (displaced.is_empty()) displaced = std::move(*slot0);
          *slot0 = chains_[c].originals.front();
        }
        chains_[c].planned = true;
        throw;
      }
    }
    return chains_[c].ref.sequential->begin()->forward<torch::Tensor>(x);
  }

  /// One training step (forward, a mean-square loss, backward) of the example's
  /// first two rows in verify's sandbox (gradients, buffers and the RNG put
  /// back), run directly, so that outside_allocator_probe sees what the worker
  /// threads and autograd make outside the allocator. Nothing for a forward
  /// that is not Tensor -> Tensor. A failure is a note: the reserve then comes
  /// from the example forward and the profiling only.
  void run_native_warmup(const torch::Tensor& example) {
    if (!whole_forward_) return;
    auto root = root_.lock();
    MEMSCALE_ASSERT(root != nullptr, "the model outlived its wrap() call");
    try {
      verify::sandbox box(*root);
      (void)verification_step(box, example.narrow(0, 0, std::min<std::int64_t>(2, example.size(0))),
                              /*as_before_wrap=*/true);
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mutex_);
      report_.notes.push_back("the training step at two rows that measures what the process holds outside the "
                              "allocator failed (" + memscale::detail::message_of(e) +
                              "); the reserve covers the example forward and the profiling only");
    }
  }

  /// verify_correctness: one step of `example` in `box`, through the model as
  /// it is now; `as_before_wrap`: memscale::forward calls run directly (the
  /// unoptimized step, taken before the plan is applied).
  verify::step_outcome verification_step(verify::sandbox& box, const torch::Tensor& example, bool as_before_wrap) {
    MEMSCALE_ASSERT(whole_forward_, "verify_correctness needs the model's Tensor -> Tensor forward");
    planning_scope direct_calls(as_before_wrap);
    return box.run(whole_forward_, example);
  }

  /// Compares the two verification steps, puts the outcome in the report and
  /// logs it; throws CorrectnessError when they differ beyond what the plan's
  /// techniques allow (the caller then restores the model).
  void judge_verification(const verify::sandbox& box, const verify::step_outcome& unoptimized,
                          const verify::step_outcome& optimized, c10::Device device) {
    double tolerance = 0.0;
    std::string reason = "checkpoint and offload leave the arithmetic unchanged";
    if (config_.use_mixed_precision) {
      tolerance = verify_mixed_precision_tolerance;
      reason = "mixed precision: the optimized chains run in reduced precision";
    } else if (report_.tiled_segments() > 0) {
      tolerance = verify_tiling_tolerance;
      reason = "tiling adds the chunks' weight gradients in another order";
    } else if (device.is_cuda() && !at::globalContext().deterministicAlgorithms()) {
      tolerance = verify_nondeterministic_tolerance;
      reason = "CUDA without torch's deterministic algorithms: some kernels add in another order on each run";
    }
    auto outcome = verify::judge(box, unoptimized, optimized, tolerance, reason);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      report_.verification = outcome.check;
    }
    if (config_.enable_logging) {
      try {
        std::clog << "[memscale] " << outcome.check.str() << "\n";
      } catch (...) {
      }
    }
    if (!outcome.first_mismatch) return;
    const auto& [what, how] = *outcome.first_mismatch;
    std::ostringstream message;
    message << "memscale: verify_correctness: one step of the example input gives a different " << what
            << " with the plan applied than without it: " << how << " (";
    if (tolerance == 0.0) message << "bit-identity required: " << reason;
    else message << "allowed: " << std::scientific << std::setprecision(2) << tolerance << ", " << reason;
    message << std::defaultfloat << "; loss " << std::setprecision(9) << outcome.check.loss_baseline << " unoptimized, "
            << outcome.check.loss_optimized << " optimized). The plan (" << report_.checkpointed_segments()
            << " checkpointed segment(s), " << report_.offloaded_units()
            << " offloaded unit(s)) is not applied: the model is left unoptimized and unchanged. Please report "
               "this with the model; meanwhile exclude the technique (Config::enable_checkpointing, "
               "enable_offloading, enable_tiling, use_mixed_precision) that the parameter's unit uses";
    throw CorrectnessError(what, message.str());
  }

  /// Whether the model is in training mode (planning waits for a training call).
  [[nodiscard]] bool training_call() const {
    auto root = root_.lock();
    return root && root->is_training();
  }

  /// Puts every original slot back, stops listening to call sites and closes a
  /// whole-model offload scope. Never throws.
  void restore() noexcept {
    std::lock_guard<std::mutex> planning(plan_mutex_);
    sites_ = sites_state::off;
    stop_listening();
    sequence_.clear();
    whole_scope_.reset();
    for (auto& chain : chains_) {
      if (chain.source != chain_source::sequential) continue;
      auto it = chain.ref.sequential->begin();
      for (std::size_t k = 0; k < chain.originals.size(); ++k, ++it) *it = chain.originals[k];
    }
  }

 private:
  // verify_correctness's relative L2 tolerances where bit-identity cannot hold
  // (measured on the example GPT and the tests' models: see the README).
  static constexpr double verify_mixed_precision_tolerance = 5e-2;
  static constexpr double verify_tiling_tolerance = 1e-4;
  static constexpr double verify_nondeterministic_tolerance = 1e-4;

  void add_technique_notes() {
    if (techniques_.tile && !config_.enable_checkpointing)
      report_.notes.emplace_back("enable_tiling: tiling chunks checkpointed runs, and enable_checkpointing is off, "
                                 "so nothing is tiled");
    else if (techniques_.tile)
      report_.notes.emplace_back("enable_tiling (experimental): checkpointed runs of row-independent layers may run "
                                 "over chunks (rule R10); gradients then equal the untiled ones up to summation "
                                 "order");
    if (config_.use_mixed_precision)
      report_.notes.emplace_back(
          "use_mixed_precision: the layers of the optimized chains run their forward under autocast (bfloat16 "
          "on CPU, float16 on CUDA; scale float16 losses with memscale::amp::loss_scaler); backward, the "
          "optimizer step and code outside the chains do not. To autocast the rest of the forward and the "
          "loss too, open a memscale::autocast_scope around them. The plan was profiled in full precision" +
          std::string(TORCH_VERSION_MAJOR < 2 ? ". LibTorch 1.13: CPU LayerNorm refuses a bfloat16 input with "
                                                "float32 weights under autocast (fixed in 2.x)"
                                              : ""));
    if (config_.use_8bit_optimizer)
      report_.notes.emplace_back("use_8bit_optimizer: build the optimizer with memscale::make_optimizer(config, "
                                 "params, options) to get memscale::optim::AdamW8bit (about 2.03 bytes of state per "
                                 "parameter instead of AdamW's 8); the plan budgets that state");
    if (config_.auto_policy)
      report_.notes.emplace_back("auto_policy: the Stage 1 policy is not implemented in this release; the "
                                 "Config is used as given");
    if (config_.observability_port)
      report_.notes.emplace_back("observability_port: the metrics endpoint is not implemented in this release");
  }

  /// What a plan changes besides Sequential slots, made before it commits and
  /// moved into place after (noexcept).
  struct pending_changes {
    slot_transaction swaps;
    std::vector<std::pair<std::size_t, torch::nn::AnyModule>> runners;  // call sequence position -> runner
    std::unique_ptr<offload_scope> whole_scope;
  };

  /// Plans chains `ready`, applies the plan (and probes on the other chains when
  /// asked) in one transaction, then publishes the report.
  void commit_plan(const std::vector<std::size_t>& ready, const std::vector<torch::Tensor>& inputs,
                   bool probe_the_others, torch::nn::AnyModule* displaced = nullptr) {
    planning_scope planning;
    Report next = report_;
    std::vector<std::vector<unit>> units;
    if (!ready.empty()) units = plan(ready, inputs, next);
    pending_changes changes;
    bool first_change = true;
    for (std::size_t i = 0; i < ready.size(); ++i) {
      // plan() appended the profiles of `ready` last, in order.
      const auto& profile = next.chains[next.chains.size() - ready.size() + i];
      apply_units(ready[i], units[i], profile.supported, changes, first_change);
    }
    for (std::size_t c = 0; probe_the_others && c < chains_.size(); ++c) {
      if (chains_[c].source != chain_source::sequential || chains_[c].planned) continue;
      if (std::find(ready.begin(), ready.end(), c) != ready.end()) continue;
      changes.swaps.replace(*chains_[c].ref.sequential, 0,
                            torch::nn::AnyModule(std::make_shared<PlanningProbeImpl>(weak_from_this(), c,
                                                                                      chains_[c].originals.front())));
      after_first_change(first_change);
    }
    auto sequence = pending_sequence_;  // copies AnyModule handles only
    for (auto& [position, runner] : changes.runners) sequence[position].runner = std::move(runner);
    next.notes.insert(next.notes.end(), pending_notes_.begin(), pending_notes_.end());
    detail::fault_point(detail::pipeline_stage::commit);
    // Nothing below may throw: the slots are swapped, and a caller that saw an
    // exception would restore only some of them.
    changes.swaps.commit(displaced);
    for (auto c : ready) {
      chains_[c].planned = true;
      chains_[c].unit_inputs.clear();  // the recorded activations are not needed any more
    }
    if (!pending_sequence_.empty()) {
      sequence_ = std::move(sequence);
      cursor_ = 0;
      diverged_ = false;
      cursor_epoch_ = offload::backwards_started();
      sites_ = sites_state::active;
    }
    pending_sequence_.clear();
    pending_notes_.clear();
    if (changes.whole_scope) whole_scope_ = std::move(changes.whole_scope);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      std::swap(report_, next);
      observability::log_report(config_, report_);  // noexcept
    }
  }

  void after_first_change(bool& first_change) {
    if (first_change) {
      first_change = false;
      detail::fault_point(detail::pipeline_stage::apply);  // a failure mid-way, after one slot changed
    }
  }

  /// Profiles chains `which` (inputs indexed by chain) and runs the engine; fills `out`.
  std::vector<std::vector<unit>> plan(const std::vector<std::size_t>& which,
                                      const std::vector<torch::Tensor>& inputs, Report& out) {
    const auto device = inputs[which.front()].device();
    bool training = true;
    if (auto root = root_.lock()) training = root->is_training();
    const auto options = profile_options_from(config_, training);
    detail::fault_point(detail::pipeline_stage::profile);
    // CPU: what the process holds beyond the allocator, measured over the
    // profiling here unless attach() measures from before the example forward.
    const bool measure_outside = device.is_cpu() && !out.planned && profile_outside_allocator_bytes() < 0;
    std::optional<outside_allocator_probe> own_probe;
    if (measure_outside && outside_probe_ == nullptr) own_probe.emplace();
    std::vector<chain_profile> profiles;
    {
      torch::AutoGradMode grad_on(true);  // profiling measures what backward keeps
      for (auto c : which) {
        const auto& chain = chains_[c];
        profiles.push_back(chain.source == chain_source::call_sites
                               ? profile_chain(chain.ref.path, chain.originals, inputs[c], options,
                                               &chain.unit_inputs, chain.unit_names)
                               : profile_chain(chain.ref.path, chain.originals, inputs[c], options));
      }
    }
    if (const double scale = profile_batch_scale(); scale != 1.0)
      for (auto& p : profiles) scale_profile(p, scale);
    detail::fault_point(detail::pipeline_stage::plan);

    out.device = device.str();
    out.budget_bytes = memory_budget_bytes(config_.memory_budget_gb, out.hardware, device);
    out.usable_bytes = static_cast<std::int64_t>(static_cast<double>(out.budget_bytes) *
                                                 config_.target_gpu_utilization);
    if (!out.planned) {
      out.parameter_bytes = out.gradient_bytes = out.buffer_bytes = out.optimizer_reserve_bytes = 0;
      out.outside_allocator_bytes = 0;
      if (device.is_cpu()) {
        std::int64_t outside = profile_outside_allocator_bytes();
        if (measure_outside) outside = (own_probe ? *own_probe : *outside_probe_).bytes();
        if (outside >= 0) {
          out.outside_allocator_bytes = outside;
        } else {
          out.notes.push_back("the process's resident peak could not be read (/proc/self, or a LibTorch profiler "
                              "holds the memory-reporting slot): what it holds outside LibTorch's allocator is "
                              "not reserved in the budget");
        }
        if (config_.memory_budget_gb && !fixed_malloc_mmap_threshold())
          out.notes.push_back("glibc's mmap threshold is not fixed: freed tensor memory may stay resident in "
                              "malloc's heaps, so the process can hold well above the planned peak; call "
                              "memscale::fix_malloc_mmap_threshold() (or set MALLOC_MMAP_THRESHOLD_=131072) "
                              "before training for a CPU budget that holds");
      }
      if (auto root = root_.lock()) {
        for (const auto& p : root->parameters()) {
          if (p.device() != device) continue;
          out.parameter_bytes += static_cast<std::int64_t>(p.nbytes());
          if (!p.requires_grad()) continue;
          out.gradient_bytes += static_cast<std::int64_t>(p.nbytes());
          // AdamW keeps two moments of the parameter's size; AdamW8bit one byte each
          // plus a float per block (small tensors stay 32-bit).
          out.optimizer_reserve_bytes += config_.use_8bit_optimizer
                                             ? optim::optimizer_state_bytes(p.numel(), true)
                                             : 2 * static_cast<std::int64_t>(p.nbytes());
        }
        for (const auto& b : root->buffers())
          if (b.device() == device) out.buffer_bytes += static_cast<std::int64_t>(b.nbytes());
      }
    } else {
      // Chains planned earlier keep their forward bytes while this one runs.
      out.earlier_chains_bytes = 0;
      for (std::size_t c = 0; c < out.chains.size(); ++c)
        out.earlier_chains_bytes += project_chain(out.chains[c].slots, out.plan.units[c]).forward_end;
    }

    std::vector<std::vector<slot_cost>> costs;
    std::vector<bool> supported;
    for (const auto& p : profiles) {
      costs.push_back(p.slots);
      supported.push_back(p.supported && p.slots.size() == chains_[which[costs.size() - 1]].originals.size());
    }
    engine_input in;
    in.mode = config_.mode;
    in.checkpointing_allowed = config_.enable_checkpointing && static_cast<bool>(techniques_.checkpoint);
    in.force_optimize = config_.force_optimize;
    in.usable_bytes = out.usable_bytes;
    in.static_bytes = out.static_bytes();
    in.tiling_allowed = in.checkpointing_allowed && static_cast<bool>(techniques_.tile);
    in.offload_allowed = static_cast<bool>(techniques_.offload);
    for (auto c : which) in.segment_limit.push_back(chains_[c].source == chain_source::sequential ? 0 : 1);
    if (chains_[which.front()].source == chain_source::whole_model) {  // the only chain then
      in.checkpointing_allowed = in.tiling_allowed = false;
      in.whole_model_group_bytes = whole_group_bytes;
    }
    // On CUDA this also finds out whether memscale's engine can run the
    // process's CUDA backwards at all (and hands them back to LibTorch's if not).
    if (in.offload_allowed || device.is_cuda()) {
      // Offload lives on saved-tensor hooks: without them it would save nothing.
      if (const auto why = offload::hooks_unavailable_reason(device); !why.empty() && in.offload_allowed) {
        in.offload_allowed = false;
        const auto note = "offload disabled: " + why + "; the plan uses the other techniques only";
        if (std::find(out.notes.begin(), out.notes.end(), note) == out.notes.end()) out.notes.push_back(note);
        if (config_.enable_logging) std::clog << "[memscale] warning: " << note << "\n";
      }
    }
    if (in.offload_allowed) {
      const auto engine_options = offload::options_from(config_);
      const auto tiers = offload_room(device, engine_options);
      // Chains planned earlier (lazy planning) already use part of the room.
      std::int64_t used = 0;
      for (std::size_t c = 0; c < out.chains.size() && c < out.plan.units.size(); ++c)
        used += project_chain(out.chains[c].slots, out.plan.units[c]).offloaded_bytes;
      in.offload_budget_bytes = std::max<std::int64_t>(0, tiers.first - used);
      in.offload_bytes_per_second = tiers.second;
      in.offload_min_bytes = engine_options.min_bytes;
    }
    auto decided = decide(costs, supported, in);
    if (agree_) decided = agree_(profiles, std::move(decided));

    // Merge into the report: chains planned earlier stay; indices shift.
    const int offset = static_cast<int>(out.chains.size());
    for (auto& d : decided.decisions) d.chain += offset;
    if (!out.planned) {
      out.plan = decided;
    } else {
      out.plan.pressure = decided.pressure;
      out.plan.baseline_peak = decided.baseline_peak;
      out.plan.planned_peak = decided.planned_peak;
      out.plan.target_bytes = decided.target_bytes;
      out.plan.overall = decided.overall;
      out.plan.units.insert(out.plan.units.end(), decided.units.begin(), decided.units.end());
      out.plan.segment_length.insert(out.plan.segment_length.end(), decided.segment_length.begin(),
                                     decided.segment_length.end());
      out.plan.decisions.insert(out.plan.decisions.end(), decided.decisions.begin(), decided.decisions.end());
    }
    out.chains.insert(out.chains.end(), profiles.begin(), profiles.end());
    out.planned = true;
    if ((decided.overall == rule_id::checkpoint_segment || decided.overall == rule_id::tile_segment) &&
        decided.planned_peak > decided.target_bytes && config_.mode != OptimizationMode::Aggressive)
      out.notes.push_back("the projected peak " + detail::format_bytes(decided.planned_peak) +
                          " stays above the target " + detail::format_bytes(decided.target_bytes) + ": " +
                          (decided.overall == rule_id::tile_segment ? "checkpointing and tiling" : "checkpointing") +
                          " alone cannot meet this budget; this is the lowest peak the rules found");
    return decided.units;
  }

  /// Room in the offload tiers for tensors on `device` (the engine's caps, see
  /// offload::options_from), and the transfer rate to the tier they reach first:
  /// host tiers then disk for CUDA, disk only for CPU tensors.
  static std::pair<std::int64_t, double> offload_room(const c10::Device& device, const offload::engine_options& o) {
    const std::int64_t disk = o.disk_bytes.value_or(0);
    if (!device.is_cuda()) return {disk, nominal_disk_bytes_per_second};
    const std::int64_t host = o.host_bytes.value_or(0);
    return {host + disk, host > 0 ? nominal_host_link_bytes_per_second : nominal_disk_bytes_per_second};
  }

  /// The engine offloaded units share; created at the first plan that offloads.
  std::shared_ptr<offload::engine> engine_for_plan() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!engine_) engine_ = std::make_shared<offload::engine>(offload::options_from(config_));
    return engine_;
  }

  /// Replaces chain c's slots as `units` say (originals where a unit is kept):
  /// a Sequential's slots are swapped, call sites get runners, and a whole
  /// model that offloads gets its offload scope.
  void apply_units(std::size_t c, const std::vector<unit>& units, bool supported, pending_changes& changes,
                   bool& first_change) {
    auto& chain = chains_[c];
    if (chain.source == chain_source::whole_model) {
      if (units.empty() || !units.front().offloaded) return;
      // The WholeModel slot registers the model: its parameters and buffers stay.
      changes.whole_scope = std::make_unique<offload_scope>(engine_for_plan(), detail::storages_of(chain.originals),
                                                            whole_group_bytes, root_name());
      after_first_change(first_change);
      return;
    }
    std::vector<torch::nn::AnyModule> target = chain.originals;
    for (const auto& u : units) {
      if (!u.checkpointed && !u.offloaded) continue;
      std::vector<torch::nn::AnyModule> segment(chain.originals.begin() + u.first,
                                                chain.originals.begin() + u.last + 1);
      wrap_context context;
      if (u.checkpointed && u.tiles > 1) {
        MEMSCALE_ASSERT(techniques_.tile, "a plan tiles although the Strategy or Config excludes it");
        context.tiles = u.tiles;
        context.tile_dim = u.tile_dim;
        segment = {techniques_.tile(std::move(segment), context)};
      } else if (u.checkpointed) {
        MEMSCALE_ASSERT(techniques_.checkpoint, "a plan checkpoints although the Strategy excludes it");
        segment = {techniques_.checkpoint(std::move(segment), context)};
      }
      if (u.offloaded) {
        MEMSCALE_ASSERT(techniques_.offload, "a plan offloads although the Strategy or Config excludes it");
        context.offload_engine = engine_for_plan();
        segment = {techniques_.offload(std::move(segment), context)};
      }
      target[static_cast<std::size_t>(u.first)] = std::move(segment.front());
      for (int k = u.first + 1; k <= u.last; ++k)
        target[static_cast<std::size_t>(k)] = torch::nn::AnyModule(std::make_shared<PassThroughImpl>());
    }
    // A chain whose slots are not all Tensor -> Tensor runs as it is: the
    // autocast wrapper has one Tensor forward.
    if (config_.use_mixed_precision && supported)
      for (auto& slot : target)
        if (!std::dynamic_pointer_cast<PassThroughImpl>(slot.ptr()))
          slot = torch::nn::AnyModule(std::make_shared<AutocastSlotImpl>(std::move(slot)));
    if (chain.source == chain_source::call_sites) {
      for (std::size_t k = 0; k < target.size(); ++k)
        if (target[k].ptr() != chain.originals[k].ptr()) changes.runners.emplace_back(chain.positions[k], target[k]);
      return;
    }
    auto& seq = *chain.ref.sequential;
    auto it = seq.begin();
    for (std::size_t k = 0; k < target.size(); ++k, ++it) {
      if (it->ptr() == target[k].ptr()) continue;
      changes.swaps.replace(seq, k, std::move(target[k]));
      after_first_change(first_change);
    }
  }

  // --- call sites ------------------------------------------------------------

  /// Prefetch groups of a whole-model offload scope (it has no layer boundaries).
  static constexpr std::int64_t whole_group_bytes = std::int64_t{32} << 20;
  /// A lazy recording longer than this ends (a training forward never followed by a backward).
  static constexpr std::size_t max_recorded_calls = 1 << 16;

  enum class sites_state : std::uint8_t { waiting, recording, recording_lazily, active, off };

  [[nodiscard]] std::string root_name() const {
    auto root = root_.lock();
    return root ? root->name() : std::string("model");
  }

  /// "TransformerBlock" for gpt::TransformerBlockImpl: the name users write.
  static std::string type_name(const torch::nn::Module& module) {
    auto name = module.name();
    if (const auto colon = name.rfind("::"); colon != std::string::npos) name = name.substr(colon + 2);
    if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
    return name;
  }

  [[nodiscard]] std::string path_of(const torch::nn::Module* module) const {
    const auto it = paths_.find(module);
    if (it == paths_.end()) return "<not registered in the model>";
    return it->second.empty() ? "<root>" : it->second;
  }

  [[nodiscard]] bool allows_whole_model_offload() const {
    return whole_forward_ && static_cast<bool>(techniques_.offload) && offload::hooks_engine_active();
  }

  void record(torch::nn::Module& module, int depth, const std::function<torch::nn::AnyModule()>* make_slot,
              const torch::Tensor* input, const char* why_not) {
    if (records_.size() >= max_recorded_calls) return;
    call_record r;
    r.module = &module;
    r.depth = depth;
    if (make_slot != nullptr) {
      try {
        r.slot = (*make_slot)();
      } catch (const std::bad_weak_ptr&) {
        r.why_not = "the module is not owned by a std::shared_ptr (build it through its ModuleHolder, "
                    "std::make_shared or register_module)";
      }
    } else if (why_not != nullptr) {
      r.why_not = why_not;
    }
    if (input != nullptr && !r.slot.is_empty()) r.input = input->detach();
    records_.push_back(std::move(r));
  }

  /// Whether a lazy recording holds a whole training forward: a backward ran
  /// since it began (memscale's engine counts them), or, without that engine,
  /// the first recorded module is called again at its depth.
  [[nodiscard]] bool recording_complete(const torch::nn::Module& module, int depth) const {
    if (records_.empty()) return false;
    if (records_.size() >= max_recorded_calls) return true;
    if (offload::hooks_engine_active()) return offload::backwards_started() != recording_epoch_;
    return depth == records_.front().depth && &module == records_.front().module;
  }

  /// Several forwards before the first backward (gradient accumulation): the
  /// shortest period of the recorded sequence is one forward.
  static std::vector<call_record> one_forward(std::vector<call_record> records) {
    const auto n = records.size();
    for (std::size_t p = 1; p < n; ++p) {
      if (n % p != 0) continue;
      bool periodic = true;
      for (std::size_t i = p; i < n && periodic; ++i)
        periodic = records[i].module == records[i % p].module && records[i].depth == records[i % p].depth;
      if (periodic) {
        records.resize(p);
        break;
      }
    }
    return records;
  }

  /// Lazy planning of the recorded calls, at the first call after the recording
  /// ended (the next forward). On failure call sites run directly from then on.
  void plan_recorded_calls() {
    std::lock_guard<std::mutex> planning(plan_mutex_);
    if (sites_.load() != sites_state::recording_lazily) return;
    try {
      const auto added = add_call_chains(/*lazy=*/true);
      if (added.empty()) {
        sites_ = sites_state::off;
        pending_notes_.clear();
        return;
      }
      std::vector<torch::Tensor> inputs(chains_.size());
      for (auto c : added) inputs[c] = chains_[c].unit_inputs.front();
      commit_plan(added, inputs, /*probe_the_others=*/false);
    } catch (...) {
      sites_ = sites_state::off;
      pending_sequence_.clear();
      pending_notes_.clear();
      throw;
    }
  }

  /// Turns the recorded calls into chains of call-site units (appended to
  /// chains_; their indices are returned), the call sequence and report notes.
  std::vector<std::size_t> add_call_chains(bool lazy) {
    auto records = std::move(records_);
    records_.clear();
    if (lazy) records = one_forward(std::move(records));
    // Calls inside a Sequential memscale manages run in its slots, its units.
    std::vector<std::string> managed;
    for (const auto& chain : chains_)
      if (chain.source == chain_source::sequential && !chain.inside_call_site) managed.push_back(chain.ref.path);
    const auto in_managed = [&](const torch::nn::Module* m) {
      const auto it = paths_.find(m);
      if (it == paths_.end()) return false;
      return std::any_of(managed.begin(), managed.end(), [&](const std::string& p) {
        return p.empty() || it->second == p || it->second.rfind(p + ".", 0) == 0;
      });
    };
    excluded_.clear();
    std::vector<const call_record*> eligible;
    for (const auto& r : records) {
      if (in_managed(r.module)) excluded_.insert(r.module);
      else eligible.push_back(&r);
    }
    // The outermost depth with at least two calls (else the outermost).
    std::map<int, int> per_depth;
    for (const auto* r : eligible) ++per_depth[r->depth];
    level_ = per_depth.empty() ? 0 : per_depth.begin()->first;
    for (const auto& [d, n] : per_depth)
      if (n >= 2) {
        level_ = d;
        break;
      }
    pending_sequence_.clear();
    pending_notes_.clear();
    std::vector<std::size_t> added;
    std::unordered_map<const torch::nn::Module*, int> calls_of;
    std::size_t open = 0;
    bool is_open = false;
    int nested = 0;
    std::vector<std::string> direct;
    for (const auto* r : eligible) {
      if (r->depth != level_) {
        nested += r->depth > level_ ? 1 : 0;
        continue;
      }
      const auto position = pending_sequence_.size();
      pending_sequence_.push_back({r->module, {}});
      if (r->slot.is_empty()) {
        is_open = false;
        const auto line = "call site '" + path_of(r->module) + "' (" + type_name(*r->module) + ") runs as it is: " +
                          r->why_not;
        if (std::find(direct.begin(), direct.end(), line) == direct.end()) direct.push_back(line);
        continue;
      }
      if (!is_open) {
        managed_chain chain;
        chain.source = chain_source::call_sites;
        chains_.push_back(std::move(chain));
        open = chains_.size() - 1;
        is_open = true;
        added.push_back(open);
      }
      auto& chain = chains_[open];
      auto name = path_of(r->module) + " (" + type_name(*r->module) + ")";
      if (const int k = ++calls_of[r->module]; k > 1) name += " call " + std::to_string(k);
      chain.originals.push_back(r->slot);
      chain.unit_inputs.push_back(r->input);
      chain.positions.push_back(position);
      chain.unit_names.push_back(std::move(name));
    }
    for (std::size_t i = 0; i < added.size(); ++i) {
      auto& chain = chains_[added[i]];
      chain.ref.path = "memscale::forward call sites " + chain.unit_names.front().substr(0, chain.unit_names.front().find(' ')) +
                       " .. " + chain.unit_names.back().substr(0, chain.unit_names.back().find(' '));
    }
    if (!pending_sequence_.empty()) {
      int units = 0;
      for (auto c : added) units += static_cast<int>(chains_[c].originals.size());
      std::string line = "call sites: " + std::to_string(pending_sequence_.size()) + " memscale::forward call(s) per " +
                         "forward at depth " + std::to_string(level_) + ", " + std::to_string(units) +
                         " of them planned as units";
      if (level_ > per_depth.begin()->first)
        line += "; the outermost depth has a single call, so the plan goes one level finer";
      if (nested > 0)
        line += "; " + std::to_string(nested) + " nested call(s) inside them run directly (the plan uses the "
                "outermost depth with at least two calls: whole blocks are the boundaries where a checkpoint "
                "keeps least, and a unit's recompute re-runs its nested calls anyway)";
      line += lazy ? "; recorded over the first training forward" : "; recorded from the example forward";
      pending_notes_.push_back(std::move(line));
    }
    for (auto& line : direct) pending_notes_.push_back(std::move(line));
    if (!excluded_.empty())
      pending_notes_.push_back(std::to_string(excluded_.size()) + " module(s) called through memscale::forward inside "
                               "a managed Sequential run directly: that Sequential's slots are the units there");
    for (const auto& chain : chains_)
      if (chain.source == chain_source::sequential && chain.inside_call_site)
        pending_notes_.push_back("Sequential '" + chain.ref.path + "' runs inside a memscale::forward call: it is "
                                 "part of that unit, not planned on its own");
    return added;
  }

  /// A model with no Sequential and no call site: its whole forward, one unit.
  void add_whole_model_chain() {
    managed_chain chain;
    chain.source = chain_source::whole_model;
    chain.ref.path = "<whole model> " + root_name();
    auto root = root_.lock();
    MEMSCALE_ASSERT(root != nullptr, "the model outlived its wrap() call");
    chain.originals.push_back(torch::nn::AnyModule(std::make_shared<WholeModelImpl>(root, whole_forward_)));
    chains_.push_back(std::move(chain));
    pending_notes_.push_back(
        "no unit boundaries: the model has no torch::nn::Sequential and its forward makes no memscale::forward "
        "call, so checkpointing and tiling cannot apply. Write `x = memscale::forward(*blocks[i], x);` where "
        "your forward calls its blocks to get them. What needs no boundaries applies: offload of every tensor "
        "autograd saves on the thread that called wrap/optimize while the model is wrapped (the forward and "
        "the loss), the 8-bit optimizer (memscale::make_optimizer), and mixed precision through "
        "memscale::autocast_scope around your forward");
  }

  /// The planned call for a memscale::forward call at `depth`, following the
  /// recorded sequence (call_sites.hpp has the rules).
  call_ticket next_call(const torch::nn::Module& module, int depth) {
    if (depth != level_ || sequence_.empty() || excluded_.count(&module) != 0) return {};
    if (!torch::GradMode::is_enabled() || c10::InferenceMode::is_enabled()) return {};  // nothing is saved
    const auto epoch = offload::backwards_started();
    if (epoch != cursor_epoch_) {
      end_forward();
      cursor_epoch_ = epoch;
    }
    if (diverged_) return {};
    const auto* first = sequence_.front().module;
    if (cursor_ == sequence_.size() && &module == first) {
      cursor_ = 0;  // the sequence completed: a new forward
    } else if (cursor_ > 0 && cursor_ < sequence_.size() && sequence_[cursor_].module != &module && &module == first) {
      end_forward();  // a shorter forward ended; this call starts the next
    }
    if (cursor_ >= sequence_.size() || sequence_[cursor_].module != &module) {
      diverged_ = true;
      const auto n = ++diverged_forwards_;
      if (config_.enable_logging && n <= 5)
        std::clog << "[memscale] warning: memscale::forward call " << cursor_ << " of this forward is '"
                  << path_of(&module) << "', but the plan recorded "
                  << (cursor_ < sequence_.size() ? "'" + path_of(sequence_[cursor_].module) + "'"
                                                 : std::to_string(sequence_.size()) + " calls")
                  << "; the rest of this forward runs unoptimized"
                  << (n == 5 ? " (further occurrences are only counted in the report)" : "") << "\n";
      return {};
    }
    return {sequence_[cursor_++].runner};
  }

  void end_forward() {
    if (cursor_ != 0 && cursor_ < sequence_.size() && !diverged_) ++short_forwards_;
    cursor_ = 0;
    diverged_ = false;
  }

  std::weak_ptr<torch::nn::Module> root_;
  Config config_;
  technique_set techniques_;
  plan_agreement agree_;
  std::function<torch::Tensor(const torch::Tensor&)> whole_forward_;  // empty: forward is not Tensor -> Tensor
  torch::Tensor whole_input_;
  std::unique_ptr<offload_scope> whole_scope_;
  std::vector<managed_chain> chains_;
  std::unordered_map<const torch::nn::Module*, std::string> paths_;  // every module of the model
  // Call sites. The recording and the sequence change under plan_mutex_; the
  // cursor belongs to the thread that runs the forward (one at a time).
  std::atomic<sites_state> sites_{sites_state::waiting};
  std::atomic<bool> listening_{false};
  std::vector<call_record> records_;
  std::uint64_t recording_epoch_ = 0;
  std::vector<planned_call> pending_sequence_;
  std::vector<std::string> pending_notes_;
  std::vector<planned_call> sequence_;
  std::unordered_set<const torch::nn::Module*> excluded_;
  int level_ = 0;
  std::size_t cursor_ = 0;
  bool diverged_ = false;
  std::uint64_t cursor_epoch_ = 0;
  std::atomic<std::int64_t> diverged_forwards_{0};
  std::atomic<std::int64_t> short_forwards_{0};
  std::shared_ptr<offload::engine> engine_;  // guarded by mutex_
  outside_allocator_probe* outside_probe_ = nullptr;  // attach()'s, while it runs (outside_probe_binding)
  mutable std::mutex mutex_;  // guards report_ and engine_
  std::mutex plan_mutex_;     // serializes lazy planning and restore
  Report report_;
};

inline outside_probe_binding::outside_probe_binding(attachment& attached, outside_allocator_probe* probe)
    : attached_(attached) {
  attached_.outside_probe_ = probe;
}
inline outside_probe_binding::~outside_probe_binding() { attached_.outside_probe_ = nullptr; }

inline torch::Tensor PlanningProbeImpl::forward(torch::Tensor x) {
  // Planning replaces this very slot: the module and the AnyModule holder that
  // called us stay alive (in `displaced`) until we have returned to it.
  auto keep_alive = shared_from_this();
  torch::nn::AnyModule displaced;
  // Plan from a training call: an evaluation or no-grad first call would measure
  // nothing that backward keeps. Until then, the chain runs as it is.
  // Inside a memscale::forward call, a recompute or planning, the chain is part
  // of something being run or measured: it runs as it is.
  if (call_sites::depth() > 0 || detail::recompute_scope::current() != nullptr || planning_on_this_thread())
    return original_.forward<torch::Tensor>(std::move(x));
  auto owner = owner_.lock();
  if (owner && owner->training_call() && torch::GradMode::is_enabled() && !c10::InferenceMode::is_enabled())
    return owner->plan_on_first_call(chain_, x, displaced);
  return original_.forward<torch::Tensor>(std::move(x));
}

/// The pipeline behind wrap(): validate, find chains, listen to call sites,
/// (capture), profile, plan, apply, register. `forward`: runs the example input
/// through the model, or empty. `whole_forward`: the model's Tensor -> Tensor
/// forward, when it has one (a model with no unit boundaries is planned as one).
inline std::shared_ptr<attachment> attach(const std::shared_ptr<torch::nn::Module>& root, const Config& config,
                                          technique_set techniques, const std::function<void()>& forward,
                                          plan_agreement agree = {},
                                          std::function<torch::Tensor(const torch::Tensor&)> whole_forward = {},
                                          const torch::Tensor* example = nullptr) {
  config.validate();
  if (!root) throw UnsupportedModelError("memscale: the model is empty (a null module holder)");
  if (config.verify_correctness && example == nullptr)
    throw ConfigError("verify_correctness",
                      "needs an example input to run one step with and without the plan: use wrap(model, "
                      "example_input, config) or optimize(model, example_input, config) (a model planned at its "
                      "first forward is not verified)");
  if (config.verify_correctness && !whole_forward)
    throw ConfigError("verify_correctness",
                      "needs a model whose forward takes one Tensor and returns one Tensor, to take a loss from "
                      "its output; this model's forward does not (" + root->name() + ")");
  if (registry::global().find(root.get()))
    throw AlreadyOptimizedError("memscale: this model is already optimized; call memscale::detach(model) "
                                "before wrapping it again");
  auto chains = find_chains(root);
  for (const auto& chain : chains)
    for (const auto& slot : *chain.sequential)
      if (is_memscale_slot(slot))
        throw AlreadyOptimizedError("memscale: Sequential '" + (chain.path.empty() ? root->name() : chain.path) +
                                    "' is already managed by memscale (through another model that contains "
                                    "it); detach that model first");
  auto attached = std::make_shared<attachment>(root, std::move(chains), config, techniques, std::move(agree),
                                               std::move(whole_forward));
  try {
    attached->listen_to_call_sites();
    // CPU: what the process comes to hold beyond the allocator, from the first
    // full-batch operation on (verify's step or the example forward) to the end
    // of profiling. Declared before the sandbox, so it closes after it.
    std::optional<outside_allocator_probe> outside;
    if (forward && profile_outside_allocator_bytes() < 0) {
      const auto parameters = root->parameters();
      const bool cpu = example != nullptr ? example->device().is_cpu()
                                          : parameters.empty() || parameters.front().device().is_cpu();
      if (cpu) outside.emplace();
    }
    const outside_probe_binding bound(*attached, outside ? &*outside : nullptr);
    // With a CPU budget and no verification step (which runs a whole step of
    // its own first), a training step at two rows lets the probe see what
    // backward and autograd make outside the allocator too, which the no-grad
    // example forward and the profiling do not reach.
    if (outside && example != nullptr && config.memory_budget_gb && !config.verify_correctness)
      attached->run_native_warmup(*example);
    // verify_correctness: the unoptimized step first, on the model as it is.
    std::optional<verify::sandbox> box;
    std::optional<verify::step_outcome> unoptimized;
    if (config.verify_correctness) {
      box.emplace(*root);
      unoptimized = attached->verification_step(*box, *example, /*as_before_wrap=*/true);
      box->reset();
    }
    std::vector<torch::Tensor> inputs;
    if (forward) {
      if (example != nullptr) attached->set_whole_input(*example);
      inputs = attached->capture_inputs(forward);
    }
    attached->plan_and_apply(std::move(inputs));
    if (unoptimized) {
      const auto optimized = attached->verification_step(*box, *example, /*as_before_wrap=*/false);
      attached->judge_verification(*box, *unoptimized, optimized, example->device());
    }
    box.reset();  // gradients, buffers and the RNG as they were
    registry::global().add(root, attached);
  } catch (...) {
    attached->restore();
    throw;
  }
  return attached;
}

/// Undoes attach(); false when memscale does not manage `root` (or, with
/// `only`, when what manages it is another attachment). Never throws.
inline bool detach(const torch::nn::Module* root, const attachment* only = nullptr) noexcept {
  std::shared_ptr<attachment> found;
  try {
    found = registry::global().remove(root, only);
  } catch (...) {
    return false;
  }
  if (!found) return false;
  found->restore();
  return true;
}

}  // namespace memscale::core

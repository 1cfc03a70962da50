// memscale — the executor's attachment: the
// class that profiles, plans, applies and runs a model's chains and call sites;
// its members and short functions. The longer member functions are defined in
// attachment_planning.hpp (capture, profile, plan), attachment_apply.hpp (commit a
// plan, swap slots), attachment_call_sites.hpp (record and run memscale::forward
// calls), attachment_report.hpp (report notes, verify_correctness) and
// attach_detach.hpp (restore); include execute/executor.hpp to get them all.
//
// It swaps forward slots of each torch::nn::Sequential chain
// for technique wrappers and puts the originals back on detach. The chain's
// registered children never change, so parameters(), named_parameters(), state
// dicts and optimizers see the same tensors under the same names. An attachment
// is registered against the model's root module so detach() can find it. Every
// step either completes or is rolled back: a throwing wrap leaves the model as it was.
// Threads: wrap/detach/is_optimized may be called from any thread, but not while
// the model runs a forward elsewhere; without an example input, the first
// training forward plans and swaps slots, so make it from one thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/config.hpp>
#include <memscale/core/call_sites.hpp>
#include <memscale/core/memory_model.hpp>
#include <memscale/core/plan.hpp>
#include <memscale/core/profiler.hpp>
#include <memscale/core/slots.hpp>
#include <memscale/detail/assert.hpp>
#include <memscale/detail/fault_injection.hpp>
#include <memscale/detail/step_gate.hpp>
#include <memscale/device/hardware.hpp>
#include <memscale/execute/managed_chain.hpp>
#include <memscale/execute/metrics_page.hpp>
#include <memscale/execute/plan_log.hpp>
#include <memscale/execute/planning_scope.hpp>
#include <memscale/execute/stage1.hpp>
#include <memscale/execute/telemetry_events.hpp>
#include <memscale/execute/verify.hpp>
#include <memscale/observability/endpoint.hpp>
#include <memscale/observability/log.hpp>
#include <memscale/observability/telemetry.hpp>
#include <memscale/offload/engine.hpp>
#include <memscale/offload/hooks.hpp>
#include <memscale/techniques/offload.hpp>

namespace memscale::core {

class attachment;

/// Lends attach()'s outside_allocator_probe to an attachment's planning for the binding's lifetime.
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
        caller_config_(config),
        config_(std::move(config)),
        log_(observability::log_channel::open(config_)),
        telemetry_(telemetry::channel::open(config_)),
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
    report_.strategy = as_written(config_, config_.auto_policy
                                               ? "Stage 1 runs when the first chains are planned"
                                               : "auto_policy is off: the Config as written");
    report_.hardware = detect_hardware();
    if (telemetry_.on()) facts_ = telemetry::facts_of(*root);
    add_technique_notes();
  }

  attachment(const attachment&) = delete;
  attachment& operator=(const attachment&) = delete;
  /// A model dropped without detach() takes its attachment with it: its call
  /// sites stop reaching it.
  ~attachment() override { stop_listening(); }

  [[nodiscard]] Report report() const {
    Report r;
    std::shared_ptr<offload::engine> engine;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      r = report_;
      engine = engine_;
    }
    if (engine) r.offload = engine->stats();
    std::tie(r.measured_peak_bytes, r.process_peak_bytes) = observability::measured_peaks(r.device);
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

  /// memscale::forward: records, plans or runs a call (take_call, attachment_call_sites.hpp). Defined in the
  /// class, or it would be the key function (cmake/check_layers.sh says why).
  call_ticket begin_call(torch::nn::Module& module, int depth, const std::function<torch::nn::AnyModule()>* make_slot,
                         const torch::Tensor* input, const char* why_not) override {
    return take_call(module, depth, make_slot, input, why_not);
  }

  /// One training step at a time (detail/step_gate.hpp): given to every wrapper.
  [[nodiscard]] const std::shared_ptr<detail::step_gate>& step_gate() const noexcept { return gate_; }

  /// The offload engine, once a plan offloaded something (else null).
  [[nodiscard]] std::shared_ptr<offload::engine> offload_engine() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return engine_;
  }

  /// Telemetry's wrap_called (outcome "ok" or the kind of error) and detach_called; never throw.
  void wrap_finished(const char* outcome) const noexcept {
    if (telemetry_.on()) telemetry_.emit(telemetry::wrap_called(facts_, caller_config_, outcome));
  }
  /// A guard ended during another thread's step: the model stays optimized until a detach() succeeds.
  void guard_detach_refused(const std::string& model) const noexcept try {
    log_.warn("memscale: the guard of " + model + " ended while another thread's training step was in flight; "
              "the model stays optimized: call memscale::detach(model) once that step's backward is done");
  } catch (...) {
  }
  void detached() const noexcept {
    if (telemetry_.on()) telemetry_.emit(telemetry::detach_called(facts_));
  }
  /// The summary line of a wrap whose planning waits for the first forward (a planned one logged its plan).
  void log_if_deferred() const noexcept {
    try {
      const auto r = report();
      if (!r.planned) observability::log_report(log_, r);
    } catch (...) {
    }
  }

  /// Runs `step` (a caller's training step) marking each planned unit; the Report it returns has measured_timeline.
  Report trace_step(const std::function<void()>& step);

  /// Config::observability_port: serves the metrics until restore(); an unbindable port is a warning and a note.
  void start_metrics_endpoint() noexcept;

  /// Runs `forward` once (no grad, no visible RNG draws, buffers restored) to learn
  /// what each chain receives. Chains the forward never reaches get no input.
  std::vector<torch::Tensor> capture_inputs(const std::function<void()>& forward);

  /// Profiles, plans and applies the chains with a defined input (the others get a probe), all or nothing.
  void plan_and_apply(std::vector<torch::Tensor> inputs);

  /// The example input, for a model planned as one whole-forward unit.
  void set_whole_input(const torch::Tensor& x) { whole_input_ = x.detach(); }

  /// Called by a chain's planning probe on its first training input. The probe
  /// runs inside slot 0's AnyModule holder, which planning replaces: the holder
  /// moves to `displaced` and lives until this call (and the probe's) returns.
  torch::Tensor plan_on_first_call(std::size_t c, const torch::Tensor& x, torch::nn::AnyModule& displaced);

  /// One training step (forward, a mean-square loss, backward) of the example's
  /// first two rows in verify's sandbox (gradients, buffers and the RNG put
  /// back), run directly, so that outside_allocator_probe sees what the worker
  /// threads and autograd make outside the allocator. Nothing for a forward
  /// that is not Tensor -> Tensor. A failure is a note: the reserve then comes
  /// from the example forward and the profiling only.
  void run_native_warmup(const torch::Tensor& example);

  /// verify_correctness: one step of `example` in `box`, through the model as
  /// it is now; `as_before_wrap`: memscale::forward calls run directly (the
  /// unoptimized step, taken before the plan is applied).
  verify::step_outcome verification_step(verify::sandbox& box, const torch::Tensor& example, bool as_before_wrap) {
    MEMSCALE_ASSERT(whole_forward_, "verify_correctness needs the model's Tensor -> Tensor forward");
    planning_scope direct_calls(as_before_wrap);
    return box.run(whole_forward_, example);
  }

  /// verify_correctness under mixed precision (attachment_report.hpp).
  std::optional<verify::step_outcome> autocast_reference_step(verify::sandbox& box, const torch::Tensor& example);

  /// Compares the optimized verification step with the unoptimized one (or
  /// the autocast reference), reports it; throws CorrectnessError beyond what
  /// the plan's techniques allow (the caller then restores the model).
  void judge_verification(const verify::sandbox& box, const verify::step_outcome& unoptimized,
                          const std::optional<verify::step_outcome>& autocast_reference,
                          const verify::step_outcome& optimized, c10::Device device);

  /// Whether the model is in training mode (planning waits for a training call).
  [[nodiscard]] bool training_call() const {
    auto root = root_.lock();
    return root && root->is_training();
  }

  /// Puts every original slot back, stops listening to call sites and closes a
  /// whole-model offload scope. Never throws.
  void restore() noexcept;

 private:
  call_ticket take_call(torch::nn::Module& module, int depth, const std::function<torch::nn::AnyModule()>* make_slot,
                        const torch::Tensor* input, const char* why_not);
  void add_technique_notes();

  /// What a plan changes besides Sequential slots, made before it commits and
  /// moved into place after (noexcept).
  struct pending_changes {
    slot_transaction swaps;
    std::vector<std::pair<std::size_t, torch::nn::AnyModule>> runners;  // call sequence position -> runner
    std::unique_ptr<offload_scope> whole_scope;
  };

  /// Plans chains `ready`, applies the plan (and probes on the other chains when
  /// asked) in one transaction, then publishes the report.
  void commit_plan(std::vector<std::size_t> ready, const std::vector<torch::Tensor>& inputs,
                   bool probe_the_others, torch::nn::AnyModule* displaced = nullptr);

  void after_first_change(bool& first_change) {  // a failure mid-way, after one slot changed
    if (std::exchange(first_change, false)) detail::fault_point(detail::pipeline_stage::apply);
  }

  /// Stage 1 (Config::auto_policy), at the first plan: decides the strategy from the profiles and
  /// the engine's input, narrows `in` and config_ to it, and records the decision in `out`.
  void choose_strategy(const std::vector<chain_profile>& profiles, const std::vector<std::vector<slot_cost>>& costs,
                       const std::vector<bool>& supported, engine_input& in, const c10::Device& device, Report& out);

  /// Profiles chains `which` (inputs indexed by chain) within profiling_room(), runs the engine, fills `out`;
  /// `which` may come back naming a finer level's chains (consider_finer_level).
  std::vector<std::vector<unit>> plan(std::vector<std::size_t>& which, const std::vector<torch::Tensor>& inputs,
                                      Report& out);
  std::int64_t profiling_room(const std::vector<std::size_t>& which, const std::vector<torch::Tensor>& inputs,
                              const Report& out) const;

  /// A chain's profile, and what each gets before the engine reads it (attachment_levels.hpp).
  chain_profile profile_of(const managed_chain& chain, const torch::Tensor& input, const profile_options& options) const;
  void adjust_profiles(std::vector<chain_profile>& profiles) const;

  /// Plans finer_ at `decided`'s target; where cheaper, its chains, profiles and plan replace level_'s
  /// (keep_outer_calls_run_whole: only the outer calls `decided` runs whole stay in the sequence; it returns them).
  bool consider_finer_level(std::vector<std::size_t>& which, const profile_options& options,
                            std::vector<chain_profile>& profiles, std::vector<std::vector<slot_cost>>& costs,
                            std::vector<bool>& supported, engine_input& in, engine_plan& decided, Report& out);
  std::vector<const torch::nn::Module*> keep_outer_calls_run_whole(std::size_t head, const std::vector<std::size_t>& which,
                                                                   const engine_plan& decided);
  /// The engine offloaded units share; created at the first plan that offloads.
  std::shared_ptr<offload::engine> engine_for_plan() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!engine_) {
      auto options = offload::options_from(config_);
      options.log = log_;
      engine_ = std::make_shared<offload::engine>(std::move(options));
    }
    return engine_;
  }

  /// Replaces chain c's slots as `units` say (originals where a unit is kept): a Sequential's slots
  /// are swapped, call sites get runners, and a whole model that offloads gets its offload scope.
  void apply_units(std::size_t c, const std::vector<unit>& units, bool supported, pending_changes& changes,
                   bool& first_change);

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
              const torch::Tensor* input, const char* why_not);

  /// Whether a lazy recording holds a whole training forward: a backward ran
  /// since it began (memscale's engine counts them), or, without that engine,
  /// the first recorded module is called again at its depth.
  [[nodiscard]] bool recording_complete(const torch::nn::Module& module, int depth) const;

  /// Several forwards before the first backward (gradient accumulation): the
  /// shortest period of the recorded sequence is one forward.
  static std::vector<call_record> one_forward(std::vector<call_record> records);

  /// Lazy planning of the recorded calls, at the first call after the recording
  /// ended (the next forward). On failure call sites run directly from then on.
  void plan_recorded_calls();

  /// The recorded calls as chains of call-site units (appended to chains_, their
  /// indices returned), call sequence and notes; where calls nest, finer_ too
  /// (build_call_level with outer = level_: the outer calls in its sequence too).
  std::vector<std::size_t> add_call_chains(bool lazy);
  [[nodiscard]] call_level build_call_level(const std::vector<const call_record*>& eligible, int depth,
                                            bool lazy, int outer = -1) const;
  void add_whole_model_chain();  ///< no Sequential and no call site: the whole forward, one unit

  /// The planned call for a memscale::forward call at `depth`, following the
  /// recorded sequence (call_sites.hpp has the rules).
  call_ticket next_call(const torch::nn::Module& module, int depth);

  void end_forward() {
    if (cursor_ != 0 && cursor_ < sequence_.size() && !diverged_) ++short_forwards_;
    cursor_ = 0;
    diverged_ = false;
  }

  std::weak_ptr<torch::nn::Module> root_;
  const Config caller_config_;  ///< as the caller passed it (Stage 1 starts from it)
  Config config_;               ///< what planning uses: the caller's, or Stage 1's effective copy
  observability::log_channel log_;  ///< Config::enable_logging and log_file
  telemetry::channel telemetry_;    ///< Config::telemetry (off: sends nothing)
  telemetry::model_facts facts_;    ///< what its events say about the model
  technique_set techniques_;
  plan_agreement agree_;
  std::function<torch::Tensor(const torch::Tensor&)> whole_forward_;  // empty: forward is not Tensor -> Tensor
  torch::Tensor whole_input_;
  std::unique_ptr<offload_scope> whole_scope_;
  std::vector<managed_chain> chains_;
  std::unordered_map<const torch::nn::Module*, std::string> paths_;  // every module of the model
  std::shared_ptr<detail::step_gate> gate_ = std::make_shared<detail::step_gate>();
  // Call sites. The recording and the sequence change under plan_mutex_; the
  // cursor belongs to the thread that runs the forward (one at a time: the gate).
  std::atomic<sites_state> sites_{sites_state::waiting};
  std::atomic<bool> listening_{false};
  std::vector<call_record> records_;
  std::uint64_t recording_epoch_ = 0;
  std::thread::id recording_thread_;  // a lazy recording's thread: the others' calls run plainly meanwhile
  std::vector<planned_call> pending_sequence_;
  std::vector<std::string> pending_notes_;
  std::vector<planned_call> sequence_;
  std::vector<std::size_t> report_order_;  ///< chains_ index of each Report chain (the order they were planned)
  std::unordered_set<const torch::nn::Module*> excluded_;
  int level_ = 0, outer_level_ = -1;  ///< outer >= 0: the sequence holds the calls one depth up too
  std::optional<call_level> finer_;      ///< the level plan() weighs against level_ (until planned)
  std::vector<std::size_t> coarse_ids_;  ///< chains_ indices of level_'s chains (until planned)
  std::size_t coarse_note_count_ = 0;    ///< pending_notes_ that describe level_ (the first ones)
  std::size_t cursor_ = 0;
  bool diverged_ = false;
  std::uint64_t cursor_epoch_ = 0;
  std::atomic<std::int64_t> diverged_forwards_{0}, short_forwards_{0};
  std::shared_ptr<offload::engine> engine_;  // guarded by mutex_
  std::unique_ptr<observability::metrics_endpoint> endpoint_;  // set by attach(), stopped by restore()
  outside_allocator_probe* outside_probe_ = nullptr;  // attach()'s, while it runs (outside_probe_binding)
  std::int64_t example_forward_transient_ = -1;  ///< capture_inputs' peak above what it kept; -1 unseen
  mutable std::mutex mutex_;  // guards report_ and engine_
  std::mutex plan_mutex_;     // serializes lazy planning and restore
  Report report_;
};

inline outside_probe_binding::outside_probe_binding(attachment& attached, outside_allocator_probe* probe)
    : attached_(attached) {
  attached_.outside_probe_ = probe;
}
inline outside_probe_binding::~outside_probe_binding() { attached_.outside_probe_ = nullptr; }

}  // namespace memscale::core

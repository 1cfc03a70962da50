// memscale — core::attach and core::detach, the pipeline behind wrap() and its
// undoing: validate, find chains, listen to call sites, (capture), profile,
// plan, apply, verify, register; and attachment::restore, which puts every
// original slot back. Includes every part of the attachment it runs.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/config.hpp>
#include <memscale/core/profiler.hpp>
#include <memscale/detail/fault_injection.hpp>
#include <memscale/device/memory_tracker.hpp>
#include <memscale/device/process_memory.hpp>
#include <memscale/errors.hpp>
#include <memscale/execute/attachment.hpp>
#include <memscale/execute/attachment_apply.hpp>
#include <memscale/execute/attachment_call_sites.hpp>
#include <memscale/execute/attachment_planning.hpp>
#include <memscale/execute/attachment_report.hpp>
#include <memscale/execute/managed_chain.hpp>
#include <memscale/execute/planning_scope.hpp>
#include <memscale/execute/registry.hpp>
#include <memscale/execute/verify.hpp>
#include <memscale/observability/metrics.hpp>

namespace memscale::core {

inline void attachment::restore() noexcept {
  // First, and outside the locks: a scrape in flight reads the report under mutex_.
  if (endpoint_) endpoint_->stop();
  std::lock_guard<std::mutex> planning(plan_mutex_);
  sites_ = sites_state::off;
  stop_listening();
  sequence_.clear();
  whole_scope_.reset();
  for (auto& chain : chains_) {
    if (chain.source != chain_source::sequential) continue;
    auto it = chain.ref.sequential->begin();
    // Moved, not copied: an AnyModule's copy allocates, and this cannot fail.
    // The attachment ends here (detach, or a wrap that failed).
    // Only the slots memscale changed: another slot may be running right now.
    for (std::size_t k = 0; k < chain.originals.size(); ++k, ++it)
      if (it->ptr() != chain.originals[k].ptr()) *it = std::move(chain.originals[k]);
  }
}

/// The kind of error a wrap threw, as telemetry names it (never its message).
inline const char* telemetry_outcome(const std::exception_ptr& error) noexcept {
  try {
    std::rethrow_exception(error);
  } catch (const ConfigError&) {
    return "config";
  } catch (const UnsupportedModelError&) {
    return "unsupported_model";
  } catch (const CorrectnessError&) {
    return "correctness";
  } catch (const c10::OutOfMemoryError&) {
    return "out_of_memory";
  } catch (...) {
    return "error";
  }
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
  if (config.observability_port && !observability::http_available)
    throw ConfigError("observability_port", std::string(observability::http_unavailable_reason) +
                                                "; leave it unset, or rebuild memscale with cpp-httplib");
  if (config.telemetry_endpoint && !observability::http_available)
    throw ConfigError("telemetry_endpoint", std::string(observability::http_unavailable_reason) +
                                                "; use telemetry_file, or rebuild memscale with cpp-httplib");
  if (!root) throw UnsupportedModelError("memscale: the model is empty (a null module holder)");
  if (example != nullptr && !example->defined())
    throw Error("memscale: the example input is an undefined tensor (a default-constructed torch::Tensor); pass "
                "a batch the model's forward takes, as in training, or wrap(model, config) / optimize(model, "
                "config) without one to plan at the first training forward");
  if (example != nullptr && example->dim() > 0 && example->size(0) == 0)
    throw Error("memscale: the example input has no rows (shape " + std::string(c10::str(example->sizes())) +
                "); pass a batch of the size training runs: memscale profiles and plans at the example's size");
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
        throw AlreadyOptimizedError("memscale: " +
                                    (chain.path.empty() ? "the Sequential passed (" + root->name() + ")"
                                                        : "its Sequential '" + chain.path + "'") +
                                    " is already managed by memscale (through another model that contains "
                                    "it); detach that model first");
  auto attached = std::make_shared<attachment>(root, std::move(chains), config, techniques, std::move(agree),
                                               std::move(whole_forward));
  const observability::own_work_scope wrapping;  // its warm-up, verification and profiling are no training steps
  try {
    attached->listen_to_call_sites();
    // CPU: what the process comes to hold beyond the allocator, from the first
    // full-batch operation on (verify's step or the example forward) to the end
    // of profiling. Declared before the sandbox, so it closes after it.
    const auto parameters = root->parameters();
    const c10::Device device = example != nullptr ? example->device()
                               : parameters.empty() ? c10::Device(c10::kCPU)
                                                    : parameters.front().device();
    std::optional<outside_allocator_probe> outside;
    if (forward && profile_outside_allocator_bytes() < 0 && device.is_cpu()) {
      // The profiler's compute rates first (once per process): their operands
      // are mapped outside the allocator, which the probe would count as the
      // process's own.
      if (config.use_static_profiling) (void)memscale::detail::measured_compute_rates(device);
      outside.emplace();
    }
    const outside_probe_binding bound(*attached, outside ? &*outside : nullptr);
    // With a CPU budget and no verification step (which runs a whole step of
    // its own first), a training step at two rows lets the probe see what
    // backward and autograd make outside the allocator too, which the no-grad
    // example forward and the profiling do not reach (a few long sequences: an
    // eighth of the sequence, run_native_warmup).
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
      // Under mixed precision the optimized step is held to the same layers
      // under autocast without the other techniques (float32 is no reference:
      // a convolution's bias before BatchNorm has a gradient of about 0, whose
      // bfloat16 rounding differs from float32's by orders of magnitude).
      std::optional<verify::step_outcome> autocast_reference;
      if (config.use_mixed_precision) {
        autocast_reference = attached->autocast_reference_step(*box, *example);
        box->reset();
      }
      const auto optimized = attached->verification_step(*box, *example, /*as_before_wrap=*/false);
      attached->judge_verification(*box, *unoptimized, autocast_reference, optimized, example->device());
    }
    box.reset();  // gradients, buffers and the RNG as they were
    attached->start_metrics_endpoint();  // noexcept; before add(), so that a detach() stops it
    registry::global().add(root, attached);
    // Profiling ran the units at the full batch; glibc's heap with its dynamic
    // threshold (or tcmalloc's page heap, for a while) would keep what it freed,
    // near the baseline's peak, whatever the plan.
    if (outside && !fixed_malloc_mmap_threshold()) memscale::detail::release_free_heap();
    // CUDA: likewise the caching allocator keeps profiling's blocks reserved.
    if (forward) memscale::detail::release_cached_device_memory(device);
  } catch (...) {
    attached->restore();
    attached->wrap_finished(telemetry_outcome(std::current_exception()));
    throw;
  }
  attached->wrap_finished("ok");
  attached->log_if_deferred();
  return attached;
}

/// Undoes attach(); false when memscale does not manage `root` (or, with
/// `only`, when what manages it is another attachment). Never throws.
inline bool detach(const torch::nn::Module* root, const attachment* only = nullptr) noexcept {
  std::shared_ptr<attachment> found;
  try {
    detail::fault_point(detail::pipeline_stage::detach);
    // Not while another thread's training step is in flight: its forward runs
    // the slots restore() would swap. Once closed, the gate refuses new steps.
    const auto current = registry::global().find(root);
    if (current && (only == nullptr || current.get() == only) && !current->step_gate()->close()) return false;
    found = registry::global().remove(root, only);
  } catch (...) {
    return false;  // still registered and optimized: a later detach() can succeed
  }
  if (!found) return false;
  found->restore();
  found->detached();
  return true;
}

}  // namespace memscale::core

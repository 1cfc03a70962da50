// memscale::predict — operators whose transient allocations (workspaces) are
// not a line in the batch, measured at the example's batch.
//
// cuDNN chooses a convolution's algorithm, and with it the workspace, by the
// shapes: on an H200 (LibTorch 2.11, 2026-11-30) one convolution backward's
// workspace in a bottleneck ResNet took 108 MiB at batch 96 and 144 MiB at 128,
// the same per sample, then 26 MiB at 192 and 34 MiB at 256. Extrapolated from
// (96, 128) it was 288 MiB at 256, and the step's prediction 12% over. A deep
// CNN's allocations were predicted 25% short at batch 64 from (24, 32): its
// 106 MiB workspaces appear from batch 48.
//
// So the top calibration step records each call of the operators named in
// workspace_operators() (op_call_recorder: the events it spans), and after the
// fit each such call runs alone at the example's batch on inputs of that shape
// (probe_transients). Its transient allocations (made and freed within the
// call) replace, in order, the extrapolated sizes of the call's transient
// allocations in the step's timeline at that batch (timeline_fit::set_bytes),
// where both list as many. What the call keeps (its outputs) stays extrapolated.
// A call whose probe runs out of memory, or whose batch is not its inputs'
// first dimension, is left to the extrapolation.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include <memscale/device/hardware.hpp>
#include <memscale/device/memory_tracker.hpp>
#include <memscale/predict/timeline.hpp>

namespace memscale::predictor::detail {

/// The operators whose calls predict measures alone at the example's batch, by
/// name, each with the positions of its tensor arguments that carry the batch
/// as their first dimension (the others, weights, keep their shape). A test
/// seam adds its own. Process-wide; not thread-safe to change while predicting.
inline std::map<std::string, std::vector<std::size_t>>& workspace_operators() {
  static std::map<std::string, std::vector<std::size_t>> named{
      {"aten::cudnn_convolution", {0}},
      {"aten::cudnn_convolution_transpose", {0}},
      {"aten::convolution_backward", {0, 1}},
  };
  return named;
}

/// One recorded call: the operator, its arguments (tensors by shape only), and
/// the events of the step's timeline it spans, [first, last).
struct op_call {
  c10::OperatorName name{"", ""};
  std::vector<c10::IValue> arguments;  ///< undefined where a tensor was
  struct tensor_shape {
    std::size_t position = 0;
    std::vector<std::int64_t> sizes, strides;
    c10::TensorOptions options;
    bool batched = false;
  };
  std::vector<tensor_shape> tensors;
  std::size_t first = 0, last = 0;

  /// What identifies the call's probe: the operator, shapes and other arguments.
  [[nodiscard]] std::string key() const {
    std::ostringstream k;
    k << name.name << '.' << name.overload_name;
    for (const auto& t : tensors)
      k << '|' << t.position << ':' << c10::IntArrayRef(t.sizes) << c10::IntArrayRef(t.strides) << t.options.dtype();
    for (const auto& a : arguments) k << '|' << a;
    return k.str();
  }
};

/// Records the calls of workspace_operators() while it lives, on this thread and
/// the threads that inherit its state (autograd's), with the events of `scope`
/// they span; calls whose batched arguments do not start with `batch` rows are
/// left out. One at a time in the process (a second records nothing).
class op_call_recorder {
 public:
  op_call_recorder(const timeline_scope& scope, std::int64_t batch) : scope_(scope), batch_(batch) {
    op_call_recorder* none = nullptr;
    if (!active().compare_exchange_strong(none, this)) return;
    handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&on_start, &on_end).needsInputs(true).scopes(
        {at::RecordScope::FUNCTION}));
  }
  op_call_recorder(const op_call_recorder&) = delete;
  op_call_recorder& operator=(const op_call_recorder&) = delete;
  ~op_call_recorder() {
    if (handle_ == 0) return;
    at::removeCallback(handle_);
    active() = nullptr;
  }
  [[nodiscard]] std::vector<op_call> take() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<op_call> done;
    for (auto& c : calls_)
      if (c.last > c.first) done.push_back(std::move(c));
    calls_.clear();
    return done;
  }

 private:
  struct context final : at::ObserverContext {
    explicit context(std::size_t i) : index(i) {}
    std::size_t index;
  };
  static std::atomic<op_call_recorder*>& active() {
    static std::atomic<op_call_recorder*> one{nullptr};
    return one;
  }
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    auto* self = active().load();
    if (self == nullptr || fn.name() == nullptr) return nullptr;
    const auto named = workspace_operators().find(fn.name());
    const auto op = fn.operator_name();
    if (named == workspace_operators().end() || !op) return nullptr;
    op_call call;
    call.name = *op;
    for (const auto& a : fn.inputs()) {
      if (!a.isTensor()) {
        call.arguments.push_back(a);
        continue;
      }
      const auto& t = a.toTensor();
      call.arguments.emplace_back();
      if (!t.defined()) continue;
      const auto position = call.arguments.size() - 1;
      const bool batched = std::find(named->second.begin(), named->second.end(), position) != named->second.end();
      if (batched && (t.dim() == 0 || t.size(0) != self->batch_)) return nullptr;  // not the batch's rows
      call.tensors.push_back({position, t.sizes().vec(), t.strides().vec(), t.options(), batched});
    }
    std::lock_guard<std::mutex> lock(self->mutex_);
    call.first = self->scope_.events();
    self->calls_.push_back(std::move(call));
    return std::make_unique<context>(self->calls_.size() - 1);
  }
  static void on_end(const at::RecordFunction&, at::ObserverContext* ctx) {
    auto* self = active().load();
    if (self == nullptr || ctx == nullptr) return;
    std::lock_guard<std::mutex> lock(self->mutex_);
    self->calls_[static_cast<context*>(ctx)->index].last = self->scope_.events();
  }

  const timeline_scope& scope_;
  std::int64_t batch_;
  std::mutex mutex_;
  std::vector<op_call> calls_;
  at::CallbackHandle handle_ = 0;
};

/// The sizes of the transient allocations of events [first, last) of `t`, in
/// order: blocks allocated and freed within them, with the two events.
struct transient {
  std::size_t allocated, freed;
  std::int64_t bytes;
};
[[nodiscard]] inline std::vector<transient> transients(const timeline& t, std::size_t first, std::size_t last) {
  std::vector<transient> found;
  for (std::size_t e = first; e < last && e < t.live.size(); ++e) {
    if (!t.allocation[e]) continue;
    for (std::size_t f = e + 1; f < last && f < t.live.size(); ++f)
      if (!t.allocation[f] && t.block[f] == t.block[e]) {
        found.push_back({e, f, t.live[e] - (e == 0 ? 0 : t.live[e - 1])});
        break;
      }
  }
  return found;
}

/// The call run alone with its batched arguments at `batch` rows, recorded on
/// `device`: its transient allocations in order; nothing where it cannot run so
/// (out of memory, a layout whose rows are not outermost, an operator error).
[[nodiscard]] inline std::optional<std::vector<std::int64_t>> probe_transients(const op_call& call, std::int64_t batch,
                                                                              c10::Device device) {
  const auto handle = c10::Dispatcher::singleton().findSchema(call.name);
  if (!handle) return std::nullopt;
  try {
    torch::NoGradGuard no_grad;
    std::vector<c10::IValue> stack = call.arguments;
    for (const auto& t : call.tensors) {
      auto sizes = t.sizes;
      if (t.batched) {
        if (std::any_of(t.strides.begin() + 1, t.strides.end(), [&](auto s) { return s > t.strides.front(); }))
          return std::nullopt;
        sizes.front() = batch;
      }
      stack[t.position] = at::empty_strided(sizes, t.strides, t.options);
    }
    timeline_scope scope(device);
    handle->callBoxed(&stack);
    const auto recorded = scope.finish();
    std::vector<std::int64_t> sizes;
    for (const auto& tr : transients(recorded, 0, recorded.live.size())) sizes.push_back(tr.bytes);
    return sizes;
  } catch (const c10::Error&) {  // out of memory, or the operator refuses the shapes
  } catch (const std::bad_alloc&) {
  }
  memscale::detail::release_cached_device_memory(device);
  return std::nullopt;
}

/// Puts into `fit` (whose second timeline is `top`, at the batch the calls were
/// recorded at) the transient allocations of each call measured alone at
/// `batch`. Returns what it did, for the Prediction's notes (empty: nothing).
[[nodiscard]] inline std::string measure_workspaces(timeline_fit& fit, const timeline& top,
                                                    const std::vector<op_call>& calls, std::int64_t batch,
                                                    c10::Device device) {
  if (calls.empty() || top.block.size() != top.live.size()) return {};
  std::map<std::string, std::optional<std::vector<std::int64_t>>> probed;
  int measured = 0, skipped = 0;
  std::int64_t was = 0, now = 0;
  for (const auto& call : calls) {
    const auto in_step = transients(top, call.first, call.last);
    if (in_step.empty()) continue;
    const auto key = call.key();
    auto it = probed.find(key);
    if (it == probed.end()) it = probed.emplace(key, probe_transients(call, batch, device)).first;
    if (!it->second || it->second->size() != in_step.size()) {
      ++skipped;
      continue;
    }
    ++measured;
    for (std::size_t i = 0; i < in_step.size(); ++i) {
      was = std::max(was, fit.bytes(in_step[i].allocated, batch));
      fit.set_bytes(batch, in_step[i].allocated, in_step[i].freed, (*it->second)[i]);
      now = std::max(now, (*it->second)[i]);
    }
  }
  if (measured == 0 && skipped == 0) return {};
  std::ostringstream said;
  said << "the transient allocations (workspaces) of " << measured << " call(s) of " << probed.size()
       << " kind(s) of operator call (cuDNN's convolutions) measured alone at batch " << batch
       << ": the largest " << memscale::detail::format_bytes(now) << " where the extrapolation gave "
        << memscale::detail::format_bytes(was);
  if (skipped > 0) said << "; " << skipped << " call(s) left to the extrapolation (out of memory, or another count)";
  return said.str();
}

}  // namespace memscale::predictor::detail

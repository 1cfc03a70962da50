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
// first dimension, is left to the extrapolation. The largest batch that fits
// (largest_fitting) is made to agree with the answer at that batch (agreeing).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
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
#include <memscale/predict/record_inputs.hpp>
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
/// left out. One at a time in the process (a second records nothing). What the
/// callbacks write lives in a shared state that each call's context holds, and
/// the scope is dropped from it when the recorder ends: a device thread still
/// ending an operator then writes into that state, not into a freed recorder.
class op_call_recorder {
 public:
  op_call_recorder(const timeline_scope& scope, std::int64_t batch) : state_(std::make_shared<state>()) {
    state_->scope = &scope;
    state_->batch = batch;
    std::lock_guard<std::mutex> lock(active_mutex());
    if (active()) return;
    handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&on_start, &on_end).needsInputs(true).scopes(
        {at::RecordScope::FUNCTION}));
    active() = state_;
  }
  op_call_recorder(const op_call_recorder&) = delete;
  op_call_recorder& operator=(const op_call_recorder&) = delete;
  ~op_call_recorder() {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->scope = nullptr;
    }
    if (handle_ == 0) return;
    at::removeCallback(handle_);
    std::lock_guard<std::mutex> lock(active_mutex());
    active().reset();
  }
  [[nodiscard]] std::vector<op_call> take() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    std::vector<op_call> done;
    for (auto& c : state_->calls)
      if (c.last > c.first) done.push_back(std::move(c));
    state_->calls.clear();
    return done;
  }

 private:
  struct state {
    std::mutex mutex;
    const timeline_scope* scope = nullptr;  // null once the recorder has ended
    std::int64_t batch = 0;
    std::vector<op_call> calls;
  };
  struct context final : at::ObserverContext {
    context(std::shared_ptr<state> s, std::size_t i) : owner(std::move(s)), index(i) {}
    std::shared_ptr<state> owner;
    std::size_t index;
  };
  static std::mutex& active_mutex() {
    static std::mutex m;
    return m;
  }
  static std::shared_ptr<state>& active() {
    static std::shared_ptr<state> one;
    return one;
  }
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    if (fn.name() == nullptr) return nullptr;
    const auto named = workspace_operators().find(fn.name());
    const auto op = fn.operator_name();
    if (named == workspace_operators().end() || !op) return nullptr;
    std::shared_ptr<state> self;
    {
      std::lock_guard<std::mutex> lock(active_mutex());
      self = active();
    }
    if (!self) return nullptr;
    op_call call;
    call.name = *op;
    for (const auto& a : record_inputs(fn)) {
      if (!a.isTensor()) {
        call.arguments.push_back(a);
        continue;
      }
      const auto& t = a.toTensor();
      call.arguments.emplace_back();
      if (!t.defined()) continue;
      const auto position = call.arguments.size() - 1;
      const bool batched = std::find(named->second.begin(), named->second.end(), position) != named->second.end();
      if (batched && (t.dim() == 0 || t.size(0) != self->batch)) return nullptr;  // not the batch's rows
      call.tensors.push_back({position, t.sizes().vec(), t.strides().vec(), t.options(), batched});
    }
    std::lock_guard<std::mutex> lock(self->mutex);
    if (self->scope == nullptr) return nullptr;
    call.first = self->scope->events();
    self->calls.push_back(std::move(call));
    return std::make_unique<context>(self, self->calls.size() - 1);
  }
  static void on_end(const at::RecordFunction&, at::ObserverContext* ctx) {
    if (ctx == nullptr) return;
    const auto& c = *static_cast<context*>(ctx);
    std::lock_guard<std::mutex> lock(c.owner->mutex);
    if (c.owner->scope != nullptr && c.index < c.owner->calls.size())
      c.owner->calls[c.index].last = c.owner->scope->events();
  }

  std::shared_ptr<state> state_;
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
/// `device`: its transient allocations in order, for each of `runs` runs
/// (cuDNN's benchmark mode searches at a shape's first call, with workspaces of
/// its own, and not at the next); nothing where it cannot run so (out of memory,
/// a layout whose rows are not outermost, an operator that refuses the shapes).
[[nodiscard]] inline std::optional<std::vector<std::vector<std::int64_t>>> probe_transients(const op_call& call,
                                                                                          std::int64_t batch,
                                                                                          c10::Device device,
                                                                                          int runs) {
  const auto handle = c10::Dispatcher::singleton().findSchema(call.name);
  if (!handle) return std::nullopt;
  for (const auto& t : call.tensors)
    if (t.batched && std::any_of(t.strides.begin() + 1, t.strides.end(), [&](auto s) { return s > t.strides.front(); }))
      return std::nullopt;
  try {
    std::vector<std::vector<std::int64_t>> found;
    for (int run = 0; run < runs; ++run) {
      torch::NoGradGuard no_grad;
      std::vector<c10::IValue> stack = call.arguments;
      for (const auto& t : call.tensors) {
        auto sizes = t.sizes;
        if (t.batched) sizes.front() = batch;
        stack[t.position] = at::empty_strided(sizes, t.strides, t.options);
      }
      timeline_scope scope(device);
      handle->callBoxed(&stack);
      const auto recorded = scope.finish();
      auto& sizes = found.emplace_back();
      for (const auto& tr : transients(recorded, 0, recorded.live.size())) sizes.push_back(tr.bytes);
    }
    return found;
  } catch (const std::exception&) {  // out of memory (c10::Error, std::bad_alloc), or the shapes refused
  }
  try {
    memscale::detail::release_cached_device_memory(device);
  } catch (const std::exception&) {  // the next step meets what made this fail
  }
  return std::nullopt;
}

/// The largest n >= 1 with peak(n) <= budget (0 when none).
inline std::int64_t largest_fitting(const std::function<std::int64_t(std::int64_t)>& peak, std::int64_t budget) {
  if (peak(1) > budget) return 0;
  std::int64_t low = 1, high = 2;
  while (high < (std::int64_t{1} << 40) && peak(high) <= budget) {
    low = high;
    high *= 2;
  }
  while (high - low > 1) {
    const auto mid = low + (high - low) / 2;
    (peak(mid) <= budget ? low : high) = mid;
  }
  return low;
}

/// The largest batch that fits, `largest` (from the line at every batch),
/// made to agree with the answer at `batch` where measure_workspaces corrected
/// the fit there: the workspaces are measured at that batch only.
[[nodiscard]] inline std::int64_t agreeing(const timeline_fit& fit, bool fits, std::int64_t batch,
                                           std::int64_t largest) {
  if (fit.corrected_batch() != batch) return largest;
  return fits ? std::max(largest, batch) : std::min(largest, batch - 1);
}

/// Puts into `fit` (whose second timeline is `top`, at the batch the calls were
/// recorded at) the transient allocations of each call measured alone at
/// `batch`. Returns what it did, for the Prediction's notes (empty: nothing).
[[nodiscard]] inline std::string measure_workspaces(timeline_fit& fit, const timeline& top,
                                                    const std::vector<op_call>& calls, std::int64_t batch,
                                                    c10::Device device) {
  if (calls.empty() || top.block.size() != top.live.size()) return {};
  std::map<std::string, std::optional<std::vector<std::vector<std::int64_t>>>> probed;
  const int runs = device.is_cuda() && at::globalContext().benchmarkCuDNN() ? 2 : 1;
  int measured = 0, skipped = 0;
  std::int64_t was = 0, now = 0;
  for (const auto& call : calls) {
    const auto in_step = transients(top, call.first, call.last);
    if (in_step.empty()) continue;
    const auto key = call.key();
    auto it = probed.find(key);
    if (it == probed.end()) it = probed.emplace(key, probe_transients(call, batch, device, runs)).first;
    // The last run's list (a steady step's), else the first's (a call that searched in the step too).
    const std::vector<std::int64_t>* sizes = nullptr;
    if (it->second)
      for (auto run = it->second->rbegin(); run != it->second->rend() && sizes == nullptr; ++run)
        if (run->size() == in_step.size()) sizes = &*run;
    if (sizes == nullptr) {
      ++skipped;
      continue;
    }
    ++measured;
    for (std::size_t i = 0; i < in_step.size(); ++i) {
      was = std::max(was, fit.bytes(in_step[i].allocated, batch));
      fit.set_bytes(batch, in_step[i].allocated, in_step[i].freed, (*sizes)[i]);
      now = std::max(now, (*sizes)[i]);
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

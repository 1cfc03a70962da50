// memscale — profiler, the measuring half: a slot no rule covers is run alone on
// a synthetic input of its propagated shape, and what it keeps for backward
// (through the saved-tensor hooks), its output, its workspace and its forward and
// backward time are measured (measure_slot); a slot a rule covers gets its bytes
// from the rule's estimate (static_cost), and its times measured the same way
// (core/slot_parts.hpp, time_static_slot), or from measured rates where the slot
// may not be run; how many rows a part keeps for the whole's kernels, and the
// lines and parabolas that carry a figure measured on parts to the whole.
// core/profiler.hpp puts them together.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include <torch/cuda.h>
#include <torch/torch.h>

#include <memscale/core/graph.hpp>
#include <memscale/core/layer_rules.hpp>
#include <memscale/detail/buffers.hpp>
#include <memscale/detail/draw_replay.hpp>
#include <memscale/detail/product_replay.hpp>
#include <memscale/detail/rng.hpp>
#include <memscale/device/compute_rates.hpp>
#include <memscale/device/memory_tracker.hpp>
#include <memscale/errors.hpp>
#include <memscale/offload/hooks.hpp>
#include <memscale/techniques/offload.hpp>
#include <memscale/techniques/saved_compaction.hpp>

namespace memscale::detail {

inline void synchronize(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// Where the profiler's times come from on this thread while it is open: a
/// count of seconds that is not the wall clock's (memscale::predict's
/// shape-only execution, whose operators compute nothing, counts what they
/// would take). Outside one, measure_slot times with the wall clock.
class profile_clock_scope {
 public:
  explicit profile_clock_scope(std::function<double()> seconds) : seconds_(std::move(seconds)), outer_(open()) {
    open() = this;
  }
  profile_clock_scope(const profile_clock_scope&) = delete;
  profile_clock_scope& operator=(const profile_clock_scope&) = delete;
  ~profile_clock_scope() { open() = outer_; }
  /// Seconds on this thread's clock: the open scope's count, else the wall clock's.
  [[nodiscard]] static double now() {
    if (const auto* scope = open()) return scope->seconds_();
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

 private:
  static profile_clock_scope*& open() {
    thread_local profile_clock_scope* scope = nullptr;
    return scope;
  }
  std::function<double()> seconds_;
  profile_clock_scope* outer_;
};

inline torch::Tensor synthetic_input(const layer_input& in, const c10::Device& device) {
  auto options = torch::TensorOptions().dtype(in.dtype).device(device);
  return c10::isFloatingType(in.dtype) ? torch::randn(in.shape, options) : torch::zeros(in.shape, options);
}

/// Where measure_slot's byte figures came from.
enum class byte_source : std::uint8_t {
  allocations,     ///< the memory tracker: reported or counted allocations, or CUDA statistics
  saved_tensors,   ///< allocations go unseen: storages autograd saved (workspace unmeasured)
  none,            ///< neither: saved bytes unknown, input and output assumed kept
};

struct measured_slot {
  slot_cost cost;
  torch::Tensor output;  ///< detached, for the next slot
  bool tensor_output = true;
  byte_source bytes = byte_source::allocations;
  /// The most it held at once above what lived when it began (allocations only).
  std::int64_t peak_bytes = 0;
};

inline const void* storage_of(const torch::Tensor& t) {
  return t.defined() && t.has_storage() ? static_cast<const void*>(t.storage().unsafeGetStorageImpl()) : nullptr;
}

/// Runs one slot alone and measures what its forward keeps for backward. On CPU
/// with `reporting` (a scope the caller opened), bytes are what it reports, if it
/// reports the input's copy; else what `byte_source` says.
/// `products`: also measure its matrix products (what keeping them for a
/// selective recompute saves and keeps; Config::selective_recompute).
/// `compaction`: also count what keeping its saved tensors compact frees and
/// costs (techniques/saved_compaction.hpp), where its bytes come from allocations.
/// `offload_min_bytes` >= 0: also count what offloading its saved tensors would
/// leave on the device (slot_cost::offload_kept_bytes; the engine's min_bytes),
/// on the first of two or more passes (the census is a saved-tensor hook scope,
/// as the compaction census is: one per pass), or on the only one without
/// compaction. One pass with compaction (warmup_steps 1, or predict's 0) takes
/// no census: rather than a second pass, offloading is counted to free it all.
inline measured_slot measure_slot(torch::nn::AnyModule& slot, const torch::Tensor& input, int passes,
                                  const memory_tracker::reporting_scope* reporting = nullptr, bool products = true,
                                  saved_compaction compaction = {}, std::int64_t offload_min_bytes = -1) {
  measured_slot result;
  const auto device = input.device();
  double fastest_forward = 1e300, fastest_backward = 1e300;
  double fastest_replay_saved = 0.0;  // from the pass with the fastest forward, which holds its draws
  double fastest_product_saved = 0.0;
  std::int64_t offload_freed = -1;  // what the offload census found offloading would free
  for (int pass = 0; pass < std::max(1, passes); ++pass) {
    slot_cost cost;
    const auto reported_before = reporting != nullptr ? reporting->allocated_bytes() : 0;
    // An owned, non-leaf copy (as inside a chain, where the input comes out of the
    // previous slot): dropping our reference then shows whether the slot keeps it.
    // A leaf would be kept alive by its gradient accumulator, whatever the slot saves.
    torch::Tensor leaf, x;
    if (c10::isFloatingType(input.scalar_type())) {
      leaf = input.detach().clone().requires_grad_(true);
      x = leaf.clone();
    } else {
      x = input.detach().clone();
    }
    cost.input_bytes = static_cast<std::int64_t>(x.nbytes());
    // The copy is a CPU allocation of known size: a scope that missed it misses them all.
    auto source = byte_source::allocations;
    if (reporting != nullptr &&
        (!reporting->active() || reporting->allocated_bytes() - reported_before < cost.input_bytes)) {
      source = offload::hooks_engine_active() ? byte_source::saved_tensors : byte_source::none;
    }
    const bool by_allocations = source == byte_source::allocations;
    const auto version = x._version();
    synchronize(device);
    torch::Tensor y;
    std::int64_t copied_bytes = 0;  // products a recording forward would copy (product_replay.hpp)
    std::int64_t live_before = 0, live_after = 0, peak = 0, held = 0;
    std::vector<offload::saved_storage_log::entry> saved;
    {
      std::optional<memory_tracker::peak_scope> scope;
      std::optional<offload::saved_storage_log> log;
      if (by_allocations) {
        scope.emplace(device);
        live_before = memory_tracker::current_bytes(device);
      } else if (source == byte_source::saved_tensors) {
        log.emplace();
      }
      // The random draws a recompute could replay are timed apart, with what
      // replaying them costs (packing and writing back their outcomes), which is
      // not the forward's own time.
      draw_log draws;
      const auto start = profile_clock_scope::now();
      std::optional<draw_span> timed_draws(std::in_place, draws, draw_mode::measure);
      std::optional<product_span> timed_products;
      if (products) timed_products.emplace(draws, draw_mode::measure);
      const bool can_census = by_allocations && offload::hooks_engine_active() && !computing_nothing();
      std::optional<offload_census> offload_counted;
      if (can_census && offload_min_bytes >= 0 && pass == 0 && (passes >= 2 || !compaction.any()))
        offload_counted.emplace(offload_min_bytes, storages_of({slot}));
      std::optional<detail::saved_compaction_scope> census;
      if (compaction.any() && can_census && !offload_counted) census.emplace(compaction, /*dry=*/true);
      auto out = slot.any_forward(x);
      // Read while the forward's input, output and graph are held, as in a step.
      if (offload_counted) offload_freed = offload_counted->freed_bytes();
      offload_counted.reset();
      double census_seconds = 0.0;  // the census's own work, not the forward's
      if (census) {
        const auto* returned = out.try_get<torch::Tensor>();
        cost.compact_bytes = census->state().freed_bytes(returned != nullptr ? *returned : torch::Tensor());
        cost.compact_seconds = census->state().seconds();
        cost.compact_transient_bytes = census->state().largest_bytes();
        census_seconds = census->state().own_seconds();
        census.reset();
      }
      timed_products.reset();
      timed_draws.reset();
      auto* tensor = out.try_get<torch::Tensor>();
      if (tensor == nullptr) {
        result.tensor_output = false;
        return result;
      }
      y = *tensor;
      synchronize(device);
      cost.forward_seconds = std::max(0.0, profile_clock_scope::now() - start - draws.replay_seconds - census_seconds);
      cost.replay_saved_seconds = std::max(0.0, draws.draw_seconds - draws.replay_seconds);
      cost.replay_kept_bytes = draws.kept_bytes;
      const auto kept = measured_product_totals(draws, y);
      cost.product_saved_seconds = std::min(kept.seconds, cost.forward_seconds);
      cost.product_kept_bytes = kept.bytes;
      cost.returned_product_bytes = kept.returned_bytes;
      copied_bytes = kept.copied_bytes;
      if (by_allocations) {
        live_after = memory_tracker::current_bytes(device);
        peak = scope->peak();
        held = std::max(held, peak - live_before + 2 * cost.input_bytes);
      }
      if (log) saved = log->entries();
    }
    // Where keeping a product takes a copy (LibTorch 1.13's Linear on a 3D
    // input), the copy is timed here, outside the bytes measured, and taken off
    // what keeping the products saves.
    if (copied_bytes > 0 && !computing_nothing()) {
      const auto bytes = at::empty({copied_bytes}, at::TensorOptions(at::kByte).device(device));
      synchronize(device);
      const auto start = std::chrono::steady_clock::now();
      const auto copy = bytes.clone();
      synchronize(device);
      cost.product_saved_seconds = std::max(0.0, cost.product_saved_seconds - seconds_since(start));
    }
    cost.mutates_input = x._version() != version;
    cost.output_bytes = static_cast<std::int64_t>(y.nbytes());
    cost.output_is_view = y.storage().is_alias_of(x.storage());
    if (by_allocations) {
      cost.workspace_bytes = std::max<std::int64_t>(0, peak - live_after);
      const auto kept = live_after - live_before;
      cost.saved_bytes = std::max<std::int64_t>(0, kept - (cost.output_is_view ? 0 : cost.output_bytes));
      cost.compact_bytes = std::min(cost.compact_bytes, cost.saved_bytes);
      cost.compact_transient_bytes = std::min(cost.compact_transient_bytes, cost.compact_bytes);
    } else if (source == byte_source::saved_tensors) {
      // New storages autograd keeps, beyond the input, the output and the slot's own tensors.
      std::unordered_set<const void*> counted{storage_of(x), storage_of(y)};
      for (const auto& p : slot.ptr()->parameters()) counted.insert(storage_of(p));
      for (const auto& b : slot.ptr()->buffers()) counted.insert(storage_of(b));
      for (const auto& e : saved) {
        if (!cost.output_is_view) {
          cost.saves_input = cost.saves_input || e.storage == storage_of(x);
          cost.saves_output = cost.saves_output || e.storage == storage_of(y);
        }
        if (counted.insert(e.storage).second) cost.saved_bytes += e.bytes;
      }
    } else {
      cost.saves_input = cost.saves_output = !cost.output_is_view;  // unknown: assume both kept
    }

    if (y.requires_grad()) {
      std::vector<torch::Tensor> targets;
      if (x.requires_grad()) targets.push_back(x);
      for (const auto& p : slot.ptr()->parameters())
        if (p.requires_grad()) targets.push_back(p);
      auto grad_output = torch::ones_like(y);
      const auto start = profile_clock_scope::now();
      if (!targets.empty()) {
        // What the backward holds beyond the gradients it returns (the input's
        // counts in the model's backward peak, the parameters' are static bytes).
        std::optional<memory_tracker::peak_scope> scope;
        std::int64_t live_before_backward = 0;
        if (by_allocations) {
          live_before_backward = memory_tracker::current_bytes(device);
          scope.emplace(device);
        }
        auto grads = torch::autograd::grad({y}, targets, {grad_output}, /*retain_graph=*/true,
                                           /*create_graph=*/false, /*allow_unused=*/true);
        synchronize(device);
        if (by_allocations) {
          std::int64_t returned = 0;
          for (const auto& g : grads)
            if (g.defined()) returned += static_cast<std::int64_t>(g.nbytes());
          cost.backward_workspace_bytes = std::max<std::int64_t>(0, scope->peak() - live_before_backward - returned);
          held = std::max(held, scope->peak() - live_before + 2 * cost.input_bytes);
        }
      }
      cost.backward_seconds = profile_clock_scope::now() - start;
    }
    auto next = y.detach().clone();
    if (by_allocations) {
      // Which of input and output does the graph keep alive?
      const auto live_with_input = memory_tracker::current_bytes(device);
      x = torch::Tensor();
      const auto live_without_input = memory_tracker::current_bytes(device);
      cost.saves_input = !cost.output_is_view && y.grad_fn() != nullptr &&
                         live_with_input - live_without_input < cost.input_bytes / 2;
      auto graph = y.grad_fn();
      y = torch::Tensor();
      const auto live_without_output = memory_tracker::current_bytes(device);
      cost.saves_output = !cost.output_is_view && graph != nullptr &&
                          live_without_input - live_without_output < cost.output_bytes / 2;
      graph.reset();
    } else if (y.grad_fn() == nullptr) {
      cost.saves_input = cost.saves_output = false;  // no graph: nothing is kept for backward
      cost.saved_bytes = 0;
    }
    // Memory from the last pass (one-time allocations are gone); the fastest times.
    if (cost.forward_seconds < fastest_forward) {
      fastest_replay_saved = cost.replay_saved_seconds;
      fastest_product_saved = cost.product_saved_seconds;
    }
    fastest_forward = std::min(fastest_forward, cost.forward_seconds);
    fastest_backward = std::min(fastest_backward, cost.backward_seconds);
    result.cost = cost;
    result.cost.forward_seconds = fastest_forward;
    result.cost.replay_saved_seconds = std::min(fastest_replay_saved, fastest_forward);
    result.cost.product_saved_seconds = std::min(fastest_product_saved, fastest_forward);
    result.cost.backward_seconds = fastest_backward;
    if (offload_freed >= 0)
      result.cost.offload_kept_bytes = std::max<std::int64_t>(0, result.cost.saved_bytes - offload_freed);
    result.output = std::move(next);
    result.bytes = source;
    result.peak_bytes = held;
  }
  return result;
}

/// The rate model's forward and backward seconds for a static estimate on an
/// input of `input_bytes` (device/compute_rates.hpp): forward = flops /
/// flops_per_second + the bytes it reads and writes (input, output, what it
/// saves besides) / bytes_per_second; backward twice the arithmetic (a matrix
/// product's gradient is two of them) and one and a half times the bytes (it
/// reads the output's gradient beside what the forward read).
struct rate_model_seconds {
  double forward = 0.0;
  double backward = 0.0;
  rate_model_seconds(const layer_estimate& e, std::int64_t input_bytes, const compute_rates& rates) {
    const double bytes = static_cast<double>(input_bytes + (e.output_is_view ? 0 : e.output_bytes()) + e.saved_bytes);
    forward = rates.seconds(e.flops, bytes);
    backward = rates.seconds(2.0 * e.flops, 1.5 * bytes);
  }
};

/// A slot's costs from a static estimate, its times the rate model's
/// (rate_model_seconds). The profiler replaces them with measured times where
/// it may run the slot (use_empirical_fallback).
inline slot_cost static_cost(const layer_estimate& e, std::int64_t input_bytes, const compute_rates& rates) {
  slot_cost cost;
  cost.input_bytes = input_bytes;
  cost.output_bytes = e.output_bytes();
  cost.output_is_view = e.output_is_view;
  cost.saved_bytes = e.saved_bytes;
  cost.saves_input = e.saves_input;
  cost.saves_output = e.saves_output;
  cost.workspace_bytes = e.workspace_bytes;
  cost.backward_workspace_bytes = e.backward_workspace_bytes;
  cost.fixed_workspace_bytes = e.fixed_workspace_bytes;
  const rate_model_seconds seconds(e, input_bytes, rates);
  cost.forward_seconds = seconds.forward;
  cost.backward_seconds = seconds.backward;
  return cost;
}

/// The fewest rows a part of a convolution's input keeps to run the whole's
/// kernels: on CPU, LibTorch picks oneDNN's by the batch (use_mkldnn, 1.13 and
/// 2.x: from 16 rows for an unstrided 1x1 kernel on one thread, else from 2).
template <std::size_t D, class Impl>
std::int64_t conv_kernel_rows(const Impl* m) {
  bool pointwise = true;
  for (std::size_t i = 0; i < D; ++i)
    pointwise = pointwise && (*m->options.kernel_size())[i] == 1 && (*m->options.stride())[i] == 1 &&
                (*m->options.dilation())[i] == 1;
  return pointwise && at::get_num_threads() == 1 ? 16 : 2;
}

/// conv_kernel_rows for a convolution, the largest of its children's for a
/// module that holds some (a nested Sequential), else 1.
inline std::int64_t same_kernel_rows(const torch::nn::Module& m) {
  if (const auto* c = dynamic_cast<const torch::nn::Conv1dImpl*>(&m)) return conv_kernel_rows<1>(c);
  if (const auto* c = dynamic_cast<const torch::nn::Conv2dImpl*>(&m)) return conv_kernel_rows<2>(c);
  std::int64_t rows = 1;
  for (const auto& child : m.children()) rows = std::max(rows, same_kernel_rows(*child));
  return rows;
}

/// A byte figure measured at `r` and `3r` rows, extrapolated to `n` rows along
/// the line through them (never below the larger part's figure).
inline std::int64_t extrapolate_rows(std::int64_t at_r, std::int64_t at_3r, std::int64_t r, std::int64_t n) {
  const double slope = static_cast<double>(at_3r - at_r) / static_cast<double>(2 * r);
  const auto v = static_cast<double>(at_3r) + slope * static_cast<double>(n - 3 * r);
  return std::max(at_3r, static_cast<std::int64_t>(v));
}

/// A byte figure measured at 2s, 3s and 4s positions, extrapolated to t·s
/// along the parabola through them (never below the largest part's figure).
inline std::int64_t extrapolate_parabola(std::int64_t at_2s, std::int64_t at_3s, std::int64_t at_4s, double t) {
  const double v = static_cast<double>(at_2s) * (t - 3.0) * (t - 4.0) / 2.0 -
                   static_cast<double>(at_3s) * (t - 2.0) * (t - 4.0) +
                   static_cast<double>(at_4s) * (t - 2.0) * (t - 3.0) / 2.0;
  return std::max(at_4s, static_cast<std::int64_t>(v));
}

/// How far a figure measured at s, 2s, 3s and 4s positions may be off at t·s
/// along the parabola through the last three: the first part's distance from
/// that parabola, carried to t as a cubic term would carry it.
inline double parabola_miss(std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d, double t) {
  const double at_s = static_cast<double>(a) - (3.0 * static_cast<double>(b) - 3.0 * static_cast<double>(c) +
                                                static_cast<double>(d));
  return std::abs(at_s) * std::max(1.0, (t - 2.0) * (t - 3.0) * (t - 4.0) / 6.0);
}

}  // namespace memscale::detail

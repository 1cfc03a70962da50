// memscale — shape-only execution's public switch: shape_only_available(),
// measured_shape_only_rates() and shape_only_scope, the guard that runs a span
// shape-only (the fallback, predict/shape_only_fallback.hpp) and keeps its tally.
//
// LibTorch 2.x uses DispatchKey::Fake for its own FakeTensor mode: there
// shape_only_available() is false and shape_only_scope refuses.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>

#include <torch/version.h>

#include <memscale/errors.hpp>
#include <memscale/predict/shape_only_arena.hpp>
#include <memscale/predict/shape_only_fallback.hpp>
#include <memscale/predict/shape_only_tally.hpp>

#if TORCH_VERSION_MAJOR < 2
#include <c10/core/impl/LocalDispatchKeySet.h>
#endif

namespace memscale::predictor {

/// Whether shape-only execution is possible in this process (LibTorch 1.13,
/// and the fallback registered).
[[nodiscard]] inline bool shape_only_available() {
#if TORCH_VERSION_MAJOR < 2
  return detail::register_shape_only_fallback();
#else
  return false;
#endif
}

/// The rates shape-only execution estimates times with, measured now if they
/// were not yet (a few milliseconds of real work whose allocations a watching
/// scope would see: call it before opening a span whose allocations are watched).
/// Zero where shape-only execution is unavailable.
[[nodiscard]] inline shape_only_rates measured_shape_only_rates() {
#if TORCH_VERSION_MAJOR < 2
  return detail::register_shape_only_fallback() ? detail::rates() : shape_only_rates{};
#else
  return {};
#endif
}

/// Runs what is dispatched on this thread (and autograd's, for the work it
/// starts) shape-only while open; with `census`, an operator's first call in
/// the process among census spans also runs for real, unseen (see
/// predict/shape_only_fallback.hpp's header).
/// One open scope at a time per process; open it only where
/// shape_only_available(). The tally is the span's.
class shape_only_scope {
 public:
  explicit shape_only_scope(bool census = false) {
#if TORCH_VERSION_MAJOR < 2
    if (!detail::register_shape_only_fallback())
      throw Error("memscale::predict(): shape-only execution is unavailable (LibTorch refused a fallback for "
                  "DispatchKey::Fake: another library registered one)");
    auto& state = detail::shape_only_state::instance();
    {
      std::lock_guard<std::mutex> lock(state.mutex);
      state.tally = &tally_;
      state.census = census;
    }
    guard_.emplace(c10::DispatchKey::Fake);
#else
    (void)census;
    throw Error("memscale::predict(): shape-only execution needs LibTorch 1.x (DispatchKey::Fake is LibTorch 2.x's "
                "own FakeTensor key)");
#endif
  }
  shape_only_scope(const shape_only_scope&) = delete;
  shape_only_scope& operator=(const shape_only_scope&) = delete;
  ~shape_only_scope() {
#if TORCH_VERSION_MAJOR < 2
    guard_.reset();
    auto& state = detail::shape_only_state::instance();
    {
      std::lock_guard<std::mutex> lock(state.mutex);
      state.tally = nullptr;
      state.census = false;
    }
    {
      std::lock_guard<std::mutex> lock(state.census_mutex);
      state.census_scratch.reset();  // what census_run read from: the span's only
    }
    if (auto* arena = detail::shape_only_arena::instance()) arena->start_over_if_idle();
#endif
  }
  /// What the span's operators so far would have taken computed (the tally's
  /// estimated_seconds), cheaper than a copy of the tally. The first call in a
  /// process measures the rates (measured_shape_only_rates()): where the span's
  /// allocations are watched, measure them before opening it.
  [[nodiscard]] double estimated_seconds() const {
#if TORCH_VERSION_MAJOR < 2
    const auto& rates = detail::rates();
    std::lock_guard<std::mutex> lock(detail::shape_only_state::instance().mutex);
    return rates.seconds(tally_);
#else
    return 0.0;
#endif
  }
  /// The calls so far, with estimated_seconds filled as by estimated_seconds()
  /// where the rates were measured already (0 otherwise: a copy of the tally
  /// never runs their measuring work inside a span someone watches).
  [[nodiscard]] shape_only_tally tally() const {
#if TORCH_VERSION_MAJOR < 2
    const bool estimate = detail::rates_measured();
    const auto rates = estimate ? detail::rates() : shape_only_rates{};
    std::lock_guard<std::mutex> lock(detail::shape_only_state::instance().mutex);
    auto copy = tally_;
    copy.estimated_seconds = estimate ? rates.seconds(copy) : 0.0;
    return copy;
#else
    return tally_;
#endif
  }
  /// Calls that read tensor values so far (the tally's values_read), without the
  /// copy or the rates.
  [[nodiscard]] std::int64_t values_read() const {
#if TORCH_VERSION_MAJOR < 2
    std::lock_guard<std::mutex> lock(detail::shape_only_state::instance().mutex);
#endif
    return tally_.values_read;
  }

 private:
  shape_only_tally tally_;
#if TORCH_VERSION_MAJOR < 2
  std::optional<c10::impl::IncludeDispatchKeyGuard> guard_;
#endif
};

}  // namespace memscale::predictor

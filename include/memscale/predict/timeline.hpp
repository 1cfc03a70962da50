// memscale::predict — the allocation timeline of a piece of work: the live bytes
// on one device after each allocation and free LibTorch reports while a
// timeline_scope is open (the reports its memory profiler gets: LibTorch's CPU
// allocator, memscale's counting allocator, CUDA's caching allocator). Two
// timelines of the same step at two batch sizes hold the same events in the
// same order, each event's live bytes affine in the batch: extrapolated event by
// event, they give the step's timeline, hence its peak, at any batch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <memscale/detail/format.hpp>
#include <memscale/device/memory_tracker.hpp>
#include <memscale/errors.hpp>

namespace memscale::predictor {

/// What a timeline_scope saw: live bytes (from the scope's opening) after each
/// event, whether the event was an allocation, and the marks set in between.
struct timeline {
  std::vector<std::int64_t> live;
  std::vector<bool> allocation;
  std::vector<std::size_t> marks;  ///< event counts at each mark()
  std::int64_t reserved_peak = 0;  ///< CUDA: highest reserved bytes reported (caching allocator)
  std::int64_t allocated_peak = 0;  ///< CUDA: highest allocated bytes reported, on the device as a whole
  /// Each event's block, numbered in allocation order from 0 (a free names the
  /// block it frees), to replay the step through a model of CUDA's caching
  /// allocator (predict/cuda_reserve.hpp).
  std::vector<std::uint32_t> block;

  [[nodiscard]] std::int64_t peak() const {
    return live.empty() ? 0 : std::max<std::int64_t>(0, *std::max_element(live.begin(), live.end()));
  }
  [[nodiscard]] std::int64_t end() const { return live.empty() ? 0 : live.back(); }
  /// Live bytes at mark `m` (after the events before it).
  [[nodiscard]] std::int64_t at_mark(std::size_t m) const {
    const auto n = m < marks.size() ? marks[m] : live.size();
    return n == 0 ? 0 : live[n - 1];
  }
};

/// Whether two timelines hold the same events in the same order (so that they
/// can be extrapolated event by event).
[[nodiscard]] inline bool aligned(const timeline& a, const timeline& b) {
  return a.live.size() == b.live.size() && a.allocation == b.allocation && a.marks == b.marks;
}

/// The timeline at batch `batch` from aligned timelines at batches b1 < b2.
class timeline_fit {
 public:
  timeline_fit() = default;
  timeline_fit(const timeline& t1, std::int64_t b1, const timeline& t2, std::int64_t b2)
      : t1_(t1), t2_(t2), b1_(b1), b2_(b2) {}

  [[nodiscard]] std::int64_t first_batch() const noexcept { return b1_; }
  [[nodiscard]] const timeline& first() const noexcept { return t1_; }
  [[nodiscard]] const timeline& second() const noexcept { return t2_; }
  [[nodiscard]] std::int64_t second_batch() const noexcept { return b2_; }
  /// The largest difference of live bytes, event by event, between the fit at
  /// `batch` and timeline `t` recorded there (aligned with the fit's own).
  [[nodiscard]] double largest_difference(const timeline& t, std::int64_t batch) const {
    double worst = 0.0;
    for (std::size_t e = 0; e < t.live.size() && e < t1_.live.size(); ++e)
      worst = std::max(worst, std::abs(value(e, batch) - static_cast<double>(t.live[e])));
    return worst;
  }
  /// Whether the fit gives timeline `t` (aligned with its own) at `batch`: each
  /// event within `tolerance` times t's peak.
  [[nodiscard]] bool gives(const timeline& t, std::int64_t batch, double tolerance) const {
    return t.live.size() == t1_.live.size() &&
           largest_difference(t, batch) <= tolerance * static_cast<double>(t.peak());
  }

  [[nodiscard]] double value(std::size_t event, std::int64_t batch) const {
    const double v = line(event, batch);
    return batch == corrected_batch_ && !correction_.empty() ? v + correction_[event] : v;
  }
  /// Event `event`'s live bytes at `batch` on the line between the calibrations (set_bytes aside).
  [[nodiscard]] double line(std::size_t event, std::int64_t batch) const {
    const double v1 = static_cast<double>(t1_.live[event]);
    const double v2 = static_cast<double>(t2_.live[event]);
    return v1 + (v2 - v1) * static_cast<double>(batch - b1_) / static_cast<double>(b2_ - b1_);
  }
  /// At batch `batch` only, the block allocated at event `from` and freed at
  /// event `to` holds `bytes`, not what the line between the two calibrations
  /// gives: a size measured there (a cuDNN workspace, whose algorithm changes
  /// with the batch: predict/op_workspace.hpp). Corrections are for one batch;
  /// one for another batch is ignored.
  void set_bytes(std::int64_t batch, std::size_t from, std::size_t to, std::int64_t bytes) {
    if (from >= to || to > t1_.live.size()) return;
    if (correction_.empty()) {
      correction_.assign(t1_.live.size(), 0.0);
      corrected_batch_ = batch;
    }
    if (batch != corrected_batch_) return;
    const double delta = static_cast<double>(bytes) - step(from, batch);
    for (std::size_t e = from; e < to; ++e) correction_[e] += delta;
  }
  /// The batch set_bytes corrected (0: none).
  [[nodiscard]] std::int64_t corrected_batch() const noexcept { return correction_.empty() ? 0 : corrected_batch_; }
  [[nodiscard]] std::int64_t peak(std::int64_t batch) const {
    double best = 0.0;
    for (std::size_t e = 0; e < t1_.live.size(); ++e) best = std::max(best, value(e, batch));
    if (bound_ && batch > b2_) {
      const double p2 = static_cast<double>(t2_.peak());
      double bound = p2 + (p2 - static_cast<double>(bound_->second)) * static_cast<double>(batch - b2_) /
                              static_cast<double>(b2_ - bound_->first);
      if (batch == corrected_batch()) {  // moved by what set_bytes changed in the events' peak here
        double uncorrected = 0.0;
        for (std::size_t e = 0; e < t1_.live.size(); ++e) uncorrected = std::max(uncorrected, line(e, batch));
        bound += best - uncorrected;
      }
      best = std::max(best, bound);
    }
    return static_cast<std::int64_t>(best + 0.5);
  }
  /// Beyond b2, the peak no lower than the line from `peak` at `batch` (< b2, a
  /// step's whole peak) through b2's (bound_close_pair), moved at set_bytes's
  /// batch by as much as its sizes moved the events' peak there (the line knows
  /// no event, so a size raised off the peak raises it as much). The events stay
  /// the pair's: at_mark(), end() and the CUDA reserve's replay do not see it, so
  /// what it adds counts as the step's transient bytes.
  void bound_peak_below(std::int64_t batch, std::int64_t peak) {
    if (batch < b2_) bound_ = std::pair{batch, peak};
  }
  /// The batch bound_peak_below drew its line from (0: none).
  [[nodiscard]] std::int64_t bounding_batch() const noexcept { return bound_ ? bound_->first : 0; }
  [[nodiscard]] std::int64_t end(std::int64_t batch) const {
    return t1_.live.empty() ? 0 : static_cast<std::int64_t>(value(t1_.live.size() - 1, batch) + 0.5);
  }
  [[nodiscard]] std::int64_t at_mark(std::size_t m, std::int64_t batch) const {
    const auto n = m < t1_.marks.size() ? t1_.marks[m] : t1_.live.size();
    return n == 0 ? 0 : static_cast<std::int64_t>(value(n - 1, batch) + 0.5);
  }
  /// CUDA, where the events cannot be replayed (predict/cuda_reserve.hpp): what
  /// the caching allocator reserves above its allocations at `batch` (both on the
  /// device as a whole, at their highest). Up to b2, the reserve held at b2.
  /// Beyond it, that plus a share of what the step's peak grows by: the reserve's
  /// growth per allocated byte from b1 to b2 (the device's allocated peaks: the
  /// batch's input, allocated before the step, is in their growth, not in the
  /// step's), or its share at b2 where that is more. A reserve held constant at
  /// b2's fell short as the batch grew: the
  /// example GPT's on an H200 was 7, 17 and 57 MiB at batches 16, 32 and 64, a
  /// growth of 9% of the allocations from 16 to 32, 18% from 32 to 64.
  [[nodiscard]] std::int64_t reserved_overhead(std::int64_t batch) const {
    const auto reserve = [](const timeline& t) {
      return static_cast<double>(std::max<std::int64_t>(0, t.reserved_peak - t.allocated_peak));
    };
    const double at_b2 = reserve(t2_);
    if (batch <= b2_ || t2_.allocated_peak <= 0) return static_cast<std::int64_t>(at_b2);
    const double grown = static_cast<double>(t2_.allocated_peak - t1_.allocated_peak);
    const double share = at_b2 / static_cast<double>(t2_.allocated_peak);
    const double rate = std::clamp(grown > 0 ? std::max(share, (at_b2 - reserve(t1_)) / grown) : share, 0.0, 1.0);
    const double more = static_cast<double>(std::max<std::int64_t>(0, peak(batch) - peak(b2_)));
    return static_cast<std::int64_t>(at_b2 + rate * more + 0.5);
  }
  [[nodiscard]] std::size_t events() const { return t1_.live.size(); }
  /// Event `event`: an allocation (else a free), its block, and its bytes at `batch`.
  [[nodiscard]] bool allocation(std::size_t event) const { return t2_.allocation[event]; }
  /// Whether the events name their blocks (b2's numbering: on CUDA, autograd's
  /// device thread and the caller's may free two blocks in either order, which
  /// changes neither timeline's live bytes but the numbers their frees name).
  [[nodiscard]] bool has_blocks() const noexcept {
    return !t2_.live.empty() && t2_.block.size() == t2_.live.size();
  }
  [[nodiscard]] std::uint32_t block(std::size_t event) const { return t2_.block[event]; }
  [[nodiscard]] std::int64_t bytes(std::size_t event, std::int64_t batch) const {
    return static_cast<std::int64_t>(std::abs(step(event, batch)) + 0.5);
  }
  /// Event `event`'s change of the live bytes at `batch`, signed (a line
  /// extrapolated far can take an allocation below zero).
  [[nodiscard]] double step(std::size_t event, std::int64_t batch) const {
    return value(event, batch) - (event == 0 ? 0.0 : value(event - 1, batch));
  }

 private:
  timeline t1_, t2_;
  std::int64_t b1_ = 0, b2_ = 1;
  std::vector<double> correction_;  // per event, at corrected_batch_ (set_bytes)
  std::int64_t corrected_batch_ = 0;
  std::optional<std::pair<std::int64_t, std::int64_t>> bound_;  // batch, whole peak (bound_peak_below)
};

/// `fit`, of two steps at batches close together (fit_near_target's (7H/8, H),
/// where the steps below took another path), carries a step off its path's line
/// far beyond b2: 8 times over at 2H. The example GPT's on an H200 came out 10%
/// short at batch 64 from (28, 32), where the whole steps at 16, 32 and 64 lie
/// within 1% of one line (CUDA's caching allocator reports the block it hands
/// out, up to 1 MiB over the request where it does not split one: sizes that
/// need not follow the batch between two steps 4 rows apart). Where the pair's
/// peaks rise at least a tenth less per row than those of every two others of
/// the steps that ran (`others`: batch and timeline, each below b1; with b2's),
/// the pair is taken for such a step, and the fit's peak beyond b2 is held no
/// lower than the line from the lowest of them through b2 (the widest pair).
/// Where the larger batches' path costs more per row (a tensor more), some other
/// pair rises no more than the close one, and nothing changes; where it costs
/// less per row but more at once (a fixed workspace), the bound is too high: an
/// error on the side that fits. Returns what it did, with the peak at `target`
/// before and after, for the notes (empty: nothing).
[[nodiscard]] inline std::string bound_close_pair(timeline_fit& fit,
                                                  std::vector<std::pair<std::int64_t, const timeline*>> others,
                                                  std::int64_t target) {
  const auto b1 = fit.first_batch(), b2 = fit.second_batch();
  if (others.empty() || b2 <= b1) return {};
  const auto rise = [](std::int64_t x, const timeline& a, std::int64_t y, const timeline& b) {
    return static_cast<double>(b.peak() - a.peak()) / static_cast<double>(y - x);
  };
  const double close = rise(b1, fit.first(), b2, fit.second());
  others.emplace_back(b2, &fit.second());
  std::sort(others.begin(), others.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  double least = 1e300, most = -1e300;
  for (std::size_t i = 0; i < others.size(); ++i)
    for (std::size_t j = i + 1; j < others.size(); ++j) {
      if (others[i].first >= others[j].first || others[i].first >= b1) return {};
      const double r = rise(others[i].first, *others[i].second, others[j].first, *others[j].second);
      least = std::min(least, r);
      most = std::max(most, r);
    }
  if (!(least > 0.0 && close < 0.9 * least)) return {};
  const auto was = fit.peak(target);
  fit.bound_peak_below(others.front().first, others.front().second->peak());
  const auto bytes = [](double b) { return memscale::detail::format_bytes(std::llround(b)); };
  std::string batches;
  for (std::size_t i = 0; i < others.size(); ++i)
    batches += (i == 0 ? "" : i + 1 == others.size() ? " and " : ", ") + std::to_string(others[i].first);
  const auto range = bytes(least) + (bytes(most) != bytes(least) ? " to " + bytes(most) : std::string());
  return "the pair (" + std::to_string(b1) + ", " + std::to_string(b2) + ")'s peaks rise " + bytes(close) +
         " a row where " + (others.size() > 2 ? "every two of " : "") + "the steps at " + batches + " rise " + range +
         ": taken for a step off its path's line, which the pair would carry far beyond " + std::to_string(b2) +
         ", so the peak beyond it is held no lower than the line through the steps at " +
         std::to_string(others.front().first) + " and " + std::to_string(b2) + " (at " + std::to_string(target) +
         ": " + memscale::detail::format_bytes(fit.peak(target)) + " where the pair gave " +
         memscale::detail::format_bytes(was) + ")";
}

namespace detail {

/// The PROFILER_STATE occupant a timeline_scope installs: records the live bytes
/// of blocks on one device allocated while open, and passes every report on to
/// the reporter it shadows, as that one asks for.
class timeline_reporter final : public c10::MemoryReportingInfoBase {
 public:
  timeline_reporter(c10::Device device, c10::MemoryReportingInfoBase* outer,
                    std::shared_ptr<c10::ThreadLocalDebugInfo> outer_chain)
      : device_(device), outer_(outer), outer_chain_(std::move(outer_chain)) {}

  void reportMemoryUsage(void* ptr, std::int64_t alloc_size, memscale::detail::report_total_t total_allocated,
                         memscale::detail::report_total_t total_reserved, c10::Device device) override {
    if (ptr != nullptr && ours(device)) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (open_ && alloc_size > 0) {
        blocks_[ptr] = {alloc_size, next_block_};
        live_ += alloc_size;
        record(true, next_block_++, static_cast<std::int64_t>(total_allocated),
               static_cast<std::int64_t>(total_reserved));
      } else if (const auto it = alloc_size < 0 ? blocks_.find(ptr) : blocks_.end(); it != blocks_.end()) {
        if (open_) {
          live_ -= it->second.first;
          record(false, it->second.second, static_cast<std::int64_t>(total_allocated),
                 static_cast<std::int64_t>(total_reserved));
        }
        blocks_.erase(it);
      }
    }
    if (outer_ != nullptr && outer_->memoryProfilingEnabled())
      outer_->reportMemoryUsage(ptr, alloc_size, total_allocated, total_reserved, device);
  }
  void reportOutOfMemory(std::int64_t alloc_size, memscale::detail::oom_total_t total_allocated,
                         memscale::detail::oom_total_t total_reserved, c10::Device device) override {
    if (outer_ != nullptr) outer_->reportOutOfMemory(alloc_size, total_allocated, total_reserved, device);
  }
  [[nodiscard]] bool memoryProfilingEnabled() const override { return true; }

  void mark() {
    std::lock_guard<std::mutex> lock(mutex_);
    trace_.marks.push_back(trace_.live.size());
  }
  [[nodiscard]] std::size_t events() {
    std::lock_guard<std::mutex> lock(mutex_);
    return trace_.live.size();
  }
  timeline close() {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = false;
    return std::move(trace_);
  }

 private:
  [[nodiscard]] bool ours(c10::Device device) const {
    if (device.type() != device_.type()) return false;
    if (device.is_cpu()) return true;
    const auto index = [](c10::Device d) { return d.has_index() ? d.index() : c10::DeviceIndex{0}; };
    return index(device) == index(device_);
  }
  void record(bool allocation, std::uint32_t block, std::int64_t allocated, std::int64_t reserved) {
    trace_.live.push_back(live_);
    trace_.allocation.push_back(allocation);
    trace_.block.push_back(block);
    if (!device_.is_cpu()) {
      trace_.reserved_peak = std::max(trace_.reserved_peak, reserved);
      trace_.allocated_peak = std::max(trace_.allocated_peak, allocated);
    }
  }

  c10::Device device_;
  c10::MemoryReportingInfoBase* outer_;
  std::shared_ptr<c10::ThreadLocalDebugInfo> outer_chain_;  // keeps outer_ alive
  std::mutex mutex_;
  bool open_ = true;
  std::int64_t live_ = 0;
  std::unordered_map<void*, std::pair<std::int64_t, std::uint32_t>> blocks_;  // bytes, number
  std::uint32_t next_block_ = 0;
  timeline trace_;
};

}  // namespace detail

/// Records the allocation timeline on `device` while open (this thread and the
/// threads that inherit its debug info: autograd's). Throws memscale::Error when
/// a LibTorch profiler holds the slot it needs. Close it on the thread that
/// opened it.
class timeline_scope {
 public:
  explicit timeline_scope(c10::Device device) {
    const auto slot = memscale::detail::inspect_profiler_slot();
    if (!slot.refusal.empty())
      throw Error("memscale::predict(): " + slot.refusal +
                  "; predict() records the step's allocations through that slot: run it outside the profiler");
    reporter_ = std::make_shared<detail::timeline_reporter>(device, slot.outer, c10::ThreadLocalDebugInfo::current());
    guard_.emplace(c10::DebugInfoKind::PROFILER_STATE, reporter_);
  }
  timeline_scope(const timeline_scope&) = delete;
  timeline_scope& operator=(const timeline_scope&) = delete;
  ~timeline_scope() = default;

  /// Marks the current point of the timeline (phase boundaries).
  void mark() { reporter_->mark(); }
  /// The events recorded so far (any thread).
  [[nodiscard]] std::size_t events() const { return reporter_->events(); }
  /// Stops recording and returns the timeline; the scope stays installed until
  /// destroyed, passing reports on.
  timeline finish() {
    auto t = reporter_->close();
    guard_.reset();
    return t;
  }

 private:
  std::shared_ptr<detail::timeline_reporter> reporter_;
  std::optional<c10::DebugInfoGuard> guard_;
};

}  // namespace memscale::predictor

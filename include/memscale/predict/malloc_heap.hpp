// memscale::predict — what glibc's malloc keeps resident beyond a step's live
// bytes on CPU, with the mmap threshold fixed (memscale::fix_malloc_mmap_threshold()).
//
// LibTorch's CPU allocator asks posix_memalign(64, n). glibc serves a request
// whose chunk, with the alignment and a minimal chunk more, stays under the
// threshold from its heap, and maps a larger one on its own, unmapping it when
// freed. A freed heap chunk stays resident: the heap gives pages back only from
// its top, which the program's and LibTorch's own small objects (autograd's
// nodes, the loss, the optimizer's scalars), made after a step's tensors, hold.
// So the heap holds the highest of its live bytes so far, and a step whose peak
// comes after its small tensors are freed (a large gradient made late in
// backward, mapped) holds them too. Measured on a 100k-token GRU (its per-step
// tensors 32 and 96 KiB at batch 32): 23-25 MiB free in the heap under the
// embedding's 49 MiB gradient at 32; at 64, where glibc's bins serve its 192 KiB
// gate tensors from those free chunks too, the heap grew for about six steps, to
// 49-54 MiB free. A calibration at 2 and 3 rows sees none of it
// (benchmarks/RESULTS.md, "glibc's heap").
//
// The estimate takes the heap as packed perfectly (a freed chunk is reused by
// any later request it holds, a request over the threshold too, as glibc's bins
// serve it) and never trimmed: resident = mapped live bytes + the heap's
// high-water mark; replayed until a pass leaves that mark where it was (the
// heap's growth over steps), 8 passes at most. Not modelled: fragmentation (the
// heap growing for a request no one free chunk holds), a trim where nothing
// holds the top, other threads' arenas.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include <memscale/device/process_memory.hpp>
#include <memscale/predict/replay.hpp>
#include <memscale/predict/timeline.hpp>

namespace memscale::predictor {

class malloc_heap_estimate {
 public:
  explicit malloc_heap_estimate(std::int64_t mmap_threshold) : threshold_(mmap_threshold) {}

  /// Whether glibc serves posix_memalign(64, bytes) from its heap: the request's
  /// chunk (request2size) with the alignment and a minimal chunk more (what
  /// _int_memalign asks _int_malloc for), as a chunk, under the threshold.
  [[nodiscard]] bool from_heap(std::int64_t bytes) const {
    return chunk(chunk(bytes) + alignment + min_chunk) < threshold_;
  }
  void allocate(std::uint64_t key, std::int64_t bytes) {
    const bool heap = from_heap(bytes) || heap_high_ - heap_ >= bytes;
    if (key < dense_keys) {
      if (key >= dense_.size()) dense_.resize(key + 1, {0, 0});
      dense_[key] = {bytes, static_cast<std::int8_t>(heap ? 2 : 1)};
    } else {
      others_[key] = {bytes, heap};
    }
    (heap ? heap_ : mapped_) += bytes;
    heap_high_ = std::max(heap_high_, heap_);
    peak_live_ = std::max(peak_live_, heap_ + mapped_);
    peak_resident_ = std::max(peak_resident_, heap_high_ + mapped_);
  }
  void free(std::uint64_t key) {
    if (key < dense_keys) {
      if (key >= dense_.size() || dense_[key].second == 0) return;
      (dense_[key].second == 2 ? heap_ : mapped_) -= dense_[key].first;
      dense_[key].second = 0;
      return;
    }
    const auto it = others_.find(key);
    if (it == others_.end()) return;
    (it->second.second ? heap_ : mapped_) -= it->second.first;
    others_.erase(it);
  }
  /// Whether the heap's high-water mark is where it was at the last call: a
  /// replayed pass that did not raise it leaves the next the same start.
  [[nodiscard]] bool settled() {
    const bool same = heap_high_ == settled_at_;
    settled_at_ = heap_high_;
    return same;
  }
  /// The highest live bytes, and the highest resident (mapped live + heap high-water).
  [[nodiscard]] std::int64_t peak_live() const noexcept { return peak_live_; }
  [[nodiscard]] std::int64_t peak_resident() const noexcept { return peak_resident_; }

 private:
  static constexpr std::int64_t alignment = 64, min_chunk = 32;  // c10's gAlignment; glibc's MINSIZE
  [[nodiscard]] static std::int64_t chunk(std::int64_t bytes) {
    return std::max<std::int64_t>(min_chunk, (bytes + 8 + 15) & ~std::int64_t{15});
  }
  std::int64_t threshold_;
  static constexpr std::uint64_t dense_keys = std::uint64_t{1} << 32;  // a step's block numbers
  std::vector<std::pair<std::int64_t, std::int8_t>> dense_;  // bytes; 0 free, 1 mapped, 2 from the heap
  std::unordered_map<std::uint64_t, std::pair<std::int64_t, bool>> others_;  // bytes, from the heap
  std::int64_t heap_ = 0, mapped_ = 0, heap_high_ = 0, peak_live_ = 0, peak_resident_ = 0, settled_at_ = -1;
};

/// What the heap holds at the step's resident peak beyond its live peak: the step
/// of `fit` at `batch` replayed (replay_steps) through the estimate. nullopt where
/// the fit has no block numbers.
[[nodiscard]] inline std::optional<std::int64_t> heap_retention(const timeline_fit& fit, std::int64_t batch,
                                                                const std::vector<std::int64_t>& resident,
                                                                const std::vector<std::int64_t>& state,
                                                                std::int64_t transient, std::int64_t mmap_threshold) {
  if (!fit.has_blocks()) return std::nullopt;
  malloc_heap_estimate m(mmap_threshold);
  replay_steps(m, fit, batch, resident, state, transient, 8);
  return std::max<std::int64_t>(0, m.peak_resident() - m.peak_live());
}

/// Of the step's allocations glibc serves from its heap at batch `from` (a
/// calibration's), the share by bytes it still serves from the heap at `to`; 1
/// where none comes from the heap at `from`. What the heap gained free over a
/// shape-only calibration (its small batches' tensors under the threshold, and
/// the census's real calls') holds at the batch in this share: a ViT's 96 KiB
/// activations at batch 2 are mapped at 16, so little of the gain stays
/// (measured: 2.4 MiB; the prediction 3.8-5.5% over at 16 when it all stayed); a
/// GRU's gate tensors stay on the heap, so all of it does (with the whole gain
/// taken off it read 5.0% short at 32; benchmarks/RESULTS.md, "equal(x, x)").
[[nodiscard]] inline double heap_share_kept(const timeline_fit& fit, std::int64_t from, std::int64_t to,
                                            std::int64_t mmap_threshold) {
  const malloc_heap_estimate m(mmap_threshold);
  double heap = 0, kept = 0;
  for (std::size_t e = 0; e < fit.events(); ++e) {
    if (!fit.allocation(e)) continue;
    const auto bytes = fit.bytes(e, from);
    if (!m.from_heap(bytes)) continue;
    heap += static_cast<double>(bytes);
    if (m.from_heap(fit.bytes(e, to))) kept += static_cast<double>(bytes);
  }
  return heap > 0 ? kept / heap : 1.0;
}

/// The mmap threshold the estimate uses: glibc's where the process's malloc is
/// glibc's and its threshold is fixed; 0 (no estimate) otherwise.
[[nodiscard]] inline std::int64_t heap_estimate_threshold() {
  if (process_malloc() != malloc_kind::glibc) return 0;
  return fixed_malloc_mmap_threshold().value_or(0);
}

}  // namespace memscale::predictor

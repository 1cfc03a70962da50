// memscale — what the process came to hold outside LibTorch's allocator for a
// model, remembered across predict() calls in one process (CPU).
//
// predict() measures that share as the process's growth over its calibration
// (libtorch's code read in at a kernel's first use, OpenMP and oneDNN buffers,
// the BLAS library's packing buffers). It is made once per process: a second
// call, or one after the model has trained, sees the pages already resident and
// reads little or nothing, though a training step holds them all the same. An
// earlier call's figures for the same model stand in for what a later one cannot
// see again: its base share (measured at the calibration's own batches) at any
// batch, its total with the BLAS buffers at a batch no larger than the one asked
// for (those grow with the batch). Measured on a CNN here: 32.1 MB predicted in
// a fresh process, 17.0 MB by a second call, 29.5 MB held by a fresh training
// process. A process that trained the model before its first predict() has
// nothing to remember; the README says so.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/detail/modules.hpp>
#include <memscale/device/hardware.hpp>
#include <memscale/device/process_memory.hpp>

namespace memscale::predictor::detail {

/// The model's structure (memscale::detail::structure_of, as autotune's cache
/// key has it), the input's shape past the batch, its type and device, and the
/// training mode: what the share depends on, the batch aside. Collisions (layers
/// of the same types and shapes with other options) only over-count.
[[nodiscard]] inline std::string outside_memo_key(torch::nn::Module& root, const torch::Tensor& example) {
  std::ostringstream key;
  const auto structure = memscale::detail::structure_of(root);
  for (const auto* lines : {&structure.modules, &structure.parameters, &structure.buffers})
    for (const auto& line : *lines) key << line << ';';
  key << "input=" << memscale::detail::shape_of(example.select(0, 0)) << " on " << example.device()
      << (root.is_training() ? ";train" : ";eval");
  return key.str();
}

/// Per key, the largest outside-allocator share measured in this process: the
/// base share (measured over the calibration, at its own small batches, so the
/// same whatever the example's batch) and the totals with the BLAS buffers of
/// the example's batch.
class outside_memo {
 public:
  static outside_memo& process() {
    static outside_memo memo;
    return memo;
  }

  /// The largest base share remembered for `key` (at any batch); 0 if none.
  [[nodiscard]] std::int64_t base(const std::string& key) const {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = shares_.find(key);
    return it == shares_.end() ? 0 : it->second.base;
  }
  /// The largest total remembered for `key` at a batch no larger than `batch`; 0 if none.
  [[nodiscard]] std::int64_t at(const std::string& key, std::int64_t batch) const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::int64_t best = 0;
    if (const auto it = shares_.find(key); it != shares_.end())
      for (const auto& [b, bytes] : it->second.totals)
        if (b <= batch) best = std::max(best, bytes);
    return best;
  }

  /// The free heap bytes (glibc's) the calibration whose base is kept gained:
  /// part of its base, which a shape-only prediction takes off as the batch
  /// maps those blocks (predict/run.hpp's `beneath`); 0 if none.
  [[nodiscard]] std::int64_t heap_gain(const std::string& key) const {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = shares_.find(key);
    return it == shares_.end() ? 0 : it->second.heap_gain;
  }

  void record(const std::string& key, std::int64_t batch, std::int64_t base, std::int64_t total,
              std::int64_t heap_gain = 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& kept = shares_[key];
    if (base > kept.base || (base == kept.base && heap_gain > kept.heap_gain)) kept.heap_gain = heap_gain;
    kept.base = std::max(kept.base, base);
    for (auto& [b, bytes] : kept.totals)
      if (b == batch) {
        bytes = std::max(bytes, total);
        return;
      }
    kept.totals.emplace_back(batch, total);
  }

  void forget() {  // tests: as a fresh process
    std::lock_guard<std::mutex> lock(mutex_);
    shares_.clear();
  }

 private:
  struct shares {
    std::int64_t base = 0;
    std::int64_t heap_gain = 0;  ///< the free heap bytes in `base`
    std::vector<std::pair<std::int64_t, std::int64_t>> totals;  ///< (batch, base + BLAS buffers)
  };
  mutable std::mutex mutex_;
  std::map<std::string, shares> shares_;
};

/// The base share (`measured`) raised to what an earlier call measured for
/// `key`: its base, and its total less `blas` (the part that grows with the
/// batch, at `batch`) where that call's batch was no larger; records both. A
/// note says how much was remembered. `measured` < 0 (not measured) is returned as is.
/// `heap_gain`: this calibration's free heap gain, in `measured`; where an
/// earlier figure stands in, it becomes the one in that figure (this call's
/// gain is not in it: taken off, a later call read a few KiB under the first).
[[nodiscard]] inline std::int64_t remembered_outside(const std::string& key, std::int64_t batch,
                                                     std::int64_t measured, std::int64_t blas,
                                                     std::vector<std::string>& notes, std::int64_t& heap_gain) {
  if (measured < 0) return measured;
  auto& memo = outside_memo::process();
  // The base kept is the calibration's own: a total raised from a larger batch's
  // (its BLAS buffers in it) would charge a smaller batch with them.
  const auto base = std::max(measured, memo.base(key));
  const auto raised = std::max(base, memo.at(key, batch) - blas);
  const auto own_gain = heap_gain;
  if (raised > measured) {
    heap_gain = memo.heap_gain(key);
    notes.push_back("outside the allocator: " + memscale::detail::format_bytes(raised + blas) + " as an earlier "
                    "predict() of this model in this process measured it; this call's calibration saw " +
                    memscale::detail::format_bytes(measured + blas) + " grow, the rest being resident since");
  }
  memo.record(key, batch, base, raised + blas, base == measured ? own_gain : heap_gain);
  return raised;
}

/// What predict() says about malloc where the process figures depend on it.
inline void malloc_notes(std::vector<std::string>& notes) {
  if (process_malloc() == malloc_kind::tcmalloc)
    notes.push_back("malloc is tcmalloc: predict's process figures are calibrated and checked with glibc's malloc "
                    "and its mmap threshold fixed (within 1% on the example GPT); under tcmalloc the process held "
                    "1-13% more than predicted there (benchmarks/RESULTS.md, \"tcmalloc\")");
  else if (!process_memory_follows_allocator())
    notes.push_back(malloc_retention_advice() +
                    "; until then a fresh process's step may hold up to 2x the allocator's peak, varying run to run "
                    "(glibc's heaps: 1.4-2.0x measured on the example GPT and a ResNet-style CNN), and the process "
                    "figures here do not hold");
}

}  // namespace memscale::predictor::detail

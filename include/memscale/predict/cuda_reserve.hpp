// memscale::predict — what CUDA's caching allocator reserves for a sequence of
// allocations and frees, from a model of its rules (c10/cuda/CUDACachingAllocator.cpp,
// LibTorch 1.13 to 2.x with the default PYTORCH_CUDA_ALLOC_CONF):
//   - a request is rounded up to a multiple of 512 bytes;
//   - up to 1 MiB it comes from the small pool, carved out of 2 MiB segments;
//     larger ones from the large pool, under 10 MiB out of 20 MiB segments, else
//     from a segment of the size rounded up to 2 MiB;
//   - the smallest free cached block that fits is taken (the lowest address
//     among equals), and split where what remains is at least 512 bytes (small
//     pool) or over 1 MiB (large pool); else the whole block is handed out;
//   - a freed block merges with free neighbours of its own segment;
//   - segments are never given back (no emptyCache, no out-of-memory retry).
// One stream, no expandable segments, no max_split_size. Pure arithmetic: no
// CUDA needed, so it is tested on any machine (tests/test_predict.cpp).
// replay_reserve runs a step's extrapolated timeline through it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memscale/device/memory_tracker.hpp>
#include <memscale/predict/replay.hpp>
#include <memscale/predict/timeline.hpp>

namespace memscale::predictor {

class caching_allocator_model {
 public:
  static constexpr std::int64_t min_block = 512;
  static constexpr std::int64_t small_size = std::int64_t{1} << 20;        // kSmallSize
  static constexpr std::int64_t small_buffer = std::int64_t{2} << 20;      // kSmallBuffer
  static constexpr std::int64_t large_buffer = std::int64_t{20} << 20;     // kLargeBuffer
  static constexpr std::int64_t min_large_alloc = std::int64_t{10} << 20;  // kMinLargeAlloc
  static constexpr std::int64_t round_large = std::int64_t{2} << 20;       // kRoundLarge

  [[nodiscard]] static std::int64_t round_size(std::int64_t bytes) {
    return bytes < min_block ? min_block : (bytes + min_block - 1) / min_block * min_block;
  }
  [[nodiscard]] static std::int64_t segment_size(std::int64_t rounded) {
    if (rounded <= small_size) return small_buffer;
    if (rounded < min_large_alloc) return large_buffer;
    return (rounded + round_large - 1) / round_large * round_large;
  }

  /// Allocates `bytes` for `key` (a key in use is freed first).
  void allocate(std::uint64_t key, std::int64_t bytes) {
    if (keys_.contains(key)) free(key);
    const auto size = round_size(std::max<std::int64_t>(0, bytes));
    const bool small = size <= small_size;
    auto& pool = small ? small_free_ : large_free_;
    auto it = pool.lower_bound({size, std::int64_t{-1}});
    std::int64_t address = 0;
    if (it != pool.end()) {
      address = it->second;
      pool.erase(it);
    } else {  // a new segment, far from the others (no merging across segments)
      const auto bytes_reserved = segment_size(size);
      address = next_address_;
      next_address_ += bytes_reserved + large_buffer;
      blocks_[address] = {bytes_reserved, segments_++, small, true};
      reserved_ += bytes_reserved;
      peak_reserved_ = std::max(peak_reserved_, reserved_);
    }
    auto& b = blocks_.at(address);
    const auto remaining = b.size - size;
    if (small ? remaining >= min_block : remaining > small_size) {
      blocks_[address + size] = {remaining, b.segment, small, true};
      pool.insert({remaining, address + size});
      b.size = size;
    }
    b.free = false;
    keys_[key] = address;
    allocated_ += b.size;
    peak_allocated_ = std::max(peak_allocated_, allocated_);
  }

  /// Frees `key`'s block; an unknown key is ignored.
  void free(std::uint64_t key) {
    const auto k = keys_.find(key);
    if (k == keys_.end()) return;
    auto it = blocks_.find(k->second);
    keys_.erase(k);
    allocated_ -= it->second.size;
    it->second.free = true;
    auto& pool = it->second.small ? small_free_ : large_free_;
    if (it != blocks_.begin()) {  // merge with a free block before it in the same segment
      const auto before = std::prev(it);
      if (before->second.free && before->second.segment == it->second.segment &&
          before->first + before->second.size == it->first) {
        pool.erase({before->second.size, before->first});
        before->second.size += it->second.size;
        blocks_.erase(it);
        it = before;
      }
    }
    if (const auto after = std::next(it); after != blocks_.end() && after->second.free &&
                                          after->second.segment == it->second.segment &&
                                          it->first + it->second.size == after->first) {
      pool.erase({after->second.size, after->first});
      it->second.size += after->second.size;
      blocks_.erase(after);
    }
    pool.insert({it->second.size, it->first});
  }

  [[nodiscard]] bool holds(std::uint64_t key) const { return keys_.contains(key); }
  [[nodiscard]] std::int64_t allocated() const noexcept { return allocated_; }
  [[nodiscard]] std::int64_t reserved() const noexcept { return reserved_; }
  [[nodiscard]] std::int64_t peak_allocated() const noexcept { return peak_allocated_; }
  [[nodiscard]] std::int64_t peak_reserved() const noexcept { return peak_reserved_; }
  [[nodiscard]] int segments() const noexcept { return segments_; }

 private:
  struct block {
    std::int64_t size = 0;
    int segment = 0;
    bool small = false;
    bool free = true;
  };
  std::map<std::int64_t, block> blocks_;                     // by address
  std::set<std::pair<std::int64_t, std::int64_t>> small_free_;  // (size, address): best fit first
  std::set<std::pair<std::int64_t, std::int64_t>> large_free_;
  std::unordered_map<std::uint64_t, std::int64_t> keys_;     // key -> address
  std::int64_t next_address_ = 0;
  std::int64_t allocated_ = 0, reserved_ = 0, peak_allocated_ = 0, peak_reserved_ = 0;
  int segments_ = 0;
};

/// What the caching allocator holds over steady training steps, replayed.
struct replayed_reserve {
  std::int64_t reserved = 0;   ///< its highest reserve
  std::int64_t allocated = 0;  ///< its highest allocations
};

/// predict()'s note on what it counts outside CUDA's caching allocator.
inline constexpr const char* cuda_outside_note =
    "CUDA: outside the allocator = the caching allocator's reserve above its allocations (the step's extrapolated "
    "allocations and frees replayed through a model of its rounding, segments and best fit; where the calibrations "
    "did not align, the reserve it held above its allocations at the larger calibration batch, grown with the step "
    "beyond it), plus the device memory in use outside it now (the CUDA context, cuBLAS's and cuDNN's handles, and "
    "other processes' memory); what is allocated on the device beyond the model's tensors, its optimizer's state and "
    "the example (cuBLAS's workspaces, the program's other tensors) is counted as held through the step";

/// predict()'s note where the calibrations `which` ("without", "with") the plan did not align.
[[nodiscard]] inline std::string unaligned_reserve_note(const timeline_fit& fit, const char* which) {
  return std::string("CUDA: the calibrations ") + which + " the plan did not align event by event: the caching " +
         "allocator's reserve is not replayed: the one held at batch " + std::to_string(fit.second_batch()) +
         ", beyond it grown with the step (at its rate from " + std::to_string(fit.first_batch()) +
         ", or its share there where more)";
}

/// The step of `fit` at `batch` replayed through the caching allocator's model
/// (replay_steps). nullopt where the fit has no block numbers (the calibrations
/// did not align).
[[nodiscard]] inline std::optional<replayed_reserve> replay_reserve(const timeline_fit& fit, std::int64_t batch,
                                                                     const std::vector<std::int64_t>& resident,
                                                                     const std::vector<std::int64_t>& state,
                                                                     std::int64_t transient) {
  if (!fit.has_blocks()) return std::nullopt;
  caching_allocator_model m;
  replay_steps(m, fit, batch, resident, state, transient);
  return replayed_reserve{m.peak_reserved(), m.peak_allocated()};
}

namespace detail {

/// CUDA: what `allocated` (the caching allocator's allocated bytes on `device`)
/// holds beyond what memscale can name: the parameters, buffers and defined
/// gradients there, the caller's gradients a sandbox holds set aside
/// (`set_aside`: predict counts the step's gradients in their own row), the
/// optimizer's state (`state_bytes`) and the example. That is cuBLAS's
/// workspaces (one per thread that ran a matrix product: the caller's and
/// autograd's), and the program's other tensors, which a training step holds too.
[[nodiscard]] inline std::int64_t unnamed_allocations(c10::Device device, std::int64_t allocated,
                                                      const std::vector<at::Tensor>& parameters,
                                                      const std::vector<at::Tensor>& buffers,
                                                      std::int64_t state_bytes, const at::Tensor& example,
                                                      const std::vector<at::Tensor>& set_aside = {}) {
  std::int64_t named = state_bytes;
  const auto add = [&](const at::Tensor& t) {
    if (t.defined() && t.device() == device) named += static_cast<std::int64_t>(t.nbytes());
  };
  for (const auto& p : parameters) {
    add(p);
    add(p.grad());
  }
  for (const auto& g : set_aside) add(g);
  for (const auto& b : buffers) add(b);
  add(example);
  return std::max<std::int64_t>(0, allocated - named);
}

/// The blocks that live across steps: parameters, buffers on `device`, and the
/// gradients where they are kept between steps (LibTorch 1.x).
[[nodiscard]] inline std::vector<std::int64_t> resident_blocks(const std::vector<at::Tensor>& parameters,
                                                               const std::vector<at::Tensor>& buffers,
                                                               const std::vector<at::Tensor>& trainable,
                                                               bool gradients_kept, c10::Device device) {
  std::vector<std::int64_t> blocks;
  for (const auto& p : parameters) blocks.push_back(static_cast<std::int64_t>(p.nbytes()));
  for (const auto& b : buffers)
    if (b.defined() && b.device() == device) blocks.push_back(static_cast<std::int64_t>(b.nbytes()));
  if (gradients_kept)
    for (const auto& p : trainable) blocks.push_back(static_cast<std::int64_t>(p.nbytes()));
  return blocks;
}

/// The optimizer's state as blocks: per trainable parameter, its share of
/// `state_bytes` in as many blocks as bytes of state per byte of parameter
/// (Adam: 2, its moments), at least 1 and at most 4.
[[nodiscard]] inline std::vector<std::int64_t> state_blocks(const std::vector<at::Tensor>& trainable,
                                                            std::int64_t state_bytes) {
  std::vector<std::int64_t> blocks;
  std::int64_t trainable_bytes = 0;
  for (const auto& p : trainable) trainable_bytes += static_cast<std::int64_t>(p.nbytes());
  if (trainable_bytes <= 0 || state_bytes <= 0) return blocks;
  const double ratio = static_cast<double>(state_bytes) / static_cast<double>(trainable_bytes);
  const auto n = std::clamp(static_cast<int>(ratio + 0.5), 1, 4);
  for (const auto& p : trainable)
    blocks.insert(blocks.end(), static_cast<std::size_t>(n),
                  static_cast<std::int64_t>(static_cast<double>(p.nbytes()) * ratio / n));
  return blocks;
}

}  // namespace detail

}  // namespace memscale::predictor

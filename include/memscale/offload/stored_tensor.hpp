// memscale — one tensor in the offload engine's care (stored_tensor): where it
// lives, what it holds, and freeing its tier when it goes; with the detail
// helpers of its I/O (small-tensor batches and their staging offsets, the I/O
// jobs' fault seam and wake-up guard). The engine (offload/engine_class.hpp)
// moves records between tiers; records own only the shared engine_core.
//
// In-place checks: autograd does not check hooked saved tensors, so a record
// remembers the version of the tensor it was given, and load() refuses one
// whose bytes it still read from that tensor's memory (kept, waiting for its
// batch, written to disk asynchronously) after that tensor was modified in place.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

#include <torch/torch.h>

#include <memscale/detail/fault_injection.hpp>
#include <memscale/offload/cuda_copy.hpp>
#include <memscale/offload/engine_core.hpp>
#include <memscale/offload/tiers.hpp>

namespace memscale::offload {

class stored_tensor;

namespace detail {
/// Small tensors of one group, gathered into one staging buffer that is stored
/// (one transfer) as `blob`; each member knows its offset in it.
struct batch {
  std::shared_ptr<stored_tensor> blob;
  std::int64_t members = 0;
  std::mutex mutex;
  at::Tensor staging;  // the blob back on its device while members are being loaded
  std::int64_t served = 0;
};

/// Offsets in a staging buffer keep every member 64-byte aligned.
constexpr std::int64_t staging_alignment = 64;
constexpr std::int64_t aligned(std::int64_t bytes) {
  return (bytes + staging_alignment - 1) / staging_alignment * staging_alignment;
}

/// The bytes of a dense tensor as a flat uint8 tensor on its device (no copy).
inline at::Tensor byte_view(const at::Tensor& dense, std::int64_t bytes) {
  return at::from_blob(dense.data_ptr(), {bytes}, dense.options().dtype(at::kByte));
}

/// Autograd's own words for a saved tensor modified in place since it was saved.
inline std::string modified_in_place(const tensor_layout& layout, std::uint32_t current, std::uint32_t expected) {
  return c10::str("one of the variables needed for gradient computation has been modified by an inplace operation: [",
                  c10::toString(layout.options.backend()), c10::toString(layout.options.dtype().toScalarType()),
                  "Type ", c10::IntArrayRef(layout.sizes), "] is at version ", current, "; expected version ", expected,
                  " instead.");
}

/// A test seam: the engine's I/O jobs throw from inside when a test asks.
inline void io_job_fault_point() {
  if (memscale::detail::offload_fault_injected(memscale::detail::offload_fault::io_job_throws))
    throw std::runtime_error("I/O job failure injected by a test");
}

/// Wakes the waiters of a record on every way out of an I/O job (after its lock is released).
struct notify_at_exit {
  std::condition_variable& changed;
  ~notify_at_exit() { changed.notify_all(); }
};
}  // namespace detail

/// One tensor in the engine's care. Destroying it frees its tier (budget, pinned
/// block, file). Thread-safe: loads may come from autograd worker threads.
class stored_tensor {
 public:
  stored_tensor(std::shared_ptr<detail::engine_core> core, const at::Tensor& t, int group)
      : core_(std::move(core)),
        layout_(detail::tensor_layout::of(t)),
        device_(t.device()),
        group_(group),
        source_version_(torch::autograd::impl::version_counter(t)),
        saved_version_(source_version_.enabled() ? source_version_.current_version() : 0) {}
  stored_tensor(const stored_tensor&) = delete;
  stored_tensor& operator=(const stored_tensor&) = delete;
  ~stored_tensor() {
    if (where_ != tier::device) core_->release(where_, layout_.bytes);
    if (pinned_block_) {
      // Copies on side streams may still read or write the block: another
      // record (another device's stream) must not get it before they finish.
      detail::host_waits(ready_);
      detail::host_waits(last_read_);
      core_->pool.release(std::move(*pinned_block_));
    }
    if (!file_.empty()) {
      std::error_code ignored;
      std::filesystem::remove(file_, ignored);
    }
  }

  [[nodiscard]] tier where() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return batch_ ? batch_->blob->where() : where_;
  }
  /// Whether it travelled inside a batch's staging buffer.
  [[nodiscard]] bool batched() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return batch_ != nullptr;
  }
  [[nodiscard]] std::int64_t bytes() const noexcept { return layout_.bytes; }
  [[nodiscard]] int group() const noexcept { return group_; }
  [[nodiscard]] c10::Device device() const noexcept { return device_; }
  /// Dtype, sizes and (dense) strides of the tensor it holds.
  [[nodiscard]] const detail::tensor_layout& layout() const noexcept { return layout_; }

 private:
  friend class engine;

  /// Whether the tensor given to store() was modified in place since (false
  /// when it has no version counter: an inference tensor).
  [[nodiscard]] bool source_modified() const {
    return source_version_.enabled() && source_version_.current_version() != saved_version_;
  }

  /// Refuses to return bytes read from a tensor modified since it was stored. Under mutex_.
  void check_unmodified() const {
    if (!aliases_source_ || !source_modified()) return;
    const auto current = source_version_.current_version();
    TORCH_CHECK(false, "memscale: ", detail::modified_in_place(layout_, current, saved_version_),
                " The offload engine was still reading that tensor's own memory (it was kept, waiting for its "
                "batch, or being written to disk), so it would return the modified values; make that operation "
                "out of place.");
  }

  std::shared_ptr<detail::engine_core> core_;
  detail::tensor_layout layout_;
  c10::Device device_;
  int group_;
  c10::VariableVersion source_version_;  // shares the version counter of the tensor given to store()
  std::uint32_t saved_version_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  tier where_ = tier::device;
  at::Tensor held_;                      // device: the tensor; host tiers: the copy; disk: the source while writing
  std::optional<at::Tensor> pinned_block_;
  detail::cuda_ready ready_;             // the device->host copy into held_ (async CUDA)
  detail::cuda_ready last_read_;         // the latest host->device copy out of held_ (async CUDA)
  detail::cuda_ready prefetch_ready_;    // the host->device copy into prefetched_ (pinned tier)
  std::filesystem::path file_;
  // Stored to the disk tier inside memscale::predict's shape-only span
  // (LibTorch 1.x): its bytes were never computed, so it has no file and none
  // are read back (engine::to_disk, engine::read_back).
  bool uncomputed_ = false;
  bool writing_ = false;
  bool reading_ = false;
  at::Tensor prefetched_;
  bool pending_batch_ = false;           // deferred: waits in held_ for the group's flush
  std::shared_ptr<detail::batch> batch_;
  std::int64_t batch_offset_ = 0;
  bool aliases_source_ = false;          // what load() returns is (or was read from) the source's memory
};

using stored_handle = std::shared_ptr<stored_tensor>;

}  // namespace memscale::offload

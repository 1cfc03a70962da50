// memscale — where shape-only outputs live: shape_only_arena, reserved address
// space handed out by a bump pointer for outputs on the CPU (no system call, no
// page per output, not malloc), and shape_only_empty, the uninitialised tensor
// the fallback (predict/shape_only_fallback.hpp) returns for each output.
// LibTorch 1.x only. Part of shape-only execution (predict/shape_only.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <utility>

#include <torch/torch.h>
#include <torch/version.h>

#include <memscale/device/memory_tracker.hpp>

#if TORCH_VERSION_MAJOR < 2
#include <ATen/EmptyTensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#endif

namespace memscale::predictor::detail {

#if TORCH_VERSION_MAJOR < 2

/// Where shape-only outputs on the CPU live: address space reserved once per
/// process (an anonymous MAP_NORESERVE mapping, up to 1 TiB) and handed out by a
/// bump pointer, so that an output costs no system call and no page: glibc's
/// malloc would mmap and munmap each block above its mmap threshold (128 KiB
/// once memscale::fix_malloc_mmap_threshold() fixed it), which measured 45% of a
/// shape-only step of the example GPT. Nothing writes these blocks (in-place
/// operators are skipped), so their pages do not become resident (a read maps
/// the kernel's zero page; not on every kernel, some give each page read a page
/// of its own); any a real operator writes or reads are given back
/// (MADV_DONTNEED) when the arena starts over,
/// which it does at the end of a span once no block is live, so that no block
/// ever aliases a live one. Allocations and frees are reported as LibTorch's CPU
/// allocator reports them (timelines and reporting scopes see them) and counted
/// by memscale's counting allocator where it is installed (its hard limit
/// included). Null where the address space cannot be reserved (strict
/// overcommit, an address-space limit): outputs then come from LibTorch's
/// allocator, and likewise once a span has used the whole reservation.
class shape_only_arena final : public c10::Allocator {
 public:
  /// Each block starts on a multiple of this (LibTorch's CPU alignment).
  static constexpr std::size_t alignment = 64;

  static shape_only_arena* instance() {
    static shape_only_arena* arena = [] {
#if defined(__linux__) && defined(MAP_NORESERVE)
      for (std::size_t bytes = std::size_t{1} << 40; bytes >= (std::size_t{1} << 30); bytes /= 4) {
        void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (base == MAP_FAILED) continue;
#if defined(MADV_DONTDUMP)
        (void)::madvise(base, bytes, MADV_DONTDUMP);  // no terabyte of zeros in a core file
#endif
#if defined(MADV_NOHUGEPAGE)
        // Under transparent huge pages ("always"), a real operator's one touched
        // byte would make 2 MiB resident.
        (void)::madvise(base, bytes, MADV_NOHUGEPAGE);
#endif
        return new shape_only_arena(static_cast<char*>(base), bytes);  // never destroyed: blocks may outlive anything
      }
#endif
      return static_cast<shape_only_arena*>(nullptr);
    }();
    return arena;
  }

  /// A block of `bytes`, or an empty DataPtr when the reservation is used up.
  c10::DataPtr allocate(std::size_t bytes) const override {
    const c10::Device cpu(c10::kCPU);
    if (bytes == 0) return c10::DataPtr(nullptr, nullptr, &release, cpu);
    const auto size = static_cast<std::int64_t>(bytes);
    const auto tracked = memory_tracker::installed();
    auto& counting = memscale::detail::counting_cpu_allocator::instance();
    if (tracked) memscale::detail::counting_cpu_allocator::check_limit(size);
    const auto rounded = (bytes + alignment - 1) / alignment * alignment;
    char* data = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (capacity_ - next_ < rounded) return {};
      data = base_ + next_;
      next_ += rounded;
      ++live_blocks_;
    }
    if (tracked) counting.counter().add(size);
    report(data, size, tracked);
    return c10::DataPtr(data, new block{data, size, tracked}, &release, cpu);
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  /// At the end of a span: when no block is live, gives back any page a real
  /// operator wrote and starts over from the reservation's beginning.
  void start_over_if_idle() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (live_blocks_ != 0 || next_ == 0) return;
#if defined(__linux__)
    (void)::madvise(base_, next_, MADV_DONTNEED);
#endif
    next_ = 0;
  }

 private:
  struct block {
    char* data;
    std::int64_t bytes;
    bool tracked;
  };
  shape_only_arena(char* base, std::size_t capacity) : base_(base), capacity_(capacity) {}

  static void report(void* data, std::int64_t delta, bool tracked) {
    if (!c10::memoryProfilingEnabled()) return;
    const auto live = tracked ? memscale::detail::counting_cpu_allocator::instance().counter().current() : 0;
    c10::reportMemoryUsageToProfiler(data, delta, live, live, c10::Device(c10::kCPU));
  }
  static void release(void* context) {
    const auto* b = static_cast<const block*>(context);
    if (b->tracked) memscale::detail::counting_cpu_allocator::instance().counter().add(-b->bytes);
    report(b->data, -b->bytes, b->tracked);
    {
      auto* arena = instance();
      std::lock_guard<std::mutex> lock(arena->mutex_);
      --arena->live_blocks_;
    }
    delete b;
  }

  char* const base_;
  const std::size_t capacity_;
  mutable std::mutex mutex_;
  mutable std::size_t next_ = 0;
  mutable std::int64_t live_blocks_ = 0;
};

/// An uninitialised tensor of these sizes, strides and type on `device`: from
/// the arena on the CPU where it has room, else from the device's allocator.
inline torch::Tensor shape_only_empty(c10::IntArrayRef sizes, c10::IntArrayRef strides, caffe2::TypeMeta dtype,
                                      c10::Device device) {
  c10::impl::ExcludeDispatchKeyGuard no_fake(c10::DispatchKey::Fake);
  if (device.is_cpu()) {
    if (auto* arena = shape_only_arena::instance()) {
      const auto bytes = at::detail::computeStorageNbytes(sizes, strides, dtype.itemsize());
      auto data = arena->allocate(bytes);
      if (data || bytes == 0) {
        c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(data), arena, /*resizable=*/true);
        auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                          dtype);
        t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides);
        return t;
      }
    }
  }
  return at::empty_strided(sizes, strides, torch::TensorOptions().dtype(dtype).device(device));
}
inline torch::Tensor shape_only_empty(const torch::Tensor& meta, c10::Device device) {
  return shape_only_empty(meta.sizes(), meta.strides(), meta.dtype(), device);
}

#endif  // TORCH_VERSION_MAJOR < 2

}  // namespace memscale::predictor::detail

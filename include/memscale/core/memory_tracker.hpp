// memscale — measured memory: a counting CPU allocator installed through
// c10::SetCPUAllocator, and CUDA caching-allocator statistics where LibTorch has
// CUDA. The profiler, the OOM predictor, tests and benchmarks all read memory here.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/Device.h>
#include <c10/core/impl/alloc_cpu.h>

#include <memscale/errors.hpp>

#if defined(MEMSCALE_WITH_CUDA) && MEMSCALE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#define MEMSCALE_HAS_CUDA() 1
#else
#define MEMSCALE_HAS_CUDA() 0
#endif

namespace memscale {
namespace detail {

/// The CPU allocator memscale installs: LibTorch's own alloc_cpu/free_cpu plus a
/// 64-byte header holding the block's size, so live and peak bytes are counted.
/// The data pointer doubles as the context, as raw_allocate() requires.
/// Process-wide and never destroyed: tensors it allocated may outlive any scope.
class counting_cpu_allocator final : public c10::Allocator {
 public:
  static constexpr std::size_t header_bytes = 64;  // keeps LibTorch's 64-byte alignment

  // LibTorch 1.13 declares allocate() const, 2.x non-const: providing both
  // overrides whichever the headers declare.
  c10::DataPtr allocate(std::size_t bytes) const { return counted(bytes); }
  c10::DataPtr allocate(std::size_t bytes) { return counted(bytes); }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  // Required by LibTorch 2.x; our blocks are plain host memory.
  void copy_data(void* dest, const void* src, std::size_t count) const {
    if (count != 0) std::memcpy(dest, src, count);
  }

  [[nodiscard]] std::int64_t current() const noexcept { return current_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::int64_t peak() const noexcept { return peak_.load(std::memory_order_relaxed); }
  void set_peak(std::int64_t value) noexcept { peak_.store(value, std::memory_order_relaxed); }

  static counting_cpu_allocator& instance() {
    static auto* self = new counting_cpu_allocator();  // never destroyed, see above
    return *self;
  }

 private:
  counting_cpu_allocator() = default;

  static void release(void* data) {
    if (data == nullptr) return;
    auto* base = static_cast<char*>(data) - header_bytes;
    std::int64_t bytes = 0;
    std::memcpy(&bytes, base, sizeof bytes);
    instance().current_.fetch_sub(bytes, std::memory_order_relaxed);
    c10::free_cpu(base);
  }

  c10::DataPtr counted(std::size_t bytes) const {
    const c10::Device cpu(c10::kCPU);
    if (bytes == 0) return c10::DataPtr(nullptr, nullptr, &release, cpu);
    auto* base = static_cast<char*>(c10::alloc_cpu(bytes + header_bytes));
    const auto size = static_cast<std::int64_t>(bytes);
    std::memcpy(base, &size, sizeof size);
    auto& self = instance();
    const auto now = self.current_.fetch_add(size, std::memory_order_relaxed) + size;
    auto seen = self.peak_.load(std::memory_order_relaxed);
    while (now > seen && !self.peak_.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
    void* data = base + header_bytes;
    return c10::DataPtr(data, data, &release, cpu);
  }

  std::atomic<std::int64_t> current_{0};
  std::atomic<std::int64_t> peak_{0};
};

inline std::atomic<bool>& tracker_installed() {
  static std::atomic<bool> installed{false};
  return installed;
}

}  // namespace detail

/// Live and peak bytes per device, measured. CPU figures count every tensor
/// allocated after install(); CUDA figures are the caching allocator's own.
class memory_tracker {
 public:
  /// Installs the counting CPU allocator (idempotent, thread-safe). wrap() calls it;
  /// call it before building a model to count the model's parameters too.
  /// Install before other threads run tensor operations: a block allocated by the
  /// previous allocator must not be raw-deallocated through this one.
  static void install() {
    static std::once_flag once;
    std::call_once(once, [] {
      auto* counting = &detail::counting_cpu_allocator::instance();
      // SetCPUAllocator only replaces an allocator of lower or equal priority.
      for (int priority = 0; priority <= 255 && c10::GetCPUAllocator() != counting; ++priority)
        c10::SetCPUAllocator(counting, static_cast<std::uint8_t>(priority));
      if (c10::GetCPUAllocator() != counting)
        throw Error("memscale::memory_tracker: LibTorch refused the counting CPU allocator");
      detail::tracker_installed() = true;
    });
  }

  [[nodiscard]] static bool installed() noexcept { return detail::tracker_installed(); }

  [[nodiscard]] static std::int64_t current_bytes(c10::Device device = c10::kCPU) {
    if (device.is_cpu()) return cpu().current();
#if MEMSCALE_HAS_CUDA()
    if (device.is_cuda())
      return c10::cuda::CUDACachingAllocator::getDeviceStats(cuda_index(device)).allocated_bytes[0].current;
#endif
    throw Error("memscale::memory_tracker: no memory statistics for device " + device.str());
  }

  [[nodiscard]] static std::int64_t peak_bytes(c10::Device device = c10::kCPU) {
    if (device.is_cpu()) return cpu().peak();
#if MEMSCALE_HAS_CUDA()
    if (device.is_cuda())
      return c10::cuda::CUDACachingAllocator::getDeviceStats(cuda_index(device)).allocated_bytes[0].peak;
#endif
    throw Error("memscale::memory_tracker: no memory statistics for device " + device.str());
  }

  /// Sets the peak to the current live bytes.
  static void reset_peak(c10::Device device = c10::kCPU) {
    if (device.is_cpu()) {
      cpu().set_peak(cpu().current());
      return;
    }
#if MEMSCALE_HAS_CUDA()
    if (device.is_cuda()) {
      c10::cuda::CUDACachingAllocator::resetPeakStats(cuda_index(device));
      return;
    }
#endif
    throw Error("memscale::memory_tracker: no memory statistics for device " + device.str());
  }

  /// Measures the peak within a scope. On CPU nested scopes compose (an outer
  /// scope still sees an inner scope's peak); on CUDA the caching allocator has
  /// one resettable peak, so an inner scope resets the outer one's.
  class peak_scope {
   public:
    explicit peak_scope(c10::Device device = c10::kCPU)
        : device_(device), outer_peak_(peak_bytes(device)) {
      reset_peak(device_);
      baseline_ = current_bytes(device_);
    }
    peak_scope(const peak_scope&) = delete;
    peak_scope& operator=(const peak_scope&) = delete;
    ~peak_scope() {
      if (device_.is_cpu()) cpu().set_peak(std::max(outer_peak_, cpu().peak()));
    }
    /// Live bytes when the scope began.
    [[nodiscard]] std::int64_t baseline() const noexcept { return baseline_; }
    /// Highest live bytes since the scope began.
    [[nodiscard]] std::int64_t peak() const { return peak_bytes(device_); }
    /// Peak minus baseline: the scope's peak memory growth.
    [[nodiscard]] std::int64_t peak_growth() const { return peak() - baseline_; }

   private:
    c10::Device device_;
    std::int64_t outer_peak_;
    std::int64_t baseline_ = 0;
  };

 private:
  static detail::counting_cpu_allocator& cpu() {
    install();
    return detail::counting_cpu_allocator::instance();
  }
#if MEMSCALE_HAS_CUDA()
  static c10::DeviceIndex cuda_index(c10::Device device) {
    return device.has_index() ? device.index() : c10::DeviceIndex{0};
  }
#endif
};

}  // namespace memscale

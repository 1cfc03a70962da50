// memscale — measured memory. CPU bytes come from one of two sources: a scoped,
// thread-local reporting_scope that listens to the allocation reports LibTorch
// already makes (nothing replaced; what the profiler uses), or the counting CPU
// allocator, an explicit opt-in (install()) that replaces the process's CPU
// allocator (both in device/cpu_byte_sources.hpp). CUDA bytes are the caching
// allocator's own statistics.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <c10/core/CPUAllocator.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <memscale/device/cpu_byte_sources.hpp>
#include <memscale/device/process_memory.hpp>
#include <memscale/errors.hpp>

#if defined(MEMSCALE_WITH_CUDA) && MEMSCALE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#define MEMSCALE_HAS_CUDA() 1
#else
#define MEMSCALE_HAS_CUDA() 0
#endif

namespace memscale {

namespace detail {
#if MEMSCALE_HAS_CUDA()
/// The index of CUDA device `device`, with the caching allocator made ready for
/// every device first: LibTorch makes it so at the process's first CUDA
/// allocation, and before that its statistics refuse every device ("Invalid
/// device argument"). Its init() only adds the devices it lacks.
inline c10::DeviceIndex cuda_allocator_index(c10::Device device) {
  static std::once_flag ready;
  std::call_once(ready, [] { c10::cuda::CUDACachingAllocator::init(c10::cuda::device_count()); });
  return device.has_index() ? device.index() : c10::DeviceIndex{0};
}
#endif

/// CUDA: hands the caching allocator's unused blocks back to the device, so that
/// what it reserves from here on follows what is allocated (cudaMemGetInfo and
/// other processes see them free). Nothing on another device.
inline void release_cached_device_memory([[maybe_unused]] c10::Device device) {
#if MEMSCALE_HAS_CUDA()
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

/// Whether `e` is an allocation failure (LibTorch 2.x and the tracker's hard
/// limit throw c10::OutOfMemoryError; 1.13's CUDA and CPU allocators a c10::Error;
/// a CUDA library that could not allocate its own memory names its status:
/// "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
/// cuDNN's, cuSOLVER's and cuSPARSE's likewise, cuFFT's "CUFFT_ALLOC_FAILED").
inline bool is_out_of_memory(const c10::Error& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return true;
  const std::string what = e.what_without_backtrace();
  for (const char* sign : {"out of memory", "not enough memory", "can't allocate memory", "Cannot allocate memory",
                           "_ALLOC_FAILED", "cudaErrorMemoryAllocation"})
    if (what.find(sign) != std::string::npos) return true;
  return false;
}
/// The same for any exception: only a c10::Error can be an allocation failure.
inline bool is_out_of_memory(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error != nullptr && is_out_of_memory(*error);
}

/// CUDA: the caching allocator's allocated bytes on `device` now; 0 elsewhere.
[[nodiscard]] inline std::int64_t allocated_on_device([[maybe_unused]] c10::Device device) {
#if MEMSCALE_HAS_CUDA()
  if (device.is_cuda()) {
    const auto index = cuda_allocator_index(device);
    return static_cast<std::int64_t>(c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[0].current);
  }
#endif
  return 0;
}
}  // namespace detail

/// Live and peak bytes per device, measured. CPU figures come from the counting
/// allocator while it is installed (process-wide, counting from install()), else
/// from the innermost open reporting_scope of this thread (counting from its
/// opening); CUDA figures are the caching allocator's own.
class memory_tracker {
 public:
  /// Opt-in: replaces the process's CPU allocator (c10::SetCPUAllocator, at the
  /// lowest priority LibTorch accepts, up to 255) with memscale's counting one,
  /// so every CPU tensor allocated afterwards, on any thread, is counted. An
  /// allocator the program or another library installed is no longer used.
  /// LibTorch's memory profiler still gets the CPU reports. memscale's own wrap(),
  /// optimize() and profiler never call it; tests, benchmarks and the example do.
  /// Idempotent and thread-safe; puts the counting allocator back if another one
  /// replaced it since. Install before other threads run tensor operations: a
  /// block allocated by the previous allocator must not be raw-deallocated
  /// through this one.
  static void install() {
    static std::mutex mutex;
    std::lock_guard<std::mutex> lock(mutex);
    auto* counting = &detail::counting_cpu_allocator::instance();
    // SetCPUAllocator only replaces an allocator of lower or equal priority.
    for (int priority = 0; priority <= 255 && c10::GetCPUAllocator() != counting; ++priority)
      c10::SetCPUAllocator(counting, static_cast<std::uint8_t>(priority));
    if (c10::GetCPUAllocator() != counting)
      throw Error("memscale::memory_tracker: LibTorch refused the counting CPU allocator");
    detail::tracker_installed() = true;
  }

  /// Whether the counting allocator is LibTorch's CPU allocator now (installed,
  /// and not replaced since).
  [[nodiscard]] static bool installed() noexcept {
    return detail::tracker_installed() && c10::GetCPUAllocator() == &detail::counting_cpu_allocator::instance();
  }

  /// Throws memscale::Error for CPU when neither source is there (see the class comment).
  [[nodiscard]] static std::int64_t current_bytes(c10::Device device = c10::kCPU) {
    if (device.is_cpu()) return cpu_counter()->current();
#if MEMSCALE_HAS_CUDA()
    if (device.is_cuda())
      return c10::cuda::CUDACachingAllocator::getDeviceStats(cuda_index(device)).allocated_bytes[0].current;
#endif
    throw Error("memscale::memory_tracker: no memory statistics for device " + device.str());
  }

  /// current_bytes(device), or nullopt where nothing measures it (never throws).
  [[nodiscard]] static std::optional<std::int64_t> current_bytes_if(c10::Device device = c10::kCPU) noexcept {
    try {
      return current_bytes(device);
    } catch (...) {
      return std::nullopt;
    }
  }

  [[nodiscard]] static std::int64_t peak_bytes(c10::Device device = c10::kCPU) {
    if (device.is_cpu()) return cpu_counter()->peak();
#if MEMSCALE_HAS_CUDA()
    if (device.is_cuda())
      return c10::cuda::CUDACachingAllocator::getDeviceStats(cuda_index(device)).allocated_bytes[0].peak;
#endif
    throw Error("memscale::memory_tracker: no memory statistics for device " + device.str());
  }

  /// Sets the peak to the current live bytes.
  static void reset_peak(c10::Device device = c10::kCPU) {
    if (device.is_cpu()) {
      const auto counter = cpu_counter();
      counter->set_peak(counter->current());
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

  /// Counts, on this thread, the CPU allocations LibTorch reports to its memory
  /// profiler, without replacing any allocator: while open, it is the
  /// c10::MemoryReportingInfoBase in the thread's PROFILER_STATE debug-info slot
  /// (inherited by autograd's and at::launch's threads). LibTorch's default CPU
  /// allocator reports, and so does any allocator that delegates to
  /// c10::GetDefaultCPUAllocator(), and so does memscale's counting allocator;
  /// one that allocates by itself without reporting does not, and the scope
  /// then sees nothing.
  /// A reporter already in the slot (the program's own) keeps receiving every
  /// report it would have received. A LibTorch profiler's state is never
  /// shadowed (its callbacks would mistake the scope for it): the scope then
  /// stays inactive and counts nothing. Frees of blocks allocated before the
  /// scope are not counted; LibTorch may log a warning for them (one per 1000).
  /// Thread-local: open and close it on one thread, innermost first.
  class reporting_scope {
   public:
    reporting_scope() {
      auto slot = detail::inspect_profiler_slot();
      if (!slot.refusal.empty()) {
        inactive_reason_ = std::move(slot.refusal);
        return;
      }
      reporter_ = std::make_shared<detail::memory_reporter>(slot.outer, c10::ThreadLocalDebugInfo::current());
      guard_.emplace(c10::DebugInfoKind::PROFILER_STATE, reporter_);
      detail::reporting_stack().push_back(reporter_);
    }
    reporting_scope(const reporting_scope&) = delete;
    reporting_scope& operator=(const reporting_scope&) = delete;
    ~reporting_scope() {
      if (!reporter_) return;
      reporter_->close();
      auto& stack = detail::reporting_stack();
      stack.erase(std::remove(stack.begin(), stack.end(), reporter_), stack.end());
      guard_.reset();  // the thread's debug info as it was before the scope
    }

    /// False when the scope could not take the slot; inactive_reason() says why.
    [[nodiscard]] bool active() const noexcept { return reporter_ != nullptr; }
    [[nodiscard]] const std::string& inactive_reason() const noexcept { return inactive_reason_; }
    /// Live bytes of the blocks allocated since the scope opened.
    [[nodiscard]] std::int64_t current_bytes() const noexcept { return reporter_ ? reporter_->counter().current() : 0; }
    /// Highest current_bytes() so far (lowered only by memory_tracker::reset_peak).
    [[nodiscard]] std::int64_t peak_bytes() const noexcept { return reporter_ ? reporter_->counter().peak() : 0; }
    /// Bytes of every allocation reported since the scope opened, freed or not:
    /// still 0 after a CPU allocation means the CPU allocator does not report.
    [[nodiscard]] std::int64_t allocated_bytes() const noexcept {
      return reporter_ ? reporter_->allocated_bytes() : 0;
    }

   private:
    std::shared_ptr<detail::memory_reporter> reporter_;
    std::optional<c10::DebugInfoGuard> guard_;
    std::string inactive_reason_;
  };

  /// A hard limit on the CPU bytes the counting allocator holds live, for the
  /// scope's lifetime: an allocation that would take them past `bytes` throws
  /// c10::OutOfMemoryError (what LibTorch throws for a CUDA out-of-memory)
  /// instead of allocating, so an out-of-memory on CPU can be tested and
  /// survived (tests, AutoTuner trials). Off by default. Needs the counting
  /// allocator (install()); process-wide, so under concurrent allocations from
  /// several threads it may be passed by what they allocate at that moment.
  /// Nested scopes restore the limit they found.
  class hard_limit_scope {
   public:
    explicit hard_limit_scope(std::int64_t bytes) {
      if (!installed())
        throw Error("memscale::memory_tracker::hard_limit_scope: the hard limit needs the counting CPU "
                    "allocator: call memscale::memory_tracker::install() first");
      if (bytes < 0)
        throw Error("memscale::memory_tracker::hard_limit_scope: the limit must be >= 0 bytes, got " +
                    std::to_string(bytes));
      previous_ = detail::counting_cpu_allocator::instance().limit().exchange(bytes);
    }
    hard_limit_scope(const hard_limit_scope&) = delete;
    hard_limit_scope& operator=(const hard_limit_scope&) = delete;
    ~hard_limit_scope() { detail::counting_cpu_allocator::instance().limit().store(previous_); }

   private:
    std::int64_t previous_ = -1;
  };

  /// The hard limit in force (hard_limit_scope), if any.
  [[nodiscard]] static std::optional<std::int64_t> hard_limit() noexcept {
    const auto cap = detail::counting_cpu_allocator::instance().limit().load();
    return cap >= 0 ? std::optional<std::int64_t>(cap) : std::nullopt;
  }

  /// What the process holds (CPU), over a scope: its resident bytes' peak above
  /// what was resident when the scope began (Linux's VmHWM, reset at the start),
  /// which includes what LibTorch's allocator does not see (oneDNN and BLAS
  /// buffers, malloc's retention; see fix_malloc_mmap_threshold()). Scopes nest
  /// and overlap across threads: each sees its own peak. Inactive (growth -1)
  /// where /proc/self cannot reset or report the mark.
  class process_peak_scope {
   public:
    process_peak_scope() {
      if (const auto resident = detail::process_peak_registry::instance().open(&seen_)) resident_ = *resident;
    }
    process_peak_scope(const process_peak_scope&) = delete;
    process_peak_scope& operator=(const process_peak_scope&) = delete;
    ~process_peak_scope() {
      if (active()) detail::process_peak_registry::instance().close(&seen_);
    }
    [[nodiscard]] bool active() const noexcept { return resident_ >= 0; }
    /// Resident bytes when the scope began, or -1.
    [[nodiscard]] std::int64_t baseline() const noexcept { return resident_; }
    /// The resident peak since the scope began, or -1.
    [[nodiscard]] std::int64_t peak() { return active() ? detail::process_peak_registry::instance().peak(&seen_) : -1; }
    /// peak() - baseline(), or -1.
    [[nodiscard]] std::int64_t peak_growth() { return active() ? peak() - resident_ : -1; }

   private:
    std::int64_t seen_ = 0;
    std::int64_t resident_ = -1;
  };

  /// Measures the peak within a scope, from the source current_bytes() reads
  /// when the scope begins. On CPU nested scopes compose (an outer scope still
  /// sees an inner scope's peak); on CUDA the caching allocator has one
  /// resettable peak, so an inner scope resets the outer one's.
  class peak_scope {
   public:
    explicit peak_scope(c10::Device device = c10::kCPU) : device_(device) {
      if (device_.is_cpu()) {
        counter_ = cpu_counter();
        outer_peak_ = counter_->peak();
        counter_->set_peak(counter_->current());
        baseline_ = counter_->current();
      } else {
        outer_peak_ = peak_bytes(device_);
        reset_peak(device_);
        baseline_ = current_bytes(device_);
      }
    }
    peak_scope(const peak_scope&) = delete;
    peak_scope& operator=(const peak_scope&) = delete;
    ~peak_scope() {
      if (counter_) counter_->set_peak(std::max(outer_peak_, counter_->peak()));
    }
    /// Live bytes when the scope began.
    [[nodiscard]] std::int64_t baseline() const noexcept { return baseline_; }
    /// Highest live bytes since the scope began.
    [[nodiscard]] std::int64_t peak() const { return counter_ ? counter_->peak() : peak_bytes(device_); }
    /// Peak minus baseline: the scope's peak memory growth.
    [[nodiscard]] std::int64_t peak_growth() const { return peak() - baseline_; }

   private:
    c10::Device device_;
    std::shared_ptr<detail::byte_counter> counter_;  // CPU only
    std::int64_t outer_peak_ = 0;
    std::int64_t baseline_ = 0;
  };

 private:
  /// The CPU source: the counting allocator (never destroyed, so not owned) or
  /// the innermost reporting scope's counter (shared: a peak_scope may outlive it).
  static std::shared_ptr<detail::byte_counter> cpu_counter() {
    if (installed())
      return {std::shared_ptr<void>(), &detail::counting_cpu_allocator::instance().counter()};
    const auto& stack = detail::reporting_stack();
    if (!stack.empty()) return {stack.back(), &stack.back()->counter()};
    throw Error("memscale::memory_tracker: nothing measures CPU memory on this thread: open a "
                "memscale::memory_tracker::reporting_scope, or call memscale::memory_tracker::install() "
                "(which replaces the process's CPU allocator)");
  }
#if MEMSCALE_HAS_CUDA()
  static c10::DeviceIndex cuda_index(c10::Device device) { return detail::cuda_allocator_index(device); }
#endif
};

}  // namespace memscale

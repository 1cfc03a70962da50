// memscale — the two sources of measured CPU bytes under memory_tracker: the
// counting CPU allocator (an opt-in that replaces LibTorch's, counting live and
// peak bytes process-wide) and the memory reporter that a reporting_scope puts in
// the thread's profiler slot (listening to the reports LibTorch already makes).
// Internal: use memscale::memory_tracker (device/memory_tracker.hpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/Device.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <memscale/errors.hpp>

namespace memscale {
namespace detail {

/// Live and peak bytes, updated from any thread.
class byte_counter {
 public:
  void add(std::int64_t bytes) noexcept {
    const auto now = current_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    auto seen = peak_.load(std::memory_order_relaxed);
    while (now > seen && !peak_.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }
  [[nodiscard]] std::int64_t current() const noexcept { return current_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::int64_t peak() const noexcept { return peak_.load(std::memory_order_relaxed); }
  void set_peak(std::int64_t value) noexcept { peak_.store(value, std::memory_order_relaxed); }

 private:
  std::atomic<std::int64_t> current_{0};
  std::atomic<std::int64_t> peak_{0};
};

/// The CPU allocator memory_tracker::install() puts in place: LibTorch's own
/// alloc_cpu/free_cpu plus a 64-byte header holding the block's size, so live and
/// peak bytes are counted. The data pointer doubles as the context, as
/// raw_allocate() requires. Like LibTorch's default CPU allocator it reports
/// each allocation and free to the thread's memory-profiling reporter while one
/// listens (LibTorch's profiler, memscale's reporting scopes and predict()).
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

  [[nodiscard]] byte_counter& counter() noexcept { return counter_; }
  /// The hard limit on live bytes, or -1 for none (memory_tracker::hard_limit_scope).
  [[nodiscard]] std::atomic<std::int64_t>& limit() noexcept { return limit_; }
  /// Throws OutOfMemoryError where `size` bytes more would pass the hard limit:
  /// what each allocation checks, this allocator's and those memscale counts
  /// with it (predict's shape-only arena).
  static void check_limit(std::int64_t size) {
    if (const auto cap = instance().limit_.load(std::memory_order_relaxed); cap >= 0) {
      const auto live = instance().counter_.current();
      TORCH_CHECK_WITH(OutOfMemoryError, live + size <= cap,
                       "CPU out of memory (memscale::memory_tracker::hard_limit_scope): tried to allocate ", size,
                       " bytes with ", live, " bytes live; the hard limit is ", cap, " bytes");
    }
  }

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
    instance().counter_.add(-bytes);
    if (c10::memoryProfilingEnabled()) report(data, -bytes);
    c10::free_cpu(base);
  }

  c10::DataPtr counted(std::size_t bytes) const {
    const c10::Device cpu(c10::kCPU);
    if (bytes == 0) return c10::DataPtr(nullptr, nullptr, &release, cpu);
    const auto size = static_cast<std::int64_t>(bytes);
    check_limit(size);
    auto* base = static_cast<char*>(c10::alloc_cpu(bytes + header_bytes));
    std::memcpy(base, &size, sizeof size);
    instance().counter_.add(size);
    void* data = base + header_bytes;
    if (c10::memoryProfilingEnabled()) report(data, size);
    return c10::DataPtr(data, data, &release, cpu);
  }

  /// Tells the thread's memory-profiling reporter (defined below, after the
  /// type of its totals).
  static void report(void* data, std::int64_t delta);

  byte_counter counter_;
  std::atomic<std::int64_t> limit_{-1};
};

inline std::atomic<bool>& tracker_installed() {
  static std::atomic<bool> installed{false};
  return installed;
}

/// The integer type of MemoryReportingInfoBase's totals: int64_t on LibTorch
/// 1.13, size_t on 2.x. Deduced, so the overrides below say `override` on both.
template <class>
struct report_signature;
template <class Base, class Size, class Total>
struct report_signature<void (Base::*)(void*, Size, Total, Total, c10::Device)> {
  using total = Total;
};
template <class Base, class Size, class Total>
struct report_signature<void (Base::*)(Size, Total, Total, c10::Device)> {
  using total = Total;
};
using report_total_t = report_signature<decltype(&c10::MemoryReportingInfoBase::reportMemoryUsage)>::total;
using oom_total_t = report_signature<decltype(&c10::MemoryReportingInfoBase::reportOutOfMemory)>::total;

inline void counting_cpu_allocator::report(void* data, std::int64_t delta) {
  const auto live = static_cast<report_total_t>(instance().counter_.current());
  c10::reportMemoryUsageToProfiler(data, delta, live, live, c10::Device(c10::kCPU));
}

/// What a reporting_scope puts in the thread's PROFILER_STATE debug-info slot.
/// It counts the CPU blocks reported while its scope is open (a free counts only
/// for a block it saw allocated) and passes each report on to the reporter it
/// shadows as that one would have received it: allocations while it has memory
/// profiling enabled, frees of those blocks and of blocks from before the scope.
class memory_reporter final : public c10::MemoryReportingInfoBase {
 public:
  /// `outer_chain` owns `outer` (the thread's debug info when the scope opened).
  memory_reporter(c10::MemoryReportingInfoBase* outer, std::shared_ptr<c10::ThreadLocalDebugInfo> outer_chain)
      : outer_(outer), outer_chain_(std::move(outer_chain)) {}

  void reportMemoryUsage(void* ptr, std::int64_t alloc_size, report_total_t total_allocated,
                         report_total_t total_reserved, c10::Device device) override {
    bool forward = outer_ != nullptr && outer_->memoryProfilingEnabled();
    if (device.is_cpu() && ptr != nullptr) {
      std::lock_guard<std::mutex> lock(mutex_);
      const bool open = open_.load(std::memory_order_relaxed);
      if (alloc_size > 0 && open) {
        blocks_[ptr] = block{alloc_size, forward};
        allocated_.fetch_add(alloc_size, std::memory_order_relaxed);
        counter_.add(alloc_size);
      } else if (const auto it = alloc_size < 0 ? blocks_.find(ptr) : blocks_.end(); it != blocks_.end()) {
        forward = forward && it->second.forwarded;
        if (open) counter_.add(-it->second.bytes);
        blocks_.erase(it);
      }
    }
    if (forward) outer_->reportMemoryUsage(ptr, alloc_size, total_allocated, total_reserved, device);
  }

  void reportOutOfMemory(std::int64_t alloc_size, oom_total_t total_allocated, oom_total_t total_reserved,
                         c10::Device device) override {
    if (outer_ != nullptr) outer_->reportOutOfMemory(alloc_size, total_allocated, total_reserved, device);
  }

  /// LibTorch reports allocations only while this says yes: always while the
  /// scope is open, else as the shadowed reporter says.
  [[nodiscard]] bool memoryProfilingEnabled() const override {
    return open_.load(std::memory_order_relaxed) || (outer_ != nullptr && outer_->memoryProfilingEnabled());
  }

  [[nodiscard]] byte_counter& counter() noexcept { return counter_; }
  [[nodiscard]] const byte_counter& counter() const noexcept { return counter_; }
  [[nodiscard]] std::int64_t allocated_bytes() const noexcept { return allocated_.load(std::memory_order_relaxed); }

  /// The scope closed: stop counting. Reports may still arrive from threads that
  /// inherited the debug info (autograd's); they are only passed on.
  void close() noexcept { open_.store(false, std::memory_order_relaxed); }

 private:
  struct block {
    std::int64_t bytes;
    bool forwarded;  // the outer reporter saw this allocation
  };

  c10::MemoryReportingInfoBase* outer_;
  std::shared_ptr<c10::ThreadLocalDebugInfo> outer_chain_;  // keeps outer_ alive
  std::atomic<bool> open_{true};
  std::mutex mutex_;
  std::unordered_map<void*, block> blocks_;  // guarded by mutex_
  byte_counter counter_;
  std::atomic<std::int64_t> allocated_{0};
};

/// Whether a memory-profiling scope may take this thread's PROFILER_STATE
/// debug-info slot: `outer` is the reporter it would shadow (null for an empty
/// slot); `refusal` says why it may not (empty when it may). A LibTorch
/// profiler's state is never shadowed: its callbacks would mistake the scope for it.
struct profiler_slot {
  c10::MemoryReportingInfoBase* outer = nullptr;
  std::string refusal;
};

inline profiler_slot inspect_profiler_slot() {
  auto* occupant = c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE);
  if (dynamic_cast<torch::profiler::impl::ProfilerStateBase*>(occupant) != nullptr)
    return {nullptr, "a LibTorch profiler is active on this thread and holds the PROFILER_STATE debug-info slot"};
  auto* outer = dynamic_cast<c10::MemoryReportingInfoBase*>(occupant);
  if (occupant != nullptr && outer == nullptr)
    return {nullptr, "the thread's PROFILER_STATE debug-info slot holds something other than a "
                     "c10::MemoryReportingInfoBase"};
  return {outer, {}};
}

/// The open reporting scopes of this thread, innermost last.
inline std::vector<std::shared_ptr<memory_reporter>>& reporting_stack() {
  thread_local std::vector<std::shared_ptr<memory_reporter>> stack;
  return stack;
}

}  // namespace detail

}  // namespace memscale

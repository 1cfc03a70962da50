// memscale::detail — what the process holds (Linux /proc/self): resident bytes,
// their high-water mark and its reset (one registry, so that measurements nest);
// glibc's mmap threshold, which decides whether freed tensor memory goes back
// to the system; and which malloc the process runs on (glibc's, or tcmalloc,
// jemalloc or mimalloc preloaded or linked in its place). Used by predict() to
// measure what sits outside LibTorch's allocator (oneDNN and BLAS buffers,
// malloc's retention), and by the benchmarks to measure a step's max RSS growth.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif
#if defined(__linux__)
#include <dlfcn.h>
#endif

namespace memscale {
namespace detail {

struct process_memory {
  std::int64_t resident_bytes = 0;  ///< VmRSS
  std::int64_t peak_bytes = 0;      ///< VmHWM: the resident high-water mark
};

/// VmRSS and VmHWM of this process; nullopt where /proc/self/status has none.
[[nodiscard]] inline std::optional<process_memory> read_process_memory() {
  std::ifstream in("/proc/self/status");
  if (!in) return std::nullopt;
  process_memory m;
  bool rss = false;
  bool hwm = false;
  for (std::string line; std::getline(in, line);) {
    try {
      if (line.rfind("VmRSS:", 0) == 0) {
        m.resident_bytes = std::stoll(line.substr(6)) * 1024;
        rss = true;
      } else if (line.rfind("VmHWM:", 0) == 0) {
        m.peak_bytes = std::stoll(line.substr(6)) * 1024;
        hwm = true;
      }
    } catch (...) {
      return std::nullopt;
    }
  }
  if (!rss || !hwm) return std::nullopt;
  return m;
}

/// Resets VmHWM to the current VmRSS (Linux >= 4.0: "5" to /proc/self/clear_refs).
/// False where that is not possible.
inline bool reset_process_peak() {
  std::ofstream out("/proc/self/clear_refs");
  if (!out) return false;
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

/// The process's resident high-water mark is one per process, and resetting it
/// erases what an enclosing measurement has not read yet. Every measurement
/// opens here: each reset first folds the current mark into every open one, so
/// nested and overlapping measurements (a tuner's trial inside a benchmark's
/// run, predict() inside either) each see their own peak.
class process_peak_registry {
 public:
  static process_peak_registry& instance() {
    static process_peak_registry registry;
    return registry;
  }

  /// Opens a measurement from now: `seen` holds the highest mark folded into it.
  /// Returns the resident bytes at its start, or nullopt where the mark cannot
  /// be reset or read (then nothing is registered).
  std::optional<std::int64_t> open(std::int64_t* seen) {
    std::lock_guard<std::mutex> lock(mutex_);
    fold();
    if (!reset_process_peak()) return std::nullopt;
    const auto now = read_process_memory();
    if (!now) return std::nullopt;
    *seen = now->peak_bytes;
    open_.push_back(seen);
    return now->resident_bytes;
  }
  /// The highest resident bytes since `seen`'s measurement opened.
  std::int64_t peak(std::int64_t* seen) {
    std::lock_guard<std::mutex> lock(mutex_);
    fold();
    return *seen;
  }
  void close(std::int64_t* seen) {
    std::lock_guard<std::mutex> lock(mutex_);
    fold();
    open_.erase(std::remove(open_.begin(), open_.end(), seen), open_.end());
  }

 private:
  void fold() {
    if (open_.empty()) return;
    if (const auto now = read_process_memory())
      for (auto* s : open_) *s = std::max(*s, now->peak_bytes);
  }
  std::mutex mutex_;
  std::vector<std::int64_t*> open_;
};

inline std::atomic<std::int64_t>& pinned_mmap_threshold() {
  static std::atomic<std::int64_t> bytes{-1};
  return bytes;
}

}  // namespace detail

/// The malloc that serves the process's allocations (LibTorch's CPU tensors among them).
enum class malloc_kind { glibc, tcmalloc, jemalloc, mimalloc, other };

[[nodiscard]] constexpr const char* to_string(malloc_kind kind) noexcept {
  switch (kind) {
    case malloc_kind::glibc: return "glibc";
    case malloc_kind::tcmalloc: return "tcmalloc";
    case malloc_kind::jemalloc: return "jemalloc";
    case malloc_kind::mimalloc: return "mimalloc";
    case malloc_kind::other: break;
  }
  return "other";
}

namespace detail {
/// A function the whole process exports under `name` (the executable, what
/// LD_PRELOAD put in front, every library loaded), or nullptr.
template <class Function>
[[nodiscard]] Function* process_symbol(const char* name) noexcept {
#if defined(__linux__)
  return reinterpret_cast<Function*>(::dlsym(RTLD_DEFAULT, name));
#else
  (void)name;
  return nullptr;
#endif
}
}  // namespace detail

/// Which malloc the process runs on, by a symbol only that one exports:
/// gperftools' tcmalloc (tc_malloc), jemalloc (mallctl), mimalloc (mi_malloc);
/// glibc's where none is there and the C library is glibc.
[[nodiscard]] inline malloc_kind process_malloc() noexcept {
  if (detail::process_symbol<void*(std::size_t)>("tc_malloc") != nullptr) return malloc_kind::tcmalloc;
  using mallctl_fn = int(const char*, void*, std::size_t*, void*, std::size_t);
  if (detail::process_symbol<mallctl_fn>("mallctl") != nullptr) return malloc_kind::jemalloc;
  if (detail::process_symbol<void*(std::size_t)>("mi_malloc") != nullptr) return malloc_kind::mimalloc;
#if defined(__GLIBC__)
  return malloc_kind::glibc;
#else
  return malloc_kind::other;
#endif
}

/// Fixes glibc's mmap threshold at `bytes` (mallopt(M_MMAP_THRESHOLD)): every
/// block of at least that size is mapped on its own and given back to the system
/// when freed. By default glibc raises the threshold each time it frees a mapped
/// block, after which tensor-sized blocks come from its heaps and stay resident
/// when freed: measured on the example GPT and a ResNet-style CNN, a step's max
/// RSS growth is then 1.4 to 2.0 times LibTorch's live-byte peak, and varies by
/// up to 12% between runs of the same program. With the threshold fixed it is the
/// allocator's peak plus a constant (benchmarks/studies/README.md), which is what
/// makes memscale::predict's process figures hold. The cost is a page fault per
/// first touch of each large block, every step: the benchmark GPT's step took
/// 1.9x as long in a fresh process on a 2-core VM (benchmarks/RESULTS.md), where
/// tcmalloc held 4-11% more at no such cost (process_memory_follows_allocator()).
/// The same as running with the environment variable MALLOC_MMAP_THRESHOLD_=bytes.
/// Process-wide; returns false (and changes nothing) where malloc is not glibc's
/// (process_malloc(): tcmalloc, say, exports a mallopt that does nothing).
inline bool fix_malloc_mmap_threshold(std::int64_t bytes = std::int64_t{128} << 10) {
#if defined(__GLIBC__)
  if (process_malloc() != malloc_kind::glibc) return false;
  if (bytes <= 0 || bytes > (std::int64_t{32} << 20)) return false;  // glibc's HEAP_MAX / 2 on 64-bit
  if (mallopt(M_MMAP_THRESHOLD, static_cast<int>(bytes)) != 1) return false;
  detail::pinned_mmap_threshold() = bytes;
  return true;
#else
  (void)bytes;
  return false;
#endif
}

namespace detail {
/// Gives malloc's free pages back to the system: glibc's malloc_trim(0) (with
/// the dynamic mmap threshold, what wrap's full-batch profiling freed would
/// otherwise stay resident for the rest of the process), tcmalloc's
/// MallocExtension_ReleaseFreeMemory(). No-op under another malloc.
inline void release_free_heap() noexcept {
  switch (process_malloc()) {
    case malloc_kind::tcmalloc:
      if (auto* release = process_symbol<void()>("MallocExtension_ReleaseFreeMemory")) release();
      return;
    case malloc_kind::glibc:
#if defined(__GLIBC__)
      (void)malloc_trim(0);
#endif
      return;
    default: return;
  }
}
}  // namespace detail

/// glibc's fixed mmap threshold, when fix_malloc_mmap_threshold() or the
/// MALLOC_MMAP_THRESHOLD_ environment variable set one; nullopt otherwise.
[[nodiscard]] inline std::optional<std::int64_t> fixed_malloc_mmap_threshold() {
  if (const auto pinned = detail::pinned_mmap_threshold().load(); pinned >= 0) return pinned;
#if defined(__GLIBC__)
  if (const char* env = std::getenv("MALLOC_MMAP_THRESHOLD_"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long long value = std::strtoll(env, &end, 10);
    if (end != env && *end == '\0' && value >= 0) return value;
  }
#endif
  return std::nullopt;
}

namespace detail {
/// The bytes glibc's malloc holds free in its heaps, every arena's (mallinfo2's
/// fordblks); nullopt under another malloc or a glibc before 2.33.
[[nodiscard]] inline std::optional<std::int64_t> malloc_heap_free_bytes() noexcept {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  if (process_malloc() != malloc_kind::glibc) return std::nullopt;
  return static_cast<std::int64_t>(mallinfo2().fordblks);
#else
  return std::nullopt;
#endif
}
}  // namespace detail

/// Whether what the process holds follows LibTorch's allocator's live bytes, so
/// that a plan's cut is the process's (the process-true figures of predict, the
/// planner's CPU budget and the benchmarks): glibc's malloc with its mmap
/// threshold fixed (every freed large block goes back to the system), or
/// tcmalloc, which reuses freed spans and hands them back over time without the
/// fixed threshold's page fault per large block each step (the benchmark GPT's
/// process peaks 4-11% above the fixed threshold's, its steps about twice as
/// fast; benchmarks/RESULTS.md, "tcmalloc").
[[nodiscard]] inline bool process_memory_follows_allocator() {
  const auto kind = process_malloc();
  return kind == malloc_kind::tcmalloc || (kind == malloc_kind::glibc && fixed_malloc_mmap_threshold().has_value());
}

/// Where process_memory_follows_allocator() is false: why, and what makes the
/// process's figures hold, for a Report's or a tuner's note.
[[nodiscard]] inline std::string malloc_retention_advice() {
  const auto kind = process_malloc();
  if (kind == malloc_kind::glibc)
    return "glibc's mmap threshold is not fixed: freed tensor memory may stay resident in malloc's heaps. "
           "memscale::fix_malloc_mmap_threshold() (or MALLOC_MMAP_THRESHOLD_=131072) returns it, at the cost of a "
           "page fault per first touch of each large block every step; tcmalloc returns it without that cost "
           "(LD_PRELOAD=libtcmalloc_minimal.so.4, Debian's libtcmalloc-minimal4; benchmarks/RESULTS.md)";
  return std::string("malloc is ") + to_string(kind) +
         ", under which memscale has not measured what the process keeps of freed tensor memory (it has under "
         "tcmalloc, and glibc's malloc with memscale::fix_malloc_mmap_threshold())";
}

}  // namespace memscale

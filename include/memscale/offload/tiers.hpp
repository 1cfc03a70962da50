// memscale — offload tiers: where a saved tensor can live (device, pinned host,
// pageable host, disk), the budget of each host tier, the reusable pinned
// buffer pool, and the disk tier's files (and where they go: a
// directory on a disk, since one on tmpfs would keep the bytes in RAM).
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fcntl.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/vfs.h>
#endif

#include <torch/torch.h>

#include <memscale/detail/fault_injection.hpp>
#include <memscale/detail/files.hpp>

namespace memscale::offload {

/// Memory tiers, fastest first. A saved tensor goes to the first tier after its
/// own that has room, and stays on `device` when none has.
enum class tier : std::uint8_t { device, pinned_host, pageable_host, disk };

inline constexpr int tier_count = 4;

[[nodiscard]] constexpr std::string_view to_string(tier t) noexcept {
  switch (t) {
    case tier::device: return "device";
    case tier::pinned_host: return "pinned host";
    case tier::pageable_host: return "pageable host";
    case tier::disk: return "disk";
  }
  return "?";
}

namespace detail {

/// A tensor's layout: dense tensors (contiguous or permuted) keep their strides
/// through any tier; other views (a slice, q of a fused qkv projection) come
/// back dense with their dimensions in the same stride order. The order, not
/// only the values, must survive: a BLAS picks its kernel, and so its
/// summation order, by which dimension is contiguous (a contiguous copy of
/// such a view changed gradients by 1e-8 relative with OpenBLAS's SkylakeX
/// kernels).
struct tensor_layout {
  std::vector<std::int64_t> sizes;
  std::vector<std::int64_t> strides;
  at::TensorOptions options;
  bool dense = true;  ///< the tensor's own strides, so its bytes can be copied as they are
  std::int64_t bytes = 0;

  static tensor_layout of(const at::Tensor& t) {
    tensor_layout l;
    l.sizes = t.sizes().vec();
    l.dense = t.is_non_overlapping_and_dense();
    l.strides = l.dense ? t.strides().vec() : dense_strides_in_order(t.sizes(), t.strides());
    l.options = t.options();
    l.bytes = t.numel() * static_cast<std::int64_t>(t.element_size());
    return l;
  }

  /// Dense strides for `sizes` that order the dimensions as `strides` does
  /// (largest outermost; equal strides in dimension order), as ATen lays out
  /// an elementwise result of a strided input.
  static std::vector<std::int64_t> dense_strides_in_order(c10::IntArrayRef sizes, c10::IntArrayRef strides) {
    std::vector<std::size_t> order(sizes.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return strides[a] > strides[b]; });
    std::vector<std::int64_t> dense(sizes.size());
    std::int64_t step = 1;
    for (auto it = order.rbegin(); it != order.rend(); ++it) {
      dense[*it] = step;
      step *= std::max<std::int64_t>(sizes[*it], 1);
    }
    return dense;
  }

  /// `t`'s values in this layout, on t's device: `t` itself where it is dense.
  [[nodiscard]] at::Tensor dense_copy(const at::Tensor& t) const {
    if (dense) return t;
    at::Tensor out = empty_on(t.device());
    out.copy_(t);
    return out;
  }

  /// An uninitialized tensor of this layout on `device` (pinned when asked).
  [[nodiscard]] at::Tensor empty_on(c10::Device device, bool pinned = false) const {
    return at::empty_strided(sizes, strides, options.device(device).pinned_memory(pinned));
  }
};

}  // namespace detail

/// Pinned host buffers for the pinned tier, reused across steps: freed blocks
/// wait in per-size-class free lists (powers of two from 64 KiB). In use plus
/// cached never exceeds the capacity. Allocation failures (no CUDA, cudaHostAlloc
/// refusing) are reported to the caller, which spills to pageable memory.
class pinned_pool {
 public:
  /// Makes one block; throws when it cannot (a CPU-only LibTorch always does).
  using allocator = std::function<at::Tensor(std::int64_t bytes)>;

  static at::Tensor allocate_pinned(std::int64_t bytes) {
    return at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  }

  explicit pinned_pool(std::int64_t capacity_bytes, allocator allocate = &allocate_pinned)
      : capacity_(capacity_bytes), allocate_(std::move(allocate)) {}

  /// A pinned uint8 block of at least `bytes`, or nullopt (over capacity, or failed).
  /// `failed` is set when the allocation itself failed.
  std::optional<at::Tensor> acquire(std::int64_t bytes, bool& failed) {
    failed = false;
    const std::int64_t size = size_class(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = free_.find(size); it != free_.end() && !it->second.empty()) {
      at::Tensor block = std::move(it->second.back());
      it->second.pop_back();
      cached_ -= size;
      in_use_ += size;
      return block;
    }
    while (in_use_ + cached_ + size > capacity_ && cached_ > 0) drop_one_cached();
    if (in_use_ + size > capacity_) return std::nullopt;
    try {
      if (memscale::detail::offload_fault_injected(memscale::detail::offload_fault::pinned_alloc))
        throw std::runtime_error("pinned allocation failure injected by a test");
      at::Tensor block = allocate_(size);
      in_use_ += size;
      return block;
    } catch (const std::exception&) {
      failed = true;
      return std::nullopt;
    }
  }

  /// Returns a block from acquire() for reuse.
  void release(at::Tensor block) {
    const std::int64_t size = block.numel();
    std::lock_guard<std::mutex> lock(mutex_);
    in_use_ -= size;
    if (in_use_ + cached_ + size <= capacity_) {
      free_[size].push_back(std::move(block));
      cached_ += size;
    }
  }

  [[nodiscard]] std::int64_t in_use_bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return in_use_;
  }
  [[nodiscard]] std::int64_t cached_bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return cached_;
  }
  [[nodiscard]] std::int64_t capacity_bytes() const noexcept { return capacity_; }

  static constexpr std::int64_t size_class(std::int64_t bytes) noexcept {
    std::int64_t size = 64 * 1024;
    while (size < bytes) size *= 2;
    return size;
  }

 private:
  void drop_one_cached() {
    for (auto& [size, blocks] : free_) {
      if (blocks.empty()) continue;
      blocks.pop_back();
      cached_ -= size;
      return;
    }
  }

  mutable std::mutex mutex_;
  std::int64_t capacity_;
  allocator allocate_;
  std::int64_t in_use_ = 0;
  std::int64_t cached_ = 0;
  std::map<std::int64_t, std::vector<at::Tensor>> free_;
};

/// The RAM-backed file system `path` lies on ("tmpfs" or "ramfs"), or empty
/// when it is on another one or cannot be told (no such path, not Linux).
[[nodiscard]] inline std::string_view ram_file_system(const std::filesystem::path& path) noexcept {
#if defined(__linux__)
  struct statfs info {};
  if (::statfs(path.c_str(), &info) != 0) return {};
  // The magic numbers of linux/magic.h, compared as the 32-bit values they are.
  const auto type = static_cast<std::uint32_t>(info.f_type);
  if (type == 0x01021994u) return "tmpfs";
  if (type == 0x858458f6u) return "ramfs";
#else
  (void)path;
#endif
  return {};
}

/// Whether files under `path` live in RAM (tmpfs, ramfs): "offloading" there
/// only moves bytes from one part of host memory to another.
[[nodiscard]] inline bool is_ram_backed(const std::filesystem::path& path) noexcept {
  return !ram_file_system(path).empty();
}

/// Where the disk tier may create its directory, in order of preference. The
/// user's directory when given; else $TMPDIR when set (also the user's
/// choice); else /var/tmp unless it is RAM-backed, then the system temp
/// directory (often tmpfs).
[[nodiscard]] inline std::vector<std::filesystem::path> disk_parent_candidates(
    const std::optional<std::string>& chosen) {
  if (chosen) return {std::filesystem::path(*chosen)};
  if (const char* tmpdir = std::getenv("TMPDIR"); tmpdir && *tmpdir) return {std::filesystem::path(tmpdir)};
  std::vector<std::filesystem::path> candidates;
  std::error_code ec;
  const std::filesystem::path var_tmp = "/var/tmp";  // meant for files that outlive a reboot: on a disk
  if (std::filesystem::is_directory(var_tmp, ec) && !is_ram_backed(var_tmp)) candidates.push_back(var_tmp);
  if (auto temp = std::filesystem::temp_directory_path(ec); !ec) candidates.push_back(std::move(temp));
  return candidates;
}

/// The disk tier's files: one file per tensor (pwrite, pread) in a directory of
/// its own (created on first use under the first of disk_parent_candidates()
/// that takes it, removed with everything in it on destruction).
class disk_store {
 public:
  explicit disk_store(std::optional<std::string> parent) : parent_(std::move(parent)) {}
  disk_store(const disk_store&) = delete;
  disk_store& operator=(const disk_store&) = delete;
  ~disk_store() {
    if (dir_.empty()) return;
    memscale::detail::remove_tree(dir_);
  }

  /// Creates the directory if needed; on failure returns why (empty: ready).
  /// The call that creates it on a RAM-backed file system sets `warning`.
  std::string prepare(std::string* warning = nullptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!dir_.empty()) return {};
    if (!failure_.empty()) return failure_;
    const auto parents = disk_parent_candidates(parent_);
    if (parents.empty()) {
      failure_ = "no directory to create it under: the system temp directory cannot be determined";
      return failure_;
    }
    if (memscale::detail::offload_fault_injected(memscale::detail::offload_fault::disk_unwritable)) {
      return "cannot create a directory under " + parents.front().string() + ": unwritable (injected by a test)";
    }
    static std::atomic<int> counter{0};
    const auto name = "memscale-offload-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    for (const auto& parent : parents) {
      const auto dir = parent / name;
      std::error_code ec;
      if (!std::filesystem::create_directories(dir, ec) || ec) {
        if (failure_.empty())
          failure_ = "cannot create " + dir.string() + ": " + (ec ? ec.message() : std::string("it already exists"));
        continue;  // the next candidate, if any
      }
      dir_ = dir;
      failure_.clear();
      if (const auto file_system = ram_file_system(dir); !file_system.empty() && warning)
        *warning = "the disk offload tier's directory " + dir.string() + " is on " + std::string(file_system) +
                   " (RAM): offloaded bytes still occupy host memory; set AsyncOffloadConfig::disk_dir to a "
                   "directory on a disk";
      return {};
    }
    return failure_;
  }

  [[nodiscard]] std::filesystem::path directory() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return dir_;
  }

  /// A fresh file name in the directory.
  std::filesystem::path next_file() { return directory() / ("t" + std::to_string(next_id_++) + ".bin"); }

  /// Writes `bytes` from `data` into a new file; returns the error (empty:
  /// written). A failed write leaves no file behind. pwrite(), not a shared
  /// mapping: a mapping's pages count in the process's resident size while it is
  /// mapped, so each write (and each read) held the tensor's bytes twice
  /// (measured on 64 MiB: the resident peak grew 64 MiB, now 0; tested in
  /// tests/test_offload.cpp). `through`: the bytes reach the disk before it
  /// returns and leave the page cache (pages_to_disk); else they sit in the page
  /// cache, dirty, until the kernel writes them back.
  static std::string write(const std::filesystem::path& file, const void* data, std::int64_t bytes,
                           bool through = true) {
    if (memscale::detail::offload_fault_injected(memscale::detail::offload_fault::disk_full))
      return "no space left on device (injected by a test)";
    const int fd = ::open(file.c_str(), O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return "cannot create " + file.string() + ": " + std::strerror(errno);
    // pwrite reports a full disk itself (ENOSPC); a mapping needed posix_fallocate
    // first, or the full disk came as SIGBUS on a page fault.
    std::string error = write_plainly(fd, data, bytes, file);
    if (error.empty() && through) error = pages_to_disk(fd, file);
    ::close(fd);
    if (!error.empty()) ::unlink(file.c_str());
    return error;
  }

  /// pwrite() until done; returns the error (empty: written).
  static std::string write_plainly(int fd, const void* data, std::int64_t bytes, const std::filesystem::path& file) {
    const auto* p = static_cast<const char*>(data);
    std::int64_t done = 0;
    while (done < bytes) {
      const auto n = ::pwrite(fd, p + done, static_cast<std::size_t>(bytes - done), static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return "cannot write " + file.string() + ": " + std::strerror(n < 0 ? errno : ENOSPC);
      done += n;
    }
    return {};
  }

  /// Waits for `fd`'s written bytes to reach the disk, then drops its pages from
  /// the page cache: only then has host memory let them go (measured here, 256
  /// MiB written: 256 MiB more page cache, all of it dirty, before; none after,
  /// in the same write time; reading them back took 100 ms from the disk against
  /// 30 ms from the cache). A write the disk refuses only now (EIO, ENOSPC on
  /// some file systems) is a failed write.
  static std::string pages_to_disk(int fd, const std::filesystem::path& file) {
    if (::fdatasync(fd) != 0) return "cannot write " + file.string() + " to the disk: " + std::strerror(errno);
    drop_cached_pages(fd);
    return {};
  }

  /// Drops `fd`'s clean pages from the page cache (advice: nothing fails).
  static void drop_cached_pages([[maybe_unused]] int fd) {
#if defined(POSIX_FADV_DONTNEED)
    (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
#endif
  }

  /// Reads `bytes` of `file` into `data` (pread(), for the reason write() gives);
  /// returns the error (empty: read). `through`: the pages the read brought into
  /// the page cache leave it.
  static std::string read(const std::filesystem::path& file, void* data, std::int64_t bytes, bool through = true) {
    if (bytes == 0) return {};
    const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return "cannot open " + file.string() + ": " + std::strerror(errno);
    std::string error;
    auto* p = static_cast<char*>(data);
    std::int64_t done = 0;
    while (done < bytes) {
      const auto n = ::pread(fd, p + done, static_cast<std::size_t>(bytes - done), static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        error = "cannot read " + file.string() + ": " + (n < 0 ? std::strerror(errno) : "it is shorter than written");
        break;
      }
      done += n;
    }
    if (through) drop_cached_pages(fd);
    ::close(fd);
    return error;
  }

 private:
  std::optional<std::string> parent_;
  mutable std::mutex mutex_;
  std::filesystem::path dir_;
  std::string failure_;
  std::atomic<std::uint64_t> next_id_{0};
};

}  // namespace memscale::offload

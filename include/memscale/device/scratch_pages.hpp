// memscale::detail — memory for memscale's own measurements (the compute rates,
// the disk tier's rate, predict's BLAS probe and census): fresh anonymous
// pages, mapped where the kernel allows in 2 MiB pages, and resident before
// the measurement uses them.
//
// A fresh 4 KiB page costs a fault at its first touch: on the 2-CPU VM of
// 2026-11-30 about 11-13 µs each, 26 ms for 8 MiB, where the same 8 MiB in
// 2 MiB pages took 0.9-1.1 ms. Those faults were most of a first predict()'s
// measurements (the 8 MiB copy of the compute rates, the probe's 4 MiB left
// operand, the disk rate's 16 MiB), none of them what was being measured.
// Huge pages on Linux only (transparent huge pages, MADV_HUGEPAGE: honoured in
// the kernel's "always" and "madvise" modes; in "never", or elsewhere, 4 KiB
// pages, as before). Under the kernel's default defrag setting a huge page
// fault may compact memory first, a stall where memory is fragmented. The
// mapping is the memory's own: freeing it unmaps it, with no trace in malloc's
// heaps or its thresholds. Every 2 MiB page is whole: a buffer of a few KiB
// holds 2 MiB while it lives, so share one among small buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <utility>

#include <torch/torch.h>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#define MEMSCALE_SCRATCH_MMAP 1
#else
#define MEMSCALE_SCRATCH_MMAP 0
#endif

namespace memscale::detail {

/// `bytes` of zeroed, resident memory: an anonymous mapping of whole 2 MiB
/// pages, 2 MiB-aligned (in 2 MiB pages where transparent huge pages are on),
/// touched once. Throws std::bad_alloc where nothing can be mapped.
class scratch_pages {
 public:
  static constexpr std::size_t huge_page = std::size_t{2} << 20;

  explicit scratch_pages(std::size_t bytes) : bytes_(bytes == 0 ? 1 : bytes) {
    if (bytes_ > SIZE_MAX - 2 * huge_page) throw std::bad_alloc();
    mapped_ = (bytes_ + huge_page - 1) / huge_page * huge_page;
#if MEMSCALE_SCRATCH_MMAP
    // Map a page's slack more, then cut the slack off both ends: whole 2 MiB pages, 2 MiB-aligned.
    void* raw = ::mmap(nullptr, mapped_ + huge_page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    const auto start = reinterpret_cast<std::uintptr_t>(raw);
    const auto aligned = (start + huge_page - 1) / huge_page * huge_page;
    if (aligned > start) ::munmap(raw, aligned - start);
    ::munmap(reinterpret_cast<void*>(aligned + mapped_), start + huge_page - aligned);  // never empty
    data_ = reinterpret_cast<void*>(aligned);
#if defined(MADV_HUGEPAGE)
    (void)::madvise(data_, mapped_, MADV_HUGEPAGE);
#endif
#else
    data_ = ::operator new(mapped_, std::align_val_t{huge_page});
#endif
    std::memset(data_, 0, bytes_);  // resident now: the faults here, not in what is measured
  }
  scratch_pages(const scratch_pages&) = delete;
  scratch_pages& operator=(const scratch_pages&) = delete;
  ~scratch_pages() {
#if MEMSCALE_SCRATCH_MMAP
    ::munmap(data_, mapped_);
#else
    ::operator delete(data_, mapped_, std::align_val_t{huge_page});
#endif
  }

  [[nodiscard]] void* data() const { return data_; }
  [[nodiscard]] std::size_t size() const { return bytes_; }

 private:
  std::size_t bytes_;
  std::size_t mapped_ = 0;
  void* data_ = nullptr;
};

/// A contiguous CPU tensor of `sizes` over its own scratch_pages (zeros,
/// resident), unmapped when the tensor's storage goes. Throws c10::Error for
/// a negative or overflowing size, std::bad_alloc where nothing can be mapped.
[[nodiscard]] inline torch::Tensor scratch_tensor(c10::IntArrayRef sizes, const torch::TensorOptions& options) {
  const auto element = c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  std::size_t bytes = element;
  for (const auto s : sizes) {
    TORCH_CHECK(s >= 0, "memscale::detail::scratch_tensor: negative size ", s, " in ", sizes);
    TORCH_CHECK(!__builtin_mul_overflow(bytes, static_cast<std::size_t>(s), &bytes),
                "memscale::detail::scratch_tensor: ", sizes, " overflows");
  }
  auto pages = std::make_unique<scratch_pages>(bytes);
  void* data = pages->data();
  // The DataPtr owns the pages from here on: whatever throws below frees them once.
  c10::DataPtr owner(data, pages.get(), [](void* p) { delete static_cast<scratch_pages*>(p); }, c10::Device(c10::kCPU));
  (void)pages.release();
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<std::int64_t>(bytes), std::move(owner), nullptr,
                       /*resizable=*/false);
  return torch::empty({0}, options.device(c10::kCPU)).set_(std::move(storage), 0, sizes);
}

}  // namespace memscale::detail

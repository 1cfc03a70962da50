// memscale::detail — memory for memscale's own measurements (the compute rates,
// the disk tier's rate, predict's BLAS probe): fresh anonymous pages, mapped
// where the kernel allows in 2 MiB pages, and resident before the measurement
// uses them.
//
// A fresh 4 KiB page costs a fault at its first touch: on the 2-CPU VM of
// 2026-11-30 about 11-13 µs each, 26 ms for 8 MiB, where the same 8 MiB in
// 2 MiB pages took 0.9-1.1 ms. Those faults were most of a first predict()'s
// measurements (the 8 MiB copy of the compute rates, the probe's 4 MiB left
// operand, the disk rate's 16 MiB), none of them what was being measured.
// Linux only (transparent huge pages, MADV_HUGEPAGE: honoured in the kernel's
// "always" and "madvise" modes; in "never", or elsewhere, the pages are 4 KiB,
// as before). The mapping is the memory's own: freeing it unmaps it, with no
// trace in malloc's heaps or its thresholds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <utility>

#include <torch/torch.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace memscale::detail {

/// `bytes` of zeroed, resident memory: an anonymous mapping of whole 2 MiB
/// pages where transparent huge pages are on, touched once. Throws
/// std::bad_alloc where nothing can be mapped.
class scratch_pages {
 public:
  static constexpr std::size_t huge_page = std::size_t{2} << 20;

  explicit scratch_pages(std::size_t bytes) : bytes_(bytes == 0 ? 1 : bytes) {
#if defined(__linux__)
    // Whole 2 MiB pages, 2 MiB-aligned: map that and a page's slack, cut the slack off both ends.
    const std::size_t size = (bytes_ + huge_page - 1) / huge_page * huge_page;
    void* raw = ::mmap(nullptr, size + huge_page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    const auto start = reinterpret_cast<std::uintptr_t>(raw);
    const auto aligned = (start + huge_page - 1) / huge_page * huge_page;
    if (aligned > start) ::munmap(raw, aligned - start);
    ::munmap(reinterpret_cast<void*>(aligned + size), start + huge_page - aligned);  // never empty
    data_ = reinterpret_cast<void*>(aligned);
    mapped_ = size;
#if defined(MADV_HUGEPAGE)
    (void)::madvise(data_, mapped_, MADV_HUGEPAGE);
#endif
#else
    data_ = ::operator new(bytes_);
#endif
    std::memset(data_, 0, bytes_);  // resident now: the faults here, not in what is measured
  }
  scratch_pages(const scratch_pages&) = delete;
  scratch_pages& operator=(const scratch_pages&) = delete;
  ~scratch_pages() {
#if defined(__linux__)
    ::munmap(data_, mapped_);
#else
    ::operator delete(data_);
#endif
  }

  [[nodiscard]] void* data() const { return data_; }
  [[nodiscard]] std::size_t size() const { return bytes_; }

 private:
  std::size_t bytes_;
  void* data_ = nullptr;
  std::size_t mapped_ = 0;
};

/// A contiguous CPU tensor of `sizes` over its own scratch_pages (zeros,
/// resident), unmapped when the tensor's storage goes.
[[nodiscard]] inline torch::Tensor scratch_tensor(c10::IntArrayRef sizes, const torch::TensorOptions& options) {
  std::int64_t elements = 1;
  for (const auto s : sizes) elements *= s;
  const auto element = static_cast<std::int64_t>(c10::elementSize(c10::typeMetaToScalarType(options.dtype())));
  auto* pages = new scratch_pages(static_cast<std::size_t>(elements * element));
  try {
    return torch::from_blob(
        pages->data(), sizes, [pages](void*) { delete pages; }, options.device(c10::kCPU));
  } catch (...) {
    delete pages;
    throw;
  }
}

}  // namespace memscale::detail

// memscale — the BLAS library's packing buffers: what the full batch's matrix
// products make the process hold outside LibTorch's allocator, which a
// calibration at batch 2 does not see (predict/run.hpp).
//
// OpenBLAS packs an operand of every product into a buffer it allocates once
// and keeps, and the pages a product touches stay resident. Measured here
// (OpenBLAS 0.3.21, float, 2 threads): a product [m, k] x [k, n] touches
// min(k, 384) * m * 4 bytes (for k between 384 and 768, half of k), whatever n
// is, linearly in m to at least 131072 rows (192 MiB). The example GPT's step
// at batch 32 holds 5.6 MiB of it more than at batch 2.
//
// So predict records the calibration's matrix products (product_recorder), and
// extrapolates their shapes to other batches from two calibration batches
// (products_at). It then runs each distinct product for real (probe_product_runs),
// with n cut to 16 columns (on one OpenBLAS thread, to 512: probe_columns),
// at half the batch and at the batch, and reads the
// resident size just before and after each, its operands already in place.
// The growth is what those batches' products add. This is measured, not
// modelled: another BLAS (MKL, or OpenBLAS built otherwise) shows what it does.
//
// Not seen: BLAS calls that are not one of those five operators (a
// convolution's im2col path, LibTorch 2.x's _addmm_activation and CPU
// attention kernels), complex products, and the pages the process held before
// (the growth is relative to now: a second predict() in a process finds most
// of them held).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <ATen/record_function.h>
#include <torch/torch.h>

#include <memscale/device/hardware.hpp>
#include <memscale/device/process_memory.hpp>
#include <memscale/device/scratch_pages.hpp>
#include <memscale/predict/record_inputs.hpp>

namespace memscale::predictor::detail {

/// One matrix product, [m, k] x [k, n] (per matrix for a batched product).
struct matrix_product {
  std::int64_t m = 0, k = 0, n = 0;
  c10::ScalarType dtype = c10::ScalarType::Float;
  friend bool operator==(const matrix_product&, const matrix_product&) = default;
};

/// Records the matrix products (aten::mm, addmm, bmm, baddbmm, addbmm) that
/// run on this thread while it lives, in call order, whether they compute or
/// run shape-only. One recorder at a time on a thread (a nested one would see
/// each product twice).
class product_recorder {
 public:
  product_recorder() : previous_(current()) {
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&on_call).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
    current() = &products_;
  }
  product_recorder(const product_recorder&) = delete;
  product_recorder& operator=(const product_recorder&) = delete;
  ~product_recorder() {
    at::removeCallback(handle_);
    current() = previous_;
  }
  [[nodiscard]] std::vector<matrix_product> take() { return std::move(products_); }

 private:
  static std::vector<matrix_product>*& current() {
    thread_local std::vector<matrix_product>* products = nullptr;
    return products;
  }
  static std::unique_ptr<at::ObserverContext> on_call(const at::RecordFunction& fn) {
    auto* products = current();
    if (products == nullptr || fn.name() == nullptr) return nullptr;
    const std::string_view name = fn.name();
    std::size_t first = 0;  // the index of the left operand
    if (name == "aten::mm" || name == "aten::bmm") first = 0;
    else if (name == "aten::addmm" || name == "aten::baddbmm" || name == "aten::addbmm") first = 1;
    else return nullptr;
    const auto inputs = record_inputs(fn);
    if (inputs.size() < first + 2 || !inputs[first].isTensor() || !inputs[first + 1].isTensor()) return nullptr;
    const auto& a = inputs[first].toTensor();
    const auto& b = inputs[first + 1].toTensor();
    if (!a.defined() || !b.defined() || a.dim() < 2 || b.dim() < 2 || !a.device().is_cpu() ||
        a.layout() != c10::kStrided || b.layout() != c10::kStrided)
      return nullptr;
    products->push_back({a.size(-2), a.size(-1), b.size(-1), a.scalar_type()});
    return nullptr;
  }

  std::vector<matrix_product>* previous_;
  std::vector<matrix_product> products_;
  at::CallbackHandle handle_ = 0;
};

/// The products at batch `batch`, each dimension extrapolated linearly from the
/// same product at batches `batch_a` and `batch_b`; empty when the two lists
/// differ (another product sequence at the two batches).
[[nodiscard]] inline std::vector<matrix_product> products_at(const std::vector<matrix_product>& a, std::int64_t batch_a,
                                                             const std::vector<matrix_product>& b, std::int64_t batch_b,
                                                             std::int64_t batch) {
  if (a.size() != b.size() || batch_a == batch_b) return {};
  const auto at = [&](std::int64_t x, std::int64_t y) {
    return std::max<std::int64_t>(1, x + (y - x) * (batch - batch_a) / (batch_b - batch_a));
  };
  std::vector<matrix_product> out;
  out.reserve(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].dtype != b[i].dtype) return {};
    out.push_back({at(a[i].m, b[i].m), at(a[i].k, b[i].k), at(a[i].n, b[i].n), a[i].dtype});
  }
  return out;
}

#if defined(__linux__)
/// `bytes` of fresh anonymous pages, advised off transparent huge pages (which
/// map no zero page: a read would allocate one); null where mmap fails.
[[nodiscard]] inline void* fresh_pages(std::size_t bytes) {
  void* pages = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (pages == MAP_FAILED) return nullptr;
#if defined(MADV_NOHUGEPAGE)
  (void)::madvise(pages, bytes, MADV_NOHUGEPAGE);
#endif
  return pages;
}
#endif

/// Whether reading fresh anonymous pages leaves the process holding nothing,
/// the kernel mapping its shared zero page for each. Not on every Linux: seen
/// (2026-11-28) on a 6.18 kernel in a virtual machine that gave each page read
/// a page of its own. Read once per process, on 4 MiB of pages.
[[nodiscard]] inline bool zero_page_reads_are_free() {
#if defined(__linux__)
  static const bool free_reads = [] {
    constexpr std::size_t bytes = std::size_t{4} << 20;
    void* pages = fresh_pages(bytes);
    if (pages == nullptr) return false;
    const auto before = memscale::detail::read_process_memory();
    const volatile unsigned char* bytes_read = static_cast<const unsigned char*>(pages);
    unsigned sum = 0;
    for (std::size_t at = 0; at < bytes; at += 4096) sum += bytes_read[at];
    const auto after = memscale::detail::read_process_memory();
    ::munmap(pages, bytes);
    // Growth under half the pages read: another thread's pages cannot make a
    // held read look free.
    return sum == 0 && before && after && after->resident_bytes - before->resident_bytes < std::int64_t{bytes / 2};
  }();
  return free_reads;
#else
  return false;
#endif
}

/// `elements` zeros. Where reading fresh anonymous pages holds nothing
/// (zero_page_reads_are_free), those pages: a product reads them without the
/// process holding (or writing) them, where torch::zeros would write every
/// page first (3.5-4.4 ms for 12 MiB here, more than the product). Elsewhere
/// scratch_pages, held before the product runs, in 2 MiB pages where the
/// kernel gives them (on the 2-CPU VM of 2026-11-30 torch::zeros' 4 MiB cost
/// 13 ms of faults in every predict()).
[[nodiscard]] inline torch::Tensor zero_pages(std::int64_t elements, const torch::TensorOptions& options) {
#if defined(__linux__)
  if (zero_page_reads_are_free()) {
    const auto bytes = static_cast<std::size_t>(elements) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
    if (void* pages = fresh_pages(bytes)) {
      return torch::from_blob(
          pages, {elements}, [bytes](void* p) { ::munmap(p, bytes); }, options);
    }
  }
#endif
  return memscale::detail::scratch_tensor({elements}, options);
}

/// What probe_products measured.
struct workspace_probe {
  std::int64_t bytes = 0;  ///< the resident growth the products caused
  int products = 0;        ///< distinct products run
  bool scaled = false;     ///< a product ran on fewer rows, its growth extended to all (its operand over the cap)
};

/// The largest left operand probe_products runs whole: 1 GiB of zero pages
/// where reading them holds nothing (zero_page_reads_are_free), else 64 MiB of
/// zeros, which the process holds while the probe runs.
[[nodiscard]] inline std::int64_t probe_operand_cap() {
  return zero_page_reads_are_free() ? std::int64_t{1} << 30 : std::int64_t{64} << 20;
}

/// The columns a probe runs a product of at most `n` columns on, given
/// memscale::openblas_threads() (0: another BLAS, taken as threaded). Threaded,
/// OpenBLAS packs the left operand (m x min(k, 384) floats) whatever n is: 16.
/// On one thread it packs it only for products of more than about 400 columns
/// (8192 x 384 left operands, OpenBLAS 0.3.21, 2026-11-30: 1.2 MiB touched at 16
/// columns, 1.7 at 384, 13.5 at 512, 13.8 at 1536): n, up to 512.
[[nodiscard]] inline std::int64_t probe_columns(std::int64_t n, int blas_threads) {
  constexpr std::int64_t threaded = 16, one_thread_most = 512;
  return blas_threads == 1 ? std::clamp<std::int64_t>(n, 1, one_thread_most) : threaded;
}

/// Runs each distinct product of each list of `runs` (by element type and k: the
/// largest m and n), list after list, once for real on probe_columns(n)
/// columns, and sums, per
/// list, the resident size's growth across each call, its operands in place
/// first (the left one zero_pages). The operands are made once for all the
/// lists, sized for the largest product: each buffer made costs its pages'
/// faults (on the 2-CPU VM of 2026-11-30, 48 ms of a 69 ms predict() went on
/// the buffers the two lists of the example GPT made each for itself). A
/// product whose left operand would exceed `operand_cap` bytes runs on half,
/// then all of the rows the cap allows, and its growth is extended to all rows
/// at the rate of that second step (linear in the rows, as measured; an
/// under-estimate where the pages of those rows were held already). Only float
/// and double, which the BLAS computes. A list whose growth could not be read
/// gets an empty probe.
[[nodiscard]] inline std::vector<workspace_probe> probe_product_runs(
    const std::vector<std::vector<matrix_product>>& runs, std::int64_t operand_cap = probe_operand_cap()) {
  // (dtype, k) -> the largest m, and the columns to run on
  using distinct = std::map<std::pair<c10::ScalarType, std::int64_t>, std::pair<std::int64_t, std::int64_t>>;
  const int threads = memscale::openblas_threads();
  std::vector<distinct> rows(runs.size());
  for (std::size_t i = 0; i < runs.size(); ++i)
    for (const auto& p : runs[i])
      if (p.dtype == c10::ScalarType::Float || p.dtype == c10::ScalarType::Double) {
        auto& [m, columns] = rows[i][{p.dtype, p.k}];
        m = std::max(m, p.m);
        columns = std::max(columns, probe_columns(p.n, threads));
      }
  torch::NoGradGuard no_grad;
  const auto rows_run = [&](c10::ScalarType dtype, std::int64_t k, std::int64_t m) {
    const auto element = static_cast<std::int64_t>(c10::elementSize(dtype));
    return std::clamp<std::int64_t>(operand_cap / std::max<std::int64_t>(1, k * element), 1, m);
  };
  // The operands and the result are views of one buffer each per type, sized
  // for the largest.
  struct operands {
    std::int64_t left = 0, right = 0, result = 0;  // elements
    torch::Tensor left_buffer, right_buffer, result_buffer;
  };
  std::map<c10::ScalarType, operands> buffers;
  for (const auto& run : rows)
    for (const auto& [key, shape] : run) {
      const auto [m, columns] = shape;
      auto& o = buffers[key.first];
      const auto r = rows_run(key.first, key.second, m);
      o.left = std::max(o.left, r * key.second);
      o.right = std::max(o.right, key.second * columns);
      o.result = std::max(o.result, r * columns);
    }
  for (auto& [dtype, o] : buffers) {
    const auto options = torch::TensorOptions().dtype(dtype).device(c10::kCPU);
    o.left_buffer = zero_pages(o.left, options);
    o.right_buffer = memscale::detail::scratch_tensor({o.right}, options);
    o.result_buffer = memscale::detail::scratch_tensor({o.result}, options);
  }
  // The resident growth of one product of `r` rows; -1 where it cannot be read.
  const auto growth_of = [&](c10::ScalarType dtype, std::int64_t k, std::int64_t r,
                             std::int64_t columns) -> std::int64_t {
    const auto& o = buffers.at(dtype);
    const auto left = o.left_buffer.narrow(0, 0, r * k).view({r, k});
    const auto right = o.right_buffer.narrow(0, 0, k * columns).view({k, columns});
    auto result = o.result_buffer.narrow(0, 0, r * columns).view({r, columns});
    const auto before = memscale::detail::read_process_memory();
    at::mm_out(result, left, right);
    const auto after = memscale::detail::read_process_memory();
    if (!before || !after) return -1;
    return std::max<std::int64_t>(0, after->resident_bytes - before->resident_bytes);
  };
  const auto probe = [&](const distinct& run) -> workspace_probe {
    workspace_probe out;
    for (const auto& [key, shape] : run) {
      const auto [dtype, k] = key;
      const auto [m, columns] = shape;
      const auto r = rows_run(dtype, k, m);
      if (r == m || r < 2) {
        const auto g = growth_of(dtype, k, r, columns);
        if (g < 0) return {};
        out.bytes += g;
      } else {
        const auto first = growth_of(dtype, k, r / 2, columns);
        const auto second = growth_of(dtype, k, r, columns);
        if (first < 0 || second < 0) return {};
        const double per_row = static_cast<double>(second) / static_cast<double>(r - r / 2);
        out.bytes += first + second + static_cast<std::int64_t>(per_row * static_cast<double>(m - r));
        out.scaled = true;
      }
      ++out.products;
    }
    return out;
  };
  std::vector<workspace_probe> out;
  out.reserve(rows.size());
  for (const auto& run : rows) out.push_back(probe(run));
  return out;
}

/// probe_product_runs for one list of products.
[[nodiscard]] inline workspace_probe probe_products(const std::vector<matrix_product>& products,
                                                    std::int64_t operand_cap = probe_operand_cap()) {
  return probe_product_runs({products}, operand_cap).front();
}

}  // namespace memscale::predictor::detail

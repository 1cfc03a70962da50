// memscale — a saved tensor whose rows end in runs of +0 stored without them
// (Config::pack_saved_zeros). Causal attention written with plain ops saves
// softmax's output, whose row i is +0 after position i (the masked scores):
// nearly half of the score-sized tensor that is the largest a block saves. Gist
// (Jain et al., ISCA 2018) stores ReLU outputs sparsely for the same reason;
// trailing runs keep it a copy per row: each row's elements up to its last one
// that is not +0 are copied out, and backward gets the tensor back with the
// rest written as +0 (memset). Lossless: an element is dropped only where its
// bit pattern is all zero (so -0 and NaN stay), the rows' lengths are kept, and
// the tensor comes back bit for bit, contiguous like the one saved.
//
// Only where it pays: a floating, contiguous CPU tensor of at least
// min_packed_elements whose dropped elements come to at least a quarter of its
// bytes. Rejecting a tensor costs a look at each row's last element.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <memscale/techniques/mask_packing.hpp>

namespace memscale::detail {

/// Saved tensors stored as zero_tails in this process so far (tests read it).
inline std::atomic<std::int64_t>& zero_tails_count() {
  static std::atomic<std::int64_t> count{0};
  return count;
}

/// A tensor's rows (its last dimension) without their trailing +0 elements.
struct zero_tails {
  at::Tensor kept;     ///< bytes: each row's elements up to its last non-+0 one, row after row
  at::Tensor lengths;  ///< int64 per row: the elements kept of it
  std::vector<std::int64_t> sizes;
  c10::ScalarType dtype = c10::ScalarType::Undefined;

  [[nodiscard]] bool defined() const noexcept { return kept.defined(); }
  /// What it holds (the rows' prefixes and their lengths).
  [[nodiscard]] std::int64_t nbytes() const noexcept {
    return defined() ? static_cast<std::int64_t>(kept.nbytes() + lengths.nbytes()) : 0;
  }
};

/// Whether `t` may be stored as zero_tails: an activation (computed in the
/// graph: a parameter, a buffer or the caller's input stays held anyway, and a
/// copy of it would only add), floating, dense and contiguous on CPU, large,
/// rows of at least 16 elements.
inline bool zero_tails_candidate(const at::Tensor& t) {
  return t.defined() && !t.is_leaf() && t.layout() == c10::kStrided && t.device().is_cpu() &&
         c10::isFloatingType(t.scalar_type()) &&
         t.dim() >= 2 && t.size(-1) >= 16 && t.is_contiguous() && !t.is_neg() && !t.is_conj() && t.has_storage() &&
         t.numel() >= min_packed_elements && t.storage().data() != nullptr;
}

/// Where each row's kept elements start: the running sum of `len`.
inline std::vector<std::int64_t> row_starts(const std::int64_t* len, std::int64_t rows) {
  std::vector<std::int64_t> start(static_cast<std::size_t>(rows) + 1, 0);
  for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) start[r + 1] = start[r] + len[r];
  return start;
}

/// Packs `t` (a zero_tails_candidate) into `out` where the rows' trailing +0
/// elements come to at least `min_fraction` of its bytes; false (and `out`
/// untouched) elsewhere.
template <class U>
bool pack_zero_tails(const at::Tensor& t, zero_tails& out, double min_fraction = 0.25) {
  const auto row = t.size(-1);
  const auto rows = t.numel() / row;
  const auto* data = static_cast<const U*>(t.data_ptr());
  auto lengths = at::empty({rows}, at::kLong);
  auto* len = lengths.data_ptr<std::int64_t>();
  at::parallel_for(0, rows, 256, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const auto* p = data + r * row;
      std::int64_t n = row;
      while (n > 0 && p[n - 1] == U(0)) --n;
      len[r] = n;
    }
  });
  std::int64_t kept = 0;
  for (std::int64_t r = 0; r < rows; ++r) kept += len[r];
  const auto dropped = t.numel() - kept;
  if (static_cast<double>(dropped) < min_fraction * static_cast<double>(t.numel())) return false;
  const auto start = row_starts(len, rows);
  auto bytes = at::empty({std::max<std::int64_t>(1, kept * static_cast<std::int64_t>(sizeof(U)))}, at::kByte);
  auto* dst = static_cast<U*>(bytes.data_ptr());
  at::parallel_for(0, rows, 256, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r)
      std::memcpy(dst + start[static_cast<std::size_t>(r)], data + r * row,
                  static_cast<std::size_t>(len[r]) * sizeof(U));
  });
  out.kept = std::move(bytes);
  out.lengths = std::move(lengths);
  out.sizes = t.sizes().vec();
  out.dtype = t.scalar_type();
  return true;
}

inline bool pack_zero_tails(const at::Tensor& t, zero_tails& out, double min_fraction = 0.25) {
  return by_element_size(t.element_size(), [&]<class U>() { return pack_zero_tails<U>(t, out, min_fraction); });
}

/// The tensor `p` was packed from, bit for bit (contiguous).
inline at::Tensor unpack_zero_tails(const zero_tails& p) {
  auto t = at::empty(p.sizes, at::TensorOptions().dtype(p.dtype));
  const auto element = static_cast<std::int64_t>(t.element_size());
  const auto row = t.size(-1);
  const auto rows = t.numel() / row;
  const auto* len = p.lengths.data_ptr<std::int64_t>();
  const auto start = row_starts(len, rows);
  const auto* src = static_cast<const char*>(p.kept.data_ptr());
  auto* dst = static_cast<char*>(t.data_ptr());
  at::parallel_for(0, rows, 256, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      auto* out = dst + r * row * element;
      const auto n = len[r] * element;
      std::memcpy(out, src + start[static_cast<std::size_t>(r)] * element, static_cast<std::size_t>(n));
      std::memset(out + n, 0, static_cast<std::size_t>(row * element - n));
    }
  });
  return t;
}

}  // namespace memscale::detail

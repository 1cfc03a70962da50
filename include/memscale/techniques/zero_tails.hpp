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
#include <type_traits>
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
      while (n >= 8) {  // eight at a time while all eight are +0, then one at a time
        U any = 0;
        for (std::int64_t k = 1; k <= 8; ++k) any |= p[n - k];
        if (any != 0) break;
        n -= 8;
      }
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

/// x * mask with x kept as zero_tails and the mask as bits, without writing x
/// back first (Dropout's product of causal attention's softmax output, which
/// backward asks for): multiply_by_bits(unpack_zero_tails(z), m), byte for
/// byte, in one pass and one tensor. A row's dropped tail is +0 times its bits.
template <class T, class U>
at::Tensor multiply_tails_by_bits(const zero_tails& z, const packed_mask& m) {
  auto out = at::empty(z.sizes, at::TensorOptions().dtype(z.dtype));
  const auto row = out.size(-1);
  const auto rows = out.numel() / row;
  const auto* len = z.lengths.data_ptr<std::int64_t>();
  const auto start = row_starts(len, rows);
  const auto* kept = static_cast<const T*>(z.kept.data_ptr());
  const auto* bits = m.bits.data_ptr<std::uint8_t>();
  auto* o = out.data_ptr<T>();
  T value;
  const auto pattern = static_cast<U>(m.value);
  std::memcpy(&value, &pattern, sizeof(T));
  const auto set = [bits](std::int64_t i) { return ((static_cast<unsigned>(bits[i >> 3]) >> (i & 7)) & 1U) != 0; };
  const T tail_set = T(0) * value, tail_clear = T(0) * T(0);  // +0 times the mask, as the plain product makes it
  U tail_set_bits;
  std::memcpy(&tail_set_bits, &tail_set, sizeof(T));
  const bool tails_zero = tail_set_bits == 0;  // +0 either way: a memset (value finite and positive, as Dropout's)
  at::parallel_for(0, rows, 256, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const auto base = r * row, n = len[r];
      const T* x = kept + start[static_cast<std::size_t>(r)];
      T* y = o + base;
      std::int64_t j = 0;
#if defined(__SSE2__)
      if constexpr (std::is_same_v<T, float>) {
        if (base % 8 == 0) {  // the row starts on a byte of the bits: eight at a time
          sse2_bits::multiply_run(x, bits + base / 8, y, n / 8, pattern);
          j = n / 8 * 8;
        }
      }
#endif
      for (; j < n; ++j) y[j] = x[j] * (set(base + j) ? value : T(0));
      if (tails_zero) {
        std::memset(y + n, 0, static_cast<std::size_t>(row - n) * sizeof(T));
      } else {
        for (j = n; j < row; ++j) y[j] = set(base + j) ? tail_set : tail_clear;
      }
    }
  });
  return out;
}

/// Undefined where the operands are not a float or double tensor kept as tails
/// and a mask of its sizes and type (multiply_by_bits on the unpacked tensor then).
inline at::Tensor multiply_tails_by_bits(const zero_tails& z, const packed_mask& m) {
  if (!z.defined() || !m.bits.defined() || z.sizes != m.sizes || z.dtype != m.dtype) return {};
  if (m.dtype == at::kFloat) return multiply_tails_by_bits<float, std::uint32_t>(z, m);
  if (m.dtype == at::kDouble) return multiply_tails_by_bits<double, std::uint64_t>(z, m);
  return {};
}

}  // namespace memscale::detail

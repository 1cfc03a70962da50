// memscale — masks kept as bits (Config::pack_saved_masks). LibTorch's CPU
// Dropout saves its scaled noise for its product's backward: a float tensor
// whose elements are all +0 or one value (1 / (1 - p)), as large as the
// activation it masks. Under the saved-tensor hooks of saved_compaction.hpp, a
// unit the plan leaves in place stores every such saved tensor a bit an element
// with what is here, and writes it back exactly when backward asks for it. Nothing is inferred from where a
// tensor came from: the pack checks every element's bit pattern, so a tensor is
// packed only where the bits written back are the bits saved (a -0, or a third
// value, and it is stored as it is). Measured on the benchmark GPT on CPU: 40 of
// its step's 243 MiB freed, the step no slower (benchmarks/RESULTS.md).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <ATen/Parallel.h>
#include <torch/torch.h>


namespace memscale {

namespace detail {

/// Saved tensors smaller than this are stored as they are (as draw_replay's
/// smallest kept draw): their bits would save little beside the bookkeeping.
inline constexpr std::int64_t min_packed_elements = 16384;

/// Tensors packed in this process so far (tests read it).
inline std::atomic<std::int64_t>& packed_mask_count() {
  static std::atomic<std::int64_t> count{0};
  return count;
}

#if defined(__SSE2__)
/// SSE2 (every x86-64 CPU) for 4-byte elements, eight at a time: the bits of
/// eight elements that are not +0, and whether each is +0 or `value`.
struct sse2_bits {
  /// Byte i of `packed` from elements 8i..8i+7; false where one is neither +0 nor `value`.
  static bool pack(const std::uint32_t* in, std::uint8_t* packed, std::int64_t begin, std::int64_t end,
                   std::uint32_t value) {
    const __m128i zero = _mm_setzero_si128();
    const __m128i v = _mm_set1_epi32(static_cast<int>(value));
    __m128i ok = _mm_cmpeq_epi32(zero, zero);
    for (std::int64_t i = begin; i < end; ++i) {
      const auto* p = reinterpret_cast<const __m128i*>(in + 8 * i);
      const __m128i a = _mm_loadu_si128(p), b = _mm_loadu_si128(p + 1);
      const __m128i za = _mm_cmpeq_epi32(a, zero), zb = _mm_cmpeq_epi32(b, zero);
      ok = _mm_and_si128(ok, _mm_and_si128(_mm_or_si128(za, _mm_cmpeq_epi32(a, v)),
                                           _mm_or_si128(zb, _mm_cmpeq_epi32(b, v))));
      const int zeros = _mm_movemask_ps(_mm_castsi128_ps(za)) | (_mm_movemask_ps(_mm_castsi128_ps(zb)) << 4);
      packed[i] = static_cast<std::uint8_t>(~zeros);
    }
    return _mm_movemask_epi8(ok) == 0xFFFF;
  }
  /// Lanes of `byte`'s bits 0..3 and 4..7: all ones where set.
  static void lanes(unsigned byte, __m128i& lo, __m128i& hi) {
    const __m128i bits = _mm_set1_epi32(static_cast<int>(byte));
    const __m128i low = _mm_setr_epi32(1, 2, 4, 8), high = _mm_setr_epi32(16, 32, 64, 128);
    lo = _mm_cmpeq_epi32(_mm_and_si128(bits, low), low);
    hi = _mm_cmpeq_epi32(_mm_and_si128(bits, high), high);
  }
  static void unpack(const std::uint8_t* packed, std::uint32_t* out, std::int64_t begin, std::int64_t end,
                     std::uint32_t value) {
    const __m128i v = _mm_set1_epi32(static_cast<int>(value));
    for (std::int64_t i = begin; i < end; ++i) {
      __m128i lo, hi;
      lanes(packed[i], lo, hi);
      auto* p = reinterpret_cast<__m128i*>(out + 8 * i);
      _mm_storeu_si128(p, _mm_and_si128(lo, v));
      _mm_storeu_si128(p + 1, _mm_and_si128(hi, v));
    }
  }
  /// out = x * (bit ? value : +0), element by element (a float multiplication each).
  static void multiply(const float* x, const std::uint8_t* packed, float* out, std::int64_t begin, std::int64_t end,
                       std::uint32_t value) {
    multiply_run(x + 8 * begin, packed + begin, out + 8 * begin, end - begin, value);
  }
  /// The same for `bytes` runs of eight: x[8k..8k+7] and out[8k..8k+7] with packed[k].
  static void multiply_run(const float* x, const std::uint8_t* packed, float* out, std::int64_t bytes,
                           std::uint32_t value) {
    const __m128 v = _mm_castsi128_ps(_mm_set1_epi32(static_cast<int>(value)));
    for (std::int64_t k = 0; k < bytes; ++k) {
      __m128i lo, hi;
      lanes(packed[k], lo, hi);
      _mm_storeu_ps(out + 8 * k, _mm_mul_ps(_mm_loadu_ps(x + 8 * k), _mm_and_ps(_mm_castsi128_ps(lo), v)));
      _mm_storeu_ps(out + 8 * k + 4, _mm_mul_ps(_mm_loadu_ps(x + 8 * k + 4), _mm_and_ps(_mm_castsi128_ps(hi), v)));
    }
  }
};
#endif

/// A saved tensor: as it is (`plain`), or a bit an element with the one
/// nonzero bit pattern `value` (element i is `value` where bit i is set, +0 else).
struct packed_mask {
  at::Tensor plain;
  at::Tensor bits;
  std::uint64_t value = 0;
  std::vector<std::int64_t> sizes;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
};

/// Whether a saved tensor may be a mask: floating, dense, contiguous, on CPU,
/// not a tensor autograd computes a gradient for (activations are), and large.
inline bool mask_candidate(const at::Tensor& t) {
  return t.defined() && !t.requires_grad() && t.layout() == c10::kStrided && t.device().is_cpu() &&
         c10::isFloatingType(t.scalar_type()) && t.is_contiguous() && !t.is_neg() && !t.is_conj() &&
         t.has_storage() && t.numel() >= min_packed_elements && t.storage().data() != nullptr;
}

/// Packs `t` (a mask_candidate) a bit an element if all its elements are +0 or
/// one bit pattern; returns false (and writes nothing to `out`) otherwise.
template <class U>
bool pack_two_valued(const at::Tensor& t, packed_mask& out) {
  const auto n = t.numel();
  const auto* in = static_cast<const U*>(t.data_ptr());
  U value = 0;
  for (std::int64_t i = 0; i < n && value == 0; ++i) value = in[i];
  if (value == 0) return false;  // all +0: a tensor of zeros is no mask worth packing
  auto bits = at::empty({(n + 7) / 8}, at::TensorOptions(at::kByte));
  auto* packed = bits.data_ptr<std::uint8_t>();
  const std::int64_t whole = n / 8;  // bytes of eight elements
  std::atomic<bool> other{false};
  // One pass, branch-free over each run of eight elements so that it vectorizes.
  at::parallel_for(0, whole, 1 << 13, [&](std::int64_t begin, std::int64_t end) {
#if defined(__SSE2__)
    if constexpr (sizeof(U) == 4) {
      if (!sse2_bits::pack(in, packed, begin, end, value)) other = true;
      return;
    }
#endif
    unsigned bad = 0;
    for (std::int64_t i = begin; i < end; ++i) {
      const U* v = in + 8 * i;
      unsigned byte = 0;
      for (int j = 0; j < 8; ++j) {
        byte |= static_cast<unsigned>(v[j] != 0) << j;
        bad |= static_cast<unsigned>(v[j] != 0) & static_cast<unsigned>(v[j] != value);
      }
      packed[i] = static_cast<std::uint8_t>(byte);
    }
    if (bad != 0) other = true;
  });
  if (whole < bits.numel()) {  // the last, partial byte
    unsigned byte = 0;
    for (std::int64_t j = 0; 8 * whole + j < n; ++j) {
      const U u = in[8 * whole + j];
      if (u != 0 && u != value) other = true;
      byte |= static_cast<unsigned>(u != 0) << j;
    }
    packed[whole] = static_cast<std::uint8_t>(byte);
  }
  if (other) return false;
  out.bits = std::move(bits);
  out.value = value;
  out.sizes = t.sizes().vec();
  out.dtype = t.scalar_type();
  return true;
}

template <class U>
void unpack_two_valued(const packed_mask& p, at::Tensor& t) {
  const auto n = t.numel();
  auto* o = static_cast<U*>(t.data_ptr());
  const auto* in = p.bits.data_ptr<std::uint8_t>();
  const auto value = static_cast<U>(p.value);
  const std::int64_t whole = n / 8;
  at::parallel_for(0, whole, 1 << 13, [&](std::int64_t begin, std::int64_t end) {
#if defined(__SSE2__)
    if constexpr (sizeof(U) == 4) {
      sse2_bits::unpack(in, o, begin, end, value);
      return;
    }
#endif
    for (std::int64_t i = begin; i < end; ++i) {
      const unsigned byte = in[i];
      U* v = o + 8 * i;
      for (int j = 0; j < 8; ++j) v[j] = static_cast<U>(value & (U{0} - static_cast<U>((byte >> j) & 1U)));
    }
  });
  for (std::int64_t j = 0; 8 * whole + j < n; ++j)
    o[8 * whole + j] = ((static_cast<unsigned>(in[whole]) >> j) & 1U) != 0 ? value : U{0};
}

/// Calls f.template operator()<U>() with U the unsigned type of `t`'s element size (2, 4 or 8 bytes).
template <class F>
bool by_element_size(std::size_t size, F&& f) {
  switch (size) {
    case 2: return f.template operator()<std::uint16_t>();
    case 4: return f.template operator()<std::uint32_t>();
    case 8: return f.template operator()<std::uint64_t>();
    default: return false;
  }
}

/// Packs a saved tensor if it is a two-valued mask; else keeps it as it is.
inline packed_mask pack_mask(const at::Tensor& t) {
  packed_mask p;
  if (mask_candidate(t) &&
      by_element_size(t.element_size(), [&]<class U>() { return pack_two_valued<U>(t, p); })) {
    packed_mask_count().fetch_add(1, std::memory_order_relaxed);
    return p;
  }
  // Detached: for a tensor an op saves of its own outputs, LibTorch hands the
  // hook the output itself, whose grad_fn holds this hook (a cycle, and every
  // such graph would leak). Backward rebuilds the variable from the data.
  p.plain = t.detach();
  return p;
}

/// The saved tensor back, bit for bit.
inline at::Tensor unpack_mask(const packed_mask& p) {
  if (p.plain.defined() || !p.bits.defined()) return p.plain;
  auto t = at::empty(p.sizes, at::TensorOptions(p.dtype));
  by_element_size(t.element_size(), [&]<class U>() {
    unpack_two_valued<U>(p, t);
    return true;
  });
  return t;
}

/// x * mask where the mask is kept as bits, without writing the mask back:
/// each element x[i] * (bit i ? value : +0), the multiplication the forward made
/// (Dropout's product of its input and its noise). Undefined where the operands
/// are not a contiguous float or double tensor and a mask of its sizes and type.
template <class T, class U>
at::Tensor multiply_by_bits(const at::Tensor& x, const packed_mask& m) {
  auto out = at::empty(m.sizes, x.options());
  const auto n = x.numel();
  const auto* in = x.data_ptr<T>();
  auto* o = out.data_ptr<T>();
  const auto* bits = m.bits.data_ptr<std::uint8_t>();
  T value;
  const auto pattern = static_cast<U>(m.value);
  std::memcpy(&value, &pattern, sizeof(T));
  at::parallel_for(0, (n + 7) / 8, 1 << 13, [&](std::int64_t begin, std::int64_t end) {
#if defined(__SSE2__)
    if constexpr (std::is_same_v<T, float>) {  // whole bytes of eight; the last, partial one below
      const auto whole = std::min(end, n / 8);
      if (begin < whole) sse2_bits::multiply(in, bits, o, begin, whole, pattern);
      begin = std::max(begin, whole);
    }
#endif
    for (std::int64_t i = begin; i < end; ++i) {
      const unsigned byte = bits[i];
      for (std::int64_t j = 0; j < 8 && 8 * i + j < n; ++j)
        o[8 * i + j] = in[8 * i + j] * (((byte >> j) & 1U) != 0 ? value : T(0));
    }
  });
  return out;
}

inline at::Tensor multiply_by_bits(const at::Tensor& x, const packed_mask& m) {
  if (!x.defined() || !x.is_contiguous() || x.sizes() != c10::IntArrayRef(m.sizes) || x.scalar_type() != m.dtype ||
      !x.device().is_cpu())
    return {};
  if (m.dtype == at::kFloat) return multiply_by_bits<float, std::uint32_t>(x, m);
  if (m.dtype == at::kDouble) return multiply_by_bits<double, std::uint64_t>(x, m);
  return {};
}

}  // namespace detail

}  // namespace memscale

// memscale — block-wise 8-bit quantization, as bitsandbytes' block-wise
// optimizers store their state: blocks of 256 values, each with one fp32 absmax
// (one outlier coarsens only its 255 neighbours; the absmax costs 4/256 byte per
// value), codes into bitsandbytes' dynamic tree maps (create_dynamic_map, 7
// exponent bits: signed for values of either sign, unsigned for nonnegative
// ones; their entries span 7 decades, so small values keep their relative
// precision), nearest-entry rounding (ties to the lower entry). AdamW8bit
// (techniques/optim8bit.hpp) stores both moments this way; memscale::cuda's
// kernels use the same maps, midpoints and rounding.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>

#include <torch/torch.h>

namespace memscale {
namespace optim {

/// Values per quantization block (one fp32 absmax each).
inline constexpr std::int64_t quantization_block_size = 256;

/// bitsandbytes' dynamic tree quantization map (create_dynamic_map with 7
/// exponent bits, 8 bits): 256 sorted values in [-1, 1] (signed) or [0, 1],
/// with 0 and 1 exactly; the signed map's most negative entry is -0.99297.
/// Decade i (i = 0..6) holds midpoints of linspace(0.1, 1) scaled by 10^(i-6):
/// 2^i of them per sign (signed) or 2^(i+1) (unsigned).
[[nodiscard]] inline const std::array<float, 256>& dynamic_map(bool is_signed) {
  static const auto build = [](bool with_sign) {
    std::vector<double> values;
    for (int i = 0; i < 7; ++i) {
      const int intervals = with_sign ? (1 << i) : (1 << (i + 1));
      const double scale = std::pow(10.0, i - 6);
      for (int k = 0; k < intervals; ++k) {
        const double lo = 0.1 + 0.9 * k / intervals;
        const double hi = 0.1 + 0.9 * (k + 1) / intervals;
        values.push_back(scale * (lo + hi) / 2.0);
        if (with_sign) values.push_back(-scale * (lo + hi) / 2.0);
      }
    }
    values.push_back(0.0);
    values.push_back(1.0);
    std::sort(values.begin(), values.end());
    std::array<float, 256> map{};
    if (values.size() != map.size()) throw std::logic_error("memscale: the dynamic map must have 256 entries");
    std::transform(values.begin(), values.end(), map.begin(), [](double v) { return static_cast<float>(v); });
    return map;
  };
  static const std::array<float, 256> signed_map = build(true);
  static const std::array<float, 256> unsigned_map = build(false);
  return is_signed ? signed_map : unsigned_map;
}

/// The code of 0 in a dynamic map (the initial state of both moments).
[[nodiscard]] inline std::uint8_t zero_code(bool is_signed) {
  const auto& map = dynamic_map(is_signed);
  return static_cast<std::uint8_t>(std::find(map.begin(), map.end(), 0.0f) - map.begin());
}

/// A tensor quantized block-wise: codes (uint8, one per value, flat) and
/// absmax (float, one per block).
struct quantized_blocks {
  torch::Tensor codes;
  torch::Tensor absmax;
};

namespace detail {
// Internal: the maps and their midpoints as tensors on one device.

/// The 255 decision boundaries of a map, (map[k] + map[k + 1]) * 0.5f in float
/// (the CUDA kernels compute the same expression).
inline const std::array<float, 255>& midpoints(bool is_signed) {
  static const auto build = [](bool with_sign) {
    const auto& map = dynamic_map(with_sign);
    std::array<float, 255> mid{};
    for (std::size_t k = 0; k < mid.size(); ++k) mid[k] = (map[k] + map[k + 1]) * 0.5f;
    return mid;
  };
  static const std::array<float, 255> signed_mid = build(true);
  static const std::array<float, 255> unsigned_mid = build(false);
  return is_signed ? signed_mid : unsigned_mid;
}

struct quant_tables {
  torch::Tensor map[2];        ///< [unsigned, signed]
  torch::Tensor midpoints[2];  ///< [unsigned, signed]
};

/// CPU tables view the static arrays (no allocation, never freed); other
/// devices get a copy, which callers may cache.
inline quant_tables tables_on(c10::Device device) {
  quant_tables t;
  for (bool is_signed : {false, true}) {
    auto* map = const_cast<float*>(dynamic_map(is_signed).data());
    auto* mid = const_cast<float*>(midpoints(is_signed).data());
    t.map[is_signed] = torch::from_blob(map, {256}, torch::kFloat);
    t.midpoints[is_signed] = torch::from_blob(mid, {255}, torch::kFloat);
    if (!device.is_cpu()) {
      t.map[is_signed] = t.map[is_signed].to(device);
      t.midpoints[is_signed] = t.midpoints[is_signed].to(device);
    }
  }
  return t;
}

/// `values` (float, 1-D, any length) padded with zeros to whole blocks: [blocks, 256].
inline torch::Tensor as_blocks(const torch::Tensor& values) {
  const auto n = values.numel();
  const auto blocks = (n + quantization_block_size - 1) / quantization_block_size;
  const auto pad = blocks * quantization_block_size - n;
  auto padded = pad == 0 ? values.contiguous() : torch::constant_pad_nd(values, {0, pad}, 0.0);
  return padded.view({blocks, quantization_block_size});
}

/// Quantizes float `values` (1-D) into `codes` and `absmax` (views into state).
inline void quantize_into(const torch::Tensor& values, const torch::Tensor& map_midpoints, torch::Tensor codes,
                          torch::Tensor absmax) {
  const auto blocks = as_blocks(values);
  auto block_absmax = blocks.abs().amax(1);
  const auto scale = torch::where(block_absmax > 0, block_absmax, torch::ones_like(block_absmax));
  const auto normalized = blocks / scale.unsqueeze(1);
  // bucketize (right = false) counts the midpoints < x: the nearest entry, ties to the lower one.
  auto index = torch::bucketize(normalized, map_midpoints, /*out_int32=*/true, /*right=*/false);
  codes.copy_(index.view(-1).narrow(0, 0, values.numel()));
  absmax.copy_(block_absmax);
}

/// Dequantizes `codes` (n values) with their blocks' `absmax`: float [n].
inline torch::Tensor dequantize(const torch::Tensor& codes, const torch::Tensor& absmax, const torch::Tensor& map) {
  const auto n = codes.numel();
  auto values = map.index_select(0, codes.to(torch::kLong));
  auto blocks = as_blocks(values);
  blocks.mul_(absmax.view({-1, 1}));
  return blocks.view(-1).narrow(0, 0, n);
}


/// Nearest-entry lookup without a search: the map's midpoints are never closer
/// than the width of a cell of floats sharing their top 16 bits, so a cell's
/// first code plus one comparison gives the code (checked when built).
struct code_lookup {
  std::array<std::uint8_t, 65536> first_code{};  ///< midpoints below the cell's lowest value
  std::array<float, 256> midpoint{};             ///< the 255 midpoints, then +inf
};

inline const code_lookup& lookup(bool is_signed) {
  static const auto build = [](bool with_sign) {
    const auto& mid = midpoints(with_sign);
    const auto below = [&](float x) { return std::lower_bound(mid.begin(), mid.end(), x) - mid.begin(); };
    const auto at_most = [&](float x) { return std::upper_bound(mid.begin(), mid.end(), x) - mid.begin(); };
    auto table = std::make_unique<code_lookup>();
    std::copy(mid.begin(), mid.end(), table->midpoint.begin());
    table->midpoint.back() = std::numeric_limits<float>::infinity();
    for (std::uint32_t cell = 0; cell < 65536; ++cell) {
      const bool negative = (cell & 0x8000u) != 0;
      const auto low = std::bit_cast<float>((cell << 16) | (negative ? 0xFFFFu : 0u));
      const auto high = std::bit_cast<float>((cell << 16) | (negative ? 0u : 0xFFFFu));
      if (std::isnan(low) || std::isnan(high)) continue;
      if (at_most(high) - below(low) > 1) throw std::logic_error("memscale: a quantization cell holds two midpoints");
      table->first_code[cell] = static_cast<std::uint8_t>(below(low));
    }
    return table;
  };
  static const auto signed_table = build(true);
  static const auto unsigned_table = build(false);
  return is_signed ? *signed_table : *unsigned_table;
}

/// The nearest map entry to x, ties to the lower one: how many midpoints are < x.
inline std::uint8_t nearest_code(const code_lookup& table, float x) {
  const auto code = table.first_code[std::bit_cast<std::uint32_t>(x) >> 16];
  return static_cast<std::uint8_t>(code + (table.midpoint[code] < x ? 1 : 0));
}

}  // namespace detail


/// Block-wise 8-bit quantization of any float tensor (flattened), with the
/// signed map (is_signed) or the unsigned one (for nonnegative values).
[[nodiscard]] inline quantized_blocks quantize_blockwise(const torch::Tensor& values, bool is_signed) {
  torch::NoGradGuard no_grad;
  const auto flat = values.detach().reshape(-1).to(torch::kFloat);
  const auto blocks = (flat.numel() + quantization_block_size - 1) / quantization_block_size;
  quantized_blocks q{torch::empty({flat.numel()}, flat.options().dtype(torch::kByte)),
                     torch::empty({blocks}, flat.options())};
  const auto tables = detail::tables_on(flat.device());
  detail::quantize_into(flat, tables.midpoints[is_signed], q.codes, q.absmax);
  return q;
}

/// The float values `q` stands for (flat, q.codes.numel() long).
[[nodiscard]] inline torch::Tensor dequantize_blockwise(const quantized_blocks& q, bool is_signed) {
  torch::NoGradGuard no_grad;
  const auto tables = detail::tables_on(q.codes.device());
  return detail::dequantize(q.codes, q.absmax, tables.map[is_signed]).clone();
}

}  // namespace optim
}  // namespace memscale

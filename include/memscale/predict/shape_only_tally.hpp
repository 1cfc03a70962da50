// memscale — what a shape-only span did and what its operators would take
// computed: the tally (shape_only_tally), the rates that turn arithmetic and
// bytes moved into seconds (shape_only_rates, measured once per process), and
// the estimate of one operator's work (work_of) the fallback adds to the tally.
// Part of shape-only execution (predict/shape_only.hpp).
//
// The tally counts what the span's operators would take computed: those run
// for real are timed, the others estimated from their matrix products'
// arithmetic and the bytes they read and write, at rates measured once per
// process (shape_only_rates). The profiler can time by that count
// (profile_clock_scope), which is how predict() profiles its plan shape-only.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#include <memscale/device/compute_rates.hpp>
#include <memscale/predict/blas_workspace.hpp>

namespace memscale::predictor {

/// What a shape_only_scope's span did, by operator call.
struct shape_only_tally {
  std::int64_t shape_only = 0;  ///< ran on meta, outputs allocated uninitialised
  std::int64_t skipped = 0;     ///< in-place, or equal(x, x): nothing computed
  std::int64_t real = 0;        ///< ran for real (views, factories, integer results, no meta kernel)
  std::int64_t census = 0;      ///< also ran for real, unseen: a census's first call of the operator in the process
  /// What the span's operators would take computed: measured for those run for
  /// real, estimated for the others (shape_only_rates): real_seconds +
  /// flops / flops_per_second + bytes_moved / bytes_per_second, filled by
  /// shape_only_scope::tally() once the rates are measured.
  double estimated_seconds = 0.0;
  double real_seconds = 0.0;  ///< the operators run for real, timed
  double flops = 0.0;         ///< the others' matrix products' arithmetic
  double bytes_moved = 0.0;   ///< the bytes the others read and write
  /// Operators that ran for real because this LibTorch has no meta kernel for
  /// them (their compute is not skipped), with their call counts.
  std::map<std::string, std::int64_t> without_meta;
  /// Calls that read tensor values on the host (item(), equal of two tensors) or whose output
  /// shape depends on them (nonzero, masked_select, unique): computed from
  /// uninitialised memory, so what follows them may not be the real step's.
  std::int64_t values_read = 0;
  /// The span's matrix products, in call order (predict/blas_workspace.hpp).
  std::vector<detail::matrix_product> products;
};

/// The rates shape-only execution turns an operator's arithmetic and memory
/// traffic into seconds with: measured once per process (a 256^3 float matrix
/// product and a 4 MiB copy, each the fastest of nine, at the thread count set
/// then), at the first shape_only_scope::estimated_seconds(), or before, by
/// measured_shape_only_rates().
struct shape_only_rates {
  double flops_per_second = 0.0;
  double bytes_per_second = 0.0;
  /// The tally's estimate of what its operators would take computed.
  [[nodiscard]] double seconds(const shape_only_tally& t) const {
    return t.real_seconds + t.flops / flops_per_second + t.bytes_moved / bytes_per_second;
  }
};

namespace detail {

#if TORCH_VERSION_MAJOR < 2

/// The CPU's rates (device/compute_rates.hpp), measured once per process.
inline shape_only_rates measure_rates() {
  const auto r = memscale::detail::measured_compute_rates(c10::Device(c10::kCPU));
  return {r.flops_per_second, r.bytes_per_second};
}

inline std::atomic<bool>& rates_measured() {
  static std::atomic<bool> measured{false};
  return measured;
}
inline const shape_only_rates& rates() {
  static const shape_only_rates measured = [] {
    const auto r = measure_rates();
    rates_measured() = true;
    return r;
  }();
  return measured;
}

inline std::int64_t tensor_bytes(const c10::IValue& v) {
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    return t.defined() ? static_cast<std::int64_t>(t.numel()) * static_cast<std::int64_t>(t.element_size()) : 0;
  }
  std::int64_t bytes = 0;
  if (v.isTensorList())
    for (const auto& element : v.toTensorList()) bytes += tensor_bytes(c10::IValue(static_cast<torch::Tensor>(element)));
  return bytes;
}

/// What an operator would do computed: its matrix products' arithmetic and the
/// bytes it reads and writes.
struct operator_work {
  double flops = 0.0;
  double bytes = 0.0;
  std::optional<matrix_product> product;  ///< a matrix product's shape (one matrix of a batched one)
};
inline operator_work work_of(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args,
                             std::int64_t output_bytes) {
  const auto& name = schema.name();
  const auto dims = [&](std::size_t i) -> c10::IntArrayRef {
    return i < args.size() && args[i].isTensor() && args[i].toTensor().defined() ? args[i].toTensor().sizes()
                                                                                   : c10::IntArrayRef{};
  };
  double flops = 0.0;
  std::optional<matrix_product> shape;
  const auto product = [&](c10::IntArrayRef a, c10::IntArrayRef b) {  // [.., M, K] x [.., K, N]
    if (a.size() < 2 || b.size() < 2) return;
    const auto dtype = args[0].isTensor() && args[0].toTensor().defined() ? args[0].toTensor().scalar_type()
                                                                          : c10::ScalarType::Float;
    shape = matrix_product{a[a.size() - 2], a[a.size() - 1], b[b.size() - 1], dtype};
    double batch = 1.0;
    for (std::size_t d = 0; d + 2 < a.size(); ++d) batch *= static_cast<double>(a[d]);
    flops = 2.0 * batch * static_cast<double>(a[a.size() - 2]) * static_cast<double>(a[a.size() - 1]) *
            static_cast<double>(b[b.size() - 1]);
  };
  if (name == "aten::mm" || name == "aten::bmm") product(dims(0), dims(1));
  else if (name == "aten::addmm" || name == "aten::baddbmm" || name == "aten::addbmm") product(dims(1), dims(2));

  std::int64_t bytes = output_bytes;
  for (const auto& v : args) bytes += tensor_bytes(v);
  return {flops, static_cast<double>(bytes), shape};
}

#endif  // TORCH_VERSION_MAJOR < 2

}  // namespace detail

}  // namespace memscale::predictor

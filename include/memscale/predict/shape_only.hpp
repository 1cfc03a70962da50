// memscale::predict — shape-only execution: a training step whose operators
// allocate their outputs as they would but compute nothing, so that the step's
// allocation timeline costs dispatch time, not arithmetic.
//
// LibTorch 1.13 has DispatchKey::Fake (between ADInplaceOrView and the
// backends) and registers nothing for it. A boxed fallback registered for it
// here, and turned on for a span by shape_only_scope (a thread-local
// IncludeDispatchKeyGuard, which autograd's threads inherit), handles every
// operator that reaches it:
//   - an in-place operator returns its written argument and computes nothing;
//   - views, out= and other aliasing operators, operators without a tensor
//     argument (factories), operators with integer or bool results (indices
//     stay right) and operators with no meta kernel (no shape function in this
//     LibTorch; remembered after the first failure) run for real;
//   - every other operator runs on meta tensors for its outputs' shapes and
//     strides, and real, uninitialised outputs of those are allocated on the
//     device: LibTorch's allocator sees the allocations of the real step.
// Autograd records and runs backward through the same fallback. What this
// misses: workspace a real kernel allocates inside itself and frees before it
// returns (measured: none on the example GPT, 1.2% of an MLP's step peak;
// benchmarks/studies/README.md), and values (uninitialised: a forward whose
// control flow reads them may take another path, a data-dependent shape may
// differ). The tally counts the calls that read values (values_read): a user
// of it must check that count, and what it gets (e.g. that timelines at two
// batches align), and run real steps otherwise.
//
// In census mode the first call of each operator in the scope runs for real, on
// its real shapes: the code, threads and buffers the step's kernels need are
// then made, as a real step at that batch makes them, at a fraction of its cost
// where operators repeat (a model's blocks). Outputs made shape-only are never
// written, so their pages are not resident: the process's resident peak over
// the span is not the real step's (what stays resident after it is: the code
// read in, the kernels' threads and buffers).
//
// LibTorch 2.x uses DispatchKey::Fake for its own FakeTensor mode: there
// shape_only_available() is false and shape_only_scope refuses.
//
// The tally counts what the span's operators would take computed: those run
// for real are timed, the others estimated from their matrix products'
// arithmetic and the bytes they read and write, at rates measured once per
// process (shape_only_rates). The profiler can time by that count
// (profile_clock_scope), which is how predict() profiles its plan shape-only.
//
// predict() runs its calibration steps and its plan's profile with it on CPU
// (predict.hpp's header says how); tested against real steps in
// tests/test_predict.cpp.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#include <memscale/errors.hpp>

#if TORCH_VERSION_MAJOR < 2
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#endif

namespace memscale::predictor {

/// What a shape_only_scope's span did, by operator call.
struct shape_only_tally {
  std::int64_t shape_only = 0;  ///< ran on meta, outputs allocated uninitialised
  std::int64_t skipped = 0;     ///< in-place: nothing computed
  std::int64_t real = 0;        ///< ran for real (views, factories, integer results, census)
  /// What the span's operators would take computed: measured for those run for
  /// real, estimated for the others (shape_only_rates).
  double estimated_seconds = 0.0;
  /// Operators that ran for real because this LibTorch has no meta kernel for
  /// them (their compute is not skipped), with their call counts.
  std::map<std::string, std::int64_t> without_meta;
  /// Calls that read tensor values on the host (item(), equal) or whose output
  /// shape depends on them (nonzero, masked_select, unique): computed from
  /// uninitialised memory, so what follows them may not be the real step's.
  std::int64_t values_read = 0;
};

/// The rates shape-only execution turns an operator's arithmetic and memory
/// traffic into seconds with: measured once per process (a 256^3 float matrix
/// product and an 8 MiB copy, each the fastest of three, at the thread count set
/// then).
struct shape_only_rates {
  double flops_per_second = 0.0;
  double bytes_per_second = 0.0;
};

namespace detail {

#if TORCH_VERSION_MAJOR < 2

/// The fallback's process-wide state: the operators known to have no meta
/// kernel, the active span's tally and census.
struct shape_only_state {
  std::mutex mutex;
  std::unordered_set<const c10::FunctionSchema*> without_meta;
  shape_only_tally* tally = nullptr;  // the open scope's, or null
  bool census = false;
  std::unordered_set<const c10::FunctionSchema*> seen;  // census: operators run once already
  static shape_only_state& instance() {
    static shape_only_state state;
    return state;
  }
};

inline shape_only_rates measure_rates() {
  c10::impl::ExcludeDispatchKeyGuard no_fake(c10::DispatchKey::Fake);
  torch::NoGradGuard no_grad;
  const auto fastest = [](const auto& work) {
    double best = 1e300;
    for (int i = 0; i < 3; ++i) {
      const auto start = std::chrono::steady_clock::now();
      work();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    return std::max(best, 1e-9);
  };
  constexpr std::int64_t n = 256;
  const auto a = torch::full({n, n}, 0.5f);
  const auto b = torch::full({n, n}, 0.25f);
  const double gemm = fastest([&] { (void)torch::mm(a, b); });
  const auto source = torch::full({std::int64_t{2} << 20}, 1.0f);
  auto target = torch::empty_like(source);
  const double copy = fastest([&] { target.copy_(source); });
  return {2.0 * static_cast<double>(n * n * n) / gemm, 2.0 * static_cast<double>(source.nbytes()) / copy};
}

inline const shape_only_rates& rates() {
  static const shape_only_rates measured = measure_rates();
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

/// Seconds an operator would take computed: its matrix products' arithmetic
/// plus the bytes it reads and writes, at rates().
inline double estimated_seconds(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args,
                                std::int64_t output_bytes) {
  const auto& r = rates();
  const auto& name = schema.name();
  const auto dims = [&](std::size_t i) -> c10::IntArrayRef {
    return i < args.size() && args[i].isTensor() && args[i].toTensor().defined() ? args[i].toTensor().sizes()
                                                                                   : c10::IntArrayRef{};
  };
  double flops = 0.0;
  const auto product = [&](c10::IntArrayRef a, c10::IntArrayRef b) {  // [.., M, K] x [.., K, N]
    if (a.size() < 2 || b.size() < 2) return;
    double batch = 1.0;
    for (std::size_t d = 0; d + 2 < a.size(); ++d) batch *= static_cast<double>(a[d]);
    flops = 2.0 * batch * static_cast<double>(a[a.size() - 2]) * static_cast<double>(a[a.size() - 1]) *
            static_cast<double>(b[b.size() - 1]);
  };
  if (name == "aten::mm" || name == "aten::bmm") product(dims(0), dims(1));
  else if (name == "aten::addmm" || name == "aten::baddbmm" || name == "aten::addbmm") product(dims(1), dims(2));
  std::int64_t bytes = output_bytes;
  for (const auto& v : args) bytes += tensor_bytes(v);
  return flops / r.flops_per_second + static_cast<double>(bytes) / r.bytes_per_second;
}

inline torch::Tensor meta_like(const torch::Tensor& t) {
  c10::impl::ExcludeDispatchKeyGuard no_fake(c10::DispatchKey::Fake);
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
}

/// Operators whose results (a host value, or an output's shape) depend on their
/// input's values.
inline bool reads_values(const std::string& name) {
  static const std::unordered_set<std::string> names{
      "aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal",        "aten::nonzero",
      "aten::masked_select",       "aten::_unique",    "aten::_unique2",     "aten::unique_dim",
      "aten::unique_consecutive",  "aten::argwhere",   "aten::nonzero_numpy"};
  return names.count(name) > 0;
}

inline void shape_only_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  auto& state = shape_only_state::instance();
  const auto& schema = op.schema();
  const auto n = schema.arguments().size();
  if (reads_values(schema.name())) {
    std::lock_guard<std::mutex> lock(state.mutex);
    if (state.tally != nullptr) ++state.tally->values_read;
  }
  const auto args = torch::jit::last(*stack, n);
  const auto count = [&](std::int64_t shape_only_tally::*field) {
    std::lock_guard<std::mutex> lock(state.mutex);
    if (state.tally != nullptr) ++(state.tally->*field);
  };
  const auto add_seconds = [&](double seconds) {
    std::lock_guard<std::mutex> lock(state.mutex);
    if (state.tally != nullptr) state.tally->estimated_seconds += seconds;
  };
  const auto real = [&] {
    count(&shape_only_tally::real);
    c10::impl::ExcludeDispatchKeyGuard no_fake(c10::DispatchKey::Fake);
    const auto start = std::chrono::steady_clock::now();
    op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Fake), stack);
    add_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  };

  // The device outputs go to: the first tensor argument's on another device than
  // the CPU (a CPU scalar may come with CUDA tensors), else the CPU.
  std::optional<c10::Device> device;
  for (const auto& v : args) {
    if (!v.isTensor() || !v.toTensor().defined()) continue;
    const auto& t = v.toTensor();
    if (!device || (device->is_cpu() && !t.is_cpu())) device = t.device();
  }
  if (!device) return real();  // a factory: runs as it is
  bool census_call = false;  // the operator's first call in a census: run for real
  bool known_without_meta = false;
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    census_call = state.census && state.seen.insert(&schema).second;
    known_without_meta = state.without_meta.count(&schema) > 0;
  }
  if (census_call) return real();
  bool writes = false;
  for (const auto& a : schema.arguments())
    if (a.alias_info() != nullptr && a.alias_info()->isWrite()) writes = true;
  bool aliases = false;
  for (const auto& r : schema.returns())
    if (r.alias_info() != nullptr) aliases = true;
  // In place (one result, the written argument): nothing to compute, nothing allocated.
  if (writes && schema.overload_name().find("out") == std::string::npos && schema.returns().size() == 1 &&
      schema.returns()[0].alias_info() != nullptr && schema.returns()[0].alias_info()->isWrite()) {
    for (std::size_t i = 0; i < n; ++i) {
      const auto* alias = schema.arguments()[i].alias_info();
      if (alias != nullptr && alias->isWrite() && args[i].isTensor()) {
        auto self = args[i];
        add_seconds(estimated_seconds(schema, args, tensor_bytes(self)));
        torch::jit::drop(*stack, n);
        stack->push_back(std::move(self));
        count(&shape_only_tally::skipped);
        return;
      }
    }
  }
  const auto without_meta = [&] {
    {
      std::lock_guard<std::mutex> lock(state.mutex);
      state.without_meta.insert(&schema);
      if (state.tally != nullptr) ++state.tally->without_meta[schema.name()];
    }
    real();
  };
  if (writes || aliases) return real();
  if (known_without_meta || !op.hasComputedKernelForDispatchKey(c10::DispatchKey::Meta)) return without_meta();

  // Shapes on meta.
  torch::jit::Stack meta;
  meta.reserve(n);
  for (const auto& v : args) {
    if (v.isTensor() && v.toTensor().defined()) {
      meta.emplace_back(meta_like(v.toTensor()));
    } else if (v.isTensorList()) {
      std::vector<torch::Tensor> list;
      for (const auto& element : v.toTensorList()) {
        const torch::Tensor t = element;
        list.push_back(t.defined() ? meta_like(t) : t);
      }
      meta.emplace_back(std::move(list));
    } else {
      meta.push_back(v);
    }
  }
  try {
    c10::impl::ExcludeDispatchKeyGuard no_fake(c10::DispatchKey::Fake);
    op.callBoxed(meta);
  } catch (const c10::Error&) {
    return without_meta();
  }
  for (const auto& r : meta) {
    if (!r.isTensor()) return real();  // a scalar or list result: compute it
    const auto& t = r.toTensor();
    if (t.defined() && !t.is_floating_point() && !t.is_complex()) return real();  // indices, masks
  }
  std::int64_t output_bytes = 0;
  for (const auto& r : meta) output_bytes += tensor_bytes(r);
  add_seconds(estimated_seconds(schema, args, output_bytes));
  torch::jit::drop(*stack, n);
  c10::impl::ExcludeDispatchKeyGuard no_fake(c10::DispatchKey::Fake);
  for (const auto& r : meta) {
    const auto& t = r.toTensor();
    stack->push_back(t.defined() ? at::empty_strided(t.sizes(), t.strides(), t.options().device(*device)) : t);
  }
  count(&shape_only_tally::shape_only);
}

/// Registers the fallback once per process; false where LibTorch refused it
/// (another library registered one for DispatchKey::Fake).
inline bool register_shape_only_fallback() {
  static const bool registered = [] {
    try {
      // Kept for the process's lifetime: a registration is undone when its Library is destroyed.
      static auto* library =
          new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::Fake, __FILE__, __LINE__);
      library->fallback(torch::CppFunction::makeFromBoxedFunction<&shape_only_fallback>());
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return registered;
}

#endif  // TORCH_VERSION_MAJOR < 2

}  // namespace detail

/// Whether shape-only execution is possible in this process (LibTorch 1.13,
/// and the fallback registered).
[[nodiscard]] inline bool shape_only_available() {
#if TORCH_VERSION_MAJOR < 2
  if (!detail::register_shape_only_fallback()) return false;
  (void)detail::rates();  // measured once, now, so that no span sees their allocations
  return true;
#else
  return false;
#endif
}

/// Runs what is dispatched on this thread (and autograd's, for the work it
/// starts) shape-only while open; with `census`, each operator's first call in
/// the span runs for real. One open scope at a time per process; open it only
/// where shape_only_available(). The tally is the span's.
class shape_only_scope {
 public:
  explicit shape_only_scope(bool census = false) {
#if TORCH_VERSION_MAJOR < 2
    if (!detail::register_shape_only_fallback())
      throw Error("memscale::predict(): shape-only execution is unavailable (LibTorch refused a fallback for "
                  "DispatchKey::Fake: another library registered one)");
    (void)detail::rates();  // measured once, for real, before any span
    auto& state = detail::shape_only_state::instance();
    {
      std::lock_guard<std::mutex> lock(state.mutex);
      state.tally = &tally_;
      state.census = census;
      state.seen.clear();
    }
    guard_.emplace(c10::DispatchKey::Fake);
#else
    (void)census;
    throw Error("memscale::predict(): shape-only execution needs LibTorch 1.x (DispatchKey::Fake is LibTorch 2.x's "
                "own FakeTensor key)");
#endif
  }
  shape_only_scope(const shape_only_scope&) = delete;
  shape_only_scope& operator=(const shape_only_scope&) = delete;
  ~shape_only_scope() {
#if TORCH_VERSION_MAJOR < 2
    guard_.reset();
    auto& state = detail::shape_only_state::instance();
    std::lock_guard<std::mutex> lock(state.mutex);
    state.tally = nullptr;
    state.census = false;
    state.seen.clear();
#endif
  }
  /// What the span's operators so far would have taken computed (the tally's
  /// estimated_seconds), cheaper than a copy of the tally.
  [[nodiscard]] double estimated_seconds() const {
#if TORCH_VERSION_MAJOR < 2
    std::lock_guard<std::mutex> lock(detail::shape_only_state::instance().mutex);
#endif
    return tally_.estimated_seconds;
  }
  /// The calls so far.
  [[nodiscard]] shape_only_tally tally() const {
#if TORCH_VERSION_MAJOR < 2
    std::lock_guard<std::mutex> lock(detail::shape_only_state::instance().mutex);
#endif
    return tally_;
  }

 private:
  shape_only_tally tally_;
#if TORCH_VERSION_MAJOR < 2
  std::optional<c10::impl::IncludeDispatchKeyGuard> guard_;
#endif
};

}  // namespace memscale::predictor

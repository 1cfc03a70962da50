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
// In census mode an operator's first call in the process (among census spans)
// also runs for real, on its real arguments, its results dropped and its
// allocations unreported (the span's timeline is then a shape-only step's):
// the code, threads and buffers the step's kernels need are made, as a real
// step at that batch makes them, at a fraction of its cost where operators
// repeat (a model's blocks), and once per process. Outputs made shape-only are
// never written, so their pages are not resident: the process's resident peak
// over the span is not the real step's (what stays resident after it is: the
// code read in, the kernels' threads and buffers).
//
// Shape-only outputs on the CPU come from an arena of reserved address space
// (shape_only_arena), not from malloc: no system call, no page per output.
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
#include <atomic>
#include <chrono>
#include <cstddef>
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

#include <memscale/core/memory_tracker.hpp>

#if TORCH_VERSION_MAJOR < 2
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/strides.h>
#include <torch/library.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#endif

namespace memscale::predictor {

/// What a shape_only_scope's span did, by operator call.
struct shape_only_tally {
  std::int64_t shape_only = 0;  ///< ran on meta, outputs allocated uninitialised
  std::int64_t skipped = 0;     ///< in-place: nothing computed
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
  /// Calls that read tensor values on the host (item(), equal) or whose output
  /// shape depends on them (nonzero, masked_select, unique): computed from
  /// uninitialised memory, so what follows them may not be the real step's.
  std::int64_t values_read = 0;
};

/// The rates shape-only execution turns an operator's arithmetic and memory
/// traffic into seconds with: measured once per process (a 256^3 float matrix
/// product and a 4 MiB copy, each the fastest of three, at the thread count set
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

/// Operators whose meta path throws in LibTorch 1.13 although the dispatcher
/// has a Meta entry for them (a composite kernel that reaches one without a
/// meta kernel), as measured on training models' common layers and losses.
/// Known from the start, they run for real without the attempt: each failing
/// attempt costs a c10::Error with its symbolised backtrace, about 3 ms, which
/// was a third of the first shape-only step of the example GPT.
inline constexpr const char* operators_without_meta[] = {
    "aten::embedding",          "aten::embedding_dense_backward",
    "aten::_embedding_bag",     "aten::index_select",
    "aten::native_layer_norm",  "aten::native_layer_norm_backward",
    "aten::native_group_norm",  "aten::native_group_norm_backward",
    "aten::native_batch_norm",  "aten::native_batch_norm_backward",
    "aten::convolution",        "aten::convolution_backward",
    "aten::_adaptive_avg_pool2d", "aten::_adaptive_avg_pool2d_backward",
    "aten::native_dropout",     "aten::mse_loss_backward",
    "aten::l1_loss",            "aten::smooth_l1_loss_backward",
    "aten::huber_loss_backward", "aten::binary_cross_entropy",
    "aten::binary_cross_entropy_backward", "aten::_thnn_fused_lstm_cell"};

/// The fallback's process-wide state: the operators known to have no meta
/// kernel, the active span's tally and census.
struct shape_only_state {
  std::mutex mutex;
  std::unordered_set<const c10::FunctionSchema*> without_meta;
  shape_only_tally* tally = nullptr;  // the open scope's, or null
  bool census = false;
  std::unordered_set<const c10::FunctionSchema*> censused;  // operators a census ran for real in this process
  static shape_only_state& instance() {
    static shape_only_state state;
    return state;
  }

 private:
  shape_only_state() {
    for (const char* name : operators_without_meta)
      if (const auto op = c10::Dispatcher::singleton().findSchema({name, ""})) without_meta.insert(&op->schema());
  }
};

/// Where shape-only outputs on the CPU live: address space reserved once per
/// process (an anonymous MAP_NORESERVE mapping, up to 1 TiB) and handed out by a
/// bump pointer, so that an output costs no system call and no page: glibc's
/// malloc would mmap and munmap each block above its mmap threshold (128 KiB
/// once memscale::fix_malloc_mmap_threshold() fixed it), which measured 45% of a
/// shape-only step of the example GPT. Nothing writes these blocks (in-place
/// operators are skipped), so their pages never become resident; any a real
/// operator writes are given back (MADV_DONTNEED) when the arena starts over,
/// which it does at the end of a span once no block is live, so that no block
/// ever aliases a live one. Allocations and frees are reported as LibTorch's CPU
/// allocator reports them (timelines and reporting scopes see them) and counted
/// by memscale's counting allocator where it is installed (its hard limit
/// included). Null where the address space cannot be reserved (strict
/// overcommit, an address-space limit): outputs then come from LibTorch's
/// allocator, and likewise once a span has used the whole reservation.
class shape_only_arena final : public c10::Allocator {
 public:
  static shape_only_arena* instance() {
    static shape_only_arena* arena = [] {
#if defined(__linux__) && defined(MAP_NORESERVE)
      for (std::size_t bytes = std::size_t{1} << 40; bytes >= (std::size_t{1} << 30); bytes /= 4) {
        void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (base == MAP_FAILED) continue;
#if defined(MADV_DONTDUMP)
        (void)::madvise(base, bytes, MADV_DONTDUMP);  // no terabyte of zeros in a core file
#endif
        return new shape_only_arena(static_cast<char*>(base), bytes);  // never destroyed: blocks may outlive anything
      }
#endif
      return static_cast<shape_only_arena*>(nullptr);
    }();
    return arena;
  }

  /// A block of `bytes`, or an empty DataPtr when the reservation is used up.
  c10::DataPtr allocate(std::size_t bytes) const override {
    const c10::Device cpu(c10::kCPU);
    if (bytes == 0) return c10::DataPtr(nullptr, nullptr, &release, cpu);
    const auto size = static_cast<std::int64_t>(bytes);
    const auto tracked = memory_tracker::installed();
    auto& counting = memscale::detail::counting_cpu_allocator::instance();
    if (tracked) memscale::detail::counting_cpu_allocator::check_limit(size);
    constexpr std::size_t alignment = 64;  // LibTorch's CPU alignment
    const auto rounded = (bytes + alignment - 1) / alignment * alignment;
    char* data = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (capacity_ - next_ < rounded) return {};
      data = base_ + next_;
      next_ += rounded;
      ++live_blocks_;
    }
    if (tracked) counting.counter().add(size);
    report(data, size, tracked);
    return c10::DataPtr(data, new block{data, size, tracked}, &release, cpu);
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  /// At the end of a span: when no block is live, gives back any page a real
  /// operator wrote and starts over from the reservation's beginning.
  void start_over_if_idle() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (live_blocks_ != 0 || next_ == 0) return;
#if defined(__linux__)
    (void)::madvise(base_, next_, MADV_DONTNEED);
#endif
    next_ = 0;
  }

 private:
  struct block {
    char* data;
    std::int64_t bytes;
    bool tracked;
  };
  shape_only_arena(char* base, std::size_t capacity) : base_(base), capacity_(capacity) {}

  static void report(void* data, std::int64_t delta, bool tracked) {
    if (!c10::memoryProfilingEnabled()) return;
    const auto live = tracked ? memscale::detail::counting_cpu_allocator::instance().counter().current() : 0;
    c10::reportMemoryUsageToProfiler(data, delta, live, live, c10::Device(c10::kCPU));
  }
  static void release(void* context) {
    const auto* b = static_cast<const block*>(context);
    if (b->tracked) memscale::detail::counting_cpu_allocator::instance().counter().add(-b->bytes);
    report(b->data, -b->bytes, b->tracked);
    {
      auto* arena = instance();
      std::lock_guard<std::mutex> lock(arena->mutex_);
      --arena->live_blocks_;
    }
    delete b;
  }

  char* const base_;
  const std::size_t capacity_;
  mutable std::mutex mutex_;
  mutable std::size_t next_ = 0;
  mutable std::int64_t live_blocks_ = 0;
};

/// An uninitialised tensor of these sizes, strides and type on `device`: from
/// the arena on the CPU where it has room, else from the device's allocator.
inline torch::Tensor shape_only_empty(c10::IntArrayRef sizes, c10::IntArrayRef strides, caffe2::TypeMeta dtype,
                                      c10::Device device) {
  c10::impl::ExcludeDispatchKeyGuard no_fake(c10::DispatchKey::Fake);
  if (device.is_cpu()) {
    if (auto* arena = shape_only_arena::instance()) {
      const auto bytes = at::detail::computeStorageNbytes(sizes, strides, dtype.itemsize());
      auto data = arena->allocate(bytes);
      if (data || bytes == 0) {
        c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(data), arena, /*resizable=*/true);
        auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                          dtype);
        t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides);
        return t;
      }
    }
  }
  return at::empty_strided(sizes, strides, torch::TensorOptions().dtype(dtype).device(device));
}
inline torch::Tensor shape_only_empty(const torch::Tensor& meta, c10::Device device) {
  return shape_only_empty(meta.sizes(), meta.strides(), meta.dtype(), device);
}

/// An output a shape rule makes: its sizes, strides and type (undefined: the
/// operator returns no tensor there).
struct output_spec {
  bool defined = false;
  std::vector<std::int64_t> sizes;
  std::vector<std::int64_t> strides;
  caffe2::TypeMeta dtype;
};

inline output_spec contiguous_spec(std::vector<std::int64_t> sizes, caffe2::TypeMeta dtype) {
  const auto strides = c10::contiguous_strides(sizes);
  return {true, std::move(sizes), {strides.begin(), strides.end()}, dtype};
}

/// The arguments a rule reads, checked: the i-th argument as a defined CPU
/// float or double tensor in the default contiguous layout (what the rules
/// cover: the kernels then copy nothing and make contiguous outputs), an
/// optional one, integers, flags.
struct rule_args {
  c10::ArrayRef<c10::IValue> args;
  bool ok = true;

  const torch::Tensor* dense(std::size_t i) {
    if (i >= args.size() || !args[i].isTensor()) return fail();
    const auto& t = args[i].toTensor();
    if (!t.defined() || !t.device().is_cpu() || t.layout() != c10::kStrided || !t.is_contiguous() ||
        (t.scalar_type() != c10::kFloat && t.scalar_type() != c10::kDouble))
      return fail();
    return &t;
  }
  /// Absent (None or undefined): nullptr and still ok.
  const torch::Tensor* optional(std::size_t i) {
    if (i >= args.size()) return fail();
    if (args[i].isNone() || (args[i].isTensor() && !args[i].toTensor().defined())) return nullptr;
    return dense(i);
  }
  const torch::Tensor* indices(std::size_t i) {
    if (i >= args.size() || !args[i].isTensor()) return fail();
    const auto& t = args[i].toTensor();
    if (!t.defined() || !t.device().is_cpu() || !t.is_contiguous() ||
        (t.scalar_type() != c10::kLong && t.scalar_type() != c10::kInt))
      return fail();
    return &t;
  }
  std::vector<std::int64_t> ints(std::size_t i) {
    if (i < args.size() && args[i].isIntList()) return args[i].toIntVector();
    ok = false;
    return {};
  }
  std::int64_t integer(std::size_t i) {
    if (i < args.size() && args[i].isInt()) return args[i].toInt();
    ok = false;
    return 0;
  }
  bool flag(std::size_t i) {
    if (i < args.size() && args[i].isBool()) return args[i].toBool();
    ok = false;
    return false;
  }
  std::vector<bool> mask(std::size_t i) {
    if (i < args.size() && args[i].isBoolList()) {
      std::vector<bool> m;
      for (const bool b : args[i].toBoolList()) m.push_back(b);
      return m;
    }
    ok = false;
    return {};
  }

 private:
  const torch::Tensor* fail() {
    ok = false;
    return nullptr;
  }
};

/// Output shapes for operators LibTorch 1.13 has no meta kernel for, made as
/// their CPU kernels make them (the same outputs, contiguous): layer norm,
/// embedding and batch norm, forward and backward. nullopt where a rule does
/// not cover the call (another type or layout): the operator then runs for
/// real. Batch norm's update of the running statistics, like every value, is
/// skipped. Convolution has none: its CPU kernels allocate temporaries of the
/// output's size beside it (measured on a ResNet-style CNN: a shape-only step
/// with a rule for it peaked two activations short of the real step), which a
/// rule would miss. Checked against the real kernels and steps in
/// tests/test_predict.cpp.
inline std::optional<std::vector<output_spec>> rule_outputs(const c10::FunctionSchema& schema,
                                                           c10::ArrayRef<c10::IValue> args) {
  const auto& name = schema.name();
  if (!schema.overload_name().empty()) return std::nullopt;
  rule_args a{args};
  std::vector<output_spec> out;
  const auto absent = output_spec{};
  if (name == "aten::native_layer_norm") {
    // (input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd)
    const auto* input = a.dense(0);
    const auto normalized = a.ints(1);
    (void)a.optional(2);
    (void)a.optional(3);
    if (!a.ok || normalized.size() > static_cast<std::size_t>(input->dim())) return std::nullopt;
    const auto axis = static_cast<std::size_t>(input->dim()) - normalized.size();
    std::vector<std::int64_t> stat(input->sizes().begin(), input->sizes().begin() + static_cast<std::ptrdiff_t>(axis));
    stat.resize(static_cast<std::size_t>(input->dim()), 1);
    out = {contiguous_spec(input->sizes().vec(), input->dtype()), contiguous_spec(stat, input->dtype()),
           contiguous_spec(stat, input->dtype())};
  } else if (name == "aten::native_layer_norm_backward") {
    // (grad_out, input, normalized_shape, mean, rstd, weight?, bias?, output_mask) -> (dX, dgamma, dbeta)
    (void)a.dense(0);
    const auto* input = a.dense(1);
    (void)a.ints(2);
    const auto* weight = a.optional(5);
    const auto* bias = a.optional(6);
    const auto mask = a.mask(7);
    if (!a.ok || mask.size() != 3 || (mask[1] && weight == nullptr) || (mask[2] && bias == nullptr)) return std::nullopt;
    out = {mask[0] ? contiguous_spec(input->sizes().vec(), input->dtype()) : absent,
           mask[1] ? contiguous_spec(weight->sizes().vec(), weight->dtype()) : absent,
           mask[2] ? contiguous_spec(bias->sizes().vec(), bias->dtype()) : absent};
  } else if (name == "aten::embedding") {
    // (weight, indices, padding_idx, scale_grad_by_freq, sparse) -> out
    const auto* weight = a.dense(0);
    const auto* indices = a.indices(1);
    if (!a.ok || weight->dim() != 2) return std::nullopt;
    auto sizes = indices->sizes().vec();
    sizes.push_back(weight->size(1));
    out = {contiguous_spec(sizes, weight->dtype())};
  } else if (name == "aten::embedding_dense_backward") {
    // (grad_output, indices, num_weights, padding_idx, scale_grad_by_freq) -> grad_weight
    const auto* grad = a.dense(0);
    (void)a.indices(1);
    const auto rows = a.integer(2);
    if (!a.ok || grad->dim() < 1) return std::nullopt;
    out = {contiguous_spec({rows, grad->size(-1)}, grad->dtype())};
  } else if (name == "aten::native_batch_norm") {
    // (input, weight?, bias?, running_mean?, running_var?, training, momentum, eps) -> (out, save_mean, save_invstd)
    const auto* input = a.dense(0);
    for (std::size_t i = 1; i <= 4; ++i) {
      const auto* p = a.optional(i);
      if (p != nullptr && p->scalar_type() != input->scalar_type()) return std::nullopt;  // mixed types
    }
    const bool training = a.flag(5);
    if (!a.ok || input->dim() < 2) return std::nullopt;
    const std::vector<std::int64_t> stats{training ? input->size(1) : 0};
    out = {contiguous_spec(input->sizes().vec(), input->dtype()), contiguous_spec(stats, input->dtype()),
           contiguous_spec(stats, input->dtype())};
  } else if (name == "aten::native_batch_norm_backward") {
    // (grad_out, input, weight?, running_mean?, running_var?, save_mean?, save_invstd?, train, eps, output_mask)
    (void)a.dense(0);
    const auto* input = a.dense(1);
    for (std::size_t i = 2; i <= 6; ++i) {
      const auto* p = a.optional(i);
      if (p != nullptr && p->scalar_type() != input->scalar_type()) return std::nullopt;
    }
    const auto mask = a.mask(9);
    if (!a.ok || mask.size() != 3 || input->dim() < 2) return std::nullopt;
    const std::vector<std::int64_t> channels{input->size(1)};
    out = {mask[0] ? contiguous_spec(input->sizes().vec(), input->dtype()) : absent,
           mask[1] ? contiguous_spec(channels, input->dtype()) : absent,
           mask[2] ? contiguous_spec(channels, input->dtype()) : absent};
  } else {
    return std::nullopt;
  }
  return out;
}

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
  // 4 MiB each way, past a core's L2 on usual CPUs. The 8 MiB copy used before
  // cost 9 ms in a fresh process (page faults), a fifth of predict's time on the
  // example GPT; on the 2-core build machine it read 30 GB/s against 69 here,
  // both within its 32 MiB L3: a rate to weigh arithmetic against traffic, not
  // a bandwidth.
  const auto source = torch::full({std::int64_t{1} << 20}, 1.0f);
  auto target = torch::empty_like(source);
  const double copy = fastest([&] { target.copy_(source); });
  return {2.0 * static_cast<double>(n * n * n) / gemm, 2.0 * static_cast<double>(source.nbytes()) / copy};
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
};
inline operator_work work_of(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args,
                             std::int64_t output_bytes) {
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
  return {flops, static_cast<double>(bytes)};
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

/// A memory reporter that asks for no reports: what census_run() puts in the
/// thread's PROFILER_STATE slot.
class unreported final : public c10::MemoryReportingInfoBase {
 public:
  void reportMemoryUsage(void*, std::int64_t, memscale::detail::report_total_t, memscale::detail::report_total_t,
                         c10::Device) override {}
  void reportOutOfMemory(std::int64_t, memscale::detail::oom_total_t, memscale::detail::oom_total_t,
                         c10::Device) override {}
  [[nodiscard]] bool memoryProfilingEnabled() const override { return false; }
};

/// A census's real call of an operator that otherwise runs shape-only: it runs
/// for real on the arguments (its code, threads and buffers are made as a real
/// step makes them) with its results dropped and its allocations unreported
/// (where no LibTorch profiler holds the reporting slot), so that the span's
/// timeline holds the events a shape-only step's holds and aligns with it.
inline void census_run(const c10::OperatorHandle& op, c10::DispatchKeySet keys, c10::ArrayRef<c10::IValue> args) {
  static const auto silent = std::make_shared<unreported>();
  std::optional<c10::DebugInfoGuard> unseen;
  if (memscale::detail::inspect_profiler_slot().refusal.empty())
    unseen.emplace(c10::DebugInfoKind::PROFILER_STATE, silent);
  c10::impl::ExcludeDispatchKeyGuard no_fake(c10::DispatchKey::Fake);
  torch::jit::Stack copy(args.begin(), args.end());
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Fake), &copy);
  copy.clear();  // the results freed unseen
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
  const auto add_work = [&](operator_work work) {
    std::lock_guard<std::mutex> lock(state.mutex);
    if (state.tally == nullptr) return;
    state.tally->flops += work.flops;
    state.tally->bytes_moved += work.bytes;
  };
  const auto real = [&] {
    count(&shape_only_tally::real);
    c10::impl::ExcludeDispatchKeyGuard no_fake(c10::DispatchKey::Fake);
    const auto start = std::chrono::steady_clock::now();
    op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Fake), stack);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::lock_guard<std::mutex> lock(state.mutex);
    if (state.tally != nullptr) state.tally->real_seconds += seconds;
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
  bool census_call = false;  // the operator's first call in a census: also run for real, unseen
  bool known_without_meta = false;
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    census_call = state.census && state.censused.insert(&schema).second;
    if (census_call && state.tally != nullptr) ++state.tally->census;
    known_without_meta = state.without_meta.count(&schema) > 0;
  }
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
        if (census_call) census_run(op, keys, args);
        add_work(work_of(schema, args, tensor_bytes(self)));
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
  // Operators without a meta kernel that a shape rule covers.
  if (auto specs = rule_outputs(schema, args)) {
    if (census_call) census_run(op, keys, args);
    std::vector<torch::Tensor> outputs;
    std::int64_t output_bytes = 0;
    for (const auto& spec : *specs) {
      outputs.push_back(spec.defined ? shape_only_empty(spec.sizes, spec.strides, spec.dtype, *device)
                                     : torch::Tensor());
      output_bytes += tensor_bytes(outputs.back());
    }
    add_work(work_of(schema, args, output_bytes));
    torch::jit::drop(*stack, n);
    for (auto& t : outputs) stack->push_back(std::move(t));
    count(&shape_only_tally::shape_only);
    return;
  }
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
  if (census_call) census_run(op, keys, args);
  std::int64_t output_bytes = 0;
  for (const auto& r : meta) output_bytes += tensor_bytes(r);
  add_work(work_of(schema, args, output_bytes));
  torch::jit::drop(*stack, n);
  c10::impl::ExcludeDispatchKeyGuard no_fake(c10::DispatchKey::Fake);
  for (const auto& r : meta) {
    const auto& t = r.toTensor();
    stack->push_back(t.defined() ? shape_only_empty(t, *device) : t);
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
  return detail::register_shape_only_fallback();
#else
  return false;
#endif
}

/// The rates shape-only execution estimates times with, measured now if they
/// were not yet (a few milliseconds of real work whose allocations a watching
/// scope would see: call it before opening a span whose allocations are watched).
/// Zero where shape-only execution is unavailable.
[[nodiscard]] inline shape_only_rates measured_shape_only_rates() {
#if TORCH_VERSION_MAJOR < 2
  return detail::register_shape_only_fallback() ? detail::rates() : shape_only_rates{};
#else
  return {};
#endif
}

/// Runs what is dispatched on this thread (and autograd's, for the work it
/// starts) shape-only while open; with `census`, an operator's first call in
/// the process among census spans also runs for real, unseen (see the header).
/// One open scope at a time per process; open it only where
/// shape_only_available(). The tally is the span's.
class shape_only_scope {
 public:
  explicit shape_only_scope(bool census = false) {
#if TORCH_VERSION_MAJOR < 2
    if (!detail::register_shape_only_fallback())
      throw Error("memscale::predict(): shape-only execution is unavailable (LibTorch refused a fallback for "
                  "DispatchKey::Fake: another library registered one)");
    auto& state = detail::shape_only_state::instance();
    {
      std::lock_guard<std::mutex> lock(state.mutex);
      state.tally = &tally_;
      state.census = census;
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
    {
      std::lock_guard<std::mutex> lock(state.mutex);
      state.tally = nullptr;
      state.census = false;
    }
    if (auto* arena = detail::shape_only_arena::instance()) arena->start_over_if_idle();
#endif
  }
  /// What the span's operators so far would have taken computed (the tally's
  /// estimated_seconds), cheaper than a copy of the tally. The first call in a
  /// process measures the rates (measured_shape_only_rates()): where the span's
  /// allocations are watched, measure them before opening it.
  [[nodiscard]] double estimated_seconds() const {
#if TORCH_VERSION_MAJOR < 2
    const auto& rates = detail::rates();
    std::lock_guard<std::mutex> lock(detail::shape_only_state::instance().mutex);
    return rates.seconds(tally_);
#else
    return 0.0;
#endif
  }
  /// The calls so far, with estimated_seconds filled as by estimated_seconds()
  /// where the rates were measured already (0 otherwise: a copy of the tally
  /// never runs their measuring work inside a span someone watches).
  [[nodiscard]] shape_only_tally tally() const {
#if TORCH_VERSION_MAJOR < 2
    const bool estimate = detail::rates_measured();
    const auto rates = estimate ? detail::rates() : shape_only_rates{};
    std::lock_guard<std::mutex> lock(detail::shape_only_state::instance().mutex);
    auto copy = tally_;
    copy.estimated_seconds = estimate ? rates.seconds(copy) : 0.0;
    return copy;
#else
    return tally_;
#endif
  }
  /// Calls that read tensor values so far (the tally's values_read), without the
  /// copy or the rates.
  [[nodiscard]] std::int64_t values_read() const {
#if TORCH_VERSION_MAJOR < 2
    std::lock_guard<std::mutex> lock(detail::shape_only_state::instance().mutex);
#endif
    return tally_.values_read;
  }

 private:
  shape_only_tally tally_;
#if TORCH_VERSION_MAJOR < 2
  std::optional<c10::impl::IncludeDispatchKeyGuard> guard_;
#endif
};

}  // namespace memscale::predictor

// memscale — the shape-only dispatcher fallback: what every operator does in a
// shape-only span (shape_only_fallback), its process-wide state and its
// registration. Outputs come from predict/shape_only_arena.hpp or a shape rule
// (predict/shape_only_rules.hpp); predict/shape_only_scope.hpp turns it on.
//
// LibTorch 1.13 has DispatchKey::Fake (between ADInplaceOrView and the
// backends) and registers nothing for it. A boxed fallback registered for it
// here, and turned on for a span by shape_only_scope (a thread-local
// IncludeDispatchKeyGuard, which autograd's threads inherit), handles every
// operator that reaches it:
//   - an in-place operator returns its written argument and computes nothing
//     (one that changes the argument's sizes or strides runs for real);
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
// never written, so their pages are not resident (shape_only_arena.hpp says
// where a read holds them): the process's resident peak
// over the span is not the real step's (what stays resident after it is: the
// code read in, the kernels' threads and buffers).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#include <memscale/device/memory_tracker.hpp>
#include <memscale/device/scratch_pages.hpp>
#include <memscale/predict/shape_only_arena.hpp>
#include <memscale/predict/shape_only_rules.hpp>
#include <memscale/predict/shape_only_tally.hpp>

#if TORCH_VERSION_MAJOR < 2
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#endif

namespace memscale::predictor::detail {

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
  /// What a census's real calls read in place of shape-only arguments (census_run), kept while the census
  /// span is open: the scope drops it when the span closes, before anyone reads the resident size. Under
  /// its own mutex, held through a real call (which never reaches the fallback: the Fake key is excluded).
  std::mutex census_mutex;
  std::unique_ptr<memscale::detail::scratch_pages> census_scratch;
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

/// Whether `a` and `b` are one tensor: the same TensorImpl, or views of one
/// storage at the same offset with the same sizes, strides, dtype and
/// negation/conjugation flags (each element compared with itself).
inline bool same_tensor(const c10::IValue& a, const c10::IValue& b) {
  if (!a.isTensor() || !b.isTensor()) return false;
  const auto& x = a.toTensor();
  const auto& y = b.toTensor();
  if (!x.defined() || !y.defined()) return false;
  if (x.unsafeGetTensorImpl() == y.unsafeGetTensorImpl()) return true;
  return x.has_storage() && y.has_storage() && x.storage().is_alias_of(y.storage()) &&
         x.storage_offset() == y.storage_offset() && x.sizes() == y.sizes() && x.strides() == y.strides() &&
         x.dtype() == y.dtype() && x.device() == y.device() && x.layout() == y.layout() && x.is_neg() == y.is_neg() &&
         x.is_conj() == y.is_conj();
}

/// In-place operators that change their argument's sizes, strides or storage
/// rather than its values: what a shape-only step must run for real.
inline bool changes_metadata(const c10::OperatorHandle& op) {
  static const std::unordered_set<std::string> names{"aten::resize_", "aten::resize_as_", "aten::set_"};
  return op.hasTag(at::Tag::inplace_view) || names.count(op.schema().name()) > 0;
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
///
/// A shape-only argument (an output of the arena, never written) is read from
/// zeros of the same sizes and strides in the census's scratch_pages instead,
/// in 2 MiB pages where the kernel gives them: where reading a fresh page
/// makes it resident (zero_page_reads_are_free() false: a 6.18 kernel in a VM,
/// 11 µs a page), the arena's pages cost a fault each at every census call,
/// most of the census step on the example GPT. The values were uninitialised
/// anyway; nothing the call returns is kept, so nothing aliases the scratch
/// after it. The results stay the kernel's own (allocated, written, freed).
inline void census_run(const c10::OperatorHandle& op, c10::DispatchKeySet keys, c10::ArrayRef<c10::IValue> args) {
  static const auto silent = std::make_shared<unreported>();
  std::optional<c10::DebugInfoGuard> unseen;
  if (memscale::detail::inspect_profiler_slot().refusal.empty())
    unseen.emplace(c10::DebugInfoKind::PROFILER_STATE, silent);
  c10::impl::ExcludeDispatchKeyGuard no_fake(c10::DispatchKey::Fake);
  auto* arena = shape_only_arena::instance();
  const auto shape_only = [arena](const c10::IValue& v) {
    if (!v.isTensor() || arena == nullptr) return false;
    const auto& t = v.toTensor();
    return t.defined() && t.has_storage() && t.storage().allocator() == arena && t.nbytes() > 0;
  };
  const auto span = [](const torch::Tensor& t) {  // the bytes its sizes and strides reach from its first element
    return static_cast<std::size_t>(at::detail::computeStorageNbytes(t.sizes(), t.strides(), t.itemsize()));
  };
  constexpr auto alignment = shape_only_arena::alignment;  // each argument's copy aligned as the arena's blocks
  std::size_t needed = 0;
  for (const auto& v : args)
    if (shape_only(v)) needed += (span(v.toTensor()) + alignment - 1) / alignment * alignment;
  torch::jit::Stack copy(args.begin(), args.end());
  auto& state = shape_only_state::instance();
  std::unique_lock<std::mutex> lock(state.census_mutex, std::defer_lock);
  if (needed > 0) {
    lock.lock();  // one census call at a time on the scratch
    auto& scratch = state.census_scratch;
    try {
      if (!scratch || scratch->size() < needed)
        scratch = std::make_unique<memscale::detail::scratch_pages>(std::max(needed, std::size_t{8} << 20));
      auto* next = static_cast<char*>(scratch->data());
      for (auto& v : copy) {
        if (!shape_only(v)) continue;
        const auto& t = v.toTensor();
        const auto bytes = span(t);
        std::memset(next, 0, bytes);  // zeros again where an earlier call wrote
        v = torch::from_blob(next, t.sizes(), t.strides(), t.options());
        next += (bytes + alignment - 1) / alignment * alignment;
      }
    } catch (const std::bad_alloc&) {  // no scratch: the arena's own pages, as before
      copy.assign(args.begin(), args.end());
      lock.unlock();
    }
  }
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Fake), &copy);
  copy.clear();  // the results freed unseen
}

inline void shape_only_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  auto& state = shape_only_state::instance();
  const auto& schema = op.schema();
  const auto n = schema.arguments().size();
  // equal(x, x) is true without reading x's values, but for a NaN in x (a
  // floating x compares unequal to itself there): taken as true, on the ground
  // that a step whose tensors hold a NaN has no finite loss to train on.
  // nn::MultiheadAttention asks equal(query, key) and equal(key, value) to
  // choose its self-attention path; a shape-only step, whose values are
  // uninitialised, would otherwise read them and take either path.
  if (schema.name() == "aten::equal" && n == 2 && same_tensor((*stack)[stack->size() - 2], stack->back())) {
    torch::jit::drop(*stack, n);
    stack->emplace_back(true);
    std::lock_guard<std::mutex> lock(state.mutex);
    if (state.tally != nullptr) ++state.tally->skipped;
    return;
  }
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
    if (work.product) state.tally->products.push_back(*work.product);
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
  // In place (one result, the written argument): nothing to compute, nothing allocated. Not
  // those that change the argument's sizes or strides (transpose_, unsqueeze_, as_strided_: tagged
  // inplace_view; resize_, set_), which run for real below: they compute nothing either, and a
  // resize_ that grows a shape-only tensor allocates from its storage's allocator, the arena.
  if (writes && !changes_metadata(op) && schema.overload_name().find("out") == std::string::npos &&
      schema.returns().size() == 1 &&
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

}  // namespace memscale::predictor::detail

// memscale::detail — selective recompute: a checkpoint's forward keeps the
// outputs of its matrix products (a Linear's addmm, a plain mm), and its
// recompute takes them back instead of multiplying again, so only the rest
// (norms, activations, attention's softmax, dropout) is recomputed. Megatron's
// selective activation recompute, and PyTorch's selective checkpoint policies,
// do the same by hand or in Python; here it is a plan's choice
// (Config::selective_recompute). Internal; not part of the public surface.
//
// How: kernels for aten::addmm and aten::mm on DispatchKey::ADInplaceOrView,
// the key just below autograd that every ordinary tensor carries and that
// LibTorch (1.13 and 2.x) registers only in-place and view operators for. So in
// a recompute autograd records the product's node as usual (it saves the
// operands it needs, recomputed) and only the multiplication below it is
// skipped. Outside a product_span the kernels hand straight on. Batched
// products (attention's bmm) are recomputed: their outputs are the score-sized
// tensors selective recompute exists to free.
//
// A kept output is served only where the recompute's n-th product matches the
// forward's n-th (the operation, its operands' sizes and type, addmm's
// scalars), the output was not written in place since (its version), and it is
// not what the checkpoint returned (dropped when the forward ends); a mismatch
// multiplies for real for the rest of that recompute. Spans nest as
// draw_replay.hpp's do (the same frames): the innermost replay serves, every
// recording span records, up to the innermost isolating span. Registration is
// made at the first span; should LibTorch or another library have registered
// for these operators on that key, nothing is registered and products are
// recomputed (product_replay_available() is false).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_unsafe_view_ops.h>
#include <ATen/ops/addmm_ops.h>
#include <ATen/ops/mm_ops.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <memscale/detail/draw_replay.hpp>
#include <memscale/detail/output_frames.hpp>

namespace memscale::detail {

enum class product_op : std::uint8_t { addmm, mm };

/// Products served from a log in this process so far (tests read it).
inline std::atomic<std::int64_t>& served_product_count() {
  static std::atomic<std::int64_t> count{0};
  return count;
}

/// The operands' layout, one after the other: rank, sizes, strides, storage
/// offset, device type and index.
inline std::vector<std::int64_t> operand_layout(std::initializer_list<const at::Tensor*> operands) {
  std::vector<std::int64_t> layout;
  for (const auto* t : operands) {
    layout.push_back(t->dim());
    layout.insert(layout.end(), t->sizes().begin(), t->sizes().end());
    if (t->layout() == c10::kStrided) {
      layout.insert(layout.end(), t->strides().begin(), t->strides().end());
      layout.push_back(t->storage_offset());
    }
    layout.push_back(static_cast<std::int64_t>(t->device().type()));
    layout.push_back(t->device().index());
  }
  return layout;
}

inline std::vector<weak_storage> operand_storages(std::initializer_list<const at::Tensor*> operands) {
  std::vector<weak_storage> storages;
  for (const auto* t : operands) storages.push_back(weak_storage_of(*t));
  return storages;
}

/// Whether the recompute's product is the forward's: the same layout of its
/// operands, and each operand whose forward storage is still alive (a
/// parameter, the checkpoint's input, a product served before) on that storage.
inline bool same_operands(const kept_product& p, std::initializer_list<const at::Tensor*> operands) {
  if (p.layout != operand_layout(operands) || p.storages.size() != operands.size()) return false;
  std::size_t k = 0;
  for (const auto* t : operands) {
    const auto& then = p.storages[k++];
    if (!then.expired() && !on_storage(*t, then)) return false;
  }
  return true;
}

/// Whether nothing but the log holds a kept output (no view of it, no other
/// handle): serving it gives autograd a tensor no one else sees.
inline bool held_only_by_log(const at::Tensor& t) {
  return t.use_count() == 1 && (!t.has_storage() || t.storage().use_count() == 1);
}

/// Runs one product inside whatever product frames are open: serves it from
/// the innermost replay, or computes it (timed where a frame measures), and
/// records it in every recording frame.
template <class Compute>
at::Tensor product_through_frames(product_op op, std::initializer_list<const at::Tensor*> operands, double beta,
                                  double alpha, Compute&& compute) {
  const auto frames = visible_frames(/*products=*/true);
  if (frames.empty()) return compute();
  const auto dtype = (*operands.begin())->scalar_type();
  draw_frame* replay = nullptr;
  for (auto it = frames.rbegin(); it != frames.rend(); ++it)
    if ((*it)->mode == draw_mode::replay) {
      replay = *it;
      break;
    }
  at::Tensor out;
  if (replay != nullptr && !replay->diverged) {
    auto& products = replay->log->products;
    kept_product* p = replay->next < products.size() ? &products[replay->next] : nullptr;
    if (p == nullptr || p->op != static_cast<std::uint8_t>(op) || p->dtype != dtype || p->beta != beta ||
        p->alpha != alpha || !same_operands(*p, operands)) {
      replay->diverged = true;
    } else {
      ++replay->next;
      // Written in place since, handed to autograd elsewhere, or still seen by
      // someone else: multiplied again.
      if (p->output.defined() && p->output._version() == p->version && !p->output.requires_grad() &&
          held_only_by_log(p->output)) {
        out = std::move(p->output);
        p->output = at::Tensor();
        served_product_count().fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
  bool measuring = false, recording = false;
  for (const auto* f : frames) {
    measuring = measuring || f->mode == draw_mode::measure;
    recording = recording || f->mode == draw_mode::record;
  }
  double seconds = 0.0;
  if (!out.defined()) {
    const bool timed = measuring && !computing_nothing();
    const auto device = (*operands.begin())->device();
    if (timed && device.is_cuda()) torch::cuda::synchronize(device.index());  // the product alone
    const auto start = std::chrono::steady_clock::now();
    out = compute();
    if (timed && device.is_cuda()) torch::cuda::synchronize(device.index());
    if (timed) seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  if (!recording && !measuring) return out;
  const bool keepable = out.defined() && out.layout() == c10::kStrided && out.has_storage() && !out.requires_grad();
  if (measuring && keepable) {
    const measured_product m{weak_storage_of(out), static_cast<std::int64_t>(out.storage().nbytes()), seconds};
    for (auto* f : frames)
      if (f->mode == draw_mode::measure) f->log->measured_products.push_back(m);
  }
  if (recording) {
    kept_product p;
    if (keepable) {
      p.output = out;
      p.version = static_cast<std::int64_t>(out._version());
      p.source = weak_storage_of(out);
    }
    p.op = static_cast<std::uint8_t>(op);
    p.dtype = dtype;
    p.layout = operand_layout(operands);
    p.storages = operand_storages(operands);
    p.beta = beta;
    p.alpha = alpha;
    for (auto* f : frames)
      if (f->mode == draw_mode::record) f->log->products.push_back(p);
  }
  return out;
}

inline at::Tensor addmm_kernel(c10::DispatchKeySet keys, const at::Tensor& self, const at::Tensor& mat1,
                               const at::Tensor& mat2, const at::Scalar& beta, const at::Scalar& alpha) {
  const auto below = keys & c10::after_ADInplaceOrView_keyset;
  const auto compute = [&] { return at::_ops::addmm::redispatch(below, self, mat1, mat2, beta, alpha); };
  if (draw_frames().empty()) return compute();
  return product_through_frames(product_op::addmm, {&self, &mat1, &mat2}, beta.toDouble(), alpha.toDouble(),
                                compute);
}

inline at::Tensor mm_kernel(c10::DispatchKeySet keys, const at::Tensor& self, const at::Tensor& mat2) {
  const auto below = keys & c10::after_ADInplaceOrView_keyset;
  const auto compute = [&] { return at::_ops::mm::redispatch(below, self, mat2); };
  if (draw_frames().empty()) return compute();
  return product_through_frames(product_op::mm, {&self, &mat2}, 1.0, 1.0, compute);
}

/// _unsafe_view (matmul wraps its mm's output in one, and a Linear on a 3D
/// input in LibTorch 1.13 then adds its bias into that in place) makes a tensor
/// on the same storage with a version counter of its own, so a write through
/// it would not show in the kept product's version (nor in an output's that
/// output_recipes.hpp would compute again: the open output frame hears of it). Where a forward records
/// the product, the log keeps a copy of it instead, made now, before any such
/// write (or forgets it, if it was written already); where a forward measures
/// it, the product is marked, and measure_slot times such a copy apart (outside
/// the bytes it measures).
inline at::Tensor unsafe_view_kernel(c10::DispatchKeySet keys, const at::Tensor& self, c10::SymIntArrayRef size) {
  auto out = at::_ops::_unsafe_view::redispatch(keys & c10::after_ADInplaceOrView_keyset, self, size);
  if (!output_frames().empty()) output_frames().back()->aliased(self);
  if (draw_frames().empty() || !self.has_storage() || self.is_inference()) return out;
  if (self.storage().data() == nullptr) return out;  // nothing allocated: nothing to tell apart
  for (auto* f : visible_frames(/*products=*/true)) {
    if (f->mode == draw_mode::record) {
      for (auto& p : f->log->products) {
        if (!p.output.defined() || !self.is_alias_of(p.output)) continue;
        if (p.output._version() != p.version) {
          p.output = at::Tensor();  // written already: the copy would hold the write
          continue;
        }
        p.output = p.output.clone();
        p.version = static_cast<std::int64_t>(p.output._version());
      }
    } else if (f->mode == draw_mode::measure) {
      for (auto& m : f->log->measured_products)
        if (on_storage(self, m.storage)) m.copied = true;
    }
  }
  return out;
}

/// Registers the kernels once per process; false where the key already has
/// kernels for these operators (then nothing is registered).
inline bool product_replay_available() {
  static const bool registered = [] {
    try {
      auto& dispatcher = c10::Dispatcher::singleton();
      for (const char* name : {"aten::addmm", "aten::mm", "aten::_unsafe_view"})
        if (dispatcher.findSchemaOrThrow(name, "").hasKernelForDispatchKey(c10::DispatchKey::ADInplaceOrView))
          return false;
      // Kept for the process's lifetime: a registration is undone when its Library is destroyed.
      static auto* products =
          new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::ADInplaceOrView, __FILE__, __LINE__);
      // Lambdas, not TORCH_FN: GCC under AddressSanitizer cannot fold an inline
      // function's address in TORCH_FN's static_assert (it may be a weak symbol).
      products->impl("addmm", [](c10::DispatchKeySet keys, const at::Tensor& self, const at::Tensor& mat1,
                                 const at::Tensor& mat2, const at::Scalar& beta, const at::Scalar& alpha) {
        return addmm_kernel(keys, self, mat1, mat2, beta, alpha);
      });
      products->impl("mm", [](c10::DispatchKeySet keys, const at::Tensor& self, const at::Tensor& mat2) {
        return mm_kernel(keys, self, mat2);
      });
      products->impl("_unsafe_view", [](c10::DispatchKeySet keys, const at::Tensor& self, c10::SymIntArrayRef size) {
        return unsafe_view_kernel(keys, self, size);
      });
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return registered;
}

/// Open while a checkpoint's forward keeps its products (record), its
/// recompute takes them back (replay), or a profiler's forward measures them.
/// Opens nothing where the kernels are not registered.
class product_span {
 public:
  product_span(draw_log& log, draw_mode mode) {
    if (product_replay_available()) span_.emplace(log, mode, /*products=*/true);
  }

 private:
  std::optional<draw_span> span_;
};

/// Forgets the kept products a checkpoint's forward returned (or a view of;
/// or, where the log keeps a copy, the product itself): serving one in the
/// recompute would give the outer graph's output a new history, and a copy
/// would be kept for nothing (the run's last Linear is not recomputed).
inline void drop_returned_products(draw_log& log, const std::vector<at::Tensor>& outputs) {
  for (auto& p : log.products) {
    if (!p.output.defined()) continue;
    for (const auto& o : outputs)
      if (o.defined() && o.has_storage() && (o.is_alias_of(p.output) || on_storage(o, p.source))) {
        p.output = at::Tensor();
        break;
      }
  }
}

/// The products a forward measured: their bytes and seconds, and the bytes of
/// those whose output is `returned`'s storage (a plain Linear's: not kept
/// where its slot ends a checkpointed run, whose output it is).
struct product_totals {
  std::int64_t bytes = 0;
  std::int64_t returned_bytes = 0;
  std::int64_t copied_bytes = 0;  ///< of products a recording forward would copy (unsafe_view_kernel)
  double seconds = 0.0;
};
inline product_totals measured_product_totals(const draw_log& log, const at::Tensor& returned) {
  product_totals t;
  for (const auto& m : log.measured_products) {
    t.bytes += m.bytes;
    t.seconds += m.seconds;
    if (m.copied) t.copied_bytes += m.bytes;
    if (on_storage(returned, m.storage)) t.returned_bytes += m.bytes;
  }
  return t;
}

}  // namespace memscale::detail

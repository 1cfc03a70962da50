// memscale::detail — a checkpoint's recompute replays the random masks its
// forward drew instead of drawing them again. Internal; not part of the public
// surface.
//
// Dropout on CPU draws its mask with bernoulli_ (on a fresh tensor; input *
// noise), and LibTorch's CPU generator draws serially: 4-6 ns an element here,
// half of a GPT block's forward (benchmarks/RESULTS.md, 2026-11-25). A
// recompute restores the forward's generator state and draws the same masks
// again. Here the forward keeps each draw's outcomes instead, one bit an element
// (a 32nd of a float mask), with the generator's state after the draw; the
// recompute writes the outcomes back and sets that state, so the values, and
// every draw after it, are what drawing again would give, bit for bit.
//
// How: a kernel for aten::bernoulli_.float on DispatchKey::TESTING_ONLY_GenericMode
// (a mode key above autograd, in LibTorch 1.13 and 2.x; nothing in LibTorch
// registers for it), turned on for a span by a thread-local include guard; every
// other operator falls through it at no cost. Should another library have
// registered for that key, the registration is refused and draws are simply
// drawn again (draw_replay_available() is false).
//
// A draw is replayed only where the recompute's n-th draw matches the forward's
// n-th (shape, type, probability, generator), from the default CPU generator, on
// a plain contiguous CPU tensor of at least min_replayed_elements that does not
// require grad (keepable_draw); any other draws for real from the generator's
// right state, and a mismatch stops the replay for the rest of that recompute
// (it then draws from where the replayed draws left the generator). Nested
// spans: the innermost replay serves a draw, and every recording span open
// records it, up to the innermost isolating span (a run whose draws are hidden:
// a probe, a profile, another checkpoint's recompute that does not replay).
// The registration is made at the first span, on whatever thread opens it.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#include <torch/torch.h>

namespace memscale::detail {

inline constexpr c10::DispatchKey draw_replay_key = c10::DispatchKey::TESTING_ONLY_GenericMode;

/// The fewest elements a draw is kept for. Keeping one costs its bits and the
/// generator's state after it (5 KB on CPU); below this a draw takes under
/// about 0.1 ms, and is drawn again.
inline constexpr std::int64_t min_replayed_elements = 16384;

/// One bernoulli_ draw as a forward made it.
struct recorded_draw {
  at::Tensor outcomes;  ///< 0/1 per element, 8 to a byte; undefined where the draw was not kept
  std::vector<std::int64_t> sizes;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  double p = 0.0;
  const c10::GeneratorImpl* generator = nullptr;  ///< the one the draw used (compared, never used: see state_after)
  at::Tensor state_after;                         ///< its state after the draw
};

/// A storage not kept alive. Compare through on_storage, never by address: a
/// freed storage's address is handed out again (a checkpoint's output took the
/// address of a product freed in its forward, and lost a kept product for it).
using weak_storage = c10::weak_intrusive_ptr<c10::StorageImpl>;

inline weak_storage weak_storage_of(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().getWeakStorageImpl()
                                        : weak_storage(c10::intrusive_ptr<c10::StorageImpl>());
}

/// Whether `t` lies on the storage `w` refers to, which must still be alive.
inline bool on_storage(const at::Tensor& t, const weak_storage& w) {
  if (!t.defined() || !t.has_storage()) return false;
  const auto alive = w.lock();
  return alive && alive.get() == t.storage().unsafeGetStorageImpl();
}

/// One matrix product's output as a forward computed it (detail/product_replay.hpp).
struct kept_product {
  at::Tensor output;                ///< undefined once served, or where it was not kept
  std::int64_t version = 0;         ///< the output's version then: a later in-place write bars serving it
  weak_storage source = weak_storage_of({});  ///< the product's own storage (output may be a copy: product_replay.hpp)
  std::uint8_t op = 0;              ///< which product (product_replay.hpp's product_op)
  c10::ScalarType dtype = c10::ScalarType::Undefined;  ///< its first operand's type
  /// Its operands' layout, one after the other: rank, sizes, strides, offset, device.
  std::vector<std::int64_t> layout;
  /// Its operands' storages, not kept alive: one still alive at the recompute
  /// (a parameter's) must be the recompute's operand's there too.
  std::vector<weak_storage> storages;
  double beta = 1.0, alpha = 1.0;   ///< addmm's scalars
};

/// A product a profiler's forward measured: what keeping it costs and saves.
struct measured_product {
  weak_storage storage = weak_storage_of({});  ///< its output's (one a slot returns is not kept)
  std::int64_t bytes = 0;
  double seconds = 0.0;
  bool copied = false;  ///< a recording forward would keep a copy (product_replay.hpp's _unsafe_view)
};

/// The draws of one forward, in order; or, measuring, what drawing and replaying them took.
/// Also the matrix products a checkpoint keeps for its recompute (product_replay.hpp).
struct draw_log {
  std::vector<recorded_draw> draws;
  double draw_seconds = 0.0;      ///< measuring: the draws that could be replayed
  double replay_seconds = 0.0;    ///< measuring: packing their outcomes and writing them back
  std::int64_t kept_bytes = 0;    ///< measuring: what recording them would keep (bits and generator states)
  std::vector<kept_product> products;
  std::vector<measured_product> measured_products;  ///< measuring

  /// Frees what a forward kept for its recompute (its masks and products).
  void release() {
    std::vector<recorded_draw>().swap(draws);
    std::vector<kept_product>().swap(products);
  }
};

enum class draw_mode {
  record,   ///< keep each draw in the log
  replay,   ///< serve draws from the log
  measure,  ///< time each draw, and packing and writing back its outcomes (a profiler's forward)
  isolate,  ///< hide the draws inside from the spans outside (a probe, a profile, another recompute)
};

struct draw_frame {
  draw_log* log;
  draw_mode mode;
  std::size_t next = 0;   ///< replay: the next draw to serve
  bool diverged = false;  ///< replay: a draw did not match; the rest are drawn
  /// What the frame is about: random draws (draw_span), or matrix products
  /// (product_replay.hpp's product_span). An isolating frame hides both.
  bool products = false;
};

/// Whether `f` takes part in what a kernel for draws (products: false) or
/// for matrix products (true) does.
inline bool frame_covers(const draw_frame& f, bool products) {
  return f.mode == draw_mode::isolate || f.products == products;
}

/// Draws served from a log in this process so far (tests read it).
inline std::atomic<std::int64_t>& replayed_draw_count() {
  static std::atomic<std::int64_t> count{0};
  return count;
}

inline std::vector<draw_frame*>& draw_frames() {
  thread_local std::vector<draw_frame*> frames;
  return frames;
}

/// The frames after this thread's innermost isolating one that take part in
/// draws or products (nullptr-free, outermost first).
inline std::vector<draw_frame*> visible_frames(bool products) {
  auto& all = draw_frames();
  auto first = all.size();
  while (first > 0 && all[first - 1]->mode != draw_mode::isolate) --first;
  std::vector<draw_frame*> frames;
  for (auto k = first; k < all.size(); ++k)
    if (frame_covers(*all[k], products)) frames.push_back(all[k]);
  return frames;
}

/// The element types pack_outcomes takes.
inline bool packable(c10::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

/// The 0/1 values of a contiguous floating-point tensor, packed 8 to a byte
/// (bit j of byte i is element 8i + j).
inline at::Tensor pack_outcomes(const at::Tensor& values) {
  const auto n = values.numel();
  auto packed = at::empty({(n + 7) / 8}, at::TensorOptions(at::kByte));
  auto* out = packed.data_ptr<std::uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "memscale_pack_outcomes", [&] {
    const auto* in = values.data_ptr<scalar_t>();
    at::parallel_for(0, packed.numel(), 1 << 13, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) {
        const auto* v = in + 8 * i;
        unsigned byte = 0;
        if (8 * i + 8 <= n) {
          for (int j = 0; j < 8; ++j) byte |= (v[j] != scalar_t(0) ? 1U : 0U) << j;
        } else {
          for (std::int64_t j = 0; j < n - 8 * i; ++j) byte |= (v[j] != scalar_t(0) ? 1U : 0U) << j;
        }
        out[i] = static_cast<std::uint8_t>(byte);
      }
    });
  });
  return packed;
}

/// Writes packed 0/1 values into `target` (contiguous, of the packed tensor's
/// type and size), and counts the write in its version, as the draw would.
inline void unpack_outcomes(const at::Tensor& packed, at::Tensor& target) {
  const auto n = target.numel();
  const auto* in = packed.data_ptr<std::uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, target.scalar_type(), "memscale_unpack_outcomes", [&] {
    auto* out = target.data_ptr<scalar_t>();
    at::parallel_for(0, packed.numel(), 1 << 13, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) {
        auto* v = out + 8 * i;
        const unsigned byte = in[i];
        if (8 * i + 8 <= n) {
          for (int j = 0; j < 8; ++j) v[j] = scalar_t((byte >> j) & 1U);
        } else {
          for (std::int64_t j = 0; j < n - 8 * i; ++j) v[j] = scalar_t((byte >> j) & 1U);
        }
      }
    });
  });
  target.unsafeGetTensorImpl()->bump_version();
}

/// Whether this thread's operators compute nothing now (memscale::predict's
/// shape-only dispatch on LibTorch 1.x, FakeTensor on 2.x): there are no outcomes to keep.
inline bool computing_nothing() {
  return c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Fake) &&
         !c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Fake);
}

inline at::Tensor generator_state(at::Generator& g) {
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}

/// Bytes of the CPU generator's state, which a kept draw holds beside its bits.
inline std::int64_t cpu_generator_state_bytes() {
  static const std::int64_t bytes = [] {
    auto g = at::detail::getDefaultCPUGenerator();
    return static_cast<std::int64_t>(generator_state(g).nbytes());
  }();
  return bytes;
}

/// A tensor whose draw may be kept and written back above autograd: a plain,
/// dense, contiguous CPU tensor (no functionalization, wrapper or forward-mode
/// gradient whose own kernels the write would bypass) that does not require
/// grad, of a packable type, large enough to be worth it.
inline bool keepable_draw(const at::Tensor& self) {
  if (!self.device().is_cpu() || self.layout() != c10::kStrided || self.numel() < min_replayed_elements) return false;
  const auto plain = c10::DispatchKeySet(c10::DispatchKey::CPU) | c10::DispatchKeySet(c10::DispatchKey::AutogradCPU) |
                     c10::DispatchKeySet(c10::DispatchKey::ADInplaceOrView) |
                     c10::DispatchKeySet(c10::DispatchKey::AutocastCPU);
  return plain.isSupersetOf(self.key_set()) && self.is_contiguous() && !self.requires_grad() && !self.is_inference() &&
         !self._fw_grad(0).defined() && packable(self.scalar_type());
}

/// bernoulli_.float(Tensor(a!) self, float p, *, Generator? generator) on the replay key.
inline void draw_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto n = stack->size();
  auto self = (*stack)[n - 3].toTensor();
  const double p = (*stack)[n - 2].toDouble();
  // Only draws from the default CPU generator are kept: a recompute does not
  // restore another generator, and writing one's state back would rewind it.
  const bool own_generator = !(*stack)[n - 1].isNone();
  // The frames after the innermost isolating one see this draw.
  const auto frames = visible_frames(/*products=*/false);
  const bool keepable = !frames.empty() && !own_generator && keepable_draw(self);
  // Under shape-only dispatch nothing is drawn, written or timed, but a
  // recording allocates what it would (predict sizes the real step by it).
  const bool shape_only = computing_nothing();
  at::Generator generator;  // the default CPU generator where the draw is kept
  if (keepable) generator = at::detail::getDefaultCPUGenerator();
  const c10::GeneratorImpl* source =
      own_generator ? (*stack)[n - 1].toGenerator().unsafeGetGeneratorImpl() : generator.unsafeGetGeneratorImpl();

  draw_frame* replay = nullptr;
  for (auto it = frames.rbegin(); it != frames.rend(); ++it)
    if ((*it)->mode == draw_mode::replay) {
      replay = *it;
      break;
    }
  bool served = false;
  if (replay != nullptr && !replay->diverged) {
    const auto& draws = replay->log->draws;
    const recorded_draw* d = replay->next < draws.size() ? &draws[replay->next] : nullptr;
    if (d == nullptr || d->dtype != self.scalar_type() || d->p != p || d->generator != source ||
        c10::IntArrayRef(d->sizes) != self.sizes()) {
      replay->diverged = true;
    } else {
      ++replay->next;  // one not kept, or not to be written here, is drawn: the generator is where it was then
      if (d->outcomes.defined() && keepable && !shape_only) {
        try {
          unpack_outcomes(d->outcomes, self);
          std::lock_guard<std::mutex> lock(generator.mutex());
          generator.set_state(d->state_after);
          served = true;
          replayed_draw_count().fetch_add(1, std::memory_order_relaxed);
        } catch (const std::exception&) {
          replay->diverged = true;  // drawn below, from the state the previous draws left
        }
      }
    }
  }
  bool measuring = false, recording = false;
  for (const auto* f : frames) {
    measuring = measuring || f->mode == draw_mode::measure;
    recording = recording || f->mode == draw_mode::record;
  }
  if (served) {
    torch::jit::drop(*stack, 3);
    stack->emplace_back(self);
  } else {
    const auto start = std::chrono::steady_clock::now();
    op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, draw_replay_key), stack);
    if (measuring && keepable) {
      double draw_seconds = 0.0, replay_seconds = 0.0;
      if (!shape_only) {  // shape-only: nothing to time, but the bytes are the real step's
        const auto drawn = std::chrono::steady_clock::now();
        unpack_outcomes(pack_outcomes(self), self);  // the same values back: what a replay costs both ways
        draw_seconds = std::chrono::duration<double>(drawn - start).count();
        replay_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - drawn).count();
      }
      for (auto* f : frames)
        if (f->mode == draw_mode::measure) {
          f->log->draw_seconds += draw_seconds;
          f->log->replay_seconds += replay_seconds;
          f->log->kept_bytes += (self.numel() + 7) / 8 + cpu_generator_state_bytes();
        }
    }
  }
  if (!recording) return;
  recorded_draw d;
  d.sizes = self.sizes().vec();
  d.dtype = self.scalar_type();
  d.p = p;
  d.generator = source;
  if (keepable) {
    const recorded_draw* served_from = served ? &replay->log->draws[replay->next - 1] : nullptr;
    d.outcomes = served_from != nullptr ? served_from->outcomes
                 : shape_only ? at::empty({(self.numel() + 7) / 8}, at::TensorOptions(at::kByte))
                              : pack_outcomes(self);
    d.state_after = served_from != nullptr ? served_from->state_after : generator_state(generator);
  }
  for (auto* f : frames)
    if (f->mode == draw_mode::record) f->log->draws.push_back(d);
}

/// Registers the kernel once per process; false where LibTorch refused it.
inline bool draw_replay_available() {
  static const bool registered = [] {
    try {
      // Kept for the process's lifetime: a registration is undone when its Library is destroyed.
      static auto* others = new torch::Library(torch::Library::IMPL, "_", draw_replay_key, __FILE__, __LINE__);
      others->fallback(torch::CppFunction::makeFallthrough());
      static auto* draws = new torch::Library(torch::Library::IMPL, "aten", draw_replay_key, __FILE__, __LINE__);
      draws->impl("bernoulli_.float", torch::CppFunction::makeFromBoxedFunction<&draw_kernel>());
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return registered;
}

/// Open while a forward records its draws into a log, a recompute replays them,
/// or a profiler's forward measures them. Opens nothing where the kernel is not
/// registered (but for an isolating span, which hides products too).
/// `products`: a frame for matrix products instead (product_replay.hpp's
/// product_span, which registers their kernels first).
class draw_span {
 public:
  draw_span(draw_log& log, draw_mode mode, bool products = false) {
    const bool draws = !products && draw_replay_available();
    if (!draws && !products && mode != draw_mode::isolate) return;
    frame_ = std::make_unique<draw_frame>(draw_frame{&log, mode});
    frame_->products = products;
    draw_frames().push_back(frame_.get());
    if (draws) include_.emplace(draw_replay_key);
  }
  draw_span(const draw_span&) = delete;
  draw_span& operator=(const draw_span&) = delete;
  ~draw_span() {
    include_.reset();
    if (!frame_) return;
    auto& frames = draw_frames();
    const auto it = std::find(frames.begin(), frames.end(), frame_.get());
    if (it != frames.end()) frames.erase(it);  // the last one, but for spans closed out of order
  }

 private:
  std::unique_ptr<draw_frame> frame_;
  std::optional<c10::impl::IncludeDispatchKeyGuard> include_;
};

/// An isolating span with a log of its own: the draws and products inside are
/// neither served nor recorded by the spans outside.
class isolating_span {
 public:
  isolating_span() = default;
  isolating_span(const isolating_span&) = delete;
  isolating_span& operator=(const isolating_span&) = delete;

 private:
  draw_log unseen_;
  draw_span span_{unseen_, draw_mode::isolate};
};

}  // namespace memscale::detail

// memscale — the Offload technique: while a wrapped run of slots runs its
// forward, every tensor autograd saves (above the engine's size threshold, and
// not a parameter, buffer or view of one) goes to the offload engine, and comes
// back when backward needs it. Wrapped around a CheckpointSegment it offloads
// the input the checkpoint keeps. Saved-tensor hooks: offload/hooks.hpp.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/detail/draw_replay.hpp>
#include <memscale/detail/fault_injection.hpp>
#include <memscale/detail/modules.hpp>
#include <memscale/detail/step_gate.hpp>
#include <memscale/errors.hpp>
#include <memscale/offload/engine.hpp>
#include <memscale/offload/hooks.hpp>
#include <memscale/techniques/checkpoint.hpp>
#include <memscale/techniques/concepts.hpp>

namespace memscale {

namespace detail {

/// What an offload scope saved for one tensor: the tensor itself (kept on the
/// device) or the engine's record of where it went, and the version the tensor
/// had when autograd saved it.
struct offload_packed {
  at::Tensor kept;  // detached: a saved output's grad_fn would own this very record
  offload::stored_handle stored;
  c10::VariableVersion version_counter;  // shares the saved tensor's counter, as autograd's SavedVariable does
  std::uint32_t saved_version = 0;
  std::shared_ptr<step_token> step;  // the step in flight (detail/step_gate.hpp), until backward frees this
};

/// The record of `t`, saved as `kept` or `stored`, with its version now.
inline offload_packed pack_for_offload(const at::Tensor& t, at::Tensor kept, offload::stored_handle stored) {
  offload_packed p{std::move(kept), std::move(stored), c10::VariableVersion(), 0, current_step_token()};
  if (t.defined()) {
    p.version_counter = torch::autograd::impl::version_counter(t);
    if (p.version_counter.enabled()) p.saved_version = p.version_counter.current_version();
  }
  return p;
}

/// Saved-tensor hooks turn off autograd's own in-place check, so the scope
/// makes it at unpack, on every path: a tensor modified in place since it was
/// saved is refused whether its bytes were kept, batched, written or copied
/// away, exactly where autograd would refuse it. `label` names the scope.
inline void check_unmodified(const offload_packed& p, const std::string& label) {
  if (!p.version_counter.enabled()) return;
  const auto current = p.version_counter.current_version();
  if (current == p.saved_version) return;
  const auto layout = p.stored ? p.stored->layout() : offload::detail::tensor_layout::of(p.kept);
  const std::string scope = label.empty() ? std::string("a with_offload call") : "'" + label + "'";
  TORCH_CHECK(false, "memscale: ", offload::detail::modified_in_place(layout, current, p.saved_version),
              " It was saved inside the offload scope of ", scope,
              ", whose saved tensors autograd cannot check itself; make that in-place operation out of place.");
}

/// Storages the scope must not offload: its parameters and buffers (they stay
/// alive anyway, so moving them would only cost transfers).
using storage_set = std::unordered_set<const c10::StorageImpl*>;

inline void add_storages(const std::vector<torch::nn::AnyModule>& slots, storage_set& set) {
  for (const auto& slot : slots) {
    // A CheckpointSegment or TileSegment registers nothing: look at the slots it runs.
    if (const auto* segment = dynamic_cast<const slot_wrapper*>(slot.ptr().get())) {
      add_storages(segment->slots(), set);
      continue;
    }
    for (const auto& p : slot.ptr()->parameters())
      if (p.defined() && p.has_storage()) set.insert(p.storage().unsafeGetStorageImpl());
    for (const auto& b : slot.ptr()->buffers())
      if (b.defined() && b.has_storage()) set.insert(b.storage().unsafeGetStorageImpl());
  }
}

inline std::shared_ptr<const storage_set> storages_of(const std::vector<torch::nn::AnyModule>& slots) {
  auto set = std::make_shared<storage_set>();
  add_storages(slots, *set);
  return set;
}

/// Whether an offload scope keeps `t` on the device instead of handing it to
/// its engine: not a dense tensor with storage, a leaf that needs a gradient
/// (parameters, tied weights a checkpoint reads, a caller's input: they live on
/// anyway, so moving them only costs copies), under `min_bytes` (the view's own
/// bytes), or on one of the `keep` storages.
inline bool offload_keeps(const at::Tensor& t, std::int64_t min_bytes, const storage_set* keep) {
  return !t.defined() || t.layout() != c10::kStrided || !t.has_storage() || (t.is_leaf() && t.requires_grad()) ||
         static_cast<std::int64_t>(t.nbytes()) < min_bytes ||
         (keep != nullptr && keep->count(t.storage().unsafeGetStorageImpl()) != 0);
}

/// The profiler's dry run of an offload scope (measure_slot): while it is open,
/// every tensor autograd saves on this thread is kept as it is (detached) and
/// counted by storage while its saved variable lives: how many saved views it
/// has, and how many of them the scope would keep. Offloading frees a storage
/// only when every saved view of it goes and nothing but those views holds it;
/// a storage the slot's output, its input or another live tensor shares stays,
/// and so does one a small view keeps (an LSTM step's gate chunks, under
/// min_bytes, of a larger tensor). freed_bytes() is what the scope would free,
/// read while the forward's tensors are still held; a CUDA storage counts as
/// the caching allocator's 512-byte blocks hold it.
class offload_census {
 public:
  offload_census(std::int64_t min_bytes, std::shared_ptr<const storage_set> keep)
      : state_(std::make_shared<state>(min_bytes, std::move(keep))), hooks_(pack{state_}, unpack{}) {}

  [[nodiscard]] std::int64_t freed_bytes() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    std::int64_t freed = 0;
    for (const auto& [impl, e] : state_->storages)
      if (e.views > 0 && e.staying == 0 && static_cast<std::int64_t>(e.storage.use_count()) == e.views)
        freed += e.bytes;
    return freed;
  }

 private:
  struct entry {
    weak_storage storage = weak_storage_of({});  // keeps the StorageImpl's address from being reused
    std::int64_t bytes = 0;
    std::int64_t views = 0;    ///< saved views alive: each holds the storage once (its detached tensor)
    std::int64_t staying = 0;  ///< ... of which the scope would keep on the device
  };
  struct state {
    state(std::int64_t min, std::shared_ptr<const storage_set> k) : min_bytes(min), keep(std::move(k)) {}
    std::mutex mutex;
    std::int64_t min_bytes;
    std::shared_ptr<const storage_set> keep;
    std::unordered_map<const c10::StorageImpl*, entry> storages;
  };
  /// One saved variable's tensor; its death (a graph dropped in the forward) uncounts it.
  struct view {
    view(at::Tensor t, std::shared_ptr<state> st, bool keeps) : tensor(std::move(t)), s(std::move(st)), stays(keeps) {
      if (!tensor.has_storage()) return;
      storage = tensor.storage().unsafeGetStorageImpl();
      std::lock_guard<std::mutex> lock(s->mutex);
      auto& e = s->storages[storage];
      if (e.views == 0) {
        const auto bytes = static_cast<std::int64_t>(tensor.storage().nbytes());
        e = entry{weak_storage_of(tensor), tensor.is_cuda() ? (bytes + 511) / 512 * 512 : bytes};
      }
      ++e.views;
      e.staying += stays ? 1 : 0;
    }
    view(const view&) = delete;
    view& operator=(const view&) = delete;
    ~view() {
      if (storage == nullptr) return;
      std::lock_guard<std::mutex> lock(s->mutex);
      if (const auto it = s->storages.find(storage); it != s->storages.end()) {
        --it->second.views;
        it->second.staying -= stays ? 1 : 0;
      }
    }
    at::Tensor tensor;  // detached, as saved_storage_log keeps it (offload/hooks.hpp)
    std::shared_ptr<state> s;
    bool stays;
    const c10::StorageImpl* storage = nullptr;
  };
  struct pack {
    std::shared_ptr<state> s;
    std::shared_ptr<const view> operator()(const at::Tensor& t) const {
      const bool stays = offload_keeps(t, s->min_bytes, s->keep.get());
      return std::make_shared<const view>(t.defined() ? t.detach() : t, s, stays);
    }
  };
  struct unpack {
    at::Tensor operator()(std::shared_ptr<const view>& v) const { return v->tensor; }
  };

  std::shared_ptr<state> state_;
  offload::saved_tensors_hooks<pack, unpack> hooks_;
};

/// The pack side of an offload scope: what stays (leaves that need a gradient,
/// small tensors, `keep` storages) and what goes to the engine. With
/// `group_bytes`, a new prefetch group starts after that many bytes (a scope
/// over a whole forward has no layer boundaries to group by).
struct offload_pack {
  std::shared_ptr<offload::engine> engine;
  std::shared_ptr<const storage_set> keep;
  std::int64_t group_bytes = 0;
  std::shared_ptr<std::atomic<std::int64_t>> in_group = std::make_shared<std::atomic<std::int64_t>>(0);

  offload_packed operator()(const at::Tensor& t) const {
    if (offload_keeps(t, engine->options().min_bytes, keep.get())) return pack_for_offload(t, t.detach(), nullptr);
    // A scope without layer boundaries (group_bytes > 0) has no end of group to
    // flush batched tensors at: each goes on its own, and groups end by size.
    auto packed = pack_for_offload(t, at::Tensor(), group_bytes <= 0 ? engine->store_or_defer(t) : engine->store(t));
    fault_point(pipeline_stage::offload_write);  // the stored tensor goes with `packed`
    const auto n = static_cast<std::int64_t>(t.nbytes());
    if (group_bytes > 0 && in_group->fetch_add(n) + n >= group_bytes) {  // this tensor fills the group
      in_group->store(0);
      engine->begin_group();
    }
    return packed;
  }
};

struct offload_unpack {
  std::shared_ptr<offload::engine> engine;
  std::string label;
  at::Tensor operator()(offload_packed& p) const {
    check_unmodified(p, label);
    if (!p.stored) return p.kept;
    auto loaded = engine->load(p.stored);
    fault_point(pipeline_stage::offload_read);
    return loaded;
  }
};

using offload_hooks = offload::saved_tensors_hooks<offload_pack, offload_unpack>;

}  // namespace detail

/// Runs `fn()` with every tensor autograd saves in it (except `keep` storages
/// and tensors below the engine's min_bytes) handed to `engine`, as one prefetch
/// group. The building block of OffloadSegment; usable from a custom forward.
/// `label` names the layer or segment in errors (a saved tensor modified in place).
template <class Fn>
decltype(auto) with_offload(const std::shared_ptr<offload::engine>& engine, Fn&& fn,
                            std::shared_ptr<const detail::storage_set> keep = {}, std::string label = {}) {
  if (!engine) throw Error("memscale: with_offload needs an offload engine, got none");
  engine->begin_group();
  // Small tensors wait for the end of the group and travel together.
  struct flush_at_exit {
    offload::engine& e;
    ~flush_at_exit() {
      try {
        e.flush();  // on failure the tensors stay where they are
      } catch (...) {
      }
    }
  } flush{*engine};
  detail::offload_hooks scope(detail::offload_pack{engine, std::move(keep)},
                              detail::offload_unpack{engine, std::move(label)});
  return std::forward<Fn>(fn)();
}

/// For its lifetime, on the thread that made it, every tensor autograd saves
/// goes to `engine` (except leaves needing a gradient, `keep` storages and small
/// tensors), in prefetch groups of about `group_bytes`. What a model with no
/// unit boundaries gets: the whole forward (and the loss) offloaded.
class offload_scope {
 public:
  offload_scope(std::shared_ptr<offload::engine> engine, std::shared_ptr<const detail::storage_set> keep,
                std::int64_t group_bytes, std::string label)
      : engine_(std::move(engine)) {
    if (!engine_) throw Error("memscale: an offload_scope needs an offload engine, got none");
    engine_->begin_group();
    hooks_ = std::make_unique<detail::offload_hooks>(detail::offload_pack{engine_, std::move(keep), group_bytes},
                                                     detail::offload_unpack{engine_, std::move(label)});
  }
  offload_scope(const offload_scope&) = delete;
  offload_scope& operator=(const offload_scope&) = delete;
  ~offload_scope() {
    hooks_.reset();
    try {
      engine_->flush();
    } catch (...) {
    }
  }

 private:
  std::shared_ptr<offload::engine> engine_;
  std::unique_ptr<detail::offload_hooks> hooks_;
};

/// A chain slot that runs consecutive original slots (or one memscale wrapper)
/// with their saved tensors offloaded. Registers nothing, like CheckpointSegment.
class OffloadSegmentImpl : public memscale::detail::wrapper_module, public detail::gated {
 public:
  OffloadSegmentImpl(std::vector<torch::nn::AnyModule> slots, std::shared_ptr<offload::engine> engine)
      : wrapper_module("memscale::OffloadSegment"), slots_(std::move(slots)), engine_(std::move(engine)) {
    if (!engine_) throw Error("memscale: an OffloadSegment needs an offload engine, got none");
    label_ = detail::slot_names(slots_);
  }

  torch::Tensor forward(torch::Tensor x) {
    auto run = [&] {
      for (auto& slot : slots_) x = slot.forward<torch::Tensor>(std::move(x));
      return x;
    };
    if (!torch::GradMode::is_enabled()) return run();  // nothing is saved
    const detail::step_scope step(gate());  // one training step at a time (a second thread is refused)
    return with_offload(engine_, run, detail::storages_of(slots_), label_);
  }

  [[nodiscard]] const std::vector<torch::nn::AnyModule>& slots() const noexcept { return slots_; }
  [[nodiscard]] const std::shared_ptr<offload::engine>& engine() const noexcept { return engine_; }

 private:
  std::vector<torch::nn::AnyModule> slots_;
  std::shared_ptr<offload::engine> engine_;
  std::string label_;  // the slots' module names, for errors
};

/// The offload technique: a run of slots becomes one OffloadSegment using the
/// attachment's engine.
struct Offload {
  static constexpr technique_id id = technique_id::offload;
  static constexpr std::string_view name = "offload";
  static constexpr bool available = true;
  static torch::nn::AnyModule wrap(std::vector<torch::nn::AnyModule> slots, const wrap_context& context) {
    return torch::nn::AnyModule(std::make_shared<OffloadSegmentImpl>(std::move(slots), context.offload_engine));
  }
};

}  // namespace memscale

// memscale — saved tensors kept compact in the units a plan leaves in place:
// masks as bits (Config::pack_saved_masks; techniques/mask_packing.hpp),
// outputs computed again from inputs that are saved anyway
// (Config::recompute_saved_outputs; detail/output_recipes.hpp), and rows
// without their trailing +0 (Config::pack_saved_zeros; zero_tails.hpp). One saved-tensor
// hook scope (offload/hooks.hpp) decides per tensor, in this order:
//   - a tensor already saved in the scope (the same storage, view and version)
//     shares what it was stored as;
//   - an output a recomputable op computed in the scope, each of whose inputs
//     was saved in the scope (an absent optional aside), is stored as a recipe
//     holding what those inputs are stored as (so a mask input stays bits);
//   - a mask is stored as bits;
//   - a tensor whose rows end in +0 (causal attention's softmax) without them;
//   - anything else as it is (detached: mask_packing.hpp's pack_mask says why).
// Backward gets every tensor back bit for bit. A recipe's input written in
// place since the forward fails the unpack with an error saying so (autograd
// would fail on it later as well). A recipe on the storage the scope's forward
// returns frees nothing (the caller holds it): release_returned() keeps it as it
// is. The census is the same scope kept dry, for the profiler: everything is
// stored as it is, and it counts what compacting would free and cost.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <memscale/detail/draw_replay.hpp>
#include <memscale/detail/modules.hpp>
#include <memscale/detail/output_recipes.hpp>
#include <memscale/offload/hooks.hpp>
#include <memscale/techniques/checkpoint_segment.hpp>
#include <memscale/techniques/mask_packing.hpp>
#include <memscale/techniques/zero_tails.hpp>

namespace memscale {

/// What a compaction scope does: Config::pack_saved_masks, Config::recompute_saved_outputs.
struct saved_compaction {
  bool masks = false;
  bool outputs = false;
  bool zeros = false;  ///< Config::pack_saved_zeros (techniques/zero_tails.hpp)
  [[nodiscard]] bool any() const noexcept { return masks || outputs || zeros; }
};

namespace detail {

/// Saved tensors stored as recipes in this process so far (tests read it).
inline std::atomic<std::int64_t>& recipe_count() {
  static std::atomic<std::int64_t> count{0};
  return count;
}

/// One saved tensor as a compaction scope stores it.
struct saved_entry {
  packed_mask stored;  ///< as it is, or as bits (no recipe, no tails); as it is in a census
  zero_tails tails;    ///< set: its rows without their trailing +0 (no recipe)
  std::shared_ptr<const output_recipe> recipe;        ///< set: computed again from `inputs`
  std::vector<std::shared_ptr<saved_entry>> inputs;  ///< the recipe's, as saved (null: an absent optional)
  std::vector<std::int64_t> input_versions;          ///< of those stored as they are, at the op
  weak_storage source = weak_storage_of({});          ///< the storage it was saved from
  std::vector<std::int64_t> sizes, strides;           ///< the view saved
  std::int64_t offset = 0;
  double bits_seconds = 0.0;  ///< census: what packing it as bits took (writing it back: as long again)
};

/// A mul recipe one of whose operands is kept as bits, computed from the bits.
inline at::Tensor product_with_mask(const saved_entry& e) {
  if (e.recipe->op != output_op::mul || e.inputs.size() != 2 || !e.inputs[0] || !e.inputs[1]) return {};
  for (int k = 0; k < 2; ++k) {
    const auto& mask = *e.inputs[static_cast<std::size_t>(k)];
    const auto& other = *e.inputs[static_cast<std::size_t>(1 - k)];
    if (mask.recipe || !mask.stored.bits.defined()) continue;
    if (other.recipe || (!other.stored.plain.defined() && !other.tails.defined())) return {};
    const auto& plain = other.stored.plain;
    if (plain.defined() && plain._version() != e.input_versions[static_cast<std::size_t>(1 - k)])
      return {};  // unpack_entry says
    auto out = other.tails.defined() ? multiply_tails_by_bits(other.tails, mask.stored) : at::Tensor();
    if (!out.defined())
      out = multiply_by_bits(other.tails.defined() ? unpack_zero_tails(other.tails) : plain, mask.stored);
    if (out.defined() && out.strides().vec() == e.recipe->strides) return out;
    return {};
  }
  return {};
}

/// The saved tensor back, bit for bit.
inline at::Tensor unpack_entry(const saved_entry& e) {
  if (!e.recipe) return e.tails.defined() ? unpack_zero_tails(e.tails) : unpack_mask(e.stored);
  if (auto product = product_with_mask(e); product.defined())
    return product.as_strided(e.sizes, e.strides, e.offset);
  std::vector<at::Tensor> inputs;
  for (std::size_t k = 0; k < e.inputs.size(); ++k) {
    if (!e.inputs[k]) {
      inputs.emplace_back();
      continue;
    }
    auto t = unpack_entry(*e.inputs[k]);
    TORCH_CHECK(!e.inputs[k]->stored.plain.defined() || e.inputs[k]->recipe ||
                    t._version() == e.input_versions[k],
                "memscale: an input of a saved output that backward computes again was written in place after "
                "the forward (Config::recompute_saved_outputs); write to a copy, or set recompute_saved_outputs = "
                "false");
    inputs.push_back(std::move(t));
  }
  auto out = recompute_output(*e.recipe, inputs);
  if (out.strides().vec() != e.recipe->strides) {
    auto laid = at::empty_strided(e.recipe->sizes, e.recipe->strides, out.options());
    laid.copy_(out);
    out = std::move(laid);
  }
  return out.as_strided(e.sizes, e.strides, e.offset);
}

/// The state of one compaction scope (or census): what was saved in it, and
/// the outputs its recomputable ops computed. Packs run on the scope's thread.
class compaction_state final : public output_frame {
 public:
  compaction_state(saved_compaction what, bool dry) : what_(what), dry_(dry) {}

  [[nodiscard]] bool timed() const override { return dry_; }

  void computed(output_recipe recipe, const at::Tensor& out, const std::vector<at::Tensor>& inputs) override {
    if (!what_.outputs || !out.has_storage() || out.storage().data() == nullptr || out.numel() < min_packed_elements ||
        out.storage_offset() != 0 || !out.is_non_overlapping_and_dense() ||
        out.nbytes() != out.storage().nbytes())
      return;
    pending p;
    p.output = weak_storage_of(out);
    p.counter = out.unsafeGetTensorImpl()->version_counter();
    p.output_version = static_cast<std::int64_t>(out._version());
    for (const auto& t : inputs) {
      p.present.push_back(t.defined());
      if (!t.defined()) {
        p.inputs.emplace_back();
        p.versions.push_back(0);
        continue;
      }
      auto entry = find(t);
      if (!entry) return;  // an input not saved here: the output is stored as it is
      p.inputs.push_back(entry);
      p.versions.push_back(static_cast<std::int64_t>(t._version()));
    }
    p.recipe = std::make_shared<const output_recipe>(std::move(recipe));
    outputs_[out.storage().unsafeGetStorageImpl()] = std::move(p);
  }

  void aliased(const at::Tensor& base) override {
    if (!base.has_storage()) return;
    const auto it = outputs_.find(base.storage().unsafeGetStorageImpl());
    if (it != outputs_.end() && on_storage(base, it->second.output)) outputs_.erase(it);
  }

  std::shared_ptr<saved_entry> pack(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage() || t.layout() != c10::kStrided) {
      auto e = std::make_shared<saved_entry>();
      e->stored.plain = t.defined() ? t.detach() : t;
      return e;
    }
    if (auto shared = find(t)) return shared;
    auto e = std::make_shared<saved_entry>();
    e->source = weak_storage_of(t);
    e->sizes = t.sizes().vec();
    e->strides = t.strides().vec();
    e->offset = t.storage_offset();
    const auto* storage = t.storage().unsafeGetStorageImpl();
    if (!as_recipe(t, e) && what_.masks && mask_candidate(t)) {
      const auto start = std::chrono::steady_clock::now();
      packed_mask p;
      const bool mask = by_element_size(t.element_size(), [&]<class U>() { return pack_two_valued<U>(t, p); });
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      own_seconds_ += seconds;
      if (mask && dry_) {
        e->bits_seconds = seconds;
        seconds_ += 2.0 * seconds;
        if (counted_.insert(storage).second) freed_ += static_cast<std::int64_t>(t.nbytes()) - p.bits.numel();
        largest_ = std::max<std::int64_t>(largest_, static_cast<std::int64_t>(t.nbytes()));
      } else if (mask) {
        e->stored = std::move(p);
        packed_mask_count().fetch_add(1, std::memory_order_relaxed);
      }
    }
    if (!e->recipe && !e->stored.bits.defined() && what_.zeros && zero_tails_candidate(t)) pack_tails(t, e);
    if (!e->recipe && !e->stored.bits.defined() && !e->tails.defined()) e->stored.plain = t.detach();
    saved_[storage].push_back({e, static_cast<std::int64_t>(t._version())});
    return e;
  }

  /// A recipe on `returned`'s storage (what the scope's forward returns, which
  /// the caller holds) is stored as it is instead: recomputing it frees nothing.
  void release_returned(const at::Tensor& returned) {
    for (auto& weak : recipes_)
      if (auto e = weak.lock(); e && (e->recipe || e->tails.defined()) && on_storage(returned, e->source)) {
        e->stored.plain = returned.detach().as_strided(e->sizes, e->strides, e->offset);
        e->recipe.reset();
        e->inputs.clear();
        e->tails = {};
      }
  }

  /// Census: the bytes compacting would free (masks less their bits, recipes'
  /// storages, each once; none on `returned`'s storage), the step time it would
  /// add (packing and writing back masks, computing recipes again and writing
  /// back their masked inputs), and the time the census itself took.
  [[nodiscard]] std::int64_t freed_bytes(const at::Tensor& returned) const {
    auto bytes = freed_;
    for (const auto& [storage, b] : recipe_bytes_)
      if (on_storage(returned, storage)) bytes -= b;
    return std::max<std::int64_t>(0, bytes);
  }
  [[nodiscard]] double seconds() const { return seconds_; }
  /// The largest tensor it would compact (backward brings one back at a time).
  [[nodiscard]] std::int64_t largest_bytes() const { return largest_; }
  [[nodiscard]] double own_seconds() const { return own_seconds_; }

  /// Forgets what the scope saw (its entries live on with the tensors saved).
  void close() {
    saved_.clear();
    outputs_.clear();
    recipes_.clear();
    counted_.clear();
    recipe_bytes_.clear();
  }

 private:
  struct registered {
    std::weak_ptr<saved_entry> entry;
    std::int64_t version = 0;
  };
  struct pending {
    std::shared_ptr<const output_recipe> recipe;
    weak_storage output = weak_storage_of({});
    /// The output's version counter (shared with its views) and its version when computed.
    c10::VariableVersion counter;
    std::int64_t output_version = 0;
    std::vector<std::weak_ptr<saved_entry>> inputs;
    std::vector<bool> present;  ///< false: an absent optional
    std::vector<std::int64_t> versions;
  };

  /// The entry `t` (the same storage, view and version) was saved as here, if alive.
  std::shared_ptr<saved_entry> find(const at::Tensor& t) const {
    if (!t.has_storage()) return nullptr;
    const auto it = saved_.find(t.storage().unsafeGetStorageImpl());
    if (it == saved_.end()) return nullptr;
    for (const auto& r : it->second) {
      auto e = r.entry.lock();
      if (e && r.version == static_cast<std::int64_t>(t._version()) && on_storage(t, e->source) &&
          e->offset == t.storage_offset() && e->sizes == t.sizes() && e->strides == t.strides())
        return e;
    }
    return nullptr;
  }

  /// Stores `t` (a zero_tails_candidate) as its rows without their trailing +0
  /// where that frees a quarter of it; a census counts it (packing and writing
  /// back are a copy each, counted as twice the packing).
  void pack_tails(const at::Tensor& t, const std::shared_ptr<saved_entry>& e) {
    const auto start = std::chrono::steady_clock::now();
    zero_tails z;
    const bool packed = pack_zero_tails(t, z);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    own_seconds_ += seconds;
    if (!packed) return;
    const auto bytes = static_cast<std::int64_t>(t.nbytes()) - z.nbytes();
    if (dry_) {
      if (!counted_.insert(t.storage().unsafeGetStorageImpl()).second) return;
      freed_ += bytes;
      seconds_ += 2.0 * seconds;
      largest_ = std::max<std::int64_t>(largest_, static_cast<std::int64_t>(t.nbytes()));
      recipe_bytes_.emplace_back(weak_storage_of(t), bytes);
      return;
    }
    e->tails = std::move(z);
    recipes_.push_back(e);
    zero_tails_count().fetch_add(1, std::memory_order_relaxed);
  }

  /// Makes `e` a recipe where `t` is an output computed here from inputs saved here.
  bool as_recipe(const at::Tensor& t, const std::shared_ptr<saved_entry>& e) {
    const auto it = outputs_.find(t.storage().unsafeGetStorageImpl());
    if (it == outputs_.end() || !on_storage(t, it->second.output)) return false;
    const auto& p = it->second;
    // Written in place since the op (through it or a view: its counter; through
    // an alias with a counter of its own, as _unsafe_view makes: t's): computing
    // it again would give the values before the write.
    if (!p.counter.enabled() || static_cast<std::int64_t>(p.counter.current_version()) != p.output_version ||
        static_cast<std::int64_t>(t._version()) != p.output_version)
      return false;
    std::vector<std::shared_ptr<saved_entry>> inputs;
    double unpack_seconds = 0.0;
    for (std::size_t k = 0; k < p.inputs.size(); ++k) {
      inputs.push_back(p.inputs[k].lock());
      if (p.present[k] && !inputs.back()) return false;  // that input is no longer saved
      // A mask input is written back for the recompute (a Dropout product multiplies by its bits).
      if (inputs.back() && p.recipe->op != output_op::mul) unpack_seconds += inputs.back()->bits_seconds;
    }
    const auto* storage = t.storage().unsafeGetStorageImpl();
    if (dry_) {  // the census keeps it as it is; it only counts
      if (counted_.insert(storage).second) {
        const auto bytes = static_cast<std::int64_t>(t.storage().nbytes());
        freed_ += bytes;
        largest_ = std::max(largest_, bytes);
        recipe_bytes_.emplace_back(weak_storage_of(t), bytes);
        seconds_ += p.recipe->seconds + unpack_seconds;
      }
      return true;
    }
    e->recipe = p.recipe;
    e->inputs = std::move(inputs);
    e->input_versions = p.versions;
    recipes_.push_back(e);
    recipe_count().fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  saved_compaction what_;
  bool dry_;
  std::unordered_map<const c10::StorageImpl*, std::vector<registered>> saved_;
  std::unordered_map<const c10::StorageImpl*, pending> outputs_;
  std::vector<std::weak_ptr<saved_entry>> recipes_;
  std::unordered_set<const c10::StorageImpl*> counted_;  // census: storages counted (alive while the graph is)
  std::vector<std::pair<weak_storage, std::int64_t>> recipe_bytes_;
  std::int64_t freed_ = 0, largest_ = 0;
  double seconds_ = 0.0, own_seconds_ = 0.0;
};

struct compact_pack_fn {
  std::shared_ptr<compaction_state> state;
  std::shared_ptr<saved_entry> operator()(const at::Tensor& t) const { return state->pack(t); }
};
struct compact_unpack_fn {
  at::Tensor operator()(std::shared_ptr<saved_entry>& e) const { return unpack_entry(*e); }
};

/// While open on this thread, the tensors autograd saves are kept compact as
/// `what` says (dry: as they are, counted).
class saved_compaction_scope {
 public:
  explicit saved_compaction_scope(saved_compaction what, bool dry = false)
      : state_(std::make_shared<compaction_state>(what, dry)),
        hooks_(compact_pack_fn{state_}, compact_unpack_fn{}),
        frame_(*state_) {}
  ~saved_compaction_scope() { state_->close(); }
  saved_compaction_scope(const saved_compaction_scope&) = delete;
  saved_compaction_scope& operator=(const saved_compaction_scope&) = delete;

  void release_returned(const at::Tensor& returned) { state_->release_returned(returned); }
  [[nodiscard]] const compaction_state& state() const { return *state_; }

 private:
  std::shared_ptr<compaction_state> state_;
  offload::saved_tensors_hooks<compact_pack_fn, compact_unpack_fn> hooks_;
  output_frame_scope frame_;
};

}  // namespace detail

/// A chain slot the plan leaves in place, run with its saved tensors kept
/// compact (Config::pack_saved_masks, Config::recompute_saved_outputs).
/// Registers nothing: parameters and state-dict names do not change.
class CompactSavedSlotImpl : public memscale::detail::wrapper_module, public detail::slot_wrapper {
 public:
  CompactSavedSlotImpl(torch::nn::AnyModule inner, saved_compaction what)
      : wrapper_module("memscale::CompactSavedSlot"), slots_{std::move(inner)}, what_(what) {}

  torch::Tensor forward(torch::Tensor x) {
    detail::saved_compaction_scope scope(what_);
    auto y = slots_.front().forward<torch::Tensor>(std::move(x));
    scope.release_returned(y);
    return y;
  }

  [[nodiscard]] const std::vector<torch::nn::AnyModule>& slots() const noexcept override { return slots_; }
  [[nodiscard]] saved_compaction compaction() const noexcept { return what_; }

 private:
  std::vector<torch::nn::AnyModule> slots_;
  saved_compaction what_;
};

}  // namespace memscale

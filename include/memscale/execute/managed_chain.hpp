// memscale — what an attachment (execute/attachment.hpp) keeps per chain and per
// call: the technique set a Strategy and Config allow, the plan-agreement hook,
// the planning probe that waits in slot 0 for a chain's first input, where a
// chain's units come from, and the records of memscale::forward calls.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/core/decisions.hpp>
#include <memscale/core/graph.hpp>
#include <memscale/core/profiler.hpp>
#include <memscale/core/slots.hpp>
#include <memscale/detail/modules.hpp>
#include <memscale/offload/disk_rate.hpp>
#include <memscale/offload/engine_options.hpp>
#include <memscale/offload/host_link_rate.hpp>
#include <memscale/offload/tiers.hpp>
#include <memscale/techniques/checkpoint.hpp>
#include <memscale/techniques/concepts.hpp>
#include <memscale/techniques/mixed_precision.hpp>
#include <memscale/techniques/offload.hpp>
#include <memscale/techniques/tile.hpp>

namespace memscale::core {

/// What the Strategy and the Config allow: the Strategy's way to wrap a run of
/// slots per technique (empty when the Strategy or the Config excludes it).
struct technique_set {
  using wrap_fn = std::function<torch::nn::AnyModule(std::vector<torch::nn::AnyModule>, const wrap_context&)>;
  wrap_fn checkpoint;
  wrap_fn offload;
  wrap_fn tile;
};

/// Nominal one-way rates the planner assumes for an offload transfer where
/// none is measured (the engine's statistics report what a step really took).
inline constexpr double nominal_host_link_bytes_per_second = 16e9;  // pinned PCIe 4 copies
inline constexpr double nominal_pageable_link_bytes_per_second = 8e9;  // pageable ones, staged by the driver
inline constexpr double nominal_disk_bytes_per_second = 1e9;        // a local SSD

/// What offload_room() finds: the tiers' room, and the one-way rate a transfer is costed at.
struct offload_tiers {
  std::int64_t room_bytes = 0;
  double bytes_per_second = nominal_disk_bytes_per_second;
  bool measured = false;  ///< the rate was measured in this process (else: nominal)
  /// CUDA: the pinned pool's bytes, which go at bytes_per_second; past them, a
  /// step's offloads go through pageable memory at spill_bytes_per_second. -1: no such limit.
  std::int64_t fast_bytes = -1;
  double spill_bytes_per_second = 0.0;
  bool spill_measured = false;

  /// The planner's input from them, less `used` bytes that chains planned earlier offload already.
  void set_input(engine_input& in, std::int64_t used) const {
    in.offload_budget_bytes = std::max<std::int64_t>(0, room_bytes - used);
    in.offload_bytes_per_second = bytes_per_second;
    in.offload_fast_bytes = fast_bytes < 0 ? -1 : std::max<std::int64_t>(0, fast_bytes - used);
    in.offload_spill_bytes_per_second = spill_bytes_per_second;
  }
};

/// Room in the offload tiers for tensors on `device` (the engine's caps, see
/// offload::options_from), and the transfer rate to the tier they reach first:
/// host tiers then disk for CUDA, disk only for CPU tensors. The rate is
/// measured where `may_offload()` says a plan could weigh it, for transfers of
/// about `typical_bytes`, once per process and size: the disk's
/// (offload::measured_disk_bytes_per_second: four such written and read back;
/// 10-230 ms on a VM's disk for 1-16 MiB) or the host link's
/// (offload::measured_host_link_bytes_per_second: four copies out and back
/// through pinned memory, where the pinned pool takes a transfer of that size:
/// beyond it the engine copies through pageable memory, slower: that rate is
/// measured too, where the host tier has room past the pool). Elsewhere, or
/// where it cannot be measured, the nominal rate stands. `may_offload` is asked
/// only where a rate would be measured, and once.
template <class MayOffload>
offload_tiers offload_room(const c10::Device& device, const offload::engine_options& o, MayOffload&& may_offload,
                           std::int64_t typical_bytes = offload::disk_rate_max_bytes) {
  const std::int64_t disk = o.disk_bytes.value_or(0), host = device.is_cuda() ? o.host_bytes.value_or(0) : 0;
  std::optional<double> rate;
  if (host > 0) {
    const auto pinned = std::clamp<std::int64_t>(o.pinned_bytes, 0, host);
    // The pool hands out blocks of a power of two (offload::pinned_pool::size_class): of tensors of about the
    // typical size, it holds that many whole ones (a 256 MiB pool, 12 MiB tensors: 16, 192 MiB).
    const auto block = offload::pinned_pool::size_class(std::max<std::int64_t>(typical_bytes, 1));
    const auto fast = typical_bytes > 0 ? std::min(pinned, pinned / block * typical_bytes) : pinned;
    const bool pool_takes_one = pinned >= offload::disk_rate_transfer_bytes(typical_bytes);
    std::optional<double> spill;
    if ((pool_takes_one || host > pinned) && may_offload()) {
      if (pool_takes_one) rate = offload::measured_host_link_bytes_per_second(device, typical_bytes);
      if (host > pinned)
        spill = offload::measured_host_link_bytes_per_second(device, typical_bytes, offload::host_memory::pageable);
    }
    return {host + disk, rate.value_or(nominal_host_link_bytes_per_second), rate.has_value(), fast,
            spill.value_or(nominal_pageable_link_bytes_per_second), spill.has_value()};
  }
  if (disk > 0 && may_offload())
    rate = offload::measured_disk_bytes_per_second(o.disk_dir, o.disk_write_through, typical_bytes);
  return {host + disk, rate.value_or(nominal_disk_bytes_per_second), rate.has_value()};
}

/// The size of the tensors an offload of these chains would move, for the disk
/// rate's measurement: the median of their slots' input bytes (a checkpointed
/// unit's offload moves its input; a kept one's, its saved tensors, mostly
/// activations of about that size). 0 where no slot has an input.
[[nodiscard]] inline std::int64_t typical_offload_bytes(const std::vector<std::vector<slot_cost>>& chains) {
  std::vector<std::int64_t> sizes;
  for (const auto& chain : chains)
    for (const auto& s : chain)
      if (s.input_bytes > 0) sizes.push_back(s.input_bytes);
  if (sizes.empty()) return 0;
  const auto middle = sizes.begin() + static_cast<std::ptrdiff_t>(sizes.size() / 2);
  std::nth_element(sizes.begin(), middle, sizes.end());
  return *middle;
}

class attachment;

/// Runs after this process decided a plan and before anything is applied: gets
/// the chains just profiled and the local plan, returns the plan to apply.
/// Data parallel training sets it so every rank applies rank 0's plan
/// (memscale/distributed.hpp); it may throw (nothing has changed yet).
using plan_agreement = std::function<engine_plan(const std::vector<chain_profile>& profiles, engine_plan local)>;

/// Slot 0 of a chain whose plan waits for its first input (wrap without an example).
class PlanningProbeImpl : public memscale::detail::wrapper_module {
 public:
  PlanningProbeImpl(std::weak_ptr<attachment> owner, std::size_t chain, torch::nn::AnyModule original)
      : wrapper_module("memscale::PlanningProbe"),
        owner_(std::move(owner)),
        chain_(chain),
        original_(std::move(original)) {}
  torch::Tensor forward(torch::Tensor x);

 private:
  std::weak_ptr<attachment> owner_;
  std::size_t chain_;
  torch::nn::AnyModule original_;
};

/// Whether a slot holds one of memscale's wrappers.
inline bool is_memscale_slot(const torch::nn::AnyModule& slot) {
  const auto& p = slot.ptr();
  return std::dynamic_pointer_cast<CheckpointSegmentImpl>(p) || std::dynamic_pointer_cast<OffloadSegmentImpl>(p) ||
         std::dynamic_pointer_cast<TileSegmentImpl>(p) ||
         std::dynamic_pointer_cast<PassThroughImpl>(p) || std::dynamic_pointer_cast<AutocastSlotImpl>(p) ||
         std::dynamic_pointer_cast<PlanningProbeImpl>(p) || std::dynamic_pointer_cast<InputCaptureImpl>(p) ||
         std::dynamic_pointer_cast<ChainEndCaptureImpl>(p);
}

/// Where a chain's units come from.
enum class chain_source : std::uint8_t {
  sequential,   ///< the slots of a torch::nn::Sequential (swapped in place)
  call_sites,   ///< recorded memscale::forward calls (run through the call sequence)
  whole_model,  ///< no unit boundaries: the whole forward, one unit (offload only)
};

struct managed_chain {
  chain_ref ref;  ///< ref.sequential is null unless source is sequential
  std::vector<torch::nn::AnyModule> originals;
  bool planned = false;
  chain_source source = chain_source::sequential;
  std::vector<std::string> unit_names;     ///< call sites: "blocks.3 (Block)"
  std::vector<torch::Tensor> unit_inputs;  ///< call sites: what each call received (until planned)
  std::vector<std::size_t> positions;      ///< call sites: each unit's place in the call sequence
  bool inside_call_site = false;           ///< a Sequential first run inside a memscale::forward call
  /// Sequentials: what the model's code before it held as it began, in the
  /// example forward (slot_cost::made_before_bytes of its slot 0).
  std::int64_t made_before_bytes = 0;
  /// Call sites, per unit: where units i..group_end[i] are all the inner calls
  /// of one outer call (a group, checkpointed whole as that call where the plan
  /// makes it one run), its last unit; -1 elsewhere. The outer call's place in
  /// the sequence and its AnyModule are at the group's first unit.
  std::vector<int> group_end;
  std::vector<std::size_t> group_positions;
  std::vector<torch::nn::AnyModule> group_slots;
  /// Per unit: a checkpoint starting there keeps its matrix products (the plan
  /// chose selective recompute for it; core/decision_selective.hpp).
  std::vector<bool> keeps_products;
  /// Per unit: left in place, it keeps its saved tensors compact (the plan
  /// chose it; core/decision_masks.hpp, techniques/saved_compaction.hpp).
  std::vector<bool> compacts_saved;

  /// Whether the plan's unit [first, last] is a group run (call sites only).
  [[nodiscard]] bool is_group(int first, int last) const {
    return last > first && source == chain_source::call_sites && static_cast<std::size_t>(first) < group_end.size() &&
           group_end[static_cast<std::size_t>(first)] == last;
  }
  /// The place in the call sequence where unit [first, last] runs: the outer
  /// call's for a group, else the first unit's.
  [[nodiscard]] std::size_t position_of(int first, int last) const {
    return is_group(first, last) ? group_positions[static_cast<std::size_t>(first)]
                                 : positions[static_cast<std::size_t>(first)];
  }
  /// What runs there unoptimized: the outer call's module for a group.
  [[nodiscard]] const torch::nn::AnyModule& original_of(int first, int last) const {
    return is_group(first, last) ? group_slots[static_cast<std::size_t>(first)]
                                 : originals[static_cast<std::size_t>(first)];
  }
};

/// One memscale::forward call seen while recording.
struct call_record {
  const torch::nn::Module* module = nullptr;
  torch::nn::AnyModule slot;  ///< empty: the call cannot be a unit (why_not says why)
  std::string why_not;
  torch::Tensor input;        ///< detached (it shares the version counter)
  std::int64_t version = 0;   ///< the input's version when the call began
  int depth = 0;
  bool bound = false;  ///< the call passed arguments after its input (its slot is a BoundCallImpl)
};

/// A call of the planned sequence and what runs for it (empty: the module itself).
/// Where the plan's level is one below the outermost, the outer calls are in
/// the sequence too, each followed by its `inner` calls: an outer call with a
/// runner (its group checkpointed whole) stands for them, and the cursor
/// passes over them; one without runs directly and they follow.
struct planned_call {
  const torch::nn::Module* module = nullptr;
  torch::nn::AnyModule runner;
  int depth = 0;
  std::size_t inner = 0;  ///< an outer call: how many calls after it are its inner ones
  bool bound = false;     ///< its unit takes the call's arguments after its input (call_record::bound)
};

/// The chains of call-site units, the call sequence and the report notes of
/// one depth of recorded memscale::forward calls.
struct call_level {
  int depth = 0;
  int outer_depth = -1;  ///< >= 0: the outer calls, one depth up, are in the sequence too
  std::vector<managed_chain> chains;
  std::vector<planned_call> sequence;
  std::vector<std::string> notes;
};

/// Call sites' runners replaced for a while (a traced or a reference step):
/// put back by put_back() or, however the step ends, the destructor.
class runner_swaps {
 public:
  explicit runner_swaps(std::vector<planned_call>& sequence) : sequence_(sequence) {}
  runner_swaps(const runner_swaps&) = delete;
  runner_swaps& operator=(const runner_swaps&) = delete;
  ~runner_swaps() { put_back(); }
  void replace(std::size_t position, torch::nn::AnyModule next) {
    saved_.emplace_back(position, sequence_[position].runner);
    sequence_[position].runner = std::move(next);
  }
  void put_back() noexcept {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) sequence_[it->first].runner = std::move(it->second);
    saved_.clear();
  }

 private:
  std::vector<planned_call>& sequence_;
  std::vector<std::pair<std::size_t, torch::nn::AnyModule>> saved_;
};

}  // namespace memscale::core

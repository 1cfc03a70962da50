// memscale — attachment, call-site units (execute/attachment.hpp has the class;
// core/call_sites.hpp the rules): take_call, which memscale::forward reaches;
// recording the calls of the example or the first training forward; turning
// them into chains of call-site units and the planned call sequence (planned
// lazily at the next forward); a whole-model chain where there are no unit
// boundaries; and following the planned sequence call by call.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/core/call_sites.hpp>
#include <memscale/core/slots.hpp>
#include <memscale/detail/assert.hpp>
#include <memscale/execute/attachment.hpp>
#include <memscale/execute/attachment_apply.hpp>
#include <memscale/execute/builtin_units.hpp>
#include <memscale/execute/managed_chain.hpp>
#include <memscale/execute/planning_scope.hpp>
#include <memscale/offload/hooks.hpp>
#include <memscale/techniques/checkpoint.hpp>

namespace memscale::core {

/// Whether a backward began since `epoch` (offload::backwards_started());
/// only memscale's hooks engine counts them.
inline bool backward_began_since(std::uint64_t epoch) {
  return offload::hooks_engine_active() && offload::backwards_started() != epoch;
}

inline call_ticket attachment::take_call(torch::nn::Module& module, int depth,
                                         const std::function<torch::nn::AnyModule()>* make_slot,
                                         const torch::Tensor* input, const char* why_not) {
  if (detail::recompute_scope::current() != nullptr || planning_on_this_thread()) return {};
  const bool training = training_call() && torch::GradMode::is_enabled() && !c10::InferenceMode::is_enabled();
  // The cursor is one forward's: a second thread's training forward is
  // refused while another thread's step is in flight (its wrappers' token).
  if (training && sites_.load() != sites_state::off) gate_->check();
  switch (sites_.load()) {
    case sites_state::waiting: {
      // Without an example input, record the first training forward.
      if (!training) return {};
      std::lock_guard<std::mutex> planning(plan_mutex_);
      if (sites_.load() == sites_state::waiting) {
        recording_epoch_ = offload::backwards_started();
        recording_thread_ = std::this_thread::get_id();
        sites_ = sites_state::recording_lazily;
      }
      [[fallthrough]];
    }
    case sites_state::recording_lazily: {
      // One thread records one forward; another thread's calls run plainly
      // until the recording is over (a backward began since; without
      // memscale's hooks engine, only the recording thread can tell).
      bool recorder = false;
      {
        std::lock_guard<std::mutex> planning(plan_mutex_);
        recorder = recording_thread_ == std::this_thread::get_id() || backward_began_since(recording_epoch_);
      }
      if (!recorder) return {};
      if (recording_complete(module, depth)) {
        plan_recorded_calls();
        return sites_.load() == sites_state::active ? next_call(module, depth) : call_ticket{};
      }
      [[fallthrough]];
    }
    case sites_state::recording:
      record(module, depth, make_slot, input, why_not);
      return {};
    case sites_state::active: return next_call(module, depth);
    case sites_state::off: return {};
  }
  return {};
}

inline void attachment::record(torch::nn::Module& module, int depth,
                               const std::function<torch::nn::AnyModule()>* make_slot, const torch::Tensor* input,
                               const char* why_not) {
  if (records_.size() >= max_recorded_calls) return;
  call_record r;
  r.module = &module;
  r.depth = depth;
  if (make_slot != nullptr) {
    try {
      r.slot = (*make_slot)();
    } catch (const std::bad_weak_ptr&) {
      r.why_not = "the module is not owned by a std::shared_ptr (build it through its ModuleHolder, "
                  "std::make_shared or register_module)";
    }
  } else if (why_not != nullptr) {
    r.why_not = why_not;
  }
  r.bound = !r.slot.is_empty() && dynamic_cast<const memscale::detail::bound_slot*>(r.slot.ptr().get()) != nullptr;
  if (input != nullptr && !r.slot.is_empty()) {
    r.input = input->detach();
    r.version = r.input._version();
  }
  records_.push_back(std::move(r));
}

inline bool attachment::recording_complete(const torch::nn::Module& module, int depth) const {
  if (records_.empty()) return false;
  if (records_.size() >= max_recorded_calls) return true;
  if (offload::hooks_engine_active()) return backward_began_since(recording_epoch_);
  return depth == records_.front().depth && &module == records_.front().module;
}

inline std::vector<call_record> attachment::one_forward(std::vector<call_record> records) {
  const auto n = records.size();
  for (std::size_t p = 1; p < n; ++p) {
    if (n % p != 0) continue;
    bool periodic = true;
    for (std::size_t i = p; i < n && periodic; ++i)
      periodic = records[i].module == records[i % p].module && records[i].depth == records[i % p].depth;
    if (periodic) {
      records.resize(p);
      break;
    }
  }
  return records;
}

inline void attachment::plan_recorded_calls() {
  std::lock_guard<std::mutex> planning(plan_mutex_);
  if (sites_.load() != sites_state::recording_lazily) return;
  try {
    const auto added = add_call_chains(/*lazy=*/true);
    if (added.empty()) {
      sites_ = sites_state::off;
      pending_notes_.clear();
      finer_.reset();
      return;
    }
    std::vector<torch::Tensor> inputs(chains_.size());
    for (auto c : added) inputs[c] = chains_[c].unit_inputs.front();
    commit_plan(added, inputs, /*probe_the_others=*/false);
  } catch (...) {
    sites_ = sites_state::off;
    pending_sequence_.clear();
    pending_notes_.clear();
    finer_.reset();
    throw;
  }
}

inline std::vector<std::size_t> attachment::add_call_chains(bool lazy) {
  auto records = std::move(records_);
  records_.clear();
  if (lazy) records = one_forward(std::move(records));
  // Calls inside a Sequential memscale manages run in its slots, its units.
  std::vector<std::string> managed;
  for (const auto& chain : chains_)
    if (chain.source == chain_source::sequential && !chain.inside_call_site) managed.push_back(chain.ref.path);
  const auto in_managed = [&](const torch::nn::Module* m) {
    const auto it = paths_.find(m);
    if (it == paths_.end()) return false;
    return std::any_of(managed.begin(), managed.end(), [&](const std::string& p) {
      return p.empty() || it->second == p || it->second.rfind(p + ".", 0) == 0;
    });
  };
  excluded_.clear();
  std::vector<const call_record*> eligible;
  for (const auto& r : records) {
    if (in_managed(r.module)) excluded_.insert(r.module);
    else eligible.push_back(&r);
  }
  // The outermost depth with at least two calls (else the outermost), and the
  // next depth below it with at least two calls, which plan() weighs against it.
  // Counted: calls that can be units (an outer call passing a tensor that needs a
  // gradient is none, its inner calls may be), or
  // every call where none can (the notes then say why).
  std::map<int, int> per_depth;
  for (const auto* r : eligible)
    if (!r->slot.is_empty()) ++per_depth[r->depth];
  if (per_depth.empty())
    for (const auto* r : eligible) ++per_depth[r->depth];
  const auto two_calls_below = [&](int above) -> std::optional<int> {
    for (const auto& [d, n] : per_depth)
      if (d > above && n >= 2) return d;
    return std::nullopt;
  };
  level_ = two_calls_below(std::numeric_limits<int>::min())
               .value_or(per_depth.empty() ? 0 : per_depth.begin()->first);
  outer_level_ = -1;
  const auto finer_depth = two_calls_below(level_);
  auto coarse = build_call_level(eligible, level_, lazy);
  if (!per_depth.empty() && level_ > per_depth.begin()->first && !coarse.notes.empty())
    coarse.notes.front() += "; the outermost depth has a single call, so the plan goes one level finer";
  finer_.reset();
  coarse_ids_.clear();
  if (finer_depth && !agree_) {
    // One depth below: the outer calls join the sequence, so that a group of
    // their inner calls can be checkpointed as the outer call.
    auto finer = build_call_level(eligible, *finer_depth, lazy, *finer_depth == level_ + 1 ? level_ : -1);
    if (!finer.chains.empty()) finer_ = std::move(finer);
  }
  pending_sequence_ = std::move(coarse.sequence);
  pending_notes_ = std::move(coarse.notes);
  coarse_note_count_ = pending_notes_.size();
  std::vector<std::size_t> added;
  for (auto& chain : coarse.chains) {
    chains_.push_back(std::move(chain));
    added.push_back(chains_.size() - 1);
  }
  coarse_ids_ = added;
  if (!excluded_.empty())
    pending_notes_.push_back(std::to_string(excluded_.size()) + " module(s) called through memscale::forward inside "
                             "a managed Sequential run directly: that Sequential's slots are the units there");
  for (const auto& chain : chains_)
    if (chain.source == chain_source::sequential && chain.inside_call_site)
      pending_notes_.push_back("Sequential '" + chain.ref.path + "' runs inside a memscale::forward call: it is "
                               "part of that unit, not planned on its own");
  return added;
}

inline call_level attachment::build_call_level(const std::vector<const call_record*>& eligible, int depth,
                                                           bool lazy, int outer) const {
  call_level out;
  out.depth = depth;
  out.outer_depth = outer;
  std::unordered_map<const torch::nn::Module*, int> calls_of;
  bool is_open = false;
  int nested = 0, around = 0;
  std::vector<std::string> direct;
  // The outer call whose inner calls come now (outer >= 0: one depth up): its
  // inner calls are a group where they are all units of one chain, two or more.
  struct open_group {
    std::size_t position = 0;
    torch::nn::AnyModule slot;
    std::size_t chain = 0;
    int first = -1;
    int count = 0;
    bool ok = true;
  };
  std::optional<open_group> group;
  const auto close_group = [&] {
    if (group && group->ok && group->count >= 2 && !group->slot.is_empty()) {
      auto& chain = out.chains[group->chain];
      const auto first = static_cast<std::size_t>(group->first);
      chain.group_end[first] = group->first + group->count - 1;
      chain.group_positions[first] = group->position;
      chain.group_slots[first] = group->slot;
    }
    group.reset();
  };
  for (const auto* r : eligible) {
    if (outer >= 0 && r->depth <= outer) close_group();
    if (outer >= 0 && r->depth == outer) {
      around += 1;
      // An outer call that changed its input in place cannot be checkpointed
      // whole (its recompute would read the changed input): no group.
      const bool in_place = r->input.defined() && r->input._version() != r->version;
      group = open_group{out.sequence.size(), in_place ? torch::nn::AnyModule() : r->slot};
      out.sequence.push_back({r->module, {}, outer, 0, r->bound});
      continue;
    }
    if (r->depth != depth) {
      (r->depth > depth ? nested : around) += 1;
      continue;
    }
    const auto position = out.sequence.size();
    out.sequence.push_back({r->module, {}, depth, 0, r->bound});
    if (group) ++out.sequence[group->position].inner;
    if (r->slot.is_empty()) {
      is_open = false;
      if (group) group->ok = false;
      const auto line = "call site '" + path_of(r->module) + "' (" + type_name(*r->module) + ") runs as it is: " +
                        r->why_not;
      if (std::find(direct.begin(), direct.end(), line) == direct.end()) direct.push_back(line);
      continue;
    }
    if (!is_open) {
      managed_chain chain;
      chain.source = chain_source::call_sites;
      out.chains.push_back(std::move(chain));
      is_open = true;
    }
    auto& chain = out.chains.back();
    if (group) {
      if (group->count == 0) {
        group->chain = out.chains.size() - 1;
        group->first = static_cast<int>(chain.originals.size());
      } else if (group->chain != out.chains.size() - 1) {
        group->ok = false;
      }
      ++group->count;
    }
    auto name = path_of(r->module) + " (" + type_name(*r->module) + ")";
    if (const int k = ++calls_of[r->module]; k > 1) name += " call " + std::to_string(k);
    chain.originals.push_back(r->slot);
    chain.unit_inputs.push_back(r->input);
    chain.positions.push_back(position);
    chain.unit_names.push_back(std::move(name));
    chain.group_end.push_back(-1);
    chain.group_positions.push_back(0);
    chain.group_slots.emplace_back();
  }
  close_group();
  int units = 0;
  for (auto& chain : out.chains) {
    chain.ref.path = "memscale::forward call sites " +
                     chain.unit_names.front().substr(0, chain.unit_names.front().find(' ')) + " .. " +
                     chain.unit_names.back().substr(0, chain.unit_names.back().find(' '));
    units += static_cast<int>(chain.originals.size());
  }
  const auto calls = std::count_if(out.sequence.begin(), out.sequence.end(),
                                   [depth](const planned_call& c) { return c.depth == depth; });
  if (calls > 0) {
    std::string line = "call sites: " + std::to_string(calls) + " memscale::forward call(s) per " +
                       "forward at depth " + std::to_string(depth) + ", " + std::to_string(units) +
                       " of them planned as units";
    if (nested > 0)
      line += "; " + std::to_string(nested) + " nested call(s) inside them run directly (a unit's recompute "
              "re-runs its nested calls anyway)";
    if (around > 0)
      line += "; the " + std::to_string(around) + " call(s) around them at depth " + std::to_string(depth - 1) +
              (depth > 1 ? " and above" : "") + " run directly (their inner calls are the units)" +
              (outer >= 0 ? ", but for those the plan checkpoints whole" : "");
    line += lazy ? "; recorded over the first training forward" : "; recorded from the example forward";
    out.notes.push_back(std::move(line));
  }
  for (auto& line : direct) out.notes.push_back(std::move(line));
  return out;
}

inline void attachment::add_whole_model_chain() {
  managed_chain chain;
  chain.source = chain_source::whole_model;
  chain.ref.path = "<whole model> " + root_name();
  auto root = root_.lock();
  MEMSCALE_ASSERT(root != nullptr, "the model outlived its wrap() call");
  chain.originals.push_back(torch::nn::AnyModule(std::make_shared<WholeModelImpl>(root, whole_forward_)));
  chains_.push_back(std::move(chain));
  // Calls recorded but none a unit (each passes a tensor needing a gradient, or
  // returns other than one Tensor): said apart.
  const bool calls = std::any_of(pending_notes_.begin(), pending_notes_.end(),
                                 [](const std::string& n) { return n.rfind("call sites: ", 0) == 0; });
  pending_notes_.push_back(
      std::string("no unit boundaries: the model has no torch::nn::Sequential and ") +
      (calls ? "none of its memscale::forward calls is a unit (a unit's call takes a Tensor, then copyable "
               "arguments that need no gradient, and returns one Tensor; the notes above say why each call "
               "runs directly)"
             : "its forward makes no memscale::forward call") +
      ", so checkpointing and tiling cannot apply. Write `x = memscale::forward(*blocks[i], x);` where "
      "your forward calls its blocks to get them. What needs no boundaries applies: offload of every tensor "
      "autograd saves on the thread that called wrap/optimize while the model is wrapped (the forward and "
      "the loss), the 8-bit optimizer (memscale::make_optimizer), and mixed precision through "
      "memscale::autocast_scope around your forward" + memscale::detail::builtin_stack_suffix(*root));
}

inline call_ticket attachment::next_call(const torch::nn::Module& module, int depth) {
  if ((depth != level_ && depth != outer_level_) || sequence_.empty() || excluded_.count(&module) != 0) return {};
  if (!torch::GradMode::is_enabled() || c10::InferenceMode::is_enabled()) return {};  // nothing is saved
  const auto epoch = offload::backwards_started();
  if (epoch != cursor_epoch_) {
    end_forward();
    cursor_epoch_ = epoch;
  }
  if (diverged_) return {};
  const auto is = [&](const planned_call& call) { return call.module == &module && call.depth == depth; };
  const bool first = is(sequence_.front());
  if (cursor_ == sequence_.size() && first) {
    cursor_ = 0;  // the sequence completed: a new forward
  } else if (cursor_ > 0 && cursor_ < sequence_.size() && !is(sequence_[cursor_]) && first) {
    end_forward();  // a shorter forward ended; this call starts the next
  }
  if (cursor_ >= sequence_.size() || !is(sequence_[cursor_])) {
    // The outer calls are in the sequence only where the plan runs one whole:
    // another one runs directly, as calls at other depths do.
    if (depth == outer_level_) return {};
    diverged_ = true;
    const auto n = ++diverged_forwards_;
    if (n <= 5 && log_.wants(spdlog::level::warn))
      log_.warn("memscale::forward call " + std::to_string(cursor_) + " of this forward is '" + path_of(&module) +
                "', but the plan recorded " +
                (cursor_ < sequence_.size() ? "'" + path_of(sequence_[cursor_].module) + "'"
                                            : std::to_string(sequence_.size()) + " calls") +
                "; the rest of this forward runs unoptimized" +
                (n == 5 ? " (further occurrences are only counted in the report)" : ""));
    return {};
  }
  const auto& call = sequence_[cursor_];
  // An outer call checkpointed whole stands for its inner calls: they run
  // inside it directly, and the cursor passes over them.
  if (call.inner > 0 && !call.runner.is_empty()) {
    cursor_ += 1 + call.inner;
    return {call.runner, true, call.bound};
  }
  ++cursor_;
  return {call.runner, false, call.bound};
}

}  // namespace memscale::core

// memscale — twin slots: slots of one chain that are the same computation (the
// same module type with the same submodules, parameter and buffer shapes, on an
// input of the same shape, measured the same way) get the same figures: each
// measured figure is the median of the twins' measurements.
//
// Measured one at a time, twins differ only by noise: the benchmark GPT's six
// MLP halves were timed 8.5-10.8 ms forward and 11.3-14.6 ms backward, and one
// of them read 0 for what keeping its products saves (the copy it subtracts
// paid fresh pages there). The planner, which ranks units by bytes freed per
// second of recompute, then picked a different twin in each fresh process, and
// a trial and the training after it could plan differently. The median of the
// twins is the same figure for each of them, so the plan picks among exact
// ties, which it breaks by position, the same in every run; it also takes one
// outlier in three or more out.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <memscale/core/graph.hpp>

namespace memscale::detail {

/// What makes two slots the same computation: the module's type, its
/// submodules' types and training flags, its parameters' and buffers' names,
/// shapes, types, devices and whether they take gradients, and what the
/// profile says of its input, its output and how it was measured (the source,
/// and the note, which names a part of the batch where it was measured on one).
/// Figures measured by noise (times, saved and transient bytes, what a
/// recompute or compaction keeps) are left out: those are what twins pool.
inline std::string twin_key(const torch::nn::Module& module, const slot_cost& s, profile_source source,
                            const std::string& note) {
  std::ostringstream key;
  for (const auto& item : module.named_modules("", /*include_self=*/true))
    key << item.key() << ':' << item.value()->name() << (item.value()->is_training() ? "+" : "-") << ';';
  const auto tensor = [&](const std::string& name, const torch::Tensor& t) {
    key << name << '=' << t.sizes() << t.scalar_type() << t.device() << (t.requires_grad() ? "g" : "") << ';';
  };
  key << '|';
  for (const auto& p : module.named_parameters(/*recurse=*/true)) tensor(p.key(), p.value());
  key << '|';
  for (const auto& b : module.named_buffers(/*recurse=*/true)) tensor(b.key(), b.value());
  key << '|' << s.input_bytes << ',' << s.output_bytes << ',' << s.output_is_view << s.saves_input << s.saves_output
      << s.mutates_input << s.backward_from_input << ',' << s.row_dims;
  for (const auto e : s.input_extents) key << ',' << e;
  key << '|' << static_cast<int>(source) << '|' << note;
  return key.str();
}

/// The lower median of `values` (one of them: twins keep a figure some twin measured).
template <class T>
T lower_median(std::vector<T> values) {
  const auto middle = values.begin() + static_cast<std::ptrdiff_t>((values.size() - 1) / 2);
  std::nth_element(values.begin(), middle, values.end());
  return *middle;
}

/// Gives each group of twins in `profile` (two or more slots with the same
/// twin_key) the median of its measured figures, field by field, and says so in
/// each twin's note (figures that are not measured, a static rule's bytes or
/// times from the rates, agree already and stay as they are). `slots` are the
/// chain's modules, in the profile's order.
inline void pool_twins(chain_profile& profile, const std::vector<torch::nn::AnyModule>& slots) {
  const auto n = std::min(slots.size(), profile.slots.size());
  if (profile.notes.size() < n || profile.sources.size() < n) return;
  std::map<std::string, std::vector<std::size_t>> groups;
  for (std::size_t k = 0; k < n; ++k)
    groups[twin_key(*slots[k].ptr(), profile.slots[k], profile.sources[k], profile.notes[k])].push_back(k);
  for (const auto& [key, members] : groups) {
    if (members.size() < 2) continue;
    const auto median = [&](auto field) {
      std::vector<std::remove_cvref_t<decltype(profile.slots[members[0]].*field)>> values;
      for (const auto k : members) values.push_back(profile.slots[k].*field);
      return lower_median(std::move(values));
    };
    slot_cost pooled = profile.slots[members[0]];
    pooled.forward_seconds = median(&slot_cost::forward_seconds);
    pooled.backward_seconds = median(&slot_cost::backward_seconds);
    pooled.replay_saved_seconds = std::min(median(&slot_cost::replay_saved_seconds), pooled.forward_seconds);
    pooled.product_saved_seconds = std::min(median(&slot_cost::product_saved_seconds), pooled.forward_seconds);
    pooled.compact_seconds = median(&slot_cost::compact_seconds);
    pooled.saved_bytes = median(&slot_cost::saved_bytes);
    pooled.workspace_bytes = median(&slot_cost::workspace_bytes);
    pooled.backward_workspace_bytes = median(&slot_cost::backward_workspace_bytes);
    pooled.replay_kept_bytes = median(&slot_cost::replay_kept_bytes);
    pooled.product_kept_bytes = median(&slot_cost::product_kept_bytes);
    pooled.returned_product_bytes = std::min(median(&slot_cost::returned_product_bytes), pooled.product_kept_bytes);
    pooled.compact_bytes = std::min(median(&slot_cost::compact_bytes), pooled.saved_bytes);
    pooled.compact_transient_bytes = std::min(median(&slot_cost::compact_transient_bytes), pooled.compact_bytes);
    pooled.offload_kept_bytes = std::min(median(&slot_cost::offload_kept_bytes), pooled.saved_bytes);
    std::string named;
    for (const auto k : members) named += (named.empty() ? "" : ", ") + std::to_string(k);
    for (const auto k : members) {
      profile.slots[k] = pooled;
      profile.notes[k] += "; figures: the median of its " + std::to_string(members.size()) +
                          " twins (slots " + named + ": the same module, shapes and input)";
    }
  }
}

}  // namespace memscale::detail

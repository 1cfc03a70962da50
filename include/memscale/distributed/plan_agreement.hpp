// memscale::distributed — every rank applies one plan, rank 0's. Each rank
// profiles its chains as usual; before anything is applied the ranks check over
// the process group that they profiled the same chains with the same techniques
// allowed (an error naming the ranks that differ otherwise), and rank 0's plan
// is broadcast to the others as int64 words (doubles by bit pattern: exact).
#pragma once

#include <bit>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/core/decision_engine.hpp>
#include <memscale/execute/executor.hpp>
#include <memscale/core/graph.hpp>
#include <memscale/detail/assert.hpp>
#include <memscale/distributed/c10d.hpp>
#include <memscale/distributed/process_group.hpp>
#include <memscale/errors.hpp>

namespace memscale::distributed {

/// The techniques a rank may apply (its Strategy and Config allow them): ranks
/// that differ here could not apply one plan.
struct plan_capabilities {
  bool checkpoint = false;
  bool offload = false;
  bool tile = false;
  bool mixed_precision = false;  ///< not a technique of the plan, but it changes every optimized layer's numerics
  friend bool operator==(const plan_capabilities&, const plan_capabilities&) = default;
};

namespace detail {

inline constexpr std::int64_t plan_magic = 0x6d73'706c'616e;  // "msplan"

/// Appends an engine_plan's fields to `out`. The structured bindings stop
/// compiling when a field is added to the plan's types: extend both functions then.
inline std::vector<std::int64_t> serialize_plan(const core::engine_plan& plan) {
  std::vector<std::int64_t> out{plan_magic};
  auto put = [&](auto v) {
    if constexpr (std::is_floating_point_v<decltype(v)>)
      out.push_back(std::bit_cast<std::int64_t>(static_cast<double>(v)));
    else
      out.push_back(static_cast<std::int64_t>(v));
  };
  const auto& [pressure, baseline_peak, planned_peak, target_bytes, overall, units, segment_length, decisions,
               overrides] = plan;
  put(pressure), put(baseline_peak), put(planned_peak), put(target_bytes), put(overall);
  put(units.size());
  for (const auto& chain : units) {
    put(chain.size());
    for (const auto& u : chain) {
      const auto& [first, last, checkpointed, offloaded, tiles, tile_dim] = u;
      put(first), put(last), put(checkpointed), put(offloaded), put(tiles), put(tile_dim);
    }
  }
  put(segment_length.size());
  for (int length : segment_length) put(length);
  put(decisions.size());
  for (const auto& d : decisions) {
    const auto& [chain, first, last, checkpointed, rule, freed_bytes, recompute_seconds, peak_before, peak_after,
                 offloaded, compute_seconds, tiles, tile_dim] = d;
    put(chain), put(first), put(last), put(checkpointed), put(rule), put(freed_bytes), put(recompute_seconds);
    put(peak_before), put(peak_after), put(offloaded), put(compute_seconds), put(tiles), put(tile_dim);
  }
  put(overrides.size());
  for (const auto& o : overrides) {
    const auto& [chain, greedy_seconds, optimal_seconds, greedy_peak, optimal_peak, budget] = o;
    put(chain), put(greedy_seconds), put(optimal_seconds), put(greedy_peak), put(optimal_peak), put(budget);
  }
  return out;
}

/// The inverse of serialize_plan; throws DistributedError on words it did not write.
inline core::engine_plan deserialize_plan(const std::vector<std::int64_t>& words) {
  std::size_t at = 0;
  auto next = [&]() -> std::int64_t {
    if (at >= words.size()) throw DistributedError("memscale: the plan received from rank 0 is truncated");
    return words[at++];
  };
  auto get = [&](auto& field) {
    using T = std::remove_reference_t<decltype(field)>;
    const auto word = next();
    if constexpr (std::is_floating_point_v<T>)
      field = static_cast<T>(std::bit_cast<double>(word));
    else
      field = static_cast<T>(word);
  };
  auto count = [&] {
    const auto n = next();
    if (n < 0 || static_cast<std::size_t>(n) > words.size())
      throw DistributedError("memscale: the plan received from rank 0 is malformed");
    return static_cast<std::size_t>(n);
  };
  if (next() != plan_magic) throw DistributedError("memscale: the plan received from rank 0 is not a memscale plan");
  core::engine_plan plan;
  auto& [pressure, baseline_peak, planned_peak, target_bytes, overall, units, segment_length, decisions, overrides] =
      plan;
  get(pressure), get(baseline_peak), get(planned_peak), get(target_bytes), get(overall);
  units.resize(count());
  for (auto& chain : units) {
    chain.resize(count());
    for (auto& u : chain) {
      auto& [first, last, checkpointed, offloaded, tiles, tile_dim] = u;
      get(first), get(last), get(checkpointed), get(offloaded), get(tiles), get(tile_dim);
    }
  }
  segment_length.resize(count());
  for (auto& length : segment_length) get(length);
  decisions.resize(count());
  for (auto& d : decisions) {
    auto& [chain, first, last, checkpointed, rule, freed_bytes, recompute_seconds, peak_before, peak_after, offloaded,
           compute_seconds, tiles, tile_dim] = d;
    get(chain), get(first), get(last), get(checkpointed), get(rule), get(freed_bytes), get(recompute_seconds);
    get(peak_before), get(peak_after), get(offloaded), get(compute_seconds), get(tiles), get(tile_dim);
  }
  overrides.resize(count());
  for (auto& o : overrides) {
    auto& [chain, greedy_seconds, optimal_seconds, greedy_peak, optimal_peak, budget] = o;
    get(chain), get(greedy_seconds), get(optimal_seconds), get(greedy_peak), get(optimal_peak), get(budget);
  }
  if (at != words.size()) throw DistributedError("memscale: the plan received from rank 0 has trailing words");
  return plan;
}

/// What ranks must share to apply one plan, in four words: chains, slots, a
/// fingerprint of the chains' paths and slot types, and the capabilities.
struct structure_summary {
  std::int64_t chains = 0;
  std::int64_t slots = 0;
  std::int64_t fingerprint = 0;
  std::int64_t capabilities = 0;
  friend bool operator==(const structure_summary&, const structure_summary&) = default;
};

inline structure_summary summarize(const std::vector<chain_profile>& profiles, const plan_capabilities& can) {
  std::uint64_t hash = 14695981039346656037ull;  // FNV-1a
  auto mix = [&](std::string_view text) {
    for (unsigned char ch : text) hash = (hash ^ ch) * 1099511628211ull;
    hash = (hash ^ 0xffu) * 1099511628211ull;  // separator
  };
  structure_summary s;
  s.chains = static_cast<std::int64_t>(profiles.size());
  for (const auto& p : profiles) {
    s.slots += static_cast<std::int64_t>(p.slot_names.size());
    mix(p.path);
    mix(p.supported ? "supported" : "unsupported");
    for (const auto& name : p.slot_names) mix(name);
  }
  s.fingerprint = static_cast<std::int64_t>(hash);
  s.capabilities = (can.checkpoint ? 1 : 0) | (can.offload ? 2 : 0) | (can.tile ? 4 : 0) | (can.mixed_precision ? 8 : 0);
  return s;
}

inline std::string describe(const structure_summary& s) {
  std::ostringstream os;
  os << s.chains << " chain(s) of " << s.slots << " slot(s) (fingerprint " << std::hex
     << static_cast<std::uint64_t>(s.fingerprint) << std::dec << "), techniques allowed:";
  const char* names[] = {" checkpoint", " offload", " tile", " mixed-precision"};
  bool any = false;
  for (int bit = 0; bit < 4; ++bit)
    if (s.capabilities & (std::int64_t{1} << bit)) os << names[bit], any = true;
  if (!any) os << " none";
  return os.str();
}

/// Collectives run on CPU tensors, except with NCCL, which takes CUDA ones.
inline torch::Device exchange_device(const process_group& group) {
  std::string backend;
  try {
    backend = group->getBackendName();
  } catch (const std::exception&) {  // 1.13: a process group class that does not say
  }
  return backend == "nccl" ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
}

/// Every rank's summary; throws (on every rank alike) when any differs from rank 0's.
inline void check_same_structure(const process_group& group, const structure_summary& mine) {
  const int world = group->getSize();
  const int rank = group->getRank();
  const auto device = exchange_device(group);
  std::vector<torch::Tensor> input{
      torch::tensor({mine.chains, mine.slots, mine.fingerprint, mine.capabilities}, torch::kInt64).to(device)};
  std::vector<std::vector<torch::Tensor>> output(1);
  for (int r = 0; r < world; ++r) output[0].push_back(torch::empty({4}, input[0].options()));
  collective_step("comparing the model's chains across ranks (planning)", rank, world,
                  [&] { group->allgather(output, input)->wait(); });
  std::vector<structure_summary> all;
  for (const auto& t : output[0]) {
    const auto cpu = t.cpu();
    const auto* w = cpu.data_ptr<std::int64_t>();
    all.push_back({w[0], w[1], w[2], w[3]});
  }
  std::vector<int> differ;
  for (int r = 1; r < world; ++r)
    if (!(all[static_cast<std::size_t>(r)] == all[0])) differ.push_back(r);
  if (differ.empty()) return;
  std::ostringstream os;
  os << "memscale: the ranks cannot apply one plan: rank";
  for (std::size_t i = 0; i < differ.size(); ++i) os << (i ? ", " : " ") << differ[i];
  os << (differ.size() == 1 ? " differs" : " differ")
     << " from rank 0 in the chains they profiled or the techniques their Strategy and Config allow. ";
  for (int r = 0; r < world; ++r) os << "rank " << r << ": " << describe(all[static_cast<std::size_t>(r)]) << ". ";
  os << "Every rank must build the same model and pass the same Strategy and Config techniques.";
  throw DistributedError(os.str());
}

/// Sends rank 0's words to every rank (a length, then the words).
inline std::vector<std::int64_t> broadcast_words(const process_group& group, std::vector<std::int64_t> words) {
  const int world = group->getSize();
  const int rank = group->getRank();
  const auto device = exchange_device(group);
  const auto cpu_int64 = torch::TensorOptions().dtype(torch::kInt64);
  std::vector<torch::Tensor> length{
      torch::tensor({static_cast<std::int64_t>(words.size())}, cpu_int64).to(device)};
  collective_step("receiving rank 0's plan", rank, world, [&] { group->broadcast(length)->wait(); });
  const auto n = length[0].cpu().item<std::int64_t>();
  std::vector<torch::Tensor> payload{
      rank == 0 ? torch::from_blob(words.data(), {n}, cpu_int64).clone().to(device) : torch::empty({n}, cpu_int64.device(device))};
  collective_step("receiving rank 0's plan", rank, world, [&] { group->broadcast(payload)->wait(); });
  const auto received = payload[0].cpu().contiguous();
  const auto* w = received.data_ptr<std::int64_t>();
  return {w, w + n};
}

}  // namespace detail

/// The plan_agreement that makes every rank apply rank 0's plan. Without an
/// example input each chain plans at its first training forward, and this runs
/// there: every rank runs the same forwards in the same order (data parallel
/// training), so they reach these collectives together.
inline core::plan_agreement rank0_plan(process_group group, plan_capabilities can) {
  if (!group) throw Error("memscale::distributed: no process group (a null c10d::ProcessGroup): make one first");
  return [group = std::move(group), can](const std::vector<chain_profile>& profiles,
                                         core::engine_plan local) -> core::engine_plan {
    detail::check_same_structure(group, detail::summarize(profiles, can));
    const bool root = group->getRank() == 0;
    auto words = detail::broadcast_words(group, root ? detail::serialize_plan(local) : std::vector<std::int64_t>{});
    if (root) return local;
    auto plan = detail::deserialize_plan(words);
    // Same chains (checked above), so rank 0's units cover this rank's slots.
    MEMSCALE_ASSERT(plan.units.size() == profiles.size(), "rank 0's plan has another number of chains");
    for (std::size_t c = 0; c < profiles.size(); ++c) {
      int next = 0;
      for (const auto& u : plan.units[c]) {
        MEMSCALE_ASSERT(u.first == next && u.last >= u.first, "rank 0's plan leaves a gap in a chain");
        next = u.last + 1;
      }
      MEMSCALE_ASSERT(next == static_cast<int>(profiles[c].slot_names.size()) || plan.units[c].empty(),
                      "rank 0's plan does not cover this rank's chain");
    }
    return plan;
  };
}

}  // namespace memscale::distributed

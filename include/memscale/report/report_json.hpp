// memscale — the Report as JSON (Report::to_json, Report::from_json): every
// field of the Report, each decision's line as the text report prints it, and a
// summary of the figures the text derives (static bytes, recompute time, units
// per technique), under a schema name and version. Reading takes back what
// writing wrote (the summary and the lines are derived, and ignored); a
// document of another schema or version is refused with an Error saying which.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <memscale/config.hpp>
#include <memscale/core/decisions.hpp>
#include <memscale/core/graph.hpp>
#include <memscale/core/memory_model.hpp>
#include <memscale/core/plan.hpp>
#include <memscale/device/hardware.hpp>
#include <memscale/errors.hpp>
#include <memscale/observability/config_json.hpp>
#include <memscale/offload/engine_options.hpp>
#include <memscale/policy/decision.hpp>
#include <memscale/version.hpp>

namespace memscale {

inline constexpr const char* report_json_schema = "memscale.report";
inline constexpr int report_json_schema_version = 1;

NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(gpu_info, index, name, total_bytes, free_bytes)
// With defaults: a report written before blas_core and blas_warning existed still reads.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(HardwareInfo, host_total_bytes, host_available_bytes, cpu_threads, gpus,
                                                blas_core, blas_warning)
// With defaults: a report written before made_before_bytes, offload_kept_bytes or fixed_workspace_bytes existed
// still reads (as 0).
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(slot_cost, input_bytes, made_before_bytes, output_bytes, output_is_view,
                                                saved_bytes, offload_kept_bytes, saves_input, saves_output, mutates_input,
                                                backward_from_input, workspace_bytes, backward_workspace_bytes,
                                                fixed_workspace_bytes, forward_seconds, backward_seconds,
                                                replay_saved_seconds, replay_kept_bytes, product_saved_seconds,
                                                product_kept_bytes, returned_product_bytes, keeps_products, row_dims,
                                                input_extents)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(chain_profile, path, slot_names, slots, sources, notes, input_shape, supported,
                                   unsupported_reason, caveats)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(CorrectnessCheck, passed, tolerance, tolerance_reason, parameters, buffers,
                                   loss_baseline, loss_optimized, max_relative_difference, largest_at)
NLOHMANN_JSON_SERIALIZE_ENUM(profile_source, {{profile_source::static_rule, "static"},
                                              {profile_source::empirical, "empirical"}})
NLOHMANN_JSON_SERIALIZE_ENUM(DeviceKind, {{DeviceKind::cpu, "cpu"}, {DeviceKind::cuda, "cuda"},
                                          {DeviceKind::other, "other"}})
NLOHMANN_JSON_SERIALIZE_ENUM(DecisionSource, {{DecisionSource::user_config, "user_config"},
                                              {DecisionSource::rule, "rule"},
                                              {DecisionSource::ml, "ml"},
                                              {DecisionSource::rule_fallback, "rule_fallback"}})
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(StrategyContext, device, budget_given, usable_bytes, parameter_bytes,
                                   static_bytes, baseline_peak_bytes, target_bytes, checkpoint_floor_bytes,
                                   offload_floor_bytes, step_seconds, recompute_floor_seconds,
                                   offload_bytes_per_second, batch_size, units, linear_units, conv_units,
                                   norm_units, block_units, other_units, call_sites)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(StrategyChoice, mode, checkpoint, offload)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(measured_point, chain, unit, backward, bytes)

namespace offload {
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(tier_usage, bytes, peak, tensors, written, read)
// With defaults: a document written before served_before_written existed reads it as 0.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(engine_stats, tiers, spills, pinned_failures, disk_failures,
                                                bytes_written, bytes_read, transfer_seconds, timed_bytes, wait_seconds,
                                                prefetch_hits, prefetch_misses, batches, batched_tensors,
                                                kernel_gathers, warnings, served_before_written)
}  // namespace offload

namespace core {
NLOHMANN_JSON_SERIALIZE_ENUM(rule_id, {{rule_id::low_pressure_skip, "low_pressure_skip"},
                                       {rule_id::checkpointing_disabled, "checkpointing_disabled"},
                                       {rule_id::unsupported_chain, "unsupported_chain"},
                                       {rule_id::checkpoint_segment, "checkpoint_segment"},
                                       {rule_id::keep_fits, "keep_fits"},
                                       {rule_id::keep_no_gain, "keep_no_gain"},
                                       {rule_id::refine_segment, "refine_segment"},
                                       {rule_id::offload_segment, "offload_segment"},
                                       {rule_id::offload_no_room, "offload_no_room"},
                                       {rule_id::tile_segment, "tile_segment"},
                                       {rule_id::optimal_schedule, "optimal_schedule"}})
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(unit, first, last, checkpointed, offloaded, tiles, tile_dim)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(segment_decision, chain, first, last, checkpointed, rule, freed_bytes,
                                   recompute_seconds, peak_before, peak_after, offloaded, compute_seconds, tiles,
                                   tile_dim)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(optimal_override, chain, greedy_seconds, optimal_seconds, greedy_peak,
                                   optimal_peak, budget)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(engine_plan, pressure, baseline_peak, planned_peak, target_bytes, overall, units,
                                   segment_length, decisions, overrides)
}  // namespace core

inline void to_json(nlohmann::json& j, const StrategyDecision& d) {
  j = {{"decision_source", d.decision_source}, {"choice", d.choice}, {"reason", d.reason},
       {"caller", d.caller}, {"effective", d.effective}};
  detail::put_optional(j, "confidence", d.confidence);
  j["context"] = d.context ? nlohmann::json(*d.context) : nlohmann::json(nullptr);
}

inline void from_json(const nlohmann::json& j, StrategyDecision& d) {
  j.at("decision_source").get_to(d.decision_source);
  j.at("choice").get_to(d.choice);
  j.at("reason").get_to(d.reason);
  j.at("caller").get_to(d.caller);
  j.at("effective").get_to(d.effective);
  detail::get_optional(j, "confidence", d.confidence);
  detail::get_optional(j, "context", d.context);
}

/// The JSON document of a Report (Report::to_json writes it with an indent).
[[nodiscard]] inline nlohmann::json report_document(const Report& r) {
  nlohmann::json j = {{"schema", report_json_schema},
                      {"schema_version", report_json_schema_version},
                      {"memscale_version", version_string},
                      {"hardware", r.hardware},
                      {"mode", r.mode},
                      {"device", r.device},
                      {"planned", r.planned},
                      {"budget_bytes", r.budget_bytes},
                      {"usable_bytes", r.usable_bytes},
                      {"parameter_bytes", r.parameter_bytes},
                      {"gradient_bytes", r.gradient_bytes},
                      {"optimizer_reserve_bytes", r.optimizer_reserve_bytes},
                      {"buffer_bytes", r.buffer_bytes},
                      {"earlier_chains_bytes", r.earlier_chains_bytes},
                      {"outside_allocator_bytes", r.outside_allocator_bytes},
                      {"outside_units_bytes", r.outside_units_bytes},
                      {"offload_async", r.offload_async},
                      {"offload_bytes_per_second", r.offload_bytes_per_second},
                      {"offload_rate_measured", r.offload_rate_measured},
                      {"offload_fast_bytes", r.offload_fast_bytes},
                      {"offload_spill_bytes_per_second", r.offload_spill_bytes_per_second},
                      {"offload_spill_rate_measured", r.offload_spill_rate_measured},
                      {"chains", r.chains},
                      {"plan", r.plan},
                      {"notes", r.notes},
                      {"strategy", r.strategy},
                      {"metrics_endpoint", r.metrics_endpoint},
                      {"measured_peak_bytes", r.measured_peak_bytes},
                      {"process_peak_bytes", r.process_peak_bytes},
                      {"measured_timeline", r.measured_timeline}};
  j["offload"] = r.offload ? nlohmann::json(*r.offload) : nlohmann::json(nullptr);
  j["verification"] = r.verification ? nlohmann::json(*r.verification) : nlohmann::json(nullptr);
  // Derived: what the text report computes, and each decision's line.
  std::vector<std::vector<slot_cost>> costs;
  for (const auto& chain : r.chains) costs.push_back(chain.slots);
  j["summary"] = {{"static_bytes", r.static_bytes()},
                  {"memory_pressure", r.memory_pressure()},
                  {"baseline_peak_bytes", r.baseline_peak_bytes()},
                  {"planned_peak_bytes", r.planned_peak_bytes()},
                  {"checkpointed_segments", r.checkpointed_segments()},
                  {"tiled_segments", r.tiled_segments()},
                  {"offloaded_units", r.offloaded_units()},
                  {"offloaded_bytes_per_step", core::offloaded_bytes(costs, r.plan.units)},
                  {"recompute_seconds", r.recompute_seconds()},
                  {"profiled_step_seconds", r.profiled_step_seconds()},
                  {"offload_wait_seconds", r.offload_wait_seconds()}};
  auto lines = nlohmann::json::array();
  for (const auto& d : r.plan.decisions)
    lines.push_back({{"chain", d.chain},
                     {"first", d.first},
                     {"last", d.last},
                     {"technique", Report::technique_of(d)},
                     {"rule", std::string(core::to_string(d.rule))},
                     {"text", r.decision_text(d)}});
  j["decision_lines"] = std::move(lines);
  return j;
}

/// Report::to_json's work (found by argument-dependent lookup).
[[nodiscard]] inline std::string report_json(const Report& r, int indent) {
  // A note may quote an exception's text, which need not be UTF-8.
  return report_document(r).dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

namespace detail {

/// The costs and units a Report's summary is computed from: byte counts and
/// times a step can have (no negative, none past 2^50 B or 10^9 s: a fuzzed
/// document's 9.2e18 overflowed the projection's sums), and units inside their
/// chains. Throws memscale::Error naming what is out of range.
inline void check_report_ranges(const Report& r) {
  constexpr std::int64_t most_bytes = std::int64_t{1} << 50;
  const auto bytes_ok = [&](std::int64_t b) { return b >= 0 && b <= most_bytes; };
  const auto seconds_ok = [](double s) { return std::isfinite(s) && s >= 0.0 && s <= 1e9; };
  const auto refuse = [](const std::string& what) {
    throw Error("memscale: Report::from_json: " + what + " is out of range");
  };
  if (r.plan.units.size() < r.chains.size()) refuse("the plan's unit list (fewer chains than the Report's)");
  for (const auto& [rate, name] : {std::pair{r.offload_bytes_per_second, "offload_bytes_per_second"},
                                   std::pair{r.offload_spill_bytes_per_second, "offload_spill_bytes_per_second"}})
    if (!std::isfinite(rate) || rate < 0.0 || rate > 1e15) refuse(name);
  if (r.offload_fast_bytes < -1 || r.offload_fast_bytes > most_bytes) refuse("offload_fast_bytes");
  for (std::size_t c = 0; c < r.chains.size(); ++c) {
    const auto& slots = r.chains[c].slots;
    for (std::size_t k = 0; k < slots.size(); ++k) {
      const auto& s = slots[k];
      for (const auto b : {s.input_bytes, s.made_before_bytes, s.output_bytes, s.saved_bytes, s.workspace_bytes,
                           s.backward_workspace_bytes, s.replay_kept_bytes, s.product_kept_bytes,
                           s.returned_product_bytes, s.offload_kept_bytes})
        if (!bytes_ok(b)) refuse("a byte count of chain " + std::to_string(c) + " slot " + std::to_string(k));
      if (!seconds_ok(s.forward_seconds) || !seconds_ok(s.backward_seconds) || !seconds_ok(s.replay_saved_seconds) ||
          !seconds_ok(s.product_saved_seconds))
        refuse("a time of chain " + std::to_string(c) + " slot " + std::to_string(k));
    }
    for (const auto& u : r.plan.units[c])
      if (u.first < 0 || u.first > u.last || static_cast<std::size_t>(u.last) >= slots.size() || u.tiles < 1)
        refuse("a unit of chain " + std::to_string(c) + " (slots " + std::to_string(u.first) + ".." +
               std::to_string(u.last) + " of " + std::to_string(slots.size()) + ", " + std::to_string(u.tiles) +
               " tiles)");
  }
}

/// Fields schema version 1 gained after it was first written, read with
/// defaults (Report::outside_units_bytes, engine_stats::served_before_written,
/// engine_stats::timed_bytes, slot_cost::made_before_bytes,
/// slot_cost::offload_kept_bytes, Report::offload_bytes_per_second,
/// offload_rate_measured and the pinned pool's spill): wherever the document read lacks one, its
/// rewrite `again` leaves it out too, so that reading it back compares.
inline void drop_added_fields(const nlohmann::json& read, nlohmann::json& again, bool top = true) {
  if (read.is_object() && again.is_object()) {
    for (const char* added :
         {"outside_units_bytes", "served_before_written", "timed_bytes", "made_before_bytes", "offload_kept_bytes"})
      if (!read.contains(added)) again.erase(added);
    if (top)  // the Report's own (StrategyContext has an offload_bytes_per_second of its own, always written)
      for (const char* added : {"offload_bytes_per_second", "offload_rate_measured", "offload_fast_bytes",
                                "offload_spill_bytes_per_second", "offload_spill_rate_measured"})
        if (!read.contains(added)) again.erase(added);
    for (auto& item : again.items())
      if (const auto it = read.find(item.key()); it != read.end()) drop_added_fields(*it, item.value(), false);
  } else if (read.is_array() && again.is_array()) {
    for (std::size_t i = 0; i < read.size() && i < again.size(); ++i) drop_added_fields(read[i], again[i], false);
  }
}

}  // namespace detail

/// Report::from_json's work: throws memscale::Error on text that is not a
/// Report document of this schema version, naming what is wrong.
[[nodiscard]] inline Report report_from_json(std::string_view text, const Report* /*tag*/) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("memscale: Report::from_json: not JSON: ") + e.what());
  }
  const auto schema = j.is_object() ? j.find("schema") : j.end();
  if (!j.is_object() || schema == j.end() || *schema != report_json_schema)
    throw Error(std::string("memscale: Report::from_json: not a Report document (\"schema\" must be \"") +
                report_json_schema + "\")");
  const auto version = j.find("schema_version");
  if (version == j.end() || !version->is_number_integer() || *version != report_json_schema_version)
    throw Error("memscale: Report::from_json: schema_version " +
                (version == j.end() ? std::string("missing") : version->dump()) + ", this memscale reads " +
                std::to_string(report_json_schema_version));
  Report r;
  try {
    j.at("hardware").get_to(r.hardware);
    j.at("mode").get_to(r.mode);
    j.at("device").get_to(r.device);
    j.at("planned").get_to(r.planned);
    j.at("budget_bytes").get_to(r.budget_bytes);
    j.at("usable_bytes").get_to(r.usable_bytes);
    j.at("parameter_bytes").get_to(r.parameter_bytes);
    j.at("gradient_bytes").get_to(r.gradient_bytes);
    j.at("optimizer_reserve_bytes").get_to(r.optimizer_reserve_bytes);
    j.at("buffer_bytes").get_to(r.buffer_bytes);
    j.at("earlier_chains_bytes").get_to(r.earlier_chains_bytes);
    j.at("outside_allocator_bytes").get_to(r.outside_allocator_bytes);
    r.outside_units_bytes = j.value("outside_units_bytes", std::int64_t{0});  // absent from older documents: none
    j.at("offload_async").get_to(r.offload_async);
    // Absent from older documents: not recorded (as for a plan that did not weigh offloading).
    r.offload_bytes_per_second = j.value("offload_bytes_per_second", 0.0);
    r.offload_rate_measured = j.value("offload_rate_measured", false);
    r.offload_fast_bytes = j.value("offload_fast_bytes", std::int64_t{-1});  // older: no pinned pool's limit
    r.offload_spill_bytes_per_second = j.value("offload_spill_bytes_per_second", 0.0);
    r.offload_spill_rate_measured = j.value("offload_spill_rate_measured", false);
    j.at("chains").get_to(r.chains);
    j.at("plan").get_to(r.plan);
    j.at("notes").get_to(r.notes);
    j.at("strategy").get_to(r.strategy);
    j.at("metrics_endpoint").get_to(r.metrics_endpoint);
    j.at("measured_peak_bytes").get_to(r.measured_peak_bytes);
    j.at("process_peak_bytes").get_to(r.process_peak_bytes);
    j.at("measured_timeline").get_to(r.measured_timeline);
    detail::get_optional(j, "offload", r.offload);
    detail::get_optional(j, "verification", r.verification);
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("memscale: Report::from_json: ") + e.what());
  } catch (const Error& e) {  // a Config in it that is not one (a ConfigError naming the field)
    throw Error(std::string("memscale: Report::from_json: ") + e.what());
  }
  detail::check_report_ranges(r);
  // Strict: what was read must write back as it was written (nlohmann reads an
  // enum name it does not know as the first value, and a 1.5 into an integer as 1).
  auto again = report_document(r);
  detail::drop_added_fields(j, again);  // an older document's
  for (auto* doc : {&j, &again})
    for (const char* derived : {"summary", "decision_lines", "memscale_version"}) doc->erase(derived);
  if (const auto changes = nlohmann::json::diff(j, again); !changes.empty())
    throw Error("memscale: Report::from_json: the value at " + changes.front().value("path", std::string("?")) +
                " is not one this memscale writes there (an unknown name, a number of another type, or a field of "
                "another version)");
  return r;
}

}  // namespace memscale

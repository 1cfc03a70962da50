// memscale — the Config as JSON, field names as in C++: written by the
// AutoTuner's cache and export (autotuning/result.hpp) and by Report::to_json
// (report/report_json.hpp). Reading is strict (a value of another type, an
// integer out of range or given as 2.5, a field that does not exist: a
// ConfigError naming it) and lenient about absent fields (their defaults);
// Config::validate() runs on what was read.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

#include <nlohmann/json.hpp>

#include <memscale/config.hpp>
#include <memscale/errors.hpp>

namespace memscale {

NLOHMANN_JSON_SERIALIZE_ENUM(OptimizationMode, {{OptimizationMode::Conservative, "Conservative"},
                                                {OptimizationMode::Balanced, "Balanced"},
                                                {OptimizationMode::Aggressive, "Aggressive"}})

namespace detail {

template <class T>
void put_optional(nlohmann::json& j, const char* key, const std::optional<T>& value) {
  if (value) j[key] = *value;
  else j[key] = nullptr;
}

/// Why `value` cannot be read as a T without changing it ("must be ..."), or
/// nothing: booleans only from true/false, integers only from integers in T's
/// range (never 2.5 nor 1e300), numbers only from numbers, strings from strings.
/// Other types are left to their own from_json.
template <class T>
std::optional<std::string> type_mismatch(const nlohmann::json& value) {
  if constexpr (std::is_same_v<T, bool>) {
    if (!value.is_boolean()) return "must be true or false";
  } else if constexpr (std::is_integral_v<T>) {
    using limits = std::numeric_limits<T>;
    bool fits = false;
    if (value.is_number_unsigned()) {
      fits = value.get<std::uint64_t>() <= static_cast<std::uint64_t>(limits::max());
    } else if (value.is_number_integer()) {
      const auto v = value.get<std::int64_t>();
      if constexpr (std::is_signed_v<T>) fits = v >= static_cast<std::int64_t>(limits::min()) &&
                                                v <= static_cast<std::int64_t>(limits::max());
      else fits = v >= 0 && static_cast<std::uint64_t>(v) <= static_cast<std::uint64_t>(limits::max());
    }
    if (!fits) return "must be an integer from " + std::to_string(limits::min()) + " to " + std::to_string(limits::max());
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!value.is_number()) return std::string("must be a number");
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!value.is_string()) return std::string("must be a string");
  }
  return std::nullopt;
}

/// `value` as a T; throws memscale::Error naming `key` when it is not one (with
/// `for_config`, a ConfigError naming the field `key`).
template <class T, bool for_config = false>
T read_as(const nlohmann::json& value, const std::string& key) {
  if (const auto why = type_mismatch<T>(value)) {
    if constexpr (for_config) throw ConfigError(key, *why + ", got " + value.dump());
    else throw Error(key + " " + *why + ", got " + value.dump());
  }
  return value.template get<T>();
}

template <class T>
void get_optional(const nlohmann::json& j, const char* key, std::optional<T>& value) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) value.reset();
  else value = read_as<T>(*it, key);
}

template <class T>
void get_if_present(const nlohmann::json& j, const char* key, T& value) {
  if (const auto it = j.find(key); it != j.end()) value = read_as<T>(*it, key);
}

/// Reads Config field `key` of `j` into `value` (absent: left as it is; null:
/// an optional reset); a ConfigError naming `prefix` + `key` when it is not one.
template <class T>
void read_field(const nlohmann::json& j, const char* key, T& value, const std::string& prefix = "") {
  const auto field = prefix + key;
  const auto it = j.find(key);
  try {
    if constexpr (requires { value.reset(); }) {
      if (it == j.end() || it->is_null()) value.reset();
      else value = read_as<typename T::value_type, true>(*it, field);
    } else if (it != j.end()) {
      value = read_as<T, true>(*it, field);
    }
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(field, std::string("has the wrong type (") + e.what() + ")");
  }
}

/// A key of `given` that `written` (what to_json writes of the value read) does
/// not have is not a field: a ConfigError naming it and the fields there are.
inline void reject_unknown_fields(const nlohmann::json& given, const nlohmann::json& written,
                                  const std::string& prefix) {
  for (const auto& item : given.items()) {
    if (written.contains(item.key())) continue;
    std::string known;
    for (const auto& field : written.items()) known += (known.empty() ? "" : ", ") + field.key();
    throw ConfigError(prefix + item.key(), "is not a field (the fields: " + known + ")");
  }
}

}  // namespace detail

inline void to_json(nlohmann::json& j, const AsyncOffloadConfig& c) {
  using detail::put_optional;
  j = {{"prefetch_depth", c.prefetch_depth}, {"pinned_pool_mb", c.pinned_pool_mb}, {"io_threads", c.io_threads},
       {"min_offload_kb", c.min_offload_kb}, {"batch_below_kb", c.batch_below_kb},
       {"disk_write_through", c.disk_write_through}};
  put_optional(j, "disk_dir", c.disk_dir);
  put_optional(j, "max_disk_offload_gb", c.max_disk_offload_gb);
}

inline void from_json(const nlohmann::json& j, AsyncOffloadConfig& c) {
  if (!j.is_object()) throw ConfigError("async_config", "must be an object or null, got " + j.dump());
  c = AsyncOffloadConfig{};
  const auto field = [&](const char* key, auto& value) { detail::read_field(j, key, value, "async_config."); };
  field("prefetch_depth", c.prefetch_depth);
  field("pinned_pool_mb", c.pinned_pool_mb);
  field("io_threads", c.io_threads);
  field("min_offload_kb", c.min_offload_kb);
  field("batch_below_kb", c.batch_below_kb);
  field("disk_write_through", c.disk_write_through);
  field("disk_dir", c.disk_dir);
  field("max_disk_offload_gb", c.max_disk_offload_gb);
  detail::reject_unknown_fields(j, nlohmann::json(c), "async_config.");
}

inline void to_json(nlohmann::json& j, const Config& c) {
  using detail::put_optional;
  j = {{"mode", c.mode},
       {"enable_checkpointing", c.enable_checkpointing},
       {"enable_offloading", c.enable_offloading},
       {"enable_tiling", c.enable_tiling},
       {"use_mixed_precision", c.use_mixed_precision},
       {"use_8bit_optimizer", c.use_8bit_optimizer},
       {"target_gpu_utilization", c.target_gpu_utilization},
       {"force_optimize", c.force_optimize},
       {"replay_random_draws", c.replay_random_draws},
       {"selective_recompute", c.selective_recompute},
       {"pack_saved_masks", c.pack_saved_masks},
       {"recompute_saved_outputs", c.recompute_saved_outputs},
       {"pack_saved_zeros", c.pack_saved_zeros},
       {"use_static_profiling", c.use_static_profiling},
       {"use_empirical_fallback", c.use_empirical_fallback},
       {"warmup_steps", c.warmup_steps},
       {"enable_logging", c.enable_logging},
       {"observability_bind_address", c.observability_bind_address},
       {"telemetry", c.telemetry},
       {"verify_correctness", c.verify_correctness},
       {"async_offload", c.async_offload},
       {"auto_policy", c.auto_policy},
       {"policy", c.policy == PolicyKind::rule ? "rule" : "trained"}};
  put_optional(j, "max_cpu_offload_gb", c.max_cpu_offload_gb);
  put_optional(j, "log_file", c.log_file);
  put_optional(j, "observability_port", c.observability_port);
  put_optional(j, "telemetry_file", c.telemetry_file);
  put_optional(j, "telemetry_endpoint", c.telemetry_endpoint);
  put_optional(j, "async_config", c.async_config);
  put_optional(j, "memory_budget_gb", c.memory_budget_gb);
  put_optional(j, "policy_artifact", c.policy_artifact);
}

inline void from_json(const nlohmann::json& j, Config& c) {
  c = Config{};
  if (!j.is_object()) throw Error("memscale: a Config in JSON must be an object, got " + std::string(j.type_name()));
  if (const auto it = j.find("mode"); it != j.end()) {
    if (!it->is_string() || (*it != "Conservative" && *it != "Balanced" && *it != "Aggressive"))
      throw ConfigError("mode", "must be \"Conservative\", \"Balanced\" or \"Aggressive\", got " + it->dump());
    c.mode = it->get<OptimizationMode>();
  }
  if (const auto it = j.find("policy"); it != j.end()) {
    if (!it->is_string() || (*it != "trained" && *it != "rule"))
      throw ConfigError("policy", "must be \"trained\" or \"rule\", got " + it->dump());
    c.policy = *it == "rule" ? PolicyKind::rule : PolicyKind::trained;
  }
  const auto field = [&](const char* key, auto& value) { detail::read_field(j, key, value); };
  field("enable_checkpointing", c.enable_checkpointing);
  field("enable_offloading", c.enable_offloading);
  field("enable_tiling", c.enable_tiling);
  field("use_mixed_precision", c.use_mixed_precision);
  field("use_8bit_optimizer", c.use_8bit_optimizer);
  field("target_gpu_utilization", c.target_gpu_utilization);
  field("force_optimize", c.force_optimize);
  field("replay_random_draws", c.replay_random_draws);
  field("selective_recompute", c.selective_recompute);
  field("pack_saved_masks", c.pack_saved_masks);
  field("recompute_saved_outputs", c.recompute_saved_outputs);
  field("pack_saved_zeros", c.pack_saved_zeros);
  field("use_static_profiling", c.use_static_profiling);
  field("use_empirical_fallback", c.use_empirical_fallback);
  field("warmup_steps", c.warmup_steps);
  field("enable_logging", c.enable_logging);
  field("observability_bind_address", c.observability_bind_address);
  field("telemetry", c.telemetry);
  field("verify_correctness", c.verify_correctness);
  field("async_offload", c.async_offload);
  field("auto_policy", c.auto_policy);
  field("max_cpu_offload_gb", c.max_cpu_offload_gb);
  field("log_file", c.log_file);
  field("observability_port", c.observability_port);
  field("telemetry_file", c.telemetry_file);
  field("telemetry_endpoint", c.telemetry_endpoint);
  field("async_config", c.async_config);
  field("memory_budget_gb", c.memory_budget_gb);
  field("policy_artifact", c.policy_artifact);
  detail::reject_unknown_fields(j, nlohmann::json(c), "");
  c.validate();
}

}  // namespace memscale

// memscale — the Config as JSON, field names as in C++: written by the
// AutoTuner's cache and export (autotuning/result.hpp) and by Report::to_json
// (report/report_json.hpp). Reading is strict about types and lenient about
// absent optional fields; Config::validate() runs on what was read.
#pragma once

#include <optional>
#include <string>

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

template <class T>
void get_optional(const nlohmann::json& j, const char* key, std::optional<T>& value) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) value.reset();
  else value = it->template get<T>();
}

template <class T>
void get_if_present(const nlohmann::json& j, const char* key, T& value) {
  if (const auto it = j.find(key); it != j.end()) value = it->template get<T>();
}

}  // namespace detail

inline void to_json(nlohmann::json& j, const AsyncOffloadConfig& c) {
  using detail::put_optional;
  j = {{"prefetch_depth", c.prefetch_depth}, {"pinned_pool_mb", c.pinned_pool_mb}, {"io_threads", c.io_threads},
       {"min_offload_kb", c.min_offload_kb}, {"batch_below_kb", c.batch_below_kb}};
  put_optional(j, "disk_dir", c.disk_dir);
  put_optional(j, "max_disk_offload_gb", c.max_disk_offload_gb);
}

inline void from_json(const nlohmann::json& j, AsyncOffloadConfig& c) {
  using detail::get_if_present;
  using detail::get_optional;
  get_if_present(j, "prefetch_depth", c.prefetch_depth);
  get_if_present(j, "pinned_pool_mb", c.pinned_pool_mb);
  get_if_present(j, "io_threads", c.io_threads);
  get_if_present(j, "min_offload_kb", c.min_offload_kb);
  get_if_present(j, "batch_below_kb", c.batch_below_kb);
  get_optional(j, "disk_dir", c.disk_dir);
  get_optional(j, "max_disk_offload_gb", c.max_disk_offload_gb);
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
  using detail::get_if_present;
  using detail::get_optional;
  c = Config{};
  if (!j.is_object()) throw Error("memscale: a Config in JSON must be an object, got " + std::string(j.type_name()));
  if (const auto it = j.find("mode"); it != j.end()) {
    if (!it->is_string() || (*it != "Conservative" && *it != "Balanced" && *it != "Aggressive"))
      throw ConfigError("mode", "must be \"Conservative\", \"Balanced\" or \"Aggressive\", got " + it->dump());
    c.mode = it->get<OptimizationMode>();
  }
  get_if_present(j, "enable_checkpointing", c.enable_checkpointing);
  get_if_present(j, "enable_offloading", c.enable_offloading);
  get_if_present(j, "enable_tiling", c.enable_tiling);
  get_if_present(j, "use_mixed_precision", c.use_mixed_precision);
  get_if_present(j, "use_8bit_optimizer", c.use_8bit_optimizer);
  get_if_present(j, "target_gpu_utilization", c.target_gpu_utilization);
  get_if_present(j, "force_optimize", c.force_optimize);
  get_if_present(j, "use_static_profiling", c.use_static_profiling);
  get_if_present(j, "use_empirical_fallback", c.use_empirical_fallback);
  get_if_present(j, "warmup_steps", c.warmup_steps);
  get_if_present(j, "enable_logging", c.enable_logging);
  get_if_present(j, "observability_bind_address", c.observability_bind_address);
  get_if_present(j, "telemetry", c.telemetry);
  get_if_present(j, "verify_correctness", c.verify_correctness);
  get_if_present(j, "async_offload", c.async_offload);
  get_if_present(j, "auto_policy", c.auto_policy);
  if (const auto it = j.find("policy"); it != j.end()) {
    if (!it->is_string() || (*it != "trained" && *it != "rule"))
      throw ConfigError("policy", "must be \"trained\" or \"rule\", got " + it->dump());
    c.policy = *it == "rule" ? PolicyKind::rule : PolicyKind::trained;
  }
  get_optional(j, "max_cpu_offload_gb", c.max_cpu_offload_gb);
  get_optional(j, "log_file", c.log_file);
  get_optional(j, "observability_port", c.observability_port);
  get_optional(j, "telemetry_file", c.telemetry_file);
  get_optional(j, "telemetry_endpoint", c.telemetry_endpoint);
  get_optional(j, "async_config", c.async_config);
  get_optional(j, "memory_budget_gb", c.memory_budget_gb);
  get_optional(j, "policy_artifact", c.policy_artifact);
  c.validate();
}

}  // namespace memscale

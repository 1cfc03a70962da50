// memscale::autotune's cache: results keyed by what decides them (the model's
// structure, the input's shape and type, the hardware, LibTorch's and
// memscale's versions, the optimizer, the budget and the search), in one JSON
// file the user names (default ~/.cache/memscale/autotune.json). A file that
// cannot be read or parsed, or an entry that does not hold a result, is
// reported and ignored, never fatal; writes go through a temporary file and a
// rename, so a reader never sees half a file.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>

#include <unistd.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <torch/version.h>

#include <memscale/autotuning/result.hpp>
#include <memscale/config.hpp>
#include <memscale/detail/modules.hpp>
#include <memscale/device/hardware.hpp>
#include <memscale/predict/optimizer_state.hpp>
#include <memscale/version.hpp>

namespace memscale::autotuning {

inline constexpr const char* cache_format = "memscale-autotune-cache";
inline constexpr int cache_format_version = 1;
/// A cache file larger than this is not read (an entry is a few KB): it is
/// ignored and moved aside like a corrupt one, never loaded whole.
inline constexpr std::uintmax_t cache_max_bytes = std::uintmax_t{64} << 20;

/// The default cache file: $XDG_CACHE_HOME/memscale/autotune.json, else
/// $HOME/.cache/memscale/autotune.json; empty when neither is set.
[[nodiscard]] inline std::string default_cache_file() {
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0')
    return (std::filesystem::path(xdg) / "memscale" / "autotune.json").string();
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0')
    return (std::filesystem::path(home) / ".cache" / "memscale" / "autotune.json").string();
  return {};
}

/// 64-bit FNV-1a: a digest that is the same on every platform and run.
[[nodiscard]] constexpr std::uint64_t fnv1a(std::string_view text) noexcept {
  std::uint64_t h = 14695981039346656037ULL;
  for (const char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ULL;
  }
  return h;
}

/// What a tuning result depends on, as readable JSON; its digest is the key.
struct cache_key {
  nlohmann::json parts;
  [[nodiscard]] std::string digest() const {
    std::ostringstream os;
    os << std::hex << std::setw(16) << std::setfill('0')
       << fnv1a(parts.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    return os.str();
  }
};

/// The key of tuning `root` on `example` (its shape and type, batch sizes
/// aside) on `device` of `hw` with `optimizer` (sized by `sizing`), under
/// `base` and `options`.
[[nodiscard]] inline cache_key make_key(torch::nn::Module& root, const torch::Tensor& example, c10::Device device,
                                        const HardwareInfo& hw, const torch::optim::Optimizer& optimizer,
                                        const predictor::optimizer_sizing& sizing,
                                        const Config& base, const TuneOptions& options, std::int64_t budget_bytes) {
  const auto structure = memscale::detail::structure_of(root);

  nlohmann::json hardware = {{"device", device.str()}, {"host_total_bytes", hw.host_total_bytes}};
  if (device.is_cpu()) {
    hardware["cpu"] = memscale::detail::cpu_model();
    hardware["threads"] = at::get_num_threads();
  }
  for (const auto& g : hw.gpus)
    if (device.is_cuda() && g.index == (device.has_index() ? device.index() : 0)) {
      hardware["gpu"] = g.name;
      hardware["gpu_total_bytes"] = g.total_bytes;
    }

  // Each group's size and the state its options keep (momentum, amsgrad, ...):
  // what the optimizer changes about a step's memory.
  nlohmann::json groups = nlohmann::json::array();
  for (const auto& g : optimizer.param_groups()) {
    std::int64_t state = 0;
    for (const auto& p : g.params())
      if (p.defined() && p.requires_grad()) state += sizing.state_bytes(p, g.options());
    groups.push_back({{"parameters", g.params().size()}, {"state_bytes", state}});
  }
  Config search = base;  // what decides the result: the knobs, not what autotune() takes from the caller
  search.enable_logging = true;
  search.log_file.reset();
  search.observability_port.reset();
  search.observability_bind_address = Config{}.observability_bind_address;
  search.telemetry = false;
  search.telemetry_file.reset();
  search.telemetry_endpoint.reset();
  search.verify_correctness = false;
  nlohmann::json modes = nlohmann::json::array();
  for (auto m : options.modes) modes.push_back(m);

  return {{{"model", {{"type", root.name()}, {"training", root.is_training()}, {"modules", structure.modules},
                      {"parameters", structure.parameters}, {"buffers", structure.buffers}}},
           {"input", memscale::detail::shape_of(example.select(0, 0)) + " on " + example.device().str()},
           {"hardware", hardware},
           {"libtorch", TORCH_VERSION},
           {"memscale", std::to_string(version_major) + "." + std::to_string(version_minor) + "." +
                            std::to_string(version_patch)},
           // How a CPU trial's peak is measured: 2 counts predict's share outside the
           // allocator (results cached before it read low; they are tuned again).
           {"trial_measure", 2},
           {"optimizer", {{"type", sizing.name}, {"groups", groups}}},
           {"budget_bytes", budget_bytes},
           {"config", search},
           {"search", {{"modes", modes},
                       {"batch_sizes", options.batch_sizes},
                       {"example_batch", example.size(0)},
                       {"max_trials", options.max_trials},
                       {"warmup_steps", options.warmup_steps},
                       {"timed_steps", options.timed_steps},
                       {"prune_with_predictor", options.prune_with_predictor}}}}};
}

/// The cache file's entries; `problem` says why the file was ignored, if it was.
struct cache_file_contents {
  nlohmann::json entries = nlohmann::json::object();
  std::string problem;
};

[[nodiscard]] inline cache_file_contents read_cache(const std::string& path) {
  cache_file_contents out;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return out;
  if (const auto size = std::filesystem::file_size(path, ec); !ec && size > cache_max_bytes) {
    out.problem = "the cache file " + path + " is corrupt and was ignored (it holds " + std::to_string(size) +
                  " bytes, more than the " + std::to_string(cache_max_bytes) + " a cache file may)";
    return out;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    out.problem = "the cache file " + path + " cannot be opened for reading";
    return out;
  }
  std::ostringstream text;
  text << in.rdbuf();
  try {
    const auto j = nlohmann::json::parse(text.str());
    if (!j.is_object() || j.value("format", std::string()) != cache_format)
      throw Error("it is not a memscale autotune cache (no \"format\": \"" + std::string(cache_format) + "\")");
    if (j.value("version", 0) != cache_format_version)
      throw Error("its format version is " + j.value("version", nlohmann::json()).dump() + ", this memscale reads " +
                  std::to_string(cache_format_version));
    const auto it = j.find("entries");
    if (it == j.end() || !it->is_object()) throw Error("it has no \"entries\" object");
    out.entries = *it;
  } catch (const std::exception& e) {
    out.entries = nlohmann::json::object();
    out.problem = "the cache file " + path + " is corrupt and was ignored (" + e.what() + ")";
  }
  return out;
}

/// The cached result for `key`, if `contents` holds a valid one; a malformed
/// entry sets `problem` and is ignored.
[[nodiscard]] inline std::optional<TuneResult> lookup(const cache_file_contents& contents, const cache_key& key,
                                                      std::string& problem) {
  const auto it = contents.entries.find(key.digest());
  if (it == contents.entries.end()) return std::nullopt;
  try {
    if (!it->is_object() || it->find("key") == it->end() || (*it)["key"] != key.parts)
      throw Error("its key does not match (a digest collision or an edited file)");
    return detail::result_from(it->at("result"));
  } catch (const std::exception& e) {
    problem = "the cache entry " + key.digest() + " is malformed and was ignored (" + e.what() + ")";
    return std::nullopt;
  }
}

/// Adds (or replaces) `key`'s entry and writes the file: read afresh, so that
/// entries another process wrote meanwhile are kept, then a temporary file in
/// the same directory renamed over it. A file that is not a cache this memscale
/// reads is moved aside to `path`.corrupt first, never overwritten. Returns what
/// went wrong (or was moved), "" when nothing did; never throws.
[[nodiscard]] inline std::string store(const std::string& path, const cache_key& key, const TuneResult& result) {
  namespace fs = std::filesystem;
  try {
    std::error_code ec;
    const fs::path file(path);
    if (file.has_parent_path()) fs::create_directories(file.parent_path(), ec);
    if (ec) return "the cache directory " + file.parent_path().string() + " cannot be created (" + ec.message() + ")";
    std::string moved;
    auto contents = read_cache(path);
    if (!contents.problem.empty()) {
      fs::rename(file, fs::path(path + ".corrupt"), ec);
      if (ec) return "the cache file " + path + " is not a memscale cache and cannot be moved aside (" + ec.message() +
                     "): left as it is, the result not cached";
      moved = "the unreadable cache file was moved to " + path + ".corrupt";
    }
    contents.entries[key.digest()] = {{"key", key.parts}, {"result", nlohmann::json::parse(result.to_json(-1))}};
    const nlohmann::json j = {
        {"format", cache_format}, {"version", cache_format_version}, {"entries", contents.entries}};
    // The process and the thread: two writers never share a temporary file.
    std::ostringstream name;
    name << path << ".tmp." << ::getpid() << "." << std::hash<std::thread::id>{}(std::this_thread::get_id());
    const fs::path temporary(name.str());
    {
      std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
      out << j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
      out.flush();
      if (!out) {
        fs::remove(temporary, ec);
        return "the cache file " + path + " cannot be written";
      }
    }
    fs::rename(temporary, file, ec);
    if (ec) {
      fs::remove(temporary, ec);
      return "the cache file " + path + " cannot be replaced (" + ec.message() + ")";
    }
    return moved;
  } catch (const std::exception& e) {
    return "the cache file " + path + " was not written (" + e.what() + ")";
  }
}

}  // namespace memscale::autotuning

// memscale — opt-in telemetry. Off unless Config::telemetry is true or the
// environment has MEMSCALE_TELEMETRY=1. Events (schema "memscale.telemetry",
// version 2: wrap_called, plan_applied, detach_called, policy_decided,
// autotune_finished) carry bucketed, non-identifying metadata only: the
// architecture class, a parameter-count bucket, the techniques chosen, the
// memscale and LibTorch versions. Never a name, a path, a host name, or a shape
// (event_fields() lists every field; a test holds each event to it).
//
// Delivery is asynchronous and bounded: emit() puts the line in a queue of
// queue_capacity and returns; one worker thread writes it to the sink (a
// JSON-lines file, or an HTTP POST to an http:// endpoint, each bounded by
// send_timeout). A full queue drops the event (counted); a sink that throws,
// refuses or blocks costs events, never wrap() or a training step.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <torch/version.h>

#include <memscale/config.hpp>
#include <memscale/errors.hpp>
#include <memscale/observability/endpoint.hpp>
#include <memscale/observability/metrics.hpp>
#include <memscale/version.hpp>

namespace memscale::telemetry {

inline constexpr const char* schema = "memscale.telemetry";
inline constexpr int schema_version = 2;
inline constexpr std::size_t queue_capacity = 256;
inline constexpr std::chrono::seconds send_timeout{2};

/// Every field each event may carry (the schema; a test checks events against it).
inline const std::map<std::string, std::set<std::string>>& event_fields() {
  static const std::set<std::string> common{"schema", "schema_version", "event", "memscale_version",
                                            "libtorch_version", "device_class"};
  static const auto with = [](std::set<std::string> extra) {
    extra.insert(common.begin(), common.end());
    return extra;
  };
  static const std::map<std::string, std::set<std::string>> fields{
      {"wrap_called", with({"architecture", "parameter_bucket", "mode", "outcome"})},
      {"plan_applied", with({"architecture", "parameter_bucket", "mode", "techniques", "pressure_bucket",
                             "decision_source"})},
      {"detach_called", with({"steps_bucket"})},
      {"policy_decided", with({"decision_source", "chosen_mode", "chosen_checkpoint", "chosen_offload"})},
      {"autotune_finished", with({"found", "from_cache", "trials_bucket", "chosen_mode"})},
  };
  return fields;
}

/// "<1M", "1M-10M", "10M-100M", "100M-1B", ">=1B" parameters.
[[nodiscard]] inline std::string parameter_bucket(std::int64_t parameters) {
  if (parameters < 1'000'000) return "<1M";
  if (parameters < 10'000'000) return "1M-10M";
  if (parameters < 100'000'000) return "10M-100M";
  if (parameters < 1'000'000'000) return "100M-1B";
  return ">=1B";
}

/// Counts as powers of ten: "0", "1-9", "10-99", "100-999", ">=1000".
[[nodiscard]] inline std::string count_bucket(std::int64_t n) {
  if (n <= 0) return "0";
  if (n < 10) return "1-9";
  if (n < 100) return "10-99";
  if (n < 1000) return "100-999";
  return ">=1000";
}

/// A step's projected peak over the usable memory: "<0.7", "0.7-1", "1-2", ">=2".
[[nodiscard]] inline std::string pressure_bucket(double pressure) {
  if (pressure < 0.7) return "<0.7";
  if (pressure < 1.0) return "0.7-1";
  if (pressure < 2.0) return "1-2";
  return ">=2";
}

/// "transformer" (attention, or LayerNorm with Linear), "cnn" (a convolution),
/// "mlp" (Linear layers), else "other": from LibTorch's own layer types only.
[[nodiscard]] inline std::string architecture_class(const torch::nn::Module& root) {
  bool attention = false, conv = false, linear = false, layer_norm = false;
  for (const auto& m : root.modules(/*include_self=*/true)) {
    const auto* p = m.get();
    attention = attention || dynamic_cast<const torch::nn::MultiheadAttentionImpl*>(p) != nullptr;
    conv = conv || dynamic_cast<const torch::nn::Conv1dImpl*>(p) || dynamic_cast<const torch::nn::Conv2dImpl*>(p) ||
           dynamic_cast<const torch::nn::Conv3dImpl*>(p);
    linear = linear || dynamic_cast<const torch::nn::LinearImpl*>(p) != nullptr;
    layer_norm = layer_norm || dynamic_cast<const torch::nn::LayerNormImpl*>(p) != nullptr;
  }
  if (attention || (layer_norm && linear && !conv)) return "transformer";
  if (conv) return "cnn";
  if (linear) return "mlp";
  return "other";
}

/// The fields every event starts with.
[[nodiscard]] inline nlohmann::json event(const char* name, const std::string& device_class) {
  return {{"schema", schema},           {"schema_version", schema_version}, {"event", name},
          {"memscale_version", version_string}, {"libtorch_version", TORCH_VERSION},
          {"device_class", device_class}};
}

/// Where events go; implement it to route them into your own pipeline (set_sink).
class sink {
 public:
  virtual ~sink() = default;
  /// Delivers one event (a JSON object on one line); throws on failure.
  virtual void send(const std::string& line) = 0;
};

/// Appends each event as one line to a file (missing directories are created).
class file_sink final : public sink {
 public:
  explicit file_sink(std::filesystem::path path) : path_(std::move(path)) {}
  void send(const std::string& line) override {
    std::error_code ignored;
    if (path_.has_parent_path()) std::filesystem::create_directories(path_.parent_path(), ignored);
    std::ofstream out(path_, std::ios::app);
    if (!(out << line << '\n')) throw Error("memscale telemetry: cannot append to " + path_.string());
  }

 private:
  std::filesystem::path path_;
};

/// Splits "http://host[:port][/path]"; nullopt when it is not of that form.
struct http_url {
  std::string host;
  int port = 80;
  std::string path = "/";
};
[[nodiscard]] inline std::optional<http_url> parse_http_url(const std::string& url) {
  if (!Config::telemetry_endpoint_valid(url)) return std::nullopt;
  const auto rest = url.substr(std::string_view("http://").size());
  const auto slash = rest.find('/');
  const auto authority = rest.substr(0, slash);
  const auto colon = authority.rfind(':');
  http_url u{authority.substr(0, colon), colon == std::string::npos ? 80 : std::stoi(authority.substr(colon + 1)),
             slash == std::string::npos ? "/" : rest.substr(slash)};
  return u;
}

/// POSTs each event (application/json) to an http:// URL; a status other than 2xx is a failure.
class http_sink final : public sink {
 public:
  explicit http_sink(http_url url) : url_(std::move(url)) {}
  void send(const std::string& line) override {
#if MEMSCALE_HAS_HTTP()
    httplib::Client client(url_.host, url_.port);
    const auto t = static_cast<time_t>(send_timeout.count());
    client.set_connection_timeout(t, 0);
    client.set_read_timeout(t, 0);
    client.set_write_timeout(t, 0);
    const auto response = client.Post(url_.path.c_str(), line, "application/json");
    if (!response) throw Error("memscale telemetry: POST " + url_.host + " failed: " + httplib::to_string(response.error()));
    if (response->status < 200 || response->status >= 300)
      throw Error("memscale telemetry: POST answered " + std::to_string(response->status));
#else
    (void)line;
    throw Error(std::string("memscale telemetry: ") + observability::http_unavailable_reason);
#endif
  }

 private:
  http_url url_;
};

/// What the worker did so far (process-wide).
struct delivery_stats {
  std::int64_t queued = 0, sent = 0, failed = 0, dropped = 0;
};

/// The process's telemetry queue and its worker thread.
class emitter {
 public:
  /// Never destroyed: the detached worker may outlive static destruction.
  static emitter& global() {
    static auto* instance = new emitter();
    return *instance;
  }

  /// Queues `line` for `to` (or for the sink set_sink() gave); never blocks, never throws.
  void post(std::shared_ptr<sink> to, std::string line) noexcept {
    try {
      std::lock_guard<std::mutex> lock(mutex_);
      if (override_) to = override_;
      if (!to) return;
      if (queue_.size() >= queue_capacity) {
        ++stats_.dropped;
        return;
      }
      queue_.emplace_back(std::move(to), std::move(line));
      ++stats_.queued;
      if (!started_) {
        std::thread([this] { work(); }).detach();
        started_ = true;
      }
      ready_.notify_one();
    } catch (...) {
    }
  }

  /// Routes every event to `s` instead of the Config's sink (nullptr: back to the Config's).
  void set_sink(std::shared_ptr<sink> s) {
    std::lock_guard<std::mutex> lock(mutex_);
    override_ = std::move(s);
  }

  /// Waits until the queue is empty and nothing is being sent, or `timeout` passed; true if drained.
  bool flush(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    return idle_.wait_for(lock, timeout, [&] { return queue_.empty() && !sending_; });
  }

  [[nodiscard]] delivery_stats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

 private:
  emitter() = default;

  void work() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      ready_.wait(lock, [&] { return !queue_.empty(); });
      auto [to, line] = std::move(queue_.front());
      queue_.pop_front();
      sending_ = true;
      lock.unlock();
      bool ok = true;
      try {
        to->send(line);
      } catch (...) {
        ok = false;
      }
      to.reset();
      lock.lock();
      sending_ = false;
      ++(ok ? stats_.sent : stats_.failed);
      if (queue_.empty()) idle_.notify_all();
    }
  }

  mutable std::mutex mutex_;
  std::condition_variable ready_, idle_;
  std::deque<std::pair<std::shared_ptr<sink>, std::string>> queue_;
  std::shared_ptr<sink> override_;
  delivery_stats stats_;
  bool started_ = false;
  bool sending_ = false;
};

/// Whether telemetry is on for `config`: Config::telemetry, or MEMSCALE_TELEMETRY=1 (or true, on, yes).
[[nodiscard]] inline bool enabled(const Config& config) {
  if (config.telemetry) return true;
  const char* env = std::getenv("MEMSCALE_TELEMETRY");
  if (env == nullptr) return false;
  const std::string v(env);
  return v == "1" || v == "true" || v == "on" || v == "yes";
}

/// The default local sink: $XDG_STATE_HOME/memscale/telemetry.jsonl, else ~/.local/state/memscale/telemetry.jsonl.
[[nodiscard]] inline std::filesystem::path default_file() {
  if (const char* state = std::getenv("XDG_STATE_HOME"); state != nullptr && *state != '\0')
    return std::filesystem::path(state) / "memscale" / "telemetry.jsonl";
  const char* home = std::getenv("HOME");
  return std::filesystem::path(home != nullptr ? home : ".") / ".local" / "state" / "memscale" / "telemetry.jsonl";
}

/// Open while memscale wraps a model for its own purposes (an AutoTuner trial,
/// predict()): those wraps send nothing; the call the user made does.
using mute_scope = observability::thread_scope<struct mute_tag>;

/// What one wrap (or autotune) sends, and where: silent unless telemetry is on.
class channel {
 public:
  channel() = default;  ///< off

  /// The sink: Config::telemetry_endpoint or telemetry_file, else the environment's
  /// MEMSCALE_TELEMETRY_ENDPOINT or MEMSCALE_TELEMETRY_FILE, else default_file().
  static channel open(const Config& config) {
    channel c;
    if (!enabled(config) || mute_scope::depth() > 0) return c;
    const char* env_endpoint = std::getenv("MEMSCALE_TELEMETRY_ENDPOINT");
    const char* env_file = std::getenv("MEMSCALE_TELEMETRY_FILE");
    if (config.telemetry_endpoint || (!config.telemetry_file && env_endpoint && *env_endpoint)) {
      const std::string url = config.telemetry_endpoint ? *config.telemetry_endpoint : env_endpoint;
      const auto parsed = parse_http_url(url);
      if (!parsed || !observability::http_available) return c;  // Config::validate refuses both for the Config's own
      c.sink_ = std::make_shared<http_sink>(*parsed);
    } else {
      c.sink_ = std::make_shared<file_sink>(config.telemetry_file ? std::filesystem::path(*config.telemetry_file)
                                            : env_file && *env_file ? std::filesystem::path(env_file)
                                                                    : default_file());
    }
    return c;
  }

  [[nodiscard]] bool on() const noexcept { return sink_ != nullptr; }

  /// Queues an event (event() plus its own fields); never blocks, never throws.
  void emit(const nlohmann::json& e) const noexcept {
    if (!sink_) return;
    try {
      emitter::global().post(sink_, e.dump());
    } catch (...) {
    }
  }

 private:
  std::shared_ptr<sink> sink_;
};

}  // namespace memscale::telemetry

// memscale — logging, through spdlog. Everything memscale says goes to the
// spdlog logger named "memscale": the one the program registered under that
// name before memscale first logged (memscale then uses it as it is, sinks,
// level and pattern), else one memscale makes and registers, writing to stderr
// at info. To route memscale's log into your own, register your logger as
// "memscale", or add sinks to spdlog::get("memscale"); spdlog's own level
// settings (spdlog::set_level, SPDLOG_LEVEL through spdlog::cfg) apply to it.
//
// Levels: info, a one-line summary per plan; debug, the whole plan; warn,
// what the user should act on (an offload tier full, a plan re-made, a policy
// fallback, a metrics port that could not be bound). A wrap's log_channel adds
// Config::enable_logging (false: that wrap says nothing) and Config::log_file
// (that wrap's log from debug up, appended to the file).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include <spdlog/logger.h>
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <memscale/config.hpp>
#include <memscale/errors.hpp>

namespace memscale::observability {

inline constexpr const char* logger_name = "memscale";

/// The process's "memscale" logger (see the file comment). Never null; never throws
/// but for std::bad_alloc.
inline std::shared_ptr<spdlog::logger> logger() {
  static std::mutex mutex;
  static std::shared_ptr<spdlog::logger> made;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto registered = spdlog::get(logger_name)) return registered;
  try {
    if (!made) {
      // memscale's own, made once. initialize_logger gives it the levels the
      // program set before (spdlog::set_level, SPDLOG_LEVEL) and registers it.
      made = std::make_shared<spdlog::logger>(logger_name, std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
      spdlog::initialize_logger(made);
      made->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] %v");
    } else {
      spdlog::register_logger(made);  // the program dropped it: back in the registry
    }
  } catch (const spdlog::spdlog_ex&) {
    // registered by another thread just now
    if (auto registered = spdlog::get(logger_name)) return registered;
  }
  return made;
}

/// What one wrap logs, and where: the "memscale" logger, and Config::log_file
/// (from debug up) when set. Copies share the file. Logging never throws.
class log_channel {
 public:
  log_channel() = default;  ///< silent

  /// To the "memscale" logger only (what code outside a wrap uses).
  static log_channel process() {
    log_channel channel;
    channel.enabled_ = true;
    return channel;
  }

  /// Throws ConfigError("log_file") when the file cannot be opened for appending
  /// (before anything else of the wrap happens).
  static log_channel open(const Config& config) {
    log_channel channel;
    channel.enabled_ = config.enable_logging;
    if (!config.enable_logging || !config.log_file) return channel;
    try {
      auto sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(*config.log_file, /*truncate=*/false);
      channel.file_ = std::make_shared<spdlog::logger>(logger_name, std::move(sink));
      channel.file_->set_level(spdlog::level::debug);
      channel.file_->flush_on(spdlog::level::debug);
      channel.file_->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%l] %v");
    } catch (const spdlog::spdlog_ex& e) {
      throw ConfigError("log_file", "cannot be opened for appending: \"" + *config.log_file + "\" (" + e.what() +
                                        "); give a writable file path, or leave it unset to log to stderr only");
    }
    return channel;
  }

  [[nodiscard]] bool enabled() const noexcept { return enabled_; }
  /// Whether a message at `level` would go anywhere (build costly messages only then).
  [[nodiscard]] bool wants(spdlog::level::level_enum level) const noexcept {
    if (!enabled_) return false;
    if (file_ && file_->should_log(level)) return true;
    try {
      return logger()->should_log(level);
    } catch (...) {
      return false;
    }
  }

  void log(spdlog::level::level_enum level, std::string_view message) const noexcept {
    if (!enabled_) return;
    try {
      if (auto l = logger(); l->should_log(level)) l->log(level, spdlog::string_view_t(message.data(), message.size()));
      if (file_ && file_->should_log(level)) file_->log(level, spdlog::string_view_t(message.data(), message.size()));
    } catch (...) {
      // a full disk or a throwing sink must not fail training
    }
  }
  void debug(std::string_view message) const noexcept { log(spdlog::level::debug, message); }
  void info(std::string_view message) const noexcept { log(spdlog::level::info, message); }
  void warn(std::string_view message) const noexcept { log(spdlog::level::warn, message); }

 private:
  bool enabled_ = false;
  std::shared_ptr<spdlog::logger> file_;
};

/// A warning from code that has no wrap's channel at hand (a technique's
/// wrapper): to the "memscale" logger. Never throws.
inline void warn(std::string_view message) noexcept {
  try {
    logger()->warn(spdlog::string_view_t(message.data(), message.size()));
  } catch (...) {
  }
}

}  // namespace memscale::observability

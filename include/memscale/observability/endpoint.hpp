// memscale — the metrics endpoint: an HTTP server (cpp-httplib) on a thread of
// its own, serving GET /metrics in the Prometheus text format while a guard
// with Config::observability_port is active. Bound to loopback unless
// Config::observability_bind_address says otherwise. It never touches
// training: a port it cannot bind is reported (error()), a slow or malformed
// request costs one of its own few threads, and stop() closes the listening
// socket at once and does not wait long for a client that keeps a request open.
// Built only where memscale was configured with cpp-httplib (MEMSCALE_WITH_HTTP).
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#if defined(MEMSCALE_WITH_HTTP) && MEMSCALE_WITH_HTTP
#include <httplib.h>
#define MEMSCALE_HAS_HTTP() 1
#else
#define MEMSCALE_HAS_HTTP() 0
#endif

namespace memscale::observability {

/// Whether this build can serve metrics and post telemetry over HTTP.
inline constexpr bool http_available = MEMSCALE_HAS_HTTP() != 0;
inline constexpr const char* http_unavailable_reason =
    "this build of memscale has no HTTP server: cpp-httplib (Debian: libcpp-httplib-dev) was not found when "
    "memscale was configured";
/// The media type of the Prometheus text exposition format.
inline constexpr const char* exposition_content_type = "text/plain; version=0.0.4; charset=utf-8";

class metrics_endpoint {
 public:
  using page = std::function<std::string()>;

  /// Binds `address`:`port` (0: any free port) and serves `body()` at /metrics,
  /// giving a client `io_timeout` to send its request or take the answer (and
  /// a kept-alive connection as long, at least a second, for its next one).
  /// Never throws for a port it cannot bind: bound() is then false, error() says why.
  metrics_endpoint(std::string address, int port, page body,
                   [[maybe_unused]] std::chrono::milliseconds io_timeout = std::chrono::seconds(2))
      : address_(std::move(address)) {
#if MEMSCALE_HAS_HTTP()
    auto state = std::make_shared<shared>();
    state->body = std::move(body);
    auto& server = state->server;
    server.new_task_queue = [] { return new httplib::ThreadPool(4); };  // at most 4 requests at once
    const auto seconds = static_cast<time_t>(io_timeout.count() / 1000);
    const auto micros = static_cast<time_t>(io_timeout.count() % 1000 * 1000);
    server.set_read_timeout(seconds, micros);
    server.set_write_timeout(seconds, micros);
    server.set_keep_alive_timeout(std::max<time_t>(1, seconds));
    server.set_keep_alive_max_count(16);
    server.set_payload_max_length(4096);  // a scrape has no body
    // httplib's default is SO_REUSEPORT, which lets a second server bind a port in
    // use (scrapes then go to either at random): SO_REUSEADDR only, so a busy port fails.
    server.set_socket_options([](auto sock) {
      int yes = 1;
      ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    });
    std::weak_ptr<shared> weak = state;
    server.Get("/metrics", [weak](const httplib::Request&, httplib::Response& response) {
      const auto s = weak.lock();
      try {
        if (!s) throw std::runtime_error("stopped");
        response.set_content(s->body(), exposition_content_type);
      } catch (...) {
        response.status = 500;
        response.set_content("memscale: the metrics could not be read\n", "text/plain");
      }
    });
    port_ = port == 0 ? server.bind_to_any_port(address_) : (server.bind_to_port(address_, port) ? port : -1);
    if (port_ < 0) {
      error_ = "could not bind " + address_ + ":" + std::to_string(port) +
               " (the port is in use, may not be bound by this process, or the address is not one of this host)";
      return;
    }
    std::promise<void> finished;
    done_ = finished.get_future();
    thread_ = std::thread([state, finished = std::move(finished)]() mutable {
      try {
        state->server.listen_after_bind();
      } catch (...) {
      }
      finished.set_value();
    });
    // stop() closes the socket only once the server runs: wait for that (or its end).
    while (!state->server.is_running() && done_.wait_for(std::chrono::milliseconds(1)) != std::future_status::ready) {
    }
    state_ = std::move(state);
#else
    (void)port;
    (void)body;
    port_ = -1;
    error_ = http_unavailable_reason;
#endif
  }

  metrics_endpoint(const metrics_endpoint&) = delete;
  metrics_endpoint& operator=(const metrics_endpoint&) = delete;
  /// Unstopped (a model dropped without detach, its attachment destroyed where a
  /// lock may be held), it does not wait for a request in flight.
  ~metrics_endpoint() { stop(std::chrono::milliseconds(0)); }

  [[nodiscard]] bool bound() const noexcept { return port_ >= 0; }
  [[nodiscard]] int port() const noexcept { return port_; }
  [[nodiscard]] const std::string& error() const noexcept { return error_; }
  [[nodiscard]] std::string url() const {
    const bool v6 = address_.find(':') != std::string::npos;
    return "http://" + (v6 ? "[" + address_ + "]" : address_) + ":" + std::to_string(port_) + "/metrics";
  }

  /// Closes the listening socket now; waits up to `wait` for requests in flight,
  /// then leaves a client that keeps one open to its own thread (which holds all it uses).
  void stop(std::chrono::milliseconds wait = std::chrono::seconds(2)) noexcept {
#if MEMSCALE_HAS_HTTP()
    if (!thread_.joinable()) return;
    try {
      state_->server.stop();
      if (done_.wait_for(wait) == std::future_status::ready) thread_.join();
      else thread_.detach();
    } catch (...) {
      if (thread_.joinable()) thread_.detach();
    }
    state_.reset();
#else
    (void)wait;
#endif
  }

 private:
#if MEMSCALE_HAS_HTTP()
  struct shared {
    httplib::Server server;
    page body;
  };
  std::shared_ptr<shared> state_;
  std::thread thread_;
  std::future<void> done_;
#endif
  std::string address_;
  int port_ = -1;
  std::string error_;
};

}  // namespace memscale::observability

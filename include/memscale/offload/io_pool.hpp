// memscale — the offload engine's small I/O thread pool (disk-tier writes and
// prefetch reads). Jobs run in submission order per worker; stop() (and the
// destructor) runs every queued job, then joins. A job must not own the pool
// (see offload/engine.hpp). Nothing a job throws leaves its thread: the first
// such exception waits in the pool for wait() to rethrow it.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <memscale/detail/fault_injection.hpp>
#include <memscale/errors.hpp>

namespace memscale::offload {

class io_pool {
 public:
  /// Starts `threads` workers (at least one). Throws memscale::Error, with every
  /// worker already started joined again, when one cannot start.
  explicit io_pool(int threads) {
    const int count = threads < 1 ? 1 : threads;
    workers_.reserve(static_cast<std::size_t>(count));
    try {
      for (int i = 0; i < count; ++i) {
        if (i == 1 && memscale::detail::offload_fault_injected(memscale::detail::offload_fault::thread_start_fails))
          throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                                  "thread start failure injected by a test");
        workers_.emplace_back([this] { work(); });
      }
    } catch (const std::exception& e) {
      const auto started = workers_.size();
      stop();
      throw Error("memscale: the offload I/O pool could not start thread " + std::to_string(started + 1) + " of " +
                  std::to_string(count) + " (" + e.what() +
                  "); lower AsyncOffloadConfig::io_threads or turn async_offload off");
    }
  }
  io_pool(const io_pool&) = delete;
  io_pool& operator=(const io_pool&) = delete;
  ~io_pool() { stop(); }

  /// Queues `job`. Throws memscale::Error once the pool has stopped.
  void submit(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) throw Error("memscale: a job was submitted to the offload I/O pool after it stopped");
      jobs_.push_back(std::move(job));
    }
    ready_.notify_one();
  }

  /// Blocks until every job submitted so far has run (call it from outside
  /// the pool), then rethrows the first exception a job threw since the last
  /// wait(): each is reported once.
  void wait() {
    std::exception_ptr failure;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      idle_.wait(lock, [&] { return jobs_.empty() && running_ == 0; });
      failure = std::exchange(failure_, nullptr);
    }
    if (failure) std::rethrow_exception(failure);
  }

  /// Stops taking jobs, runs the queued ones, joins the workers. Idempotent.
  void stop() noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_all();
    for (auto& w : workers_)
      if (w.joinable()) w.join();
  }

  [[nodiscard]] int threads() const noexcept { return static_cast<int>(workers_.size()); }

 private:
  void work() noexcept {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stopping, and nothing left to run
        job = std::move(jobs_.front());
        jobs_.pop_front();
        ++running_;
      }
      // The engine's jobs fall back on their own (a failed transfer leaves the
      // tensor where it was); anything else they throw is kept for wait().
      std::exception_ptr failure;
      try {
        job();
        job = nullptr;  // what the job captured goes here, inside the guard
      } catch (...) {
        failure = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (failure && !failure_) failure_ = std::move(failure);
        --running_;
      }
      idle_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::condition_variable idle_;
  std::deque<std::function<void()>> jobs_;
  int running_ = 0;
  bool stopping_ = false;
  std::exception_ptr failure_;
  std::vector<std::thread> workers_;
};

}  // namespace memscale::offload

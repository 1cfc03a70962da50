// memscale — the offload engine's small I/O thread pool (disk-tier writes and
// prefetch reads). Jobs run in submission order per worker; the destructor runs
// every queued job, then joins. A job must not own the pool (see offload/engine.hpp).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace memscale::offload {

class io_pool {
 public:
  explicit io_pool(int threads) {
    for (int i = 0; i < (threads < 1 ? 1 : threads); ++i) workers_.emplace_back([this] { work(); });
  }
  io_pool(const io_pool&) = delete;
  io_pool& operator=(const io_pool&) = delete;
  ~io_pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_all();
    for (auto& w : workers_) w.join();
  }

  void submit(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(std::move(job));
    }
    ready_.notify_one();
  }

  [[nodiscard]] int threads() const noexcept { return static_cast<int>(workers_.size()); }

 private:
  void work() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stopping, and nothing left to run
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();  // jobs catch their own errors: a failed transfer leaves the tensor where it was
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace memscale::offload

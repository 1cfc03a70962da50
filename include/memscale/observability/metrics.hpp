// memscale — metrics: the process-wide counters memscale's code adds to as a
// model trains (training steps, their period, recompute time), and the writer
// of the Prometheus text exposition format 0.0.4 the metrics endpoint serves
// (observability/endpoint.hpp; what it serves is put together in
// execute/metrics_page.hpp).
//
// A training step is one top-level backward pass that memscale's autograd
// engine runs (offload/hooks.hpp): one started outside any other backward (a
// backward inside another, such as a checkpoint's recompute, is part of that
// step), and outside memscale's own work (own_work_scope: profiling,
// verification, the AutoTuner's trials). Its period is the time from one step's
// backward start to the next one's: the training loop's step time, data
// loading and the optimizer included. Recompute time is host time: on CUDA, the
// time to launch the recomputed kernels, which run asynchronously.
#pragma once

#include <array>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace memscale::observability {

/// Cumulative histogram with fixed bounds (seconds). Thread-safe.
class histogram {
 public:
  static constexpr std::array<double, 14> bounds{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                 0.5,   1.0,   2.5,  5.0,   10.0, 30.0, 60.0};
  struct snapshot {
    std::array<std::uint64_t, bounds.size()> cumulative{};  ///< observations <= each bound
    std::uint64_t count = 0;
    double sum = 0.0;
  };

  void observe(double value) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (std::size_t i = 0; i < bounds.size(); ++i)
      if (value <= bounds[i]) ++counts_.cumulative[i];
    ++counts_.count;
    counts_.sum += value;
  }
  [[nodiscard]] snapshot read() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return counts_;
  }

 private:
  mutable std::mutex mutex_;
  snapshot counts_;
};

/// What memscale's code counts as it runs, for the whole process.
class process_counters {
 public:
  using clock = std::chrono::steady_clock;

  /// A top-level backward started (see the file comment).
  void step_started() {
    const auto now = clock::now();
    steps_.fetch_add(1, std::memory_order_relaxed);
    std::optional<clock::time_point> previous;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      previous = last_step_;
      last_step_ = now;
    }
    if (previous) step_seconds_.observe(std::chrono::duration<double>(now - *previous).count());
  }
  /// A checkpoint's (or tile's) forward ran again in backward, taking `seconds`.
  void recomputed(double seconds) {
    recomputes_.fetch_add(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mutex_);
    recompute_seconds_ += seconds;
  }

  [[nodiscard]] std::uint64_t steps() const { return steps_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t recomputes() const { return recomputes_.load(std::memory_order_relaxed); }
  [[nodiscard]] double recompute_seconds() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return recompute_seconds_;
  }
  [[nodiscard]] histogram::snapshot step_seconds() const { return step_seconds_.read(); }

 private:
  std::atomic<std::uint64_t> steps_{0};
  std::atomic<std::uint64_t> recomputes_{0};
  mutable std::mutex mutex_;
  double recompute_seconds_ = 0.0;
  std::optional<clock::time_point> last_step_;
  histogram step_seconds_;
};

inline process_counters& counters() {
  static process_counters instance;
  return instance;
}

/// Open on this thread for its lifetime, nested scopes counted: `depth()` > 0
/// while any scope of the same Tag is open on the calling thread.
template <class Tag>
class thread_scope {
 public:
  thread_scope() { ++depth_ref(); }
  thread_scope(const thread_scope&) = delete;
  thread_scope& operator=(const thread_scope&) = delete;
  ~thread_scope() { --depth_ref(); }
  [[nodiscard]] static int depth() noexcept { return depth_ref(); }

 private:
  static int& depth_ref() noexcept {
    thread_local int depth = 0;
    return depth;
  }
};

/// Open while memscale runs the model for its own purposes (wrap's profiling and
/// verification step, lazy planning, predict(), the AutoTuner's trials): the
/// backwards run there are no training steps.
using own_work_scope = thread_scope<struct own_work_tag>;

/// Times a recompute: adds its seconds to counters() when it closes.
class recompute_timer {
 public:
  recompute_timer() : start_(process_counters::clock::now()) {}
  recompute_timer(const recompute_timer&) = delete;
  recompute_timer& operator=(const recompute_timer&) = delete;
  ~recompute_timer() {
    counters().recomputed(std::chrono::duration<double>(process_counters::clock::now() - start_).count());
  }

 private:
  process_counters::clock::time_point start_;
};

/// Writes the Prometheus text exposition format 0.0.4: one family at a time
/// (# HELP, # TYPE, then its samples).
class exposition {
 public:
  using labels = std::vector<std::pair<std::string, std::string>>;

  /// Starts a family; `type`: counter, gauge, histogram or untyped.
  void family(std::string_view name, std::string_view type, std::string_view help) {
    out_ << "# HELP " << name << ' ';
    for (char c : help) {
      if (c == '\\') out_ << "\\\\";
      else if (c == '\n') out_ << "\\n";
      else out_ << c;
    }
    out_ << "\n# TYPE " << name << ' ' << type << '\n';
  }

  void sample(std::string_view name, const labels& l, double value) {
    out_ << name;
    if (!l.empty()) {
      out_ << '{';
      for (std::size_t i = 0; i < l.size(); ++i) {
        out_ << (i ? "," : "") << l[i].first << "=\"";
        for (char c : l[i].second) {
          if (c == '\\') out_ << "\\\\";
          else if (c == '"') out_ << "\\\"";
          else if (c == '\n') out_ << "\\n";
          else out_ << c;
        }
        out_ << '"';
      }
      out_ << '}';
    }
    out_ << ' ' << number(value) << '\n';
  }

  /// A histogram's samples: _bucket per bound and +Inf, _sum, _count.
  void histogram_samples(std::string_view name, const labels& l, const histogram::snapshot& h) {
    const std::string bucket = std::string(name) + "_bucket";
    for (std::size_t i = 0; i < histogram::bounds.size(); ++i) {
      auto with_le = l;
      with_le.emplace_back("le", number(histogram::bounds[i]));
      sample(bucket, with_le, static_cast<double>(h.cumulative[i]));
    }
    auto inf = l;
    inf.emplace_back("le", "+Inf");
    sample(bucket, inf, static_cast<double>(h.count));
    sample(std::string(name) + "_sum", l, h.sum);
    sample(std::string(name) + "_count", l, static_cast<double>(h.count));
  }

  [[nodiscard]] std::string str() const { return out_.str(); }

  /// A float as Prometheus reads it: integers exactly, else the shortest form
  /// that reads back the same (locale-free); NaN, +Inf, -Inf.
  static std::string number(double v) {
    if (std::isnan(v)) return "NaN";
    if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
    if (v == std::floor(v) && std::fabs(v) < 1e15) return std::to_string(static_cast<std::int64_t>(v));
    std::array<char, 32> buffer{};
    const auto end = std::to_chars(buffer.data(), buffer.data() + buffer.size(), v).ptr;  // shortest round trip
    return std::string(buffer.data(), end);
  }

 private:
  std::ostringstream out_;
};

}  // namespace memscale::observability

// memscale benchmark (bench_memscale.cpp), shared pieces: the run's constants,
// what the machine is (BLAS, load), and the formatting of figures and tables.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <memscale/device/process_memory.hpp>

namespace bench {


using clock_type = std::chrono::steady_clock;
constexpr double gib = 1024.0 * 1024.0 * 1024.0;
constexpr std::uint64_t init_seed = 42;
constexpr std::uint64_t train_seed = 1234;
constexpr double learning_rate = 3e-4;
constexpr double balanced_budget_fraction = 0.6;
constexpr std::int64_t dp_buckets = 8192;  ///< live-byte resolution of the optimal-DP yardstick

/// A child process's one row (--solo NAME --budget-gb X): only that row is built and
/// measured, in a process of its own (benchmarks/bench_process.hpp runs them).
struct solo_options {
  std::string row;
  double budget_gb = 0.0;
  bool default_malloc = false;  ///< leave glibc's dynamic mmap threshold (default: fix it)
};
inline solo_options& solo() {
  static solo_options options;
  return options;
}

// --- machine information ---------------------------------------------------------

/// The malloc this run's processes use: this process's, and what the
/// one-process-per-row children do with glibc's mmap threshold.
inline std::string malloc_in_use() {
  const auto kind = memscale::process_malloc();
  if (kind != memscale::malloc_kind::glibc) return std::string(memscale::to_string(kind)) + ", in every process";
  return solo().default_malloc ? "glibc, its default (dynamic) mmap threshold in every process"
                               : "glibc; the rows alone in a fresh process fix its mmap threshold "
                                 "(fix_malloc_mmap_threshold()), the interleaved rows keep the default";
}

inline std::string blas_details() {
  std::ostringstream os;
  using memscale::detail::process_symbol;
  if (auto* threads = process_symbol<int()>("openblas_get_num_threads")) os << "OpenBLAS threads " << threads();
  if (auto* config = process_symbol<char*()>("openblas_get_config")) os << ", config: " << config();
  return os.str();
}

inline std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

inline std::string utc_now() {
  const auto t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

// --- formatting -----------------------------------------------------------------------

inline std::string mib(double bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << bytes / (1024.0 * 1024.0) << " MiB";
  return os.str();
}

inline std::string ms(double seconds, int precision = 1) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(precision) << seconds * 1e3 << " ms";
  return os.str();
}

inline std::string ratio(double num, double den) {
  if (!(den > 0.0)) return num > 0.0 ? "inf" : "-";
  std::ostringstream os;
  os << std::fixed << std::setprecision(3) << num / den << "x";
  return os.str();
}

template <class T>
double median(std::vector<T> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 == 1 ? static_cast<double>(v[n / 2])
                    : (static_cast<double>(v[n / 2 - 1]) + static_cast<double>(v[n / 2])) / 2.0;
}

/// The q-quantile of `v` (0 <= q <= 1), interpolated between order statistics; 0 when empty.
inline double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double at = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(at);
  const auto hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (at - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

/// A plain-text table: right-aligned columns except the first.
class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print(std::ostream& os) const {
    std::vector<std::size_t> width(rows_.front().size(), 0);
    for (const auto& r : rows_)
      for (std::size_t i = 0; i < r.size() && i < width.size(); ++i) width[i] = std::max(width[i], r[i].size());
    for (std::size_t k = 0; k < rows_.size(); ++k) {
      const auto& r = rows_[k];
      for (std::size_t i = 0; i < r.size(); ++i) {
        if (i == 0) os << std::left << std::setw(static_cast<int>(width[i])) << r[i] << std::right;
        else os << "  " << std::setw(static_cast<int>(width[i])) << r[i];
      }
      os << "\n";
      if (k == 0) {
        std::size_t total = 0;
        for (auto w : width) total += w + 2;
        os << std::string(total - 2, '-') << "\n";
      }
    }
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace bench

// memscale benchmark (bench_memscale.cpp): every row again, each alone in a
// fresh process of its own (this program re-executed with --solo ROW), so that
// what a row's process holds is its own: the step's resident peak (VmHWM) over
// the process before the model was built, beside the planner's projected peak,
// and the step time with no other row sharing the process's heaps and caches.
// Under glibc's malloc the children call memscale::fix_malloc_mmap_threshold()
// first, as the planner's note asks of a CPU budget that is to hold for the
// process (--default-malloc: they do not); under tcmalloc (LD_PRELOAD) there is
// nothing to fix. Their losses must equal the parent's baseline row's, bit for
// bit (rows that keep the arithmetic).
#pragma once

#include <unistd.h>

#include <bit>
#include <cstdint>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "bench_print.hpp"
#include "bench_runner.hpp"

namespace bench {

/// The line a --solo child prints: its row's figures and its losses' bits.
inline std::string solo_line(const RowResult& r) {
  std::ostringstream os;
  os << "SOLO\t" << std::setprecision(17) << r.step_seconds << '\t' << r.growth << '\t' << r.total_peak << '\t'
     << r.process_growth << '\t' << r.process_total << '\t'
     << (r.report ? static_cast<double>(r.report->planned_peak_bytes()) : -1.0) << '\t'
     << projected_step_seconds(r) << '\t';
  for (std::size_t i = 0; i < r.losses.size(); ++i) os << (i ? "," : "") << std::bit_cast<std::uint32_t>(r.losses[i]);
  return os.str();
}

struct SoloRow {
  std::string name;
  bool ok = false;
  std::string error;
  double step_seconds = 0, growth = 0, total_peak = 0, process_growth = -1, process_total = -1, projected = -1;
  double projected_seconds = 0;  ///< the plan's projected step time (0: no plan)
  std::vector<float> losses;
};

inline std::string shell_quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

/// Runs `row` of workload `part` in a child process and reads its SOLO line.
inline SoloRow run_solo(const std::string& part, const std::string& row, int steps, double budget_gb) {
  SoloRow result;
  result.name = row;
  char exe[4096] = {};
  const auto length = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (length <= 0) {
    result.error = "cannot find this program (/proc/self/exe)";
    return result;
  }
  std::ostringstream cmd;
  cmd << shell_quoted(std::string(exe, static_cast<std::size_t>(length))) << " --only " << part << " --steps "
      << steps << " --solo " << shell_quoted(row) << " --budget-gb " << std::setprecision(17) << budget_gb
      << (solo().default_malloc ? " --default-malloc" : "") << " 2>/dev/null";
  FILE* pipe = ::popen(cmd.str().c_str(), "r");
  if (pipe == nullptr) {
    result.error = "popen failed";
    return result;
  }
  std::string out;
  char buffer[4096];
  while (const auto n = std::fread(buffer, 1, sizeof buffer, pipe)) out.append(buffer, n);
  const int status = ::pclose(pipe);
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("SOLO\t", 0) != 0) continue;
    std::istringstream fields(line.substr(5));
    std::string losses;
    fields >> result.step_seconds >> result.growth >> result.total_peak >> result.process_growth >>
        result.process_total >> result.projected >> result.projected_seconds >> losses;
    std::istringstream bits(losses);
    for (std::string word; std::getline(bits, word, ',');)
      result.losses.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(std::stoul(word))));
    result.ok = static_cast<bool>(fields) || fields.eof();
  }
  if (!result.ok) result.error = "the child exited with status " + std::to_string(status) + " and no result";
  return result;
}

/// Runs every row of `w` alone and prints the table; false if a row failed or
/// lost bit-exactness against the parent's baseline.
inline bool print_process_rows(const Workload& w, const std::string& part, int steps, std::ostream& os) {
  std::vector<SoloRow> solo_rows;
  for (const auto& r : w.rows) {
    std::cerr << "[bench] " << w.title << ": " << r.name << " alone in a fresh process\n";
    solo_rows.push_back(run_solo(part, r.name, steps, r.budget_gb.value_or(w.balanced_budget_gb)));
  }
  const auto& base = solo_rows.front();
  const double base_projected = static_cast<double>(projected_baseline(w));
  // The baseline has no plan: the Conservative row's profile (it applies
  // nothing here) is the un-optimized step's, made in a fresh process too.
  double base_projected_seconds = 0.0;
  for (const auto& s : solo_rows)
    if (s.ok && s.name == "Conservative") base_projected_seconds = s.projected_seconds;
  bool fine = true;
  Table t({"one process per row", "step", "vs base", "projected", "proj/meas", "tracked growth", "process growth", "vs base", "process peak",
           "vs base", "projected", "proj/process", "bit-exact"});
  for (std::size_t i = 0; i < solo_rows.size(); ++i) {
    const auto& s = solo_rows[i];
    const auto& parent = w.rows[i];
    if (!s.ok) {
      t.add({s.name, "failed: " + s.error, "", "", "", "", "", "", "", "", "", "", ""});
      fine = false;
      continue;
    }
    const double projected = i == 0 ? base_projected : s.projected;
    const double seconds = i == 0 ? base_projected_seconds : s.projected_seconds;
    const bool exact = same_losses(s.losses, w.rows.front().losses);
    if (parent.exact_expected && !exact) fine = false;
    t.add({s.name, ms(s.step_seconds), ratio(s.step_seconds, base.step_seconds), seconds > 0 ? ms(seconds) : "-",
           seconds > 0 ? ratio(seconds, s.step_seconds) : "-", mib(s.growth),
           s.process_growth >= 0 ? mib(s.process_growth) : "-", ratio(s.process_growth, base.process_growth),
           s.process_total >= 0 ? mib(s.process_total) : "-", ratio(s.process_total, base.process_total),
           projected > 0 ? mib(projected) : "-",
           projected > 0 && s.process_total > 0 ? ratio(projected, s.process_total) : "-",
           parent.exact_expected ? (exact ? "yes" : "NO") : "-"});
  }
  os << "\n";
  t.print(os);
  os << "one process per row: each row alone in a fresh process (this program, --solo; malloc: "
     << malloc_in_use() << "), its medians over "
     << steps << " steps, each after an unmeasured one as in the turns above, after the same warm-up and "
        "calibration step; projected (time): as in the table above, "
        "from the plan made in that process (the baseline row: the Conservative row's, which applies nothing); "
        "process growth: a step's resident peak "
        "over its start; process peak: over the process before the model was built (parameters, gradients, AdamW "
        "state, what the process holds outside LibTorch's allocator, and the step); projected: the plan's projected "
        "step peak (the baseline row: the un-optimized projection), static bytes and the reserve outside the "
        "allocator included; bit-exact: its losses against the baseline row above, bit for bit.\n";
  return fine;
}

}  // namespace bench

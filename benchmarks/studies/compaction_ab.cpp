// Study (issue 13, "Balanced at most 1.10x"): the benchmark GPT's Balanced
// forced step against the baseline with few rows in the process, so that the
// comparison is not buried in the interleaved benchmark's sixteen models. Rows
// take turns two steps at a time (the second measured), medians of each row:
//   baseline                  no guard
//   forced                    Balanced, force_optimize (saved tensors compacted)
//   forced zeros kept         the same with pack_saved_zeros off (rows' +0 tails kept)
//   forced saved as is        the same with pack_saved_masks, recompute_saved_outputs
//                             and pack_saved_zeros off
//   balanced applies nothing  Balanced without force_optimize: nothing presses, so it
//                             applies nothing (what the guard alone costs)
// `--extra N` adds N more copies of the first three rows (more memory touched
// between a step's forward and its backward); `--context T --batch B` train the
// GPT at another context length and batch (default 128 and 16: the benchmark's). Also prints the step's minor page
// faults (glibc's default malloc: none once warm). Not built by CMake; see README.md.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <memscale/memscale.hpp>

#include "gpt.hpp"

namespace {
long minor_faults() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return r.ru_minflt;
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  int steps = 15, extra = 0;
  std::int64_t context = 128, batch_size = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--steps") steps = std::atoi(argv[i + 1]);
    if (flag == "--extra") extra = std::atoi(argv[i + 1]);
    if (flag == "--context") context = std::atoll(argv[i + 1]);
    if (flag == "--batch") batch_size = std::atoll(argv[i + 1]);
  }
  at::set_num_threads(1);  // as bench_memscale
  memscale::memory_tracker::install();  // a step's growth: the allocator's peak over its start
  auto o = gpt::benchmark_options();
  o.context = context;
  const auto text = gpt::encode(gpt::training_text());
  std::mt19937_64 rng(7);
  const auto batch = gpt::sample_batch(text, batch_size, o.context, rng);

  memscale::Config forced;
  forced.mode = memscale::OptimizationMode::Balanced;
  forced.force_optimize = true;
  forced.enable_offloading = false;
  forced.enable_logging = false;
  auto zeros_kept = forced;
  zeros_kept.pack_saved_zeros = false;
  auto as_is = zeros_kept;
  as_is.pack_saved_masks = false;
  as_is.recompute_saved_outputs = false;
  auto nothing = forced;
  nothing.force_optimize = false;
  std::vector<std::pair<std::string, std::optional<memscale::Config>>> rows = {
      {"baseline", std::nullopt}, {"forced", forced}, {"forced zeros kept", zeros_kept}, {"forced saved as is", as_is},
      {"balanced applies nothing", nothing}};
  for (int e = 0; e < extra; ++e) {
    rows.emplace_back("baseline again", std::nullopt);
    rows.emplace_back("forced again", forced);
    rows.emplace_back("forced saved as is again", as_is);
  }

  std::vector<gpt::GPT> models;
  std::vector<std::unique_ptr<torch::optim::AdamW>> optimizers;
  std::vector<std::optional<memscale::OptimizationGuard>> guards(rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    torch::manual_seed(1);
    models.emplace_back(o);
    optimizers.push_back(
        std::make_unique<torch::optim::AdamW>(models.back()->parameters(), torch::optim::AdamWOptions(3e-4)));
    if (rows[i].second) guards[i].emplace(memscale::optimize(models[i], batch.input, *rows[i].second));
  }
  std::vector<std::vector<double>> ms(rows.size()), faults(rows.size()), growth(rows.size());
  for (int s = 0; s < steps + 2; ++s)
    for (std::size_t i = 0; i < rows.size(); ++i) {
      torch::manual_seed(100 + s);
      for (int turn = 0; turn < 2; ++turn) {
        const auto f0 = minor_faults();
        memscale::memory_tracker::reset_peak();
        const auto live = memscale::memory_tracker::current_bytes();
        const auto t0 = std::chrono::steady_clock::now();
        optimizers[i]->zero_grad();
        gpt::loss(models[i]->forward(batch.input), batch.target).backward();
        optimizers[i]->step();
        const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3;
        if (s >= 2 && turn == 1) {
          ms[i].push_back(elapsed);
          faults[i].push_back(static_cast<double>(minor_faults() - f0));
          growth[i].push_back(static_cast<double>(memscale::memory_tracker::peak_bytes() - live) / (1 << 20));
        }
      }
    }
  for (std::size_t i = 0; i < rows.size(); ++i)
    std::cout << rows[i].first << ": growth " << median(growth[i]) << " MiB (" << median(growth[i]) / median(growth[0])
              << "x), " << (guards[i] ? guards[i]->report().checkpointed_segments() : 0) << " checkpoints, "
              << median(ms[i]) << " ms (" << median(ms[i]) / median(ms[0])
              << "x), minor faults a step " << median(faults[i]) << "\n";
}

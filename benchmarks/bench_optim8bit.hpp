// memscale benchmark section: torch::optim::AdamW against memscale::optim::AdamW8bit
// on the same parameters, on the CPU, measured in one run. Workload: an MLP of
// four Linear(1024,1024) layers with GELU between (4.2M parameters, all
// weights quantized, biases fp32) trained online against a fixed teacher
// (batch 64, a fresh batch per step from a fixed seed); each optimizer trains
// its own identically initialized copy on the same batches, and the two take
// turns step by step so that load changes hit both alike. Per optimizer:
//   - state: live CPU bytes the first step adds (memory_tracker), per parameter;
//   - step peak: the peak growth within a later step (temporaries);
//   - step: mean wall time of optimizer.step() over all steps but the first;
//   - loss: held-out MSE after the run (the run is max(steps, 30) steps long).
// bench_memscale.cpp includes this header and calls bench_optimizer().
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iomanip>
#include <ostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/device/memory_tracker.hpp>
#include <memscale/techniques/optim8bit.hpp>

namespace memscale_bench_optim8bit {

struct optimizer_result {
  std::string name;
  std::int64_t state_bytes = 0;
  std::int64_t step_peak_growth = 0;  ///< largest over the timed steps
  double step_seconds = 0.0;          ///< mean over the timed steps
  float final_loss = 0.0f;
};

inline torch::nn::Sequential mlp() {
  torch::manual_seed(31);
  torch::nn::Sequential model;
  for (int layer = 0; layer < 4; ++layer) {
    if (layer > 0) model->push_back(torch::nn::GELU());
    model->push_back(torch::nn::Linear(1024, 1024));
  }
  return model;
}

/// Inputs and targets of the online regression: sin of a fixed projection.
inline std::pair<torch::Tensor, torch::Tensor> batch(const torch::Tensor& teacher, std::int64_t rows) {
  auto x = torch::randn({rows, 1024});
  return {x, torch::sin(x.matmul(teacher))};
}

inline std::string fixed(double value, int precision) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(precision) << value;
  return os.str();
}

}  // namespace memscale_bench_optim8bit

/// Prints the table (and with `csv`, the same rows as CSV) to `out`.
inline void bench_optimizer(std::ostream& out, int steps, bool csv) {
  namespace b = memscale_bench_optim8bit;
  using clock_type = std::chrono::steady_clock;
  memscale::memory_tracker::install();
  torch::NoGradGuard no_grad_outside_steps;
  const int run_steps = std::max(steps, 30);
  torch::manual_seed(32);
  const auto teacher = torch::randn({1024, 1024}) / 32.0;
  const auto [held_out_x, held_out_y] = b::batch(teacher, 1024);

  auto reference_model = b::mlp();
  auto model = b::mlp();
  std::int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();
  const memscale::optimizer_options options{.lr = 1e-3};
  auto reference = memscale::make_optimizer({.use_8bit_optimizer = false}, reference_model->parameters(), options);
  auto eight_bit = memscale::make_optimizer({.use_8bit_optimizer = true}, model->parameters(), options);
  std::vector<std::pair<torch::nn::Sequential*, torch::optim::Optimizer*>> runs = {
      {&reference_model, reference.get()}, {&model, eight_bit.get()}};
  std::vector<b::optimizer_result> results(2);
  results[0].name = "torch::optim::AdamW";
  results[1].name = "memscale::optim::AdamW8bit";

  torch::manual_seed(33);
  for (int step = 0; step < run_steps; ++step) {
    const auto [x, y] = b::batch(teacher, 64);
    for (std::size_t r = 0; r < runs.size(); ++r) {
      auto& [net, optimizer] = runs[r];
      optimizer->zero_grad();
      {
        at::AutoGradMode grad_mode(true);
        torch::mse_loss((*net)->forward(x), y).backward();
      }
      memscale::memory_tracker::peak_scope scope;
      const auto start = clock_type::now();
      optimizer->step();
      const double seconds = std::chrono::duration<double>(clock_type::now() - start).count();
      if (step == 0) {
        results[r].state_bytes = memscale::memory_tracker::current_bytes() - scope.baseline();
      } else {
        results[r].step_seconds += seconds / (run_steps - 1);
        results[r].step_peak_growth = std::max(results[r].step_peak_growth, scope.peak_growth());
      }
    }
  }
  for (std::size_t r = 0; r < runs.size(); ++r)
    results[r].final_loss = torch::mse_loss((*runs[r].first)->forward(held_out_x), held_out_y).item<float>();

  const auto& base = results.front();
  out << "\n## optimizer state: torch::optim::AdamW vs memscale::optim::AdamW8bit (CPU)\n"
      << "4 x Linear(1024,1024) with GELU (" << parameters << " parameters), online regression, batch 64, "
      << run_steps << " steps, lr 1e-3, weight decay 1e-2; state = bytes the first step adds (memory tracker); "
      << "step = mean of optimizer.step() over steps 2.." << run_steps << "; loss = held-out MSE at the end\n\n";
  out << "| optimizer | state | bytes/param | vs AdamW | step peak | step | vs AdamW | final loss | vs AdamW |\n"
         "|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& r : results) {
    const auto bytes = static_cast<double>(r.state_bytes);
    out << "| " << r.name << " | " << b::fixed(bytes / (1024.0 * 1024.0), 2) << " MiB | "
        << b::fixed(bytes / static_cast<double>(parameters), 3) << " | "
        << b::fixed(bytes / static_cast<double>(base.state_bytes), 3) << "x | "
        << b::fixed(static_cast<double>(r.step_peak_growth) / (1024.0 * 1024.0), 2) << " MiB | "
        << b::fixed(r.step_seconds * 1e3, 2) << " ms | " << b::fixed(r.step_seconds / base.step_seconds, 2) << "x | "
        << b::fixed(r.final_loss, 5) << " | " << (r.final_loss >= base.final_loss ? "+" : "")
        << b::fixed(100.0 * (r.final_loss - base.final_loss) / base.final_loss, 2) << "% |\n";
  }
  if (csv) {
    out << "\noptimizer,parameters,state_bytes,step_peak_growth_bytes,step_ms,final_loss\n";
    for (const auto& r : results)
      out << r.name << ',' << parameters << ',' << r.state_bytes << ',' << r.step_peak_growth << ','
          << b::fixed(r.step_seconds * 1e3, 4) << ',' << b::fixed(r.final_loss, 6) << "\n";
  }
}

// Study: does the planner's projection hold on a model with no Sequential whose
// saved tensors are many small views, a 2-layer LSTM language model (issue 13's
// "the projection stays honest"; session 41's trial found its whole-model
// offload projected to cut 38 MiB and measured at 14). Not built by CMake;
// build and run as benchmarks/studies/README.md says:
//   ./lstm_projection MODE [BATCH] [LENGTH] [--print]   (defaults: aggressive 32 128)
// MODE: baseline, balanced (Balanced, force_optimize), aggressive. Prints the
// allocator's step growth (memory_tracker::peak_scope, the largest of 6 steps
// after 2), the process's resident growth and the median step time; with
// memscale, the projected peaks; --print adds the Report. PHASES=1 prints each
// step's live bytes at the forward's end and its forward and backward peaks.
#include <torch/torch.h>
#include <memscale/memscale.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>
namespace nn = torch::nn;
struct LSTMLMImpl : nn::Module {
  nn::Embedding emb{nullptr};
  nn::LSTM lstm{nullptr};
  nn::Linear head{nullptr};
  LSTMLMImpl(int V, int E, int H, double drop) {
    emb = register_module("emb", nn::Embedding(V, E));
    lstm = register_module("lstm", nn::LSTM(nn::LSTMOptions(E, H).num_layers(2).batch_first(true).dropout(drop)));
    head = register_module("head", nn::Linear(H, V));
  }
  torch::Tensor forward(torch::Tensor tok) {
    return head(std::get<0>(lstm(emb(tok))));
  }
};
TORCH_MODULE(LSTMLM);
int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "aggressive";
  const int64_t batch = argc > 2 ? std::atoll(argv[2]) : 32;
  const int64_t T = argc > 3 ? std::atoll(argv[3]) : 128;
  const int V = 2000;
  memscale::memory_tracker::install();
  torch::manual_seed(1);
  LSTMLM model(V, 128, 256, 0.2);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto x = torch::randint(V, {batch, T});
  auto t = torch::randint(V, {batch, T});
  auto step = [&] {
    opt.zero_grad();
    auto c0 = memscale::memory_tracker::current_bytes();
    memscale::memory_tracker::reset_peak();
    auto loss = torch::nn::functional::cross_entropy(model->forward(x).reshape({-1, V}), t.reshape({-1}));
    auto c1 = memscale::memory_tracker::current_bytes(); auto p1 = memscale::memory_tracker::peak_bytes();
    memscale::memory_tracker::reset_peak();
    loss.backward();
    auto p2 = memscale::memory_tracker::peak_bytes(); auto c2 = memscale::memory_tracker::current_bytes();
    if (getenv("PHASES")) std::printf("fwd end %+.2f (fwd peak %+.2f) bwd peak %+.2f bwd end %+.2f MiB\n", (c1-c0)/1048576.0, (p1-c0)/1048576.0, (p2-c0)/1048576.0, (c2-c0)/1048576.0);
    opt.step();
    return loss.item<double>();
  };
  std::optional<memscale::OptimizationGuard> guard;
  memscale::Config cfg;
  if (mode != "baseline") {
    cfg.mode = mode == "aggressive" ? memscale::OptimizationMode::Aggressive : memscale::OptimizationMode::Balanced;
    cfg.force_optimize = true;
    guard.emplace(memscale::optimize(model, x, cfg));
  }
  step(); step();
  std::vector<double> times; int64_t growth = 0, pgrowth = 0;
  for (int i = 0; i < 6; ++i) {
    memscale::memory_tracker::process_peak_scope ps;
    memscale::memory_tracker::peak_scope s;
    auto t0 = std::chrono::steady_clock::now();
    double l = step();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    growth = std::max(growth, s.peak_growth());
    if (ps.active()) pgrowth = std::max(pgrowth, ps.peak_growth());
    if (i == 5) std::cout << "loss " << l << "\n";
  }
  std::sort(times.begin(), times.end());
  std::cout << mode << " growth " << growth / 1048576.0 << " MiB, process growth " << pgrowth / 1048576.0
            << " MiB, step " << times[3] * 1e3 << " ms\n";
  if (guard) {
    auto r = guard->report();
    std::cout << "projected baseline " << r.baseline_peak_bytes() / 1048576.0 << " planned " << r.planned_peak_bytes() / 1048576.0
              << " static " << r.static_bytes() / 1048576.0 << " MiB; recompute " << r.recompute_seconds() * 1e3 << " ms\n";
    if (argc > 4 && std::string(argv[4]) == "--print") std::cout << r << "\n";
  }
}

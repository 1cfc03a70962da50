// Study: does the planner's projection hold on a U-Net, whose Sequentials the
// model's own code joins (max pools, transposed convolutions, torch::cat skips)?
// (issue 13's "the projection stays honest"). Not built by CMake; build and run
// as benchmarks/studies/README.md says:
//   ./unet_projection MODE [BATCH] [SIDE] [--width C] [--print]
// MODE: baseline, balanced (Balanced, force_optimize), ckpt (the same,
// checkpointing only), aggressive. C: the first level's channels (16; the
// bottom has 8 C, where at 64 a 3x3 layer's weight outweighs its input). Prints the allocator's step growth
// (memory_tracker::peak_scope, the largest of 8 steps after 2), the process's
// resident growth, the median step time; with memscale, the projected peaks
// and, per unit boundary, the projected timeline (baseline and planned) beside
// a traced step's (OptimizationGuard::trace_step); --print adds the Report.
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
nn::Sequential dc(int64_t in, int64_t out) {
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(in, out, 3).padding(1).bias(false)), nn::BatchNorm2d(out), nn::ReLU(),
                        nn::Conv2d(nn::Conv2dOptions(out, out, 3).padding(1).bias(false)), nn::BatchNorm2d(out), nn::ReLU());
}
struct UNetImpl : nn::Module {
  nn::Sequential e1{nullptr}, e2{nullptr}, e3{nullptr}, b{nullptr}, d3{nullptr}, d2{nullptr}, d1{nullptr};
  nn::ConvTranspose2d u3{nullptr}, u2{nullptr}, u1{nullptr};
  nn::Conv2d head{nullptr};
  UNetImpl(int64_t c = 16) {
    e1 = register_module("e1", dc(3, c)); e2 = register_module("e2", dc(c, 2 * c)); e3 = register_module("e3", dc(2 * c, 4 * c));
    b = register_module("b", dc(4 * c, 8 * c));
    u3 = register_module("u3", nn::ConvTranspose2d(nn::ConvTranspose2dOptions(8 * c, 4 * c, 2).stride(2)));
    d3 = register_module("d3", dc(8 * c, 4 * c));
    u2 = register_module("u2", nn::ConvTranspose2d(nn::ConvTranspose2dOptions(4 * c, 2 * c, 2).stride(2)));
    d2 = register_module("d2", dc(4 * c, 2 * c));
    u1 = register_module("u1", nn::ConvTranspose2d(nn::ConvTranspose2dOptions(2 * c, c, 2).stride(2)));
    d1 = register_module("d1", dc(2 * c, c));
    head = register_module("head", nn::Conv2d(nn::Conv2dOptions(c, 2, 1)));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto x1 = e1->forward(x);
    auto x2 = e2->forward(torch::max_pool2d(x1, 2));
    auto x3 = e3->forward(torch::max_pool2d(x2, 2));
    auto y = b->forward(torch::max_pool2d(x3, 2));
    y = d3->forward(torch::cat({u3->forward(y), x3}, 1));
    y = d2->forward(torch::cat({u2->forward(y), x2}, 1));
    y = d1->forward(torch::cat({u1->forward(y), x1}, 1));
    return head->forward(y);
  }
};
TORCH_MODULE(UNet);

int main(int argc, char** argv) {
  std::vector<std::string> args;
  bool print = false;
  int64_t width = 16;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--print") print = true;
    else if (a == "--width" && i + 1 < argc) width = std::atoll(argv[++i]);
    else args.push_back(a);
  }
  const std::string mode = args.size() > 0 ? args[0] : "balanced";
  const int64_t batch = args.size() > 1 ? std::atoll(args[1].c_str()) : 8;
  const int64_t side = args.size() > 2 ? std::atoll(args[2].c_str()) : 96;
  memscale::memory_tracker::install();
  torch::manual_seed(1);
  UNet model(width);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto x = torch::randn({batch, 3, side, side});
  auto t = torch::randint(2, {batch, side, side}, torch::kLong);
  auto step = [&] {
    opt.zero_grad();
    auto loss = torch::cross_entropy_loss(model->forward(x), t);
    loss.backward();
    opt.step();
    return loss.item<double>();
  };
  std::optional<memscale::OptimizationGuard> guard;
  memscale::Config cfg;
  if (mode != "baseline") {
    cfg.mode = mode == "aggressive" ? memscale::OptimizationMode::Aggressive : memscale::OptimizationMode::Balanced;
    cfg.force_optimize = true;
    if (mode == "ckpt") { cfg.enable_offloading = false; }
    guard.emplace(memscale::optimize(model, x, cfg));
  }
  step(); step();
  std::vector<double> times; int64_t growth = 0, pgrowth = 0;
  for (int i = 0; i < 8; ++i) {
    memscale::memory_tracker::process_peak_scope ps;
    memscale::memory_tracker::peak_scope s;
    auto t0 = std::chrono::steady_clock::now();
    double l = step();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    growth = std::max(growth, s.peak_growth());
    if (ps.active()) pgrowth = std::max(pgrowth, ps.peak_growth());
    if (i == 7) std::cout << "loss " << l << "\n";
  }
  std::sort(times.begin(), times.end());
  std::cout << mode << " growth " << growth / 1048576.0 << " MiB, process growth " << pgrowth / 1048576.0
            << " MiB, step " << times[3] * 1e3 << " ms\n";
  if (guard) {
    auto r = guard->report();
    std::cout << "projected baseline " << r.baseline_peak_bytes() / 1048576.0 << " planned " << r.planned_peak_bytes() / 1048576.0
              << " static " << r.static_bytes() / 1048576.0 << " MiB; recompute " << r.recompute_seconds() * 1e3 << " ms\n";
    if (print) std::cout << r << "\n";
    auto tr = guard->trace_step([&] { step(); });
    auto proj = memscale::html_detail::timeline(tr, true);
    auto base = memscale::html_detail::timeline(tr, false);
    auto meas = memscale::html_detail::measured(tr);
    for (auto& p : proj) {
      double m = -1; for (auto& q : meas) if (q.x == p.x) m = q.bytes / 1048576.0;
      double b = -1; for (auto& q : base) if (q.x == p.x) b = q.bytes / 1048576.0;
      std::printf("%6.1f %-40s base %8.2f proj %8.2f meas %8.2f\n", p.x, p.label.c_str(), b, p.bytes / 1048576.0, m);
    }
  }
}

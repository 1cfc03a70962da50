// memscale GPU offload benchmark (needs a CUDA LibTorch and a GPU; elsewhere it
// says so and exits 0). Measures, in one run:
//   1. host<->device bandwidth for pinned and pageable host memory;
//   2. the example GPT on the GPU: peak CUDA memory growth of a training step
//      (caching-allocator statistics) and step time for baseline, checkpoint,
//      checkpoint + offload (async), offload only (async); plus the offload
//      engine's transfer time and how much of it prefetching hid;
//   3. optimizer steps on the same CUDA parameters: torch::optim::AdamW,
//      ATen's fused AdamW kernel (LibTorch 2.x), memscale::optim::AdamW8bit
//      (memscale::cuda's fused kernel when linked): step time and state bytes.
//   memscale_bench_gpu [--steps N]
#include <algorithm>
#include <chrono>
#include <charconv>
#include <iomanip>
#include <iostream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#include <memscale/memscale.hpp>

#include "gpt.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

/// GB/s of copying `bytes` from `src` into `dst`, median of 5 after a warm-up.
double bandwidth(const torch::Tensor& src, torch::Tensor& dst) {
  std::vector<double> times;
  for (int i = 0; i < 6; ++i) {
    torch::cuda::synchronize();
    const auto start = clock_type::now();
    dst.copy_(src, /*non_blocking=*/true);
    torch::cuda::synchronize();
    if (i > 0) times.push_back(seconds_since(start));
  }
  return static_cast<double>(src.nbytes()) / median(times) / 1e9;
}

struct Row {
  std::string name;
  double growth_mib = 0.0;
  double step_ms = 0.0;
  std::optional<memscale::offload::engine_stats> stats;
  int steps = 0;
  std::vector<float> losses;
};

Row run_gpt(const std::string& name, const std::optional<memscale::Config>& config, int steps) {
  const c10::Device gpu(torch::kCUDA, 0);
  gpt::Options o;
  o.context = 256;
  o.d_model = 768;
  o.heads = 12;
  o.layers = 12;
  o.dropout = 0.0;  // the CUDA dropout RNG is exercised by the tests; here only time and memory
  const std::int64_t batch = 16;
  torch::manual_seed(1);
  gpt::GPT model(o);
  model->to(gpu);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-4));
  const auto text = gpt::encode(gpt::training_text());
  std::mt19937_64 rng(7);
  auto first = gpt::sample_batch(text, batch, o.context, rng);
  std::optional<memscale::OptimizationGuard> guard;
  if (config) guard.emplace(memscale::optimize(model, first.input.to(gpu), *config));
  Row row;
  row.name = name;
  std::vector<double> growth, times;
  for (int s = 0; s < steps + 1; ++s) {
    auto b = gpt::sample_batch(text, batch, o.context, rng);
    auto input = b.input.to(gpu), target = b.target.to(gpu);
    torch::cuda::synchronize();
    memscale::memory_tracker::peak_scope scope(gpu);
    const auto start = clock_type::now();
    optimizer.zero_grad();
    auto loss = gpt::loss(model->forward(input), target);
    loss.backward();
    optimizer.step();
    torch::cuda::synchronize();
    if (s > 0) {  // the first step creates AdamW's state
      times.push_back(seconds_since(start));
      growth.push_back(static_cast<double>(scope.peak_growth()));
    }
    row.losses.push_back(loss.item<float>());
  }
  row.growth_mib = median(growth) / (1024.0 * 1024.0);
  row.step_ms = median(times) * 1e3;
  row.steps = steps + 1;
  if (guard) row.stats = guard->offload_stats();
  return row;
}

struct OptimizerRow {
  std::string name;
  double step_ms = 0.0;
  std::int64_t state_bytes = 0;
};

/// Median step time of `step` (one warm-up first, which creates the state) and
/// the CUDA bytes that warm-up left allocated.
template <class Step>
OptimizerRow time_optimizer(const std::string& name, int steps, Step&& step) {
  const c10::Device gpu(torch::kCUDA, 0);
  OptimizerRow row;
  row.name = name;
  torch::cuda::synchronize();
  const auto before = memscale::memory_tracker::current_bytes(gpu);
  step();
  torch::cuda::synchronize();
  row.state_bytes = memscale::memory_tracker::current_bytes(gpu) - before;
  std::vector<double> times;
  for (int s = 0; s < steps; ++s) {
    const auto start = clock_type::now();
    step();
    torch::cuda::synchronize();
    times.push_back(seconds_since(start));
  }
  row.step_ms = median(times) * 1e3;
  return row;
}

/// AdamW's step on 8 CUDA parameters of 4096 x 4096 (134M), three ways.
void bench_optimizers(int steps) {
  const c10::Device gpu(torch::kCUDA, 0);
  const int count = 8;
  const std::int64_t side = 4096;
  const double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-2;
  torch::manual_seed(3);
  std::vector<torch::Tensor> grads;
  for (int i = 0; i < count; ++i) grads.push_back(torch::randn({side, side}, gpu) * 1e-2);
  const auto parameters = [&] {
    torch::manual_seed(4);
    std::vector<torch::Tensor> params;
    for (int i = 0; i < count; ++i) {
      params.push_back(torch::randn({side, side}, gpu).requires_grad_(true));
      params.back().mutable_grad() = grads[static_cast<std::size_t>(i)];
    }
    return params;
  };
  std::vector<OptimizerRow> rows;
  {
    auto params = parameters();
    torch::optim::AdamW adamw(params, torch::optim::AdamWOptions(lr).betas({beta1, beta2}).eps(eps).weight_decay(
                                          weight_decay));
    rows.push_back(time_optimizer("torch::optim::AdamW", steps, [&] { adamw.step(); }));
  }
#if TORCH_VERSION_MAJOR >= 2
  {
    // The kernel behind PyTorch's AdamW(fused=True); LibTorch's C++ AdamW has no fused option.
    auto params = parameters();
    std::vector<torch::Tensor> exp_avgs, exp_avg_sqs, state_steps;
    const auto make_state = [&] {
      for (const auto& p : params) {
        exp_avgs.push_back(torch::zeros_like(p));
        exp_avg_sqs.push_back(torch::zeros_like(p));
        state_steps.push_back(torch::zeros({}, p.options().dtype(torch::kFloat)));
      }
    };
    bool created = false;
    rows.push_back(time_optimizer("ATen _fused_adamw_ (LibTorch 2.x)", steps, [&] {
      torch::NoGradGuard no_grad;
      if (!created) make_state();
      created = true;
      at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, {}, state_steps, lr, beta1, beta2, weight_decay, eps,
                        /*amsgrad=*/false, /*maximize=*/false);
    }));
  }
#endif
  {
    auto params = parameters();
    memscale::optim::AdamW8bit adamw8bit(
        params, memscale::optim::AdamW8bitOptions(lr).betas({beta1, beta2}).eps(eps).weight_decay(weight_decay));
#if defined(MEMSCALE_WITH_CUDA_KERNELS)
    const std::string how = "memscale::cuda fused kernel";
#else
    const std::string how = "ATen ops: memscale::cuda not linked";
#endif
    rows.push_back(time_optimizer("memscale::optim::AdamW8bit (" + how + ")", steps, [&] { adamw8bit.step(); }));
  }
  const auto& base = rows.front();
  std::cout << "\nAdamW step on " << count << " CUDA parameters of " << side << " x " << side << " ("
            << count * side * side / 1000000 << "M), fp32 gradients given; median of " << steps
            << " steps after one warm-up (which creates the state)\n\n"
            << "| optimizer | state | bytes/param | step | vs torch::optim::AdamW |\n|---|---|---|---|---|\n";
  for (const auto& r : rows)
    std::cout << "| " << r.name << " | " << std::setprecision(1) << static_cast<double>(r.state_bytes) / (1 << 20)
              << " MiB | " << std::setprecision(3)
              << static_cast<double>(r.state_bytes) / static_cast<double>(count * side * side) << " | "
              << std::setprecision(2) << r.step_ms << " ms | " << std::setprecision(3) << r.step_ms / base.step_ms
              << "x |\n";
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--steps" && i + 1 < argc) {
      steps = std::max(1, std::stoi(argv[++i]));
    } else {
      std::cerr << "usage: memscale_bench_gpu [--steps N]\n";
      return 2;
    }
  }
  if (!torch::cuda::is_available()) {
    std::cout << "memscale_bench_gpu: no CUDA device visible to LibTorch " << TORCH_VERSION
              << "; nothing measured\n";
    return 0;
  }
  memscale::memory_tracker::install();
  gpt::register_memscale_rule();
  const auto hw = memscale::detect_hardware();
  std::cout << "memscale GPU offload benchmark, LibTorch " << TORCH_VERSION << "\n" << hw << "\n";

  const std::int64_t bytes = 256LL << 20;
  auto device = torch::empty({bytes}, torch::TensorOptions().dtype(torch::kByte).device(torch::kCUDA));
  auto pinned = torch::empty({bytes}, torch::TensorOptions().dtype(torch::kByte).pinned_memory(true));
  auto pageable = torch::empty({bytes}, torch::kByte);
  const double d2h = bandwidth(device, pinned);
  const double h2d = bandwidth(pinned, device);
  std::cout << "bandwidth (256 MiB copies, median of 5):\n"
            << "  device -> pinned host   " << std::fixed << std::setprecision(1) << d2h << " GB/s\n"
            << "  pinned host -> device   " << h2d << " GB/s\n"
            << "  device -> pageable host " << bandwidth(device, pageable) << " GB/s\n"
            << "  pageable host -> device " << bandwidth(pageable, device) << " GB/s\n\n";

  memscale::Config base;
  base.enable_logging = false;
  base.mode = memscale::OptimizationMode::Aggressive;
  auto checkpoint = base;
  checkpoint.enable_offloading = false;
  auto both = base;
  both.async_offload = true;
  auto offload = both;
  offload.enable_checkpointing = false;
  std::vector<Row> rows;
  rows.push_back(run_gpt("baseline", std::nullopt, steps));
  rows.push_back(run_gpt("checkpoint", checkpoint, steps));
  rows.push_back(run_gpt("checkpoint+offload async", both, steps));
  rows.push_back(run_gpt("offload async", offload, steps));

  const auto& b = rows.front();
  std::cout << "GPT d_model 768, 12 heads, 12 layers, context 256, batch 16 on " << hw.gpus.front().name
            << "; medians of " << steps << " steps after one warm-up\n\n"
            << "| row | peak CUDA growth | vs base | step | vs base | offloaded/step | transfer/step (at measured "
               "bandwidth) | exposed/step | hidden | prefetch hit/miss | losses = baseline |\n"
               "|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& r : rows) {
    std::cout << "| " << r.name << " | " << std::setprecision(1) << r.growth_mib << " MiB | " << std::setprecision(3)
              << r.growth_mib / b.growth_mib << "x | " << std::setprecision(1) << r.step_ms << " ms | "
              << std::setprecision(3) << r.step_ms / b.step_ms << "x | ";
    if (r.stats) {
      // Transfer time the step would spend if nothing overlapped: bytes out at the
      // measured device->pinned rate, bytes back at pinned->device. Exposed: what
      // the row takes beyond the same plan without offload (checkpoint for
      // checkpoint+offload, baseline for offload only).
      const double out_bytes = static_cast<double>(r.stats->bytes_written) / r.steps;
      const double transfer_ms = (out_bytes / (d2h * 1e9) + out_bytes / (h2d * 1e9)) * 1e3;
      const double reference = r.name.rfind("checkpoint", 0) == 0 ? rows[1].step_ms : b.step_ms;
      const double exposed = std::max(0.0, r.step_ms - reference);
      const double hidden = transfer_ms > 0.0 ? std::clamp(1.0 - exposed / transfer_ms, 0.0, 1.0) : 1.0;
      std::cout << std::setprecision(1) << out_bytes / (1 << 20) << " MiB | " << transfer_ms << " ms | " << exposed
                << " ms | " << std::setprecision(3) << hidden << " | " << r.stats->prefetch_hits << "/"
                << r.stats->prefetch_misses << " | ";
    } else {
      std::cout << "- | - | - | - | - | ";
    }
    std::cout << (r.losses == b.losses ? "yes" : "no") << " |\n";
  }
  std::cout << "\nhidden = 1 - exposed/transfer, clamped to [0, 1]; step times carry run-to-run noise, so a\n"
               "hidden share near 1 means the transfers cost no measurable time.\n";
  bench_optimizers(steps);
  return 0;
}

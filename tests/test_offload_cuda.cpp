// The offload path on CUDA tensors. Hidden tests ("[.cuda]"): a CPU-only run
// cannot exercise them, so CTest does not list them; scripts/gpu-run.sh runs
// them on a GPU machine (`memscale_tests "[.cuda]"`), and each one fails
// there if no GPU is visible.
#include "test_support.hpp"

using memscale::OptimizationMode;
using memscale::memory_tracker;
using memscale::offload::engine;
using memscale::offload::engine_options;
using memscale::offload::tier;

namespace {

void require_gpu() { REQUIRE(torch::cuda::is_available()); }

engine_options cuda_options(bool async) {
  engine_options o;
  o.log = {};  // silent
  o.min_bytes = 0;
  o.async = async;
  return o;
}

}  // namespace

TEST_CASE("CUDA tensors come back bit-identical from every tier", "[.cuda][offload]") {
  require_gpu();
  for (bool async : {false, true}) {
    INFO((async ? "async" : "synchronous"));
    engine e(cuda_options(async));
    torch::manual_seed(3);
    for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16, torch::kLong}) {
      auto base = (dtype == torch::kLong ? torch::randint(-1000, 1000, {257, 129}, torch::kLong)
                                         : torch::randn({257, 129}).to(dtype))
                      .to(torch::kCUDA);
      for (const auto& t : {base, base.t(), base.slice(1, 0, 129, 2), base.narrow(0, 0, 0)}) {
        for (auto first : {tier::pinned_host, tier::pageable_host, tier::disk}) {
          INFO(c10::toString(dtype) << " " << t.sizes() << " via " << memscale::offload::to_string(first));
          auto stored = e.store(t, first);
          auto back = e.load(stored);
          CHECK(back.device() == t.device());
          if (t.is_non_overlapping_and_dense()) CHECK(back.strides() == t.strides());
          CHECK(torch::equal(back, t));
        }
      }
    }
    e.wait_idle();
    CHECK(e.stats().at(tier::pinned_host).tensors > 0);
    CHECK(e.stats().pinned_failures == 0);
  }
}

TEST_CASE("small CUDA tensors travel in one staging buffer and come back bit-identical", "[.cuda][offload]") {
  require_gpu();
  auto o = cuda_options(true);
  o.batch_below_bytes = 1 << 20;
  engine e(o);
  e.begin_group();
  std::vector<torch::Tensor> originals;
  std::vector<memscale::offload::stored_handle> stored;
  for (int i = 0; i < 40; ++i) {
    originals.push_back(torch::randn({17 + i, 33}, torch::kCUDA));
    stored.push_back(e.store_or_defer(originals.back()));
  }
  e.flush();
  e.wait_idle();
  CHECK(e.stats().batches == 1);
#if defined(MEMSCALE_WITH_CUDA_KERNELS)
  CHECK(e.stats().kernel_gathers == 1);  // memscale::cuda is linked: its kernel gathered the batch
#endif
  for (std::size_t i = 0; i < stored.size(); ++i) CHECK(torch::equal(e.load(stored[i]), originals[i]));
}

TEST_CASE("offloading a CUDA chain's activations halves its peak, bit-identically", "[.cuda][offload][acceptance]") {
  require_gpu();
  const c10::Device gpu(torch::kCUDA, 0);
  auto run = [&](const std::optional<memscale::Config>& config) {
    torch::manual_seed(10);
    auto model = test::flat_chain(6, 512, 2048, 0.0);
    model->to(gpu);
    auto x = torch::randn({16, 256, 512}, gpu).requires_grad_();
    std::optional<memscale::OptimizationGuard> guard;
    if (config) guard.emplace(memscale::optimize(model, x, *config));
    auto loss = [&] { return model->forward(x).pow(2).mean(); };
    (void)test::step(*model, loss);
    x.mutable_grad() = torch::Tensor();
    torch::cuda::synchronize();
    memory_tracker::peak_scope scope(gpu);
    auto result = test::step(*model, loss);
    torch::cuda::synchronize();
    const auto growth = scope.peak_growth();
    std::optional<memscale::offload::engine_stats> stats;
    if (guard) stats = guard->offload_stats();
    return std::make_tuple(growth, result, stats);
  };
  const auto [base_growth, base, none] = run(std::nullopt);
  auto config = test::quiet({.mode = OptimizationMode::Aggressive, .enable_checkpointing = false});
  config.async_offload = true;
  const auto [growth, result, stats] = run(config);
  INFO("baseline " << base_growth << " B, offloaded " << growth << " B");
  REQUIRE(stats);
  CHECK(stats->at(tier::pinned_host).tensors + stats->at(tier::pageable_host).tensors > 0);
  CHECK(growth <= base_growth / 2);
  CHECK(test::bit_equal(base.second, result.second));
}

TEST_CASE("a CUDA device's link to pinned host memory is measured once per size, and a plan costs its offload with it",
          "[.cuda][offload][engine]") {
  require_gpu();
  using memscale::offload::host_link_rate_measurements;
  using memscale::offload::measured_host_link_bytes_per_second;
  const c10::Device gpu(c10::kCUDA, 0);
  // Each size is measured once in a process (an earlier test may have measured these sizes already).
  const auto big = measured_host_link_bytes_per_second(gpu);  // 16 MiB
  REQUIRE(big.has_value());
  // A PCIe 3 x16 link's pinned copies run at over 10 GB/s each way; anything at a tenth of that is a fault.
  CHECK(*big > 1e9);
  const int after_big = host_link_rate_measurements().load();
  CHECK(measured_host_link_bytes_per_second(gpu) == big);                    // measured once
  CHECK(measured_host_link_bytes_per_second(c10::Device(c10::kCUDA)) == big);  // the current device, the same
  CHECK(host_link_rate_measurements().load() == after_big);
  const auto small = measured_host_link_bytes_per_second(gpu, 3000);          // 1 MiB
  REQUIRE(small.has_value());
  CHECK(*small > 1e8);
  const int after_small = host_link_rate_measurements().load();
  CHECK(measured_host_link_bytes_per_second(gpu, std::int64_t{1} << 20) == small);
  CHECK(host_link_rate_measurements().load() == after_small);
  CHECK_FALSE(measured_host_link_bytes_per_second(c10::Device(c10::kCPU)).has_value());
  // Pageable memory, which takes what outgrows the pinned pool: measured apart, once, and not faster than pinned
  // (an H100: 9-15 GB/s against 55, at 256 MiB; a tenth over the pinned rate allowed for noise).
  using memscale::offload::host_memory;
  const auto pageable = measured_host_link_bytes_per_second(gpu, 16 << 20, host_memory::pageable);
  REQUIRE(pageable.has_value());
  CHECK(*pageable > 1e8);
  CHECK(*pageable < *big * 1.1);
  const int after_pageable = host_link_rate_measurements().load();
  CHECK(measured_host_link_bytes_per_second(gpu, 16 << 20, host_memory::pageable) == pageable);
  CHECK(host_link_rate_measurements().load() == after_pageable);
  // A pressed CUDA chain whose plan may offload: its Report names the measured rate.
  torch::manual_seed(5);
  torch::nn::Sequential model(torch::nn::Linear(256, 1024), torch::nn::GELU(), torch::nn::Linear(1024, 256),
                              torch::nn::GELU(), torch::nn::Linear(256, 1024), torch::nn::GELU(),
                              torch::nn::Linear(1024, 256));
  model->to(torch::kCUDA);
  const auto x = torch::randn({2048, 256}, torch::kCUDA);
  auto config = test::quiet({.mode = OptimizationMode::Aggressive});
  config.async_config = memscale::AsyncOffloadConfig{};
  const auto report = memscale::wrap(model, x, config);
  memscale::detach(model);
  INFO(report.str());
  REQUIRE(report.offload_bytes_per_second > 0);  // Aggressive weighs offloading
  CHECK(report.offload_rate_measured);
  std::vector<std::vector<memscale::slot_cost>> costs;
  for (const auto& chain : report.chains) costs.push_back(chain.slots);
  CHECK(report.offload_bytes_per_second ==
        measured_host_link_bytes_per_second(gpu, memscale::core::typical_offload_bytes(costs)));
}

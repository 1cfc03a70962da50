// Mixed precision: the autocast scope (and the guard that opens one), and the
// dynamic loss scaler with any torch::optim::Optimizer.
#include <cmath>

#include "test_support.hpp"

using memscale::OptimizationMode;

namespace {

/// A small regression MLP and fixed data: deterministic from the seed.
struct regression {
  torch::nn::Sequential model{torch::nn::Linear(16, 64), torch::nn::GELU(), torch::nn::Linear(64, 64),
                              torch::nn::GELU(), torch::nn::Linear(64, 1)};
  torch::Tensor x, y;
  explicit regression(std::uint64_t seed) {
    torch::manual_seed(seed);
    model = torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::GELU(), torch::nn::Linear(64, 64),
                                  torch::nn::GELU(), torch::nn::Linear(64, 1));
    x = torch::randn({256, 16});
    y = (x.slice(1, 0, 4).sum(1, true) - x.slice(1, 4, 8).pow(2).sum(1, true) * 0.25).tanh();
  }
};

/// Trains `steps` full-batch AdamW steps; with `autocast`, the forward runs
/// under CPU bf16 autocast (the loss in fp32). Returns the final fp32 loss.
double train(bool autocast, int steps) {
  regression r(11);
  torch::optim::AdamW opt(r.model->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    torch::Tensor out;
    {
      std::optional<memscale::autocast_scope> scope;
      if (autocast) scope.emplace(c10::kCPU);
      out = r.model->forward(r.x);
    }
    torch::mse_loss(out.to(torch::kFloat), r.y).backward();
    opt.step();
  }
  torch::NoGradGuard no_grad;
  return torch::mse_loss(r.model->forward(r.x), r.y).item<double>();
}

}  // namespace

TEST_CASE("autocast_scope switches CPU autocast on for its lifetime and restores it", "[amp]") {
  const auto a = torch::randn({8, 8});
  CHECK(a.mm(a).scalar_type() == torch::kFloat);
  {
    memscale::autocast_scope scope(c10::kCPU);
    CHECK(a.mm(a).scalar_type() == torch::kBFloat16);
    {
      memscale::autocast_scope nested(c10::kCPU);
      CHECK(a.mm(a).scalar_type() == torch::kBFloat16);
    }
    CHECK(a.mm(a).scalar_type() == torch::kBFloat16);  // the nested scope restored the outer one
  }
  CHECK(a.mm(a).scalar_type() == torch::kFloat);
  CHECK_THROWS_WITH(memscale::autocast_scope(c10::kCPU, torch::kFloat), Catch::Contains("bfloat16"));
  CHECK_THROWS_WITH(memscale::autocast_scope(c10::kMeta), Catch::Contains("cpu and cuda"));
}

TEST_CASE("use_mixed_precision autocasts the optimized layers' forward, not backward or the optimizer step",
          "[amp][api]") {
  // No LayerNorm: LibTorch 1.13's CPU LayerNorm refuses a bf16 input with fp32 weights under autocast.
  torch::nn::Sequential model(torch::nn::Linear(64, 256), torch::nn::GELU(), torch::nn::Linear(256, 64),
                              torch::nn::Dropout(0.1));
  auto x = torch::randn({64, 64});
  {
    auto guard = memscale::optimize(model, x, test::quiet({.use_mixed_precision = true}));
    // Outside the chain's forward autocast is off, though the guard lives.
    CHECK_FALSE(memscale::detail::compat::current_autocast().cpu);
    CHECK(x.mm(x).scalar_type() == torch::kFloat);
    auto y = model->forward(x);
    CHECK(y.scalar_type() == torch::kBFloat16);
    CHECK_FALSE(memscale::detail::compat::current_autocast().cpu);
    // Backward runs without autocast: a hook on the first layer's input gradient sees it off.
    int hooked = 0;
    bool autocast_in_backward = true;
    auto w = model->parameters().front();  // the first Linear's weight (slot 0 is wrapped now)
    auto handle = w.register_hook([&](const torch::Tensor& g) {
      ++hooked;
      autocast_in_backward = memscale::detail::compat::current_autocast().cpu;
      return g;
    });
    y.to(torch::kFloat).pow(2).mean().backward();
    w.remove_hook(handle);
    CHECK(hooked == 1);
    CHECK_FALSE(autocast_in_backward);
    CHECK(w.grad().scalar_type() == torch::kFloat);
    CHECK_THAT(guard.report().str(), Catch::Contains("run their forward under autocast"));
  }
  CHECK(model->forward(x).scalar_type() == torch::kFloat);
  auto plain = memscale::optimize(model, x, test::quiet());
  CHECK(model->forward(x).scalar_type() == torch::kFloat);
}

TEST_CASE("a LayerNorm after a Linear runs under CPU autocast, and a chain of them trains under the guard",
          "[amp][api]") {
  torch::manual_seed(4);
  torch::nn::Sequential model(torch::nn::Linear(64, 128), torch::nn::LayerNorm(torch::nn::LayerNormOptions({128})),
                              torch::nn::GELU(), torch::nn::Linear(128, 128),
                              torch::nn::LayerNorm(torch::nn::LayerNormOptions({128})), torch::nn::Linear(128, 64));
  const auto x = torch::randn({32, 64});
  {
    memscale::autocast_scope scope;
    const auto weight = torch::ones({128});
    const auto normed = torch::layer_norm(torch::randn({4, 128}).to(torch::kBFloat16), {128}, weight, weight);
    // LibTorch 1.13's CPU kernel refuses the mix; memscale registers autocast's fp32 policy for it there.
    if (TORCH_VERSION_MAJOR < 2) CHECK(normed.scalar_type() == torch::kFloat);
    CHECK(model->forward(x).scalar_type() == torch::kBFloat16);
  }
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  {
    auto guard = memscale::optimize(
        model, x,
        test::quiet({.mode = memscale::OptimizationMode::Aggressive, .use_mixed_precision = true,
                     .force_optimize = true, .verify_correctness = true}));
    CHECK(guard.report().checkpointed_segments() > 0);
    for (int step = 0; step < 3; ++step) {
      optimizer.zero_grad();
      const auto loss = model->forward(x).to(torch::kFloat).pow(2).mean();
      loss.backward();
      optimizer.step();
      CHECK(std::isfinite(loss.item<float>()));
    }
  }
  CHECK(model->forward(x).scalar_type() == torch::kFloat);
}

// Stated tolerance: the bf16 run's final loss within 25% of the fp32 run's (measured here: 7%), both
// below 1% of the initial loss. Same seed, data and optimizer; only the forward's precision differs.
TEST_CASE("a small model trains under CPU bf16 autocast to within 25% of the fp32 loss", "[amp][acceptance]") {
  const int steps = 150;
  const double fp32 = train(false, steps);
  const double bf16 = train(true, steps);
  const double start = [] {
    regression r(11);
    torch::NoGradGuard no_grad;
    return torch::mse_loss(r.model->forward(r.x), r.y).item<double>();
  }();
  INFO("initial loss " << start << ", after " << steps << " steps: fp32 " << fp32 << ", bf16 autocast " << bf16);
  CHECK(fp32 < 0.01 * start);  // the task is learnable: both runs have something to agree on
  CHECK(bf16 < 0.01 * start);
  CHECK(std::abs(bf16 - fp32) <= 0.25 * fp32);
}

TEST_CASE("the loss scaler skips a step with inf gradients and halves its scale", "[amp]") {
  regression r(3);
  torch::optim::SGD opt(r.model->parameters(), torch::optim::SGDOptions(0.1));
  memscale::amp::loss_scaler scaler({.init_scale = 1024.0, .growth_interval = 2});
  auto step = [&](bool overflow) {
    opt.zero_grad();
    auto loss = torch::mse_loss(r.model->forward(r.x), r.y);
    scaler.scale(loss).backward();
    if (overflow) r.model->parameters()[0].mutable_grad()[0][0] = std::numeric_limits<float>::infinity();
    const bool stepped = scaler.step(opt);
    scaler.update();
    return stepped;
  };
  std::vector<torch::Tensor> before;
  for (const auto& p : r.model->parameters()) before.push_back(p.detach().clone());
  CHECK_FALSE(step(true));
  for (std::size_t i = 0; i < before.size(); ++i) CHECK(torch::equal(before[i], r.model->parameters()[i]));
  CHECK(scaler.current_scale() == 512.0);
  CHECK(scaler.skipped_steps() == 1);
  CHECK(step(false));
  CHECK_FALSE(torch::equal(before[0], r.model->parameters()[0]));
  CHECK(scaler.current_scale() == 512.0);
  CHECK(step(false));
  CHECK(scaler.current_scale() == 1024.0);  // growth_interval (2) clean steps in a row
}

TEST_CASE("an unscaled step equals the plain step", "[amp]") {
  // A power-of-two scale makes scaling and unscaling exact in floating point.
  regression a(5), b(5);
  torch::optim::AdamW opt_a(a.model->parameters()), opt_b(b.model->parameters());
  memscale::amp::loss_scaler scaler({.init_scale = 256.0});
  torch::mse_loss(a.model->forward(a.x), a.y).backward();
  opt_a.step();
  scaler.scale(torch::mse_loss(b.model->forward(b.x), b.y)).backward();
  CHECK(scaler.step(opt_b));
  for (std::size_t i = 0; i < a.model->parameters().size(); ++i)
    CHECK(torch::equal(a.model->parameters()[i], b.model->parameters()[i]));
  CHECK_THROWS_WITH(memscale::amp::loss_scaler({.init_scale = 0.0}), Catch::Contains("init_scale"));
  CHECK_THROWS_WITH(memscale::amp::loss_scaler({.backoff_factor = 1.5}), Catch::Contains("backoff_factor"));
}

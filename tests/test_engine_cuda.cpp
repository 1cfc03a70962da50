// The autograd engine swap on CUDA. LibTorch starts the autograd device
// threads once per process, for whichever engine runs a CUDA backward first
// (measured on LibTorch 2.x: a second engine then fails every CUDA backward
// with an internal assertion). memscale installs its engine while the program
// loads, so it is first. Hidden tests: scripts/gpu-run.sh runs "[.cuda]", and
// "[.cuda_engine_order]" alone in a process of its own, since it leaves the
// process with LibTorch's base engine.
#include <torch/csrc/autograd/engine.h>

#include "test_support.hpp"

namespace {

/// Gradients of mean(net(x)^2) after one backward.
std::vector<torch::Tensor> cuda_step(torch::nn::Sequential& net, const torch::Tensor& x) {
  test::clear_grads(*net);
  net->forward(x).pow(2).mean().backward();
  return test::grads_of(*net);
}

torch::nn::Sequential cuda_mlp() {
  torch::manual_seed(5);
  torch::nn::Sequential net(torch::nn::Linear(64, 256), torch::nn::GELU(), torch::nn::Linear(256, 64));
  net->to(torch::kCUDA);
  return net;
}

}  // namespace

TEST_CASE("memscale's engine, installed at load, runs CUDA backwards with saved-tensor hooks", "[.cuda][hooks]") {
  REQUIRE(torch::cuda::is_available());
  REQUIRE(memscale::offload::hooks_engine_active());
  CHECK(memscale::offload::hooks_unavailable_reason(c10::Device(c10::kCUDA, 0)).empty());
  auto net = cuda_mlp();
  const auto x = torch::randn({32, 64}, torch::kCUDA);
  const auto reference = cuda_step(net, x);
  int packed = 0, unpacked = 0;
  std::vector<torch::Tensor> with_hooks;
  {
    memscale::offload::saved_tensors_hooks scope(
        [&](const at::Tensor& t) {
          ++packed;
          return t.to(torch::kCPU);
        },
        [&](at::Tensor& t) {
          ++unpacked;
          return t.to(torch::kCUDA);
        });
    with_hooks = cuda_step(net, x);
  }
  CHECK(packed > 0);
  CHECK(unpacked == packed);
  CHECK(test::bit_equal(with_hooks, reference));
}

TEST_CASE("after another engine ran a CUDA backward first, memscale puts the base engine back and plans "
          "without offload",
          "[.cuda_engine_order]") {
  REQUIRE(torch::cuda::is_available());
  auto net = cuda_mlp();
  const auto x = torch::randn({32, 64}, torch::kCUDA);
  // Another library replaces the engine, and LibTorch's base engine runs the
  // process's first CUDA backward: it owns the device threads from now on.
  torch::autograd::set_default_engine_stub(&torch::autograd::Engine::get_base_engine);
  const auto reference = cuda_step(net, x);
  torch::autograd::set_default_engine_stub(&memscale::offload::detail::hooks_engine::instance);
  REQUIRE(memscale::offload::hooks_engine_active());

  const auto why = memscale::offload::hooks_unavailable_reason(c10::Device(c10::kCUDA, 0));
  CHECK_THAT(why, Catch::Contains("cannot run a CUDA backward"));
  CHECK_FALSE(memscale::offload::hooks_engine_active());  // the base engine is back

  auto model = test::flat_chain(4, 64, 256, 0.0);
  model->to(torch::kCUDA);
  const auto input = torch::randn({64, 64}, torch::kCUDA);
  auto plain_model = test::flat_chain(4, 64, 256, 0.0);
  plain_model->to(torch::kCUDA);
  {
    torch::NoGradGuard copy;
    for (std::size_t i = 0; i < model->parameters().size(); ++i)
      plain_model->parameters()[i].copy_(model->parameters()[i]);
  }
  const auto expected = test::step(*plain_model, [&] { return plain_model->forward(input).pow(2).mean(); });
  auto guard = memscale::optimize(model, input, test::quiet({.mode = memscale::OptimizationMode::Aggressive}));
  const auto report = guard.report();
  CHECK(report.offloaded_units() == 0);
  CHECK(report.checkpointed_segments() > 0);
  CHECK_THAT(report.str(), Catch::Contains("offload disabled"));
  const auto got = test::step(*model, [&] { return model->forward(input).pow(2).mean(); });
  CHECK(test::bit_equal(got.first, expected.first));
  CHECK(test::bit_equal(got.second, expected.second));
  CHECK(test::bit_equal(cuda_step(net, x), reference));
}

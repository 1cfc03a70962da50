// Study (issue 12, predict's time target): can a training step's allocation
// timeline be had without its arithmetic? LibTorch 1.13 has DispatchKey::Fake
// (torchdistx's out-of-core key, between ADInplaceOrView and the backends) and
// registers nothing for it. The study's boxed fallback for it is now the
// library's shape-only execution (include/memscale/predict/shape_only.hpp,
// whose header comment says what each kind of operator does); this program
// runs a step with it and without.
// Prints, per model, the allocator's step peak and the step time, real and
// fake, and the last fake step's tally (calls shape-only, skipped in place, run
// for real; operators without a meta kernel). Not built by CMake; see README.md.
// LibTorch 2.x uses DispatchKey::Fake for its own C++ FakeTensor mode, so this
// is a 1.13-only path (2.x would need another key or mechanism).
#include <torch/torch.h>
#include <memscale/memscale.hpp>
#include <memscale/predict/shape_only.hpp>
#include <chrono>
#include <functional>
#include <iostream>
#include <optional>
#include "gpt.hpp"
#include "resnet.hpp"

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "gpt";
  const long batch = argc > 2 ? std::atol(argv[2]) : 16;
  memscale::memory_tracker::install();
  torch::manual_seed(1);
  std::shared_ptr<torch::nn::Module> root;
  std::function<torch::Tensor()> loss_of;
  if (which == "gpt") {
    gpt::Options o;
    gpt::GPT model(o);
    root = model.ptr();
    auto tokens = torch::randint(0, o.vocab, {batch, o.context}, torch::kLong);
    auto targets = torch::randint(0, o.vocab, {batch, o.context}, torch::kLong);
    loss_of = [=]() mutable { return gpt::loss(model->forward(tokens), targets); };
  } else if (which == "resnet") {
    resnet::ResNet model(4, 64);
    root = model.ptr();
    auto x = torch::randn({batch, 3, 32, 32});
    auto t = torch::randint(10, {batch}, torch::kLong);
    loss_of = [=]() mutable { return torch::cross_entropy_loss(model->forward(x), t); };
  } else {
    torch::nn::Sequential seq;
    for (int i = 0; i < 8; ++i) {
      seq->push_back(torch::nn::Linear(64, 256));
      seq->push_back(torch::nn::GELU());
      seq->push_back(torch::nn::Linear(256, 64));
      seq->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({64})));
    }
    root = seq.ptr();
    auto x = torch::randn({batch, 64});
    auto t = torch::randn({batch, 64});
    loss_of = [=]() mutable { return torch::mse_loss(seq->forward(x), t); };
  }
  for (auto& p : root->parameters()) p.mutable_grad() = torch::zeros_like(p);
  memscale::predictor::shape_only_tally tally;
  auto step = [&](bool fake) {
    std::optional<memscale::predictor::shape_only_scope> g;
    if (fake) g.emplace();
    memscale::memory_tracker::peak_scope peak;
    const auto t0 = std::chrono::steady_clock::now();
    loss_of().backward();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (g) tally = g->tally();
    return std::make_pair(peak.peak_growth(), s);
  };
  for (int i = 0; i < 3; ++i) {
    auto r = step(false);
    auto f = step(true);
    std::cout << which << " batch " << batch << ": real peak " << r.first << " B " << r.second << " s | fake peak "
              << f.first << " B " << f.second << " s\n";
  }
  std::cout << "last fake step: " << tally.shape_only << " calls shape-only, " << tally.skipped
            << " in place skipped, " << tally.real << " run for real; without a meta kernel:";
  for (const auto& [name, calls] : tally.without_meta) std::cout << " " << name << "=" << calls;
  std::cout << "\n";
}

// Conan test_package: wraps a small Sequential under a memory budget, trains
// one step, and checks that detach puts the model back as it was.
#include <cmath>
#include <cstdio>
#include <vector>

#include <memscale/memscale.hpp>

namespace {
int fail(const char* what) {
  std::fprintf(stderr, "memscale test_package: %s\n", what);
  return 1;
}
}  // namespace

int main() {
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                            torch::nn::ReLU(), torch::nn::Linear(64, 8));
  std::vector<const torch::nn::Module*> children;
  for (const auto& child : net->children()) children.push_back(child.get());
  const auto example = torch::randn({16, 32});
  const auto target = torch::randn({16, 8});
  torch::optim::SGD optimizer(net->parameters(), 0.01);

  memscale::Config config{.memory_budget_gb = 1.0};
  config.enable_logging = false;
  memscale::wrap(net, example, config);
  if (!memscale::is_optimized(net)) return fail("not optimized after wrap");

  optimizer.zero_grad();
  const auto loss = torch::mse_loss(net->forward(example), target);
  loss.backward();
  optimizer.step();
  if (!std::isfinite(loss.item<float>())) return fail("the training step's loss is not finite");

  if (!memscale::detach(net)) return fail("detach returned false");
  if (memscale::is_optimized(net)) return fail("still optimized after detach");
  std::vector<const torch::nn::Module*> after;
  for (const auto& child : net->children()) after.push_back(child.get());
  if (after != children) return fail("detach did not restore the Sequential's modules");

  std::printf("memscale %d.%d.%d: one step under a 1 GB budget (loss %.4f), detached\n",
              memscale::version_major, memscale::version_minor, memscale::version_patch,
              static_cast<double>(loss.item<float>()));
  return 0;
}

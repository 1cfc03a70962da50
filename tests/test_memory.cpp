// Measured savings, by the library's own tracker: Aggressive halves a step's peak
// memory growth (profiling and planning included), Balanced keeps the measured
// peak within an explicit budget, and the planner's estimate tracks measurement.
#include "test_support.hpp"

#include <memscale/core/optimal_chain.hpp>

using memscale::OptimizationMode;
using memscale::memory_tracker;

TEST_CASE("the tracker counts live and peak CPU bytes", "[memory]") {
  memory_tracker::install();
  REQUIRE(memory_tracker::installed());
  const auto before = memory_tracker::current_bytes();
  memory_tracker::peak_scope scope;
  {
    auto t = torch::empty({1 << 20}, torch::kFloat);  // 4 MiB
    CHECK(memory_tracker::current_bytes() - before == 4 << 20);
  }
  CHECK(memory_tracker::current_bytes() == before);
  CHECK(scope.peak_growth() == 4 << 20);
  {
    memory_tracker::peak_scope inner;
    auto t = torch::empty({1 << 18}, torch::kFloat);
    CHECK(inner.peak_growth() == 1 << 20);
  }
  CHECK(scope.peak_growth() == 4 << 20);  // the inner scope did not hide the outer peak
}

namespace {

struct measured_step {
  std::int64_t peak_growth;
  std::pair<torch::Tensor, std::vector<torch::Tensor>> result;
};

template <class Model, class Forward>
measured_step measure(Model& model, Forward&& forward, const std::function<void()>& before_step = {}) {
  test::clear_grads(*model);
  memory_tracker::peak_scope scope;
  if (before_step) before_step();  // wrap(): profiling and planning count too
  auto result = test::step(*model, forward);
  return {scope.peak_growth(), std::move(result)};
}

}  // namespace

TEST_CASE("Aggressive halves the step's peak memory growth on the flat primitive chain", "[memory][acceptance]") {
  memory_tracker::install();
  torch::manual_seed(10);
  auto reference = test::flat_chain(6, 256, 1024, 0.1);
  torch::manual_seed(10);
  auto model = test::flat_chain(6, 256, 1024, 0.1);
  auto x = torch::randn({16, 64, 256}, torch::requires_grad());
  auto loss = [&](torch::nn::Sequential& m) { return [&] { return m->forward(x).pow(2).mean(); }; };

  const auto baseline = measure(reference, loss(reference));
  x.mutable_grad() = torch::Tensor();  // both runs allocate the input's gradient
  std::optional<memscale::OptimizationGuard> guard;
  const auto optimized = measure(model, loss(model), [&] {
    guard.emplace(memscale::optimize(model, x, test::quiet({.mode = OptimizationMode::Aggressive})));
  });
  INFO("baseline " << baseline.peak_growth << " B, memscale (with profiling) " << optimized.peak_growth << " B\n"
                   << guard->report());
  CHECK(guard->report().checkpointed_segments() >= 3);
  CHECK(optimized.peak_growth <= baseline.peak_growth / 2);
  CHECK(test::bit_equal(baseline.result.first, optimized.result.first));
  CHECK(test::bit_equal(baseline.result.second, optimized.result.second));
}

TEST_CASE("Aggressive halves the step's peak memory growth on the example GPT", "[memory][acceptance]") {
  memory_tracker::install();
  gpt::register_memscale_rule();
  gpt::Options options;
  options.context = 128;
  options.d_model = 128;
  options.layers = 6;
  torch::manual_seed(11);
  gpt::GPT reference(options);
  torch::manual_seed(11);
  gpt::GPT model(options);
  auto tokens = torch::randint(256, {8, 128}, torch::kLong);
  auto targets = torch::randint(256, {8, 128}, torch::kLong);
  auto loss = [&](gpt::GPT& m) { return [&] { return gpt::loss(m->forward(tokens), targets); }; };

  const auto baseline = measure(reference, loss(reference));
  std::optional<memscale::OptimizationGuard> guard;
  const auto optimized = measure(model, loss(model), [&] {
    guard.emplace(memscale::optimize(model, tokens, test::quiet({.mode = OptimizationMode::Aggressive})));
  });
  INFO("baseline " << baseline.peak_growth << " B, memscale (with profiling) " << optimized.peak_growth << " B\n"
                   << guard->report());
  CHECK(guard->report().checkpointed_segments() >= options.layers - 1);
  CHECK(optimized.peak_growth <= baseline.peak_growth / 2);
  CHECK(test::bit_equal(baseline.result.first, optimized.result.first));
  CHECK(test::bit_equal(baseline.result.second, optimized.result.second));
}

namespace {

/// Peak bytes of training steps with AdamW, counting the model, its gradients
/// and optimizer state: everything allocated since `origin`.
template <class Model, class Loss>
std::int64_t train_peak(Model& model, Loss&& loss, std::int64_t origin, int steps) {
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  std::int64_t peak = 0;
  for (int i = 0; i < steps; ++i) {
    memory_tracker::peak_scope scope;
    optimizer.zero_grad();
    loss().backward();
    optimizer.step();
    peak = std::max(peak, scope.peak() - origin);
  }
  return peak;
}

template <class MakeModel, class MakeLoss>
void check_balanced_budget(MakeModel&& make_model, MakeLoss&& make_loss, const torch::Tensor& example) {
  memory_tracker::install();
  constexpr double gib = 1024.0 * 1024.0 * 1024.0;
  std::int64_t baseline_total = 0;
  {
    const auto origin = memory_tracker::current_bytes();
    auto reference = make_model();
    baseline_total = train_peak(reference, make_loss(reference), origin, 2);
  }
  const auto budget = static_cast<std::int64_t>(0.6 * static_cast<double>(baseline_total));
  const auto origin = memory_tracker::current_bytes();
  auto model = make_model();
  memscale::Config cfg = test::quiet({.mode = OptimizationMode::Balanced});
  cfg.memory_budget_gb = static_cast<double>(budget) / gib;
  std::int64_t measured = 0;
  memscale::Report report;
  {
    memory_tracker::peak_scope planning;
    auto guard = memscale::optimize(model, example, cfg);
    report = guard.report();
    measured = train_peak(model, make_loss(model), origin, 2);
    measured = std::max(measured, planning.peak() - origin);
  }
  INFO("baseline total " << baseline_total << " B, budget " << budget << " B, measured " << measured << " B\n"
                         << report);
  CHECK(report.plan.pressure > 1.0);  // the budget really binds
  CHECK(report.checkpointed_segments() > 0);
  CHECK(report.planned_peak_bytes() < report.baseline_peak_bytes());
  // Where some plan reaches the target (the optimal DP says so), the rules reach it too.
  const auto optimum = memscale::core::optimal_segmentation(report.chains.at(0).slots,
                                                            report.plan.target_bytes - report.static_bytes());
  if (optimum.feasible) CHECK(report.planned_peak_bytes() <= report.plan.target_bytes);
  CHECK(measured <= budget);
}

}  // namespace

TEST_CASE("Balanced under a budget keeps the measured peak within it: flat chain", "[memory][acceptance]") {
  auto x = torch::randn({16, 64, 256});
  check_balanced_budget(
      [] {
        torch::manual_seed(12);
        return test::flat_chain(6, 256, 1024, 0.1);
      },
      [&](torch::nn::Sequential& m) { return [&m, x] { return m->forward(x).pow(2).mean(); }; }, x);
}

TEST_CASE("Balanced under a budget keeps the measured peak within it: example GPT", "[memory][acceptance]") {
  gpt::register_memscale_rule();
  gpt::Options options;
  options.context = 128;
  options.d_model = 128;
  options.layers = 6;
  auto tokens = torch::randint(256, {8, 128}, torch::kLong);
  auto targets = torch::randint(256, {8, 128}, torch::kLong);
  check_balanced_budget(
      [&] {
        torch::manual_seed(13);
        return gpt::GPT(options);
      },
      [&](gpt::GPT& m) { return [&m, tokens, targets] { return gpt::loss(m->forward(tokens), targets); }; },
      tokens);
}

TEST_CASE("the planner's baseline estimate tracks the measured peak", "[memory][predict]") {
  memory_tracker::install();
  torch::manual_seed(14);
  auto model = test::flat_chain(4, 256, 1024, 0.1);
  auto x = torch::randn({16, 64, 256}, torch::requires_grad());
  for (auto& p : model->parameters()) p.mutable_grad() = torch::zeros_like(p);  // as from step 2 on
  std::int64_t measured = 0;
  {
    memory_tracker::peak_scope scope;
    model->forward(x).pow(2).mean().backward();
    measured = scope.peak_growth();
  }
  for (bool static_profile : {true, false}) {
    memscale::Config cfg = test::quiet({.mode = OptimizationMode::Aggressive});
    cfg.use_static_profiling = static_profile;
    auto guard = memscale::optimize(model, x, cfg);
    const auto report = guard.report();
    const auto projected = report.baseline_peak_bytes() - report.static_bytes();
    INFO((static_profile ? "static" : "empirical") << ": projected " << projected << " B, measured " << measured
                                                    << " B");
    CHECK(std::abs(static_cast<double>(projected - measured)) <= 0.15 * static_cast<double>(measured));
  }
}

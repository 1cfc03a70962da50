// Tiling: memscale::tile and TileSegment give the untiled gradients up to
// summation order, hold one chunk's intermediates at a time (tracker-measured),
// and the planner tiles only with enable_tiling, only row-independent layers.
#include <cmath>
#include <optional>

#include "test_support.hpp"

namespace {

using memscale::memory_tracker;
using memscale::OptimizationMode;

/// ||a - b|| / ||b|| (Frobenius, in double): chunking changes the order in which
/// parameter gradients are summed, so tiled gradients match to rounding only.
double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  const auto scale = b.to(torch::kDouble).norm().item<double>();
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).norm().item<double>() / (scale > 0 ? scale : 1.0);
}

double worst_relative_error(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    REQUIRE(a[i].defined() == b[i].defined());
    if (a[i].defined()) worst = std::max(worst, relative_error(a[i], b[i]));
  }
  return worst;
}

gpt::Options mlp_options(std::int64_t width, double dropout = 0.0) {
  gpt::Options o;
  o.d_model = width;
  o.dropout = dropout;
  return o;
}

/// Peak tracker growth of one forward + backward of `block` through `run`, from
/// a state holding only the parameters and the input.
template <class Run>
std::int64_t step_peak(gpt::MLP& block, const torch::Tensor& x, Run run) {
  block->zero_grad();
  (void)run(x).sum().backward();  // warm-up: gradients allocated, allocator settled
  x.mutable_grad() = torch::Tensor();
  memory_tracker::peak_scope scope;
  run(x).sum().backward();
  return scope.peak_growth();
}

}  // namespace

TEST_CASE("tile: gradients equal the untiled ones to 1e-6, along any row dimension, uneven chunks included",
          "[tile]") {
  torch::manual_seed(1);
  gpt::MLP block(mlp_options(48));
  const auto x0 = torch::randn({6, 37, 48});
  auto run = [&](std::optional<std::pair<int, int>> tiling) {
    block->zero_grad();
    auto x = x0.clone().requires_grad_(true);
    auto y = tiling ? memscale::tile([&](const torch::Tensor& t) { return block->forward(t); }, x, tiling->first,
                                     tiling->second, block->parameters())
                    : block->forward(x);
    (y * y).sum().backward();
    auto grads = test::grads_of(*block);
    grads.push_back(x.grad().clone());
    return std::make_pair(y.detach(), grads);
  };
  const auto [y0, g0] = run(std::nullopt);
  for (auto [tiles, dim] : {std::pair{4, 0}, std::pair{4, 1}, std::pair{5, 1}, std::pair{6, 0}, std::pair{64, 1}}) {
    INFO(tiles << " tiles along dimension " << dim);
    const auto [y, g] = run(std::pair{tiles, dim});
    CHECK(relative_error(y, y0) <= 1e-6);
    CHECK(worst_relative_error(g, g0) <= 1e-6);
  }
}

TEST_CASE("tile: the MLP block's peak falls by the chunk factor (tracker-measured, N = 4)", "[tile][acceptance]") {
  memory_tracker::install();
  torch::manual_seed(2);
  gpt::MLP block(mlp_options(64));
  const auto x = torch::randn({8, 256, 64}, torch::requires_grad());
  const auto params = block->parameters();
  const auto forward = [&](const torch::Tensor& t) { return block->forward(t); };
  const auto plain = step_peak(block, x, forward);
  const auto checkpointed = step_peak(block, x, [&](const torch::Tensor& t) {
    return memscale::checkpoint(forward, t, params);
  });
  const auto tiled = step_peak(block, x, [&](const torch::Tensor& t) { return memscale::tile(forward, t, 4, 0, params); });
  // What every variant holds at full size in backward: the output, its gradient
  // and the input's gradient. Above that lie the intermediates.
  const auto whole = 3 * static_cast<std::int64_t>(x.nbytes());
  INFO("peak growth: plain " << plain << " B, checkpointed " << checkpointed << " B, tiled x4 " << tiled << " B");
  CHECK(tiled <= checkpointed / 2);
  CHECK(tiled - whole <= (checkpointed - whole) / 2);
  CHECK(tiled < plain / 2);
}

TEST_CASE("tile: the recompute draws the forward's masks, chunk by chunk", "[tile]") {
  // y = dropout(x) * w, so dL/dw = sum(y) / w exactly when backward recomputes the
  // masks forward drew.
  torch::manual_seed(3);
  auto w = torch::full({1}, 1.5, torch::requires_grad());
  auto x = torch::randn({16, 40});
  auto y = memscale::tile([&](const torch::Tensor& t) { return torch::dropout(t, 0.5, true) * w; }, x, 4, 0, {w});
  y.sum().backward();
  CHECK(w.grad().item<double>() == Approx((y.sum() / w).item<double>()).epsilon(1e-6));
}

TEST_CASE("tile: bad arguments and functions that mix rows are named", "[tile]") {
  auto x = torch::randn({8, 4}, torch::requires_grad());
  auto id = [](const torch::Tensor& t) { return t * 2; };
  CHECK_THROWS_WITH(memscale::tile(id, x, 0), Catch::Contains("tiles must be >= 1, got 0"));
  CHECK_THROWS_WITH(memscale::tile(id, x, 2, 2), Catch::Contains("dim must name a dimension of the input (0..1)"));
  CHECK_THROWS_WITH(memscale::tile([](const torch::Tensor& t) { return t.sum(0, true); }, x, 2),
                    Catch::Contains("not row-independent along input dimension 0"));
  CHECK_THROWS_WITH(memscale::tile([](const torch::Tensor& t) { return t.mul_(2); }, x.clone(), 2),
                    Catch::Contains("modified its input in place"));
  // Without anything needing a gradient it runs in one piece.
  torch::NoGradGuard no_grad;
  CHECK(torch::equal(memscale::tile([](const torch::Tensor& t) { return t.sum(0, true); }, x, 2), x.sum(0, true)));
}

TEST_CASE("tile: which layers are row-independent", "[tile]") {
  namespace nn = torch::nn;
  const memscale::layer_input rank3{{4, 8, 16}, c10::kFloat, true};
  const memscale::layer_input image{{4, 3, 8, 8}, c10::kFloat, true};
  auto dims = [](const auto& m, const memscale::layer_input& in) { return memscale::row_independent_dims(*m, in); };
  CHECK(dims(nn::Linear(16, 8), rank3) == 2);
  CHECK(dims(nn::LayerNorm(nn::LayerNormOptions({16})), rank3) == 2);
  CHECK(dims(nn::GELU(), rank3) == 3);
  CHECK(dims(nn::ReLU(nn::ReLUOptions(true)), rank3) == 0);  // in place
  CHECK(dims(nn::Dropout(0.1), rank3) == 0);                 // draws masks
  CHECK(dims(nn::Conv2d(3, 4, 3), image) == 1);              // per sample
  CHECK(dims(nn::BatchNorm2d(3), image) == 0);               // batch statistics
  // Judged whatever the mode: a plan made in evaluation runs in training later.
  const memscale::layer_input evaluation{{4, 8, 16}, c10::kFloat, false};
  CHECK(dims(nn::Dropout(0.1), evaluation) == 0);
  CHECK(dims(nn::Dropout(0.0), evaluation) == 3);
  CHECK(dims(nn::BatchNorm1d(8), evaluation) == 0);
  gpt::register_memscale_rule();
  CHECK(dims(gpt::MLP(mlp_options(16)), rank3) == 2);
  CHECK(dims(gpt::MLP(mlp_options(16, 0.1)), rank3) == 0);
  CHECK(dims(gpt::MLP(mlp_options(16)), memscale::layer_input{{32, 16}}) == 1);  // never the features
  CHECK(dims(gpt::TransformerBlock(mlp_options(16)), rank3) == 0);  // attention mixes positions
  nn::Sequential nested(nn::Linear(16, 32), nn::GELU(), nn::Linear(32, 16));
  CHECK(dims(test::NestedSequential(nested), rank3) == 2);
  // Marks override types, per instance.
  nn::Linear marked(16, 8), other(16, 8);
  memscale::mark_not_tileable(marked);
  CHECK(dims(marked, rank3) == 0);
  CHECK(dims(other, rank3) == 2);
  gpt::TransformerBlock per_sample(mlp_options(16));
  memscale::mark_tileable(per_sample, 1);
  CHECK(dims(per_sample, rank3) == 1);
  CHECK_THROWS_WITH(memscale::mark_tileable(other, -1), Catch::Contains("leading_dims must be >= 0"));
}

namespace {

/// A chain of MLP blocks (no dropout): the tiling workload.
torch::nn::Sequential mlp_chain(int blocks, std::int64_t width) {
  torch::nn::Sequential seq;
  for (int i = 0; i < blocks; ++i) seq->push_back(gpt::MLP(mlp_options(width)));
  return seq;
}

test::measured_step run_chain(const std::optional<memscale::Config>& config) {
  memory_tracker::install();
  gpt::register_memscale_rule();
  torch::manual_seed(4);
  auto model = mlp_chain(4, 64);
  torch::manual_seed(5);
  auto x = torch::randn({8, 128, 64});
  return test::measure_step(model, x, config);
}

}  // namespace

TEST_CASE("tile: the planner tiles row-independent blocks with enable_tiling, lowering the measured peak",
          "[tile][acceptance]") {
  const auto baseline = run_chain(std::nullopt);
  const auto checkpointed = run_chain(test::quiet({.mode = OptimizationMode::Aggressive}));
  auto config = test::quiet({.mode = OptimizationMode::Aggressive});
  config.enable_tiling = true;
  const auto tiled = run_chain(config);
  INFO("peak growth: baseline " << baseline.peak_growth << " B, checkpointed " << checkpointed.peak_growth
                                << " B, tiled " << tiled.peak_growth << " B\n" << tiled.report);
  CHECK(checkpointed.report.tiled_segments() == 0);
  CHECK(tiled.report.tiled_segments() > 0);
  CHECK_THAT(tiled.report.str(), Catch::Contains("R10 tile-segment"));
  CHECK(tiled.report.planned_peak_bytes() < checkpointed.report.planned_peak_bytes());
  CHECK(tiled.peak_growth < checkpointed.peak_growth);
  CHECK(relative_error(tiled.result.first, baseline.result.first) <= 1e-6);
  CHECK(worst_relative_error(tiled.result.second, baseline.result.second) <= 1e-6);
  // Aggressive offloads after tiling: a tiled unit moves its input, never its weights.
  REQUIRE(tiled.report.offloaded_units() > 0);
  REQUIRE(tiled.offload);
  std::vector<std::vector<memscale::slot_cost>> costs;
  for (const auto& chain : tiled.report.chains) costs.push_back(chain.slots);
  const auto planned = memscale::core::offloaded_bytes(costs, tiled.report.plan.units);
  CHECK(tiled.offload->bytes_written == tiled.steps * planned);
}

TEST_CASE("tile: a module in two slots of one tile gets its gradient once", "[tile]") {
  torch::manual_seed(6);
  torch::nn::Linear shared(32, 32);
  torch::nn::GELU gelu;
  std::vector<torch::nn::AnyModule> slots{torch::nn::AnyModule(shared), torch::nn::AnyModule(gelu),
                                          torch::nn::AnyModule(shared)};
  auto tiled = std::make_shared<memscale::TileSegmentImpl>(slots, 4, 0);
  const auto x = torch::randn({16, 32});
  auto run = [&](auto&& forward) {
    shared->zero_grad();
    forward(x).pow(2).sum().backward();
    return test::grads_of(*shared);
  };
  const auto plain = run([&](const torch::Tensor& t) { return shared(gelu(shared(t))); });
  const auto chunked = run([&](const torch::Tensor& t) { return tiled->forward(t); });
  CHECK(worst_relative_error(chunked, plain) <= 1e-6);
}

TEST_CASE("tile: never for layers that mix rows or draw masks, and detach restores the chain", "[tile]") {
  gpt::register_memscale_rule();
  auto config = test::quiet({.mode = OptimizationMode::Aggressive});
  config.enable_tiling = true;
  auto model = test::flat_chain(3, 32, 128, 0.1);  // every run holds a drawing Dropout...
  model->push_back(torch::nn::BatchNorm1d(32));    // ... or batch statistics
  const auto slots = test::slot_identity(*model);
  {
    auto guard = memscale::optimize(model, torch::randn({16, 32}), config);
    CHECK(guard.report().checkpointed_segments() > 0);
    CHECK(guard.report().tiled_segments() == 0);
  }
  CHECK(test::slot_identity(*model) == slots);

  auto mlps = mlp_chain(3, 32);
  const auto mlp_slots = test::slot_identity(*mlps);
  memscale::mark_not_tileable(mlps->ptr(0));
  {
    auto guard = memscale::optimize(mlps, torch::randn({4, 64, 32}), config);
    // Under AddressSanitizer the measured times the choice rests on can rule tiling out (test_support.hpp).
    if (!test::under_address_sanitizer) CHECK(guard.report().tiled_segments() > 0);
    for (const auto& d : guard.report().plan.decisions)
      if (d.rule == memscale::core::rule_id::tile_segment) CHECK(d.first > 0);
  }
  CHECK(test::slot_identity(*mlps) == mlp_slots);
}

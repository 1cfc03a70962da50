// memscale::optim::AdamW8bit: the quantization maps and their round trip,
// optimizer state measured by the tracker, a 200-step run against
// torch::optim::AdamW, bit-exact save/load, small tensors bit-identical to
// torch::optim::AdamW, option and input errors, make_optimizer(). The CUDA
// comparison is hidden ("[.cuda]"): scripts/gpu-run.sh runs it on a GPU.
#include <cmath>
#include <sstream>

#include "test_support.hpp"

using memscale::memory_tracker;
using memscale::optim::AdamW8bit;
using memscale::optim::AdamW8bitOptions;
using memscale::optim::AdamW8bitParamState;

namespace {

torch::optim::AdamWParamState& adamw_state(torch::optim::AdamW& optimizer, const torch::Tensor& p) {
  return static_cast<torch::optim::AdamWParamState&>(*optimizer.state().at(memscale::optim::state_key(p)));
}

/// Gradients drawn from one seed, the same for every optimizer under test.
void set_grads(const std::vector<torch::Tensor>& params, std::uint64_t seed) {
  torch::manual_seed(seed);
  for (const auto& p : params) p.mutable_grad() = torch::randn(p.sizes()).to(p.dtype()) * 0.1;
}

std::vector<torch::Tensor> copies(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

/// Largest distance from a normalized value to its nearest map entry: half
/// the widest gap, or the signed map's distance from -1 to its lowest entry.
double map_error_bound(bool is_signed) {
  const auto& map = memscale::optim::dynamic_map(is_signed);
  double bound = is_signed ? 1.0 + map.front() : 0.0;
  for (std::size_t k = 0; k + 1 < map.size(); ++k) bound = std::max(bound, (map[k + 1] - map[k]) / 2.0);
  return bound;
}

bool state_equal(const AdamW8bitParamState& a, const AdamW8bitParamState& b) {
  return a.step() == b.step() && test::bit_equal(a.exp_avg(), b.exp_avg()) &&
         test::bit_equal(a.exp_avg_sq(), b.exp_avg_sq()) && test::bit_equal(a.exp_avg_codes(), b.exp_avg_codes()) &&
         test::bit_equal(a.exp_avg_absmax(), b.exp_avg_absmax()) &&
         test::bit_equal(a.exp_avg_sq_codes(), b.exp_avg_sq_codes()) &&
         test::bit_equal(a.exp_avg_sq_absmax(), b.exp_avg_sq_absmax());
}

/// Online regression against a fixed teacher: every step draws a fresh batch
/// (from a fixed seed), so neither optimizer can memorize and both losses
/// approach the same noise floor (0.25); the loss is measured on held-out data.
struct teacher_task {
  torch::Tensor weights;
  teacher_task() {
    torch::manual_seed(21);
    weights = torch::randn({32, 4}) / 4;
  }
  std::pair<torch::Tensor, torch::Tensor> batch(std::int64_t rows) const {
    auto x = torch::randn({rows, 32});
    auto y = torch::sin(x.matmul(weights)).sum(1, /*keepdim=*/true) + 0.5 * torch::randn({rows, 1});
    return {x, y};
  }
};

torch::nn::Sequential student() {
  torch::manual_seed(5);
  // The 32x128 and 128x128 weights are quantized; biases and the 128x1 head stay fp32.
  return torch::nn::Sequential(torch::nn::Linear(32, 128), torch::nn::Tanh(), torch::nn::Linear(128, 128),
                               torch::nn::Tanh(), torch::nn::Linear(128, 1));
}

}  // namespace

TEST_CASE("the dynamic quantization maps: 256 sorted values with 0 and 1", "[optim8bit]") {
  for (bool is_signed : {true, false}) {
    INFO((is_signed ? "signed" : "unsigned"));
    const auto& map = memscale::optim::dynamic_map(is_signed);
    CHECK(std::adjacent_find(map.begin(), map.end(), std::greater_equal<float>()) == map.end());
    CHECK(std::count(map.begin(), map.end(), 0.0f) == 1);
    CHECK(map.back() == 1.0f);
    CHECK(map[memscale::optim::zero_code(is_signed)] == 0.0f);
  }
  const auto& s = memscale::optim::dynamic_map(true);
  const auto& u = memscale::optim::dynamic_map(false);
  CHECK(std::count_if(s.begin(), s.end(), [](float v) { return v < 0.0f; }) == 127);
  CHECK(s.front() == Approx(-0.99296875).epsilon(1e-6));  // -(0.1 + 0.9 * 63/64 + 1) / 2
  CHECK(u.front() == 0.0f);
  // The smallest magnitudes: 10^-6 times the first linspace(0.1, 1) midpoint.
  CHECK(s[memscale::optim::zero_code(true) + 1] == Approx(0.55e-6).epsilon(1e-6));
  CHECK(u[1] == Approx(0.325e-6).epsilon(1e-6));
}

TEST_CASE("block-wise quantization round-trips within the map's resolution", "[optim8bit]") {
  torch::manual_seed(2);
  const std::int64_t n = 10 * 256 + 37;  // a partial last block
  auto x = torch::randn({n}) * torch::exp(torch::randn({n}) * 3);  // magnitudes over many decades
  x.narrow(0, 256, 256).zero_();                                     // an all-zero block
  for (bool is_signed : {true, false}) {
    INFO((is_signed ? "signed" : "unsigned"));
    const auto values = is_signed ? x : x.abs();
    const auto q = memscale::optim::quantize_blockwise(values, is_signed);
    REQUIRE(q.codes.scalar_type() == torch::kByte);
    REQUIRE(q.codes.numel() == n);
    REQUIRE(q.absmax.numel() == 11);
    CHECK(q.absmax[1].item<float>() == 0.0f);
    const auto back = memscale::optim::dequantize_blockwise(q, is_signed);
    const auto per_value_absmax = q.absmax.repeat_interleave(256).narrow(0, 0, n);
    CHECK(torch::equal(back.narrow(0, 256, 256), torch::zeros({256})));
    const auto error = (back - values).abs();
    CHECK((error <= per_value_absmax * map_error_bound(is_signed) * 1.0001).all().item<bool>());
    CHECK(torch::equal(q.absmax, torch::constant_pad_nd(values.abs(), {0, 11 * 256 - n}).view({11, 256}).amax(1)));
    // The code is the nearest map entry: no other entry is closer.
    const auto map = torch::tensor(std::vector<float>(memscale::optim::dynamic_map(is_signed).begin(),
                                                      memscale::optim::dynamic_map(is_signed).end()));
    const auto scale = torch::where(per_value_absmax > 0, per_value_absmax, torch::ones_like(per_value_absmax));
    const auto normalized = (values / scale).unsqueeze(1);
    const auto distance = (normalized - map.unsqueeze(0)).abs();
    const auto chosen = distance.gather(1, q.codes.to(torch::kLong).unsqueeze(1)).squeeze(1);
    CHECK(torch::equal(chosen, std::get<0>(distance.min(1))));
    // Map entries times absmax come back exactly.
    const auto exact = map.repeat({2}) * 0.5f;
    CHECK(torch::equal(memscale::optim::dequantize_blockwise(memscale::optim::quantize_blockwise(exact, is_signed),
                                                             is_signed),
                       exact));
  }
}

TEST_CASE("small tensors update bit-identically to torch::optim::AdamW", "[optim8bit]") {
  torch::manual_seed(1);
  // All below min_8bit_size, except the last, which a raised threshold keeps fp32.
  std::vector<torch::Tensor> params = {torch::randn({16, 32}), torch::randn({32}), torch::randn({4095}),
                                       torch::randn({64, 128})};
  for (auto& p : params) p.requires_grad_(true);
  auto mine = copies(params);
  auto theirs = copies(params);
  AdamW8bit eight_bit(mine, AdamW8bitOptions(1e-2).weight_decay(0.05).betas({0.8, 0.95}).min_8bit_size(1 << 14));
  torch::optim::AdamW reference(theirs, torch::optim::AdamWOptions(1e-2).weight_decay(0.05).betas({0.8, 0.95}));
  for (int step = 0; step < 6; ++step) {
    set_grads(mine, 100 + step);
    set_grads(theirs, 100 + step);
    eight_bit.step();
    reference.step();
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    INFO("parameter " << i);
    CHECK(test::bit_equal(mine[i], theirs[i]));
    const auto* state = eight_bit.state_of(mine[i]);
    REQUIRE(state != nullptr);
    CHECK_FALSE(state->quantized());
    CHECK(state->step() == adamw_state(reference, theirs[i]).step());
    CHECK(test::bit_equal(state->exp_avg(), adamw_state(reference, theirs[i]).exp_avg()));
    CHECK(test::bit_equal(state->exp_avg_sq(), adamw_state(reference, theirs[i]).exp_avg_sq()));
  }
}

TEST_CASE("optimizer state measured by the tracker: <= 2.1 bytes per parameter (fp32 AdamW: 8)", "[optim8bit]") {
  memory_tracker::install();
  for (bool eight_bit : {true, false}) {
    INFO((eight_bit ? "AdamW8bit" : "torch::optim::AdamW"));
    torch::manual_seed(3);
    torch::nn::Sequential model(torch::nn::Linear(512, 512), torch::nn::ReLU(), torch::nn::Linear(512, 512),
                                torch::nn::ReLU(), torch::nn::Linear(512, 384));
    auto optimizer = memscale::make_optimizer(test::quiet({.use_8bit_optimizer = eight_bit}), model->parameters());
    model->forward(torch::randn({8, 512})).square().mean().backward();
    std::int64_t parameters = 0, predicted = 0;
    for (const auto& p : model->parameters()) {
      parameters += p.numel();
      predicted += memscale::optim::optimizer_state_bytes(p.numel(), eight_bit);
    }
    const auto before = memory_tracker::current_bytes();
    optimizer->step();
    const auto state = memory_tracker::current_bytes() - before;
    const double per_parameter = static_cast<double>(state) / static_cast<double>(parameters);
    CAPTURE(state, parameters, per_parameter);
    CHECK(state == predicted);
    if (eight_bit) {
      CHECK(per_parameter <= 2.1);
      CHECK(state == dynamic_cast<AdamW8bit&>(*optimizer).state_bytes());
      CHECK(std::abs(per_parameter - memscale::optim::optimizer_state_bytes_per_parameter(true)) < 0.02);
    } else {
      CHECK(per_parameter == memscale::optim::optimizer_state_bytes_per_parameter(false));
    }
    // Later steps allocate no more state.
    const auto settled = memory_tracker::current_bytes();
    optimizer->step();
    CHECK(memory_tracker::current_bytes() == settled);
  }
}

TEST_CASE("a 200-step training run ends within 1% of torch::optim::AdamW's loss", "[optim8bit]") {
  const teacher_task task;
  torch::manual_seed(22);
  const auto [held_out_x, held_out_y] = task.batch(4096);
  auto reference_model = student();
  auto model = student();
  torch::optim::AdamW reference(reference_model->parameters(), torch::optim::AdamWOptions(3e-3));
  AdamW8bit eight_bit(model->parameters(), AdamW8bitOptions(3e-3));
  const auto held_out_loss = [&](torch::nn::Sequential& m) {
    torch::NoGradGuard no_grad;
    return torch::mse_loss(m->forward(held_out_x), held_out_y).item<float>();
  };
  const float initial = held_out_loss(model);
  torch::manual_seed(23);
  for (int step = 0; step < 200; ++step) {
    const auto [x, y] = task.batch(256);
    for (auto [m, optimizer] : {std::pair<torch::nn::Sequential*, torch::optim::Optimizer*>{&reference_model, &reference},
                                {&model, &eight_bit}}) {
      optimizer->zero_grad();
      torch::mse_loss((*m)->forward(x), y).backward();
      optimizer->step();
    }
  }
  const float reference_loss = held_out_loss(reference_model);
  const float loss = held_out_loss(model);
  CAPTURE(initial, reference_loss, loss);
  CHECK(reference_loss < 0.3f * initial);  // the run learns something worth comparing
  CHECK(std::abs(loss - reference_loss) <= 0.01f * reference_loss);
  std::int64_t quantized = 0;
  for (const auto& p : model->parameters()) quantized += eight_bit.state_of(p)->quantized() ? p.numel() : 0;
  CHECK(quantized == 32 * 128 + 128 * 128);
}

TEST_CASE("optimizer state survives torch::save/torch::load bit-exactly", "[optim8bit]") {
  torch::manual_seed(4);
  std::vector<torch::Tensor> params = {torch::randn({40, 300}), torch::randn({300}), torch::randn({5000})};
  for (auto& p : params) p.requires_grad_(true);
  const auto options = AdamW8bitOptions(2e-3).weight_decay(0.1);
  AdamW8bit original(params, options);
  for (int step = 0; step < 4; ++step) {
    set_grads(params, 200 + step);
    original.step();
  }
  std::stringstream stream;
  torch::save(original, stream);

  auto restored_params = copies(params);
  AdamW8bit restored(restored_params, options);
  torch::load(restored, stream);
  for (std::size_t i = 0; i < params.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(restored.state_of(restored_params[i]) != nullptr);
    CHECK(state_equal(*original.state_of(params[i]), *restored.state_of(restored_params[i])));
  }
  CHECK(original.state_of(params[0])->quantized());
  CHECK_FALSE(original.state_of(params[1])->quantized());
  CHECK(static_cast<const AdamW8bitOptions&>(restored.param_groups()[0].options()) == options);

  for (int step = 0; step < 3; ++step) {
    set_grads(params, 300 + step);
    set_grads(restored_params, 300 + step);
    original.step();
    restored.step();
  }
  CHECK(test::bit_equal(params, restored_params));
  for (std::size_t i = 0; i < params.size(); ++i)
    CHECK(state_equal(*original.state_of(params[i]), *restored.state_of(restored_params[i])));
}

TEST_CASE("AdamW8bit options out of range throw errors naming the field", "[optim8bit]") {
  const std::vector<torch::Tensor> params = {torch::zeros({4}, torch::requires_grad())};
  const auto rejects = [&](const AdamW8bitOptions& options, const std::string& field) {
    INFO(field);
    CHECK_THROWS_WITH(AdamW8bit(params, options),
                      Catch::Contains("AdamW8bitOptions::" + field + " must be") && Catch::Contains("got"));
  };
  rejects(AdamW8bitOptions(-1.0), "lr");
  rejects(AdamW8bitOptions(std::nan("")), "lr");
  rejects(AdamW8bitOptions().betas({1.0, 0.999}), "betas[0]");
  rejects(AdamW8bitOptions().betas({0.9, -0.1}), "betas[1]");
  rejects(AdamW8bitOptions().eps(-1e-8), "eps");
  rejects(AdamW8bitOptions().weight_decay(-0.1), "weight_decay");
  rejects(AdamW8bitOptions().min_8bit_size(-1), "min_8bit_size");
  // A param group's own options are checked too, and must be AdamW8bit's.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(params, std::make_unique<AdamW8bitOptions>(AdamW8bitOptions().eps(-1.0)));
  CHECK_THROWS_WITH(AdamW8bit(groups), Catch::Contains("eps must be"));
  std::vector<torch::optim::OptimizerParamGroup> foreign;
  foreign.emplace_back(params, std::make_unique<torch::optim::AdamWOptions>());
  CHECK_THROWS_AS(AdamW8bit(foreign), memscale::Error);
  CHECK_THROWS_WITH(memscale::make_optimizer(test::quiet(), params, {.lr = -1.0}),
                    Catch::Contains("memscale::optimizer_options::lr must be a finite number >= 0, got -1"));
}

TEST_CASE("make_optimizer builds what Config::use_8bit_optimizer asks for", "[optim8bit]") {
  const std::vector<torch::Tensor> params = {torch::zeros({4}, torch::requires_grad())};
  const memscale::optimizer_options options{.lr = 5e-4, .betas = {0.85, 0.99}, .eps = 1e-6, .weight_decay = 0.2};
  auto eight_bit = memscale::make_optimizer(test::quiet({.use_8bit_optimizer = true}), params, options);
  auto* adamw8bit = dynamic_cast<AdamW8bit*>(eight_bit.get());
  REQUIRE(adamw8bit != nullptr);
  const auto& o = static_cast<const AdamW8bitOptions&>(adamw8bit->defaults());
  CHECK(o == AdamW8bitOptions(5e-4).betas({0.85, 0.99}).eps(1e-6).weight_decay(0.2));

  auto fp32 = memscale::make_optimizer(test::quiet(), params, options);
  auto* adamw = dynamic_cast<torch::optim::AdamW*>(fp32.get());
  REQUIRE(adamw != nullptr);
  const auto& a = static_cast<const torch::optim::AdamWOptions&>(adamw->defaults());
  CHECK((a.lr() == 5e-4 && a.betas() == std::make_tuple(0.85, 0.99) && a.eps() == 1e-6 && a.weight_decay() == 0.2));
  CHECK(memscale::optim::optimizer_state_bytes_per_parameter(false) == 8.0);
  static_assert(memscale::optim::optimizer_state_bytes(1000, true) == 8000);  // below the threshold
  static_assert(memscale::optim::optimizer_state_bytes(4096, true) == 2 * 4096 + 8 * 16);
}

TEST_CASE("parameters without a gradient are skipped, zero gradients step as in AdamW", "[optim8bit]") {
  torch::manual_seed(6);
  std::vector<torch::Tensor> params = {torch::randn({100}), torch::randn({8192}), torch::randn({50})};
  for (auto& p : params) p.requires_grad_(true);
  auto theirs = copies(params);
  const auto before = copies(params);
  AdamW8bit eight_bit(params, AdamW8bitOptions(1e-2).weight_decay(0.1));
  torch::optim::AdamW reference(theirs, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  params[0].mutable_grad() = torch::zeros({100});
  params[1].mutable_grad() = torch::zeros({8192});
  theirs[0].mutable_grad() = torch::zeros({100});  // params[2] and theirs[2]: no gradient
  eight_bit.step();
  reference.step();
  CHECK(test::bit_equal(params[0], theirs[0]));
  // m = v = 0: only the decoupled weight decay moves the quantized tensor.
  CHECK(test::bit_equal(params[1], before[1].detach() * (1 - 1e-2 * 0.1)));
  CHECK(test::bit_equal(params[2], before[2]));
  CHECK(eight_bit.state_of(params[2]) == nullptr);
  REQUIRE(eight_bit.state_of(params[1]) != nullptr);
  CHECK(eight_bit.state_of(params[1])->step() == 1);
  CHECK(eight_bit.state_of(params[1])->quantized());  // 8192 elements: at least min_8bit_size
  CHECK_FALSE(eight_bit.state_of(params[0])->quantized());
}

TEST_CASE("min_8bit_size: 4095 elements keep fp32 moments, 4096 are quantized", "[optim8bit]") {
  std::vector<torch::Tensor> params = {torch::randn({4095}, torch::requires_grad()),
                                       torch::randn({64, 64}, torch::requires_grad())};
  set_grads(params, 1);
  AdamW8bit optimizer(params);
  optimizer.step();
  CHECK_FALSE(optimizer.state_of(params[0])->quantized());
  CHECK(optimizer.state_of(params[1])->quantized());
  CHECK(optimizer.state_of(params[1])->exp_avg_absmax().numel() == 16);
}

TEST_CASE("sparse gradients and unsupported dtypes are refused before anything changes", "[optim8bit]") {
  std::vector<torch::Tensor> params = {torch::randn({10}, torch::requires_grad()),
                                       torch::randn({10}, torch::requires_grad())};
  const auto before = copies(params);
  params[0].mutable_grad() = torch::ones({10});
  params[1].mutable_grad() = torch::ones({10}).to_sparse();
  AdamW8bit optimizer(params);
  CHECK_THROWS_WITH(optimizer.step(), Catch::Contains("sparse gradients are not supported"));
  CHECK(test::bit_equal(params, before));
  CHECK(optimizer.state_of(params[0]) == nullptr);

  std::vector<torch::Tensor> doubles = {torch::randn({10}, torch::dtype(torch::kDouble).requires_grad(true))};
  doubles[0].mutable_grad() = torch::ones({10}, torch::kDouble);
  AdamW8bit refuses(doubles);
  CHECK_THROWS_WITH(refuses.step(), Catch::Contains("float32, float16 or bfloat16, got Double"));
}

TEST_CASE("bfloat16 and float16 parameters update in fp32 and are written back", "[optim8bit]") {
  torch::manual_seed(8);
  for (auto dtype : {torch::kBFloat16, torch::kHalf})
    for (std::int64_t n : {std::int64_t{300}, std::int64_t{8192}}) {
      INFO(c10::toString(dtype) << ", " << n << " elements");
      const auto start = torch::randn({n}).to(dtype);
      std::vector<torch::Tensor> low = {start.clone().requires_grad_(true)};
      std::vector<torch::Tensor> full = {start.to(torch::kFloat).requires_grad_(true)};
      const auto grad = torch::randn({n}).to(dtype);
      low[0].mutable_grad() = grad;
      full[0].mutable_grad() = grad.to(torch::kFloat);
      AdamW8bit a(low), b(full);
      a.step();
      b.step();
      CHECK(low[0].scalar_type() == dtype);
      CHECK(test::bit_equal(low[0], full[0].to(dtype)));
      CHECK(state_equal(*a.state_of(low[0]), *b.state_of(full[0])));
    }
}

TEST_CASE("param groups keep their own hyperparameters", "[optim8bit]") {
  torch::manual_seed(9);
  std::vector<torch::Tensor> params = {torch::randn({6000}, torch::requires_grad()),
                                       torch::randn({6000}, torch::requires_grad())};
  auto alone = copies(params);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{params[0]});
  groups.emplace_back(std::vector<torch::Tensor>{params[1]},
                      std::make_unique<AdamW8bitOptions>(AdamW8bitOptions(1e-1).weight_decay(0.0)));
  AdamW8bit grouped(groups, AdamW8bitOptions(1e-3));
  AdamW8bit first(std::vector<torch::Tensor>{alone[0]}, AdamW8bitOptions(1e-3));
  AdamW8bit second(std::vector<torch::Tensor>{alone[1]}, AdamW8bitOptions(1e-1).weight_decay(0.0));
  for (int step = 0; step < 3; ++step) {
    set_grads(params, 400 + step);
    set_grads(alone, 400 + step);
    grouped.step();
    first.step();
    second.step();
  }
  CHECK(test::bit_equal(params, alone));
}

TEST_CASE("a group added to an AdamW8bit keeps its options, through the base class on LibTorch 2.x it is refused",
          "[optim8bit]") {
  torch::manual_seed(10);
  std::vector<torch::Tensor> params = {torch::randn({3000}, torch::requires_grad()),
                                       torch::randn({3000}, torch::requires_grad())};
  auto alone = copies(params);
  AdamW8bit grouped(std::vector<torch::Tensor>{params[0]}, AdamW8bitOptions(1e-3));
  grouped.add_param_group(torch::optim::OptimizerParamGroup(
      std::vector<torch::Tensor>{params[1]}, std::make_unique<AdamW8bitOptions>(AdamW8bitOptions(1e-1).weight_decay(0.0))));
  AdamW8bit first(std::vector<torch::Tensor>{alone[0]}, AdamW8bitOptions(1e-3));
  AdamW8bit second(std::vector<torch::Tensor>{alone[1]}, AdamW8bitOptions(1e-1).weight_decay(0.0));
  for (int step = 0; step < 3; ++step) {
    set_grads(params, 500 + step);
    set_grads(alone, 500 + step);
    grouped.step();
    first.step();
    second.step();
  }
  CHECK(test::bit_equal(params, alone));
  // Bad options through it are refused at once, naming the field.
  CHECK_THROWS_WITH(grouped.add_param_group(torch::optim::OptimizerParamGroup(
                        std::vector<torch::Tensor>{torch::randn({8}, torch::requires_grad())},
                        std::make_unique<AdamW8bitOptions>(AdamW8bitOptions(1e-3).eps(-1.0)))),
                    Catch::Contains("eps"));
  // Through make_optimizer's base-class pointer: LibTorch 1.13 keeps the
  // group's options; 2.x would replace them with the defaults, so step() refuses.
  auto base = memscale::make_optimizer(test::quiet({.use_8bit_optimizer = true}), {torch::randn({8}, torch::requires_grad())});
  base->add_param_group(torch::optim::OptimizerParamGroup(std::vector<torch::Tensor>{torch::randn({8}, torch::requires_grad())}));
  for (auto& group : base->param_groups())
    for (auto& p : group.params()) p.mutable_grad() = torch::ones_like(p);
  if (TORCH_VERSION_MAJOR >= 2) CHECK_THROWS_WITH(base->step(), Catch::Contains("add_param_group"));
  else CHECK_NOTHROW(base->step());
}

TEST_CASE("the CPU loop and the ATen path (other devices) make the same 8-bit update", "[optim8bit]") {
  torch::manual_seed(12);
  const std::int64_t n = 50 * 256 + 77;
  const auto options = AdamW8bitOptions(1e-3).weight_decay(0.05);
  const auto start = torch::randn({n});
  const auto q_m = memscale::optim::quantize_blockwise(torch::randn({n}) * 0.1, true);
  const auto q_v = memscale::optim::quantize_blockwise(torch::rand({n}) * 0.01, false);
  AdamW8bitParamState loop_state, aten_state;
  for (auto* s : {&loop_state, &aten_state})
    s->step(3)
        .exp_avg_codes(q_m.codes.clone())
        .exp_avg_absmax(q_m.absmax.clone())
        .exp_avg_sq_codes(q_v.codes.clone())
        .exp_avg_sq_absmax(q_v.absmax.clone());
  auto loop_param = start.clone();
  auto aten_param = start.clone();
  const auto tables = memscale::optim::detail::tables_on(torch::kCPU);
  for (int step = 4; step < 7; ++step) {
    const auto grad = torch::randn({n});
    const double bc1 = 1 - std::pow(0.9, step), bc2 = 1 - std::pow(0.999, step);
    memscale::optim::detail::quantized_update_cpu(loop_param, grad, loop_state, options, bc1, bc2);
    memscale::optim::detail::quantized_update_aten(aten_param, grad, aten_state, options, bc1, bc2, tables);
  }
  CHECK(torch::allclose(loop_param, aten_param, /*rtol=*/1e-6, /*atol=*/1e-7));
  for (const auto& [a, b] : {std::pair{loop_state.exp_avg_codes(), aten_state.exp_avg_codes()},
                             std::pair{loop_state.exp_avg_sq_codes(), aten_state.exp_avg_sq_codes()}}) {
    const auto difference = (a.to(torch::kInt) - b.to(torch::kInt)).abs();
    CHECK(difference.max().item<int>() <= 1);                      // a rounding tie at most one step apart
    CHECK(difference.sum().item<std::int64_t>() <= n / 1000 + 1);  // and rare
  }
  CHECK(torch::allclose(loop_state.exp_avg_absmax(), aten_state.exp_avg_absmax(), 1e-6, 0.0));
  CHECK(torch::allclose(loop_state.exp_avg_sq_absmax(), aten_state.exp_avg_sq_absmax(), 1e-6, 0.0));
}

TEST_CASE("AdamW8bit: the CUDA step matches the CPU step", "[.cuda]") {
  REQUIRE(torch::cuda::is_available());
  torch::manual_seed(10);
  std::vector<torch::Tensor> cpu = {torch::randn({5000}), torch::randn({300, 333}), torch::randn({100}),
                                    torch::randn({4097})};
  for (auto& p : cpu) p.requires_grad_(true);
  std::vector<torch::Tensor> gpu;
  for (const auto& p : cpu) gpu.push_back(p.detach().to(torch::kCUDA).requires_grad_(true));
  AdamW8bit on_cpu(cpu, AdamW8bitOptions(1e-3).weight_decay(0.05));
  AdamW8bit on_gpu(gpu, AdamW8bitOptions(1e-3).weight_decay(0.05));
  for (int step = 0; step < 4; ++step) {
    set_grads(cpu, 500 + step);
    for (std::size_t i = 0; i < cpu.size(); ++i) gpu[i].mutable_grad() = cpu[i].grad().to(torch::kCUDA);
    on_cpu.step();
    on_gpu.step();
  }
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    INFO("parameter " << i);
    CHECK(torch::allclose(gpu[i].detach().cpu(), cpu[i].detach(), /*rtol=*/1e-4, /*atol=*/1e-5));
    const auto& a = *on_cpu.state_of(cpu[i]);
    const auto& b = *on_gpu.state_of(gpu[i]);
    REQUIRE(a.quantized() == b.quantized());
    if (!a.quantized()) continue;
#ifdef MEMSCALE_WITH_CUDA_KERNELS
    // The fused kernel runs the CPU pass's float arithmetic (same constants and
    // order, built without FMA contraction): bit for bit.
    CHECK(torch::equal(gpu[i].detach().cpu(), cpu[i].detach()));
    CHECK(torch::equal(b.exp_avg_codes().cpu(), a.exp_avg_codes()));
    CHECK(torch::equal(b.exp_avg_sq_codes().cpu(), a.exp_avg_sq_codes()));
    CHECK(torch::equal(b.exp_avg_absmax().cpu(), a.exp_avg_absmax()));
    CHECK(torch::equal(b.exp_avg_sq_absmax().cpu(), a.exp_avg_sq_absmax()));
#endif
    // The ATen path rounds differently (FMA, other kernels): one code step at most.
    for (const auto& [x, y] : {std::pair{a.exp_avg_codes(), b.exp_avg_codes()},
                               std::pair{a.exp_avg_sq_codes(), b.exp_avg_sq_codes()}})
      CHECK((x.to(torch::kInt) - y.cpu().to(torch::kInt)).abs().max().item<int>() <= 1);
    CHECK(torch::allclose(b.exp_avg_absmax().cpu(), a.exp_avg_absmax(), 1e-4, 0.0));
    CHECK(torch::allclose(b.exp_avg_sq_absmax().cpu(), a.exp_avg_sq_absmax(), 1e-4, 0.0));
  }
}

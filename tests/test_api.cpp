// The public surface: Config validation, wrap/optimize/detach, the guard, exact
// restoration, the strong guarantee under injected faults, lazy planning.
#include <algorithm>
#include <functional>

#include "test_support.hpp"

#include <memscale/detail/fault_injection.hpp>

using memscale::Config;
using memscale::OptimizationMode;

TEST_CASE("the default Config is valid", "[api][config]") { CHECK_NOTHROW(Config{}.validate()); }

TEST_CASE("every invalid Config field gets a ConfigError naming it", "[api][config]") {
  struct bad_case {
    std::string field;
    std::function<void(Config&)> spoil;
  };
  const std::vector<bad_case> cases = {
      {"mode", [](Config& c) { c.mode = static_cast<OptimizationMode>(7); }},
      {"max_cpu_offload_gb", [](Config& c) { c.max_cpu_offload_gb = -1.0; }},
      {"max_cpu_offload_gb", [](Config& c) { c.max_cpu_offload_gb = std::nan(""); }},
      {"target_gpu_utilization", [](Config& c) { c.target_gpu_utilization = 0.0; }},
      {"target_gpu_utilization", [](Config& c) { c.target_gpu_utilization = 1.5; }},
      {"target_gpu_utilization", [](Config& c) { c.target_gpu_utilization = std::nan(""); }},
      {"warmup_steps", [](Config& c) { c.warmup_steps = -1; }},
      {"log_file", [](Config& c) { c.log_file = ""; }},
      {"policy", [](Config& c) { c.policy = static_cast<memscale::PolicyKind>(5); }},
      {"policy_artifact", [](Config& c) { c.policy_artifact = ""; }},
      {"policy_artifact", [](Config& c) {
         c.policy = memscale::PolicyKind::rule;
         c.policy_artifact = "policy.txt";
       }},
      {"observability_port", [](Config& c) { c.observability_port = -1; }},
      {"observability_bind_address", [](Config& c) { c.observability_bind_address.clear(); }},
      {"observability_port", [](Config& c) { c.observability_port = 70000; }},
      {"async_config.prefetch_depth", [](Config& c) { c.async_config = memscale::AsyncOffloadConfig{.prefetch_depth = 0}; }},
      {"async_config.pinned_pool_mb", [](Config& c) { c.async_config = memscale::AsyncOffloadConfig{.pinned_pool_mb = -5}; }},
      {"async_config.io_threads", [](Config& c) { c.async_config = memscale::AsyncOffloadConfig{.io_threads = 0}; }},
      {"async_config.disk_dir", [](Config& c) { c.async_config = memscale::AsyncOffloadConfig{.disk_dir = ""}; }},
      {"memory_budget_gb", [](Config& c) { c.memory_budget_gb = 0.0; }},
      {"memory_budget_gb", [](Config& c) { c.memory_budget_gb = -2.0; }},
      {"use_empirical_fallback", [](Config& c) {
         c.use_static_profiling = false;
         c.use_empirical_fallback = false;
       }},
  };
  for (const auto& bad : cases) {
    Config c;
    bad.spoil(c);
    INFO("field " << bad.field);
    try {
      c.validate();
      FAIL("validate() accepted a bad " << bad.field);
    } catch (const memscale::ConfigError& e) {
      CHECK(e.field() == bad.field);
      CHECK_THAT(e.what(), Catch::Contains(bad.field) && Catch::Contains("must"));
    }
  }
}

TEST_CASE("wrap rejects an invalid Config and leaves the model alone", "[api][config]") {
  auto seq = test::flat_chain(1);
  const auto slots = test::slot_identity(*seq);
  Config c = test::quiet();
  c.warmup_steps = -3;
  CHECK_THROWS_AS(memscale::wrap(seq, torch::randn({2, 64}), c), memscale::ConfigError);
  CHECK(test::slot_identity(*seq) == slots);
  CHECK_FALSE(memscale::is_optimized(seq));
}

struct NoSequentialImpl : torch::nn::Module {
  NoSequentialImpl() { lin = register_module("lin", torch::nn::Linear(4, 4)); }
  torch::Tensor forward(torch::Tensor x) { return lin(x); }
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(NoSequential);

TEST_CASE("a model without a Sequential, wrapped without an example, waits for its call sites and says so",
          "[api]") {
  NoSequential model;
  {
    auto guard = memscale::optimize(model, test::quiet());
    const auto report = guard.report();
    CHECK_FALSE(report.planned);
    CHECK_THAT(report.str(), Catch::Contains("the units will be the memscale::forward calls") &&
                                 Catch::Contains("whole-model offload only when wrapped with an example input"));
    // Its forward makes no call site: training runs as it is.
    auto x = torch::randn({2, 4});
    model->forward(x).sum().backward();
    CHECK_FALSE(guard.report().planned);
  }
  CHECK_FALSE(memscale::is_optimized(model));
}

TEST_CASE("an undefined or ill-shaped example input gets an error that says what to pass", "[api]") {
  auto seq = test::flat_chain(1);
  const auto slots = test::slot_identity(*seq);
  const auto undefined = [](auto& model) {
    try {
      (void)memscale::wrap(model, torch::Tensor(), test::quiet());
    } catch (const memscale::Error& e) {  // not LibTorch's "tensor does not have a device"
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(undefined(seq), Catch::Contains("the example input is an undefined tensor"));
  CHECK(test::slot_identity(*seq) == slots);
  CHECK_FALSE(memscale::is_optimized(seq));
  // No rows: nothing to profile or plan at (it was planned at [0, 64], applying nothing, unsaid).
  CHECK_THROWS_WITH(memscale::wrap(seq, torch::randn({0, 64}), test::quiet()),
                    Catch::Contains("the example input has no rows (shape [0, 64])"));
  // An ill-shaped example for a Sequential: the message speaks of the example first.
  CHECK_THROWS_WITH(memscale::wrap(seq, torch::randn({2, 5}), test::quiet()),
                    Catch::Contains("pass the batch the forward takes") &&
                        Catch::Contains("If the example is right"));
  CHECK(test::slot_identity(*seq) == slots);
  CHECK_FALSE(memscale::is_optimized(seq));
  NoSequential model;
  CHECK_THAT(undefined(model), Catch::Contains("the example input is an undefined tensor"));
  // A model with no Sequential: the message speaks of the input, not of a Sequential's first slot.
  const auto before = model->lin->weight.clone();
  try {
    (void)memscale::wrap(model, torch::randn({2, 5}), test::quiet());
    FAIL("a 5-wide input into a Linear(4, 4) ran");
  } catch (const memscale::UnsupportedModelError& e) {
    CHECK_THAT(e.what(), Catch::Contains("pass the batch the forward takes") && !Catch::Contains("Sequential"));
  }
  CHECK(torch::equal(model->lin->weight, before));
  CHECK_FALSE(memscale::is_optimized(model));
}

TEST_CASE("wrap twice is refused, detach of a plain model is a no-op", "[api][executor]") {
  auto seq = test::flat_chain(2);
  auto x = torch::randn({4, 64});
  CHECK_FALSE(memscale::detach(seq));
  const auto cfg = test::quiet({.mode = OptimizationMode::Aggressive});
  (void)memscale::wrap(seq, x, cfg);
  CHECK(memscale::is_optimized(seq));
  const auto slots = test::slot_identity(*seq);
  CHECK_THROWS_AS(memscale::wrap(seq, x, cfg), memscale::AlreadyOptimizedError);
  CHECK(test::slot_identity(*seq) == slots);  // the refused call changed nothing
  CHECK(memscale::detach(seq));
  CHECK_FALSE(memscale::is_optimized(seq));
  CHECK_FALSE(memscale::detach(seq));
}

namespace {
/// A model whose layers sit in a Sequential member.
class WithBodyImpl : public torch::nn::Module {
 public:
  WithBodyImpl() : body(register_module("body", test::flat_chain(3))) {}
  torch::Tensor forward(torch::Tensor x) { return body->forward(x); }
  torch::nn::Sequential body;
};
TORCH_MODULE(WithBody);

/// The modules a ModuleList holds, by identity.
std::vector<const void*> children_of(torch::nn::ModuleListImpl& list) {
  std::vector<const void*> ids;
  for (const auto& m : list) ids.push_back(m.get());
  return ids;
}
}  // namespace

TEST_CASE("a Sequential inside an optimized model cannot be wrapped on its own", "[api][executor]") {
  WithBody model;
  auto x = torch::randn({4, 64});
  auto guard = memscale::optimize(model, x, test::quiet({.mode = OptimizationMode::Aggressive}));
  REQUIRE(guard.report().checkpointed_segments() > 0);
  CHECK_THROWS_AS(memscale::wrap(model->body, test::quiet()), memscale::AlreadyOptimizedError);
  // Named as what was passed, not as its type in quotes as if it were a path.
  CHECK_THROWS_WITH(memscale::wrap(model->body, test::quiet()),
                    Catch::Contains("the Sequential passed (torch::nn::SequentialImpl) is already managed"));
}

TEST_CASE("wrap keeps parameters, names and buffers, detach restores outputs and gradients bit-exactly",
          "[api][executor]") {
  auto options = test::small_gpt();
  torch::manual_seed(5);
  gpt::GPT reference(options);
  torch::manual_seed(5);
  gpt::GPT model(options);
  auto tokens = torch::randint(256, {4, 64}, torch::kLong);
  auto targets = torch::randint(256, {4, 64}, torch::kLong);
  const auto identity = test::parameter_identity(*model);
  const auto blocks = children_of(*model->blocks);

  auto forward = [&](gpt::GPT& m) { return [&] { return gpt::loss(m->forward(tokens), targets); }; };
  const auto expected = test::step(*reference, forward(reference));
  {
    auto guard = memscale::optimize(model, tokens, test::quiet({.mode = OptimizationMode::Aggressive}));
    REQUIRE(guard.report().checkpointed_segments() > 0);
    CHECK(children_of(*model->blocks) == blocks);  // call sites change nothing in the model
    CHECK(test::parameter_identity(*model) == identity);
    const auto optimized = test::step(*model, forward(model));
    CHECK(test::bit_equal(expected.first, optimized.first));
    CHECK(test::bit_equal(expected.second, optimized.second));
  }
  CHECK_FALSE(memscale::is_optimized(model));
  CHECK(children_of(*model->blocks) == blocks);
  CHECK(test::parameter_identity(*model) == identity);
  const auto after = test::step(*model, forward(model));
  CHECK(test::bit_equal(expected.first, after.first));
  CHECK(test::bit_equal(expected.second, after.second));
}

TEST_CASE("the guard is move-only, detaches once, and release() detaches early", "[api]") {
  static_assert(!std::is_copy_constructible_v<memscale::OptimizationGuard>);
  static_assert(std::is_nothrow_move_constructible_v<memscale::OptimizationGuard>);
  static_assert(std::is_nothrow_destructible_v<memscale::OptimizationGuard>);
  auto seq = test::flat_chain(2);
  auto x = torch::randn({4, 64});
  auto guard = memscale::optimize(seq, x, test::quiet({.mode = OptimizationMode::Aggressive}));
  auto moved = std::move(guard);
  CHECK(moved.active());
  CHECK(memscale::is_optimized(seq));
  moved.release();
  CHECK_FALSE(moved.active());
  CHECK_FALSE(memscale::is_optimized(seq));
}

TEST_CASE("a fault in any stage of wrap leaves the model exactly as it was", "[api][executor]") {
  using memscale::detail::pipeline_stage;
  for (auto stage : {pipeline_stage::capture, pipeline_stage::profile, pipeline_stage::plan,
                     pipeline_stage::apply, pipeline_stage::commit}) {
    INFO("stage " << memscale::detail::stage_name(stage));
    torch::manual_seed(6);
    auto reference = test::flat_chain(3);
    torch::manual_seed(6);
    auto seq = test::flat_chain(3);
    auto x = torch::randn({8, 64});
    const auto slots = test::slot_identity(*seq);
    const auto identity = test::parameter_identity(*seq);
    {
      memscale::detail::inject_fault fault(stage);
      CHECK_THROWS_AS(memscale::wrap(seq, x, test::quiet({.mode = OptimizationMode::Aggressive})), memscale::Error);
    }
    CHECK_FALSE(memscale::is_optimized(seq));
    CHECK(test::slot_identity(*seq) == slots);
    CHECK(test::parameter_identity(*seq) == identity);
    const auto expected = test::step(*reference, [&] { return reference->forward(x).sum(); });
    const auto got = test::step(*seq, [&] { return seq->forward(x).sum(); });
    CHECK(test::bit_equal(expected.second, got.second));
  }
}

TEST_CASE("a fault while planning at the first forward restores the chain and reports it", "[api][executor]") {
  using memscale::detail::pipeline_stage;
  for (auto stage : {pipeline_stage::profile, pipeline_stage::plan, pipeline_stage::apply}) {
    INFO("stage " << memscale::detail::stage_name(stage));
    auto seq = test::flat_chain(3);
    auto x = torch::randn({8, 64});
    const auto slots = test::slot_identity(*seq);
    (void)memscale::wrap(seq, test::quiet({.mode = OptimizationMode::Aggressive}));
    {
      memscale::detail::inject_fault fault(stage);
      CHECK_THROWS_AS(seq->forward(x), memscale::Error);
    }
    CHECK(test::slot_identity(*seq) == slots);
    CHECK_NOTHROW(seq->forward(x));  // runs plainly from now on
    CHECK(memscale::detach(seq));
    CHECK(test::slot_identity(*seq) == slots);
  }
}

TEST_CASE("without an example input, planning happens at the first forward", "[api][executor]") {
  torch::manual_seed(8);
  auto reference = test::flat_chain(4);
  torch::manual_seed(8);
  auto seq = test::flat_chain(4);
  auto x = torch::randn({16, 64}, torch::requires_grad());
  auto guard = memscale::optimize(seq, test::quiet({.mode = OptimizationMode::Aggressive}));
  CHECK_FALSE(guard.report().planned);
  const auto expected = test::step(*reference, [&] { return reference->forward(x).pow(2).sum(); });
  const auto got = test::step(*seq, [&] { return seq->forward(x).pow(2).sum(); });
  const auto report = guard.report();
  CHECK(report.planned);
  CHECK(report.checkpointed_segments() > 0);
  CHECK((report.chains.at(0).input_shape == std::vector<std::int64_t>{16, 64}));
  CHECK(test::bit_equal(expected.first, got.first));
  CHECK(test::bit_equal(expected.second, got.second));
}

TEST_CASE("a model held as std::shared_ptr<Module> can be wrapped and detached", "[api]") {
  auto seq = test::flat_chain(2);
  std::shared_ptr<torch::nn::Module> base = seq.ptr();
  (void)memscale::wrap(base, test::quiet({.mode = OptimizationMode::Aggressive}));
  CHECK(memscale::is_optimized(base));
  CHECK(memscale::is_optimized(seq));  // same root
  seq->forward(torch::randn({2, 64}));
  CHECK(memscale::detach(base));
}

TEST_CASE("nested chains: every outermost Sequential is planned", "[api][executor]") {
  test::NestedSequential inner(test::flat_chain(2));
  torch::nn::Sequential outer(torch::nn::Linear(64, 64), inner, torch::nn::ReLU());
  auto chains = memscale::core::find_chains(outer.ptr());
  REQUIRE(chains.size() == 1);  // the inner one is a slot of the outer
  CHECK(chains[0].path.empty());
  WithBody model;
  auto body_chains = memscale::core::find_chains(model.ptr());
  REQUIRE(body_chains.size() == 1);
  CHECK(body_chains[0].path == "body");
  gpt::GPT gpt_model(test::small_gpt());  // blocks in a ModuleList: its units are call sites
  CHECK(memscale::core::find_chains(gpt_model.ptr()).empty());
}

TEST_CASE("Config and Strategy can exclude checkpointing, low pressure skips", "[api][engine]") {
  auto seq = test::flat_chain(2);
  auto x = torch::randn({4, 64});
  const auto slots = test::slot_identity(*seq);
  {
    auto guard = memscale::optimize(seq, x, test::quiet({.mode = OptimizationMode::Aggressive, .enable_checkpointing = false}));
    CHECK(guard.report().plan.overall == memscale::core::rule_id::checkpointing_disabled);
    CHECK(test::slot_identity(*seq) == slots);
  }
  {
    auto guard = memscale::optimize<memscale::Strategy<memscale::Offload>>(
        seq, x, test::quiet({.mode = OptimizationMode::Aggressive}));
    CHECK(guard.report().plan.overall == memscale::core::rule_id::checkpointing_disabled);
    CHECK(test::slot_identity(*seq) == slots);
  }
  {
    auto guard = memscale::optimize<memscale::Strategy<memscale::Checkpoint>>(seq, x, test::quiet());
    const auto report = guard.report();
    CHECK(report.plan.overall == memscale::core::rule_id::low_pressure_skip);  // a small model on a big host
    CHECK(test::slot_identity(*seq) == slots);
    CHECK_THAT(report.str(), Catch::Contains("R1 low-pressure-skip"));
  }
  {
    auto guard = memscale::optimize(seq, x, test::quiet({.force_optimize = true}));
    const auto report = guard.report();
    CHECK(report.plan.overall == memscale::core::rule_id::checkpoint_segment);
    // Nothing presses on this host: forced Balanced takes the light touch, not nothing.
    CHECK(report.checkpointed_segments() > 0);
    CHECK(report.planned_peak_bytes() < report.baseline_peak_bytes());
    CHECK_THAT(report.str(), Catch::Contains("force_optimize with nothing pressing"));
  }
}

TEST_CASE("clone() under a guard says what to do instead, and works again once the guard ends", "[api]") {
  // LibTorch's Sequential::clone() clones slot by slot, and memscale's wrappers
  // stand in the slots while the guard lives: LibTorch's own message named only
  // the wrapper's type.
  torch::manual_seed(21);
  auto seq = test::flat_chain(4);
  const auto x = torch::randn({8, 32, 64});
  const auto slots = test::slot_identity(*seq);
  {
    auto guard = memscale::optimize(seq, x, test::quiet({.force_optimize = true}));
    REQUIRE(guard.report().checkpointed_segments() > 0);
    // The first wrapper in slot order: a CheckpointSegment, or an OffloadSegment
    // where the plan offloads a unit before it (CI's run).
    CHECK_THROWS_WITH(seq->clone(), Catch::Contains("clone the model before or after") &&
                                        Catch::Contains("clone() reached memscale::"));
    seq->forward(x).pow(2).mean().backward();  // the model trains on
  }
  CHECK(test::slot_identity(*seq) == slots);
  const auto copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq->clone());
  REQUIRE(copy != nullptr);
  torch::manual_seed(22);
  const auto from_copy = copy->forward(x);
  torch::manual_seed(22);  // the same Dropout masks
  CHECK(test::bit_equal(from_copy, seq->forward(x)));
}

TEST_CASE("verify_correctness allows a module several slots use its summation order under checkpoints", "[api]") {
  // A Linear in three slots: its gradient's parts sum in the order backward
  // reaches them, which a recompute can change (4e-8 relative measured in CI's
  // property run, where verify_correctness refused the plan as a mismatch).
  torch::manual_seed(23);
  torch::nn::Linear shared(32, 32);
  torch::nn::Sequential with_shared;
  for (int i = 0; i < 3; ++i) {
    with_shared->push_back(shared);
    with_shared->push_back(torch::nn::Tanh());
    with_shared->push_back(torch::nn::Linear(32, 32));
    with_shared->push_back(torch::nn::GELU());
  }
  auto plain = test::flat_chain(3, 32, 64);
  const auto x = torch::randn({16, 32});
  const auto config = test::quiet({.mode = OptimizationMode::Aggressive, .enable_offloading = false,
                                   .force_optimize = true, .verify_correctness = true});
  for (auto* model : {&with_shared, &plain}) {
    const bool shares = model == &with_shared;
    INFO((shares ? "a Linear in three slots" : "the flat chain"));
    auto guard = memscale::optimize(*model, shares ? x : torch::randn({16, 8, 32}), config);
    const auto report = guard.report();
    REQUIRE(report.checkpointed_segments() > 0);
    REQUIRE(report.verification.has_value());
    CHECK(report.verification->passed);
    CHECK(report.verification->tolerance == (shares ? 1e-5 : 0.0));
    if (shares) CHECK_THAT(report.verification->tolerance_reason, Catch::Contains("several slots use"));
  }
}

TEST_CASE("where the optimal schedule replaces the greedy segments, the report says so", "[api][engine]") {
  // The acceptance chain under the light touch and a range of budgets: the
  // override depends on the measured slot times, so each case checks that the
  // plan, its R11 lines and the note agree, and that the plan keeps its budget.
  auto seq = test::flat_chain(4);
  auto x = torch::randn({8, 32, 64});
  const auto slots = test::slot_identity(*seq);
  std::int64_t baseline = 0;
  {
    auto guard = memscale::optimize(seq, x, test::quiet({.mode = OptimizationMode::Conservative}));
    baseline = guard.report().baseline_peak_bytes();
  }
  int overridden = 0;
  for (double fraction : {0.0, 0.5, 0.6, 0.7, 0.8}) {
    Config config = test::quiet({.force_optimize = true});
    if (fraction > 0) {
      config.memory_budget_gb = fraction * static_cast<double>(baseline) / (1024.0 * 1024.0 * 1024.0);
      config.target_gpu_utilization = 1.0;
    }
    auto guard = memscale::optimize(seq, x, config);
    const auto report = guard.report();
    const auto text = report.str();
    INFO("budget fraction " << fraction << "\n" << text);
    const bool r11 = text.find("R11 optimal-schedule") != std::string::npos;
    const bool note = text.find("the optimal schedule (R11") != std::string::npos;
    CHECK(r11 == !report.plan.overrides.empty());
    CHECK(note == !report.plan.overrides.empty());
    for (const auto& o : report.plan.overrides) {
      ++overridden;
      CHECK(o.optimal_seconds < o.greedy_seconds);
      CHECK(o.optimal_peak <= o.budget);
      CHECK(report.planned_peak_bytes() <= o.budget);
    }
  }
  CHECK(test::slot_identity(*seq) == slots);
  WARN(overridden << " of 5 plans of the acceptance chain re-planned by the optimal schedule");
}

TEST_CASE("the report explains the plan line by line", "[api]") {
  gpt::register_memscale_rule();
  gpt::GPT model(test::small_gpt());
  auto tokens = torch::randint(256, {2, 64}, torch::kLong);
  auto guard = memscale::optimize(model, tokens, test::quiet({.mode = OptimizationMode::Aggressive}));
  const auto text = guard.report().str();
  CHECK_THAT(text, Catch::Contains("host:"));
  CHECK_THAT(text, Catch::Contains("pressure"));
  // The blocks call their halves through memscale::forward: the Report says
  // which level it planned, with both levels' figures, and names its units.
  CHECK_THAT(text, Catch::Contains("call sites: the calls nest; planned at depth "));
  CHECK_THAT(text, Catch::Contains("the 4 unit(s) at depth 0: projected peak"));
  CHECK_THAT(text, Catch::Contains("the 8 at depth 1: "));
  if (text.find("planned at depth 0") != std::string::npos) {
    CHECK_THAT(text, Catch::Contains("chain 'memscale::forward call sites blocks.0 .. blocks.3'"));
    CHECK_THAT(text, Catch::Contains("blocks.2 (TransformerBlock)"));
  } else {
    CHECK_THAT(text, Catch::Contains("chain 'memscale::forward call sites blocks.0.attn .. blocks.3.mlp'"));
    CHECK_THAT(text, Catch::Contains("blocks.2.attn (Attention)"));
    CHECK_THAT(text, Catch::Contains("blocks.2.mlp (MLP)"));
  }
  CHECK_THAT(text, Catch::Contains("R4 checkpoint-segment"));
  // Nothing offloaded here: every tensor the blocks keep is below min_offload_kb.
  CHECK_THAT(text, Catch::Contains("0 offloaded unit(s) moving 0 B per step"));
}

namespace {
/// BatchNorm and Dropout both inside and outside the chain: a wrap that touched
/// buffers or drew random numbers would show.
struct StatefulImpl : torch::nn::Module {
  StatefulImpl() {
    pre = register_module("pre", torch::nn::BatchNorm1d(64));
    chain = register_module("chain", torch::nn::Sequential(torch::nn::Linear(64, 64), torch::nn::BatchNorm1d(64),
                                                           torch::nn::Dropout(0.3), torch::nn::Linear(64, 64),
                                                           torch::nn::GELU(), torch::nn::Linear(64, 64)));
    post = register_module("post", torch::nn::Dropout(0.3));
  }
  torch::Tensor forward(torch::Tensor x) { return post(chain->forward(pre(x))); }
  torch::nn::BatchNorm1d pre{nullptr};
  torch::nn::Sequential chain{nullptr};
  torch::nn::Dropout post{nullptr};
};
TORCH_MODULE(Stateful);

}  // namespace

TEST_CASE("wrap leaves buffers and the RNG stream as they were, when it fails and when it succeeds",
          "[api][executor]") {
  using memscale::detail::pipeline_stage;
  for (auto stage : {pipeline_stage::none, pipeline_stage::capture, pipeline_stage::profile, pipeline_stage::plan,
                     pipeline_stage::apply, pipeline_stage::commit}) {
    INFO("stage " << memscale::detail::stage_name(stage));
    torch::manual_seed(9);
    Stateful model;
    auto x = torch::randn({32, 64});
    const auto buffers = test::buffer_values(*model);
    torch::manual_seed(10);
    const auto expected_draw = torch::rand({5});
    torch::manual_seed(10);
    {
      memscale::detail::inject_fault fault(stage);
      if (stage == pipeline_stage::none) {
        CHECK_NOTHROW(memscale::wrap(model, x, test::quiet({.mode = OptimizationMode::Aggressive})));
      } else {
        CHECK_THROWS_AS(memscale::wrap(model, x, test::quiet({.mode = OptimizationMode::Aggressive})),
                        memscale::Error);
      }
    }
    CHECK(test::bit_equal(torch::rand({5}), expected_draw));
    CHECK(test::bit_equal(test::buffer_values(*model), buffers));
    memscale::detach(model);
  }
}

TEST_CASE("an old guard does not detach a newer attachment of the same model", "[api]") {
  auto seq = test::flat_chain(2);
  auto x = torch::randn({4, 64});
  const auto cfg = test::quiet({.mode = OptimizationMode::Aggressive});
  auto old_guard = memscale::optimize(seq, x, cfg);
  CHECK(memscale::detach(seq));
  auto new_guard = memscale::optimize(seq, x, cfg);
  CHECK_FALSE(old_guard.active());
  old_guard.release();
  CHECK(memscale::is_optimized(seq));
  CHECK(new_guard.active());
}

TEST_CASE("planning waits for a training call with gradients", "[api][executor]") {
  auto seq = test::flat_chain(3);
  auto x = torch::randn({8, 64});
  auto guard = memscale::optimize(seq, test::quiet({.mode = OptimizationMode::Aggressive}));
  {
    torch::NoGradGuard no_grad;
    seq->forward(x);
  }
  {
    c10::InferenceMode inference;
    seq->forward(x);
  }
  seq->eval();
  seq->forward(x);
  CHECK_FALSE(guard.report().planned);
  seq->train();
  seq->forward(x).sum().backward();
  const auto report = guard.report();
  CHECK(report.planned);
  CHECK(report.checkpointed_segments() > 0);
}

TEST_CASE("a first slot that does not take one Tensor gets UnsupportedModelError", "[api]") {
  struct TwoInputsImpl : torch::nn::Module {
    torch::Tensor forward(torch::Tensor a, torch::Tensor b) { return a + b; }
  };
  struct CallsWithTwoImpl : torch::nn::Module {
    CallsWithTwoImpl() {
      seq = register_module("seq", torch::nn::Sequential(torch::nn::AnyModule(std::make_shared<TwoInputsImpl>()),
                                                         torch::nn::Linear(4, 4)));
    }
    torch::Tensor forward(torch::Tensor x) { return seq->forward(x, x); }
    torch::nn::Sequential seq{nullptr};
  };
  auto model = std::make_shared<CallsWithTwoImpl>();
  auto x = torch::randn({2, 4});
  const auto slots = test::slot_identity(*model->seq);
  auto call = [&] { return model->forward(x); };
  CHECK_NOTHROW(call());
  std::function<void()> forward = [&] { (void)call(); };
  memscale::core::technique_set techniques;
  techniques.checkpoint = &memscale::Checkpoint::wrap;
  CHECK_THROWS_AS(memscale::core::attach(model, test::quiet(), techniques, forward), memscale::UnsupportedModelError);
  CHECK(test::slot_identity(*model->seq) == slots);
  CHECK_FALSE(memscale::is_optimized(model));
}

TEST_CASE("a budget checkpointing cannot meet is reported, and the plan still does its best", "[api][engine]") {
  auto seq = test::flat_chain(3);
  auto x = torch::randn({8, 64});
  memscale::Config cfg = test::quiet({.mode = OptimizationMode::Balanced});
  cfg.memory_budget_gb = 1e-6;  // about 1 KiB: less than the parameters
  auto guard = memscale::optimize(seq, x, cfg);
  const auto report = guard.report();
  CHECK(report.checkpointed_segments() > 0);
  CHECK(report.planned_peak_bytes() < report.baseline_peak_bytes());
  // Over the usable bytes, whatever the rule that ended the plan: said, with what would fit.
  CHECK_THAT(report.str(), Catch::Contains(memscale::core::unreachable_budget_note));
  CHECK_THAT(report.str(), Catch::Contains("(Aggressive plans for the least memory)"));
  guard.release();
  cfg.mode = OptimizationMode::Aggressive;
  const auto aggressive = memscale::optimize(seq, x, cfg).report().str();
  CHECK_THAT(aggressive, Catch::Contains(memscale::core::unreachable_budget_note));
  CHECK_THAT(aggressive, !Catch::Contains("Aggressive plans"));
}

namespace {
struct TwoChainsImpl : torch::nn::Module {
  TwoChainsImpl() {
    first = register_module("first", test::flat_chain(2));
    second = register_module("second", test::flat_chain(2));
  }
  torch::Tensor forward(torch::Tensor x) { return second->forward(torch::tanh(first->forward(x))); }
  torch::nn::Sequential first{nullptr}, second{nullptr};
};
TORCH_MODULE(TwoChains);
}  // namespace

TEST_CASE("several chains planned at their first calls: each sees the earlier ones once", "[api][executor]") {
  torch::manual_seed(15);
  TwoChains reference;
  torch::manual_seed(15);
  TwoChains model;
  auto x = torch::randn({16, 64}, torch::requires_grad());
  auto guard = memscale::optimize(model, test::quiet({.mode = OptimizationMode::Aggressive}));
  const auto expected = test::step(*reference, [&] { return reference->forward(x).pow(2).sum(); });
  const auto got = test::step(*model, [&] { return model->forward(x).pow(2).sum(); });
  CHECK(test::bit_equal(expected.first, got.first));
  CHECK(test::bit_equal(expected.second, got.second));
  const auto report = guard.report();
  REQUIRE(report.chains.size() == 2);
  CHECK(report.chains[0].path == "first");
  CHECK(report.chains[1].path == "second");
  // While 'second' was planned, 'first' kept exactly its planned forward bytes.
  CHECK(report.earlier_chains_bytes ==
        memscale::core::project_chain(report.chains[0].slots, report.plan.units[0]).forward_end);
  CHECK(report.checkpointed_segments() >= 2);
}

namespace {
/// A GPT with gradients already there (a user's model mid-training).
gpt::GPT gpt_with_gradients(const torch::Tensor& tokens) {
  torch::manual_seed(21);
  gpt::GPT model(test::small_gpt());
  model->forward(tokens).square().mean().backward();
  return model;
}
}  // namespace

TEST_CASE("verify_correctness: one example step with and without the plan, bit-identical, state kept",
          "[api][verify]") {
  SECTION("a GPT looped with memscale::forward (Dropout, checkpointed call sites)") {
    const auto tokens = torch::randint(256, {4, 64}, torch::kLong);
    auto model = gpt_with_gradients(tokens);
    const test::model_state before(*model);
    auto guard = memscale::optimize(
        model, tokens, test::quiet({.mode = OptimizationMode::Aggressive, .verify_correctness = true}));
    const auto report = guard.report();
    REQUIRE(report.checkpointed_segments() > 0);
    REQUIRE(report.verification.has_value());
    const auto& check = *report.verification;
    INFO(report);
    CHECK(check.passed);
    CHECK(check.tolerance == 0.0);
    CHECK(check.max_relative_difference == 0.0);
    CHECK(check.parameters == static_cast<int>(model->parameters().size()));
    CHECK(check.loss_baseline == check.loss_optimized);
    CHECK_THAT(report.str(), Catch::Contains("verified: loss, ") && Catch::Contains("bit-identical"));
    std::ostringstream line;
    line << check;
    CHECK(line.str() == check.str());
    CHECK(test::model_state(*model) == before);
  }
  SECTION("a Sequential with BatchNorm and Dropout, checkpointed and offloaded") {
    torch::manual_seed(9);
    Stateful model;
    const auto x = torch::randn({32, 64});
    model->forward(x).sum().backward();
    const test::model_state before(*model);
    auto guard = memscale::optimize(model, x,
                                    test::quiet({.mode = OptimizationMode::Aggressive, .force_optimize = true,
                                                 .verify_correctness = true}));
    const auto report = guard.report();
    INFO(report);
    REQUIRE(report.checkpointed_segments() + report.offloaded_units() > 0);
    REQUIRE(report.verification.has_value());
    CHECK(report.verification->passed);
    CHECK(report.verification->buffers == static_cast<int>(model->buffers().size()));
    CHECK(report.verification->max_relative_difference == 0.0);
    CHECK(test::model_state(*model) == before);
  }
}

TEST_CASE("verify_correctness catches a wrong technique and leaves the model unoptimized and unchanged",
          "[api][verify]") {
  using memscale::detail::technique_fault;
  const auto fault = GENERATE(technique_fault::checkpoint_skips_rng_restore, technique_fault::checkpoint_recompute_scaled);
  INFO("fault " << static_cast<int>(fault));
  const auto tokens = torch::randint(256, {4, 64}, torch::kLong);
  auto model = gpt_with_gradients(tokens);
  const test::model_state before(*model);
  const auto identity = test::parameter_identity(*model);
  const auto config = test::quiet({.mode = OptimizationMode::Aggressive, .verify_correctness = true});
  {
    memscale::detail::inject_fault wrong(fault);
    try {
      (void)memscale::wrap(model, tokens, config);
      FAIL("verify_correctness accepted a wrong checkpoint");
    } catch (const memscale::CorrectnessError& e) {
      CHECK_THAT(e.what_differs(), Catch::StartsWith("parameter '"));
      CHECK_THAT(e.what(), Catch::Contains(e.what_differs()) && Catch::Contains("bit-identity required") &&
                               Catch::Contains("left unoptimized and unchanged"));
    }
  }
  CHECK_FALSE(memscale::is_optimized(model));
  CHECK(test::parameter_identity(*model) == identity);
  CHECK(test::model_state(*model) == before);
  // Without the fault the same wrap verifies and applies.
  auto guard = memscale::optimize(model, tokens, config);
  REQUIRE(guard.report().verification.has_value());
  CHECK(guard.report().verification->passed);
}

TEST_CASE("verify_correctness allows a stated tolerance under tiling", "[api][verify]") {
  // Linear and GELU only: row-independent (tileable), and LibTorch 1.13's CPU
  // autocast takes them (not LayerNorm).
  torch::manual_seed(3);
  torch::nn::Sequential seq;
  for (int i = 0; i < 3; ++i) {
    seq->push_back(torch::nn::Linear(64, 256));
    seq->push_back(torch::nn::GELU());
    seq->push_back(torch::nn::Linear(256, 64));
  }
  const auto x = torch::randn({8, 128, 64});
  Config config = test::quiet({.mode = OptimizationMode::Aggressive, .force_optimize = true,
                               .verify_correctness = true});
  const std::string reason = "tiling";
  config.enable_tiling = true;
  auto guard = memscale::optimize(seq, x, config);
  const auto report = guard.report();
  INFO(report);
  if (test::under_address_sanitizer && report.tiled_segments() == 0) {
    WARN("AddressSanitizer slowed the measured times the tiling choice rests on: no tiled plan to verify");
    return;
  }
  REQUIRE(report.tiled_segments() > 0);
  REQUIRE(report.verification.has_value());
  const auto& check = *report.verification;
  CHECK(check.passed);
  CHECK(check.tolerance > 0.0);
  CHECK_THAT(check.tolerance_reason, Catch::Contains(reason));
  CHECK(check.max_relative_difference <= check.tolerance);
  WARN(reason << ": largest relative difference " << check.max_relative_difference << " at " << check.largest_at);
}

namespace {

/// Conv2d, BatchNorm2d, ReLU and Dropout(p): one slot of conv_bn_net.
struct ConvBlockImpl : torch::nn::Module {
  ConvBlockImpl(std::int64_t in, double p)
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, 8, 3).padding(1)))),
        bn(register_module("bn", torch::nn::BatchNorm2d(8))),
        drop(register_module("drop", torch::nn::Dropout(p))) {}
  torch::Tensor forward(torch::Tensor x) { return drop(torch::relu(bn(conv(x)))); }
  torch::nn::Conv2d conv;
  torch::nn::BatchNorm2d bn;
  torch::nn::Dropout drop;
};
TORCH_MODULE(ConvBlock);

/// Two ConvBlocks and a Linear head: a convolution's bias before BatchNorm
/// has a gradient of about 0, whose bfloat16 rounding differs from float32's
/// by orders of magnitude (relative L2 1.7e4 measured). With `dropout` each
/// block draws a mask, so that whatever block the plan checkpoints draws
/// random numbers.
torch::nn::Sequential conv_bn_net(bool dropout = false) {
  torch::manual_seed(0);
  const double p = dropout ? 0.3 : 0.0;
  return torch::nn::Sequential(ConvBlock(3, p), ConvBlock(8, p), torch::nn::Flatten(),
                               torch::nn::Linear(8 * 8 * 8, 10));
}

}  // namespace

TEST_CASE("verify_correctness under mixed precision holds the plan to the same layers under autocast, bit for bit",
          "[api][verify]") {
  // Against float32 (a tolerance of 5e-2) every one of 40 such CNNs was refused.
  const auto x = torch::randn({4, 3, 8, 8});
  Config config = test::quiet({.mode = OptimizationMode::Aggressive, .force_optimize = true,
                               .verify_correctness = true});
  config.use_mixed_precision = true;
  SECTION("a CNN with BatchNorm, checkpointed") {
    auto model = conv_bn_net();
    const test::model_state before(*model);
    auto guard = memscale::optimize(model, x, config);
    const auto report = guard.report();
    INFO(report);
    REQUIRE(report.checkpointed_segments() > 0);
    REQUIRE(report.verification.has_value());
    const auto& check = *report.verification;
    CHECK(check.passed);
    CHECK(check.tolerance == 0.0);
    CHECK(check.max_relative_difference == 0.0);
    CHECK(check.loss_baseline == check.loss_optimized);
    CHECK_THAT(check.tolerance_reason, Catch::Contains("under autocast"));
    CHECK(check.buffers == static_cast<int>(model->buffers().size()));
    CHECK(test::model_state(*model) == before);
  }
  SECTION("a wrong checkpoint is still caught") {
    // Other Dropout masks in the recompute. (The other planted fault, outputs
    // off by 2^-20, is below bfloat16's resolution: the next layer's cast
    // rounds it away, and the step is the same.)
    using memscale::detail::technique_fault;
    const auto fault = technique_fault::checkpoint_skips_rng_restore;
    auto model = conv_bn_net(/*dropout=*/true);
    const test::model_state before(*model);
    {
      // The same wrap without the fault checkpoints a block (the planned units
      // depend on measured times; each block draws a Dropout mask): 10 of 10
      // measured, and 10 of 10 faults caught.
      auto guard = memscale::optimize(model, x, config);
      const auto report = guard.report();
      INFO(report);
      REQUIRE_FALSE(report.plan.units.empty());
      const auto& units = report.plan.units.front();
      if (std::none_of(units.begin(), units.end(), [](const auto& u) { return u.checkpointed && u.first <= 1; })) {
        WARN("this plan checkpoints no block (measured times decide): no Dropout to recompute wrongly");
        return;
      }
    }
    {
      memscale::detail::inject_fault wrong(fault);
      try {
        (void)memscale::wrap(model, x, config);
        FAIL("verify_correctness accepted a wrong checkpoint under mixed precision");
      } catch (const memscale::CorrectnessError& e) {
        CHECK_THAT(e.what(), Catch::Contains("bit-identity required") && Catch::Contains("under autocast"));
      }
    }
    CHECK_FALSE(memscale::is_optimized(model));
    CHECK(test::model_state(*model) == before);
  }
}

TEST_CASE("verify_correctness needs an example input and a Tensor -> Tensor forward", "[api][verify][config]") {
  auto seq = test::flat_chain(1);
  const auto slots = test::slot_identity(*seq);
  try {
    (void)memscale::wrap(seq, test::quiet({.verify_correctness = true}));
    FAIL("a lazy wrap accepted verify_correctness");
  } catch (const memscale::ConfigError& e) {
    CHECK(e.field() == "verify_correctness");
    CHECK_THAT(e.what(), Catch::Contains("example input"));
  }
  CHECK_FALSE(memscale::is_optimized(seq));
  CHECK(test::slot_identity(*seq) == slots);
}

TEST_CASE("an example forward that runs out of memory throws that, not an unsupported-model error", "[api]") {
  memscale::memory_tracker::install();
  torch::manual_seed(0);
  auto model = test::flat_chain(2, 64, 256);
  const auto x = torch::randn({4096, 64});  // each hidden activation 4 MiB
  const auto before = test::parameter_identity(*model);
  {
    memscale::memory_tracker::hard_limit_scope limit(memscale::memory_tracker::current_bytes() + (1 << 20));
    CHECK_THROWS_AS(memscale::wrap(model, x, test::quiet()), c10::OutOfMemoryError);
  }
  CHECK_FALSE(memscale::is_optimized(model));
  CHECK(test::parameter_identity(*model) == before);
}

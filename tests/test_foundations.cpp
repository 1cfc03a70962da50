// Foundations that later features build on: gradients that flow through
// autograd (every hook fires as without memscale), double backward, the
// executor's slot swaps under failure and while a forward runs, saved-tensor
// hook scopes, and planning when the hooks engine is not LibTorch's default.
#include <thread>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>

#include "test_support.hpp"

using memscale::OptimizationMode;

namespace {

/// A block that reads a weight registered elsewhere (a tied weight).
struct UsesSharedImpl : torch::nn::Module {
  UsesSharedImpl(torch::Tensor w, std::int64_t width) : shared(std::move(w)) {
    fc = register_module("fc", torch::nn::Linear(width, width));
  }
  torch::Tensor forward(torch::Tensor x) { return torch::tanh(fc->forward(x) + torch::matmul(x, shared)); }
  torch::Tensor shared;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(UsesShared);

/// A chain of blocks that all read the root's `tied` weight.
struct TiedNetImpl : torch::nn::Module {
  explicit TiedNetImpl(std::int64_t width = 32, int blocks = 6) {
    tied = register_parameter("tied", torch::randn({width, width}) * 0.1);
    for (int i = 0; i < blocks; ++i) chain->push_back(UsesShared(tied, width));
    register_module("chain", chain);
  }
  torch::Tensor forward(torch::Tensor x) { return chain->forward(x); }
  torch::Tensor tied;
  torch::nn::Sequential chain;
};
TORCH_MODULE(TiedNet);

/// Counts what c10d's Reducer relies on: post hooks on a gradient accumulator.
struct counting_post_hook final : torch::autograd::FunctionPostHook {
  explicit counting_post_hook(int* count) : count_(count) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    ++*count_;
    return outputs;
  }
  int* count_;
};

/// Per parameter: tensor-hook calls, accumulator post-hook calls, and the gradient.
struct hook_counts {
  std::vector<int> tensor_hooks, post_hooks;
  std::vector<torch::Tensor> grads;
};

/// Registers both kinds of hooks on every parameter, runs `steps` backward
/// passes of `loss()`, and returns what the hooks saw.
template <class Loss>
hook_counts count_hooks(torch::nn::Module& model, Loss&& loss, int steps = 2) {
  auto params = model.parameters();
  hook_counts counts;
  counts.tensor_hooks.assign(params.size(), 0);
  counts.post_hooks.assign(params.size(), 0);
  std::vector<unsigned> handles;
  for (std::size_t i = 0; i < params.size(); ++i) {
    handles.push_back(params[i].register_hook([&counts, i](const torch::Tensor& g) {
      ++counts.tensor_hooks[i];
      return g;
    }));
    torch::autograd::impl::grad_accumulator(params[i])->add_post_hook(
        std::make_unique<counting_post_hook>(&counts.post_hooks[i]));
  }
  test::clear_grads(model);
  for (int s = 0; s < steps; ++s) loss().backward();
  counts.grads = test::grads_of(model);
  for (std::size_t i = 0; i < params.size(); ++i) params[i].remove_hook(handles[i]);
  return counts;
}

}  // namespace

// --- gradients flow through autograd ------------------------------------------------

TEST_CASE("checkpointed segments accumulate every gradient through autograd: hooks fire as without memscale",
          "[foundations][checkpoint][hooks]") {
  torch::manual_seed(11);
  TiedNet plain, model;
  {
    torch::NoGradGuard copy;
    for (std::size_t i = 0; i < plain->parameters().size(); ++i)
      model->parameters()[i].copy_(plain->parameters()[i]);
  }
  const auto x = torch::randn({16, 32});

  const auto expected = count_hooks(*plain, [&] { return plain->forward(x).pow(2).mean(); });
  auto guard = memscale::optimize(model, x, test::quiet({.mode = OptimizationMode::Aggressive}));
  REQUIRE(guard.report().checkpointed_segments() > 0);
  const auto got = count_hooks(*model, [&] { return model->forward(x).pow(2).mean(); });

  CHECK(got.tensor_hooks == expected.tensor_hooks);
  CHECK(got.post_hooks == expected.post_hooks);
  CHECK(expected.tensor_hooks.front() == 2);  // `tied`: once per backward, although every block reads it
  // Each block's own weights: bit-identical. `tied` sums six blocks' parts, and a
  // segment of several blocks adds its parts before autograd adds the segments:
  // equal up to the order of a floating-point sum.
  CHECK(test::relative_difference(got.grads.front(), expected.grads.front()) <= 1e-6);
  CHECK(test::bit_equal(std::vector<torch::Tensor>(got.grads.begin() + 1, got.grads.end()),
                        std::vector<torch::Tensor>(expected.grads.begin() + 1, expected.grads.end())));
}

TEST_CASE("a gradient-modifying tensor hook applies once through checkpoint and tile, as without memscale",
          "[foundations][checkpoint][tile][hooks]") {
  torch::manual_seed(15);
  torch::nn::Linear fc(16, 16);
  const auto x = torch::randn({8, 16});
  auto halved_grad = [&](const std::function<torch::Tensor(const torch::Tensor&)>& f) {
    auto handle = fc->weight.register_hook([](const torch::Tensor& g) { return g * 0.5; });
    fc->weight.mutable_grad() = torch::Tensor();
    f(x).pow(2).sum().backward();
    fc->weight.remove_hook(handle);
    return fc->weight.grad().clone();
  };
  const auto expected = halved_grad([&](const torch::Tensor& t) { return fc->forward(t); });
  memscale::CheckpointSegmentImpl checkpointed({torch::nn::AnyModule(fc)});
  memscale::TileSegmentImpl tiled({torch::nn::AnyModule(fc)}, 4, 0);
  CHECK(test::bit_equal(halved_grad([&](const torch::Tensor& t) { return checkpointed.forward(t); }), expected));
  // Summed tile by tile: float32 rounding apart (1.3e-7 relative measured).
  CHECK(test::relative_difference(halved_grad([&](const torch::Tensor& t) { return tiled.forward(t); }), expected) <=
        1e-6);
}

TEST_CASE("a tiled segment accumulates a weight it reads but does not own through autograd",
          "[foundations][tile][hooks]") {
  torch::manual_seed(12);
  auto tied = torch::randn({16, 16}, torch::requires_grad());
  auto block = UsesShared(tied, 16);
  struct holder : torch::nn::Module {
    holder(torch::Tensor t, UsesShared b) {
      register_parameter("tied", std::move(t));
      register_module("block", std::move(b));
    }
  } owner(tied, block);
  const auto x = torch::randn({12, 16});
  const auto expected = count_hooks(owner, [&] { return block->forward(x).pow(2).sum(); });
  memscale::TileSegmentImpl segment({torch::nn::AnyModule(block)}, 4, 0);
  const auto got = count_hooks(owner, [&] { return segment.forward(x).pow(2).sum(); });
  CHECK(got.tensor_hooks == expected.tensor_hooks);
  CHECK(got.post_hooks == expected.post_hooks);
  REQUIRE(got.grads.size() == expected.grads.size());
  for (std::size_t i = 0; i < got.grads.size(); ++i)
    CHECK(test::relative_difference(got.grads[i], expected.grads[i]) <= 1e-6);
}

TEST_CASE("checkpoint() refuses to write the gradient of a tensor its function reads but was not given",
          "[foundations][checkpoint]") {
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto x = torch::randn({4, 8}, torch::requires_grad());
  auto y = memscale::checkpoint([&](const torch::Tensor& t) { return torch::tanh(t.matmul(w)); }, x, {});
  try {
    y.sum().backward();
    FAIL("backward accepted a weight missing from params");
  } catch (const std::exception& e) {
    CHECK_THAT(e.what(), Catch::Contains("not passed in `params`"));
  }
  CHECK_FALSE(w.grad().defined());  // nothing written behind autograd's back
  // Listed, it flows.
  x.mutable_grad() = torch::Tensor();
  memscale::checkpoint([&](const torch::Tensor& t) { return torch::tanh(t.matmul(w)); }, x, {w}).sum().backward();
  CHECK(w.grad().defined());
}

TEST_CASE("a segment that reads a tensor computed before it runs unoptimized, with the baseline's gradients",
          "[foundations][checkpoint][tile]") {
  // An attention-style bias built from a parameter outside the segment and read inside it.
  struct UsesBiasImpl : torch::nn::Module {
    explicit UsesBiasImpl(torch::Tensor* b) : bias(b) { fc = register_module("fc", torch::nn::Linear(16, 16)); }
    torch::Tensor forward(torch::Tensor x) { return torch::tanh(fc->forward(x) + *bias); }
    torch::Tensor* bias;
    torch::nn::Linear fc{nullptr};
  };
  torch::manual_seed(16);
  auto p = torch::randn({16}, torch::requires_grad());
  torch::Tensor bias;
  auto block = std::make_shared<UsesBiasImpl>(&bias);
  const auto x = torch::randn({8, 16});
  auto grads = [&](const std::function<torch::Tensor(const torch::Tensor&)>& f) {
    p.mutable_grad() = torch::Tensor();
    block->zero_grad();
    bias = p * 2;  // computed before the segment, read by it and by the loss
    (f(x).pow(2).sum() + bias.sum()).backward();
    return std::make_pair(p.grad().clone(), block->fc->weight.grad().clone());
  };
  const auto expected = grads([&](const torch::Tensor& t) { return block->forward(t); });
  memscale::CheckpointSegmentImpl checkpointed({torch::nn::AnyModule(block)});
  memscale::TileSegmentImpl tiled({torch::nn::AnyModule(block)}, 4, 0);
  for (int step = 0; step < 2; ++step) {
    const auto c = grads([&](const torch::Tensor& t) { return checkpointed.forward(t); });
    CHECK(test::bit_equal(c.first, expected.first));
    CHECK(test::bit_equal(c.second, expected.second));
    const auto t = grads([&](const torch::Tensor& in) { return tiled.forward(in); });
    CHECK(test::bit_equal(t.first, expected.first));
    CHECK(test::bit_equal(t.second, expected.second));
  }
}

// --- double backward ------------------------------------------------------------------

TEST_CASE("a checkpointed segment supports create_graph: a gradient penalty matches the baseline",
          "[foundations][checkpoint]") {
  auto make = [] {
    torch::manual_seed(13);
    return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::Tanh(), torch::nn::Linear(32, 16),
                                 torch::nn::Tanh());
  };
  auto plain = make(), wrapped = make();
  const auto input = torch::randn({8, 16});
  auto penalty_step = [&](torch::nn::Module& owner, const std::function<torch::Tensor(torch::Tensor)>& f) {
    test::clear_grads(owner);
    auto x = input.clone().requires_grad_(true);
    auto y = f(x).pow(2).sum();
    auto g = torch::autograd::grad({y}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    (y + g.pow(2).sum()).backward();
    return std::make_pair(test::grads_of(owner), x.grad().clone());
  };
  const auto expected = penalty_step(*plain, [&](torch::Tensor x) { return plain->forward(x); });
  memscale::CheckpointSegmentImpl segment(std::vector<torch::nn::AnyModule>(wrapped->begin(), wrapped->end()));
  const auto got = penalty_step(*wrapped, [&](torch::Tensor x) { return segment.forward(x); });
  // Second-order kernels may sum in another order: equal to float rounding.
  REQUIRE(got.first.size() == expected.first.size());
  for (std::size_t i = 0; i < got.first.size(); ++i) {
    REQUIRE(got.first[i].defined());
    INFO("parameter " << i << ": max |difference| " << (got.first[i] - expected.first[i]).abs().max().item<double>()
                      << ", max |gradient| " << expected.first[i].abs().max().item<double>());
    CHECK(torch::allclose(got.first[i], expected.first[i], 1e-4, 1e-6));
  }
  CHECK(torch::allclose(got.second, expected.second, 1e-4, 1e-6));
  // Without the penalty term the second-order path is not taken; the test must see it differ.
  CHECK_FALSE(torch::allclose(expected.first[0], [&] {
    test::clear_grads(*plain);
    plain->forward(input).pow(2).sum().backward();
    return plain[0]->as<torch::nn::Linear>()->weight.grad().clone();
  }()));
}

TEST_CASE("a tiled segment rejects create_graph with a clear error", "[foundations][tile]") {
  torch::manual_seed(14);
  torch::nn::Linear fc(16, 16);
  memscale::TileSegmentImpl segment({torch::nn::AnyModule(fc)}, 4, 0);
  auto x = torch::randn({8, 16}, torch::requires_grad());
  auto y = segment.forward(x).pow(2).sum();
  CHECK_THROWS_WITH(torch::autograd::grad({y}, {x}, {}, true, /*create_graph=*/true),
                    Catch::Contains("create_graph") && Catch::Contains("not supported"));
}

// --- the executor's slot swaps ------------------------------------------------------

TEST_CASE("an allocation failure while swapping slots leaves every slot as it was", "[foundations][executor]") {
  auto model = test::flat_chain(3);
  std::vector<const torch::nn::Module*> before;
  for (const auto& slot : *model) before.push_back(slot.ptr().get());
  const auto x = torch::randn({8, 64});
  auto check_unchanged = [&] {
    std::size_t k = 0;
    for (const auto& slot : *model) {
      REQUIRE_FALSE(slot.is_empty());
      CHECK(slot.ptr().get() == before[k++]);
    }
  };
  const auto config = test::quiet({.mode = OptimizationMode::Aggressive});
  // With an example input: one swap while the input is captured (undone), then
  // the plan's swaps. The third swap fails, after the plan has changed a slot.
  {
    memscale::detail::inject_fault fault(memscale::detail::pipeline_stage::reserve, /*passes=*/2);
    CHECK_THROWS_WITH(memscale::wrap(model, x, config), Catch::Contains("reserve"));
  }
  check_unchanged();
  CHECK_FALSE(memscale::is_optimized(model));

  // Lazily planned: the probe goes into slot 0, then the first training forward
  // plans; its second swap fails. The forward throws, the chain is as before
  // wrap() (probe gone too), and the next forward runs unoptimized.
  memscale::wrap(model, config);
  {
    memscale::detail::inject_fault fault(memscale::detail::pipeline_stage::reserve, /*passes=*/1);
    CHECK_THROWS_WITH(model->forward(x), Catch::Contains("reserve"));
  }
  check_unchanged();
  CHECK(model->forward(x).sizes() == x.sizes());
  memscale::detach(model);
  check_unchanged();
}

TEST_CASE("lazy planning keeps the displaced probe alive until its forward returns", "[foundations][executor]") {
  auto model = test::flat_chain(3);
  const auto x = torch::randn({8, 64});
  memscale::wrap(model, test::quiet({.mode = OptimizationMode::Aggressive}));
  auto attached = memscale::core::registry::global().find(model.ptr().get());
  REQUIRE(attached != nullptr);
  REQUIRE(std::dynamic_pointer_cast<memscale::core::PlanningProbeImpl>(model->begin()->ptr()));
  // What PlanningProbe::forward does: planning replaces slot 0 while the probe runs in it.
  torch::nn::AnyModule displaced;
  const auto y = attached->plan_on_first_call(0, x, displaced);
  REQUIRE_FALSE(displaced.is_empty());
  CHECK(std::dynamic_pointer_cast<memscale::core::PlanningProbeImpl>(displaced.ptr()));
  CHECK(model->begin()->ptr() != displaced.ptr());
  CHECK(y.sizes() == x.sizes());
  memscale::detach(model);
}

// --- saved-tensor hook scopes -------------------------------------------------------

TEST_CASE("a saved-tensor hook scope closed out of order fails loudly and leaves no stale hook",
          "[foundations][hooks]") {
  int outer_packs = 0, inner_packs = 0;
  auto count = [](int& n) { return [&n](const at::Tensor& t) { return (++n, t); }; };
  auto same = [](at::Tensor& t) { return t; };
  auto outer = std::make_unique<memscale::offload::saved_tensors_hooks<decltype(count(outer_packs)), decltype(same)>>(
      count(outer_packs), same);
  auto inner = std::make_unique<memscale::offload::saved_tensors_hooks<decltype(count(inner_packs)), decltype(same)>>(
      count(inner_packs), same);
  auto w = torch::randn({4, 4}, torch::requires_grad());
  outer.reset();  // out of order: `inner` is still open
  CHECK_THROWS_WITH(torch::tanh(w).sum(), Catch::Contains("closed while a scope opened after it"));
  // The error is reported once; the remaining scope still works, the closed one is gone.
  const int outer_before = outer_packs;
  (void)torch::tanh(w);
  CHECK(inner_packs > 0);
  CHECK(outer_packs == outer_before);
  inner.reset();
  const int inner_before = inner_packs;
  (void)torch::tanh(w);
  CHECK(inner_packs == inner_before);

  // Closed on another thread: this thread's next save says so, and the hook is gone.
  int elsewhere_packs = 0;
  auto elsewhere =
      std::make_unique<memscale::offload::saved_tensors_hooks<decltype(count(elsewhere_packs)), decltype(same)>>(
          count(elsewhere_packs), same);
  std::thread([&] { elsewhere.reset(); }).join();
  CHECK_THROWS_WITH(torch::tanh(w).sum(), Catch::Contains("closed on another thread"));
  (void)torch::tanh(w);
  CHECK(elsewhere_packs == 0);
}

// --- the hooks engine --------------------------------------------------------------------

TEST_CASE("the hooks engine is installed at load, a plan without it says so and does not offload",
          "[foundations][hooks][offload]") {
  // Installed before main(): no memscale call was needed.
  CHECK(memscale::offload::hooks_engine_active());
  CHECK(memscale::offload::hooks_unavailable_reason(c10::Device(c10::kCPU)).empty());

  // Large enough that offloading a checkpoint's input lowers the projected peak
  // (at 32 rows its 8 KiB did not, and Aggressive planned none).
  auto model = test::flat_chain(4, 64, 256, 0.1);
  const auto x = torch::randn({512, 64});
  memscale::AsyncOffloadConfig disk;
  disk.min_offload_kb = 1;
  const auto config = test::quiet({.mode = OptimizationMode::Aggressive, .async_config = disk});
  {
    auto guard = memscale::optimize(model, x, config);
    REQUIRE(guard.report().offloaded_units() > 0);  // the control: with the engine, Aggressive offloads
  }
  test::before_replacing_the_engine();
  torch::autograd::set_default_engine_stub(&torch::autograd::Engine::get_base_engine);  // another library's doing
  CHECK_THAT(memscale::offload::hooks_unavailable_reason(c10::Device(c10::kCPU)),
             Catch::Contains("not memscale's"));
  {
    auto guard = memscale::optimize(model, x, config);
    const auto report = guard.report();
    CHECK(report.offloaded_units() == 0);
    CHECK(report.checkpointed_segments() > 0);
    CHECK_THAT(report.str(), Catch::Contains("offload disabled") && Catch::Contains("saved-tensor hooks"));
  }
  torch::autograd::set_default_engine_stub(&memscale::offload::detail::hooks_engine::instance);
  CHECK(memscale::offload::hooks_engine_active());
}

// memscale::checkpoint and CheckpointSegment: gradients bit-identical to the
// plain computation on CPU (same kernels, same order), Dropout included.
#include "test_support.hpp"

TEST_CASE("checkpoint(fn, x, params) gives bit-identical loss and gradients with Dropout", "[checkpoint]") {
  torch::manual_seed(1);
  auto seq = test::flat_chain(2, 32, 64, 0.3);
  auto x = torch::randn({8, 16, 32}, torch::requires_grad());
  auto plain = test::step(*seq, [&] { return seq->forward(x).pow(2).mean(); });
  auto x_grad = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  auto checkpointed = test::step(*seq, [&] {
    auto y = memscale::checkpoint([&](const torch::Tensor& t) { return seq->forward(t); }, x, seq->parameters());
    return y.pow(2).mean();
  });
  CHECK(test::bit_equal(plain.first, checkpointed.first));
  CHECK(test::bit_equal(plain.second, checkpointed.second));
  CHECK(test::bit_equal(x_grad, x.grad()));
}

TEST_CASE("checkpoint keeps only its inputs during forward", "[checkpoint][memory]") {
  memscale::memory_tracker::install();
  torch::manual_seed(2);
  auto seq = test::flat_chain(4, 64, 512, 0.1);
  auto x = torch::randn({16, 64, 64}, torch::requires_grad());
  auto kept = [&](bool use_checkpoint) {
    const auto before = memscale::memory_tracker::current_bytes();
    auto y = use_checkpoint ? memscale::checkpoint([&](const torch::Tensor& t) { return seq->forward(t); }, x,
                                                   seq->parameters())
                            : seq->forward(x);
    return memscale::memory_tracker::current_bytes() - before;
  };
  const auto plain = kept(false);
  const auto checkpointed = kept(true);
  const auto output_bytes = 16 * 64 * 64 * 4;
  // The output, the saved CPU RNG state (about 5 KB), and each of the 4 Dropouts'
  // masks, a bit an element, with the generator's state after it (about 5 KB;
  // detail/draw_replay.hpp).
  const auto masks = 4 * (16 * 64 * 64 / 8 + 8 * 1024);
  CHECK(checkpointed <= output_bytes + masks + 16 * 1024);
  CHECK(plain > 10 * output_bytes);
}

TEST_CASE("checkpoint output requires grad when only the parameters do", "[checkpoint]") {
  torch::manual_seed(3);
  torch::nn::Linear lin(8, 8);
  auto x = torch::randn({4, 8});  // no grad: the reentrant-checkpoint pitfall
  auto y = memscale::checkpoint(lin, x);
  REQUIRE(y.requires_grad());
  y.sum().backward();
  auto g = lin->weight.grad().clone();
  lin->weight.mutable_grad() = torch::Tensor();
  lin->forward(x).sum().backward();
  CHECK(test::bit_equal(g, lin->weight.grad()));
}

TEST_CASE("checkpoint without grad mode just runs the function", "[checkpoint]") {
  torch::nn::Linear lin(4, 4);
  torch::NoGradGuard no_grad;
  auto y = memscale::checkpoint(lin, torch::randn({2, 4}));
  CHECK_FALSE(y.requires_grad());
  CHECK(y.grad_fn() == nullptr);
}

TEST_CASE("checkpoint with several inputs routes each gradient", "[checkpoint]") {
  auto a = torch::randn({5, 3}, torch::requires_grad());
  auto b = torch::randn({5, 3}, torch::requires_grad());
  auto f = [](const std::vector<torch::Tensor>& in) {
    return std::vector<torch::Tensor>{in[0] * in[1] + torch::sin(in[0]), in[1].exp()};
  };
  auto plain = f({a, b});
  (plain[0].sum() + plain[1].sum()).backward();
  auto ga = a.grad().clone(), gb = b.grad().clone();
  a.mutable_grad() = torch::Tensor();
  b.mutable_grad() = torch::Tensor();
  auto out = memscale::checkpoint(f, std::vector<torch::Tensor>{a, b});
  (out[0].sum() + out[1].sum()).backward();
  CHECK(test::bit_equal(ga, a.grad()));
  CHECK(test::bit_equal(gb, b.grad()));
}

TEST_CASE("checkpoint backward leaves the RNG stream where the plain step leaves it", "[checkpoint]") {
  torch::nn::Dropout drop(0.5);
  auto x = torch::randn({64}, torch::requires_grad());
  torch::manual_seed(11);
  drop->forward(x).sum().backward();
  const auto next_plain = torch::rand({4});
  torch::manual_seed(11);
  memscale::checkpoint([&](const torch::Tensor& t) { return drop->forward(t); }, x, {}).sum().backward();
  const auto next_checkpointed = torch::rand({4});
  CHECK(test::bit_equal(next_plain, next_checkpointed));
}

TEST_CASE("CheckpointSegment registers nothing and matches its slots", "[checkpoint]") {
  torch::manual_seed(4);
  auto seq = test::flat_chain(1, 16, 32, 0.2);
  std::vector<torch::nn::AnyModule> slots(seq->begin(), seq->end());
  auto segment = std::make_shared<memscale::CheckpointSegmentImpl>(slots);
  CHECK(segment->parameters().empty());
  CHECK(segment->children().empty());
  auto x = torch::randn({3, 16}, torch::requires_grad());
  auto plain = test::step(*seq, [&] { return seq->forward(x).sum(); });
  auto wrapped = test::step(*seq, [&] { return segment->forward(x).sum(); });
  CHECK(test::bit_equal(plain.first, wrapped.first));
  CHECK(test::bit_equal(plain.second, wrapped.second));
}

namespace {
/// Counts a Linear's forward products on this thread while it lives (LibTorch
/// 1.13 runs one on 3-d input as aten::matmul, on 2-d as aten::addmm; their
/// backward runs aten::mm).
struct linear_calls {
  static inline thread_local int count = 0;
  at::CallbackHandle handle;
  linear_calls() {
    count = 0;
    handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          const std::string_view name = fn.name();
          if (name == "aten::matmul" || name == "aten::addmm" || name == "aten::linear") ++count;
          return nullptr;
        }).scopes({at::RecordScope::FUNCTION}));
  }
  ~linear_calls() { at::removeCallback(handle); }
};
}  // namespace

/// Checkpoints runs of `seq`'s slots (each [first, last]) and checks one step's
/// loss, parameter gradients and input gradient bit-identical to the plain
/// Sequential's (`plain`, built the same); returns the Linear products the
/// checkpointed step's backward ran.
int check_runs(torch::nn::Sequential plain, torch::nn::Sequential seq, const torch::Tensor& input,
               const std::vector<std::pair<std::size_t, std::size_t>>& runs) {
  auto x = input.detach().requires_grad_(true);
  const auto expected = test::step(*plain, [&] { return plain->forward(x).abs().sum(); });
  const auto expected_input_grad = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  std::vector<torch::nn::AnyModule> slots;
  for (std::size_t k = 0; k < seq->size();) {
    const auto run = std::find_if(runs.begin(), runs.end(), [k](const auto& r) { return r.first == k; });
    const auto last = run == runs.end() ? k : run->second;
    std::vector<torch::nn::AnyModule> part(seq->begin() + static_cast<std::ptrdiff_t>(k),
                                           seq->begin() + static_cast<std::ptrdiff_t>(last + 1));
    if (run == runs.end()) {
      slots.push_back(part.front());
    } else {
      slots.emplace_back(std::make_shared<memscale::CheckpointSegmentImpl>(std::move(part)));
    }
    k = last + 1;
  }
  int backward_products = 0;
  linear_calls calls;
  const auto got = test::step(*seq, [&] {
    auto h = x;
    for (auto& slot : slots) h = slot.forward(h);
    auto loss = h.abs().sum();
    backward_products = -linear_calls::count;  // test::step runs backward next
    return loss;
  });
  backward_products += linear_calls::count;
  CHECK(test::bit_equal(expected.first, got.first));
  CHECK(test::bit_equal(expected.second, got.second));
  CHECK(test::bit_equal(expected_input_grad, x.grad()));
  return backward_products;
}

TEST_CASE("a checkpointed run ending in a Linear recomputes only up to its input, gradients bit-identical",
          "[checkpoint]") {
  // Runs ending in a Linear with and without a bias, a frozen bias, Dropout's
  // draws and LayerNorm inside, on a 3-d input.
  auto make = [] {
    torch::manual_seed(12);
    torch::nn::Sequential seq(torch::nn::Linear(16, 32), torch::nn::GELU(), torch::nn::Linear(32, 16),
                              torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})), torch::nn::Dropout(0.2),
                              torch::nn::Linear(torch::nn::LinearOptions(16, 8).bias(false)), torch::nn::Tanh(),
                              torch::nn::Linear(8, 4));
    seq[2]->as<torch::nn::Linear>()->bias.requires_grad_(false);
    return seq;
  };
  const auto x = torch::randn({3, 5, 16});
  CHECK(check_runs(make(), make(), x, {{1, 2}, {3, 5}, {6, 7}}) == 0);
  // A run of a Linear alone (its input requiring grad), and a 2-d input.
  CHECK(check_runs(make(), make(), x, {{0, 0}, {1, 2}}) == 0);
  CHECK(check_runs(make(), make(), x.reshape({15, 16}), {{1, 2}, {6, 7}}) == 0);
  // A run ending elsewhere recomputes its Linear: the counter sees it.
  CHECK(check_runs(make(), make(), x, {{1, 3}, {4, 5}}) == 1);
}

TEST_CASE("a run ending in a Linear is recomputed whole where its gradients would not be autograd's",
          "[checkpoint]") {
  // The Linear's input not row-major (a transpose before it): LibTorch takes
  // another product for it, so the run is recomputed whole, still bit-identical.
  // (Tanh, not GELU: LibTorch 1.13's CPU GELU backward reads a non-contiguous
  // incoming gradient wrongly, with or without memscale.)
  auto transposed = [] {
    torch::manual_seed(13);
    return torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::Tanh(),
                                 torch::nn::Functional([](const torch::Tensor& t) { return t.transpose(0, 1); }),
                                 torch::nn::Linear(16, 8));
  };
  CHECK(check_runs(transposed(), transposed(), torch::randn({3, 5, 16}), {{1, 3}}) == 1);
  // Complex: autograd's products conjugate.
  auto complex = [] {
    torch::manual_seed(14);
    torch::nn::Sequential seq(torch::nn::Functional([](const torch::Tensor& t) { return t * 2; }),
                              torch::nn::Linear(6, 4));
    seq->to(torch::kComplexFloat);
    return seq;
  };
  CHECK(check_runs(complex(), complex(), torch::randn({5, 6}, torch::kComplexFloat), {{0, 1}}) == 1);
  // A weight reassigned after the run was built: the run recomputes whole, and
  // the new weight gets its gradient.
  torch::manual_seed(15);
  torch::nn::Sequential late(torch::nn::GELU(), torch::nn::Linear(6, 6));
  std::vector<torch::nn::AnyModule> slots(late->begin(), late->end());
  auto segment = std::make_shared<memscale::CheckpointSegmentImpl>(slots);
  torch::manual_seed(16);
  auto w = torch::randn({6, 6}, torch::requires_grad());
  late[1]->as<torch::nn::Linear>()->weight = w;
  auto x = torch::randn({4, 6}, torch::requires_grad());
  segment->forward(x).abs().sum().backward();
  REQUIRE(w.grad().defined());
  auto expected_w = w.detach().clone().requires_grad_(true);
  torch::nn::functional::linear(torch::gelu(x.detach()), expected_w, late[1]->as<torch::nn::Linear>()->bias.detach())
      .abs()
      .sum()
      .backward();
  CHECK(test::bit_equal(expected_w.grad(), w.grad()));
}

TEST_CASE("a checkpoint's recompute leaves BatchNorm statistics as one forward left them", "[checkpoint]") {
  auto make = [] {
    torch::manual_seed(5);
    return torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::BatchNorm1d(8), torch::nn::GELU());
  };
  auto plain = make(), wrapped = make();
  auto x = torch::randn({16, 8});
  auto expected = test::step(*plain, [&] { return plain->forward(x).pow(2).sum(); });
  std::vector<torch::nn::AnyModule> slots(wrapped->begin(), wrapped->end());
  auto segment = std::make_shared<memscale::CheckpointSegmentImpl>(slots);
  auto got = test::step(*wrapped, [&] { return segment->forward(x).pow(2).sum(); });
  CHECK(test::bit_equal(expected.second, got.second));
  auto bn_plain = plain[1]->as<torch::nn::BatchNorm1d>();
  auto bn_wrapped = wrapped[1]->as<torch::nn::BatchNorm1d>();
  CHECK(bn_wrapped->num_batches_tracked.item<std::int64_t>() == 1);
  CHECK(test::bit_equal(bn_plain->running_mean, bn_wrapped->running_mean));
  CHECK(test::bit_equal(bn_plain->running_var, bn_wrapped->running_var));
}

TEST_CASE("checkpoint given the module moves BatchNorm statistics once a step, as without it", "[checkpoint]") {
  // What a user writes by hand: a block with BatchNorm, checkpointed by the
  // module form, by a function given the module, or given only its parameters.
  enum class form { module, function_and_module, function_and_params };
  auto make = [] {
    torch::manual_seed(15);
    return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::BatchNorm1d(16), torch::nn::GELU(),
                                 torch::nn::Linear(16, 8));
  };
  torch::manual_seed(16);
  const auto x = torch::randn({32, 8});
  auto run = [&](std::optional<form> how) {
    auto block = make();
    torch::optim::SGD sgd(block->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    std::vector<torch::Tensor> grads;
    for (int step = 0; step < 3; ++step) {
      sgd.zero_grad();
      const auto input = x * (1.0 + step);  // each step's batch statistics differ
      const auto body = [&](const torch::Tensor& t) { return block->forward(t); };
      torch::Tensor y;
      if (!how) y = block->forward(input);
      else if (*how == form::module) y = memscale::checkpoint(block, input);
      else if (*how == form::function_and_module) y = memscale::checkpoint(body, input, block);
      else y = memscale::checkpoint(body, input, block->parameters());
      y.pow(2).sum().backward();
      sgd.step();
    }
    for (const auto& p : block->parameters()) grads.push_back(p.grad().clone());
    return std::pair{block, grads};
  };
  auto [plain, plain_grads] = run(std::nullopt);
  const auto plain_bn = plain[1]->as<torch::nn::BatchNorm1d>();
  for (const auto how : {form::module, form::function_and_module}) {
    INFO("form " << static_cast<int>(how));
    auto [block, grads] = run(how);
    const auto bn = block[1]->as<torch::nn::BatchNorm1d>();
    CHECK(bn->num_batches_tracked.item<std::int64_t>() == 3);
    CHECK(test::bit_equal(plain_bn->running_mean, bn->running_mean));
    CHECK(test::bit_equal(plain_bn->running_var, bn->running_var));
    for (std::size_t i = 0; i < grads.size(); ++i) CHECK(test::bit_equal(plain_grads[i], grads[i]));
    for (std::size_t i = 0; i < grads.size(); ++i)
      CHECK(test::bit_equal(plain->parameters()[i], block->parameters()[i]));
  }
  // Given only the parameters, the function's modules are unknown: the recompute
  // moves the statistics a second time, as PyTorch's checkpoint does.
  auto [block, grads] = run(form::function_and_params);
  CHECK(block[1]->as<torch::nn::BatchNorm1d>()->num_batches_tracked.item<std::int64_t>() == 6);
}

TEST_CASE("a module-form checkpoint inside a checkpointed function moves BatchNorm statistics once", "[checkpoint]") {
  // The outer recompute runs the inner checkpoint's forward again, and the inner
  // backward recomputes it once more: each scope puts the buffers back.
  auto make = [] {
    torch::manual_seed(17);
    return torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::BatchNorm1d(8), torch::nn::ReLU());
  };
  torch::manual_seed(18);
  const auto x = torch::randn({16, 8});
  auto plain = make(), nested = make();
  auto expected = test::step(*plain, [&] { return (plain->forward(x * 1.5) * 2.0).pow(2).sum(); });
  auto got = test::step(*nested, [&] {
    const auto outer = [&](const torch::Tensor& t) { return memscale::checkpoint(nested, t * 1.5) * 2.0; };
    return memscale::checkpoint(outer, x, nested->parameters()).pow(2).sum();
  });
  CHECK(test::bit_equal(expected.first, got.first));
  CHECK(test::bit_equal(expected.second, got.second));
  const auto bn_plain = plain[1]->as<torch::nn::BatchNorm1d>();
  const auto bn = nested[1]->as<torch::nn::BatchNorm1d>();
  CHECK(bn->num_batches_tracked.item<std::int64_t>() == 1);
  CHECK(test::bit_equal(bn_plain->running_mean, bn->running_mean));
  CHECK(test::bit_equal(bn_plain->running_var, bn->running_var));
}

TEST_CASE("a gradient penalty through a checkpointed BatchNorm: create_graph's kept graph sees no new version",
          "[checkpoint]") {
  // Putting the running statistics back after the recompute counted as a write,
  // and the penalty's backward, through the recompute's kept graph, refused it.
  auto make = [] {
    torch::manual_seed(19);
    return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::BatchNorm1d(16), torch::nn::GELU(),
                                 torch::nn::Linear(16, 8));
  };
  torch::manual_seed(20);
  const auto x = torch::randn({16, 8});
  enum class form { plain, module, segment };
  auto run = [&](form how) {
    auto block = make();
    std::vector<torch::nn::AnyModule> slots(block->begin(), block->end());
    auto segment = std::make_shared<memscale::CheckpointSegmentImpl>(slots);
    const auto y = how == form::plain    ? block->forward(x)
                   : how == form::module ? memscale::checkpoint(block, x)
                                         : segment->forward(x);
    const auto loss = y.pow(2).mean();
    const auto params = block->parameters();
    const auto grads = torch::autograd::grad({loss}, params, {}, /*retain_graph=*/true, /*create_graph=*/true);
    auto penalty = torch::zeros({});
    for (const auto& g : grads) penalty = penalty + g.pow(2).sum();
    (loss + 0.1 * penalty).backward();
    std::vector<torch::Tensor> out;
    for (const auto& p : params) out.push_back(p.grad().clone());
    return std::tuple{loss.detach(), out, block};
  };
  auto [plain_loss, plain_grads, plain_block] = run(form::plain);
  const auto plain_bn = plain_block[1]->as<torch::nn::BatchNorm1d>();
  for (const auto how : {form::module, form::segment}) {
    INFO((how == form::module ? "memscale::checkpoint(block, x)" : "CheckpointSegment"));
    std::tuple<torch::Tensor, std::vector<torch::Tensor>, torch::nn::Sequential> got;
    REQUIRE_NOTHROW(got = run(how));
    auto& [loss, grads, block] = got;
    CHECK(test::bit_equal(plain_loss, loss));
    // The second-order terms sum in another order through the recompute's graph
    // (the bias before BatchNorm has a gradient of about 0: an absolute bound).
    for (std::size_t i = 0; i < grads.size(); ++i) {
      INFO("parameter " << i << ": max |difference| " << (grads[i] - plain_grads[i]).abs().max().item<float>());
      CHECK(torch::allclose(grads[i], plain_grads[i], 1e-5, 1e-7));
    }
    const auto bn = block[1]->as<torch::nn::BatchNorm1d>();
    CHECK(bn->num_batches_tracked.item<std::int64_t>() == 1);
    CHECK(test::bit_equal(plain_bn->running_mean, bn->running_mean));
    CHECK(test::bit_equal(plain_bn->running_var, bn->running_var));
  }
}

TEST_CASE("a weight the segment reads but does not own still gets its gradient", "[checkpoint]") {
  // A block that reads a weight registered elsewhere (as tied embeddings do).
  struct UsesSharedImpl : torch::nn::Module {
    explicit UsesSharedImpl(torch::Tensor w) : shared(std::move(w)) {}
    torch::Tensor forward(torch::Tensor x) { return torch::tanh(torch::matmul(x, shared)); }
    torch::Tensor shared;
  };
  torch::manual_seed(6);
  auto shared = torch::randn({8, 8}, torch::requires_grad());
  auto block = std::make_shared<UsesSharedImpl>(shared);
  auto x = torch::randn({4, 8}, torch::requires_grad());
  (torch::tanh(torch::matmul(x, shared)).sum() + shared.sum()).backward();
  const auto expected = shared.grad().clone();
  shared.mutable_grad() = torch::Tensor();
  memscale::CheckpointSegmentImpl segment({torch::nn::AnyModule(block)});
  (segment.forward(x).sum() + shared.sum()).backward();
  REQUIRE(shared.grad().defined());
  CHECK(torch::allclose(shared.grad(), expected, 1e-6, 1e-6));
}

TEST_CASE("checkpoint refuses a function that modifies its input in place", "[checkpoint]") {
  auto x = torch::randn({4, 4}, torch::requires_grad()) * 1.0;
  torch::nn::ReLU relu(torch::nn::ReLUOptions().inplace(true));
  try {
    (void)memscale::checkpoint([&](const torch::Tensor& t) { return relu->forward(t); }, x, {});
    FAIL("an in-place first operation was accepted");
  } catch (const memscale::Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("in place"));
  }
}

TEST_CASE("plans never start a checkpoint at an in-place layer, gradients stay exact", "[checkpoint][engine]") {
  auto make = [] {
    torch::manual_seed(7);
    torch::nn::Sequential seq;
    for (int i = 0; i < 4; ++i) {
      seq->push_back(torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 4, 3).padding(1)));
      seq->push_back(torch::nn::BatchNorm2d(4));
      seq->push_back(torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)));
    }
    return seq;
  };
  auto plain = make(), model = make();
  auto x = torch::randn({2, 4, 8, 8}, torch::requires_grad());
  const auto expected = test::step(*plain, [&] { return plain->forward(x).pow(2).sum(); });
  x.mutable_grad() = torch::Tensor();
  auto guard = memscale::optimize(model, x, test::quiet({.mode = memscale::OptimizationMode::Aggressive}));
  const auto report = guard.report();
  REQUIRE(report.checkpointed_segments() > 0);
  const auto& chain = report.chains.at(0);
  for (std::size_t k = 2; k < chain.slots.size(); k += 3) CHECK(chain.slots[k].mutates_input);
  for (const auto& u : report.plan.units.at(0))
    if (u.checkpointed) CHECK_FALSE(chain.slots[static_cast<std::size_t>(u.first)].mutates_input);
  const auto got = test::step(*model, [&] { return model->forward(x).pow(2).sum(); });
  CHECK(test::bit_equal(expected.first, got.first));
  CHECK(test::bit_equal(expected.second, got.second));
  // BatchNorm statistics (read through the registered children: the slots hold wrappers now).
  const auto plain_buffers = plain->named_buffers(), model_buffers = model->named_buffers();
  REQUIRE(plain_buffers.size() == model_buffers.size());
  for (std::size_t i = 0; i < plain_buffers.size(); ++i) {
    INFO("buffer " << plain_buffers[i].key());
    CHECK(test::bit_equal(plain_buffers[i].value(), model_buffers[i].value()));
  }
}

namespace {
/// CPU bf16 autocast for a scope (restored even when the scope throws).
class cpu_autocast {
 public:
  cpu_autocast() : scope_(bf16_on_cpu()) {}

 private:
  static memscale::detail::compat::autocast_state bf16_on_cpu() {
    auto on = memscale::detail::compat::current_autocast();
    on.cpu = true;
    on.cpu_dtype = at::kBFloat16;
    return on;
  }
  memscale::detail::compat::autocast_as scope_;
};
}  // namespace

TEST_CASE("the recompute runs under the autocast state of the forward", "[checkpoint]") {
  torch::manual_seed(8);
  torch::nn::Sequential seq(torch::nn::Linear(32, 64), torch::nn::GELU(), torch::nn::Linear(64, 32));
  auto x = torch::randn({8, 32}, torch::requires_grad());
  auto plain = test::step(*seq, [&] {
    torch::Tensor y;
    {
      cpu_autocast bf16;
      y = seq->forward(x);
    }
    return y.to(torch::kFloat).pow(2).mean();
  });
  auto checkpointed = test::step(*seq, [&] {
    torch::Tensor y;
    {
      cpu_autocast bf16;
      y = memscale::checkpoint([&](const torch::Tensor& t) { return seq->forward(t); }, x, seq->parameters());
    }
    REQUIRE(y.scalar_type() == torch::kBFloat16);
    return y.to(torch::kFloat).pow(2).mean();
  });  // backward runs outside autocast: the recompute must switch it back on
  CHECK(test::bit_equal(plain.first, checkpointed.first));
  CHECK(test::bit_equal(plain.second, checkpointed.second));
}

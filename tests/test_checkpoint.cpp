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
  // The output plus the saved CPU RNG state (about 5 KB).
  CHECK(checkpointed <= output_bytes + 16 * 1024);
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

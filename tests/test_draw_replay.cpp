// A checkpoint's recompute writes back the random masks its forward drew
// (detail/draw_replay.hpp): the same values as drawing again, bit for bit, the
// generator left where drawing would leave it, and a recompute that draws
// otherwise than its forward falls back to drawing.
#include "test_support.hpp"

namespace {

std::int64_t replayed() { return memscale::detail::replayed_draw_count().load(); }

/// A loss and the gradients of `x` and `params` after one backward of `loss`.
struct outcome {
  torch::Tensor loss;
  std::vector<torch::Tensor> grads;
  torch::Tensor next_draws;  // what the generator gives after the step
};

outcome run(const std::function<torch::Tensor()>& loss_fn, torch::Tensor& x, const std::vector<torch::Tensor>& params) {
  torch::manual_seed(21);
  x.mutable_grad() = torch::Tensor();
  for (auto p : params) p.mutable_grad() = torch::Tensor();
  outcome o;
  o.loss = loss_fn();
  o.loss.backward();
  o.grads.push_back(x.grad().clone());
  for (const auto& p : params) o.grads.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  o.next_draws = torch::rand({16});
  return o;
}

/// A Linear from `seed` and an input of `sizes` (its last size the Linear's
/// width) that requires grad, for a body to draw masks behind.
struct linear_case {
  torch::nn::Linear lin;
  torch::Tensor x;
  std::vector<torch::Tensor> params;
  linear_case(std::uint64_t seed, std::vector<std::int64_t> sizes, std::int64_t out)
      : lin((torch::manual_seed(seed), torch::nn::Linear(sizes.back(), out))),
        x(torch::randn(sizes, torch::requires_grad())),
        params(lin->parameters()) {}
};

bool same(const outcome& a, const outcome& b) {
  return test::bit_equal(a.loss, b.loss) && test::bit_equal(a.grads, b.grads) &&
         test::bit_equal(a.next_draws, b.next_draws);
}

/// A body drawing masks of several sizes (none a multiple of 8 elements) and
/// types, with other draws between them that must see the generator where the
/// forward left it, and one too small to keep.
torch::Tensor mixed_draws(const torch::Tensor& t, torch::nn::Linear& lin) {
  auto h = torch::dropout(lin->forward(t), 0.3, true);  // [50, 70, 13]: 45500 elements
  h = h * (1 + torch::rand_like(h));  // another kind of draw in between, which the gradients depend on
  auto d = torch::dropout(h.to(torch::kDouble), 0.5, true).to(torch::kFloat);  // a double mask
  d = torch::dropout(d.narrow(2, 0, 9).contiguous(), 0.2, true);  // [50, 70, 9]: 31500 elements
  return d * torch::dropout(torch::ones({9}), 0.5, true);       // 9 elements: drawn again
}

}  // namespace

TEST_CASE("pack_outcomes and unpack_outcomes round-trip 0/1 values of every size and floating type",
          "[checkpoint][draws]") {
  for (const auto dtype : {torch::kFloat, torch::kDouble, torch::kHalf, torch::kBFloat16}) {
    for (const std::int64_t n : {1, 7, 8, 9, 4096 * 8 + 3}) {
      const auto values = torch::rand({n}).lt(0.4).to(dtype);
      const auto packed = memscale::detail::pack_outcomes(values);
      CHECK(packed.numel() == (n + 7) / 8);
      auto back = torch::full({n}, 7.0, torch::TensorOptions(dtype));
      const auto version = back._version();
      memscale::detail::unpack_outcomes(packed, back);
      CHECK(test::bit_equal(values, back));
      CHECK(back._version() > version);  // written in place, as the draw writes
    }
  }
}

TEST_CASE("a recompute replays the forward's Dropout masks: gradients and the RNG stream bit-identical",
          "[checkpoint][draws]") {
  REQUIRE(memscale::detail::draw_replay_available());
  linear_case c(5, {50, 70, 11}, 13);
  auto& [lin, x, params] = c;
  const auto plain = run([&] { return mixed_draws(x, lin).pow(2).sum(); }, x, params);

  const auto before = replayed();
  const auto replaying = run(
      [&] {
        return memscale::checkpoint([&](const torch::Tensor& t) { return mixed_draws(t, lin); }, x, params)
            .pow(2)
            .sum();
      },
      x, params);
  CHECK(replayed() - before == 3);  // the three large Dropouts; rand_like and the small one are drawn again
  CHECK(same(plain, replaying));

  // The same through a CheckpointSegment that draws again (Config::replay_random_draws = false).
  torch::nn::Sequential seq(torch::nn::Linear(11, 13), torch::nn::Dropout(0.3), torch::nn::GELU(),
                            torch::nn::Dropout(0.1));
  const auto seq_params = seq->parameters();
  const auto seq_plain = run([&] { return seq->forward(x).sum(); }, x, seq_params);
  std::vector<torch::nn::AnyModule> slots(seq->begin(), seq->end());
  for (const bool replay : {true, false}) {
    auto segment = std::make_shared<memscale::CheckpointSegmentImpl>(slots, replay);
    const auto at_start = replayed();
    const auto checkpointed = run([&] { return segment->forward(x).sum(); }, x, seq_params);
    CHECK(replayed() - at_start == (replay ? 2 : 0));
    CHECK(same(seq_plain, checkpointed));
  }
}

TEST_CASE("a recompute that draws otherwise than its forward draws as a plain recompute would",
          "[checkpoint][draws]") {
  REQUIRE(memscale::detail::draw_replay_available());
  torch::manual_seed(6);
  auto x = torch::randn({64, 500}, torch::requires_grad());
  // The recompute (grad mode on) draws one mask more (another probability)
  // after the first: that one and every draw after it are drawn, from where
  // the replayed first draw left the generator.
  const auto diverging = [](const torch::Tensor& t) {
    auto y = torch::dropout(t, 0.5, true);
    if (torch::GradMode::is_enabled()) y = y * torch::dropout(torch::ones_like(t), 0.3, true);
    return torch::dropout(y, 0.5, true);
  };
  std::vector<outcome> outcomes;
  for (const bool replay : {true, false}) {
    const auto before = replayed();
    auto body = c10::make_intrusive<memscale::detail::checkpoint_body>(
        [&](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{diverging(in[0])}; });
    body->replay_draws = replay;
    outcomes.push_back(run(
        [&] {
          return memscale::detail::checkpoint_function::apply(body, at::TensorList(x), at::TensorList())[0].sum();
        },
        x, {}));
    CHECK(replayed() - before == (replay ? 1 : 0));
  }
  CHECK(same(outcomes[0], outcomes[1]));
}

TEST_CASE("a backward run twice (retain_graph) draws again the second time, from the forward's state",
          "[checkpoint][draws]") {
  REQUIRE(memscale::detail::draw_replay_available());
  linear_case c(9, {64, 16, 32}, 32);
  auto& [lin, x, params] = c;
  const auto twice = [&](bool checkpointed) {
    torch::manual_seed(22);
    x.mutable_grad() = torch::Tensor();
    for (auto p : params) p.mutable_grad() = torch::Tensor();
    const auto body = [&](const torch::Tensor& t) { return torch::dropout(lin->forward(t), 0.4, true); };
    auto loss = (checkpointed ? memscale::checkpoint(body, x, params) : body(x)).pow(2).sum();
    loss.backward({}, /*retain_graph=*/true);
    loss.backward();
    std::vector<torch::Tensor> grads{x.grad().clone()};
    for (const auto& p : params) grads.push_back(p.grad().clone());
    return grads;
  };
  const auto plain = twice(false);
  const auto before = replayed();
  const auto checkpointed = twice(true);
  CHECK(replayed() - before == 1);  // the first backward; the second found the log freed
  CHECK(test::bit_equal(plain, checkpointed));
}

TEST_CASE("a segment first run inside a replaying recompute: its probe's draws are hidden from the replay",
          "[checkpoint][draws]") {
  REQUIRE(memscale::detail::draw_replay_available());
  torch::manual_seed(10);
  torch::nn::Sequential inner(torch::nn::Linear(32, 32), torch::nn::Dropout(0.3));
  torch::nn::Linear outer(32, 32);
  auto x = torch::randn({64, 16, 32}, torch::requires_grad());
  std::vector<torch::Tensor> params = inner->parameters();
  for (const auto& p : outer->parameters()) params.push_back(p);
  // The outer forward runs with grad off, so the segment first runs for
  // training (and probes what it reads) inside the outer recompute; the
  // Dropout after it draws a mask of the same shape and probability, which a
  // probe that consumed the replay's draws would be served in its place.
  auto segment = std::make_shared<memscale::CheckpointSegmentImpl>(
      std::vector<torch::nn::AnyModule>(inner->begin(), inner->end()));
  const auto body = [&](const torch::Tensor& t, bool checkpointed) {
    auto h = checkpointed ? segment->forward(outer->forward(t)) : inner->forward(outer->forward(t));
    return torch::dropout(h, 0.3, true);
  };
  const auto plain = run([&] { return body(x, false).pow(2).sum(); }, x, params);
  const auto nested = run(
      [&] {
        return memscale::checkpoint([&](const torch::Tensor& t) { return body(t, true); }, x, params).pow(2).sum();
      },
      x, params);
  CHECK(same(plain, nested));
}

TEST_CASE("nested checkpoints replay each draw once, bit-identical to the plain step", "[checkpoint][draws]") {
  REQUIRE(memscale::detail::draw_replay_available());
  torch::manual_seed(7);
  torch::nn::Linear inner_lin(32, 32), outer_lin(32, 32);
  auto x = torch::randn({64, 16, 32}, torch::requires_grad());
  std::vector<torch::Tensor> params = inner_lin->parameters();
  for (const auto& p : outer_lin->parameters()) params.push_back(p);
  const auto inner = [&](const torch::Tensor& t) { return torch::dropout(inner_lin->forward(t), 0.4, true); };
  const auto body = [&](const torch::Tensor& t, bool checkpointed) {
    auto h = torch::dropout(outer_lin->forward(t), 0.25, true);
    h = checkpointed ? memscale::checkpoint(inner, h, inner_lin->parameters()) : inner(h);
    return torch::dropout(h, 0.1, true);
  };
  const auto plain = run([&] { return body(x, false).pow(2).sum(); }, x, params);
  const auto before = replayed();
  const auto nested = run(
      [&] {
        return memscale::checkpoint([&](const torch::Tensor& t) { return body(t, true); }, x, params).pow(2).sum();
      },
      x, params);
  // The outer recompute serves its three draws (the inner checkpoint's forward
  // within it records the one it serves); the inner recompute replays that one.
  CHECK(replayed() - before == 4);
  CHECK(same(plain, nested));
}

TEST_CASE("wrap replays Dropout masks unless replay_random_draws is off; the planner counts the saving",
          "[checkpoint][draws][api]") {
  REQUIRE(memscale::detail::draw_replay_available());
  torch::manual_seed(8);
  auto seq = test::flat_chain(3, 64, 256, 0.2);
  auto x = torch::randn({32, 24, 64});
  auto loss = [&] { return seq->forward(x).pow(2).mean(); };
  const auto baseline = test::step(*seq, loss);
  for (const bool replay : {true, false}) {
    // Masks as floats: kept as bits, the Dropout slots are cheaper left in place
    // than checkpointed, and the plan may checkpoint none of them.
    auto config = test::quiet({.mode = memscale::OptimizationMode::Aggressive,
                               .enable_offloading = false,
                               .force_optimize = true,
                               .replay_random_draws = replay,
                               .pack_saved_masks = false});
    memscale::Report report;
    {
      auto guard = memscale::optimize(seq, x, config);
      const auto at_start = replayed();
      const auto optimized = test::step(*seq, loss);
      report = guard.report();
      REQUIRE(report.checkpointed_segments() > 0);
      CHECK((replayed() > at_start) == replay);
      CHECK(test::bit_equal(baseline.first, optimized.first));
      CHECK(test::bit_equal(baseline.second, optimized.second));
    }
    // Each Dropout slot's profile says what replaying keeps (its mask, a bit an
    // element, and the generator's state) and saves; nothing when off.
    std::int64_t kept = 0;
    for (const auto& chain : report.chains)
      for (const auto& slot : chain.slots) {
        CHECK(slot.replay_saved_seconds >= 0.0);
        CHECK(slot.replay_saved_seconds <= slot.forward_seconds);
        CHECK((slot.replay_kept_bytes > 0 || slot.replay_saved_seconds == 0.0));
        kept += slot.replay_kept_bytes;
      }
    const std::int64_t mask_bits = 32 * 24 * 64 / 8;
    CHECK(kept >= (replay ? 3 * mask_bits : 0));
    CHECK(kept <= (replay ? 3 * (mask_bits + 8192) : 0));
    const auto said = std::any_of(report.notes.begin(), report.notes.end(), [](const std::string& n) {
      return n.find("replay the random masks") != std::string::npos;
    });
    CHECK(said == replay);
  }
}

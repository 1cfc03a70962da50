// Saved tensors kept compact (techniques/mask_packing.hpp, saved_compaction.hpp,
// detail/output_recipes.hpp, core/decision_masks.hpp): a saved tensor whose
// elements are all +0 or one value is stored a bit an element and written back
// bit for bit; an output whose inputs are saved anyway is computed again in
// backward; anything else is stored as it is; a step under it gives the plain
// step's gradients bit for bit and holds less by exactly those bytes; the
// planner takes it where the plan gets better at its target, and the guard
// applies it to the slots it leaves in place and removes it with the rest.
#include "test_support.hpp"

#include <memscale/core/decision_masks.hpp>
#include <memscale/techniques/saved_compaction.hpp>

#include "gpt.hpp"

namespace {

std::int64_t packed() { return memscale::detail::packed_mask_count().load(); }

torch::Tensor dropout_noise(std::vector<std::int64_t> sizes, c10::ScalarType dtype, double p = 0.1) {
  // Half has no CPU bernoulli on LibTorch 1.13: drawn in float, then converted.
  const auto draw = dtype == at::kHalf ? at::kFloat : dtype;
  return torch::empty(sizes, torch::TensorOptions(draw)).bernoulli_(1.0 - p).div_(1.0 - p).to(dtype);
}

bool round_trips(const torch::Tensor& t) {
  const auto p = memscale::detail::pack_mask(t);
  return p.bits.defined() && !p.plain.defined() && test::bit_equal(memscale::detail::unpack_mask(p), t);
}

bool kept_as_is(const torch::Tensor& t) {
  const auto p = memscale::detail::pack_mask(t);
  return !p.bits.defined() && p.plain.defined() && p.plain.data_ptr() == t.data_ptr();
}

/// Byte for byte (torch::equal has NaN unequal to itself and -0 equal to +0).
bool same_bytes(const torch::Tensor& a, const torch::Tensor& b) {
  const auto x = a.contiguous(), y = b.contiguous();
  return x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type() &&
         std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

}  // namespace

TEST_CASE("a saved mask is kept as bits and written back bit for bit; anything else as it is", "[masks]") {
  torch::manual_seed(3);
  const auto before = packed();
  // Odd sizes (not a multiple of eight), float, double and half.
  CHECK(round_trips(dropout_noise({1000, 37}, at::kFloat)));
  CHECK(round_trips(dropout_noise({16385}, at::kDouble, 0.5)));
  CHECK(round_trips(dropout_noise({129, 129}, at::kHalf, 0.2)));
  CHECK(packed() - before == 3);
  const auto p = memscale::detail::pack_mask(dropout_noise({1000, 37}, at::kFloat));
  CHECK(p.bits.numel() == (37000 + 7) / 8);

  auto noise = dropout_noise({1000, 37}, at::kFloat);
  auto with_negative_zero = noise.clone();
  with_negative_zero.view(-1)[5] = -0.0F;  // a third bit pattern: written back as +0 it would differ
  CHECK(kept_as_is(with_negative_zero));
  auto third = noise.clone();
  third.view(-1)[36999] = 2.0F;  // in the last, partial byte
  CHECK(kept_as_is(third));
  CHECK(kept_as_is(torch::zeros({1000, 37})));
  CHECK(kept_as_is(torch::randn({1000, 37})));
  CHECK(kept_as_is(noise.narrow(0, 0, 100)));          // fewer elements than are worth packing
  CHECK(kept_as_is(noise.t()));                        // not contiguous
  CHECK(kept_as_is(noise.clone().requires_grad_()));  // an activation autograd computes a gradient for
  CHECK(packed() - before == 4);

  // Dropout's product computed from the bits is the forward's, byte for byte
  // (odd size; a negative input times +0 is -0, infinity times +0 NaN).
  auto x = torch::randn({1000, 37});
  x.view(-1)[3] = std::numeric_limits<float>::infinity();
  x.view(-1)[36998] = std::numeric_limits<float>::quiet_NaN();
  const auto product = memscale::detail::multiply_by_bits(x, memscale::detail::pack_mask(noise));
  const auto expected = x * noise;
  REQUIRE(product.defined());
  CHECK(same_bytes(product, expected));
  CHECK_FALSE(memscale::detail::multiply_by_bits(x.t(), memscale::detail::pack_mask(noise)).defined());
}

TEST_CASE("a step with its masks kept as bits gives the plain step's gradients and holds less", "[masks][memory]") {
  memscale::memory_tracker::install();
  torch::manual_seed(5);
  torch::nn::Sequential model(torch::nn::Linear(64, 256), torch::nn::Dropout(0.3), torch::nn::GELU(),
                              torch::nn::Linear(256, 64), torch::nn::Dropout(0.1));
  const auto x = torch::randn({32, 24, 64});
  std::int64_t held[2] = {0, 0};
  std::vector<torch::Tensor> grads[2];
  for (const bool packing : {false, true}) {
    model->zero_grad();
    torch::manual_seed(9);
    const auto before = memscale::memory_tracker::current_bytes();
    const auto count = packed();
    torch::Tensor loss;
    {
      std::optional<memscale::detail::saved_compaction_scope> scope;
      if (packing) scope.emplace(memscale::saved_compaction{.masks = true});
      loss = model->forward(x).pow(2).mean();
    }
    held[packing ? 1 : 0] = memscale::memory_tracker::current_bytes() - before;
    CHECK(packed() - count == (packing ? 2 : 0));
    loss.backward();
    for (const auto& g : model->parameters()) grads[packing ? 1 : 0].push_back(g.grad().clone());
  }
  CHECK(test::bit_equal(grads[0], grads[1]));
  // Two float masks ([768, 256] and [768, 64]) held as bits: 31/32 of them freed.
  const std::int64_t masks = (768 * 256 + 768 * 64) * 4;
  CHECK(held[0] - held[1] == masks - masks / 32);
}

TEST_CASE("outputs whose inputs are saved anyway are computed again in backward, bit for bit", "[masks][memory]") {
  memscale::memory_tracker::install();
  auto o = test::small_gpt();
  o.halves_as_units = false;
  torch::manual_seed(6);
  gpt::MLP mlp(o);
  gpt::Attention attention(o);
  const std::int64_t B = 8, T = 64, C = 64;
  const auto x = torch::randn({B, T, C});
  for (const bool is_mlp : {true, false}) {
    auto half = is_mlp ? torch::nn::AnyModule(mlp) : torch::nn::AnyModule(attention);
    // Nothing compacted; outputs computed again; and masks as bits too (the
    // Dropout product then multiplies by the bits: multiply_by_bits).
    std::int64_t held[3] = {0, 0, 0}, recipes[3] = {0, 0, 0};
    std::vector<torch::Tensor> grads[3];
    for (const int run : {0, 1, 2}) {
      const bool outputs = run > 0;
      half.ptr()->zero_grad();
      torch::manual_seed(9);
      auto input = x.clone().requires_grad_(true);
      const auto before = memscale::memory_tracker::current_bytes();
      const auto count = memscale::detail::recipe_count().load();
      torch::Tensor loss;
      {
        std::optional<memscale::detail::saved_compaction_scope> scope;
        if (outputs) scope.emplace(memscale::saved_compaction{.masks = run == 2, .outputs = true});
        loss = half.forward(input).pow(2).mean();
      }
      held[run] = memscale::memory_tracker::current_bytes() - before;
      recipes[run] = memscale::detail::recipe_count().load() - count;
      loss.backward();
      grads[run].push_back(input.grad());
      for (const auto& p : half.ptr()->parameters()) grads[run].push_back(p.grad().clone());
    }
    INFO((is_mlp ? "MLP" : "attention"));
    CHECK(test::bit_equal(grads[0], grads[1]));
    CHECK(test::bit_equal(grads[0], grads[2]));
    CHECK(recipes[2] == 2);
    CHECK(held[2] < held[1]);
    // The MLP: its LayerNorm's output and its GELU's; attention: its LayerNorm's
    // output and its attention Dropout's product (softmax's output times the noise).
    CHECK(recipes[0] == 0);
    CHECK(recipes[1] == 2);
    const std::int64_t freed = (B * T * C + (is_mlp ? B * T * 4 * C : B * o.heads * T * T)) * 4;
    CHECK(held[0] - held[1] == freed);
  }
}

TEST_CASE("an input written in place after the forward fails the recompute with an error saying so", "[masks]") {
  torch::manual_seed(2);
  torch::nn::Linear fc(64, 256), out(256, 64);
  const auto x = torch::randn({8, 64, 64});
  torch::Tensor loss;
  {
    memscale::detail::saved_compaction_scope scope(memscale::saved_compaction{.outputs = true});
    auto h = fc(x);
    auto g = torch::gelu(h);  // saved by `out` as a recipe on h, which GELU saves
    loss = out(g).sum();
    torch::NoGradGuard no_grad;
    h.add_(1.0);
  }
  CHECK_THROWS_WITH(loss.backward(), Catch::Contains("written in place after the forward"));
}

TEST_CASE("an output written in place before it is saved is kept as it is, not computed again", "[masks]") {
  torch::manual_seed(4);
  torch::nn::Linear fc(64, 256), out(256, 64);
  const auto x = torch::randn({8, 64, 64});
  std::vector<torch::Tensor> grads[2];
  for (const bool compact : {false, true}) {
    fc->zero_grad();
    out->zero_grad();
    const auto count = memscale::detail::recipe_count().load();
    torch::Tensor loss;
    {
      std::optional<memscale::detail::saved_compaction_scope> scope;
      if (compact) scope.emplace(memscale::saved_compaction{.outputs = true});
      auto g = torch::gelu(fc(x));
      g.view({-1}).mul_(2.0);  // through a view: after GELU, before `out` saves it
      auto u = torch::gelu(fc(x));
      at::_unsafe_view(u, {8 * 64, 256}).add_(1.0);  // through an alias with its own version counter
      loss = out(g).sum() + out(u).sum();
    }
    CHECK(memscale::detail::recipe_count().load() == count);
    loss.backward();
    for (const auto& p : fc->parameters()) grads[compact ? 1 : 0].push_back(p.grad().clone());
    for (const auto& p : out->parameters()) grads[compact ? 1 : 0].push_back(p.grad().clone());
  }
  CHECK(test::bit_equal(grads[0], grads[1]));
}

TEST_CASE("the planner keeps masks as bits where the plan gets better at its target", "[engine][masks]") {
  using namespace memscale::core;
  const std::int64_t MiB = 1 << 20;
  // Six call-site units alike, a third of each one's saved bytes masks.
  const auto tune = [&](memscale::slot_cost& s, int) {
    s.compact_bytes = 12 * MiB;
    s.compact_seconds = 0.0002;
  };
  const auto choose = [](auto& costs, const auto& supported, const auto& in, auto& plan) {
    return choose_saved_compaction(costs, supported, in, plan);
  };
  auto r = test::improve_six_units(36, tune, choose, "saved tensors kept compact: ");
  const auto& costs = r.costs;
  const auto& plan = r.after;
  CHECK(plan.baseline_peak == r.before.baseline_peak);  // the model as it is
  CHECK(count_units(plan.units, &unit::checkpointed) < count_units(r.before.units, &unit::checkpointed));
  // Only the slots left in place keep theirs as bits, their saved bytes less them.
  const auto in_place = detail_masks::left_in_place(costs, plan);
  for (std::size_t k = 0; k < 6; ++k) {
    CHECK(costs[0][k].compacts_saved == in_place[0][k]);
    CHECK(costs[0][k].saved_bytes == (in_place[0][k] ? 24 : 36) * MiB);
  }
  // Where no slot saves a mask, nothing is tried and nothing said.
  auto maskless = r.chains;
  for (auto& s : maskless[0]) s.compact_bytes = 0;
  auto again = decide(maskless, {true}, r.in);
  const auto none = choose_saved_compaction(maskless, {true}, r.in, again);
  CHECK_FALSE(none.changed);
  CHECK(none.note.empty());
}

TEST_CASE("the guard keeps the masks of the slots it leaves in place as bits, and detach removes it",
          "[masks][api]") {
  torch::manual_seed(8);
  auto seq = test::flat_chain(3, 64, 256, 0.2);
  auto x = torch::randn({32, 24, 64});
  auto loss = [&] { return seq->forward(x).pow(2).mean(); };
  const auto baseline = test::step(*seq, loss);
  const auto wrappers = [&] {
    int n = 0;
    // The slots the Sequential runs (a wrapper registers nothing: children() keeps the originals).
    for (const auto& m : *seq) n += std::dynamic_pointer_cast<memscale::CompactSavedSlotImpl>(m.ptr()) ? 1 : 0;
    return n;
  };
  for (const bool allowed : {true, false}) {
    auto config = test::quiet({.mode = memscale::OptimizationMode::Balanced,
                               .enable_offloading = false,
                               .force_optimize = true,
                               .pack_saved_masks = allowed,
                               .recompute_saved_outputs = allowed});
    const auto at_start = packed();
    int wrapped = 0;
    const auto report = test::checked_guarded_step(seq, x, config, loss, baseline, [&] { wrapped = wrappers(); });
    // Each Dropout's profile found its mask (its bytes, less their bits) where the flag allows it.
    for (const auto& chain : report.chains)
      for (std::size_t k = 0; k < chain.slots.size(); ++k) {
        const bool dropout = chain.slot_names[k].find("Dropout") != std::string::npos;
        CHECK((chain.slots[k].compact_bytes > 0) == (dropout && allowed));
      }
    const auto* note = test::note_starting(report, "saved tensors kept compact:");
    REQUIRE((note != nullptr) == allowed);
    const bool taken = allowed && note->find("not taken") == std::string::npos;
    std::string notes;
    for (const auto& n : report.notes) notes += n + "\n";
    INFO(notes << report);
    CHECK((wrapped > 0) == taken);
    CHECK((packed() > at_start) == taken);
    CHECK(wrappers() == 0);
    CHECK_FALSE(memscale::is_optimized(seq));
  }
}

TEST_CASE("rows that end in +0 are kept without their tails and written back bit for bit", "[masks]") {
  using memscale::detail::pack_zero_tails;
  using memscale::detail::unpack_zero_tails;
  using memscale::detail::zero_tails;
  torch::manual_seed(4);
  // A causal softmax's layout: row i is +0 past position i; odd sizes, -0, NaN
  // and inf among the values kept, a row all +0 and a row with no tail.
  for (const auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
    auto t = torch::softmax(torch::randn({3, 5, 67, 67}).masked_fill(torch::ones({67, 67}).triu(1).to(at::kBool),
                                                                      -std::numeric_limits<float>::infinity()),
                            -1)
                 .to(dtype);
    t[0][0][10].zero_();
    t[0][1][5].fill_(1.0);  // no tail: all 67 kept instead of 6
    t[1][0][20][3] = -0.0;
    t[1][0][20][4] = std::numeric_limits<double>::quiet_NaN();
    t[2][4][40][0] = std::numeric_limits<double>::infinity();
    t[2][4][40][1] = -0.0;  // the last element kept of its row would be -0 if the tail ran further
    t[2][4][40][2] = 0.0;
    zero_tails z;
    INFO(c10::toString(dtype));
    REQUIRE(pack_zero_tails(t, z));
    const auto back = unpack_zero_tails(z);
    CHECK(same_bytes(back, t));
    CHECK(back.is_contiguous());
    // Row i keeps i + 1 elements, but for the rows changed above.
    const std::int64_t rows = 3 * 5 * 67, kept_causal = rows / 67 * (67 * 68 / 2);
    CHECK(z.lengths.numel() == rows);
    CHECK(z.lengths.sum().item<std::int64_t>() == kept_causal - 11 + 61);
    // Dropout's product of it computed from the tails and the bits is the plain
    // product, byte for byte: rows of 67 (starting anywhere in a byte of bits)
    // and of 128 (on a byte: eight at a time); a negative mask value, whose
    // product with a dropped +0 is -0.
    for (const double value : {1.0 / 0.9, -2.0}) {
      const auto mask_of = [&](const torch::Tensor& like) {  // +0 or value, as Dropout's noise
        const auto keep = torch::bernoulli(torch::full(like.sizes(), 0.9)) > 0;
        return torch::zeros(like.sizes(), dtype).masked_fill(keep, value);
      };
      const auto noise = mask_of(t);
      const auto product = memscale::detail::multiply_tails_by_bits(z, memscale::detail::pack_mask(noise));
      if (dtype == at::kBFloat16) {
        CHECK_FALSE(product.defined());  // multiply_by_bits on the unpacked tensor then
        continue;
      }
      REQUIRE(product.defined());
      CHECK(same_bytes(product, t * noise));
      auto wide = torch::zeros({2, 3, 128, 128}, dtype);
      wide.narrow(-1, 0, 61).copy_(torch::randn({2, 3, 128, 61}));
      wide[1][2][7].fill_(0.5);
      const auto wide_noise = mask_of(wide);
      zero_tails w;
      REQUIRE(pack_zero_tails(wide, w));
      CHECK(same_bytes(memscale::detail::multiply_tails_by_bits(w, memscale::detail::pack_mask(wide_noise)),
                       wide * wide_noise));
    }
  }
  zero_tails z;
  CHECK_FALSE(pack_zero_tails(torch::randn({64, 300}), z));  // nothing to drop: kept as it is, cheaply
  CHECK_FALSE(z.defined());
  auto little = torch::randn({64, 300});
  little.narrow(1, 250, 50).zero_();  // a sixth of it: under the quarter it must free
  CHECK_FALSE(pack_zero_tails(little, z));
  const auto activation = [](torch::Tensor t) { return t.requires_grad_() * 1.0; };  // computed in a graph
  CHECK(memscale::detail::zero_tails_candidate(activation(torch::zeros({300, 64}))));
  CHECK_FALSE(memscale::detail::zero_tails_candidate(torch::zeros({300, 64})));  // a leaf: held anyway
  CHECK_FALSE(memscale::detail::zero_tails_candidate(torch::zeros({300, 64}).requires_grad_()));  // a parameter
  CHECK_FALSE(memscale::detail::zero_tails_candidate(activation(torch::zeros({300, 64})).t()));  // not contiguous
  CHECK_FALSE(memscale::detail::zero_tails_candidate(activation(torch::zeros({64, 8}))));  // rows too short, too small
  CHECK_FALSE(memscale::detail::zero_tails_candidate(torch::zeros({400, 64}, at::kLong)));
}

TEST_CASE("causal attention's softmax output is kept without its +0 tails: same gradients, less held",
          "[masks][memory]") {
  memscale::memory_tracker::install();
  auto o = test::small_gpt();
  torch::manual_seed(6);
  gpt::Attention attention(o);
  const std::int64_t B = 8, T = 64, C = 64, H = o.heads;
  const auto x = torch::randn({B, T, C});
  // nothing; outputs; outputs and zeros; all three; zeros only
  const memscale::saved_compaction runs[] = {
      {}, {.outputs = true}, {.outputs = true, .zeros = true}, {true, true, true}, {.zeros = true}};
  std::int64_t held[5], tails[5], census[5];
  std::vector<torch::Tensor> grads[5];
  for (int run = 0; run < 5; ++run) {
    attention->zero_grad();
    torch::manual_seed(9);
    auto input = x.clone().requires_grad_(true);
    const auto before = memscale::memory_tracker::current_bytes();
    const auto count = memscale::detail::zero_tails_count().load();
    torch::Tensor loss;
    {
      std::optional<memscale::detail::saved_compaction_scope> scope;
      if (runs[run].any()) scope.emplace(runs[run]);
      loss = attention(input).pow(2).mean();
    }
    held[run] = memscale::memory_tracker::current_bytes() - before;
    tails[run] = memscale::detail::zero_tails_count().load() - count;
    loss.backward();
    grads[run].push_back(input.grad());
    for (const auto& p : attention->parameters()) grads[run].push_back(p.grad().clone());
    torch::manual_seed(9);
    memscale::detail::saved_compaction_scope dry(runs[run], /*dry=*/true);
    const auto y = attention(x.clone().requires_grad_(true));
    census[run] = dry.state().freed_bytes(y);
  }
  for (int run = 1; run < 5; ++run) {
    INFO("run " << run);
    CHECK(test::bit_equal(grads[0], grads[run]));
  }
  // Softmax's row i keeps i + 1 of its T elements, and a length per row.
  const std::int64_t rows = B * H * T, dropped = B * H * (T * (T - 1) / 2) * 4 - rows * 8;
  CHECK(tails[1] == 0);
  CHECK(tails[2] == 1);  // softmax's output; the Dropout product is a recipe over it
  CHECK(tails[3] == 1);
  CHECK(tails[4] == 2);  // softmax's output and the Dropout product saved by attention @ v
  CHECK(held[1] - held[2] == dropped);
  CHECK(held[2] - held[3] > 0);  // the noise as bits as well
  CHECK(census[2] - census[1] == dropped);
  CHECK(held[0] - held[4] >= 2 * dropped);
}

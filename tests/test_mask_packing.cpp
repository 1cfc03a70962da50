// Masks kept as bits (techniques/mask_packing.hpp, core/decision_masks.hpp): a
// saved tensor whose elements are all +0 or one value is stored a bit an
// element and written back bit for bit; anything else is stored as it is; a
// step under it gives the plain step's gradients bit for bit and holds less;
// the planner takes it where the plan gets better at its target, and the guard
// applies it to the slots it leaves in place and removes it with the rest.
#include "test_support.hpp"

#include <memscale/core/decision_masks.hpp>
#include <memscale/techniques/mask_packing.hpp>

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
      std::optional<memscale::detail::mask_packing_scope> scope;
      if (packing) scope.emplace();
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

TEST_CASE("the planner keeps masks as bits where the plan gets better at its target", "[engine][masks]") {
  using namespace memscale::core;
  const std::int64_t MiB = 1 << 20;
  // Six call-site units alike, a third of each one's saved bytes masks.
  const auto tune = [&](memscale::slot_cost& s, int) {
    s.mask_bytes = 12 * MiB;
    s.mask_seconds = 0.0002;
  };
  const auto choose = [](auto& costs, const auto& supported, const auto& in, auto& plan) {
    return choose_mask_packing(costs, supported, in, plan);
  };
  auto r = test::improve_six_units(36, tune, choose, "masks kept as bits: ");
  const auto& costs = r.costs;
  const auto& plan = r.after;
  CHECK(plan.baseline_peak == r.before.baseline_peak);  // the model as it is
  CHECK(count_units(plan.units, &unit::checkpointed) < count_units(r.before.units, &unit::checkpointed));
  // Only the slots left in place keep theirs as bits, their saved bytes less them.
  const auto in_place = detail_masks::left_in_place(costs, plan);
  for (std::size_t k = 0; k < 6; ++k) {
    CHECK(costs[0][k].packs_masks == in_place[0][k]);
    CHECK(costs[0][k].saved_bytes == (in_place[0][k] ? 24 : 36) * MiB);
  }
  // Where no slot saves a mask, nothing is tried and nothing said.
  auto maskless = r.chains;
  for (auto& s : maskless[0]) s.mask_bytes = 0;
  auto again = decide(maskless, {true}, r.in);
  const auto none = choose_mask_packing(maskless, {true}, r.in, again);
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
    for (const auto& m : seq->children()) n += std::dynamic_pointer_cast<memscale::MaskPackingSlotImpl>(m) ? 1 : 0;
    return n;
  };
  for (const bool allowed : {true, false}) {
    auto config = test::quiet({.mode = memscale::OptimizationMode::Balanced,
                               .enable_offloading = false,
                               .force_optimize = true,
                               .pack_saved_masks = allowed});
    const auto at_start = packed();
    int wrapped = 0;
    const auto report = test::checked_guarded_step(seq, x, config, loss, baseline, [&] { wrapped = wrappers(); });
    // Each Dropout's profile found its mask (its bytes, less their bits) where the flag allows it.
    for (const auto& chain : report.chains)
      for (std::size_t k = 0; k < chain.slots.size(); ++k) {
        const bool dropout = chain.slot_names[k].find("Dropout") != std::string::npos;
        CHECK((chain.slots[k].mask_bytes > 0) == (dropout && allowed));
      }
    const auto* note = test::note_starting(report, "masks kept as bits:");
    REQUIRE((note != nullptr) == allowed);
    const bool taken = allowed && note->find("not taken") == std::string::npos;
    CHECK((wrapped > 0) == taken);
    CHECK((packed() > at_start) == taken);
    CHECK(wrappers() == 0);
    CHECK_FALSE(memscale::is_optimized(seq));
  }
}

// Call-site units (memscale::forward) and models with no unit boundaries:
// ModuleList models looped in a hand-written forward, the way LibTorch users
// write them. Checkpointing through call sites changes no arithmetic, so losses,
// gradients and BatchNorm statistics must be bit-identical to the plain model.
#include <sstream>

#include "resnet.hpp"
#include "test_support.hpp"

using memscale::OptimizationMode;

namespace {

/// A pre-norm residual MLP block with Dropout.
class ResBlockImpl : public torch::nn::Module {
 public:
  explicit ResBlockImpl(std::int64_t width, double dropout = 0.2)
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        fc1(register_module("fc1", torch::nn::Linear(width, 4 * width))),
        fc2(register_module("fc2", torch::nn::Linear(4 * width, width))),
        drop(register_module("drop", torch::nn::Dropout(dropout))) {}
  torch::Tensor forward(torch::Tensor x) { return x + drop(fc2(torch::gelu(fc1(ln(x))))); }

  torch::nn::LayerNorm ln;
  torch::nn::Linear fc1, fc2;
  torch::nn::Dropout drop;
};
TORCH_MODULE(ResBlock);

/// Blocks in a ModuleList, looped over in forward; `skip` leaves one out (a
/// data-dependent branch), `repeat` calls that block again at the end (a module
/// called at two sites).
class LoopNetImpl : public torch::nn::Module {
 public:
  LoopNetImpl(int blocks_count, std::int64_t width)
      : blocks(register_module("blocks", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(width, width))) {
    for (int i = 0; i < blocks_count; ++i) blocks->push_back(ResBlock(width));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (std::size_t i = 0; i < blocks->size(); ++i) {
      if (static_cast<int>(i) == skip) continue;
      x = memscale::forward(*blocks[i]->as<ResBlock>(), x);
    }
    if (repeat >= 0) x = memscale::forward(std::dynamic_pointer_cast<ResBlockImpl>(blocks[static_cast<std::size_t>(repeat)]), x);
    return head(x);
  }

  torch::nn::ModuleList blocks;
  torch::nn::Linear head;
  int skip = -1;
  int repeat = -1;
};
TORCH_MODULE(LoopNet);

/// Blocks whose forward makes call sites of its own (nested call sites).
class OuterBlockImpl : public torch::nn::Module {
 public:
  explicit OuterBlockImpl(std::int64_t width)
      : a(register_module("a", ResBlock(width))), b(register_module("b", ResBlock(width))) {}
  torch::Tensor forward(torch::Tensor x) { return memscale::forward(b, memscale::forward(a, x)); }
  ResBlock a, b;
};
TORCH_MODULE(OuterBlock);

class NestedNetImpl : public torch::nn::Module {
 public:
  NestedNetImpl(int blocks_count, std::int64_t width) : blocks(register_module("blocks", torch::nn::ModuleList())) {
    for (int i = 0; i < blocks_count; ++i) blocks->push_back(OuterBlock(width));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& block : *blocks) x = memscale::forward(*block->as<OuterBlock>(), x);
    return x;
  }
  torch::nn::ModuleList blocks;
};
TORCH_MODULE(NestedNet);

/// Half of a two-part block that frees much memory for little recompute: a wide
/// GELU MLP keeps two activations 16 times its input's width.
class WidePartImpl : public torch::nn::Module {
 public:
  explicit WidePartImpl(std::int64_t width)
      : fc1(register_module("fc1", torch::nn::Linear(width, 16 * width))),
        fc2(register_module("fc2", torch::nn::Linear(16 * width, width))) {}
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(WidePart);

/// The other half: much compute, little kept. Eight products 16 times its
/// input's width, of which only the sums over the features survive (a sum
/// keeps nothing for backward, a product its inputs, which exist anyway).
class CostlyPartImpl : public torch::nn::Module {
 public:
  explicit CostlyPartImpl(std::int64_t width) {
    w = register_parameter("w", torch::randn({width, 16 * width}) * 0.01);
  }
  torch::Tensor forward(torch::Tensor x) {
    auto sums = x.matmul(w).sum(-1, /*keepdim=*/true);
    for (int i = 1; i < 8; ++i) sums = sums + (x.matmul(w) + i).sum(-1, /*keepdim=*/true);
    return x + sums * 1e-3;
  }
  torch::Tensor w;
};
TORCH_MODULE(CostlyPart);

/// A block of the two halves, each called through memscale::forward, and the
/// blocks looped over the same way: two levels of units.
class TwoPartBlockImpl : public torch::nn::Module {
 public:
  explicit TwoPartBlockImpl(std::int64_t width)
      : costly(register_module("costly", CostlyPart(width))), wide(register_module("wide", WidePart(width))) {}
  torch::Tensor forward(torch::Tensor x) { return memscale::forward(wide, memscale::forward(costly, x)); }
  CostlyPart costly;
  WidePart wide;
};
TORCH_MODULE(TwoPartBlock);

class TwoPartNetImpl : public torch::nn::Module {
 public:
  TwoPartNetImpl(int blocks_count, std::int64_t width) : blocks(register_module("blocks", torch::nn::ModuleList())) {
    for (int i = 0; i < blocks_count; ++i) blocks->push_back(TwoPartBlock(width));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& block : *blocks) x = memscale::forward(*block->as<TwoPartBlock>(), x);
    return x;
  }
  torch::nn::ModuleList blocks;
};
TORCH_MODULE(TwoPartNet);

/// A two-part block that keeps something outside its halves: a gate between
/// them (y * sigmoid(y) saves y and the sigmoid's output), which no unit at the
/// halves' level frees.
class GatedBlockImpl : public torch::nn::Module {
 public:
  explicit GatedBlockImpl(std::int64_t width)
      : costly(register_module("costly", CostlyPart(width))), wide(register_module("wide", WidePart(width))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto y = memscale::forward(costly, x);
    return memscale::forward(wide, y * torch::sigmoid(y));
  }
  CostlyPart costly;
  WidePart wide;
};
TORCH_MODULE(GatedBlock);

/// A Sequential stem, planned as a chain of its own, then gated two-part blocks
/// through memscale::forward: a Sequential beside nested call sites.
class StemAndBlocksImpl : public torch::nn::Module {
 public:
  StemAndBlocksImpl(int blocks_count, std::int64_t width)
      : stem(register_module("stem", torch::nn::Sequential(torch::nn::Linear(width, 8 * width), torch::nn::GELU(),
                                                           torch::nn::Linear(8 * width, width)))),
        blocks(register_module("blocks", torch::nn::ModuleList())) {
    for (int i = 0; i < blocks_count; ++i) blocks->push_back(GatedBlock(width));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = stem->forward(x);
    for (const auto& block : *blocks) x = memscale::forward(*block->as<GatedBlock>(), x);
    return x;
  }
  torch::nn::Sequential stem;
  torch::nn::ModuleList blocks;
};
TORCH_MODULE(StemAndBlocks);

/// A Linear and an activation: a block's `up` part (16 times wider, GELU) or
/// its `down` part (back, tanh).
class LinearActImpl : public torch::nn::Module {
 public:
  LinearActImpl(std::int64_t in, std::int64_t out, bool gelu)
      : fc(register_module("fc", torch::nn::Linear(in, out))), gelu_(gelu) {}
  torch::Tensor forward(torch::Tensor x) { return gelu_ ? torch::gelu(fc(x)) : torch::tanh(fc(x)); }
  torch::nn::Linear fc;

 private:
  bool gelu_;
};
TORCH_MODULE(LinearAct);

/// Parts whose boundary is wide: checkpointed one by one they keep it (down's
/// input); only the block checkpointed whole frees it.
class WideBoundaryBlockImpl : public torch::nn::Module {
 public:
  explicit WideBoundaryBlockImpl(std::int64_t width)
      : up(register_module("up", LinearAct(width, 16 * width, true))),
        down(register_module("down", LinearAct(16 * width, width, false))) {}
  torch::Tensor forward(torch::Tensor x) { return x + memscale::forward(down, memscale::forward(up, x)); }
  LinearAct up, down;
};
TORCH_MODULE(WideBoundaryBlock);

/// Blocks of two kinds taking turns: where the parts' boundary is wide the
/// cheapest plan checkpoints the block whole; where one part is costly and the
/// other wide, only the wide part. Neither level alone plans both.
class MixedNetImpl : public torch::nn::Module {
 public:
  MixedNetImpl(int pairs, std::int64_t width) : blocks(register_module("blocks", torch::nn::ModuleList())) {
    for (int i = 0; i < pairs; ++i) {
      blocks->push_back(WideBoundaryBlock(width));
      blocks->push_back(TwoPartBlock(width));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (std::size_t i = 0; i < blocks->size(); ++i)
      x = i % 2 == 0 ? memscale::forward(*blocks[i]->as<WideBoundaryBlock>(), x)
                     : memscale::forward(*blocks[i]->as<TwoPartBlock>(), x);
    return x;
  }
  torch::nn::ModuleList blocks;
};
TORCH_MODULE(MixedNet);

/// The whole loop behind one call site: the outermost depth has a single call.
class WrapperNetImpl : public torch::nn::Module {
 public:
  WrapperNetImpl(int blocks_count, std::int64_t width) : body(register_module("body", LoopNet(blocks_count, width))) {}
  torch::Tensor forward(torch::Tensor x) { return memscale::forward(body, x); }
  LoopNet body;
};
TORCH_MODULE(WrapperNet);

/// No Sequential and no call site: named layers called directly.
class PlainNetImpl : public torch::nn::Module {
 public:
  explicit PlainNetImpl(std::int64_t width)
      : fc1(register_module("fc1", torch::nn::Linear(width, 4 * width))),
        fc2(register_module("fc2", torch::nn::Linear(4 * width, 4 * width))),
        fc3(register_module("fc3", torch::nn::Linear(4 * width, width))) {}
  torch::Tensor forward(torch::Tensor x) { return fc3(torch::gelu(fc2(torch::tanh(fc1(x))))); }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(PlainNet);

/// A loop of Linear layers called through memscale::forward (row-independent units).
class LinearLoopImpl : public torch::nn::Module {
 public:
  LinearLoopImpl(int count, std::int64_t width) : layers(register_module("layers", torch::nn::ModuleList())) {
    for (int i = 0; i < count; ++i) layers->push_back(torch::nn::Linear(width, width));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& layer : *layers) x = torch::gelu(memscale::forward(*layer->as<torch::nn::Linear>(), x));
    return x;
  }
  torch::nn::ModuleList layers;
};
TORCH_MODULE(LinearLoop);

/// Two identically initialized models: the reference and the one memscale wraps.
template <class Model, class... Args>
std::pair<Model, Model> twins(std::uint64_t seed, Args... args) {
  torch::manual_seed(seed);
  Model reference(args...);
  torch::manual_seed(seed);
  Model model(args...);
  return {reference, model};
}

/// Balanced forced, checkpoint-only: the light touch, cheapest memory first.
/// Timed over 4 passes, the fastest kept: the choice of level compares measured
/// recompute (about 2x apart here), which one slow pass beside another test
/// process could turn (seen twice under ctest -j2, 2026-11-27).
memscale::Config light_touch() {
  return test::quiet(
      {.mode = OptimizationMode::Balanced, .enable_offloading = false, .force_optimize = true, .warmup_steps = 4});
}

/// Checkpoint-only, always acting: the plan checkpoints every unit it can.
memscale::Config checkpoint_all() {
  return test::quiet({.mode = OptimizationMode::Aggressive, .enable_offloading = false});
}

template <class Model>
std::vector<torch::Tensor> buffers_of(Model& m) {
  std::vector<torch::Tensor> b;
  for (const auto& t : m->buffers()) b.push_back(t.clone());
  return b;
}

/// `steps` training steps of mean(model(x)^2) with per-step seeds; losses and gradients.
template <class Model>
std::vector<std::pair<torch::Tensor, std::vector<torch::Tensor>>> train(Model& model, const torch::Tensor& x,
                                                                        int steps) {
  std::vector<std::pair<torch::Tensor, std::vector<torch::Tensor>>> out;
  for (int s = 0; s < steps; ++s)
    out.push_back(test::step(*model, [&] { return model->forward(x).pow(2).mean(); }, 100 + s));
  return out;
}

template <class Run>
bool same_runs(const Run& a, const Run& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!test::bit_equal(a[i].first, b[i].first) || !test::bit_equal(a[i].second, b[i].second)) return false;
  return true;
}

bool has_note(const memscale::Report& r, const std::string& part) {
  for (const auto& n : r.notes)
    if (n.find(part) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST_CASE("memscale::forward is a direct call without a guard on the model", "[call_sites]") {
  torch::manual_seed(1);
  LoopNet net(3, 16);
  auto x = torch::randn({4, 16});
  torch::manual_seed(9);
  const auto direct = [&] {
    auto y = x;
    for (const auto& b : *net->blocks) y = b->as<ResBlock>()->forward(y);
    return net->head(y);
  }();
  torch::manual_seed(9);
  CHECK(test::bit_equal(direct, net->forward(x)));
  // A guard on another model leaves this one's call sites alone.
  torch::manual_seed(2);
  LoopNet other(2, 16);
  auto guard = memscale::optimize(other, x, checkpoint_all());
  REQUIRE(guard.report().checkpointed_segments() > 0);
  torch::manual_seed(9);
  CHECK(test::bit_equal(direct, net->forward(x)));
}

TEST_CASE("call-site units of a ModuleList model are checkpointed bit-exactly and detach restores it",
          "[call_sites][checkpoint]") {
  auto [reference, model] = twins<LoopNet>(3, 4, 32);
  auto x = torch::randn({8, 16, 32});
  const auto identity = test::parameter_identity(*model);
  const auto expected = train(reference, x, 3);
  {
    auto guard = memscale::optimize(model, x, checkpoint_all());
    const auto report = guard.report();
    REQUIRE(report.chains.size() == 1);
    CHECK(report.chains[0].path.find("memscale::forward call sites") == 0);
    CHECK(report.chains[0].slot_names == std::vector<std::string>{"blocks.0 (ResBlock)", "blocks.1 (ResBlock)",
                                                                  "blocks.2 (ResBlock)", "blocks.3 (ResBlock)"});
    CHECK(report.checkpointed_segments() >= 3);
    CHECK(report.plan.segment_length[0] == 1);
    CHECK(has_note(report, "4 memscale::forward call(s) per forward at depth 0"));
    CHECK(report.str().find("blocks.2 (ResBlock)") != std::string::npos);
    CHECK(test::parameter_identity(*model) == identity);
    CHECK(same_runs(expected, train(model, x, 3)));
  }
  CHECK_FALSE(memscale::is_optimized(model));
  CHECK(test::parameter_identity(*model) == identity);
  torch::manual_seed(3);
  LoopNet fresh(4, 32);
  CHECK(same_runs(train(fresh, x, 2), train(model, x, 2)));
}

TEST_CASE("checkpointed call sites lower the step's peak", "[call_sites][memory]") {
  auto [reference, model] = twins<LoopNet>(4, 6, 64);
  auto x = torch::randn({16, 64, 64});
  const auto plain = test::measure_step(reference, x, std::nullopt);
  const auto optimized = test::measure_step(model, x, checkpoint_all());
  REQUIRE(optimized.report.checkpointed_segments() >= 5);
  CHECK(test::bit_equal(plain.result.first, optimized.result.first));
  CHECK(test::bit_equal(plain.result.second, optimized.result.second));
  // Six blocks keep about 14 activations each plainly; checkpointed, one input each.
  CHECK(optimized.peak_growth < plain.peak_growth / 2);
}

TEST_CASE("without an example input, call sites are recorded over the first training step and planned at the next",
          "[call_sites][lazy]") {
  auto [reference, model] = twins<LoopNet>(5, 3, 32);
  auto x = torch::randn({4, 8, 32});
  const auto expected = train(reference, x, 4);
  auto guard = memscale::optimize(model, checkpoint_all());
  CHECK_FALSE(guard.report().planned);
  CHECK(has_note(guard.report(), "memscale::forward calls of the first training forward"));
  std::vector<std::pair<torch::Tensor, std::vector<torch::Tensor>>> got;
  got.push_back(train(model, x, 1).front());
  CHECK_FALSE(guard.report().planned);  // recorded, not yet planned
  for (int s = 1; s < 4; ++s)
    got.push_back(test::step(*model, [&] { return model->forward(x).pow(2).mean(); }, 100 + s));
  const auto report = guard.report();
  REQUIRE(report.planned);
  CHECK(report.checkpointed_segments() >= 2);
  CHECK(has_note(report, "recorded over the first training forward"));
  CHECK(same_runs(expected, got));
}

TEST_CASE("gradient accumulation before the first backward records one forward's calls", "[call_sites][lazy]") {
  torch::manual_seed(6);
  LoopNet model(3, 16);
  auto x = torch::randn({4, 16});
  auto guard = memscale::optimize(model, checkpoint_all());
  auto loss = model->forward(x).pow(2).mean() + model->forward(x * 2).pow(2).mean();
  loss.backward();
  (void)model->forward(x).sum();  // plans
  const auto report = guard.report();
  REQUIRE(report.planned);
  REQUIRE(report.chains.size() == 1);
  CHECK(report.chains[0].slots.size() == 3);
}

TEST_CASE("a ResNet-style CNN with BatchNorm and in-place ReLU keeps gradients and running statistics bit-exact",
          "[call_sites][checkpoint][cnn]") {
  auto [reference, model] = twins<resnet::ResNet>(7, 3, 8);
  auto x = torch::randn({4, 3, 16, 16});
  const auto expected = train(reference, x, 2);
  auto guard = memscale::optimize(model, x, checkpoint_all());
  REQUIRE(guard.report().checkpointed_segments() >= 2);
  CHECK(test::bit_equal(buffers_of(reference), buffers_of(model)) == false);  // two steps moved the reference's
  CHECK(same_runs(expected, train(model, x, 2)));
  CHECK(test::bit_equal(buffers_of(reference), buffers_of(model)));
}

TEST_CASE("call-site units can be offloaded, bit-exactly", "[call_sites][offload]") {
  auto [reference, model] = twins<LoopNet>(8, 3, 64);
  auto x = torch::randn({8, 32, 64});
  const auto expected = train(reference, x, 2);
  auto guard = memscale::optimize(
      model, x, test::quiet({.mode = OptimizationMode::Aggressive, .enable_checkpointing = false}));
  REQUIRE(guard.report().offloaded_units() >= 1);
  CHECK(same_runs(expected, train(model, x, 2)));
  const auto stats = guard.offload_stats();
  REQUIRE(stats.has_value());
  CHECK(stats->bytes_written > 0);
}

TEST_CASE("call-site units of row-independent modules can be tiled", "[call_sites][tile]") {
  auto [reference, model] = twins<LinearLoop>(9, 3, 64);
  auto x = torch::randn({64, 128, 64});
  const auto expected = train(reference, x, 1);
  auto cfg = test::quiet({.mode = OptimizationMode::Aggressive, .enable_offloading = false, .enable_tiling = true});
  auto guard = memscale::optimize(model, x, cfg);
  REQUIRE(guard.report().tiled_segments() >= 1);
  const auto got = train(model, x, 1);
  CHECK(torch::allclose(expected[0].first, got[0].first, 1e-5, 1e-6));
  for (std::size_t i = 0; i < expected[0].second.size(); ++i)
    CHECK(torch::allclose(expected[0].second[i], got[0].second[i], 1e-4, 1e-5));
}

TEST_CASE("a module called at two sites is two units, each planned and run on its own call",
          "[call_sites][shared]") {
  torch::manual_seed(10);
  LoopNet reference(2, 32);
  reference->repeat = 0;
  torch::manual_seed(10);
  LoopNet model(2, 32);
  model->repeat = 0;
  auto x = torch::randn({4, 8, 32});
  const auto expected = train(reference, x, 2);
  auto guard = memscale::optimize(model, x, checkpoint_all());
  const auto report = guard.report();
  REQUIRE(report.chains.size() == 1);
  CHECK(report.chains[0].slot_names ==
        std::vector<std::string>{"blocks.0 (ResBlock)", "blocks.1 (ResBlock)", "blocks.0 (ResBlock) call 2"});
  CHECK(same_runs(expected, train(model, x, 2)));
}

TEST_CASE("a forward that leaves the recorded call sequence runs correctly and is counted", "[call_sites][sequence]") {
  auto [reference, model] = twins<LoopNet>(11, 4, 32);
  auto x = torch::randn({4, 8, 32});
  auto guard = memscale::optimize(model, x, checkpoint_all());
  REQUIRE(guard.report().checkpointed_segments() >= 3);
  // A data-dependent branch skips block 1 for one step.
  reference->skip = model->skip = 1;
  CHECK(same_runs(train(reference, x, 1), train(model, x, 1)));
  CHECK(has_note(guard.report(), "1 forward(s) left the recorded call sequence"));
  // Back on the recorded sequence: optimized again, nothing more counted.
  reference->skip = model->skip = -1;
  CHECK(same_runs(train(reference, x, 2), train(model, x, 2)));
  CHECK(has_note(guard.report(), "1 forward(s) left the recorded call sequence"));
  // More calls than recorded (a call to the first block after a complete
  // sequence would start a new forward, by the rule; block 2 cannot).
  reference->repeat = model->repeat = 2;
  CHECK(same_runs(train(reference, x, 1), train(model, x, 1)));
  CHECK(has_note(guard.report(), "2 forward(s) left the recorded call sequence"));
}

TEST_CASE("nested call sites are planned at one of two depths, the Report says which", "[call_sites][nested]") {
  auto [reference, model] = twins<NestedNet>(12, 3, 16);
  auto x = torch::randn({4, 8, 16});
  const auto expected = train(reference, x, 2);
  {
    auto guard = memscale::optimize(model, x, checkpoint_all());
    const auto report = guard.report();
    INFO(report.str());
    REQUIRE(report.chains.size() == 1);
    // Which depth wins is the projection's call (here, at the lowest peak, two
    // blocks recomputed at once in an outer unit's backward peak above one).
    const bool outer = has_note(report, "call sites: the calls nest; planned at depth 0");
    CHECK(outer != has_note(report, "call sites: the calls nest; planned at depth 1"));
    CHECK(report.chains[0].slot_names.front() == (outer ? "blocks.0 (OuterBlock)" : "blocks.0.a (ResBlock)"));
    CHECK(has_note(report, outer ? "6 nested call(s) inside them run directly"
                                 : "the 3 call(s) around them at depth 0 run directly"));
    CHECK(same_runs(expected, train(model, x, 2)));
  }
  // One call at the top: the plan goes one level finer.
  auto [wrapped_reference, wrapped] = twins<WrapperNet>(13, 3, 16);
  const auto wrapped_expected = train(wrapped_reference, x, 2);
  auto guard = memscale::optimize(wrapped, x, checkpoint_all());
  const auto report = guard.report();
  REQUIRE(report.chains.size() == 1);
  CHECK(report.chains[0].slot_names.front() == "body.blocks.0 (ResBlock)");
  CHECK(has_note(report, "the outermost depth has a single call, so the plan goes one level finer"));
  CHECK(same_runs(wrapped_expected, train(wrapped, x, 2)));
}

TEST_CASE("nested call sites: the finer level is planned where it reaches the target with less recompute",
          "[call_sites][nested]") {
  // Halving the step's growth: at the blocks' level half the blocks are
  // recomputed whole, costly halves included; at the halves' level only the
  // wide halves, which hold nearly all of it.
  auto [reference, model] = twins<TwoPartNet>(21, 4, 64);
  auto x = torch::randn({8, 64, 64});
  const auto expected = train(reference, x, 2);
  {
    auto guard = memscale::optimize(model, x, light_touch());
    const auto report = guard.report();
    INFO(report.str());
    REQUIRE(report.chains.size() == 1);
    CHECK(has_note(report, "call sites: the calls nest; planned at depth 1"));
    CHECK(has_note(report, "8 memscale::forward call(s) per forward at depth 1"));
    CHECK(report.chains[0].slot_names[0] == "blocks.0.costly (CostlyPart)");
    CHECK(report.chains[0].slot_names[1] == "blocks.0.wide (WidePart)");
    CHECK(report.checkpointed_segments() >= 1);
    for (const auto& u : report.plan.units[0])  // only wide halves: the costly ones free next to nothing
      if (u.checkpointed) CHECK(report.chains[0].slot_names[static_cast<std::size_t>(u.first)].find("wide") !=
                                std::string::npos);
    CHECK(report.planned_peak_bytes() <= report.plan.target_bytes);
    CHECK(same_runs(expected, train(model, x, 2)));
  }
  // Detached: direct calls again, and the same steps as the reference.
  CHECK_FALSE(memscale::is_optimized(model));
  CHECK(same_runs(train(reference, x, 1), train(model, x, 1)));
}

TEST_CASE("nested call sites beside a Sequential: the finer level keeps the Sequential's chain and counts what the "
          "blocks keep outside their halves",
          "[call_sites][nested]") {
  auto [reference, model] = twins<StemAndBlocks>(22, 4, 64);
  auto x = torch::randn({8, 64, 64});
  const auto expected = train(reference, x, 2);
  {
    auto guard = memscale::optimize(model, x, light_touch());
    const auto report = guard.report();
    INFO(report.str());
    REQUIRE(report.chains.size() == 2);
    CHECK(report.chains[0].path == "stem");  // planned beside the blocks' parts
    CHECK(report.chains[0].slot_names.size() == 3);
    REQUIRE(has_note(report, "call sites: the calls nest; planned at depth 1"));
    CHECK(report.chains[1].slot_names[0] == "blocks.0.costly (CostlyPart)");
    CHECK(report.chains[1].slot_names[1] == "blocks.0.wide (WidePart)");
    REQUIRE(report.plan.units.size() == 2);
    // The gate keeps y and sigmoid(y), one [8, 64, 64] float tensor each, per
    // block: counted as fixed, within what the projection could round.
    const std::int64_t activation = 8 * 64 * 64 * 4;
    CHECK(report.outside_units_bytes >= 4 * 2 * activation - activation);
    CHECK(report.outside_units_bytes <= 4 * 2 * activation + activation);
    CHECK(report.static_bytes() >= report.outside_units_bytes);
    CHECK(report.checkpointed_segments() >= 1);
    CHECK(report.planned_peak_bytes() <= report.plan.target_bytes);
    CHECK(same_runs(expected, train(model, x, 2)));
  }
  CHECK_FALSE(memscale::is_optimized(model));
  CHECK(same_runs(train(reference, x, 1), train(model, x, 1)));
}

TEST_CASE("nested call sites: a plan mixes the levels, blocks checkpointed whole beside single parts, bit-exactly",
          "[call_sites][nested]") {
  auto [reference, model] = twins<MixedNet>(23, 3, 64);
  auto x = torch::randn({8, 64, 64});
  const auto expected = train(reference, x, 2);
  // Outputs kept: computing the wide parts' GELU outputs again (on by default)
  // halves what they keep, and the plan then checkpoints no single part.
  auto config = light_touch();
  config.recompute_saved_outputs = false;
  {
    auto guard = memscale::optimize(model, x, config);
    const auto report = guard.report();
    INFO(report.str());
    REQUIRE(report.chains.size() == 1);
    REQUIRE(has_note(report, "call sites: the calls nest; planned at depth 1"));
    const auto& names = report.chains[0].slot_names;
    int groups = 0, singles = 0;
    for (const auto& u : report.plan.units[0]) {
      if (!u.checkpointed) continue;
      if (u.last > u.first) {  // a whole block: its up and down parts, nothing else
        ++groups;
        CHECK(u.last == u.first + 1);
        CHECK(names[static_cast<std::size_t>(u.first)].find(".up (LinearAct)") != std::string::npos);
        CHECK(names[static_cast<std::size_t>(u.last)].find(".down (LinearAct)") != std::string::npos);
      } else {
        ++singles;
      }
    }
    CHECK(groups >= 1);
    CHECK(singles >= 1);
    CHECK(report.planned_peak_bytes() <= report.plan.target_bytes);
    CHECK(same_runs(expected, train(model, x, 2)));
    // Traced: one mark per unit, a group's at its outer call.
    const auto traced = guard.trace_step([&] { (void)train(model, x, 1); });
    CHECK(traced.measured_timeline.size() == 2 * report.plan.units[0].size());
    CHECK_FALSE(has_note(guard.report(), "left the recorded call sequence"));
  }
  CHECK_FALSE(memscale::is_optimized(model));
  CHECK(same_runs(train(reference, x, 1), train(model, x, 1)));
  // Under mixed precision no group runs whole (its runner would autocast the
  // block's own code too, outside its parts): single parts, verified.
  auto [reference2, model2] = twins<MixedNet>(24, 3, 64);
  auto autocast_verified = light_touch();
  autocast_verified.use_mixed_precision = true;
  autocast_verified.verify_correctness = true;
  auto guard = memscale::optimize(model2, x, autocast_verified);
  const auto report = guard.report();
  INFO(report.str());
  REQUIRE(report.verification.has_value());
  CHECK(report.verification->passed);
  REQUIRE(report.plan.units.size() == 1);
  for (const auto& u : report.plan.units[0]) CHECK(u.last == u.first);
  CHECK_FALSE(has_note(report, "checkpointed whole"));
}

TEST_CASE("a model with no unit boundaries gets whole-forward offload, bit-exactly, detach ends it",
          "[call_sites][whole_model][offload]") {
  // 48 MiB saved: more than backward holds of them at once (a 32 MiB group),
  // so offloading lowers the projected peak.
  auto [reference, model] = twins<PlainNet>(14, 128);
  auto x = torch::randn({64, 128, 128});
  const auto expected = train(reference, x, 2);
  std::int64_t written = 0;
  {
    auto guard = memscale::optimize(model, x, test::quiet({.mode = OptimizationMode::Aggressive}));
    const auto report = guard.report();
    REQUIRE(report.chains.size() == 1);
    CHECK(report.chains[0].path.find("<whole model>") == 0);
    CHECK(report.checkpointed_segments() == 0);
    CHECK(report.offloaded_units() == 1);
    CHECK(report.planned_peak_bytes() < report.baseline_peak_bytes());
    CHECK(has_note(report, "no unit boundaries"));
    CHECK(has_note(report, "memscale::forward(*blocks[i], x)"));
    CHECK(has_note(report, "those of any other model trained on it too"));  // the scope is the thread's
    CHECK_THAT(report.str(), Catch::Contains("no unit boundaries to recompute between"));
    CHECK(same_runs(expected, train(model, x, 2)));
    written = guard.offload_stats().value().bytes_written;
    CHECK(written > 0);
  }
  CHECK(memscale::offload::detail::hook_stack().empty());  // the scope closed with the guard
  CHECK(same_runs(train(reference, x, 1), train(model, x, 1)));
}

namespace {
struct MaskedBlockImpl : torch::nn::Module {
  MaskedBlockImpl() { lin = register_module("lin", torch::nn::Linear(64, 64)); }
  torch::Tensor forward(torch::Tensor x, torch::Tensor mask) { return torch::gelu(lin(x)) * mask; }
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(MaskedBlock);
/// Three blocks, each called through memscale::forward with the input and a mask.
/// The mask needs a gradient: a recompute could not pass it back, so the calls are no units.
template <class Block>
struct MaskedLoopImpl : torch::nn::Module {
  MaskedLoopImpl() {
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("b" + std::to_string(i), Block()));
  }
  torch::Tensor forward(torch::Tensor x) {
    const auto mask = torch::ones_like(x).requires_grad_();
    for (auto& b : blocks) x = memscale::forward(b, x, mask);
    return x;
  }
  std::vector<Block> blocks;
};
template <class Block>
using MaskedLoop = torch::nn::ModuleHolder<MaskedLoopImpl<Block>>;
}  // namespace

TEST_CASE("calls passing a tensor that needs a gradient are no units, and the Report says that, not that none is "
          "made", "[call_sites][whole_model]") {
  torch::manual_seed(3);
  MaskedLoop<MaskedBlock> model;
  const auto x = torch::randn({16, 32, 64});
  auto guard = memscale::optimize(model, x, test::quiet({.mode = OptimizationMode::Aggressive}));
  const auto report = guard.report();
  INFO(report.str());
  CHECK(has_note(report, "3 memscale::forward call(s) per forward at depth 0, 0 of them planned as units"));
  CHECK(has_note(report, "none of its memscale::forward calls is a unit"));
  CHECK(has_note(report, "an argument after its input is a tensor that needs a gradient"));
  CHECK_FALSE(has_note(report, "its forward makes no memscale::forward call"));
  CHECK_THAT(report.str(), Catch::Contains("no memscale::forward call that is a unit"));
}

namespace {
/// Outer calls that take a mask needing a gradient (no units), each making single-Tensor calls inside (units).
struct MaskedOuterImpl : torch::nn::Module {
  MaskedOuterImpl() {
    first = register_module("first", torch::nn::Linear(64, 64));
    second = register_module("second", torch::nn::Linear(64, 64));
  }
  torch::Tensor forward(torch::Tensor x, torch::Tensor mask) {
    x = memscale::forward(first, x);
    return memscale::forward(second, torch::gelu(x)) * mask;
  }
  torch::nn::Linear first{nullptr}, second{nullptr};
};
TORCH_MODULE(MaskedOuter);
}  // namespace

TEST_CASE("outer calls that are no units leave the plan to the units inside them", "[call_sites]") {
  auto [reference, model] = twins<MaskedLoop<MaskedOuter>>(6);
  const auto x = torch::randn({16, 32, 64});
  const auto expected = train(reference, x, 2);
  {
    auto guard = memscale::optimize(model, x, test::quiet({.mode = OptimizationMode::Aggressive}));
    const auto report = guard.report();
    INFO(report.str());
    CHECK(has_note(report, "6 memscale::forward call(s) per forward at depth 1, 6 of them planned as units"));
    CHECK_FALSE(has_note(report, "no unit boundaries"));  // not whole-model offload
    REQUIRE(report.chains.size() == 1);
    CHECK(report.chains[0].path.find("memscale::forward call sites") == 0);
    CHECK(report.checkpointed_segments() + report.offloaded_units() > 0);
    CHECK(same_runs(expected, train(model, x, 2)));
  }
  CHECK_FALSE(memscale::is_optimized(model));
}

TEST_CASE("a model with no unit boundaries and offload excluded is refused, naming what is missing",
          "[call_sites][whole_model]") {
  PlainNet model(8);
  auto x = torch::randn({2, 8});
  try {
    (void)memscale::wrap<memscale::Strategy<memscale::Checkpoint>>(model, x, checkpoint_all());
    FAIL("expected UnsupportedModelError");
  } catch (const memscale::UnsupportedModelError& e) {
    const std::string what = e.what();
    CHECK(what.find("no unit boundaries") != std::string::npos);
    CHECK(what.find("memscale::forward") != std::string::npos);
  }
  CHECK_FALSE(memscale::is_optimized(model));
}

TEST_CASE("verify_correctness passes bit-identically through call sites with BatchNorm and through whole-forward "
          "offload, and training then matches the plain model",
          "[call_sites][verify]") {
  SECTION("ResNet-style CNN, every call site checkpointed") {
    auto [reference, model] = twins<resnet::ResNet>(7, 3, 8);
    auto x = torch::randn({4, 3, 16, 16});
    const auto expected = train(reference, x, 2);
    auto config = checkpoint_all();
    config.verify_correctness = true;
    auto guard = memscale::optimize(model, x, config);
    const auto report = guard.report();
    REQUIRE(report.checkpointed_segments() >= 2);
    REQUIRE(report.verification.has_value());
    CHECK(report.verification->passed);
    CHECK(report.verification->max_relative_difference == 0.0);
    CHECK(report.verification->buffers > 0);  // the running statistics were compared
    CHECK(same_runs(expected, train(model, x, 2)));
    CHECK(test::bit_equal(buffers_of(reference), buffers_of(model)));
  }
  SECTION("no unit boundaries: whole-forward offload") {
    auto [reference, model] = twins<PlainNet>(14, 128);
    auto x = torch::randn({64, 128, 128});  // saves more than a 32 MiB group, as above
    const auto expected = train(reference, x, 2);
    auto guard = memscale::optimize(
        model, x, test::quiet({.mode = OptimizationMode::Aggressive, .verify_correctness = true}));
    const auto report = guard.report();
    REQUIRE(report.offloaded_units() == 1);
    REQUIRE(report.verification.has_value());
    CHECK(report.verification->passed);
    CHECK(report.verification->max_relative_difference == 0.0);
    CHECK(guard.offload_stats().value().bytes_written > 0);  // the verification step went through the tiers
    CHECK(same_runs(expected, train(model, x, 2)));
  }
}

namespace {
/// LibTorch's own nn::TransformerEncoder, called whole (`loop` false) or layer by
/// layer through memscale::forward as the Report's note says (`loop` true).
struct EncoderStackImpl : torch::nn::Module {
  explicit EncoderStackImpl(bool loop_layers)
      : encoder(register_module("encoder", torch::nn::TransformerEncoder(torch::nn::TransformerEncoderOptions(
                                               torch::nn::TransformerEncoderLayerOptions(32, 2).dim_feedforward(64),
                                               2)))),
        loop(loop_layers) {}
  torch::Tensor forward(torch::Tensor x) {  // [tokens, batch, 32]
    if (!loop) return encoder->forward(x);
    for (std::size_t i = 0; i < encoder->layers->size(); ++i)
      x = memscale::forward(*encoder->layers->ptr<torch::nn::TransformerEncoderLayerImpl>(i), x);
    return x;
  }
  torch::nn::TransformerEncoder encoder;
  bool loop;
};
TORCH_MODULE(EncoderStack);
}  // namespace

TEST_CASE("LibTorch's nn::TransformerEncoder: the Report names it and the loop that makes its layers units, and that "
          "loop checkpoints them bit-exactly",
          "[call_sites][whole_model][verify]") {
  const auto x = torch::randn({16, 8, 32});
  const std::string loop_line = "memscale::forward(*enc->layers->ptr<torch::nn::TransformerEncoderLayerImpl>(i), x)";
  SECTION("called whole: no unit boundaries, and the note says where the layers are") {
    torch::manual_seed(5);
    EncoderStack model(false);
    auto guard = memscale::optimize(model, x, test::quiet({.mode = OptimizationMode::Aggressive}));
    const auto report = guard.report();
    INFO(report.str());
    CHECK(has_note(report, "no unit boundaries"));
    CHECK(has_note(report, "`encoder` is LibTorch's torch::nn::TransformerEncoder"));
    CHECK(has_note(report, loop_line));
  }
  SECTION("called whole, offload excluded: the refusal says it too") {
    torch::manual_seed(5);
    EncoderStack model(false);
    try {
      (void)memscale::wrap<memscale::Strategy<memscale::Checkpoint>>(model, x, checkpoint_all());
      FAIL("expected UnsupportedModelError");
    } catch (const memscale::UnsupportedModelError& e) {
      CHECK_THAT(std::string(e.what()), Catch::Contains(loop_line));
    }
    CHECK_FALSE(memscale::is_optimized(model));
  }
  SECTION("its layers looped through memscale::forward: units, checkpointed bit-exactly (Dropout inside)") {
    auto [reference, model] = twins<EncoderStack>(5, true);
    const auto expected = train(reference, x, 2);
    auto config = checkpoint_all();
    config.verify_correctness = true;
    {
      auto guard = memscale::optimize(model, x, config);
      const auto report = guard.report();
      INFO(report.str());
      CHECK(has_note(report, "2 memscale::forward call(s) per forward at depth 0, 2 of them planned as units"));
      CHECK_FALSE(has_note(report, "no unit boundaries"));
      CHECK(report.checkpointed_segments() >= 1);
      REQUIRE(report.verification.has_value());
      CHECK(report.verification->passed);
      CHECK(report.verification->max_relative_difference == 0.0);
      CHECK(same_runs(expected, train(model, x, 2)));
    }
    CHECK_FALSE(memscale::is_optimized(model));
  }
}

TEST_CASE("the hint for LibTorch's layer stacks: nested paths, the model itself, nn::Transformer, decoders, many",
          "[call_sites]") {
  const auto encoder = [] {
    return torch::nn::TransformerEncoder(
        torch::nn::TransformerEncoderOptions(torch::nn::TransformerEncoderLayerOptions(16, 2).dim_feedforward(32), 1));
  };
  using memscale::detail::builtin_stack_hint;
  CHECK(builtin_stack_hint(*torch::nn::Linear(4, 4)) == "");
  {  // nested in a Sequential: the path as named_modules gives it, the loop with a placeholder
    torch::nn::Sequential seq(torch::nn::Linear(16, 16), encoder());
    const auto hint = builtin_stack_hint(*seq);
    INFO(hint);
    CHECK(hint.rfind("`1` is LibTorch's torch::nn::TransformerEncoder", 0) == 0);
    CHECK_THAT(hint, Catch::Contains("with `enc` that module"));
    CHECK_THAT(hint, Catch::Contains("if (!enc->norm.is_empty()) x = enc->norm.forward(x);"));
    CHECK(hint.back() != '.');  // the caller joins it with ". "
  }
  {  // the model is the encoder: no forward of the user's calls it
    const auto hint = builtin_stack_hint(*encoder());
    INFO(hint);
    CHECK(hint.rfind("the model is LibTorch's torch::nn::TransformerEncoder", 0) == 0);
    CHECK_THAT(hint, Catch::Contains("wrap it in a module of your own"));
  }
  {  // nn::Transformer: said once, its encoder and decoder with it
    torch::nn::Sequential seq(torch::nn::Transformer(
        torch::nn::TransformerOptions(16, 2).num_encoder_layers(1).num_decoder_layers(1).dim_feedforward(32)));
    const auto hint = builtin_stack_hint(*seq);
    INFO(hint);
    CHECK(hint.rfind("`0` is LibTorch's torch::nn::Transformer,", 0) == 0);
    CHECK_THAT(hint, Catch::Contains("t->encoder.ptr<torch::nn::TransformerEncoderImpl>()->layers"));
    CHECK(hint.find("`0.encoder`") == std::string::npos);
    CHECK(hint.find("`0.decoder`") == std::string::npos);
  }
  {  // a decoder, and more than three stacks: three said, the rest counted
    torch::nn::Sequential seq;
    seq->push_back(torch::nn::TransformerDecoder(torch::nn::TransformerDecoderOptions(
        torch::nn::TransformerDecoderLayerOptions(16, 2).dim_feedforward(32), 1)));
    for (int i = 0; i < 4; ++i) seq->push_back(encoder());
    const auto hint = builtin_stack_hint(*seq);
    INFO(hint);
    CHECK(hint.rfind("`0` is LibTorch's torch::nn::TransformerDecoder", 0) == 0);
    CHECK_THAT(hint, Catch::Contains("`x = memscale::forward(*layer, x, memory)` makes it a unit"));
    CHECK_THAT(hint, Catch::Contains("`2` is LibTorch's torch::nn::TransformerEncoder"));
    CHECK(hint.find("`3` is") == std::string::npos);
    CHECK_THAT(hint, Catch::EndsWith(". And 2 more such module(s)"));
  }
}

namespace {
/// A pre-norm encoder layer as BERT-style models call theirs: `layer(x, keep,
/// scale)`, keys where `keep` is 0 masked out of the attention, Dropout on its
/// weights; a non-tensor argument too.
struct PaddedLayerImpl : torch::nn::Module {
  explicit PaddedLayerImpl(std::int64_t width)
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        qkv(register_module("qkv", torch::nn::Linear(width, 3 * width))),
        proj(register_module("proj", torch::nn::Linear(width, width))),
        fc1(register_module("fc1", torch::nn::Linear(width, 4 * width))),
        fc2(register_module("fc2", torch::nn::Linear(4 * width, width))),
        drop(register_module("drop", torch::nn::Dropout(0.1))) {}
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& keep = {}, double scale = 1.0) {
    const auto parts = qkv(ln(x)).chunk(3, -1);
    auto att = torch::matmul(parts[0], parts[1].transpose(-2, -1)) * scale;
    if (keep.defined()) att = att.masked_fill(keep.unsqueeze(1) == 0, -1e9);
    att = drop(torch::softmax(att, -1));
    x = x + proj(torch::matmul(att, parts[2]));
    return x + fc2(torch::gelu(fc1(x)));
  }
  torch::nn::LayerNorm ln;
  torch::nn::Linear qkv, proj, fc1, fc2;
  torch::nn::Dropout drop;

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(torch::Tensor())}, {2, torch::nn::AnyValue(1.0)})
};
TORCH_MODULE(PaddedLayer);

/// Layers in a ModuleList, each called with the input, the padding mask the
/// batch's own data gives (or `keep`, where set) and its own scale; `plain`:
/// with the input alone.
struct PaddedEncoderImpl : torch::nn::Module {
  PaddedEncoderImpl(int count, std::int64_t width)
      : layers(register_module("layers", torch::nn::ModuleList())), scale(1.0 / std::sqrt(double(width))) {
    for (int i = 0; i < count; ++i) layers->push_back(PaddedLayer(width));
  }
  torch::Tensor forward(torch::Tensor x) {
    const auto mask = keep.defined() ? keep : (x.select(-1, 0) > -0.3).to(x.dtype());
    for (std::size_t i = 0; i < layers->size(); ++i) {
      auto& layer = *layers[i]->as<PaddedLayer>();
      x = plain ? memscale::forward(layer, x) : memscale::forward(layer, x, mask, scale * (1.0 + 0.25 * double(i)));
    }
    return x;
  }
  torch::nn::ModuleList layers;
  double scale;
  torch::Tensor keep;
  bool plain = false;
};
TORCH_MODULE(PaddedEncoder);

/// Steps on a batch each (each with its own padding), losses and gradients.
std::vector<std::pair<torch::Tensor, std::vector<torch::Tensor>>> train_batches(PaddedEncoder& model,
                                                                                const std::vector<torch::Tensor>& xs) {
  std::vector<std::pair<torch::Tensor, std::vector<torch::Tensor>>> out;
  for (std::size_t s = 0; s < xs.size(); ++s)
    out.push_back(test::step(*model, [&] { return model->forward(xs[s]).pow(2).mean(); }, 200 + s));
  return out;
}

std::vector<torch::Tensor> padded_batches(int count) {
  std::vector<torch::Tensor> xs;
  for (int i = 0; i < count; ++i) xs.push_back(torch::randn({8, 24, 32}));
  return xs;
}
}  // namespace

TEST_CASE("calls passing a mask and a scale after the input are units: checkpointed and offloaded with each call's "
          "own arguments, bit-exactly", "[call_sites][bound]") {
  torch::manual_seed(21);
  const auto example = torch::randn({8, 24, 32});
  const auto xs = padded_batches(3);
  const auto cfg = GENERATE(as<std::string>{}, "checkpoint", "offload");
  auto [reference, model] = twins<PaddedEncoder>(22, 3, 32);
  const auto expected = train_batches(reference, xs);
  const auto identity = test::parameter_identity(*model);
  {
    auto config = cfg == "checkpoint" ? checkpoint_all()
                                      : test::quiet({.mode = OptimizationMode::Aggressive,
                                                     .enable_checkpointing = false});
    config.verify_correctness = true;  // its steps call the units too, on the example's mask
    auto guard = memscale::optimize(model, example, config);
    const auto report = guard.report();
    REQUIRE(report.verification.has_value());
    CHECK(report.verification->passed);
    CHECK(report.verification->max_relative_difference == 0.0);
    INFO(cfg << "\n" << report.str());
    REQUIRE(report.chains.size() == 1);
    CHECK(report.chains[0].slot_names ==
          std::vector<std::string>{"layers.0 (PaddedLayer)", "layers.1 (PaddedLayer)", "layers.2 (PaddedLayer)"});
    CHECK(has_note(report, "3 memscale::forward call(s) per forward at depth 0, 3 of them planned as units"));
    if (cfg == "checkpoint") REQUIRE(report.checkpointed_segments() >= 2);
    else REQUIRE(report.offloaded_units() >= 1);
    // Each step's padding differs from the example's: a recompute on the
    // recorded call's mask, or on another step's, gives other gradients.
    CHECK(same_runs(expected, train_batches(model, xs)));
    CHECK(test::parameter_identity(*model) == identity);
  }
  CHECK_FALSE(memscale::is_optimized(model));
  torch::manual_seed(22);
  PaddedEncoder fresh(3, 32);
  CHECK(same_runs(train_batches(fresh, xs), train_batches(model, xs)));
}

TEST_CASE("calls with arguments: two forwards before one backward, and a module called with and without them",
          "[call_sites][bound]") {
  torch::manual_seed(24);
  const auto xs = padded_batches(2);
  SECTION("gradient accumulation: each recompute reads its own forward's mask") {
    auto [reference, model] = twins<PaddedEncoder>(25, 3, 32);
    const auto accumulate = [&](PaddedEncoder& m) {
      return test::step(*m, [&] { return m->forward(xs[0]).pow(2).mean() + m->forward(xs[1]).pow(2).mean(); }, 7);
    };
    const auto expected = accumulate(reference);
    auto guard = memscale::optimize(model, xs[0], checkpoint_all());
    REQUIRE(guard.report().checkpointed_segments() >= 2);
    const auto got = accumulate(model);
    CHECK(test::bit_equal(expected.first, got.first));
    CHECK(test::bit_equal(expected.second, got.second));
  }
  SECTION("planned with its arguments, called without them: the module's defaults") {
    auto [reference, model] = twins<PaddedEncoder>(26, 3, 32);
    reference->plain = true;
    const auto expected = train_batches(reference, xs);
    auto guard = memscale::optimize(model, xs[0], checkpoint_all());
    REQUIRE(guard.report().checkpointed_segments() >= 2);
    model->plain = true;
    CHECK(same_runs(expected, train_batches(model, xs)));
  }
  SECTION("planned without arguments, called with them: run directly, nothing dropped") {
    auto [reference, model] = twins<PaddedEncoder>(27, 3, 32);
    const auto expected = train_batches(reference, xs);
    model->plain = true;
    auto guard = memscale::optimize(model, xs[0], checkpoint_all());
    REQUIRE(guard.report().checkpointed_segments() >= 2);
    model->plain = false;
    CHECK(same_runs(expected, train_batches(model, xs)));
  }
}

TEST_CASE("units with arguments after the input are not tiled, even where the module is marked tileable",
          "[call_sites][bound]") {
  torch::manual_seed(28);
  PaddedEncoder model(2, 32);
  const auto x = torch::randn({64, 24, 32});
  const auto cfg = test::quiet({.mode = OptimizationMode::Aggressive, .enable_offloading = false, .enable_tiling = true});
  for (const auto& layer : *model->layers) memscale::mark_tileable(layer->as<PaddedLayer>()->shared_from_this());
  model->plain = true;  // called with the input alone, the marked layers are tiled
  {
    auto guard = memscale::optimize(model, x, cfg);
    INFO(guard.report().str());
    CHECK(guard.report().tiled_segments() >= 1);
  }
  model->plain = false;
  {
    auto guard = memscale::optimize(model, x, cfg);
    INFO(guard.report().str());
    CHECK(guard.report().tiled_segments() == 0);
    CHECK(guard.report().checkpointed_segments() >= 1);
  }
  for (const auto& layer : *model->layers) memscale::mark_not_tileable(layer->as<PaddedLayer>()->shared_from_this());
}

TEST_CASE("a checkpointed call's tensor argument changed in place before backward is refused, naming it",
          "[call_sites][bound]") {
  torch::manual_seed(23);
  PaddedEncoder model(2, 32);
  const auto x = torch::randn({8, 24, 32});
  model->keep = torch::ones({8, 24});
  auto guard = memscale::optimize(model, x, checkpoint_all());
  REQUIRE(guard.report().checkpointed_segments() >= 1);
  auto loss = model->forward(x).pow(2).mean();
  model->keep.index_put_({0, 0}, 0.0);
  CHECK_THROWS_WITH(loss.backward(), Catch::Contains("argument 1 after the input of the call to") &&
                                         Catch::Contains("changed in place between its forward and this recompute"));
  model->zero_grad();
  model->keep = torch::ones({8, 24});
  model->forward(x).pow(2).mean().backward();  // the next step runs
  CHECK(model->layers[0]->as<PaddedLayer>()->qkv->weight.grad().defined());
}

// The offload path: saved-tensor hooks through the Engine subclass, the tiered
// engine (every tier, dtype and layout, spills, faults, prefetch), the Offload
// technique on real chains, and the decision engine's offload rules.
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <thread>

#include "test_support.hpp"

using memscale::OptimizationMode;
using memscale::memory_tracker;
using memscale::offload::engine;
using memscale::offload::engine_options;
using memscale::offload::tier;
namespace fs = std::filesystem;

namespace {

/// A model whose step exercises what the engine must not change: dropout RNG,
/// BatchNorm statistics, in-place ReLU, a checkpointed segment.
struct hooks_model {
  torch::nn::Sequential seq{torch::nn::Linear(16, 32), torch::nn::BatchNorm1d(32), torch::nn::ReLU(true),
                            torch::nn::Dropout(0.2), torch::nn::Linear(32, 8)};
};

std::vector<torch::Tensor> hooks_step(hooks_model& m, const torch::Tensor& x) {
  return test::step(*m.seq, [&] {
           auto h = m.seq[0]->as<torch::nn::Linear>()->forward(x);
           h = memscale::checkpoint(
               [&](const torch::Tensor& in) {
                 auto y = m.seq[1]->as<torch::nn::BatchNorm1d>()->forward(in);
                 y = m.seq[2]->as<torch::nn::ReLU>()->forward(y);
                 return m.seq[3]->as<torch::nn::Dropout>()->forward(y);
               },
               h, m.seq->parameters());
           return m.seq[4]->as<torch::nn::Linear>()->forward(h).pow(2).mean();
         })
      .second;
}

/// Engine options for tests: no stderr warnings, and every tensor offloaded
/// unless the test sets min_bytes itself.
engine_options quiet_options(engine_options o = {}) {
  o.log_warnings = false;
  if (o.min_bytes == engine_options{}.min_bytes) o.min_bytes = 0;
  return o;
}

/// Tensors of every dtype and layout the engine must return bit-identical.
std::vector<std::pair<std::string, torch::Tensor>> round_trip_cases() {
  std::vector<std::pair<std::string, torch::Tensor>> cases;
  torch::manual_seed(3);
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16, torch::kLong}) {
    auto base = dtype == torch::kLong ? torch::randint(-1000, 1000, {33, 17}, torch::kLong)
                                      : torch::randn({33, 17}).to(dtype);
    const std::string name = c10::toString(dtype);
    cases.emplace_back(name + " contiguous", base);
    cases.emplace_back(name + " transposed", base.t());                       // dense, not contiguous
    cases.emplace_back(name + " strided slice", base.slice(1, 0, 17, 2));    // not dense
    cases.emplace_back(name + " zero-sized", base.narrow(0, 0, 0));
  }
  return cases;
}

void check_round_trip(engine& e, tier first) {
  for (const auto& [name, t] : round_trip_cases()) {
    INFO(name << " via " << memscale::offload::to_string(first));
    auto stored = e.store(t, first);
    auto back = e.load(stored);
    CHECK(back.scalar_type() == t.scalar_type());
    CHECK(back.sizes() == t.sizes());
    CHECK(back.device() == t.device());
    if (t.is_non_overlapping_and_dense()) CHECK(back.strides() == t.strides());
    CHECK(torch::equal(back, t));
    CHECK(torch::equal(e.load(stored), t));  // a second unpack (retain_graph) too
  }
}

}  // namespace

// --- saved-tensor hooks ------------------------------------------------------------

TEST_CASE("installing the hooks engine leaves a step's gradients bit-identical", "[offload][hooks]") {
  using torch::autograd::Engine;
  torch::manual_seed(1);
  hooks_model m;
  auto x = torch::randn({12, 16});
  torch::autograd::set_default_engine_stub(&Engine::get_base_engine);  // as if memscale never ran
  REQUIRE_FALSE(memscale::offload::hooks_engine_active());
  const auto base = hooks_step(m, x);
  memscale::offload::install_hooks_engine();
  torch::autograd::set_default_engine_stub(&memscale::offload::detail::hooks_engine::instance);
  REQUIRE(memscale::offload::hooks_engine_active());
  const auto with_engine = hooks_step(m, x);
  CHECK(test::bit_equal(base, with_engine));

  // Hooks that copy every saved tensor change nothing either.
  int packs = 0;
  int unpacks = 0;
  std::vector<torch::Tensor> with_hooks;
  {
    memscale::offload::saved_tensors_hooks scope([&](const at::Tensor& t) { return (++packs, t.clone()); },
                                                 [&](at::Tensor& t) { return (++unpacks, t); });
    with_hooks = hooks_step(m, x);
  }
  CHECK(packs > 0);
  CHECK(unpacks > 0);
  CHECK(test::bit_equal(base, with_hooks));
}

TEST_CASE("saved-tensor hook scopes nest, innermost first, and stay on their thread", "[offload][hooks]") {
  auto w = torch::randn({4, 4}, torch::requires_grad());
  auto x = torch::randn({3, 4});
  std::vector<std::string> seen;
  auto tagged = [&](std::string tag) {
    return [&seen, tag](const at::Tensor& t) {
      seen.push_back(tag);
      return t;
    };
  };
  auto same = [](at::Tensor& t) { return t; };
  torch::Tensor loss;
  {
    memscale::offload::saved_tensors_hooks outer(tagged("outer"), same);
    {
      memscale::offload::saved_tensors_hooks inner(tagged("inner"), same);
      loss = x.mm(w).sum();  // mm saves its inputs here
    }
    REQUIRE_FALSE(seen.empty());
    CHECK(std::all_of(seen.begin(), seen.end(), [](const auto& s) { return s == "inner"; }));
    seen.clear();
    loss = loss + x.mm(w).sum();
    CHECK(std::all_of(seen.begin(), seen.end(), [](const auto& s) { return s == "outer"; }));
    seen.clear();
    std::thread other([&] { (void)x.mm(w).sum(); });  // no scope on that thread
    other.join();
    CHECK(seen.empty());
  }
  loss.backward();
  CHECK(w.grad().defined());
}

// --- the engine ------------------------------------------------------------------

TEST_CASE("every tier returns every dtype and layout bit-identical", "[offload][engine]") {
  for (bool async : {false, true}) {
    INFO((async ? "async" : "synchronous"));
    engine e(quiet_options({.async = async}));
    check_round_trip(e, tier::pageable_host);
    check_round_trip(e, tier::disk);
    check_round_trip(e, tier::pinned_host);  // pinned or, where it cannot be had, pageable
    e.wait_idle();
    CHECK(e.stats().at(tier::disk).tensors >= 16);
  }
}

TEST_CASE("a full tier spills to the next; with all full the tensor stays", "[offload][engine]") {
  const auto t = torch::randn({256, 256});  // 256 KiB
  const std::int64_t bytes = t.numel() * 4;
  engine e(quiet_options({.host_bytes = 2 * bytes, .disk_bytes = bytes}));
  std::vector<memscale::offload::stored_handle> kept;
  for (int i = 0; i < 4; ++i) kept.push_back(e.store(t, tier::pageable_host));
  CHECK(kept[0]->where() == tier::pageable_host);
  CHECK(kept[1]->where() == tier::pageable_host);
  CHECK(kept[2]->where() == tier::disk);
  CHECK(kept[3]->where() == tier::device);  // nothing left: it stays where it was
  for (const auto& k : kept) CHECK(torch::equal(e.load(k), t));
  auto stats = e.stats();
  CHECK(stats.at(tier::pageable_host).bytes == 2 * bytes);
  CHECK(stats.spills == 1);
  kept.clear();  // records free their tiers
  stats = e.stats();
  CHECK(stats.at(tier::pageable_host).bytes == 0);
  CHECK(stats.at(tier::disk).bytes == 0);
  CHECK(stats.at(tier::pageable_host).peak == 2 * bytes);
}

TEST_CASE("the pinned pool reuses freed blocks and keeps within its capacity", "[offload][engine]") {
  int allocations = 0;
  // Pageable blocks stand in for pinned ones: the pool's bookkeeping is the same.
  memscale::offload::pinned_pool pool(1 << 20, [&](std::int64_t bytes) {
    ++allocations;
    return at::empty({bytes}, at::kByte);
  });
  bool failed = false;
  auto a = pool.acquire(100 * 1024, failed);  // size class 128 KiB
  REQUIRE(a);
  CHECK(a->numel() == 128 * 1024);
  const void* first = a->data_ptr();
  pool.release(std::move(*a));
  CHECK(pool.cached_bytes() == 128 * 1024);
  auto again = pool.acquire(120 * 1024, failed);  // same class: the cached block comes back
  REQUIRE(again);
  CHECK(again->data_ptr() == first);
  CHECK(allocations == 1);
  auto big = pool.acquire(900 * 1024, failed);  // 1 MiB class: over capacity with the block in use
  CHECK_FALSE(big);
  CHECK_FALSE(failed);  // refused for room, not an allocation failure
  pool.release(std::move(*again));
  auto fits = pool.acquire(900 * 1024, failed);  // the cached 128 KiB block is dropped to make room
  REQUIRE(fits);
  CHECK(pool.cached_bytes() == 0);
  CHECK(pool.in_use_bytes() == 1 << 20);
  CHECK(allocations == 2);
}

TEST_CASE("a failed pinned allocation falls back to pageable memory", "[offload][engine][faults]") {
  memscale::detail::inject_fault fault(memscale::detail::offload_fault::pinned_alloc);
  engine e(quiet_options());
  const auto t = torch::randn({64, 64});
  auto stored = e.store(t, tier::pinned_host);
  CHECK(stored->where() == tier::pageable_host);
  CHECK(torch::equal(e.load(stored), t));
  const auto stats = e.stats();
  CHECK(stats.pinned_failures == 1);
  REQUIRE(stats.warnings.size() == 1);
  CHECK(stats.warnings[0].find("pinned") != std::string::npos);
}

TEST_CASE("an unwritable or full disk tier warns and keeps the tensor", "[offload][engine][faults]") {
  const auto t = torch::randn({128, 64});
  SECTION("unwritable directory (injected)") {
    memscale::detail::inject_fault fault(memscale::detail::offload_fault::disk_unwritable);
    engine e(quiet_options());
    auto stored = e.store(t);
    CHECK(stored->where() == tier::device);
    CHECK(torch::equal(e.load(stored), t));
    CHECK(e.stats().disk_failures == 1);
    CHECK(e.stats().warnings.at(0).find("unwritable") != std::string::npos);
  }
  SECTION("the directory's parent is a regular file (a real failure, even as root)") {
    const auto file = fs::temp_directory_path() / "memscale-test-not-a-directory";
    std::ofstream(file) << "x";
    engine e(quiet_options({.disk_dir = file.string()}));
    auto stored = e.store(t);
    CHECK(stored->where() == tier::device);
    CHECK(torch::equal(e.load(stored), t));
    CHECK(e.stats().warnings.at(0).find("disk offload tier unavailable") != std::string::npos);
    fs::remove(file);
  }
  for (bool async : {false, true}) {
    SECTION(std::string("disk full (injected), ") + (async ? "async" : "synchronous")) {
      memscale::detail::inject_fault fault(memscale::detail::offload_fault::disk_full);
      engine e(quiet_options({.async = async}));
      auto stored = e.store(t);
      e.wait_idle();
      CHECK(stored->where() == tier::device);
      CHECK(torch::equal(e.load(stored), t));
      CHECK(e.stats().disk_failures == 1);
      CHECK(e.stats().at(tier::disk).bytes == 0);
      CHECK(e.stats().warnings.at(0).find("no space left") != std::string::npos);
    }
  }
}

TEST_CASE("the disk tier's directory is removed once the engine and its tensors are gone", "[offload][engine]") {
  const auto parent = fs::temp_directory_path() / "memscale-test-disk-parent";
  fs::create_directories(parent);
  const auto t = torch::randn({32, 32});
  memscale::offload::stored_handle survivor;
  fs::path dir;
  {
    auto e = std::make_shared<engine>(quiet_options({.disk_dir = parent.string()}));
    survivor = e->store(t);
    dir = e->disk_directory();
    REQUIRE(fs::is_directory(dir));
    CHECK(dir.parent_path() == parent);
    CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator()) == 1);
  }
  CHECK(fs::is_directory(dir));  // a tensor still lives there
  survivor.reset();
  CHECK_FALSE(fs::exists(dir));
  fs::remove_all(parent);
}

TEST_CASE("small tensors travel together in one staging buffer and come back bit-identical",
          "[offload][engine]") {
  for (bool async : {false, true}) {
    INFO((async ? "async" : "synchronous"));
    engine e(quiet_options({.batch_below_bytes = 1 << 20, .async = async}));
    e.begin_group();
    const auto cases = round_trip_cases();
    std::vector<memscale::offload::stored_handle> stored;
    for (const auto& [name, t] : cases) stored.push_back(e.store_or_defer(t));
    CHECK(torch::equal(e.load(stored[0]), cases[0].second));  // before the flush: still in place
    e.flush();
    e.wait_idle();
    auto stats = e.stats();
    CHECK(stats.batches == 1);
    CHECK(stats.batched_tensors == static_cast<std::int64_t>(cases.size()));
    CHECK(stats.at(tier::disk).tensors == 1);  // one file for the whole group
    for (std::size_t i = 0; i < cases.size(); ++i) {
      INFO(cases[i].first);
      CHECK(stored[i]->batched());
      CHECK(stored[i]->where() == tier::disk);
      const auto back = e.load(stored[i]);
      CHECK(back.scalar_type() == cases[i].second.scalar_type());
      if (cases[i].second.is_non_overlapping_and_dense()) CHECK(back.strides() == cases[i].second.strides());
      CHECK(torch::equal(back, cases[i].second));
    }
    CHECK(e.stats().bytes_read > 0);
  }
}

TEST_CASE("async writes beyond max_inflight_bytes wait, and lose nothing", "[offload][engine]") {
  engine e(quiet_options({.async = true, .max_inflight_bytes = 1}));  // one write in flight at a time
  std::vector<torch::Tensor> originals;
  std::vector<memscale::offload::stored_handle> stored;
  for (int i = 0; i < 8; ++i) {
    originals.push_back(torch::randn({256, 256}));
    stored.push_back(e.store(originals.back()));
  }
  e.wait_idle();
  for (std::size_t i = 0; i < stored.size(); ++i) {
    CHECK(stored[i]->where() == tier::disk);
    CHECK(torch::equal(e.load(stored[i]), originals[i]));
  }
  CHECK(e.stats().at(tier::disk).tensors == 8);
}

TEST_CASE("async loads prefetch earlier groups in backward order", "[offload][engine]") {
  engine e(quiet_options({.async = true, .io_threads = 2, .prefetch_depth = 2}));
  std::vector<torch::Tensor> originals;
  std::vector<memscale::offload::stored_handle> stored;
  for (int g = 0; g < 6; ++g) {
    e.begin_group();
    originals.push_back(torch::randn({128, 128}));
    stored.push_back(e.store(originals.back()));
  }
  e.wait_idle();
  for (int g = 5; g >= 0; --g) {
    CHECK(torch::equal(e.load(stored[static_cast<std::size_t>(g)]), originals[static_cast<std::size_t>(g)]));
    e.wait_idle();  // let the prefetch of the next groups land before asking for them
  }
  const auto stats = e.stats();
  CHECK(stats.prefetch_misses == 1);  // only the last group, which nothing prefetched
  CHECK(stats.prefetch_hits == 5);
  CHECK(stats.hidden_fraction() > 0.5);
}

TEST_CASE("the offload settings map from the Config and are validated", "[offload][api]") {
  memscale::Config c;
  c.max_cpu_offload_gb = 2.0;
  c.async_offload = true;
  c.async_config = memscale::AsyncOffloadConfig{.prefetch_depth = 3, .pinned_pool_mb = 64.0, .io_threads = 4,
                                               .disk_dir = "/tmp", .max_disk_offload_gb = 1.5,
                                               .min_offload_kb = 16.0, .batch_below_kb = 256.0};
  const auto o = memscale::offload::options_from(c);
  CHECK(o.async);
  CHECK(o.host_bytes == 2LL << 30);
  CHECK(o.disk_bytes == 3LL << 29);
  CHECK(o.pinned_bytes == 64LL << 20);
  CHECK(o.min_bytes == 16 * 1024);
  CHECK(o.batch_below_bytes == 256 * 1024);
  CHECK(o.io_threads == 4);
  CHECK(o.prefetch_depth == 3);
  CHECK(o.disk_dir == "/tmp");
  auto bad = [](auto edit, const std::string& field) {
    memscale::Config cfg;
    cfg.async_config = memscale::AsyncOffloadConfig{};
    edit(*cfg.async_config);
    try {
      cfg.validate();
      FAIL("no ConfigError for " << field);
    } catch (const memscale::ConfigError& e) {
      CHECK(e.field() == field);
    }
  };
  bad([](auto& a) { a.max_disk_offload_gb = -1.0; }, "async_config.max_disk_offload_gb");
  bad([](auto& a) { a.min_offload_kb = std::nan(""); }, "async_config.min_offload_kb");
  bad([](auto& a) { a.batch_below_kb = -2.0; }, "async_config.batch_below_kb");
}

TEST_CASE("a graph dropped without backward frees what it saved, offloaded or kept", "[offload][engine]") {
  memory_tracker::install();
  auto w = torch::randn({512, 512}, torch::requires_grad());
  auto x = torch::randn({512, 512});
  for (std::int64_t min_bytes : {std::int64_t{0}, std::int64_t{1} << 30}) {  // offloaded; kept on the device
    INFO("min_bytes " << min_bytes);
    auto e = std::make_shared<engine>(quiet_options({.min_bytes = min_bytes}));
    const auto before = memory_tracker::current_bytes();
    {
      // relu and sigmoid save their outputs: a record or a kept tensor holding an
      // output with its grad_fn would own the node that owns it, and never go.
      auto y = memscale::with_offload(e, [&] { return x.mm(w).relu().sigmoid().sum(); });
      CHECK(memory_tracker::current_bytes() > before);
    }
    CHECK(memory_tracker::current_bytes() - before < 64 * 1024);
    CHECK(e->stats().at(tier::disk).bytes == 0);
  }
}

TEST_CASE("a tensor kept by an offload scope and then modified in place is refused in backward",
          "[offload][engine]") {
  auto e = std::make_shared<engine>(quiet_options({.min_bytes = std::int64_t{1} << 30}));
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto h = torch::randn({4, 8});
  torch::Tensor loss;
  memscale::with_offload(e, [&] {
    loss = h.mm(w).sum();  // mm saves h for w's gradient
    return 0;
  });
  h.add_(1.0);  // what backward would read is no longer what forward saw
  CHECK_THROWS_WITH(loss.backward(), Catch::Contains("modified in place"));
}

// --- the technique ----------------------------------------------------------------

namespace {

test::measured_step run_flat(const std::optional<memscale::Config>& config, std::uint64_t seed = 10) {
  memory_tracker::install();
  torch::manual_seed(seed);
  auto model = test::flat_chain(4, 128, 512, 0.1);
  torch::manual_seed(seed + 1);
  auto x = torch::randn({8, 64, 128}, torch::requires_grad());
  return test::measure_step(model, x, config);
}

}  // namespace

TEST_CASE("offloading a chain's saved activations to disk halves the step's peak, bit-identically",
          "[offload][acceptance]") {
  const auto baseline = run_flat(std::nullopt);
  for (bool async : {false, true}) {
    INFO((async ? "async" : "synchronous"));
    auto config = test::quiet({.mode = OptimizationMode::Aggressive, .enable_checkpointing = false});
    config.async_offload = async;
    const auto offloaded = run_flat(config);
    INFO("baseline " << baseline.peak_growth << " B, offloaded " << offloaded.peak_growth << " B\n"
                     << offloaded.report);
    REQUIRE(offloaded.offload);
    CHECK(offloaded.report.checkpointed_segments() == 0);
    CHECK(offloaded.report.offloaded_units() >= 10);
    CHECK_THAT(offloaded.report.str(), Catch::Contains("R8 offload-segment"));
    CHECK(offloaded.offload->at(tier::disk).tensors > 0);
    CHECK(offloaded.peak_growth <= baseline.peak_growth / 2);
    CHECK(test::bit_equal(baseline.result.first, offloaded.result.first));
    CHECK(test::bit_equal(baseline.result.second, offloaded.result.second));
  }
}

TEST_CASE("checkpoint plus offload moves the kept segment inputs too, bit-identically", "[offload][acceptance]") {
  const auto baseline = run_flat(std::nullopt);
  const auto checkpointed =
      run_flat(test::quiet({.mode = OptimizationMode::Aggressive, .enable_offloading = false}));
  const auto both = run_flat(test::quiet({.mode = OptimizationMode::Aggressive}));
  INFO("baseline " << baseline.peak_growth << " B, checkpoint " << checkpointed.peak_growth
                   << " B, checkpoint+offload " << both.peak_growth << " B\n"
                   << both.report);
  REQUIRE(both.offload);
  CHECK(both.report.checkpointed_segments() > 0);
  CHECK(both.report.offloaded_units() > 0);
  CHECK(both.offload->at(tier::disk).tensors > 0);
  CHECK(both.report.planned_peak_bytes() < checkpointed.report.planned_peak_bytes());
  CHECK(both.peak_growth <= checkpointed.peak_growth);
  CHECK(test::bit_equal(baseline.result.second, both.result.second));
  CHECK(test::bit_equal(baseline.result.first, both.result.first));
}

TEST_CASE("offload with Balanced acts only where checkpointing does not meet the budget", "[offload][engine]") {
  // A generous budget: checkpointing (or nothing) suffices, so nothing is offloaded.
  const auto roomy = run_flat(test::quiet({.mode = OptimizationMode::Balanced, .memory_budget_gb = 64.0}));
  CHECK(roomy.report.offloaded_units() == 0);
  CHECK_FALSE(roomy.offload.has_value());
  // Strategy without Offload: never offloaded, whatever the mode.
  torch::manual_seed(3);
  auto model = test::flat_chain(2, 64, 256, 0.0);
  auto x = torch::randn({4, 32, 64});
  auto guard = memscale::optimize<memscale::Strategy<memscale::Checkpoint>>(
      model, x, test::quiet({.mode = OptimizationMode::Aggressive}));
  CHECK(guard.report().offloaded_units() == 0);
}

TEST_CASE("offload planned lazily at the first training forward is bit-identical too", "[offload]") {
  torch::manual_seed(21);
  auto reference = test::flat_chain(2, 128, 512, 0.1);
  torch::manual_seed(21);
  auto model = test::flat_chain(2, 128, 512, 0.1);
  auto x = torch::randn({8, 64, 128});
  auto loss = [&](torch::nn::Sequential& m) { return [&] { return m->forward(x).pow(2).mean(); }; };
  const auto base = test::step(*reference, loss(reference));
  (void)memscale::wrap(model, test::quiet({.mode = OptimizationMode::Aggressive, .enable_checkpointing = false}));
  const auto first = test::step(*model, loss(model));   // plans, then runs with offload
  const auto second = test::step(*model, loss(model));  // runs as planned
  const auto stats = memscale::offload_stats(model);
  REQUIRE(stats);
  CHECK(stats->at(tier::disk).tensors > 0);
  CHECK(test::bit_equal(base.second, first.second));
  CHECK(test::bit_equal(base.second, second.second));
  CHECK(memscale::detach(model));
  CHECK_FALSE(memscale::offload_stats(model));
}

TEST_CASE("detach removes the offload wrappers and restores the model", "[offload]") {
  torch::manual_seed(5);
  auto model = test::flat_chain(2, 64, 256, 0.0);
  const auto before = test::slot_identity(*model);
  const auto params = test::parameter_identity(*model);
  auto x = torch::randn({4, 32, 64});
  {
    auto guard = memscale::optimize(
        model, x, test::quiet({.mode = OptimizationMode::Aggressive, .enable_checkpointing = false}));
    CHECK(guard.report().offloaded_units() > 0);
    CHECK(test::slot_identity(*model) != before);
  }
  CHECK(test::slot_identity(*model) == before);
  CHECK(test::parameter_identity(*model) == params);
}

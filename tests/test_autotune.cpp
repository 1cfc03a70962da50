// memscale::autotune: the winner fits the budget the baseline does not and
// trains within it; an out-of-memory in the middle of a trial is survived with
// the model, gradients, buffers, RNG and optimizer exactly as they were; the
// cache answers a second call at once, re-tunes on a changed key and survives a
// corrupt file; the JSON form round-trips; bad input is refused before
// anything changes.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <unistd.h>

#include <memscale/predict/outside_memo.hpp>

#include "test_support.hpp"

namespace {

using memscale::memory_tracker;
using memscale::TrialOutcome;

/// A directory of its own under the temp dir, removed at the end.
struct temporary_directory {
  std::filesystem::path path;
  temporary_directory()
      : path(std::filesystem::temp_directory_path() /
             ("memscale-autotune-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++))) {
    std::filesystem::create_directories(path);
  }
  ~temporary_directory() {
    memscale::detail::remove_tree(path);
  }
  static int& counter() {
    static int n = 0;
    return n;
  }
};

const auto mean_square = [](const torch::Tensor& y) { return y.pow(2).mean(); };

/// A budget between the baseline's predicted peak and Aggressive's, in GB.
double budget_between(torch::nn::Sequential& model, const torch::Tensor& x, const torch::optim::Optimizer& optimizer) {
  const auto p = memscale::predict(model, x, optimizer, mean_square,
                                   test::quiet({.mode = memscale::OptimizationMode::Aggressive,
                                                .enable_offloading = false, .force_optimize = true}));
  INFO(p);
  REQUIRE(p.plan_applies);
  REQUIRE(p.peak_bytes < p.baseline_peak_bytes);
  return 0.5 * static_cast<double>(p.baseline_peak_bytes + p.peak_bytes) / double(1 << 30);
}

memscale::TuneOptions quick(const std::filesystem::path& cache) {
  memscale::TuneOptions o;
  o.modes = {memscale::OptimizationMode::Balanced, memscale::OptimizationMode::Aggressive};
  o.time_budget_seconds = 120.0;
  o.cache_file = cache.string();
  o.progress = memscale::TuneProgress::never;
  return o;
}

}  // namespace

TEST_CASE("autotune's winner fits a budget the baseline does not, and trains within it", "[autotune]") {
  memory_tracker::install();
  memscale::fix_malloc_mmap_threshold();
  torch::manual_seed(3);
  auto model = test::flat_chain(4, 64, 512, 0.1);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto x = torch::randn({1024, 64});
  // A first step: oneDNN's and BLAS's buffers are made at their first use, in
  // any process; the budget is then measured against what a step holds.
  mean_square(model->forward(x)).backward();
  test::clear_grads(*model);
  const auto budget_gb = budget_between(model, x, optimizer);
  const test::model_state before(*model);

  temporary_directory dir;
  const auto result = memscale::autotune(model, x, optimizer, mean_square,
                                         test::quiet({.enable_offloading = false, .memory_budget_gb = budget_gb}),
                                         quick(dir.path / "cache.json"));
  INFO(result);
  CHECK(test::model_state(*model) == before);
  CHECK(optimizer.state().empty());  // the user's optimizer never stepped
  if (test::under_address_sanitizer) {
    WARN("the trials measure the process, which under AddressSanitizer holds its shadow memory: no winner to check");
    return;
  }
  REQUIRE(result.found);
  const auto* winner = result.winner();
  REQUIRE(winner != nullptr);
  CHECK(winner->outcome == TrialOutcome::fits);
  CHECK(winner->measured_peak_bytes <= result.budget_bytes);
  CHECK(result.best.mode == winner->config.mode);
  CHECK(result.best_batch_size == 1024);
  CHECK(!result.from_cache);

  // The plan without any technique does not fit: it is pruned (or, if the
  // predictor let it through, measured over the budget or stopped by the hard limit).
  const auto& none = result.trials.front();
  CHECK(none.label == "no technique");
  CHECK((none.outcome == TrialOutcome::pruned || none.outcome == TrialOutcome::over_budget ||
         none.outcome == TrialOutcome::out_of_memory));
  // Every trial that ran carries the predictor's figure beside the measured one.
  int ran = 0;
  for (const auto& t : result.trials)
    if (t.outcome == TrialOutcome::fits || t.outcome == TrialOutcome::over_budget) {
      ++ran;
      CHECK(t.predicted_peak_bytes > 0);
      CHECK(t.allocator_peak_bytes > 0);
      CHECK(t.measured_peak_bytes >= t.allocator_peak_bytes);
      CHECK(t.samples_per_second > 0.0);
    }
  CHECK(ran >= 1);

  // Training with the winner stays under the budget's hard limit (the model's
  // parameters count in the budget and are live already).
  {
    auto guard = memscale::optimize(model, x, result.best);
    std::int64_t model_bytes = 0;
    for (const auto& p : model->parameters()) model_bytes += static_cast<std::int64_t>(p.nbytes());
    memory_tracker::hard_limit_scope hard(memory_tracker::current_bytes() + result.budget_bytes - model_bytes);
    for (int step = 0; step < 3; ++step) {
      optimizer.zero_grad();
      CHECK_NOTHROW(mean_square(model->forward(x)).backward());
      optimizer.step();
    }
  }
}

TEST_CASE("autotune survives an out-of-memory in the middle of a trial and leaves everything as it was",
          "[autotune][oom]") {
  memory_tracker::install();
  torch::manual_seed(4);
  auto model = test::flat_chain(3, 64, 256, 0.1);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  const auto x = torch::randn({64, 64});
  // The user has trained a step: gradients and optimizer state exist.
  mean_square(model->forward(x)).backward();
  optimizer.step();
  const test::model_state before(*model);
  const auto state_before = test::optimizer_state(optimizer);
  REQUIRE(!state_before.empty());

  // A loss that, at its second call at the full batch (the second step of the
  // first trial: parameters and the shadow optimizer's state already stepped,
  // the graph alive), fails: by asking for more than the budget (the tracker's
  // hard limit throws c10::OutOfMemoryError there, a real allocation failure),
  // or by throwing something that is not a std::exception at all.
  const bool out_of_memory = GENERATE(true, false);
  int full_batch_calls = 0;
  const auto bomb = [&](const torch::Tensor& y) {
    if (y.size(0) == x.size(0) && ++full_batch_calls == 2) {
      if (!out_of_memory) throw 42;
      (void)torch::empty({std::int64_t{1} << 33}, torch::kByte);
    }
    return mean_square(y);
  };
  temporary_directory dir;
  auto options = quick(dir.path / "cache.json");
  options.modes = {memscale::OptimizationMode::Aggressive};
  const auto result =
      memscale::autotune(model, x, optimizer, bomb,
                         test::quiet({.enable_offloading = false, .force_optimize = true, .memory_budget_gb = 1.0}),
                         options);
  INFO(result);
  REQUIRE(result.trials.size() >= 2);
  if (out_of_memory) {
    CHECK(result.trials[0].outcome == TrialOutcome::out_of_memory);
    CHECK(result.trials[0].detail.find("hard_limit_scope") != std::string::npos);
  } else {
    CHECK(result.trials[0].outcome == TrialOutcome::failed);
    CHECK(result.trials[0].detail.find("not derived from std::exception") != std::string::npos);
  }
  CHECK(result.trials[1].outcome == TrialOutcome::fits);  // the search went on
  CHECK(result.found);
  CHECK(result.best_trial == 1);

  CHECK(test::model_state(*model) == before);  // parameters, gradients, buffers, RNG
  CHECK(test::bit_equal(test::optimizer_state(optimizer), state_before));
  CHECK(!memscale::is_optimized(model));
  CHECK(!memory_tracker::hard_limit());
}

TEST_CASE("a GPU trial's host parking seeds the shadow with a copy of the state and puts every optimizer "
          "type's state back bit-identical, stepping on alike",
          "[autotune]") {
  // On CUDA, autotune moves the caller's optimizer state to the host for each trial through each state's own
  // serialize(), and gives the trial's shadow optimizer a copy of it (trial.hpp's host_parking). Here on the
  // CPU the state is reloaded as copies on the host: the same round trip, minus the device.
  using namespace torch::optim;
  const int kind = GENERATE(range(0, 6));
  const auto make = [kind](const std::vector<torch::Tensor>& ps) -> std::unique_ptr<Optimizer> {
    switch (kind) {
      case 0: return std::make_unique<SGD>(ps, SGDOptions(0.1).momentum(0.9));
      case 1: return std::make_unique<Adam>(ps, AdamOptions(1e-3));
      case 2: return std::make_unique<AdamW>(ps, AdamWOptions(1e-3).amsgrad(true));
      case 3: return std::make_unique<Adagrad>(ps, AdagradOptions(1e-2));
      case 4: return std::make_unique<RMSprop>(ps, RMSpropOptions(1e-3).momentum(0.9).centered(true));
      default: return std::make_unique<memscale::optim::AdamW8bit>(ps, memscale::optim::AdamW8bitOptions(1e-3));
    }
  };
  INFO("optimizer kind " << kind);
  torch::manual_seed(6);
  auto parked_model = test::flat_chain(2, 64, 256, 0.0);
  torch::manual_seed(6);
  auto twin_model = test::flat_chain(2, 64, 256, 0.0);
  auto parked = make(parked_model->parameters());
  auto twin = make(twin_model->parameters());
  const auto x = torch::randn({32, 64});
  const auto steps = [&](int n) {
    for (int s = 0; s < n; ++s) {
      parked->zero_grad(), twin->zero_grad();
      mean_square(parked_model->forward(x)).backward();
      mean_square(twin_model->forward(x)).backward();
      parked->step(), twin->step();
    }
  };
  steps(1);
  const auto state = test::optimizer_state(*parked);
  REQUIRE(!state.empty());
  const auto one_state_tensor = [&]() -> torch::Tensor {  // the first parameter's, for the built-in types
    auto* s = parked->state().begin()->second.get();
    if (auto* a = dynamic_cast<AdamWParamState*>(s)) return a->exp_avg();
    if (auto* a = dynamic_cast<AdamParamState*>(s)) return a->exp_avg();
    if (auto* a = dynamic_cast<SGDParamState*>(s)) return a->momentum_buffer();
    if (auto* a = dynamic_cast<AdagradParamState*>(s)) return a->sum();
    if (auto* a = dynamic_cast<RMSpropParamState*>(s)) return a->square_avg();
    return {};
  };
  const auto before = one_state_tensor();
  {
    memscale::core::verify::sandbox box(*parked_model);
    const memscale::autotuning::detail::host_parking parking(box, *parked, c10::Device(torch::kCPU));
    if (before.defined()) CHECK(one_state_tensor().data_ptr() != before.data_ptr());  // reloaded on the host
    CHECK(test::bit_equal(test::optimizer_state(*parked), state));
    // The shadow starts from a copy and steps it, leaving the caller's state alone.
    memscale::autotuning::detail::parameter_snapshot parameters(parked_model->parameters());  // back at the end
    auto shadow = memscale::autotuning::detail::shadow_optimizer(*parked, false);  // Adagrad's has state already
    parking.seed(*shadow);
    CHECK(test::bit_equal(test::optimizer_state(*shadow), state));
    shadow->zero_grad();
    mean_square(parked_model->forward(x)).backward();
    shadow->step();
    shadow->zero_grad();
    CHECK_FALSE(test::bit_equal(test::optimizer_state(*shadow), state));
    CHECK(test::bit_equal(test::optimizer_state(*parked), state));
  }
  CHECK(test::bit_equal(test::optimizer_state(*parked), state));
  {  // parking for another device: the state of these parameters, which live on the CPU, stays where it is
    const auto now = one_state_tensor();
    memscale::core::verify::sandbox box(*parked_model);
    const memscale::autotuning::detail::host_parking parking(box, *parked, c10::Device(torch::kCUDA, 0));
    if (now.defined()) CHECK(one_state_tensor().data_ptr() == now.data_ptr());
    CHECK(test::bit_equal(test::optimizer_state(*parked), state));
  }
  steps(2);
  CHECK(test::bit_equal(parked_model->parameters(), twin_model->parameters()));
  CHECK(test::bit_equal(test::optimizer_state(*parked), test::optimizer_state(*twin)));
}

TEST_CASE("autotune's cache: a second call returns at once, a changed key re-tunes, a corrupt file is ignored",
          "[autotune][cache]") {
  memory_tracker::install();
  torch::manual_seed(5);
  auto model = test::flat_chain(2, 32, 128, 0.0);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const auto x = torch::randn({32, 32});
  temporary_directory dir;
  const auto file = dir.path / "sub" / "autotune.json";  // the directory is created
  auto options = quick(file);
  options.modes = {memscale::OptimizationMode::Aggressive};
  const auto config = test::quiet({.enable_offloading = false, .memory_budget_gb = 1.0});

  int loss_calls = 0;
  const auto counted = [&](const torch::Tensor& y) {
    ++loss_calls;
    return mean_square(y);
  };
  const auto first = memscale::autotune(model, x, optimizer, counted, config, options);
  INFO(first);
  REQUIRE(first.found);
  REQUIRE(!first.from_cache);
  REQUIRE(loss_calls > 0);
  REQUIRE(std::filesystem::exists(file));

  loss_calls = 0;
  auto verifying = config;  // not in the key: the cached Config takes the caller's
  verifying.verify_correctness = true;
  const auto second = memscale::autotune(model, x, optimizer, counted, verifying, options);
  CHECK(second.from_cache);
  CHECK(loss_calls == 0);  // no trial, no prediction
  CHECK(second.cache_key == first.cache_key);
  CHECK(second.best_trial == first.best_trial);
  CHECK(second.best.mode == first.best.mode);
  CHECK(second.best.verify_correctness);
  CHECK(!first.best.verify_correctness);
  CHECK(second.trials.size() == first.trials.size());

  SECTION("a changed key re-tunes: another batch, another budget, another model") {
    const auto other_batch = memscale::autotune(model, torch::randn({48, 32}), optimizer, mean_square, config, options);
    CHECK(!other_batch.from_cache);
    auto smaller_budget = config;
    smaller_budget.memory_budget_gb = 0.5;
    const auto other_budget = memscale::autotune(model, x, optimizer, mean_square, smaller_budget, options);
    CHECK(!other_budget.from_cache);
    CHECK(other_budget.cache_key != first.cache_key);
    torch::optim::SGD no_momentum(model->parameters(), torch::optim::SGDOptions(0.1));  // no momentum buffers
    CHECK(!memscale::autotune(model, x, no_momentum, mean_square, config, options).from_cache);
    auto other_model = test::flat_chain(3, 32, 128, 0.0);
    torch::optim::SGD other_optimizer(other_model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    const auto other = memscale::autotune(other_model, x, other_optimizer, mean_square, config, options);
    CHECK(!other.from_cache);
    // Both entries live in the one file: the first key still hits.
    CHECK(memscale::autotune(model, x, optimizer, mean_square, config, options).from_cache);
  }
  SECTION("a corrupt file is reported and ignored, moved aside (never overwritten) and a new one written") {
    for (const std::string& garbage : std::vector<std::string>{"{not json", "{\"my\": \"precious settings\"}", "[1, 2, 3]",
                                      "{\"format\": \"memscale-autotune-cache\", \"version\": \"1\"}",
                                      "{\"format\": \"memscale-autotune-cache\", \"version\": 1, \"entries\": "
                                      "{\"" + first.cache_key + "\": {\"key\": 3}}}"}) {
      std::ofstream(file, std::ios::trunc) << garbage;
      const auto again = memscale::autotune(model, x, optimizer, mean_square, config, options);
      INFO(garbage);
      INFO(again);
      CHECK(!again.from_cache);
      CHECK(again.found);
      bool reported = false;
      for (const auto& n : again.notes) reported = reported || n.find("ignored") != std::string::npos;
      CHECK(reported);
      // A file that is not a cache is kept aside; a cache with one malformed
      // entry is a cache: that entry is replaced.
      const auto aside = file.string() + ".corrupt";
      if (garbage.find("entries") == std::string::npos) {
        std::ifstream in(aside);
        CHECK(std::string(std::istreambuf_iterator<char>(in), {}) == garbage);
      } else {
        CHECK(!std::filesystem::exists(aside));
      }
      std::filesystem::remove(aside);
      CHECK(memscale::autotune(model, x, optimizer, mean_square, config, options).from_cache);  // rewritten
    }
  }
  SECTION("use_cache = false neither reads nor writes") {
    std::filesystem::remove(file);
    options.use_cache = false;
    const auto uncached = memscale::autotune(model, x, optimizer, mean_square, config, options);
    CHECK(!uncached.from_cache);
    CHECK(uncached.cache_file.empty());
    CHECK(!std::filesystem::exists(file));
  }
}

TEST_CASE("autotune's result round-trips through JSON, malformed JSON is a clear error", "[autotune]") {
  memscale::TuneResult r;
  r.found = true;
  r.best = memscale::Config{.mode = memscale::OptimizationMode::Aggressive, .use_mixed_precision = true,
                            .max_cpu_offload_gb = 2.5, .async_offload = true,
                            .async_config = memscale::AsyncOffloadConfig{.disk_dir = "/tmp/x"},
                            .memory_budget_gb = 1.25};
  r.best_batch_size = 48;
  r.best_trial = 1;
  r.budget_bytes = 123456789;
  memscale::TuneTrial a;
  a.label = "no technique";
  a.batch_size = 48;
  a.outcome = TrialOutcome::pruned;
  a.predicted_peak_bytes = 2000;
  memscale::TuneTrial b;
  b.config = r.best;
  b.label = "Aggressive checkpoint";
  b.batch_size = 48;
  b.outcome = TrialOutcome::fits;
  b.predicted_peak_bytes = 1000;
  b.measured_peak_bytes = 1010;
  b.allocator_peak_bytes = 900;
  b.step_seconds = 0.25;
  b.samples_per_second = 192.0;
  r.trials = {a, b};
  r.notes = {"a note"};

  const auto back = memscale::TuneResult::from_json(r.to_json());
  CHECK(back.to_json() == r.to_json());
  CHECK(back.best.async_config->disk_dir == "/tmp/x");
  CHECK(*back.best.memory_budget_gb == 1.25);
  CHECK(back.trials[1].prediction_error().value() == Approx(-10.0 / 1010.0));
  CHECK(r.to_json(-1).find('\n') == std::string::npos);

  CHECK_THROWS_WITH(memscale::TuneResult::from_json("{"), Catch::Contains("not valid JSON"));
  CHECK_THROWS_WITH(memscale::TuneResult::from_json("{\"found\": true}"), Catch::Contains("malformed"));
  auto bad_mode = nlohmann::json::parse(r.to_json());
  bad_mode["best"]["mode"] = "Fast";
  CHECK_THROWS_WITH(memscale::TuneResult::from_json(bad_mode.dump()), Catch::Contains("mode"));
  auto bad_value = nlohmann::json::parse(r.to_json());
  bad_value["best"]["target_gpu_utilization"] = 3.0;
  CHECK_THROWS_WITH(memscale::TuneResult::from_json(bad_value.dump()), Catch::Contains("target_gpu_utilization"));
  auto bad_winner = nlohmann::json::parse(r.to_json());
  bad_winner["best_trial"] = 0;  // pruned: not a winner
  CHECK_THROWS_WITH(memscale::TuneResult::from_json(bad_winner.dump()), Catch::Contains("outcome"));
}

TEST_CASE("autotune refuses bad input before it changes anything", "[autotune]") {
  torch::manual_seed(6);
  auto model = test::flat_chain(1);
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto x = torch::randn({8, 64});
  const test::model_state before(*model);
  memscale::TuneOptions o;
  o.use_cache = false;
  o.progress = memscale::TuneProgress::never;

  auto bad = o;
  bad.max_trials = 0;
  CHECK_THROWS_WITH(memscale::autotune(model, x, adamw, mean_square, test::quiet(), bad),
                    Catch::Contains("max_trials"));
  bad = o;
  bad.modes.clear();
  CHECK_THROWS_WITH(memscale::autotune(model, x, adamw, mean_square, test::quiet(), bad), Catch::Contains("modes"));
  bad = o;
  bad.batch_sizes = {16, 0};
  CHECK_THROWS_WITH(memscale::autotune(model, x, adamw, mean_square, test::quiet(), bad),
                    Catch::Contains("batch_sizes"));
  CHECK_THROWS_WITH(memscale::autotune(model, x, adamw, mean_square, test::quiet({.warmup_steps = -1}), o),
                    Catch::Contains("warmup_steps"));
  torch::optim::LBFGS lbfgs(model->parameters(), torch::optim::LBFGSOptions(1.0));
  CHECK_THROWS_WITH(memscale::autotune(model, x, lbfgs, mean_square, test::quiet(), o),
                    Catch::Contains("torch::optim::SGD, Adam, AdamW"));
  {
    auto guard = memscale::optimize(model, x, test::quiet());
    CHECK_THROWS_AS(memscale::autotune(model, x, adamw, mean_square, test::quiet(), o),
                    memscale::AlreadyOptimizedError);
  }
  CHECK(test::model_state(*model) == before);
}

TEST_CASE("a CPU trial counts what predict measured outside the allocator, made resident before the trial",
          "[autotune][process]") {
  memory_tracker::install();  // the trials' allocator peak
  memscale::fix_malloc_mmap_threshold();
  torch::manual_seed(5);
  auto model = test::flat_chain(3, 64, 256);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto x = torch::randn({256, 64});
  memscale::predictor::detail::outside_memo::process().forget();
  const auto share =
      memscale::predict(model, x, optimizer, mean_square, test::quiet()).baseline.outside_allocator_bytes;
  if (share < (std::int64_t{1} << 20) || test::under_sanitizer) {
    WARN("the process held what a step makes outside the allocator already (" << share << " B): run this case alone");
    return;
  }
  temporary_directory dir;
  auto options = quick(dir.path / "cache.json");
  options.use_cache = false;
  const auto result = memscale::autotune(model, x, optimizer, mean_square,
                                         test::quiet({.enable_offloading = false, .memory_budget_gb = 4.0}), options);
  INFO(result);
  // The first predict made those pages resident: no trial's own growth sees them,
  // and each trial's measure still holds them (the memo's total at the batch). The
  // share also has glibc's heap at the step's peak in it, which differs by plan: a
  // plan's figure holds at least the resident pages less the heap gain the first
  // calibration had in them (predict/run.hpp's `beneath`; an Aggressive trial read
  // 1,348 B under the baseline's share for that, 2026-12-02).
  auto& memo = memscale::predictor::detail::outside_memo::process();
  const auto key = memscale::predictor::detail::outside_memo_key(*model, x);
  const auto resident = memo.at(key, x.size(0)) - memo.heap_gain(key);
  CHECK(resident > share / 2);
  int ran = 0;
  for (const auto& t : result.trials)
    if (t.outcome == TrialOutcome::fits || t.outcome == TrialOutcome::over_budget) {
      ++ran;
      REQUIRE(t.allocator_peak_bytes > 0);
      CHECK(t.measured_peak_bytes - t.allocator_peak_bytes >= resident);
    }
  CHECK(ran >= 2);
  memscale::predictor::detail::outside_memo::process().forget();
}

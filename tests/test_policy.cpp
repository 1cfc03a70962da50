// Stage 1 (Config::auto_policy): who decides (user_config, rule, ml,
// rule_fallback), the caller's Config never changed, the CPU-with-budget path,
// and the trained policy's artifact loader fed truncated, corrupt, wrong-version
// and hostile input.
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "test_support.hpp"

#include "resnet.hpp"

#include <memscale/policy/trained_policy.hpp>

using memscale::Config;
using memscale::DecisionSource;
using memscale::OptimizationMode;

namespace {

/// A valid artifact whose bias makes candidate `k` win whatever the features.
std::string artifact_choosing(std::size_t k, long schema = memscale::StrategyContext::schema_version) {
  std::ostringstream os;
  os << "memscale-policy 1\nschema " << schema << " classes " << memscale::strategy_candidates.size() << " features "
     << memscale::StrategyContext::feature_count << "\ndataset test-0001\nmean";
  for (std::size_t f = 0; f < memscale::StrategyContext::feature_count; ++f) os << " 0";
  os << "\nscale";
  for (std::size_t f = 0; f < memscale::StrategyContext::feature_count; ++f) os << " 1";
  os << "\nweights\n";
  for (std::size_t c = 0; c < memscale::strategy_candidates.size(); ++c) {
    for (std::size_t f = 0; f < memscale::StrategyContext::feature_count; ++f) os << "0 ";
    os << (c == k ? 4.0 : 0.0) << "\n";
  }
  return os.str();
}

std::string policy_file(const std::string& name, const std::string& text) {
  const auto path = std::filesystem::temp_directory_path() / ("memscale_policy_" + name + ".txt");
  std::ofstream(path, std::ios::binary) << text;
  return path.string();
}

/// Plans a flat chain (reserve outside the allocator 0, so budgets are exact) and returns the report.
memscale::Report policy_plan(const Config& config) {
  memscale::core::profile_scale_scope no_reserve(1.0, 0);
  torch::manual_seed(3);
  auto model = test::flat_chain(4, 64, 256);
  auto guard = memscale::optimize(model, torch::randn({32, 16, 64}), config);
  return guard.report();
}

/// A budget whose Balanced target lies halfway between the chain's checkpoint
/// floor and its baseline: checkpointing alone reaches it, nothing else is needed.
double budget_between_floor_and_baseline() {
  const auto floor = policy_plan(test::quiet({.mode = OptimizationMode::Aggressive, .enable_offloading = false}));
  const double target = 0.5 * static_cast<double>(floor.planned_peak_bytes() + floor.baseline_peak_bytes());
  REQUIRE(floor.planned_peak_bytes() < floor.baseline_peak_bytes());
  return target / memscale::core::policy_for(OptimizationMode::Balanced).target_fraction / (1024.0 * 1024.0 * 1024.0);
}

}  // namespace

TEST_CASE("auto_policy off, or no memory limit: Stage 1 keeps the Config as written (user_config)", "[policy]") {
  const auto off = policy_plan(test::quiet({.mode = OptimizationMode::Aggressive}));
  CHECK(off.strategy.decision_source == DecisionSource::user_config);
  CHECK(off.strategy.reason.find("auto_policy is off") != std::string::npos);
  CHECK(off.strategy.effective.mode == OptimizationMode::Aggressive);
  CHECK(off.mode == OptimizationMode::Aggressive);
  CHECK_FALSE(off.strategy.context.has_value());

  // A CPU device and no memory_budget_gb: nothing to reason about.
  const auto no_limit = policy_plan(test::quiet({.mode = OptimizationMode::Aggressive, .auto_policy = true}));
  CHECK(no_limit.strategy.decision_source == DecisionSource::user_config);
  CHECK(no_limit.strategy.reason.find("no memory limit") != std::string::npos);
  CHECK(no_limit.mode == OptimizationMode::Aggressive);
  CHECK(no_limit.checkpointed_segments() == off.checkpointed_segments());
  std::ostringstream printed;
  printed << no_limit;
  CHECK(printed.str().find("strategy (Stage 1): user_config") != std::string::npos);
}

TEST_CASE("auto_policy off on the benchmark models' kinds: Stage 1 is not entered, under a budget too", "[policy]") {
  // The plan is the caller's Config's: the attachment plans with it as given and
  // never builds a StrategyContext (Stage 1 runs only with auto_policy).
  const auto check = [](auto& model, const torch::Tensor& x) {
    memscale::core::profile_scale_scope no_reserve(1.0, 0);
    for (const bool on : {false, true}) {
      const Config caller = test::quiet({.mode = OptimizationMode::Aggressive,
                                         .auto_policy = on,
                                         .policy = memscale::PolicyKind::rule,
                                         .memory_budget_gb = 0.01});
      auto guard = memscale::optimize(model, x, caller);
      const auto& s = guard.report().strategy;
      CHECK(s.context.has_value() == on);
      if (on) continue;
      CHECK(s.decision_source == DecisionSource::user_config);
      CHECK(guard.report().mode == OptimizationMode::Aggressive);
      CHECK(s.effective.mode == caller.mode);
      CHECK(s.effective.enable_checkpointing == caller.enable_checkpointing);
      CHECK(s.effective.enable_offloading == caller.enable_offloading);
      CHECK(s.effective.enable_tiling == caller.enable_tiling);
      CHECK(s.effective.memory_budget_gb == caller.memory_budget_gb);
    }
  };
  torch::manual_seed(4);
  auto flat = test::flat_chain(4, 64, 256);
  check(flat, torch::randn({32, 16, 64}));
  gpt::GPT decoder(test::small_gpt());
  check(decoder, torch::randint(256, {4, 64}, torch::kLong));
  resnet::ResNet cnn(2, 16);
  check(cnn, torch::randn({4, 3, 16, 16}));
}

TEST_CASE("auto_policy off: the plan is the rule engine's for the caller's Config, on each benchmark model's kind",
          "[policy]") {
  // Re-runs core::decide on the report's own profile with the engine input the
  // caller's Config gives (checkpointing only, so no offload room to rebuild):
  // the plan applied is exactly that, so Stage 1 changed nothing.
  const auto same_plan = [](auto& model, const torch::Tensor& x, int segment_limit) {
    memscale::core::profile_scale_scope no_reserve(1.0, 0);
    double budget_gb = 0.0;  // the static bytes and half the step's growth above them: the budget presses
    {
      auto unpressed = memscale::optimize(model, x, test::quiet({.mode = OptimizationMode::Conservative}));
      const auto r = unpressed.report();
      budget_gb = (static_cast<double>(r.static_bytes()) +
                   0.5 * static_cast<double>(r.baseline_peak_bytes() - r.static_bytes())) / (1024.0 * 1024.0 * 1024.0);
    }
    for (const auto mode : {OptimizationMode::Balanced, OptimizationMode::Aggressive}) {
      const Config caller = test::quiet({.mode = mode, .enable_offloading = false, .memory_budget_gb = budget_gb});
      auto guard = memscale::optimize(model, x, caller);
      const auto r = guard.report();
      REQUIRE(r.planned);
      memscale::core::engine_input in;
      in.mode = mode;
      in.usable_bytes = r.usable_bytes;
      in.static_bytes = r.static_bytes();
      std::vector<std::vector<memscale::slot_cost>> costs;
      std::vector<bool> supported;
      for (const auto& chain : r.chains) {
        costs.push_back(chain.slots);
        supported.push_back(chain.supported);
        in.segment_limit.push_back(segment_limit);
      }
      const auto expected = memscale::core::decide(costs, supported, in);
      INFO(r);
      CHECK(r.strategy.decision_source == DecisionSource::user_config);
      REQUIRE(expected.units.size() == r.plan.units.size());
      for (std::size_t c = 0; c < expected.units.size(); ++c) CHECK(expected.units[c] == r.plan.units[c]);
      CHECK(expected.planned_peak == r.plan.planned_peak);
      CHECK(r.checkpointed_segments() > 0);  // the budget presses: a plan to compare
    }
  };
  torch::manual_seed(6);
  auto flat = test::flat_chain(4, 64, 256);
  same_plan(flat, torch::randn({32, 16, 64}), 0);
  gpt::GPT decoder(test::small_gpt());
  same_plan(decoder, torch::randint(256, {4, 64}, torch::kLong), 1);
  resnet::ResNet cnn(2, 16);
  same_plan(cnn, torch::randn({8, 3, 32, 32}), 1);
}

TEST_CASE("a CPU with memory_budget_gb: the rule policy chooses, the caller's Config is not changed", "[policy]") {
  const double budget = budget_between_floor_and_baseline();
  const Config caller = test::quiet({.mode = OptimizationMode::Aggressive,
                                     .auto_policy = true,
                                     .policy = memscale::PolicyKind::rule,
                                     .memory_budget_gb = budget});
  const auto report = policy_plan(caller);
  const auto& s = report.strategy;
  CHECK(s.decision_source == DecisionSource::rule);
  INFO(s.str());
  REQUIRE(s.context.has_value());
  CHECK(s.context->budget_given);
  CHECK(s.context->checkpoint_floor_bytes <= s.context->target_bytes);
  CHECK(s.context->target_bytes < s.context->baseline_peak_bytes);
  // The least that fits: Balanced, checkpointing only.
  CHECK(s.choice == memscale::StrategyChoice{OptimizationMode::Balanced, true, false});
  CHECK(s.effective.mode == OptimizationMode::Balanced);
  CHECK_FALSE(s.effective.enable_offloading);
  CHECK(report.mode == OptimizationMode::Balanced);
  CHECK(report.offloaded_units() == 0);
  CHECK(report.checkpointed_segments() > 0);
  CHECK(report.planned_peak_bytes() <= s.context->target_bytes);
  // The caller's Config, as passed and as recorded, is unchanged.
  CHECK(s.caller.mode == OptimizationMode::Aggressive);
  CHECK(s.caller.enable_offloading);
  std::ostringstream printed;
  printed << report;
  CHECK(printed.str().find("effective Config: Balanced, checkpointing, no offloading; the caller's: Aggressive, "
                           "checkpointing, offloading") != std::string::npos);
}

TEST_CASE("the trained policy: an artifact chooses (ml), none shipped or a bad one falls back to the rules",
          "[policy]") {
  const double budget = budget_between_floor_and_baseline();
  auto config = test::quiet({.auto_policy = true, .memory_budget_gb = budget});

  // The artifact shipped in the headers: the trained policy chooses.
  const auto shipped = policy_plan(config);
  INFO(shipped.strategy.str());
  CHECK(shipped.strategy.decision_source == DecisionSource::ml);
  CHECK(shipped.strategy.reason.find("fnv1a64-") != std::string::npos);
  REQUIRE(shipped.strategy.confidence.has_value());
  CHECK(*shipped.strategy.confidence > 0.0);
  CHECK(*shipped.strategy.confidence <= 1.0);
  CHECK(shipped.mode == shipped.strategy.choice.mode);

  // An artifact that picks Aggressive with both techniques.
  config.policy_artifact = policy_file("aggressive", artifact_choosing(4));
  const auto ml = policy_plan(config);
  CHECK(ml.strategy.decision_source == DecisionSource::ml);
  CHECK(ml.strategy.choice == memscale::strategy_candidates[4]);
  REQUIRE(ml.strategy.confidence.has_value());
  CHECK(*ml.strategy.confidence > 0.9);
  CHECK(*ml.strategy.confidence < 1.0);
  CHECK(ml.mode == OptimizationMode::Aggressive);
  CHECK(ml.strategy.reason.find("test-0001") != std::string::npos);

  // Another feature schema, a missing file, a corrupt one: rule_fallback naming why.
  const std::vector<std::pair<std::string, std::string>> bad = {
      {policy_file("schema", artifact_choosing(4, 99)), "feature schema 99"},
      {(std::filesystem::temp_directory_path() / "memscale_policy_absent.txt").string(), "not a regular file"},
      {std::filesystem::temp_directory_path().string(), "not a regular file"},
      {policy_file("hostile_hash", "memscale-policy 1\nschema 1 classes 5 features 16\ndataset \x1b[2J\nmean 0"),
       "dataset hash"},
      {policy_file("corrupt", "memscale-policy 1\nschema 1 classes 5 features 16\ndataset x\nmean 0 0 zero"),
       "not a finite number"}};
  for (const auto& [path, why] : bad) {
    config.policy_artifact = path;
    const auto r = policy_plan(config);
    INFO(r.strategy.reason);
    CHECK(r.strategy.decision_source == DecisionSource::rule_fallback);
    CHECK(r.strategy.reason.find(why) != std::string::npos);
    CHECK(r.mode == OptimizationMode::Balanced);
  }
}

TEST_CASE("the shipped artifact loads and names the dataset kept in the repository", "[policy]") {
  const auto text = memscale::policy::shipped_artifact();
  REQUIRE(text.has_value());
  const auto artifact = memscale::policy::parse_artifact(*text);
  // tests/ -> the repository (a unity build keeps each file's own path in __FILE__).
  const auto dataset = std::filesystem::path(__FILE__).parent_path().parent_path() / "benchmarks/policy/dataset.csv";
  std::ifstream in(dataset, std::ios::binary);
  REQUIRE(in.good());
  CHECK(artifact.dataset == memscale::policy::dataset_hash(in));
}

TEST_CASE("the artifact loader, fuzzed: every input parses or throws PolicyFallbackNeeded", "[policy]") {
  namespace policy = memscale::policy;
  const auto valid = artifact_choosing(2);
  REQUIRE_NOTHROW(policy::parse_artifact(valid));
  memscale::StrategyContext context;
  context.usable_bytes = 1 << 30;
  context.baseline_peak_bytes = 3 << 29;
  int parsed = 0, refused = 0;
  const auto feed = [&](const std::string& text) {
    try {
      const auto a = policy::parse_artifact(text);
      const auto p = policy::predict_strategy(a, context);
      CHECK(p.confidence > 0.0);
      CHECK(p.confidence <= 1.0);
      ++parsed;
    } catch (const memscale::PolicyFallbackNeeded& e) {
      CHECK(std::string(e.what()).find("trained policy") != std::string::npos);
      ++refused;
    }
  };
  for (std::size_t n = 0; n < valid.size(); ++n) feed(valid.substr(0, n));  // every truncation
  std::mt19937 rng(20261125);
  for (int i = 0; i < 2000; ++i) {  // random byte changes, 1 to 4 of them
    auto text = valid;
    for (int k = 0, n = 1 + static_cast<int>(rng() % 4); k < n; ++k)
      text[rng() % text.size()] = static_cast<char>(rng() % 256);
    feed(text);
  }
  for (const char* hostile : {"", "memscale-policy", "memscale-policy 2", "memscale-policy 1 schema -1",
                              "memscale-policy 99999999999999999999999", "\x7f" "ELF\x02\x01\x01",
                              "memscale-policy 1 schema 1 classes 5 features 16 dataset d mean 1e400"})
    feed(hostile);
  auto huge = valid;
  huge.append(policy::artifact_max_bytes, ' ');
  feed(huge);
  auto nan_scale = valid;
  nan_scale.replace(nan_scale.find("scale 1"), 7, "scale nan");
  feed(nan_scale);
  auto zero_scale = valid;
  zero_scale.replace(zero_scale.find("scale 1"), 7, "scale 0");
  feed(zero_scale);
  auto overflowing = valid;  // finite weights whose logits overflow
  overflowing.replace(overflowing.rfind("4\n"), 1, "1e308");
  feed(overflowing);
  CHECK(parsed > 0);
  CHECK(static_cast<std::size_t>(refused) > valid.size());
}

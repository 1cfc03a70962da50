// Observability: the log (spdlog: levels, log_file, enable_logging, routing into
// the program's own logger), Report::to_json, and the metrics endpoint, scraped
// over HTTP while training runs, checked by promtool and by a real Prometheus
// server, and kept out of training's way when its port is busy, its address is
// not this host's, or its clients are slow, malformed or many.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <spdlog/sinks/ostream_sink.h>

#include "test_support.hpp"

namespace {

namespace fs = std::filesystem;
using memscale::Config;

fs::path fresh_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("memscale_obs_" + name + "_" + std::to_string(::getpid()));
  memscale::detail::remove_tree(dir);
  fs::create_directories(dir);
  return dir;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

/// A budget that makes the flat chain checkpoint (its baseline peak is over it).
Config pressing(Config c = {}) {
  c.memory_budget_gb = 0.004;
  c.target_gpu_utilization = 1.0;
  return c;
}

/// Routes the "memscale" logger into a string for the scope's lifetime, then puts back what was registered.
class captured_log {
 public:
  captured_log() : previous_(spdlog::get("memscale")) {
    spdlog::drop("memscale");
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out_);
    logger_ = std::make_shared<spdlog::logger>("memscale", sink);
    logger_->set_pattern("[%l] %v");
    logger_->set_level(spdlog::level::info);
    spdlog::register_logger(logger_);
  }
  ~captured_log() {
    spdlog::drop("memscale");
    if (previous_) spdlog::register_logger(previous_);
  }
  [[nodiscard]] std::string text() const { return out_.str(); }
  spdlog::logger& logger() { return *logger_; }

 private:
  std::shared_ptr<spdlog::logger> previous_;
  std::ostringstream out_;
  std::shared_ptr<spdlog::logger> logger_;
};

}  // namespace

TEST_CASE("log: a summary at info, the plan at debug in log_file, nothing with enable_logging off",
          "[observability][log]") {
  const auto dir = fresh_dir("log");
  auto model = test::flat_chain(4);
  const auto x = torch::randn({256, 64});
  captured_log log;
  Config c = pressing();
  c.log_file = (dir / "sub" / "memscale.log").string();  // a missing directory is created
  {
    auto guard = memscale::optimize(model, x, c);
    test::train_sgd(model, x, 1);
  }
  const auto stderr_side = log.text();
  INFO(stderr_side);
  CHECK(stderr_side.find("[info] mode Balanced, device cpu (CPU, ") != std::string::npos);
  CHECK(stderr_side.find("checkpointed segment(s)") != std::string::npos);
  CHECK(stderr_side.find("[debug]") == std::string::npos);  // the logger is at info
  const auto file = read_file(c.log_file.value());
  INFO(file);
  CHECK(file.find("[info] mode Balanced") != std::string::npos);
  CHECK(file.find("[debug] memscale plan (mode Balanced, device cpu)") != std::string::npos);
  CHECK(file.find("[debug]   plan:") != std::string::npos);  // the plan's lines, at debug
  CHECK(file.find(" checkpoint ") != std::string::npos);

  // A second wrap appends.
  { auto guard = memscale::optimize(model, x, c); }
  const auto twice = read_file(c.log_file.value());
  CHECK(twice.size() > file.size());
  CHECK(twice.rfind(file, 0) == 0);

  // enable_logging off: not a line, anywhere.
  Config silent = c;
  silent.enable_logging = false;
  silent.log_file = (dir / "silent.log").string();
  const auto before = log.text().size();
  { auto guard = memscale::optimize(model, x, silent); }
  CHECK(log.text().size() == before);
  CHECK_FALSE(fs::exists(dir / "silent.log"));
  memscale::detail::remove_tree(dir);
}

TEST_CASE("log: an unwritable log_file is a ConfigError naming it, and the model is untouched",
          "[observability][log]") {
  const auto dir = fresh_dir("unwritable");
  std::ofstream(dir / "a_file") << "x";
  auto model = test::flat_chain(2);
  const auto x = torch::randn({8, 64});
  const auto slots = test::slot_identity(*model);
  Config c = test::quiet();
  c.enable_logging = true;
  c.log_file = (dir / "a_file" / "memscale.log").string();  // under a regular file
  try {
    (void)memscale::wrap(model, x, c);
    FAIL("wrap accepted an unwritable log_file");
  } catch (const memscale::ConfigError& e) {
    CHECK(e.field() == "log_file");
    CHECK(std::string(e.what()).find("a_file/memscale.log") != std::string::npos);
  }
  CHECK_FALSE(memscale::is_optimized(model));
  CHECK(test::slot_identity(*model) == slots);
  memscale::detail::remove_tree(dir);
}

TEST_CASE("log: warnings reach the program's own logger at warn", "[observability][log]") {
  captured_log log;
  auto model = test::flat_chain(2);
  const auto x = torch::randn({16, 64});
  Config c = pressing();
  c.auto_policy = true;
  c.policy_artifact = "/nonexistent/memscale-policy.txt";  // the trained policy falls back to the rule policy
  { auto guard = memscale::optimize(model, x, c); }
  INFO(log.text());
  CHECK(log.text().find("[warning] ") != std::string::npos);
  CHECK(log.text().find("/nonexistent/memscale-policy.txt") != std::string::npos);
}

TEST_CASE("Report::to_json: every field, and from_json takes back what to_json wrote", "[observability][json]") {
  auto model = test::flat_chain(4);
  const auto x = torch::randn({256, 64});
  Config c = test::quiet(pressing());
  c.verify_correctness = true;
  const auto report = memscale::wrap(model, x, c);
  memscale::detach(model);
  REQUIRE(report.checkpointed_segments() > 0);
  const auto text = report.to_json();
  const auto j = nlohmann::json::parse(text);
  CHECK(j.at("schema") == "memscale.report");
  CHECK(j.at("schema_version") == 1);
  CHECK(j.at("plan").at("planned_peak") == report.planned_peak_bytes());
  CHECK(j.at("summary").at("checkpointed_segments") == report.checkpointed_segments());
  CHECK(j.at("verification").at("passed") == true);
  CHECK(j.at("strategy").at("caller").at("memory_budget_gb") == 0.004);
  REQUIRE(j.at("decision_lines").size() == report.plan.decisions.size());
  // Each plan line of the text report appears, as written, in the JSON.
  const auto printed = report.str();
  for (const auto& line : j.at("decision_lines")) {
    INFO(line.dump());
    CHECK(printed.find(line.at("text").get<std::string>()) != std::string::npos);
  }
  // The round trip: the same document, and the same text report.
  const auto back = memscale::Report::from_json(text);
  CHECK(back.to_json() == text);
  CHECK(back.str() == report.str());
  // A document written before outside_units_bytes existed reads as none.
  auto older = j;
  older.erase("outside_units_bytes");
  CHECK(memscale::Report::from_json(older.dump()).outside_units_bytes == 0);
  // ... and one written before the offload rate was recorded, as a plan that did not weigh offloading.
  REQUIRE(older.contains("offload_bytes_per_second"));
  REQUIRE(older.contains("offload_rate_measured"));
  older.erase("offload_bytes_per_second");
  older.erase("offload_rate_measured");
  CHECK(memscale::Report::from_json(older.dump()).offload_bytes_per_second == 0.0);
  CHECK_FALSE(memscale::Report::from_json(older.dump()).offload_rate_measured);
  // ... and before the pinned pool's spill was costed apart, as no pool's limit.
  for (const char* added : {"offload_fast_bytes", "offload_spill_bytes_per_second", "offload_spill_rate_measured"}) {
    REQUIRE(older.contains(added));
    older.erase(added);
  }
  CHECK(memscale::Report::from_json(older.dump()).offload_fast_bytes == -1);
  CHECK(memscale::Report::from_json(older.dump()).offload_spill_bytes_per_second == 0.0);
  CHECK_FALSE(memscale::Report::from_json(older.dump()).offload_spill_rate_measured);
  // ... and one whose slots were written before made_before_bytes and
  // offload_kept_bytes existed, as none made and all of it offloadable.
  REQUIRE(older.at("chains").at(0).at("slots").at(0).contains("made_before_bytes"));
  REQUIRE(older.at("chains").at(0).at("slots").at(0).contains("offload_kept_bytes"));
  for (auto& chain : older.at("chains"))
    for (auto& slot : chain.at("slots")) {
      slot.erase("made_before_bytes");
      slot.erase("offload_kept_bytes");
    }
  CHECK(memscale::Report::from_json(older.dump()).chains.at(0).slots.at(0).made_before_bytes == 0);
  CHECK(memscale::Report::from_json(older.dump()).chains.at(0).slots.at(0).offload_kept_bytes == 0);
  // ... and one written before the offload statistics counted served_before_written, as 0.
  auto stats = nlohmann::json(memscale::offload::engine_stats{});
  stats["bytes_written"] = 4096;
  stats.erase("served_before_written");
  older["offload"] = stats;
  const auto read = memscale::Report::from_json(older.dump());
  REQUIRE(read.offload.has_value());
  CHECK(read.offload->bytes_written == 4096);
  CHECK(read.offload->served_before_written == 0);
  // ... and a slot's costs written before made_before_bytes existed, as none made.
  auto slot = nlohmann::json(memscale::slot_cost{.input_bytes = 64, .made_before_bytes = 32});
  slot.erase("made_before_bytes");
  const auto slot_read = slot.get<memscale::slot_cost>();
  CHECK(slot_read.input_bytes == 64);
  CHECK(slot_read.made_before_bytes == 0);
  // Bad input names what is wrong.
  CHECK_THROWS_WITH(memscale::Report::from_json("{"), Catch::Contains("not JSON"));
  CHECK_THROWS_WITH(memscale::Report::from_json("{\"schema\": \"x\"}"), Catch::Contains("not a Report document"));
  auto other = j;
  other["schema_version"] = 99;
  CHECK_THROWS_WITH(memscale::Report::from_json(other.dump()), Catch::Contains("schema_version 99"));
}

TEST_CASE("metrics: the exposition writer escapes labels and writes cumulative histograms",
          "[observability][metrics]") {
  memscale::observability::histogram h;
  h.observe(0.002);
  h.observe(0.3);
  h.observe(100.0);
  memscale::observability::exposition out;
  out.family("x_seconds", "histogram", "a \\ help\nline");
  out.histogram_samples("x_seconds", {{"a", "q\"\\\n"}}, h.read());
  const auto text = out.str();
  INFO(text);
  CHECK(text.find("# HELP x_seconds a \\\\ help\\nline\n") != std::string::npos);
  CHECK(text.find("x_seconds_bucket{a=\"q\\\"\\\\\\n\",le=\"0.001\"} 0\n") != std::string::npos);
  CHECK(text.find(",le=\"0.005\"} 1\n") != std::string::npos);
  CHECK(text.find(",le=\"0.5\"} 2\n") != std::string::npos);
  CHECK(text.find(",le=\"60\"} 2\n") != std::string::npos);
  CHECK(text.find(",le=\"+Inf\"} 3\n") != std::string::npos);
  CHECK(text.find("x_seconds_count{a=\"q\\\"\\\\\\n\"} 3\n") != std::string::npos);
  CHECK(memscale::observability::exposition::number(0.1) == "0.1");
  CHECK(memscale::observability::exposition::number(1.0 / 0.0) == "+Inf");
}

TEST_CASE("log: a wrap that plans at the first forward says so at wrap, and logs its plan then",
          "[observability][log]") {
  captured_log log;
  auto model = test::flat_chain(4);
  Config c = pressing();
  c.enable_logging = true;
  (void)memscale::wrap(model, c);
  CHECK(log.text().find("[info] mode Balanced, device cpu (CPU, ") != std::string::npos);
  CHECK(log.text().find("planning deferred to the first forward call") != std::string::npos);
  test::train_sgd(model, torch::randn({256, 64}), 1);
  memscale::detach(model);
  INFO(log.text());
  CHECK(log.text().find("checkpointed segment(s)") != std::string::npos);
}

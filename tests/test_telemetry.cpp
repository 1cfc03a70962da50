// Opt-in telemetry: nothing written or sent while it is off; when on, the
// events of a wrap, a plan, a detach, Stage 1 and the AutoTuner, each holding
// only the fields the schema lists, with bucketed values and nothing that
// names the model, a path or the host; the JSON-lines file, the environment
// switch, an HTTP endpoint on loopback; and sinks that throw, block or refuse,
// which cost events but never a wrap or a step.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_support.hpp"

namespace {

namespace fs = std::filesystem;
namespace tel = memscale::telemetry;
using memscale::Config;

/// A model whose names would identify it, were they ever sent.
torch::nn::Sequential identifiable_model() {
  auto model = test::flat_chain(4);
  model->register_module("secret_block_name_4711", torch::nn::Linear(64, 64));
  return model;
}

Config telemetry_on(const fs::path& file) {
  Config c = test::quiet();
  c.memory_budget_gb = 0.004;
  c.target_gpu_utilization = 1.0;
  c.telemetry = true;
  c.telemetry_file = file.string();
  return c;
}

fs::path fresh(const std::string& name) {
  auto p = fs::temp_directory_path() / ("memscale_tel_" + name + "_" + std::to_string(::getpid()));
  memscale::detail::remove_tree(p);
  return p;
}

std::vector<nlohmann::json> events_in(const fs::path& file) {
  REQUIRE(tel::emitter::global().flush(std::chrono::seconds(10)));
  std::vector<nlohmann::json> events;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) events.push_back(nlohmann::json::parse(line));
  return events;
}

/// Routes every event to `s` for the scope's lifetime.
struct routed {
  explicit routed(std::shared_ptr<tel::sink> s) { tel::emitter::global().set_sink(std::move(s)); }
  ~routed() { tel::emitter::global().set_sink(nullptr); }
};

struct counting_sink : tel::sink {
  std::atomic<int> lines{0};
  void send(const std::string&) override { ++lines; }
};

/// Every value of every field, against what the schema allows.
void check_event(const nlohmann::json& e) {
  INFO(e.dump());
  const auto& schema = tel::event_fields();
  REQUIRE(schema.count(e.at("event").get<std::string>()) == 1);
  const auto& allowed = schema.at(e.at("event").get<std::string>());
  for (const auto& [field, value] : e.items()) {
    INFO(field);
    CHECK(allowed.count(field) == 1);
  }
  for (const auto& field : allowed) CHECK(e.contains(field));
  const std::map<std::string, std::set<std::string>> values{
      {"schema", {"memscale.telemetry"}},
      {"memscale_version", {memscale::version_string}},
      {"libtorch_version", {TORCH_VERSION}},
      {"device_class", {"cpu", "cuda", "other"}},
      {"architecture", {"transformer", "cnn", "mlp", "other"}},
      {"parameter_bucket", {"<1M", "1M-10M", "10M-100M", "100M-1B", ">=1B"}},
      {"mode", {"Conservative", "Balanced", "Aggressive"}},
      {"chosen_mode", {"Conservative", "Balanced", "Aggressive"}},
      {"outcome", {"ok", "config", "unsupported_model", "correctness", "out_of_memory", "error"}},
      {"pressure_bucket", {"<0.7", "0.7-1", "1-2", ">=2"}},
      {"decision_source", {"user_config", "rule", "ml", "rule_fallback"}},
      {"steps_bucket", {"0", "1-9", "10-99", "100-999", ">=1000"}},
      {"trials_bucket", {"0", "1-9", "10-99", "100-999", ">=1000"}},
      {"event", {"wrap_called", "plan_applied", "detach_called", "policy_decided", "autotune_finished"}}};
  for (const auto& [field, value] : e.items()) {
    INFO(field);
    if (field == "schema_version") {
      CHECK(value == 2);
    } else if (field == "techniques") {
      for (const auto& t : value)
        CHECK(std::set<std::string>{"checkpoint", "tile", "offload", "mixed_precision", "8bit_optimizer"}.count(t) == 1);
    } else if (value.is_boolean()) {
      CHECK((field == "found" || field == "from_cache" || field == "chosen_checkpoint" || field == "chosen_offload"));
    } else {
      REQUIRE(values.count(field) == 1);  // every string field has a closed set of values
      CHECK(values.at(field).count(value.get<std::string>()) == 1);
    }
  }
}

}  // namespace

TEST_CASE("telemetry: off by default, nothing written or sent", "[telemetry]") {
  ::unsetenv("MEMSCALE_TELEMETRY");
  const auto file = fresh("off") / "t.jsonl";
  auto sink = std::make_shared<counting_sink>();
  const routed to(sink);
  const auto before = tel::emitter::global().stats();
  auto model = identifiable_model();
  const auto x = torch::randn({256, 64});
  Config c = telemetry_on(file);
  c.telemetry = false;  // the file is named, but telemetry is off
  {
    auto guard = memscale::optimize(model, x, c);
    test::train_sgd(model, x, 2);
  }
  REQUIRE(tel::emitter::global().flush(std::chrono::seconds(5)));
  CHECK_FALSE(fs::exists(file));
  CHECK(sink->lines == 0);
  CHECK(tel::emitter::global().stats().queued == before.queued);
}

TEST_CASE("telemetry: the events of a wrap, a plan, Stage 1, a detach and the AutoTuner hold only the schema's fields",
          "[telemetry]") {
  const auto dir = fresh("events");
  const auto file = dir / "sub" / "t.jsonl";
  auto model = identifiable_model();
  const auto x = torch::randn({256, 64});
  Config c = telemetry_on(file);
  c.auto_policy = true;
  c.policy = memscale::PolicyKind::rule;
  {
    auto guard = memscale::optimize(model, x, c);
    test::train_sgd(model, x, 3);
  }
  torch::optim::SGD optimizer(model->parameters(), 0.01);
  memscale::TuneOptions options;
  options.modes = {memscale::OptimizationMode::Balanced};
  options.max_trials = 2;
  options.use_cache = false;
  options.progress = memscale::TuneProgress::never;
  (void)memscale::autotune(model, x, optimizer, [](const torch::Tensor& y) { return y.pow(2).mean(); },
                           telemetry_on(file), options);
  const auto events = events_in(file);
  std::vector<std::string> names;
  for (const auto& e : events) {
    names.push_back(e.at("event"));
    check_event(e);
  }
  // The AutoTuner's trials send nothing of their own: one of each, in order.
  CHECK(names == std::vector<std::string>{"policy_decided", "plan_applied", "wrap_called", "detach_called",
                                          "autotune_finished"});
  CHECK(events[1].at("architecture") == "transformer");  // LayerNorm with Linear
  CHECK(events[1].at("techniques").size() >= 1);
  CHECK(events[3].at("steps_bucket") == "1-9");
  // Nothing that names the model, the machine or a path, nor the input's shape.
  std::ifstream in(file);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  for (const std::string& secret : {std::string("secret_block_name_4711"), std::string(host), dir.string(),
                                   std::string("Linear"), std::string("256")})
    CHECK(text.find(secret) == std::string::npos);
  memscale::detail::remove_tree(dir);
}

TEST_CASE("telemetry: MEMSCALE_TELEMETRY=1 turns it on, MEMSCALE_TELEMETRY_FILE names the file", "[telemetry]") {
  const auto file = fresh("env") / "t.jsonl";
  ::setenv("MEMSCALE_TELEMETRY", "1", 1);
  ::setenv("MEMSCALE_TELEMETRY_FILE", file.c_str(), 1);
  auto model = test::flat_chain(2);
  { auto guard = memscale::optimize(model, torch::randn({8, 64}), test::quiet()); }
  ::unsetenv("MEMSCALE_TELEMETRY");
  ::unsetenv("MEMSCALE_TELEMETRY_FILE");
  const auto events = events_in(file);
  REQUIRE(events.size() == 3);
  for (const auto& e : events) check_event(e);
  memscale::detail::remove_tree(file.parent_path());
}

#if MEMSCALE_HAS_HTTP()
TEST_CASE("telemetry: an HTTP endpoint on loopback gets each event as a JSON POST, one that refuses costs nothing",
          "[telemetry][http]") {
  httplib::Server server;
  std::mutex mutex;
  std::vector<std::string> bodies;
  server.Post("/events", [&](const httplib::Request& request, httplib::Response& response) {
    std::lock_guard<std::mutex> lock(mutex);
    if (request.get_header_value("Content-Type") == "application/json") bodies.push_back(request.body);
    response.status = 204;
  });
  server.Post("/refuse", [](const httplib::Request&, httplib::Response& response) { response.status = 503; });
  const int port = server.bind_to_any_port("127.0.0.1");
  REQUIRE(port > 0);
  std::thread serving([&] { server.listen_after_bind(); });
  auto model = test::flat_chain(2);
  const auto x = torch::randn({8, 64});
  Config c = test::quiet();
  c.telemetry = true;
  c.telemetry_endpoint = "http://127.0.0.1:" + std::to_string(port) + "/events";
  { auto guard = memscale::optimize(model, x, c); }
  REQUIRE(tel::emitter::global().flush(std::chrono::seconds(10)));
  {
    std::lock_guard<std::mutex> lock(mutex);
    REQUIRE(bodies.size() == 3);
    for (const auto& b : bodies) check_event(nlohmann::json::parse(b));
  }
  // Refusing: an error status, and a port nobody listens on.
  const auto failed = tel::emitter::global().stats().failed;
  c.telemetry_endpoint = "http://127.0.0.1:" + std::to_string(port) + "/refuse";
  { auto guard = memscale::optimize(model, x, c); }
  server.stop();
  serving.join();
  c.telemetry_endpoint = "http://127.0.0.1:" + std::to_string(port) + "/events";
  {
    auto guard = memscale::optimize(model, x, c);
    test::train_sgd(model, x, 1);
  }
  REQUIRE(tel::emitter::global().flush(std::chrono::seconds(20)));
  CHECK(tel::emitter::global().stats().failed == failed + 6);
  CHECK_FALSE(memscale::is_optimized(model));
}
#endif

TEST_CASE("telemetry: a sink that throws or blocks costs events, never a wrap or a step", "[telemetry]") {
  auto model = test::flat_chain(4);
  const auto x = torch::randn({256, 64});
  const auto c = telemetry_on(fresh("faults") / "unused.jsonl");
  SECTION("throws") {
    struct throwing : tel::sink {
      void send(const std::string&) override { throw std::runtime_error("sink broken"); }
    };
    const routed to(std::make_shared<throwing>());
    const auto failed = tel::emitter::global().stats().failed;
    {
      auto guard = memscale::optimize(model, x, c);
      test::train_sgd(model, x, 2);
    }
    REQUIRE(tel::emitter::global().flush(std::chrono::seconds(5)));
    CHECK(tel::emitter::global().stats().failed == failed + 3);
  }
  SECTION("blocks") {
    struct blocking : tel::sink {
      std::mutex mutex;
      std::condition_variable released_cv;
      bool released = false;
      std::atomic<bool> entered{false};
      void send(const std::string&) override {
        entered = true;
        std::unique_lock<std::mutex> lock(mutex);
        released_cv.wait(lock, [&] { return released; });
      }
      void release() {
        {
          std::lock_guard<std::mutex> lock(mutex);
          released = true;
        }
        released_cv.notify_all();
      }
    };
    auto sink = std::make_shared<blocking>();
    const routed to(sink);
    const auto dropped = tel::emitter::global().stats().dropped;
    {
      // wrap, steps and detach run to their end while the sink holds the worker.
      auto guard = memscale::optimize(model, x, c);
      test::train_sgd(model, x, 2);
    }
    CHECK_FALSE(memscale::is_optimized(model));
    // The queue is bounded: past its capacity, events are dropped, not waited for.
    for (std::size_t i = 0; i < tel::queue_capacity + 10; ++i) tel::emitter::global().post(sink, "{}");
    CHECK(tel::emitter::global().stats().dropped >= dropped + 10);
    for (int i = 0; i < 5000 && !sink->entered; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    CHECK(sink->entered);  // it did hold the worker all along
    sink->release();
    CHECK(tel::emitter::global().flush(std::chrono::seconds(10)));
  }
  memscale::detail::remove_tree(fresh("faults"));
}

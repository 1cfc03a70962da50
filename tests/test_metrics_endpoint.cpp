// The metrics endpoint with real clients: scraped over HTTP (cpp-httplib's
// client, many at once) while training runs, checked by promtool, scraped by a
// real Prometheus server that then answers a query; a busy port, an address
// that is not this host's, malformed and slow requests leave training alone,
// and nothing listens once the guard ends. Needs promtool and prometheus
// (Debian's prometheus; scripts/setup-deps.sh --tests installs it).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_support.hpp"

#if MEMSCALE_HAS_HTTP()

namespace {

namespace fs = std::filesystem;
using memscale::Config;

Config serving(int port = 0) {
  Config c = test::quiet();
  c.memory_budget_gb = 0.004;
  c.target_gpu_utilization = 1.0;
  c.observability_port = port;
  return c;
}

int port_of(const memscale::OptimizationGuard& guard) {
  const auto url = guard.report().metrics_endpoint;
  REQUIRE_FALSE(url.empty());
  const auto colon = url.rfind(':');
  return std::stoi(url.substr(colon + 1));
}

std::string scrape(int port, int* status = nullptr) {
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(2, 0);
  client.set_read_timeout(5, 0);
  auto response = client.Get("/metrics");
  if (!response) return {};
  if (status) *status = response->status;
  return response->body;
}

/// A plain TCP socket to 127.0.0.1:port (-1 when nothing accepts).
int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

/// A socket listening on a free loopback port (the port in *port).
int listen_somewhere(int* port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(::listen(fd, 4) == 0);
  socklen_t size = sizeof addr;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &size) == 0);
  *port = ntohs(addr.sin_port);
  return fd;
}

double sample_value(const std::string& page, const std::string& series) {
  const auto at = page.find("\n" + series + " ");
  if (at == std::string::npos) return -1.0;
  return std::stod(page.substr(at + series.size() + 2));
}

/// Runs a command, feeding it `input`; returns its exit status and output.
std::pair<int, std::string> run_with_input(const std::string& command, const std::string& input) {
  const auto dir = fs::temp_directory_path();
  const auto in = dir / ("memscale_in_" + std::to_string(::getpid()));
  const auto out = dir / ("memscale_out_" + std::to_string(::getpid()));
  std::ofstream(in) << input;
  const int status = std::system((command + " < " + in.string() + " > " + out.string() + " 2>&1").c_str());
  std::ifstream o(out);
  std::string text((std::istreambuf_iterator<char>(o)), std::istreambuf_iterator<char>());
  fs::remove(in);
  fs::remove(out);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, text};
}

bool have(const char* program) {
  return std::system((std::string("command -v ") + program + " > /dev/null 2>&1").c_str()) == 0;
}

}  // namespace

TEST_CASE("metrics endpoint: scraped while training, by many clients at once, gone when the guard ends",
          "[observability][metrics][http]") {
  auto model = test::flat_chain(4);
  const auto x = torch::randn({256, 64});
  int port = 0, offloaded_units = 0;
  std::string first, last;
  {
    auto guard = memscale::optimize(model, x, serving());
    REQUIRE(guard.report().checkpointed_segments() > 0);
    offloaded_units = guard.report().offloaded_units();
    port = port_of(guard);
    CHECK(guard.report().str().find("metrics: http://127.0.0.1:" + std::to_string(port) + "/metrics") !=
          std::string::npos);
    int status = 0;
    first = scrape(port, &status);
    CHECK(status == 200);
    std::atomic<bool> training{true};
    std::atomic<int> good{0}, bad{0};
    std::vector<std::thread> scrapers;
    for (int t = 0; t < 8; ++t)
      scrapers.emplace_back([&] {
        for (int i = 0; i < 5 && training; ++i) {
          try {
            int code = 0;
            const auto page = scrape(port, &code);
            (code == 200 && page.find("memscale_training_steps_total") != std::string::npos ? good : bad)++;
          } catch (...) {
            ++bad;
          }
        }
      });
    test::train_sgd(model, x, 4);
    training = false;
    for (auto& t : scrapers) t.join();
    CHECK(good > 0);
    CHECK(bad == 0);
    last = scrape(port);
  }
  INFO(last);
  // Exactly the 4 training steps: wrap's warm-up, profiling and the scrapes count none.
  CHECK(sample_value(last, "memscale_training_steps_total") == sample_value(first, "memscale_training_steps_total") + 4);
  CHECK(sample_value(last, "memscale_recomputes_total") > sample_value(first, "memscale_recomputes_total"));
  CHECK(last.find("memscale_planned_peak_bytes{device=\"cpu\"} ") != std::string::npos);
  CHECK(last.find("memscale_memory_peak_bytes{device=\"cpu\",kind=\"process_resident\"} ") != std::string::npos);
  CHECK(last.find("memscale_plan_units{device=\"cpu\",technique=\"checkpoint\"} ") != std::string::npos);
  // Offload traffic: what went out came back, tier by tier; some went out if the plan offloads.
  double out = 0.0;
  for (const char* tier : {"pinned_host", "pageable_host", "disk"}) {
    const auto moved = [&](const char* direction) {
      return sample_value(last, std::string("memscale_offload_bytes_total{direction=\"") + direction + "\",tier=\"" +
                                    tier + "\"}");
    };
    CHECK(moved("out") >= 0.0);
    CHECK(moved("out") == moved("in"));
    out += moved("out");
  }
  CHECK((out > 0.0) == (offloaded_units > 0));
  CHECK(last.find("memscale_step_seconds_bucket{le=\"+Inf\"} ") != std::string::npos);
  // The guard ended: nothing listens on the port any more.
  CHECK(connect_to(port) < 0);
}

TEST_CASE("metrics endpoint: promtool accepts the page", "[observability][metrics][http][promtool]") {
  REQUIRE(have("promtool"));  // Debian's prometheus (scripts/setup-deps.sh --tests)
  auto model = test::flat_chain(4);
  const auto x = torch::randn({256, 64});
  auto guard = memscale::optimize(model, x, serving());
  test::train_sgd(model, x, 2);
  const auto page = scrape(port_of(guard));
  REQUIRE_FALSE(page.empty());
  const auto [status, output] = run_with_input("promtool check metrics", page);
  INFO(page);
  INFO(output);
  CHECK(status == 0);
  CHECK(output.find("error") == std::string::npos);
}

TEST_CASE("metrics endpoint: a real Prometheus server scrapes it and answers a query",
          "[observability][metrics][http][prometheus]") {
  REQUIRE(have("prometheus"));
  auto model = test::flat_chain(4);
  const auto x = torch::randn({256, 64});
  auto guard = memscale::optimize(model, x, serving());
  const int port = port_of(guard);
  int prometheus_port = 0;
  ::close(listen_somewhere(&prometheus_port));  // a free port for the server
  const auto dir = fs::temp_directory_path() / ("memscale_prometheus_" + std::to_string(::getpid()));
  memscale::detail::remove_tree(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "prometheus.yml") << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                                        << "scrape_configs:\n  - job_name: memscale\n    static_configs:\n"
                                        << "      - targets: ['127.0.0.1:" << port << "']\n";
  struct child {
    pid_t pid;
    ~child() {
      if (pid <= 0) return;
      ::kill(pid, SIGTERM);
      int status = 0;
      ::waitpid(pid, &status, 0);
    }
  };
  const pid_t server = ::fork();
  REQUIRE(server >= 0);
  const child running{server};
  if (server == 0) {
    const auto config = "--config.file=" + (dir / "prometheus.yml").string();
    const auto storage = "--storage.tsdb.path=" + (dir / "data").string();
    const auto listen = "--web.listen-address=127.0.0.1:" + std::to_string(prometheus_port);
    const auto log = (dir / "prometheus.log").string();
    std::freopen(log.c_str(), "w", stdout);
    std::freopen(log.c_str(), "a", stderr);
    ::execlp("prometheus", "prometheus", config.c_str(), storage.c_str(), listen.c_str(), "--log.level=warn",
             static_cast<char*>(nullptr));
    ::_exit(127);
  }
  // Train while the server scrapes; ask it until a memscale series has a value (30 s at most).
  httplib::Client client("127.0.0.1", prometheus_port);
  client.set_connection_timeout(1, 0);
  double steps = -1.0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (steps < 1.0 && std::chrono::steady_clock::now() < deadline) {
    test::train_sgd(model, x, 1);
    const auto response = client.Get("/api/v1/query?query=memscale_training_steps_total");
    if (!response || response->status != 200) continue;
    const auto j = nlohmann::json::parse(response->body, nullptr, false);
    if (j.is_discarded() || j.value("status", "") != "success") continue;
    const auto& result = j["data"]["result"];
    if (result.empty()) continue;
    steps = std::stod(result[0]["value"][1].get<std::string>());
    CHECK(result[0]["metric"]["job"] == "memscale");
  }
  std::ifstream log(dir / "prometheus.log");
  INFO(std::string((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>()));
  CHECK(steps >= 1.0);
  memscale::detail::remove_tree(dir);
}

TEST_CASE("metrics endpoint: a busy port or a foreign address is a warning, training goes on",
          "[observability][metrics][http]") {
  int busy = 0;
  const int holder = listen_somewhere(&busy);
  auto model = test::flat_chain(4);
  const auto x = torch::randn({256, 64});
  for (const auto& [address, port] : {std::pair<std::string, int>{"127.0.0.1", busy}, {"192.0.2.1", 0}}) {
    Config c = serving(port);
    c.observability_bind_address = address;
    auto guard = memscale::optimize(model, x, c);
    const auto report = guard.report();
    INFO(report.str());
    CHECK(report.metrics_endpoint.empty());
    bool noted = false;
    for (const auto& note : report.notes)
      noted = noted || note.find("could not bind " + address + ":" + std::to_string(port)) != std::string::npos;
    CHECK(noted);
    CHECK(report.checkpointed_segments() > 0);
    test::train_sgd(model, x, 1);
  }
  ::close(holder);
}

TEST_CASE("metrics endpoint: a second guard on a port the first one serves gets a warning, not half the scrapes",
          "[observability][metrics][http]") {
  auto first_model = test::flat_chain(2);
  auto second_model = test::flat_chain(2);
  const auto x = torch::randn({16, 64});
  auto first = memscale::optimize(first_model, x, serving());
  const int port = port_of(first);
  auto second = memscale::optimize(second_model, x, serving(port));
  const auto report = second.report();
  INFO(report.str());
  CHECK(report.metrics_endpoint.empty());
  CHECK(report.str().find("could not bind 127.0.0.1:" + std::to_string(port)) != std::string::npos);
  CHECK_FALSE(scrape(port).empty());  // the first still serves
}

TEST_CASE("metrics endpoint: malformed and slow requests cost training nothing, the guard still ends",
          "[observability][metrics][http]") {
  auto model = test::flat_chain(4);
  const auto x = torch::randn({256, 64});
  int port = 0;
  std::vector<int> slow;
  auto guard = std::make_unique<memscale::OptimizationGuard>(memscale::optimize(model, x, serving()));
  port = port_of(*guard);
  // Malformed: an answer of 400, or a closed connection, and the server goes on.
  const int bad = connect_to(port);
  REQUIRE(bad >= 0);
  const std::string garbage = "NOT HTTP AT ALL\r\n\r\n";
  (void)::send(bad, garbage.data(), garbage.size(), 0);
  char reply[64] = {};
  const auto got = ::recv(bad, reply, sizeof reply - 1, 0);
  CHECK((got <= 0 || std::string(reply).find(" 400 ") != std::string::npos));
  ::close(bad);
  // Slow: clients that send half a request and wait, more of them than the server has threads.
  for (int i = 0; i < 6; ++i) {
    const int fd = connect_to(port);
    REQUIRE(fd >= 0);
    const std::string half = "GET /metr";
    (void)::send(fd, half.data(), half.size(), 0);
    slow.push_back(fd);
  }
  test::train_sgd(model, x, 2);  // training does not wait on the server
  CHECK(guard->active());
  const auto start = std::chrono::steady_clock::now();
  guard.reset();  // closes the listening socket even with slow clients connected
  const auto took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(took < 10.0);  // not a speed target: a guard that never ended would hang the program
  CHECK(connect_to(port) < 0);
  for (int fd : slow) ::close(fd);
  CHECK_FALSE(memscale::is_optimized(model));
}

#else

TEST_CASE("metrics endpoint: without cpp-httplib, observability_port is a ConfigError", "[observability][metrics]") {
  auto model = test::flat_chain(2);
  memscale::Config c = test::quiet();
  c.observability_port = 0;
  CHECK_THROWS_AS(memscale::wrap(model, torch::randn({4, 64}), c), memscale::ConfigError);
  CHECK_FALSE(memscale::is_optimized(model));
}

#endif

// Every parser of outside input, fuzzed by a seeded mutation loop (issue 16):
// the Config in JSON (as the AutoTuner's cache and Report::to_json write it, and
// as a user's file holds it), the AutoTuner's cache file and its results,
// Report::from_json, the telemetry endpoint's URL (also read from the
// environment), and the metrics endpoint's request handling over a real socket.
// (The policy artifact's loader is fuzzed in test_policy.cpp.) Each input either
// parses or fails with memscale's own error naming what is wrong; nothing
// crashes or hangs. (No sanitizer job runs them yet: the asan preset exists,
// CI does not build it.)
// Inputs that once broke a parser are kept below as regression cases.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_support.hpp"

namespace fuzz {

/// Seeded structure-blind mutations: bit flips, interesting bytes, insertions,
/// deletions, duplicated spans, truncation, and tokens that break parsers.
class mutator {
 public:
  explicit mutator(std::uint64_t seed) : rng_(seed) {}

  std::string operator()(std::string s) {
    static const std::vector<std::string> tokens = {
        "1e400", "-1", "null", "true", "[]", "{}", "\"\"", "18446744073709551616", "-9223372036854775809", "1.5",
        "NaN", "\\u0000", "\\ud800", "0x10", "\"\\", std::string(64, '['), std::string(3000, '9'), "\xff\xfe"};
    static const std::string bytes = std::string("\0\"{}[],:\\-9e.\r\n \xff", 17);
    for (int k = 0, n = 1 + static_cast<int>(below(4)); k < n; ++k) {
      const auto at = s.empty() ? 0 : below(s.size());
      switch (below(7)) {
        case 0:
          if (!s.empty()) s[at] = static_cast<char>(s[at] ^ (1 << below(8)));
          break;
        case 1:
          if (!s.empty()) s[at] = bytes[below(bytes.size())];
          break;
        case 2: s.insert(at, 1, static_cast<char>(below(256))); break;
        case 3: s.erase(at, 1 + below(16)); break;
        case 4: s.insert(at, s.substr(at, 1 + below(64))); break;
        case 5: s.resize(at); break;
        default: s.insert(at, tokens[below(tokens.size())]); break;
      }
    }
    return s;
  }
  std::size_t below(std::size_t n) { return n == 0 ? 0 : static_cast<std::size_t>(rng_() % n); }

 private:
  std::mt19937_64 rng_;
};

/// Every value of the other JSON types, for a field whose type is fixed.
inline std::vector<nlohmann::json> values_of_every_type() {
  return {nullptr, true, false, 0, -1, 1.5, 1e300, -1e300, 4294967296LL, 18446744073709551615ULL, "x", "",
          nlohmann::json::array(), nlohmann::json::array({1, 2}), nlohmann::json::object(),
          nlohmann::json::object({{"k", 1}})};
}

inline memscale::Config rich_config() {
  memscale::Config c;
  c.mode = memscale::OptimizationMode::Aggressive;
  c.use_mixed_precision = true;
  c.max_cpu_offload_gb = 2.5;
  c.async_offload = true;
  memscale::AsyncOffloadConfig offload;
  offload.disk_dir = "/tmp/x";
  offload.max_disk_offload_gb = 1.0;
  c.async_config = offload;
  c.memory_budget_gb = 1.25;
  c.observability_port = 0;
  c.log_file = "/tmp/memscale.log";
  c.telemetry_endpoint = "http://127.0.0.1:9/x";
  return c;
}

}  // namespace fuzz

TEST_CASE("fuzzed: a Config in JSON reads back or is a ConfigError naming the field", "[fuzz][config]") {
  const nlohmann::json valid = fuzz::rich_config();
  REQUIRE(valid.get<memscale::Config>().memory_budget_gb == 1.25);
  int read = 0, refused = 0;
  const auto feed = [&](const std::string& text) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception&) {
      return;  // not JSON (or a number JSON cannot hold): the caller's parse fails, before memscale sees anything
    }
    try {
      const auto c = j.get<memscale::Config>();
      CHECK_NOTHROW(c.validate());
      const nlohmann::json again = c;  // what was read writes back and reads the same
      CHECK(nlohmann::json(again.get<memscale::Config>()) == again);
      ++read;
    } catch (const memscale::ConfigError& e) {
      CHECK_FALSE(e.field().empty());
      ++refused;
    } catch (const memscale::Error& e) {  // only for a document that is not an object
      INFO(e.what());
      CHECK_FALSE(j.is_object());
      ++refused;
    }
  };
  // Every field given every other type: a ConfigError naming that field. A
  // value of another kind than the field's (a number for a flag, a string for
  // a number, 2.5 for an integer) must be refused; null is an optional's unset.
  const auto must_refuse = [](const nlohmann::json& field, const nlohmann::json& value) {
    if (value.is_null()) return false;
    if (field.is_boolean()) return !value.is_boolean();
    if (field.is_number_integer()) return !value.is_number_integer();
    if (field.is_number_float()) return !value.is_number();
    if (field.is_string()) return !value.is_string();
    if (field.is_object()) return !value.is_object();
    return false;
  };
  for (const auto& item : valid.items()) {
    for (const auto& value : fuzz::values_of_every_type()) {
      auto j = valid;
      j[item.key()] = value;
      try {
        (void)j.get<memscale::Config>();
        INFO(item.key() << " = " << value.dump() << " was accepted");
        CHECK_FALSE(must_refuse(item.value(), value));
      } catch (const memscale::ConfigError& e) {
        // That field, or one the value conflicts with (two telemetry sinks), named in the message.
        INFO(item.key() << " = " << value.dump() << ": " << e.what());
        CHECK((e.field().rfind(item.key(), 0) == 0 || std::string(e.what()).find(item.key()) != std::string::npos));
      }
    }
  }
  for (const auto& item : valid.at("async_config").items()) {
    for (const auto& value : fuzz::values_of_every_type()) {
      auto j = valid;
      j["async_config"][item.key()] = value;
      try {
        (void)j.get<memscale::Config>();
        INFO("async_config." << item.key() << " = " << value.dump() << " was accepted");
        CHECK_FALSE(must_refuse(item.value(), value));
      } catch (const memscale::ConfigError& e) {
        INFO(item.key() << " = " << value.dump() << ": " << e.what());
        CHECK(e.field() == "async_config." + item.key());
      }
    }
  }
  // Regressions: an integer from 2.5 or 1e300 was truncated or undefined; an
  // unknown (misspelt) field was silently ignored; a non-object async_config was
  // read as the defaults.
  for (const auto& [key, value] : std::vector<std::pair<std::string, nlohmann::json>>{
           {"warmup_steps", 2.5}, {"warmup_steps", 1e300}, {"observability_port", 4294967296LL},
           {"enable_tiling", 1}, {"memory_budget_gb", "8"}, {"async_config", 5}, {"warmup_step", 3}}) {
    auto j = valid;
    j[key] = value;
    INFO(key << " = " << value.dump());
    try {
      (void)j.get<memscale::Config>();
      FAIL("accepted");
    } catch (const memscale::ConfigError& e) {
      CHECK(e.field() == key);
      CHECK_THAT(e.what(), Catch::Contains(value.dump()) || Catch::Contains("is not a field"));
    }
  }
  fuzz::mutator mutate(20261125);
  const auto text = valid.dump(1);
  for (std::size_t n = 0; n < text.size(); n += 7) feed(text.substr(0, n));
  for (int i = 0; i < 3000; ++i) feed(mutate(text));
  CHECK(read > 0);
  CHECK(refused > 100);
}

TEST_CASE("fuzzed: the AutoTuner's cache file and results are read or ignored with a reason", "[fuzz][autotune]") {
  namespace autotuning = memscale::autotuning;
  memscale::TuneResult r;
  r.found = true;
  r.best = fuzz::rich_config();
  r.best_batch_size = 48;
  r.best_trial = 0;
  r.budget_bytes = 123456789;
  memscale::TuneTrial t;
  t.config = r.best;
  t.label = "Aggressive checkpoint";
  t.batch_size = 48;
  t.outcome = memscale::TrialOutcome::fits;
  t.predicted_peak_bytes = 1000;
  t.measured_peak_bytes = 1010;
  r.trials = {t};
  const autotuning::cache_key key{nlohmann::json{{"model", "fuzz"}, {"batch", 48}}};
  const auto dir = std::filesystem::temp_directory_path() / ("memscale-fuzz-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  struct removed_at_end {
    std::filesystem::path dir;
    ~removed_at_end() {
      memscale::detail::remove_tree(dir);
    }
  } cleanup{dir};
  const auto path = (dir / "cache.json").string();
  REQUIRE(autotuning::store(path, key, r).empty());
  std::string valid;
  {
    std::ifstream in(path, std::ios::binary);
    valid.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::string problem;
  REQUIRE(autotuning::lookup(autotuning::read_cache(path), key, problem).has_value());
  int found = 0, ignored = 0;
  const auto feed = [&](const std::string& text) {
    {
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out << text;
    }
    const auto contents = autotuning::read_cache(path);
    std::string why;
    const auto hit = autotuning::lookup(contents, key, why);
    if (hit) {
      CHECK(hit->found == (hit->winner() != nullptr));
      ++found;
    } else {
      ++ignored;
    }
    // The result's own reader: parses or throws memscale::Error.
    try {
      (void)memscale::TuneResult::from_json(text);
    } catch (const memscale::Error&) {
    }
  };
  // Regressions: "best_trial": 4294967296 was read as 0 (a winner picked from
  // nothing), an integer field took 2.5.
  for (const auto& [key, value] : std::vector<std::pair<std::string, nlohmann::json>>{
           {"best_trial", 4294967296LL}, {"best_batch_size", 2.5}, {"budget_bytes", "1"}, {"found", 1}}) {
    auto j = nlohmann::json::parse(r.to_json());
    j[key] = value;
    INFO(key << " = " << value.dump());
    CHECK_THROWS_WITH(memscale::TuneResult::from_json(j.dump()), Catch::Contains(key));
  }
  fuzz::mutator mutate(20261126);
  for (int i = 0; i < 3000; ++i) feed(mutate(valid));
  // Regression: a file of any size was read whole into memory.
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.seekp(static_cast<std::streamoff>(autotuning::cache_max_bytes));
    out << '}';
  }
  const auto huge = autotuning::read_cache(path);
  CHECK_THAT(huge.problem, Catch::Contains("more than the"));
  CHECK(huge.entries.empty());
  CHECK(found > 0);
  CHECK(ignored > 100);
}

TEST_CASE("fuzzed: Report::from_json reads a Report or throws memscale::Error", "[fuzz][report]") {
  torch::manual_seed(1);
  auto model = test::flat_chain(2, 32, 64);
  const auto x = torch::randn({4, 8, 32});
  std::string valid;
  {
    auto guard = memscale::optimize(model, x, test::quiet({.mode = memscale::OptimizationMode::Aggressive,
                                                           .force_optimize = true, .memory_budget_gb = 0.01}));
    valid = guard.report().to_json(-1);
  }
  REQUIRE(memscale::Report::from_json(valid).to_json(-1) == valid);
  int read = 0, refused = 0;
  fuzz::mutator mutate(20261127);
  for (int i = 0; i < 2000; ++i) {
    const auto text = mutate(valid);
    try {
      const auto r = memscale::Report::from_json(text);
      CHECK(memscale::Report::from_json(r.to_json(-1)).to_json(-1) == r.to_json(-1));
      ++read;
    } catch (const memscale::Error& e) {
      CHECK_THAT(e.what(), Catch::Contains("Report::from_json"));
      ++refused;
    }
  }
  CHECK(read > 0);
  CHECK(refused > 100);
  // Found under UndefinedBehaviorSanitizer: a slot's byte count of -2^63 (a
  // mutated digit) overflowed the summary's projection. Regression rows.
  auto document = nlohmann::json::parse(valid);
  REQUIRE(!document["chains"].empty());
  REQUIRE(!document["chains"][0]["slots"].empty());
  for (const auto& [field, value] :
       std::vector<std::pair<std::string, nlohmann::json>>{{"input_bytes", std::numeric_limits<std::int64_t>::min()},
                                                           {"output_bytes", std::numeric_limits<std::int64_t>::max()},
                                                           {"saved_bytes", -1},
                                                           {"forward_seconds", 1e300}}) {
    auto bad = document;
    bad["chains"][0]["slots"][0][field] = value;
    CHECK_THROWS_WITH(memscale::Report::from_json(bad.dump()), Catch::Contains("out of range"));
  }
  for (const double rate : {-1.0, 1e300})  // the rates offloads were costed at
    for (const char* field : {"offload_bytes_per_second", "offload_spill_bytes_per_second"}) {
      auto bad = document;
      bad[field] = rate;
      CHECK_THROWS_WITH(memscale::Report::from_json(bad.dump()),
                        Catch::Contains(std::string(field) + " is out of range"));
    }
  for (const std::int64_t pool : {std::int64_t{-2}, std::int64_t{1} << 60}) {  // -1: no pool's limit
    auto bad = document;
    bad["offload_fast_bytes"] = pool;
    CHECK_THROWS_WITH(memscale::Report::from_json(bad.dump()), Catch::Contains("offload_fast_bytes is out of range"));
  }
  auto past_the_chain = document;
  past_the_chain["plan"]["units"][0][0]["last"] = 1000;
  CHECK_THROWS_WITH(memscale::Report::from_json(past_the_chain.dump()), Catch::Contains("a unit of chain 0"));
}

TEST_CASE("fuzzed: the telemetry endpoint's URL is accepted or refused, never crashes", "[fuzz][telemetry]") {
  fuzz::mutator mutate(20261128);
  int accepted = 0;
  for (const std::string seed : {"http://127.0.0.1:8080/events", "http://collector/x", "http://[::1]:9/"}) {
    for (int i = 0; i < 2000; ++i) {
      const auto url = mutate(seed);
      const bool valid = memscale::Config::telemetry_endpoint_valid(url);
      accepted += valid;
      memscale::Config c;
      c.telemetry_endpoint = url;
      if (valid) CHECK_NOTHROW(c.validate());
      else CHECK_THROWS_AS(c.validate(), memscale::ConfigError);
    }
  }
  CHECK(accepted > 0);
}

#if MEMSCALE_HAS_HTTP()

namespace fuzz {

/// Whether `answer` holds a whole HTTP response: its head and Content-Length bytes.
inline bool response_complete(const std::string& answer) {
  const auto end = answer.find("\r\n\r\n");
  if (end == std::string::npos) return false;
  std::string head = answer.substr(0, end);
  for (auto& ch : head) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  const auto at = head.find("\r\ncontent-length:");
  if (at == std::string::npos) return true;
  const auto length = std::strtoull(head.c_str() + at + 17, nullptr, 10);
  return answer.size() - end - 4 >= length;
}

/// Sends `request` to 127.0.0.1:`port` and reads the answer until the server
/// closes or is silent for `wait_ms`; returns it. (The sending side stays open:
/// a peer that half-closes gets no answer from cpp-httplib at all.)
inline std::string exchange(int port, const std::string& request, int wait_ms = 3000) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return {};
  timeval timeout{wait_ms / 1000, wait_ms % 1000 * 1000};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<std::uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string answer;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0) {
    (void)::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
    char chunk[4096];
    for (ssize_t got; (got = ::recv(fd, chunk, sizeof chunk, 0)) > 0;) {
      answer.append(chunk, static_cast<std::size_t>(got));
      if (response_complete(answer)) break;  // a kept-alive connection: the answer is all there
    }
  }
  ::close(fd);
  return answer;
}

}  // namespace fuzz

TEST_CASE("fuzzed: the metrics endpoint answers or closes every malformed request and keeps serving",
          "[fuzz][metrics][http]") {
  // 100 ms for a request to arrive (2 s in a guard): a truncated request
  // holds a server thread that long.
  memscale::observability::metrics_endpoint endpoint(
      "127.0.0.1", 0, [] { return std::string("memscale_up 1\n"); }, std::chrono::milliseconds(100));
  REQUIRE(endpoint.bound());
  const auto port = endpoint.port();
  const std::string head = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/plain\r\n";
  const std::string close = "Connection: close\r\n\r\n";  // no keep-alive wait after the answer
  const std::string valid = head + close;
  REQUIRE_THAT(fuzz::exchange(port, valid), Catch::StartsWith("HTTP/1.1 200") && Catch::Contains("memscale_up 1"));
  std::vector<std::string> hostile = {
      "GET /metrics HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
      "POST /metrics HTTP/1.1\r\nContent-Length: 1000000000\r\n\r\nxx",
      "GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n",
      "GET /" + std::string(100000, 'a') + " HTTP/1.1\r\n\r\n",
      "GET /metrics HTTP/1.1\r\nX: " + std::string(100000, 'b') + "\r\n\r\n",
      "GET /../../etc/passwd HTTP/1.1\r\n\r\n", "GET /metrics%00 HTTP/1.1\r\n\r\n",
      "GET /metrics?" + std::string(5000, '&') + " HTTP/1.1\r\n\r\n", std::string(5000, '\0'), "\r\n\r\n", "GET"};
  std::string many_headers = "GET /metrics HTTP/1.1\r\n";
  for (int i = 0; i < 2000; ++i) many_headers.append("H").append(std::to_string(i)).append(": v\r\n");
  hostile.push_back(many_headers.append("\r\n"));
  std::size_t answered = 0;
  // An answer to a malformed request comes at once; one the server holds for
  // more of the request (up to its 100 ms), or keeps alive, the client leaves.
  for (const auto& request : hostile) answered += !fuzz::exchange(port, request, 250).empty();
  fuzz::mutator mutate(20261129);
  for (int i = 0; i < 300; ++i) answered += !fuzz::exchange(port, mutate(head) + close, 250).empty();
  CHECK(answered > 0);
  // Still serving, and a scrape still gets the page.
  CHECK_THAT(fuzz::exchange(port, valid), Catch::StartsWith("HTTP/1.1 200") && Catch::Contains("memscale_up 1"));
}

#endif

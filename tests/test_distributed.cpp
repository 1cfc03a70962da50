// Data parallel training (memscale/distributed.hpp): the plan exchange's encoding,
// and jobs of two processes over Gloo on this machine (tests/distributed/worker.cpp):
// parameters bit-identical with and without memscale (Sequential slots and call-site
// units) and equal across ranks; ranks
// that profiled different models, a rank that dies and one that never comes end
// every rank with an error, not a hang.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "test_support.hpp"

#include <memscale/distributed.hpp>

#include "distributed/job.hpp"

extern char** environ;

namespace {

namespace fs = std::filesystem;
namespace dist = memscale::distributed;
using clock_type = std::chrono::steady_clock;

TEST_CASE("a plan crosses the process group word for word", "[distributed]") {
  memscale::core::engine_plan plan;
  plan.pressure = 0.1 + 1e-17;  // not a round number: the encoding must keep every bit
  plan.baseline_peak = 123456789012;
  plan.planned_peak = 42;
  plan.target_bytes = -1;
  plan.overall = memscale::core::rule_id::tile_segment;
  plan.units = {{{0, 4, true, false, 1, 0}, {5, 5, false, true, 1, 0}}, {}, {{0, 2, true, true, 4, 1}}};
  plan.segment_length = {5, 0, 3};
  plan.decisions = {{2, 0, 2, true, memscale::core::rule_id::refine_segment, 99, std::nan(""), 7, 6, true,
                     std::numeric_limits<double>::denorm_min(), 4, 1}};
  plan.overrides = {{2, 0.25, 0.125 + 1e-17, 1000, 999, 1001}};
  const auto words = dist::detail::serialize_plan(plan);
  const auto back = dist::detail::deserialize_plan(words);
  CHECK(dist::detail::serialize_plan(back) == words);
  CHECK(back.units == plan.units);
  CHECK(back.segment_length == plan.segment_length);
  CHECK(back.overall == plan.overall);
  CHECK(std::isnan(back.decisions.at(0).recompute_seconds));
  CHECK(back.decisions.at(0).compute_seconds == std::numeric_limits<double>::denorm_min());
  REQUIRE(back.overrides.size() == 1);
  CHECK(back.overrides[0].optimal_seconds == plan.overrides[0].optimal_seconds);
  CHECK(back.overrides[0].budget == 1001);

  auto truncated = words;
  truncated.pop_back();
  CHECK_THROWS_AS(dist::detail::deserialize_plan(truncated), dist::DistributedError);
  auto foreign = words;
  foreign.front() = 0;
  CHECK_THROWS_AS(dist::detail::deserialize_plan(foreign), dist::DistributedError);
  auto longer = words;
  longer.push_back(0);
  CHECK_THROWS_AS(dist::detail::deserialize_plan(longer), dist::DistributedError);
}

TEST_CASE("a structure summary tells chains, slots, slot types and techniques apart", "[distributed]") {
  auto x = dp_job::batches_of(0).front().first;
  auto profile_of = [&](bool extra_slot) {
    auto model = dp_job::make_model(0, extra_slot);
    return memscale::optimize(model, x, test::quiet()).report().chains;
  };
  const auto plain = profile_of(false);
  const dist::plan_capabilities all{true, true, true, false};
  const auto summary = dist::detail::summarize(plain, all);
  CHECK(summary.chains == 1);
  CHECK(summary.slots == dp_job::slots);
  CHECK(summary == dist::detail::summarize(profile_of(false), all));
  CHECK_FALSE(summary == dist::detail::summarize(profile_of(true), all));
  CHECK_FALSE(summary == dist::detail::summarize(plain, {true, false, false, false}));
  CHECK_THAT(dist::detail::describe(summary), Catch::Contains("1 chain(s) of 15 slot(s)") &&
                                                 Catch::Contains("checkpoint offload tile"));
}

#ifdef MEMSCALE_DP_WORKER

/// A temporary directory for one job: the FileStore, the ranks' logs and results.
class scratch_dir {
 public:
  scratch_dir() {
    std::string pattern = (fs::temp_directory_path() / "memscale_dp_XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path_ = pattern;
  }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
  ~scratch_dir() {
    memscale::detail::remove_tree(path_);
  }
  [[nodiscard]] const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::string read_text(const fs::path& file) {
  std::ifstream in(file);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

/// The ranks of one job, each a worker process with its output in dir()/rank<R>.log.
/// run() enforces a deadline by killing what still runs; the destructor kills
/// and reaps whatever a failed check left behind, then removes dir().
class job {
 public:
  /// Ranks of `scenario` with `timeout`, over a FileStore in dir(), or over a
  /// TCPStore on 127.0.0.1:`tcp_port` when given.
  job(std::string scenario, std::chrono::milliseconds timeout, std::uint16_t tcp_port = 0)
      : dir_(scratch_.path()),
        scenario_(std::move(scenario)),
        store_(tcp_port ? "tcp:" + std::to_string(tcp_port) : (dir_ / "store").string()),
        timeout_(timeout) {}
  job(const job&) = delete;
  job& operator=(const job&) = delete;
  ~job() {
    for (auto& [rank, p] : ranks_)
      if (!p.done) {
        ::kill(p.pid, SIGKILL);
        ::waitpid(p.pid, nullptr, 0);
      }
  }

  /// Launches `ranks` of a job of `world_size` ranks and waits for them until
  /// `deadline`, then kills the rest. Returns the seconds it took.
  double run(const std::vector<int>& ranks, int world_size, std::chrono::seconds deadline) {
    const auto started = clock_type::now();
    for (int rank : ranks) launch(rank, world_size);
    wait(deadline);
    return std::chrono::duration<double>(clock_type::now() - started).count();
  }

  [[nodiscard]] const fs::path& dir() const { return dir_; }
  [[nodiscard]] int exit_code(int rank) const { return ranks_.at(rank).exit_code; }
  [[nodiscard]] bool killed(int rank) const { return ranks_.at(rank).killed; }
  [[nodiscard]] std::string log(int rank) const { return read_text(log_path(rank)); }
  [[nodiscard]] std::string logs() const {
    std::string all;
    for (const auto& [rank, p] : ranks_) all += "--- rank " + std::to_string(rank) + ":\n" + log(rank);
    return all;
  }

 private:
  struct rank_process {
    pid_t pid = 0;
    int exit_code = -1;
    bool done = false;
    bool killed = false;
  };

  void launch(int rank, int world_size) {
    const auto log = log_path(rank);
    std::vector<std::string> args = {MEMSCALE_DP_WORKER, "--dp-worker",  // this binary (tests/main.cpp)
                                     "--rank", std::to_string(rank),
                                     "--world-size", std::to_string(world_size),
                                     "--store", store_,
                                     "--out", dir_.string(),
                                     "--scenario", scenario_,
                                     "--timeout-ms", std::to_string(timeout_.count())};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t files;
    posix_spawn_file_actions_init(&files);
    posix_spawn_file_actions_addopen(&files, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&files, STDOUT_FILENO, STDERR_FILENO);
    pid_t pid = 0;
    const int failed = ::posix_spawn(&pid, argv[0], &files, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&files);
    REQUIRE(failed == 0);
    ranks_[rank] = {pid, -1, false, false};
  }

  /// Waits for every rank to exit, at most `deadline`; kills the ones still
  /// running then. Blocks in poll() on the ranks' pidfds (readable when the
  /// process exits): nothing sleeps or spins.
  void wait(std::chrono::seconds deadline) {
    const auto until = clock_type::now() + deadline;
    std::map<int, int> pidfds;  // rank -> pidfd, closed at the end
    for (auto& [rank, p] : ranks_) {
      if (p.done) continue;
      const int fd = static_cast<int>(::syscall(SYS_pidfd_open, p.pid, 0));
      INFO("pidfd_open(rank " << rank << "): " << std::strerror(errno) << " (needs Linux 5.3 or later)");
      REQUIRE(fd >= 0);
      pidfds[rank] = fd;
    }
    for (;;) {
      bool running = false;
      std::vector<pollfd> waiting;
      for (auto& [rank, p] : ranks_) {
        if (p.done) continue;
        int status = 0;
        if (::waitpid(p.pid, &status, WNOHANG) == p.pid) {
          p.done = true;
          p.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        } else {
          running = true;
          waiting.push_back({pidfds.at(rank), POLLIN, 0});
        }
      }
      const auto now = clock_type::now();
      if (running && now >= until) {
        for (auto& [rank, p] : ranks_)
          if (!p.done) {
            ::kill(p.pid, SIGKILL);
            ::waitpid(p.pid, nullptr, 0);
            p.done = p.killed = true;
          }
        running = false;
      }
      if (!running) break;
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - now).count();
      (void)::poll(waiting.data(), waiting.size(),
                   static_cast<int>(std::min<long long>(left, std::numeric_limits<int>::max())));
    }
    for (const auto& [rank, fd] : pidfds) ::close(fd);
  }

  [[nodiscard]] fs::path log_path(int rank) const { return dir_ / ("rank" + std::to_string(rank) + ".log"); }

  scratch_dir scratch_;
  fs::path dir_;
  std::string scenario_;
  std::string store_;
  std::chrono::milliseconds timeout_;
  std::map<int, rank_process> ranks_;
};

/// A TCP port on 127.0.0.1 that was free a moment ago.
std::uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                     ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  ::close(fd);
  REQUIRE(bound);
  return ntohs(address.sin_port);
}

std::vector<torch::Tensor> load_parameters(const fs::path& file) {
  std::vector<torch::Tensor> params;
  torch::load(params, file.string());
  return params;
}

/// The number after `label` in a plan text ("checkpointed 2 offloaded 0 ...").
long count_after(const std::string& text, const std::string& label) {
  std::smatch m;
  return std::regex_search(text, m, std::regex(label + " (\\d+)")) ? std::stol(m[1]) : -1;
}

TEST_CASE("two and three ranks train bit-identically with and without memscale, and alike", "[distributed][gloo]") {
  // The premise of the checkpoint run: rank 1's own Config plans nothing here.
  {
    auto model = dp_job::make_model(1);
    const auto own = memscale::optimize(model, dp_job::batches_of(1).front().first,
                                        dp_job::config_for(dp_job::run::checkpoint, 1, fs::temp_directory_path()));
    REQUIRE(own.report().checkpointed_segments() == 0);
  }
  // From three ranks on, Gloo's ring adds each element in an order set by its
  // place in its bucket: the buckets must not depend on memscale.
  const int world = GENERATE(2, 3);
  std::vector<int> all_ranks(static_cast<std::size_t>(world));
  std::iota(all_ranks.begin(), all_ranks.end(), 0);
  job ranks("train", std::chrono::seconds(60));
  const double seconds = ranks.run(all_ranks, world, std::chrono::seconds(120));
  INFO(ranks.logs());
  for (int rank : all_ranks) REQUIRE(ranks.exit_code(rank) == 0);
  WARN(world << " ranks, " << std::size(dp_job::runs) << " runs of " << dp_job::steps << " steps: " << seconds
             << " s");

  auto key = [](int rank, dp_job::run r) { return std::make_pair(rank, r); };
  std::map<std::pair<int, dp_job::run>, std::vector<torch::Tensor>> params;
  std::map<std::pair<int, dp_job::run>, std::string> plans;
  for (int rank : all_ranks)
    for (auto r : dp_job::runs) {
      const auto stem = ranks.dir() / ("rank" + std::to_string(rank) + "_" + dp_job::name_of(r));
      params[key(rank, r)] = load_parameters(stem.string() + ".pt");
      plans[key(rank, r)] = read_text(stem.string() + ".txt");
    }
  // Training moved the parameters away from where every rank started (rank 0's).
  CHECK_FALSE(test::bit_equal(params[key(0, dp_job::run::baseline)], dp_job::make_model(0)->parameters()));
  CHECK_FALSE(test::bit_equal(params[key(0, dp_job::run::gpt_baseline)], dp_job::make_gpt(0)->parameters()));

  for (auto r : dp_job::runs) {
    INFO(dp_job::name_of(r) << " run\n" << plans[key(0, r)]);
    for (int rank : all_ranks) {
      INFO("rank " << rank);
      CHECK(plans[key(0, r)] == plans[key(rank, r)]);  // one plan, rank 0's
      CHECK(test::bit_equal(params[key(0, r)], params[key(rank, r)]));
      CHECK(test::bit_equal(params[key(rank, r)], params[key(rank, dp_job::baseline_of(r))]));
    }
  }
  // Where a rank's own plan differed from rank 0's (the checkpoint run: only rank
  // 0's Config asks for one), its Report says so; rank 0's never does.
  const std::string differed = "this rank's own plan (0 checkpointed, 0 offloaded unit(s)) differed from rank 0's";
  for (int rank : all_ranks) {
    const auto stem = ranks.dir() / ("rank" + std::to_string(rank) + "_" + dp_job::name_of(dp_job::run::checkpoint));
    const auto notes = read_text(stem.string() + ".notes");
    INFO("rank " << rank << "'s notes, checkpoint run:\n" << notes);
    CHECK((notes.find(differed) != std::string::npos) == (rank != 0));
  }
  for (auto r : dp_job::runs) {
    const auto stem = ranks.dir() / ("rank0_" + dp_job::name_of(r));
    CHECK_THAT(read_text(stem.string() + ".notes"), !Catch::Contains("differed from rank 0's"));
  }
  CHECK(count_after(plans[key(1, dp_job::run::checkpoint)], "checkpointed") > 0);
  CHECK(count_after(plans[key(1, dp_job::run::offload)], "offloaded") > 0);
  CHECK(count_after(plans[key(1, dp_job::run::offload)], "disk_tensors") > 0);
  CHECK(count_after(plans[key(1, dp_job::run::gpt_checkpoint)], "checkpointed") > 0);
}

TEST_CASE("ranks that profiled different models fail together, naming the rank that differs",
          "[distributed][gloo]") {
  job ranks("structure", std::chrono::seconds(30), free_port());  // a TCPStore this time (rank 0 serves it)
  ranks.run({0, 1}, 2, std::chrono::seconds(60));
  INFO(ranks.logs());
  for (int rank : {0, 1}) {
    CHECK(ranks.exit_code(rank) == 1);
    CHECK_THAT(ranks.log(rank), Catch::Contains("rank 1 differs from rank 0") &&
                                    Catch::Contains("rank 0: 1 chain(s) of 15 slot(s)") &&
                                    Catch::Contains("rank 1: 1 chain(s) of 16 slot(s)"));
  }
}

TEST_CASE("a rank that dies ends the others with an error, not a hang", "[distributed][gloo]") {
  job ranks("die", std::chrono::seconds(3));
  const double seconds = ranks.run({0, 1}, 2, std::chrono::seconds(30));
  INFO(ranks.logs() << "\nafter " << seconds << " s");
  CHECK(ranks.exit_code(1) == 3);
  CHECK_FALSE(ranks.killed(0));
  CHECK(ranks.exit_code(0) == 1);
  // The all-reduce that fails runs inside backward, in c10d's Reducer, so the
  // error is Gloo's own ("Connection reset by peer", "... closed by peer", or a
  // timeout; memscale's hint for its own collectives uses none of these words).
  // The worker's own line (Gloo may log INFO lines before it: Debian unstable's does).
  const auto log = ranks.log(0);
  const auto own = log.find("rank 0: ");
  REQUIRE(own != std::string::npos);
  CHECK((own == 0 || log[own - 1] == '\n'));
  CHECK_THAT(log.substr(own), Catch::Contains("peer") || Catch::Contains("timeout", Catch::CaseSensitive::No));
}

TEST_CASE("a rank that never comes ends the rendezvous with a timeout error", "[distributed][gloo]") {
  job ranks("train", std::chrono::seconds(2));
  const double seconds = ranks.run({0}, 2, std::chrono::seconds(30));  // rank 1 never starts
  INFO(ranks.logs() << "\nafter " << seconds << " s");
  CHECK_FALSE(ranks.killed(0));
  CHECK(ranks.exit_code(0) == 1);
  CHECK_THAT(ranks.log(0), Catch::Contains("rank 0 of 2: the Gloo rendezvous (timeout 2 s) failed"));
  CHECK(seconds >= 2.0);
}

#else

TEST_CASE("two-process jobs need Gloo", "[distributed][gloo]") {
  WARN("the data parallel worker was not built (no Gloo headers: install libgloo-dev): the two-process tests did "
       "not run");
}

#endif

}  // namespace

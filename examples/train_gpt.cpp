// memscale example: train a small GPT twice on the same batches, once as is
// (the baseline) and once inside memscale::optimize(), the two runs taking
// turns a step at a time, and compare the peak memory growth of a training
// step, the step time and the losses. The GPT
// (gpt.hpp) keeps its blocks in a torch::nn::ModuleList and calls each through
// memscale::forward, which makes every call a unit memscale can plan.
//
//   train_gpt [--steps N] [--mode conservative|balanced|aggressive]
//             [--budget-gb X] [--batch B] [--layers L] [--context T]
//             [--d-model C] [--heads H]
//             [--world-size N [--rank R --store FILE|tcp:HOST:PORT] [--bind ADDR] [--timeout-s S]]
//             [--html FILE]  (default memscale_report.html; the plan as a page, and as .json beside it)
//
// With --world-size N both runs train data parallel over N processes (c10d:
// Gloo, gradients all-reduced by c10d's Reducer during backward), each rank on
// its own batches, every rank applying rank 0's memscale plan. Without --rank
// the example starts the N ranks itself on this machine; with --rank, start one
// process per rank yourself (on one machine or several) with the same --store.
// Rank 0 prints; the figures are rank 0's.
//
// On a CPU, memscale checkpoints and offloads to disk, neither of which changes
// the arithmetic: a recomputation replays its forward's RNG state (and masks),
// and each run draws from its own copy of the CPU generator's state while the
// two take turns, so both runs see the same dropout masks and the losses must
// match bit for bit. The exit code is non-zero
// only when something is actually wrong (a loss or parameter differs, or the
// model is still optimized after its guard ended).
#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <csignal>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <dlfcn.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/torch.h>

#include <memscale/distributed.hpp>
#include <memscale/memscale.hpp>

#include "gpt.hpp"
#include "host_info.hpp"
#include "rng_stream.hpp"

extern char** environ;

// Named, so that the program compiles in one translation unit with the others
// (MEMSCALE_UNITY_TRAIN_GPT, cmake/MemscaleTargetOptions.cmake), whose helpers
// share these names.
namespace train_gpt_program {
namespace {

using clock_type = std::chrono::steady_clock;

struct Args {
  int steps = 8;
  std::optional<memscale::OptimizationMode> mode;
  std::optional<double> budget_gb;
  std::int64_t batch = 16;
  gpt::Options model;
  int world_size = 1;        ///< processes training data parallel
  std::optional<int> rank;   ///< this process's rank; unset with world_size > 1: launch them all
  std::string store;         ///< FILE or tcp:HOST:PORT, the same on every rank
  std::string bind = "127.0.0.1";  ///< the address this rank's Gloo listens on
  int timeout_s = 300;             ///< how long a rank waits for the others
  std::string html = "memscale_report.html";  ///< the plan as a page (and, beside it, as .json); "" for none
};

[[noreturn]] void usage(const char* argv0, int code) {
  (code == 0 ? std::cout : std::cerr)
      << "usage: " << argv0
      << " [--steps N] [--mode conservative|balanced|aggressive] [--budget-gb X]\n"
         "       [--batch B] [--layers L] [--context T] [--d-model C] [--heads H]\n"
         "       [--world-size N [--rank R --store FILE|tcp:HOST:PORT] [--bind ADDR] [--timeout-s S]]\n"
         "       [--html FILE]\n"
         "Trains a small GPT for N steps (default 8) without and with memscale and compares\n"
         "peak memory growth, step time and losses. Default mode: aggressive; with --budget-gb\n"
         "(sets Config::memory_budget_gb, per rank) the default mode is balanced.\n"
         "--world-size N trains data parallel over N processes (Gloo). Without --rank the\n"
         "example starts the N ranks on this machine; with --rank R, start each rank yourself\n"
         "with the same --store: a file every rank can open (fresh for each job), or\n"
         "tcp:HOST:PORT, a store rank 0 serves on HOST. --bind: the address of this machine\n"
         "the other ranks reach (default 127.0.0.1, for ranks on one machine). --timeout-s: how\n"
         "long a rank waits for the others before it fails (default 300).\n";
  std::exit(code);
}

template <class T>
T parse_number(std::string_view flag, std::string_view text) {
  T value{};
  const auto* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc{} || ptr != end)
    throw std::invalid_argument("invalid value '" + std::string(text) + "' for " + std::string(flag));
  return value;
}

double parse_double(std::string_view flag, const std::string& text) {
  std::size_t used = 0;
  double value = 0.0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size())
    throw std::invalid_argument("invalid value '" + text + "' for " + std::string(flag));
  return value;
}

memscale::OptimizationMode parse_mode(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  if (text == "conservative") return memscale::OptimizationMode::Conservative;
  if (text == "balanced") return memscale::OptimizationMode::Balanced;
  if (text == "aggressive") return memscale::OptimizationMode::Aggressive;
  throw std::invalid_argument("--mode must be conservative, balanced or aggressive, got '" + text + "'");
}

Args parse_args(int argc, char** argv) {
  Args a;
  a.model.context = 128;
  a.model.d_model = 128;
  a.model.heads = 4;
  a.model.layers = 4;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") usage(argv[0], 0);
    if (i + 1 >= argc) {
      std::cerr << "train_gpt: " << flag << (flag.rfind("--", 0) == 0 ? " needs a value\n" : ": unknown argument\n");
      usage(argv[0], 2);
    }
    const std::string value = argv[++i];
    if (flag == "--steps") a.steps = parse_number<int>(flag, value);
    else if (flag == "--mode") a.mode = parse_mode(value);
    else if (flag == "--budget-gb") a.budget_gb = parse_double(flag, value);
    else if (flag == "--batch") a.batch = parse_number<std::int64_t>(flag, value);
    else if (flag == "--layers") a.model.layers = parse_number<std::int64_t>(flag, value);
    else if (flag == "--context") a.model.context = parse_number<std::int64_t>(flag, value);
    else if (flag == "--d-model") a.model.d_model = parse_number<std::int64_t>(flag, value);
    else if (flag == "--heads") a.model.heads = parse_number<std::int64_t>(flag, value);
    else if (flag == "--world-size") a.world_size = parse_number<int>(flag, value);
    else if (flag == "--rank") a.rank = parse_number<int>(flag, value);
    else if (flag == "--store") a.store = value;
    else if (flag == "--bind") a.bind = value;
    else if (flag == "--timeout-s") a.timeout_s = parse_number<int>(flag, value);
    else if (flag == "--html") a.html = value;
    else {
      std::cerr << "train_gpt: unknown option " << flag << "\n";
      usage(argv[0], 2);
    }
  }
  if (a.steps < 1) throw std::invalid_argument("--steps must be >= 1");
  if (a.batch < 1 || a.model.layers < 1 || a.model.context < 2 || a.model.d_model < 1 || a.model.heads < 1)
    throw std::invalid_argument("--batch, --layers, --d-model and --heads must be >= 1, --context >= 2");
  if (a.model.d_model % a.model.heads != 0)
    throw std::invalid_argument("--d-model (" + std::to_string(a.model.d_model) + ") must be a multiple of --heads (" +
                                std::to_string(a.model.heads) + ")");
  if (a.budget_gb && !(*a.budget_gb > 0.0)) throw std::invalid_argument("--budget-gb must be > 0");
  if (a.world_size < 1) throw std::invalid_argument("--world-size must be >= 1");
  if (a.timeout_s < 1) throw std::invalid_argument("--timeout-s must be >= 1");
  if (a.rank && (*a.rank < 0 || *a.rank >= a.world_size))
    throw std::invalid_argument("--rank must be in [0, " + std::to_string(a.world_size) + "), got " +
                                std::to_string(*a.rank));
  if (a.rank && a.store.empty())
    throw std::invalid_argument("--rank needs --store FILE|tcp:HOST:PORT, the same on every rank");
  if (!a.rank && !a.store.empty())
    throw std::invalid_argument("--store goes with --rank (without --rank the example launches the ranks itself)");
  return a;
}

std::string mib(std::int64_t bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2) << static_cast<double>(bytes) / (1024.0 * 1024.0) << " MiB";
  return os.str();
}

std::string ms(double seconds) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << seconds * 1e3 << " ms";
  return os.str();
}

std::string ratio(double num, double den) {
  if (!(den > 0.0)) return "n/a";
  std::ostringstream os;
  os << std::fixed << std::setprecision(3) << num / den << "x";
  return os.str();
}

template <class T>
T median(std::vector<T> v) {
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  if (n == 0) return T{};
  return n % 2 == 1 ? v[n / 2] : static_cast<T>((v[n / 2 - 1] + v[n / 2]) / 2);
}

struct StepResult {
  float loss = 0.0f;
  std::int64_t peak_growth = 0;  ///< bytes, over the step's starting live bytes
  double seconds = 0.0;
};

/// One training step: forward (the model's, or DataParallel's), loss, backward,
/// optimizer step. The caller opens the peak scope (so the first memscale step
/// can include planning).
template <class Forward>
float train_step(Forward&& forward, torch::optim::Optimizer& optimizer, const gpt::Batch& batch) {
  optimizer.zero_grad();
  const torch::Tensor loss = gpt::loss(forward(batch.input), batch.target);
  loss.backward();
  optimizer.step();
  return loss.item<float>();
}

bool same_parameters(gpt::GPT& a, gpt::GPT& b) {
  const auto pa = a->named_parameters();
  const auto pb = b->named_parameters();
  if (pa.size() != pb.size()) return false;
  for (const auto& item : pa) {
    const auto* other = pb.find(item.key());
    if (other == nullptr || !torch::equal(item.value(), *other)) return false;
  }
  return true;
}

namespace dist = memscale::distributed;

/// The process group of a data parallel run (null for one process): Gloo over
/// the FileStore or TCPStore --store names, listening on --bind.
dist::process_group make_group(const Args& args) {
  if (args.world_size == 1) return {};
#if MEMSCALE_HAS_GLOO()
  const int rank = *args.rank;
  const std::chrono::milliseconds timeout = std::chrono::seconds(args.timeout_s);
  if (args.store.rfind("tcp:", 0) != 0)
    return dist::gloo_group(dist::file_store(args.store, args.world_size, timeout), rank, args.world_size, timeout,
                            args.bind);
  const auto address = args.store.substr(4);
  const auto colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0)
    throw std::invalid_argument("--store tcp:HOST:PORT needs a host and a port, got '" + args.store + "'");
  const auto port = parse_number<std::uint16_t>("--store", std::string_view(address).substr(colon + 1));
  auto store = dist::tcp_store(address.substr(0, colon), port, rank, args.world_size, timeout);
  return dist::gloo_group(store, rank, args.world_size, timeout, args.bind);
#else
  throw std::runtime_error("this train_gpt was built without Gloo's headers, so it cannot train data parallel: "
                           "install libgloo-dev (scripts/setup-deps.sh does) and rebuild");
#endif
}

/// Whether this rank holds rank 0's parameters of `model`.
bool equal_to_rank0(gpt::GPT& model, const dist::process_group& group) {
  std::vector<torch::Tensor> flat;
  for (const auto& p : model->parameters()) flat.push_back(p.detach().reshape(-1));
  const auto mine = torch::cat(flat);
  std::vector<torch::Tensor> rank0{mine.clone()};
  group->broadcast(rank0)->wait();
  return torch::equal(mine, rank0.front());
}

/// How many ranks report `failed` (every rank learns the sum).
int ranks_where(bool failed, const dist::process_group& group) {
  std::vector<torch::Tensor> count{torch::tensor({failed ? 1 : 0}, torch::kInt32)};
  group->allreduce(count)->wait();
  return count.front().item<int>();
}

/// The launcher's ranks' process group, for the signal handler (0: none yet).
volatile std::sig_atomic_t ranks_group = 0;

/// Passes SIGINT, SIGTERM and SIGHUP on to the ranks; the launcher then reaps them.
extern "C" void forward_to_ranks(int signal_number) {
  if (ranks_group > 0) ::kill(-static_cast<pid_t>(ranks_group), signal_number);
}

/// Starts ranks 0..N-1 of this program on this machine (Gloo over a FileStore in
/// a fresh temporary directory, OMP_NUM_THREADS set to each rank's share of the
/// cores unless set already) and waits for them. Rank 0 reports. The ranks run in
/// a process group of their own, which gets the signals the launcher gets; when a
/// rank fails the others are stopped (as torchrun does). The exit status is the
/// first failing rank's, else 0.
int launch(int argc, char** argv, const Args& args) {
  namespace fs = std::filesystem;
  std::string pattern = (fs::temp_directory_path() / "memscale-train-gpt-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr)
    throw std::runtime_error("cannot create a temporary directory for the store: " + std::string(std::strerror(errno)));
  struct removed_at_exit {
    fs::path dir;
    ~removed_at_exit() {
      // The store's one file, then the directory: not fs::remove_all, which the PyTorch wheel's libtorch.so
      // exports from a static libstdc++ and which crashed there (pytorch/pytorch#133437).
      std::error_code ignored;
      fs::remove(dir / "store", ignored);
      fs::remove(dir, ignored);
    }
  } scratch{pattern};
  const auto store = (scratch.dir / "store").string();
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    const auto share = std::max(1u, std::thread::hardware_concurrency() / static_cast<unsigned>(args.world_size));
    ::setenv("OMP_NUM_THREADS", std::to_string(share).c_str(), 1);
  }
  struct sigaction forward {};
  forward.sa_handler = forward_to_ranks;
  sigemptyset(&forward.sa_mask);
  for (int signal_number : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(signal_number, &forward, nullptr);

  std::vector<pid_t> ranks;  // -1 once reaped
  auto stop_all = [&] {
    if (ranks_group > 0) ::kill(-static_cast<pid_t>(ranks_group), SIGTERM);
  };
  for (int r = 0; r < args.world_size; ++r) {
    std::vector<std::string> words(argv, argv + argc);
    words.insert(words.end(), {"--rank", std::to_string(r), "--store", store});
    std::vector<char*> argv_r;
    for (auto& w : words) argv_r.push_back(w.data());
    argv_r.push_back(nullptr);
    posix_spawnattr_t attributes;
    posix_spawnattr_init(&attributes);
    posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attributes, static_cast<pid_t>(ranks_group));  // rank 0: a new group
    pid_t pid = 0;
    const int error = ::posix_spawn(&pid, "/proc/self/exe", nullptr, &attributes, argv_r.data(), environ);
    posix_spawnattr_destroy(&attributes);
    if (error != 0) {
      stop_all();
      for (const pid_t started : ranks) ::waitpid(started, nullptr, 0);
      throw std::runtime_error("cannot start rank " + std::to_string(r) + ": " + std::strerror(error));
    }
    if (r == 0) ranks_group = pid;
    ranks.push_back(pid);
  }
  int job_status = 0;
  for (int left = args.world_size; left > 0;) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;  // a signal, passed on to the ranks: reap them
      break;
    }
    const auto it = std::find(ranks.begin(), ranks.end(), pid);
    if (it == ranks.end()) continue;
    const auto rank = static_cast<int>(it - ranks.begin());
    *it = -1;
    --left;
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (code == 0 || job_status != 0) continue;  // the first failure is the job's
    job_status = code;
    if (left > 0) {
      std::cerr << "train_gpt: rank " << rank << " ended with exit status " << code << "; stopping the others\n";
      stop_all();
    }
  }
  return job_status;
}

int run(const Args& args) {
  constexpr std::uint64_t init_seed = 42;     // model initialisation
  constexpr std::uint64_t train_seed = 1234;  // dropout masks during training
  constexpr std::uint64_t data_seed = 7;      // batch sampling
  constexpr double learning_rate = 3e-4;

  const auto mode = args.mode.value_or(args.budget_gb ? memscale::OptimizationMode::Balanced
                                                      : memscale::OptimizationMode::Aggressive);
  memscale::Config cfg;
  cfg.mode = mode;
  cfg.memory_budget_gb = args.budget_gb;

  // Data parallel: each rank draws its own batches and dropout masks, the same
  // in both runs; only rank 0 prints (the others' std::cout is switched off).
  const auto group = make_group(args);
  const int rank = args.rank.value_or(0);
  if (rank != 0) std::cout.setstate(std::ios_base::badbit);

  std::cout << "memscale " << memscale::version_major << '.' << memscale::version_minor << '.'
            << memscale::version_patch << " example: GPT training, baseline vs memscale\n";
  std::cout << "BLAS: " << host_info::blas_in_use() << "\n";
  std::cout << "torch threads: " << torch::get_num_threads() << " (intra-op)";
  if (const int t = host_info::openblas_threads(); t > 0) std::cout << ", OpenBLAS threads: " << t;
  std::cout << ", logical CPUs: " << std::thread::hardware_concurrency() << "\n";

  const auto data = gpt::encode(gpt::training_text());
  const auto& o = args.model;
  std::cout << "model: GPT, " << o.layers << " layers, d_model " << o.d_model << ", " << o.heads << " heads, context "
            << o.context << ", dropout " << o.dropout << "; batch " << args.batch << ", " << args.steps
            << " steps, AdamW lr " << learning_rate << "; data " << data.size(0) << " bytes of embedded text\n";
  std::cout << "memscale: mode " << mode << ", budget ";
  if (args.budget_gb) std::cout << *args.budget_gb << " GB (Config::memory_budget_gb)\n\n";
  else std::cout << "unset (host RAM)\n";
  if (group)
    std::cout << "data parallel: " << args.world_size << " processes over c10d (Gloo, gradients all-reduced by "
                 "c10d's Reducer during backward), each on its own batches, all applying rank 0's plan; "
                 "the figures below are rank 0's\n";
  std::cout << "\n";

  // The same batches for both runs.
  std::mt19937_64 rng(data_seed + static_cast<std::uint64_t>(rank));
  std::vector<gpt::Batch> batches;
  for (int s = 0; s < args.steps; ++s) batches.push_back(gpt::sample_batch(data, args.batch, o.context, rng));
  const auto example_tokens = batches.front().input;

  torch::manual_seed(init_seed);
  gpt::GPT baseline(o);
  torch::manual_seed(init_seed);
  gpt::GPT model2(o);
  baseline->train();
  model2->train();

  std::int64_t parameter_bytes = 0;
  for (const auto& p : baseline->parameters()) parameter_bytes += static_cast<std::int64_t>(p.nbytes());
  std::cout << "parameters: " << mib(parameter_bytes) << " per model\n";

  // --- both runs, in turn -----------------------------------------------------
  // The two runs take turns a step at a time (baseline, memscale; then memscale,
  // baseline; ...), so that a machine that slows down or speeds up over the run
  // (another process, a clock that changes, a noisy VM) weighs on both alike and
  // the step-time ratio compares steps taken side by side. Measured on a noisy
  // 2-CPU VM (2026-12-03), the same program with the runs one after the other
  // printed 1.26x and 1.69x in two fresh processes. Each run draws its dropout
  // masks from its own copy of the CPU generator's state, which it continues
  // from step to step, as if it trained alone.
  std::cout << "training the baseline and memscale in turn, a step each (" << args.steps
            << " steps each, same batches, same seed)...\n"
            << std::flush;
  std::vector<StepResult> base, opt;
  std::int64_t planning_growth = 0, planning_retained = 0;
  double planning_seconds = 0.0;
  memscale::Report report;
  std::optional<memscale::offload::engine_stats> offload;  // what the offload engine did, when the plan offloads
  {
    std::optional<dist::DataParallel<gpt::GPT>> base_dp, opt_dp;  // each broadcasts rank 0's parameters
    if (group) {
      base_dp.emplace(baseline, group);
      opt_dp.emplace(model2, group);  // before or after optimize(): memscale never changes parameters
    }
    auto base_forward = [&](const torch::Tensor& x) { return base_dp ? base_dp->forward(x) : baseline->forward(x); };
    auto opt_forward = [&](const torch::Tensor& x) { return opt_dp ? opt_dp->forward(x) : model2->forward(x); };
    torch::optim::AdamW base_optimizer(baseline->parameters(), torch::optim::AdamWOptions(learning_rate));
    torch::optim::AdamW opt_optimizer(model2->parameters(), torch::optim::AdamWOptions(learning_rate));
    torch::manual_seed(train_seed + static_cast<std::uint64_t>(rank));
    run_rng::stream base_rng, opt_rng;  // both from the seed

    const auto baseline_step = [&](int s) {
      StepResult r;
      memscale::memory_tracker::peak_scope scope;
      const auto start = clock_type::now();
      base_rng.run([&] { r.loss = train_step(base_forward, base_optimizer, batches[static_cast<std::size_t>(s)]); });
      r.seconds = std::chrono::duration<double>(clock_type::now() - start).count();
      r.peak_growth = scope.peak_growth();
      base.push_back(r);
    };
    baseline_step(0);

    // The first memscale step's scope opens before planning, so its peak includes profiling and planning.
    std::optional<memscale::memory_tracker::peak_scope> first_scope(std::in_place);
    const auto plan_start = clock_type::now();
    // Data parallel: every rank profiles its own example batch; rank 0's plan is applied on all.
    // optimize() draws no random numbers training would see.
    auto guard = opt_rng.run([&] {
      return group ? dist::optimize(model2, example_tokens, cfg, group)
                   : memscale::optimize(model2, example_tokens, cfg);
    });
    planning_seconds = std::chrono::duration<double>(clock_type::now() - plan_start).count();
    planning_growth = first_scope->peak_growth();
    planning_retained = memscale::memory_tracker::current_bytes() - first_scope->baseline();

    report = guard.report();
    std::cout << "\n" << report << "\n";

    const auto memscale_step = [&](int s) {
      StepResult r;
      std::optional<memscale::memory_tracker::peak_scope> scope;
      if (s > 0) scope.emplace();
      auto& active = s == 0 ? *first_scope : *scope;
      const auto start = clock_type::now();
      const auto step = [&] { r.loss = train_step(opt_forward, opt_optimizer, batches[static_cast<std::size_t>(s)]); };
      opt_rng.run([&] {
        // The last step traced for the report page: the device's bytes at every unit's boundary.
        if (s == args.steps - 1 && !args.html.empty() && rank == 0) (void)guard.trace_step(step);
        else step();
      });
      r.seconds = std::chrono::duration<double>(clock_type::now() - start).count();
      r.peak_growth = active.peak_growth();
      if (s == 0) first_scope.reset();
      opt.push_back(r);
    };
    memscale_step(0);
    for (int s = 1; s < args.steps; ++s) {
      if (s % 2 == 1) {
        baseline_step(s);
        memscale_step(s);
      } else {
        memscale_step(s);
        baseline_step(s);
      }
    }
    if (!guard.active()) {
      std::cerr << "train_gpt: ERROR: the guard stopped managing the model before its scope ended\n";
      return 1;
    }
    offload = guard.offload_stats();
    if (!args.html.empty() && rank == 0) {
      // The plan with what was measured while training: memory timeline, plan table, offload traffic.
      const auto trained = guard.report();  // with the last step's trace
      std::ofstream(args.html) << trained.to_html();
      const auto json = std::filesystem::path(args.html).replace_extension(".json");
      std::ofstream(json) << trained.to_json() << "\n";
      std::cout << "report: " << args.html << " (and " << json.string() << ")\n";
    }
  }  // the guard detaches model2 here
  const bool still_optimized = memscale::is_optimized(model2);

  // --- per-step table -------------------------------------------------------------
  bool losses_match = true;
  std::cout << "step  loss baseline   loss memscale   bit-exact  peak growth baseline  peak growth memscale  "
               "time baseline  time memscale\n";
  for (int s = 0; s < args.steps; ++s) {
    const auto& b = base[static_cast<std::size_t>(s)];
    const auto& m = opt[static_cast<std::size_t>(s)];
    const bool same = std::bit_cast<std::uint32_t>(b.loss) == std::bit_cast<std::uint32_t>(m.loss);
    losses_match = losses_match && same;
    std::cout << std::setw(4) << s + 1 << "  " << std::fixed << std::setprecision(7) << std::setw(13) << b.loss
              << "   " << std::setw(13) << m.loss << "   " << std::setw(9) << (same ? "yes" : "NO") << "  "
              << std::setw(20) << mib(b.peak_growth) << "  " << std::setw(20) << mib(m.peak_growth)
              << (s == 0 ? "*" : " ") << " " << std::setw(13) << ms(b.seconds) << "  " << std::setw(13)
              << ms(m.seconds) << (s == 0 ? "*" : "") << "\n";
  }
  std::cout << "(* memscale step 1 includes profiling + planning: " << mib(planning_growth) << " peak growth, "
            << mib(planning_retained) << " retained, " << ms(planning_seconds)
            << "; both step 1s include creating AdamW's state)\n\n";
  const bool params_match = same_parameters(baseline, model2);

  // --- summary --------------------------------------------------------------------
  auto steady = [&](const std::vector<StepResult>& v, auto field) {
    std::vector<double> xs;
    for (std::size_t s = (v.size() > 1 ? 1 : 0); s < v.size(); ++s) xs.push_back(static_cast<double>(field(v[s])));
    return median(xs);
  };
  const auto growth = [](const StepResult& r) { return r.peak_growth; };
  const auto secs = [](const StepResult& r) { return r.seconds; };
  const double base_growth = steady(base, growth), opt_growth = steady(opt, growth);
  const double base_time = steady(base, secs), opt_time = steady(opt, secs);
  const std::string over = args.steps > 1 ? "median of steps 2.." + std::to_string(args.steps) : "step 1";
  const auto col = [](const std::string& s) {
    std::ostringstream os;
    os << std::setw(14) << s;
    return os.str();
  };

  std::cout << "summary (" << over << ")                 baseline        memscale   memscale/baseline\n";
  std::cout << "peak memory growth per step          " << col(mib(static_cast<std::int64_t>(base_growth))) << "  "
            << col(mib(static_cast<std::int64_t>(opt_growth))) << "  " << std::setw(10)
            << ratio(opt_growth, base_growth) << "\n";
  std::cout << "peak memory growth, step 1 (+plan) " << "  " << col(mib(base.front().peak_growth)) << "  "
            << col(mib(opt.front().peak_growth)) << "  " << std::setw(10)
            << ratio(static_cast<double>(opt.front().peak_growth), static_cast<double>(base.front().peak_growth))
            << "\n";
  std::cout << "step time                            " << col(ms(base_time)) << "  " << col(ms(opt_time)) << "  "
            << std::setw(10) << ratio(opt_time, base_time) << "\n";
  {
    // Each step's ratio, memscale's over the baseline's step taken beside it: the
    // pairs share what the machine did at the time.
    std::vector<double> paired;
    for (std::size_t s = (opt.size() > 1 ? 1 : 0); s < opt.size(); ++s)
      if (base[s].seconds > 0) paired.push_back(opt[s].seconds / base[s].seconds);
    const std::string label = "step time, steps paired (median of their ratios)";
    std::cout << label << std::setw(static_cast<int>(37 + 14 + 2 + 14 + 2 + 10 - label.size()))
              << (paired.empty() ? ratio(0.0, 0.0) : ratio(median(paired), 1.0));
    if (paired.size() >= 4) {  // the middle half of the pairs: how much the machine moved under them
      std::sort(paired.begin(), paired.end());
      const auto half = static_cast<std::ptrdiff_t>(paired.size() / 2);
      const std::vector<double> lower(paired.begin(), paired.begin() + half), upper(paired.end() - half, paired.end());
      std::cout << "  (half the pairs within " << ratio(median(lower), 1.0) << "-" << ratio(median(upper), 1.0)
                << ")";
    }
    std::cout << "\n";
  }
  std::cout << "step time, step 1 (+plan)            " << col(ms(base.front().seconds)) << "  "
            << col(ms(opt.front().seconds + planning_seconds)) << "  " << std::setw(10)
            << ratio(opt.front().seconds + planning_seconds, base.front().seconds) << "\n";
  std::cout << "planner: projected step peak " << mib(report.baseline_peak_bytes()) << " -> "
            << mib(report.planned_peak_bytes()) << " (static " << mib(report.static_bytes()) << "), "
            << report.checkpointed_segments() << " checkpointed segment(s), " << report.offloaded_units()
            << " offloaded unit(s)\n";
  if (offload) {
    const auto& disk = offload->at(memscale::offload::tier::disk);
    std::cout << "offload engine: " << mib(offload->bytes_written / args.steps) << " written and "
              << mib(offload->bytes_read / args.steps) << " read per step, disk tier peak " << mib(disk.peak) << ", "
              << offload->warnings.size() << " warning(s)\n";
    // The transfers as projected (the plan's rate, measured in this process or nominal) beside as they ran.
    std::cout << "offload transfers per step: " << ms(offload->transfer_seconds / args.steps) << " measured"
              << (offload->some_untimed() ? " (asynchronous GPU copies untimed)" : "") << ", "
              << ms(report.offload_wait_seconds(false)) << " projected";
    if (report.offload_bytes_per_second > 0) {
      std::ostringstream rate;
      rate << std::fixed << std::setprecision(0) << report.offload_bytes_per_second / 1e6;
      std::cout << " at " << rate.str() << " MB/s one way (" << (report.offload_rate_measured ? "measured" : "nominal")
                << ")";
    }
    std::cout << "\n";
  }
  if (report.checkpointed_segments() == 0)
    std::cout << "note: the plan checkpoints nothing (memory pressure " << std::setprecision(3)
              << report.memory_pressure() << " in mode " << mode
              << "), so both runs use the same memory; try --mode aggressive or a smaller --budget-gb\n";

  int status = 0;
  std::cout << "losses bit-for-bit identical: " << (losses_match ? "yes" : "NO") << "\n";
  std::cout << "parameters after training bit-for-bit identical: " << (params_match ? "yes" : "NO") << "\n";
  if (!losses_match || !params_match) {
    std::cout << "ERROR: on a CPU memscale checkpoints and offloads to disk: it recomputes the same operations on\n"
                 "the same inputs with the forward's RNG state restored and reads back the bytes it wrote, so the\n"
                 "results must be bit-exact. A difference means a checkpointed segment did not reproduce its\n"
                 "forward (its RNG state or a buffer was not restored, or the recomputation took a different\n"
                 "kernel path), an offloaded tensor came back changed, or something drew random numbers outside\n"
                 "the runs' own generator states (run_rng::stream).\n";
    status = 1;
  }
  std::cout << "after the guard ended: memscale::is_optimized(model2) = " << (still_optimized ? "true" : "false")
            << (still_optimized ? "  <- ERROR: the guard did not detach the model" : " (detached, as expected)")
            << "\n";
  if (still_optimized) status = 1;
  if (!group) return status;

  // Data parallel: every rank checks its own run, and that it ends with rank 0's
  // parameters; rank 0 reports for all, and its exit status is the job's (the
  // others end with 0 once the verdict is in, so that no launcher stops rank 0
  // while it prints). Every rank runs both broadcasts, whatever the first says.
  const bool baseline_as_rank0 = equal_to_rank0(baseline, group);
  const bool memscale_as_rank0 = equal_to_rank0(model2, group);
  const bool same_as_rank0 = baseline_as_rank0 && memscale_as_rank0;
  const int ranks_differing = ranks_where(!losses_match || !params_match || still_optimized, group);
  const int ranks_apart = ranks_where(!same_as_rank0, group);
  std::cout << "ranks whose memscale run differs from their baseline: " << ranks_differing << " of "
            << args.world_size << "\n";
  std::cout << "parameters equal on every rank (baseline and memscale): " << (ranks_apart == 0 ? "yes" : "NO")
            << "\n";
  if (ranks_apart != 0)
    std::cout << "ERROR: " << ranks_apart << " rank(s) ended with other parameters than rank 0's: the gradient "
              << "all-reduce did not give every rank the same update\n";
  return rank == 0 && (ranks_differing != 0 || ranks_apart != 0) ? 1 : 0;
}

}  // namespace
}  // namespace train_gpt_program

int main(int argc, char** argv) {
  namespace program = train_gpt_program;
  memscale::memory_tracker::install();  // before any tensor exists, so every byte is counted
  gpt::register_memscale_rule();
  std::string who = "train_gpt";
  try {
    const auto args = program::parse_args(argc, argv);
    if (args.world_size > 1 && !args.rank) return program::launch(argc, argv, args);
    if (args.rank) {
      who += " (rank " + std::to_string(*args.rank) + ")";
      // Gloo writes to the other ranks with writev(2), which raises SIGPIPE where
      // one is gone: ignored (as Python does), the write fails and Gloo throws.
      ::signal(SIGPIPE, SIG_IGN);
    }
    return program::run(args);
  } catch (const std::invalid_argument& e) {
    std::cerr << who << ": " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << who << ": error: " << e.what() << "\n";
    return 1;
  }
}

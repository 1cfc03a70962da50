// memscale example: train a small GPT twice on the same batches, once as is
// (the baseline) and once inside memscale::optimize(), and compare the peak
// memory growth of a training step, the step time and the losses. The GPT
// (gpt.hpp) keeps its blocks in a torch::nn::ModuleList and calls each through
// memscale::forward, which makes every call a unit memscale can plan.
//
//   train_gpt [--steps N] [--mode conservative|balanced|aggressive]
//             [--budget-gb X] [--batch B] [--layers L] [--context T]
//             [--d-model C] [--heads H]
//
// On a CPU, memscale applies activation checkpointing only, and checkpointing
// restores the RNG state for the recomputation, so both runs see the same
// dropout masks and the losses must match bit for bit. The exit code is non-zero
// only when something is actually wrong (a loss or parameter differs, or the
// model is still optimized after its guard ended).
#include <algorithm>
#include <bit>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdlib>
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

#include <torch/torch.h>

#include <memscale/memscale.hpp>

#include "gpt.hpp"
#include "host_info.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

struct Args {
  int steps = 8;
  std::optional<memscale::OptimizationMode> mode;
  std::optional<double> budget_gb;
  std::int64_t batch = 16;
  gpt::Options model;
};

[[noreturn]] void usage(const char* argv0, int code) {
  (code == 0 ? std::cout : std::cerr)
      << "usage: " << argv0
      << " [--steps N] [--mode conservative|balanced|aggressive] [--budget-gb X]\n"
         "       [--batch B] [--layers L] [--context T] [--d-model C] [--heads H]\n"
         "Trains a small GPT for N steps (default 8) without and with memscale and compares\n"
         "peak memory growth, step time and losses. Default mode: aggressive; with --budget-gb\n"
         "(sets Config::memory_budget_gb) the default mode is balanced.\n";
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

/// One training step: forward, loss, backward, optimizer step. The caller opens
/// the peak scope (so the first memscale step can include planning).
float train_step(gpt::GPT& model, torch::optim::Optimizer& optimizer, const gpt::Batch& batch) {
  optimizer.zero_grad();
  auto loss = gpt::loss(model->forward(batch.input), batch.target);
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
  else std::cout << "unset (host RAM)\n\n";

  // The same batches for both runs.
  std::mt19937_64 rng(data_seed);
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

  // --- baseline ---------------------------------------------------------------
  std::cout << "training the baseline (" << args.steps << " steps)...\n" << std::flush;
  std::vector<StepResult> base;
  {
    torch::optim::AdamW optimizer(baseline->parameters(), torch::optim::AdamWOptions(learning_rate));
    torch::manual_seed(train_seed);
    for (int s = 0; s < args.steps; ++s) {
      StepResult r;
      memscale::memory_tracker::peak_scope scope;
      const auto start = clock_type::now();
      r.loss = train_step(baseline, optimizer, batches[static_cast<std::size_t>(s)]);
      r.seconds = std::chrono::duration<double>(clock_type::now() - start).count();
      r.peak_growth = scope.peak_growth();
      base.push_back(r);
    }
  }

  // --- memscale ---------------------------------------------------------------
  std::cout << "training with memscale (" << args.steps << " steps, same batches, same seed)...\n" << std::flush;
  std::vector<StepResult> opt;
  std::int64_t planning_growth = 0, planning_retained = 0;
  double planning_seconds = 0.0;
  memscale::Report report;
  std::optional<memscale::offload::engine_stats> offload;  // what the offload engine did, when the plan offloads
  {
    torch::optim::AdamW optimizer(model2->parameters(), torch::optim::AdamWOptions(learning_rate));
    torch::manual_seed(train_seed);  // optimize() draws no random numbers training would see
    // The first step's scope opens before planning, so its peak includes profiling and planning.
    std::optional<memscale::memory_tracker::peak_scope> first_scope(std::in_place);
    const auto plan_start = clock_type::now();
    auto guard = memscale::optimize(model2, example_tokens, cfg);
    planning_seconds = std::chrono::duration<double>(clock_type::now() - plan_start).count();
    planning_growth = first_scope->peak_growth();
    planning_retained = memscale::memory_tracker::current_bytes() - first_scope->baseline();

    report = guard.report();
    std::cout << "\n" << report << "\n";

    for (int s = 0; s < args.steps; ++s) {
      StepResult r;
      std::optional<memscale::memory_tracker::peak_scope> scope;
      if (s > 0) scope.emplace();
      auto& active = s == 0 ? *first_scope : *scope;
      const auto start = clock_type::now();
      r.loss = train_step(model2, optimizer, batches[static_cast<std::size_t>(s)]);
      r.seconds = std::chrono::duration<double>(clock_type::now() - start).count();
      r.peak_growth = active.peak_growth();
      if (s == 0) first_scope.reset();
      opt.push_back(r);
    }
    if (!guard.active()) {
      std::cerr << "train_gpt: ERROR: the guard stopped managing the model before its scope ended\n";
      return 1;
    }
    offload = guard.offload_stats();
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
  }
  if (report.checkpointed_segments() == 0)
    std::cout << "note: the plan checkpoints nothing (memory pressure " << std::setprecision(3)
              << report.memory_pressure() << " in mode " << mode
              << "), so both runs use the same memory; try --mode aggressive or a smaller --budget-gb\n";

  int status = 0;
  std::cout << "losses bit-for-bit identical: " << (losses_match ? "yes" : "NO") << "\n";
  std::cout << "parameters after training bit-for-bit identical: " << (params_match ? "yes" : "NO") << "\n";
  if (!losses_match || !params_match) {
    std::cout << "ERROR: on a CPU memscale applies checkpointing only, which recomputes the same operations on the\n"
                 "same inputs with the forward's RNG state restored, so the results must be bit-exact. A difference\n"
                 "means a checkpointed segment did not reproduce its forward (e.g. its RNG state or a buffer was\n"
                 "not restored, or the recomputation took a different kernel path).\n";
    status = 1;
  }
  std::cout << "after the guard ended: memscale::is_optimized(model2) = " << (still_optimized ? "true" : "false")
            << (still_optimized ? "  <- ERROR: the guard did not detach the model" : " (detached, as expected)")
            << "\n";
  if (still_optimized) status = 1;
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  memscale::memory_tracker::install();  // before any tensor exists, so every byte is counted
  gpt::register_memscale_rule();
  try {
    return run(parse_args(argc, argv));
  } catch (const std::invalid_argument& e) {
    std::cerr << "train_gpt: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "train_gpt: error: " << e.what() << "\n";
    return 1;
  }
}

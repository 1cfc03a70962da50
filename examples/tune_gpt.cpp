// memscale example: tune the example GPT under a memory budget with
// memscale::autotune, then train with the winner, and compare it with the
// default Config (Balanced, same budget) in the same process: the measured
// peak against the budget and the speed.
//
//   tune_gpt [--budget-gb X] [--batch B] [--batches B1,B2,...] [--steps N]
//            [--time-budget S] [--cache FILE | --no-cache]
//            [--layers L] [--context T] [--d-model C] [--heads H]
//
// Without --budget-gb the budget is halfway between what memscale::predict says
// the plain step holds at --batch and what it holds under Aggressive's plan: the
// baseline does not fit, so the tuner must find a plan that does. The exit code is non-zero only when
// something is actually wrong: the tuner found nothing that fits, or training
// with its winner went over the budget.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <iomanip>
#include <iostream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <torch/torch.h>

#include <memscale/memscale.hpp>

#include "gpt.hpp"
#include "host_info.hpp"

namespace {

struct Args {
  std::optional<double> budget_gb;
  std::int64_t batch = 16;
  std::vector<std::int64_t> batches;  // empty: --batch only
  int steps = 6;
  double time_budget_s = 120.0;
  std::optional<std::string> cache;
  bool no_cache = false;
  gpt::Options model;
};

[[noreturn]] void usage(const char* argv0, int code) {
  (code == 0 ? std::cout : std::cerr)
      << "usage: " << argv0
      << " [--budget-gb X] [--batch B] [--batches B1,B2,...] [--steps N] [--time-budget S]\n"
         "       [--cache FILE | --no-cache] [--layers L] [--context T] [--d-model C] [--heads H]\n"
         "Tunes the example GPT under a memory budget with memscale::autotune, trains with the winner and\n"
         "compares it with the default Config (Balanced) under the same budget.\n";
  std::exit(code);
}

Args parse(int argc, char** argv) {
  Args a;
  const auto value = [&](int& i) -> std::string {
    if (i + 1 >= argc) {
      std::cerr << argv[0] << ": " << argv[i] << " needs a value\n";
      usage(argv[0], 2);
    }
    return argv[++i];
  };
  const auto number = [&](int& i) {
    const std::string flag = argv[i];
    const auto text = value(i);
    try {
      std::size_t used = 0;
      const double v = std::stod(text, &used);
      if (used != text.size() || !(v > 0)) throw std::invalid_argument(text);
      return v;
    } catch (const std::exception&) {
      std::cerr << argv[0] << ": " << flag << " must be a positive number, got '" << text << "'\n";
      usage(argv[0], 2);
    }
  };
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--help" || flag == "-h") usage(argv[0], 0);
    else if (flag == "--budget-gb") a.budget_gb = number(i);
    else if (flag == "--batch") a.batch = static_cast<std::int64_t>(number(i));
    else if (flag == "--steps") a.steps = static_cast<int>(number(i));
    else if (flag == "--time-budget") a.time_budget_s = number(i);
    else if (flag == "--cache") a.cache = value(i);
    else if (flag == "--no-cache") a.no_cache = true;
    else if (flag == "--layers") a.model.layers = static_cast<std::int64_t>(number(i));
    else if (flag == "--context") a.model.context = static_cast<std::int64_t>(number(i));
    else if (flag == "--d-model") a.model.d_model = static_cast<std::int64_t>(number(i));
    else if (flag == "--heads") a.model.heads = static_cast<std::int64_t>(number(i));
    else if (flag == "--batches") {
      std::stringstream list(value(i));
      std::string item;
      while (std::getline(list, item, ',')) {
        char* end = nullptr;
        const auto b = std::strtoll(item.c_str(), &end, 10);
        if (item.empty() || *end != '\0' || b < 1) {
          std::cerr << argv[0] << ": --batches must be positive integers separated by commas, got '" << item << "'\n";
          usage(argv[0], 2);
        }
        a.batches.push_back(b);
      }
    } else {
      std::cerr << argv[0] << ": unknown option '" << flag << "'\n";
      usage(argv[0], 2);
    }
  }
  if (a.model.d_model % a.model.heads != 0) {
    std::cerr << argv[0] << ": --d-model must be a multiple of --heads\n";
    usage(argv[0], 2);
  }
  return a;
}

std::string mib(std::int64_t bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << static_cast<double>(bytes) / (1024.0 * 1024.0) << " MiB";
  return os.str();
}

/// What a few training steps under one Config held and how fast they ran.
struct Run {
  std::int64_t allocator_peak = 0;  // parameters and buffers + the tracker's peak growth
  std::int64_t process_peak = 0;    // parameters and buffers + the resident high-water mark's growth (at least allocator_peak)
  double step_seconds = 0.0;        // median, first step excluded
  std::int64_t batch = 0;
  memscale::Report report;
};

template <class Loss>
Run train(gpt::GPT& model, const torch::Tensor& tokens, Loss&& loss, const memscale::Config& config, int steps,
          std::int64_t budget_bytes, std::int64_t static_bytes) {
  Run r;
  r.batch = tokens.size(0);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-4));
  // The budget as a hard limit on LibTorch's allocator: a step past it throws.
  memscale::memory_tracker::hard_limit_scope hard(memscale::memory_tracker::current_bytes() + budget_bytes -
                                                  static_bytes);
  memscale::memory_tracker::process_peak_scope process;
  memscale::memory_tracker::peak_scope peak;
  std::vector<double> times;
  {
    auto guard = memscale::optimize(model, tokens, config);
    r.report = guard.report();
    for (int s = 0; s < steps; ++s) {
      const auto start = std::chrono::steady_clock::now();
      optimizer.zero_grad();
      loss(model->forward(tokens)).backward();
      optimizer.step();
      if (s > 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  r.allocator_peak = static_bytes + peak.peak_growth();
  // Resident pages a freed block left behind are reused without growing the
  // high-water mark, so the process figure is at least the allocator's (as autotune counts it).
  r.process_peak = std::max(r.allocator_peak, static_bytes + process.peak_growth());
  std::sort(times.begin(), times.end());
  r.step_seconds = times.empty() ? 0.0 : times[times.size() / 2];
  return r;
}

}  // namespace

int main(int argc, char** argv) try {
  const auto args = parse(argc, argv);
  memscale::memory_tracker::install();      // every CPU byte counted, and the hard limit the trials run under
  memscale::fix_malloc_mmap_threshold();    // freed tensors go back to the system: process figures that hold
  gpt::register_memscale_rule();
  torch::manual_seed(1);

  std::cout << "memscale " << memscale::version_major << '.' << memscale::version_minor << '.'
            << memscale::version_patch << " example: autotune the GPT under a budget, then train with the winner\n";
  std::cout << "CPU: " << host_info::cpu_model() << "; BLAS: " << host_info::blas_in_use() << "; torch threads "
            << torch::get_num_threads() << "\n";
  const auto& o = args.model;
  auto batches = args.batches;
  if (batches.empty()) batches.push_back(args.batch);
  const auto largest = *std::max_element(batches.begin(), batches.end());
  std::cout << "model: GPT, " << o.layers << " layers, d_model " << o.d_model << ", " << o.heads << " heads, context "
            << o.context << "; AdamW; batch " << args.batch << "\n";

  // One batch of the largest size; a trial at a smaller batch takes its first rows.
  const auto data = gpt::encode(gpt::training_text());
  std::mt19937_64 rng(7);
  const auto batch = gpt::sample_batch(data, std::max(largest, args.batch), o.context, rng);
  const auto loss = [&](const torch::Tensor& logits) {
    const auto rows = torch::arange(logits.size(0), torch::kLong) % batch.target.size(0);
    return gpt::loss(logits, batch.target.index_select(0, rows));
  };
  const auto example = batch.input.slice(0, 0, args.batch);

  gpt::GPT model(o);
  model->train();
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-4));
  std::int64_t static_bytes = 0;
  for (const auto& p : model->parameters()) static_bytes += static_cast<std::int64_t>(p.nbytes());
  for (const auto& b : model->buffers()) static_bytes += static_cast<std::int64_t>(b.nbytes());

  // A first step: oneDNN and BLAS make their buffers at first use.
  loss(model->forward(example)).backward();
  for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();

  memscale::Config config;
  config.enable_logging = false;
  double budget_gb = 0.0;
  if (args.budget_gb) {
    budget_gb = *args.budget_gb;
  } else {
    auto aggressive = config;
    aggressive.mode = memscale::OptimizationMode::Aggressive;
    aggressive.force_optimize = true;
    const auto p = memscale::predict(model, example, optimizer, loss, aggressive);
    budget_gb = 0.5 * static_cast<double>(p.baseline_peak_bytes + p.peak_bytes) / double(1 << 30);
    std::cout << "predicted step at batch " << args.batch << ": " << mib(p.baseline_peak_bytes) << " plain, "
              << mib(p.peak_bytes) << " with Aggressive's plan; budget: halfway between\n";
  }
  config.memory_budget_gb = budget_gb;
  const auto budget_bytes = static_cast<std::int64_t>(budget_gb * double(1 << 30));
  std::cout << "budget: " << mib(budget_bytes) << " (Config::memory_budget_gb = " << budget_gb << ")\n\n";

  memscale::TuneOptions options;
  options.batch_sizes = batches;
  options.time_budget_seconds = args.time_budget_s;
  options.cache_file = args.cache;
  options.use_cache = !args.no_cache;
  const auto tuned = memscale::autotune(model, example, optimizer, loss, config, options);
  std::cout << tuned << "\n\n";
  if (!tuned.found) {
    std::cerr << "tune_gpt: no configuration fits " << mib(budget_bytes) << "\n";
    return 1;
  }

  // Train with the default Config (Balanced, same budget) and with the winner.
  const auto tokens_of = [&](std::int64_t b) { return batch.input.slice(0, 0, b); };
  std::cout << "training " << args.steps << " steps with the default Config (Balanced) at batch " << args.batch
            << "...\n" << std::flush;
  std::optional<Run> balanced;
  try {
    balanced = train(model, tokens_of(args.batch), loss, config, args.steps, budget_bytes, static_bytes);
  } catch (const c10::Error& e) {
    std::cout << "  the default Config went over the budget: " << e.what_without_backtrace() << "\n";
  }
  std::cout << "training " << args.steps << " steps with the winner (" << tuned.winner()->label << ") at batch "
            << tuned.best_batch_size << "...\n" << std::flush;
  const auto winner = train(model, tokens_of(tuned.best_batch_size), loss, tuned.best, args.steps, budget_bytes,
                            static_bytes);

  const auto row = [&](const char* name, const Run& r) {
    std::cout << "  " << std::left << std::setw(44) << name << std::right << std::setw(7) << r.batch << std::setw(14)
              << mib(r.process_peak) << std::setw(14) << mib(r.allocator_peak) << std::setw(10) << std::fixed
              << std::setprecision(1) << 1e3 * r.step_seconds << std::setw(12)
              << static_cast<double>(r.batch) / r.step_seconds << "\n";
  };
  std::cout << "\n  " << std::left << std::setw(44) << "config" << std::right << std::setw(7) << "batch"
            << std::setw(14) << "process peak" << std::setw(14) << "tracker peak" << std::setw(10) << "step ms"
            << std::setw(12) << "samples/s" << "\n";
  if (balanced) row("default (Balanced)", *balanced);
  row(("winner: " + tuned.winner()->label).c_str(), winner);
  std::cout << "  budget " << mib(budget_bytes) << ": the winner's process peak is "
            << std::setprecision(1) << 100.0 * static_cast<double>(winner.process_peak) / static_cast<double>(budget_bytes)
            << "% of it";
  if (balanced)
    std::cout << "; speed vs the default: " << std::setprecision(2)
              << (static_cast<double>(winner.batch) / winner.step_seconds) /
                     (static_cast<double>(balanced->batch) / balanced->step_seconds)
              << "x";
  std::cout << "\n";
  if (winner.process_peak > budget_bytes) {
    std::cerr << "tune_gpt: ERROR: training with the winner held " << mib(winner.process_peak) << ", over the budget\n";
    return 1;
  }
  return 0;
} catch (const std::exception& e) {
  std::cerr << "tune_gpt: " << e.what() << "\n";
  return 1;
}

// memscale benchmark: measured memory and time of a training step, without
// memscale and with each OptimizationMode, for three workloads:
//   - the example GPT (a bit larger than the example's default),
//   - a ResNet-style CNN (residual blocks, BatchNorm, in-place ReLU), and
//   - a flat Sequential of primitive layers: (Linear(256,1024), GELU,
//     Linear(1024,256), LayerNorm(256), Dropout(0.1)) x 8 on input [32,128,256].
// Rows: baseline, Conservative (no budget), Balanced (memory_budget_gb = 60% of
// the measured baseline total peak), Aggressive, and on the GPT and the flat
// chain "hand ckpt/block": no memscale guard, memscale::checkpoint around each
// block, written into the forward as a user would by hand. Every row trains its own
// identically seeded model on the same batches with its own copy of the RNG
// stream, and the rows take turns, so load changes on the machine hit them
// alike and the losses must match the baseline's bit for bit. A turn is two
// steps, the second measured: it starts from the heap the row's own step left,
// as in a training loop, not from the previous row's. Per row:
// peak memory growth of a training step (memory_tracker::peak_scope around
// forward + backward + AdamW step; median over the measured steps after one
// warm-up and one calibration step, planning excluded), the first step
// including profiling + planning, the planner's
// projected peak next to the measured total peak, the number of checkpointed
// segments, the step time (median), and the optimal-DP yardstick: the recompute
// time of the rule engine's plan against the least recompute any one-level
// segmentation needs to reach the same projected peak (core::optimal_segmentation).
//
// A third workload shows the offload engine's disk tier on this CPU host: the
// flat Sequential with checkpointing only, offloading only (synchronous, and
// async with prefetch), and both; plus the engine's transfer statistics.
// A fourth tiles a stack of the example's MLP blocks (checkpointing alone vs
// checkpointing + tiling); a fifth trains a LayerNorm-free flat Sequential in
// bfloat16 autocast and with the 8-bit AdamW (memscale::make_optimizer), alone
// and combined. Rows that change the arithmetic (tiling, bf16, 8-bit) report
// their largest relative loss difference from the baseline instead of bit-exactness.
// Last, the optimizer on its own (benchmarks/bench_optim8bit.hpp).
//
// The GPT and a ResNet-style CNN keep their blocks in a ModuleList and call them
// through memscale::forward (call-site units); last, what memscale::forward
// costs over a direct call.
//
// The GPT, the CNN and the flat chain then run every row again, each alone in a
// fresh process (benchmarks/bench_process.hpp): what the process holds, projected
// vs measured, and step times with no other row in the process.
//
//   memscale_bench [--steps N] [--only gpt|cnn|flat|offload|tile|precision|optimizer|calls] [--csv]
//                  [--no-process-rows] [--default-malloc (the per-row processes keep glibc's mmap threshold)]
//   (--solo ROW --budget-gb X: internal, one row of the --only workload in this process)
#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <dlfcn.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <memscale/core/memory_model.hpp>
#include <memscale/core/optimal_chain.hpp>
#include <memscale/memscale.hpp>

#include "bench_calls.hpp"
#include "bench_optim8bit.hpp"
#include "gpt.hpp"
#include "host_info.hpp"
#include "resnet.hpp"

#include "bench_common.hpp"
#include "bench_print.hpp"
#include "bench_process.hpp"
#include "bench_runner.hpp"

namespace {

using namespace bench;

// --- workloads ----------------------------------------------------------------------

Workload bench_gpt(int steps) {
  const auto o = gpt::benchmark_options();
  const std::int64_t batch = 16;
  const auto text = gpt::encode(gpt::training_text());
  std::mt19937_64 rng(7);
  std::vector<Sample> data;
  for (int s = 0; s <= steps; ++s) {
    auto b = gpt::sample_batch(text, batch, o.context, rng);
    data.push_back({b.input, b.target});
  }
  std::ostringstream desc;
  desc << "GPT (examples/gpt.hpp): " << o.layers
       << " x TransformerBlock in a ModuleList, each called through memscale::forward, each calling its attention "
          "and MLP halves through it too (call-site units at two levels), d_model "
       << o.d_model
       << ", " << o.heads << " heads, context " << o.context << ", dropout " << o.dropout << "; batch " << batch
       << "; cross-entropy, AdamW lr " << learning_rate
       << "; hand ckpt/block: no guard, memscale::checkpoint around each block in the forward"
       << "; \"" << coarse_suffix.substr(2) << "\": the blocks call their halves directly (one level of units)";
  auto blocks_only = o;
  blocks_only.halves_as_units = false;
  return run_workload<gpt::GPT>(
      "GPT", desc.str(), [o] { return gpt::GPT(o); },
      [](gpt::GPT& m, const Sample& s) { return gpt::loss(m->forward(s.input), s.target); }, data, steps,
      mode_rows_and_variants, [](gpt::GPT& m, const Sample& s) {
        // GPT's forward with memscale::checkpoint around each block instead of memscale::forward.
        auto x = m->token(s.input) + m->position.slice(0, 0, s.input.size(1));
        for (const auto& block : *m->blocks) {
          auto impl = std::dynamic_pointer_cast<gpt::TransformerBlockImpl>(block);
          x = memscale::checkpoint(impl, x);
        }
        return gpt::loss(m->head(m->ln_f(x)), s.target);
      },
      [blocks_only] { return gpt::GPT(blocks_only); });
}

Workload bench_cnn(int steps) {
  static constexpr int blocks = 4;
  static constexpr std::int64_t channels = 64, batch = 16, side = 32;
  torch::manual_seed(95);
  std::vector<Sample> data;
  for (int s = 0; s <= steps; ++s)
    data.push_back({torch::randn({batch, 3, side, side}), torch::randint(10, {batch}, torch::kLong)});
  std::ostringstream desc;
  desc << "ResNet-style CNN (examples/resnet.hpp): stem conv + BatchNorm, " << blocks << " x BasicBlock (conv3x3, "
       << "BatchNorm, in-place ReLU, conv3x3, BatchNorm, residual add, in-place ReLU) in a ModuleList called "
          "through memscale::forward, "
       << channels << " channels, input [" << batch << ",3," << side << "," << side
       << "]; global average pool, Linear, cross-entropy, AdamW lr " << learning_rate;
  return run_workload<resnet::ResNet>(
      "ResNet-style CNN", desc.str(), [] { return resnet::ResNet(blocks, channels); },
      [](resnet::ResNet& m, const Sample& s) { return torch::cross_entropy_loss(m->forward(s.input), s.target); },
      data, steps);
}

/// The flat Sequential workload: (Linear(256,1024), GELU, Linear(1024,256),
/// LayerNorm(256), Dropout(0.1)) x 8 on data drawn from `data_seed`.
/// The flat Sequential's forward with memscale::checkpoint around each block of
/// `block` slots (what torch.utils.checkpoint_sequential with one segment per
/// block does).
torch::Tensor checkpoint_per_block(torch::nn::Sequential& seq, torch::Tensor x, std::size_t block) {
  for (std::size_t first = 0; first < seq->size(); first += block) {
    std::vector<torch::nn::AnyModule> slots(seq->begin() + static_cast<std::ptrdiff_t>(first),
                                            seq->begin() + static_cast<std::ptrdiff_t>(std::min(first + block, seq->size())));
    std::vector<torch::Tensor> params;
    for (const auto& slot : slots)
      for (const auto& p : slot.ptr()->parameters()) params.push_back(p);
    x = memscale::checkpoint(
        [slots](const torch::Tensor& in) mutable {
          auto y = in;
          for (auto& slot : slots) y = slot.forward(y);
          return y;
        },
        x, std::move(params));
  }
  return x;
}

Workload flat_workload(const std::string& title, const std::string& description, std::uint64_t data_seed,
                       int steps, const row_configs& rows_for, bool hand_placed = false) {
  static constexpr int repeats = 8;
  static constexpr std::int64_t width = 256, hidden = 1024;
  torch::manual_seed(data_seed);
  std::vector<Sample> data;
  for (int s = 0; s <= steps; ++s) data.push_back({torch::randn({32, 128, width}), torch::randn({32, 128, width})});
  auto make = [] {
    torch::nn::Sequential seq;
    for (int i = 0; i < repeats; ++i) {
      seq->push_back(torch::nn::Linear(width, hidden));
      seq->push_back(torch::nn::GELU());
      seq->push_back(torch::nn::Linear(hidden, width));
      seq->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
      seq->push_back(torch::nn::Dropout(0.1));
    }
    return seq;
  };
  return run_workload<torch::nn::Sequential>(
      title, description, make,
      [](torch::nn::Sequential& m, const Sample& s) { return torch::mse_loss(m->forward(s.input), s.target); }, data,
      steps, rows_for,
      hand_placed ? std::function<torch::Tensor(torch::nn::Sequential&, const Sample&)>(
                        [](torch::nn::Sequential& m, const Sample& s) {
                          return torch::mse_loss(checkpoint_per_block(m, s.input, 5), s.target);
                        })
                  : nullptr);
}

Workload bench_flat(int steps) {
  return flat_workload(
      "flat Sequential",
      "(Linear(256,1024), GELU, Linear(1024,256), LayerNorm(256), Dropout(0.1)) x 8 = 40 slots; input [32,128,256]; "
      "MSE loss, AdamW lr 3e-4; hand ckpt/block: memscale::checkpoint around each group of 5 slots",
      99, steps, mode_rows_and_variants, /*hand_placed=*/true);
}

Workload bench_offload(int steps) {
  std::error_code ec;
  const auto tmp = std::filesystem::temp_directory_path(ec);
  return flat_workload(
      "offload to the disk tier (CPU)",
      "the flat Sequential above, Aggressive, saved activations offloaded to the disk tier (files "
      "under " + (ec ? std::string("?") : tmp.string()) + "); rows: checkpointing only, offloading only "
      "(synchronous; async with prefetch), both",
      98, steps, offload_rows);
}

/// Aggressive with checkpointing only, and with tiling as well.
std::vector<std::pair<std::string, memscale::Config>> tile_rows(double) {
  auto cfg = quiet_config(memscale::OptimizationMode::Aggressive);
  cfg.enable_offloading = false;
  std::vector<std::pair<std::string, memscale::Config>> rows{{"checkpoint", cfg}};
  cfg.enable_tiling = true;
  rows.emplace_back("checkpoint+tile", cfg);
  return rows;
}

Workload bench_tile(int steps) {
  gpt::Options o;
  o.d_model = 256;
  o.dropout = 0.0;  // drawing dropout would keep the blocks untiled (tile_rules.hpp)
  static constexpr int blocks = 8;
  torch::manual_seed(97);
  std::vector<Sample> data;
  for (int s = 0; s <= steps; ++s) data.push_back({torch::randn({16, 256, o.d_model}), torch::randn({16, 256, o.d_model})});
  std::ostringstream desc;
  desc << "the example's MLP block (LayerNorm, Linear(256,1024), GELU, Linear(1024,256), residual) x " << blocks
       << " in a Sequential; input [16,256,256]; MSE loss, AdamW lr " << learning_rate
       << "; rows: Aggressive with checkpointing only, and with enable_tiling";
  return run_workload<torch::nn::Sequential>(
      "tiling", desc.str(),
      [o] {
        torch::nn::Sequential seq;
        for (int i = 0; i < blocks; ++i) seq->push_back(gpt::MLP(o));
        return seq;
      },
      [](torch::nn::Sequential& m, const Sample& s) { return torch::mse_loss(m->forward(s.input), s.target); }, data,
      steps, tile_rows);
}

/// bf16 autocast (memscale plans nothing under Conservative here: autocast alone),
/// the 8-bit AdamW, both, and both with Aggressive.
std::vector<std::pair<std::string, memscale::Config>> precision_rows(double) {
  auto cfg = quiet_config(memscale::OptimizationMode::Conservative);
  std::vector<std::pair<std::string, memscale::Config>> rows;
  auto bf16 = cfg;
  bf16.use_mixed_precision = true;
  rows.emplace_back("bf16 autocast", bf16);
  auto eight = cfg;
  eight.use_8bit_optimizer = true;
  rows.emplace_back("8-bit AdamW", eight);
  auto both = bf16;
  both.use_8bit_optimizer = true;
  rows.emplace_back("bf16+8-bit", both);
  both.mode = memscale::OptimizationMode::Aggressive;
  rows.emplace_back("Aggressive+bf16+8-bit", both);
  return rows;
}

Workload bench_precision(int steps) {
  static constexpr int repeats = 8;
  static constexpr std::int64_t width = 256, hidden = 1024;
  torch::manual_seed(96);
  std::vector<Sample> data;
  for (int s = 0; s <= steps; ++s) data.push_back({torch::randn({32, 128, width}), torch::randn({32, 128, width})});
  return run_workload<torch::nn::Sequential>(
      "bf16 autocast and the 8-bit optimizer",
      "(Linear(256,1024), GELU, Linear(1024,256), Dropout(0.1)) x 8 = 32 slots (no LayerNorm: LibTorch 1.13's CPU "
      "LayerNorm refuses bf16 input under autocast); input [32,128,256]; MSE loss (computed in float32), "
      "AdamW lr 3e-4 or memscale::optim::AdamW8bit with the same hyperparameters",
      [] {
        torch::nn::Sequential seq;
        for (int i = 0; i < repeats; ++i) {
          seq->push_back(torch::nn::Linear(width, hidden));
          seq->push_back(torch::nn::GELU());
          seq->push_back(torch::nn::Linear(hidden, width));
          seq->push_back(torch::nn::Dropout(0.1));
        }
        return seq;
      },
      [](torch::nn::Sequential& m, const Sample& s) {
        return torch::mse_loss(m->forward(s.input).to(torch::kFloat), s.target);
      },
      data, steps, precision_rows);
}

int parse_steps(std::string_view text) {
  int value = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc{} || ptr != text.data() + text.size() || value < 1)
    throw std::invalid_argument("--steps needs an integer >= 1, got '" + std::string(text) + "'");
  return value;
}

}  // namespace

int main(int argc, char** argv) {
  memscale::memory_tracker::install();
  gpt::register_memscale_rule();
  int steps = 5;
  bool csv = false;
  bool process_rows = true;
  std::string only;
  constexpr std::array<std::string_view, 8> parts{"gpt", "cnn", "flat", "offload", "tile", "precision", "optimizer",
                                                 "calls"};
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string_view arg = argv[i];
      if (arg == "--csv") csv = true;
      else if (arg == "--no-process-rows") process_rows = false;
      else if (arg == "--default-malloc") solo().default_malloc = true;
      else if (arg == "--solo" && i + 1 < argc) solo().row = argv[++i];
      else if (arg == "--budget-gb" && i + 1 < argc) solo().budget_gb = std::stod(argv[++i]);
      else if (arg == "--steps" && i + 1 < argc) steps = parse_steps(argv[++i]);
      else if (arg == "--only" && i + 1 < argc &&
               std::find(parts.begin(), parts.end(), std::string_view(argv[i + 1])) != parts.end())
        only = argv[++i];
      else if (arg == "-h" || arg == "--help") {
        std::cout << "usage: memscale_bench [--steps N (measured steps after 1 warm-up, default 5)] "
                     "[--only gpt|cnn|flat|offload|tile|precision|optimizer|calls] [--csv] [--no-process-rows] "
                     "[--default-malloc]\n";
        return 0;
      } else {
        std::cerr << "memscale_bench: unknown or incomplete argument '" << arg << "' (see --help)\n";
        return 2;
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "memscale_bench: " << e.what() << "\n";
    return 2;
  }

  if (!solo().row.empty()) {  // a child of print_process_rows: one row, alone
    if (only != "gpt" && only != "cnn" && only != "flat") {
      std::cerr << "memscale_bench: --solo needs --only gpt|cnn|flat\n";
      return 2;
    }
    if (!solo().default_malloc) memscale::fix_malloc_mmap_threshold();
    try {
      const auto w = only == "gpt" ? bench_gpt(steps) : only == "cnn" ? bench_cnn(steps) : bench_flat(steps);
      std::cout << solo_line(w.rows.front()) << "\n";
      return 0;
    } catch (const std::exception& e) {
      std::cerr << "memscale_bench: error: " << e.what() << "\n";
      return 1;
    }
  }

  const auto start = clock_type::now();
  std::cout << "memscale benchmark (memscale " << memscale::version_major << '.' << memscale::version_minor << '.'
            << memscale::version_patch << ")\n";
  std::cout << "date:     " << utc_now() << "\n";
  std::cout << "cpu:      " << host_info::cpu_model() << ", " << std::thread::hardware_concurrency() << " logical CPUs\n";
  const auto hw = memscale::detect_hardware();
  std::cout << "memory:   " << mib(static_cast<double>(hw.host_total_bytes)) << " RAM; gpus: "
            << (hw.gpus.empty() ? "none (CPU-only host)" : std::to_string(hw.gpus.size())) << "\n";
  std::cout << "threads:  torch intra-op " << torch::get_num_threads() << ", interop "
            << at::get_num_interop_threads() << "\n";
  std::cout << "blas:     " << host_info::blas_in_use() << "\n";
  if (const auto details = blas_details(); !details.empty()) std::cout << "          " << details << "\n";
  if (!hw.blas_warning.empty()) std::cout << "warning:  " << hw.blas_warning << "\n";
  std::cout << "malloc:   " << malloc_in_use() << "\n";
  std::cout << "libtorch: " << TORCH_VERSION << " (CPU)\n";
  std::cout << "load avg: " << load_average() << " (1/5/15 min, at start)\n";

  std::vector<Workload> all;
  try {
    if (only.empty() || only == "gpt") all.push_back(bench_gpt(steps));
    if (only.empty() || only == "cnn") all.push_back(bench_cnn(steps));
    if (only.empty() || only == "flat") all.push_back(bench_flat(steps));
    if (only.empty() || only == "offload") all.push_back(bench_offload(steps));
    if (only.empty() || only == "tile") all.push_back(bench_tile(steps));
    if (only.empty() || only == "precision") all.push_back(bench_precision(steps));
  } catch (const std::exception& e) {
    std::cerr << "memscale_bench: error: " << e.what() << "\n";
    return 1;
  }
  int status = 0;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const auto& w = all[i];
    print_workload(w, steps, std::cout);
    for (const auto& r : w.rows)
      if (!r.detached || (r.exact_expected ? !same_losses(r.losses, w.rows.front().losses)
                                           : !std::isfinite(loss_gap(r, w.rows.front()))))
        status = 1;
    // The first three workloads, in order: gpt, cnn, flat (whichever ran).
    const std::string part = !only.empty() ? only : i == 0 ? "gpt" : i == 1 ? "cnn" : i == 2 ? "flat" : "";
    if (process_rows && (part == "gpt" || part == "cnn" || part == "flat") &&
        !print_process_rows(w, part, steps, std::cout))
      status = 1;
  }
  if (csv) print_csv(all, std::cout);
  if (only.empty() || only == "optimizer") bench_optimizer(std::cout, steps, csv);
  if (only.empty() || only == "calls") bench_call_overhead(std::cout);
  std::cout << "\nload avg: " << load_average() << " (at end); total wall time "
            << std::fixed << std::setprecision(1)
            << std::chrono::duration<double>(clock_type::now() - start).count() << " s\n";
  return status;
}

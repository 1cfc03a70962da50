// memscale benchmark: the OOM predictor against measured steps, side by side.
//
// For each model and batch size, two fresh processes (this program re-executed):
//   predict: builds the model and its AdamW, runs memscale::predict (timed), then
//            once more in the same process ("2nd s": without the process's one-time
//            set-up, such as CUDA's context and kernels loaded at first use);
//   measure: builds the same model, trains 1 warm-up + 3 steps at that batch and
//            reads the process's max RSS growth (VmHWM over the 3 steps minus VmRSS
//            after the build; and, apart, over planning and the warm-up too) and
//            the allocator's step peak (counting allocator), and times the steps.
// Then prints predicted vs measured growth with the error, and the time to predict
// over the median step's time. Models: the example GPT (train_gpt's defaults),
// the benchmark harness's ResNet-style CNN and MLP chain, and models the
// predictor was not developed on (a wider, shallower GPT; a narrower, deeper CNN;
// an MLP of other widths with BatchNorm; on CPU, a batch-first GRU classifier over
// 10k and 100k tokens, whose small per-step tensors glibc's heap keeps, and a ViT
// around nn::MultiheadAttention). Each runs baseline (the default Config, which on
// a roomy host applies nothing) and, for the GPTs and the ViT, with the Aggressive plan.
// Not in the default list, a new user's trial (2026-12-02): LibTorch's own
// nn::TransformerEncoder (Aggressive too), a MobileNet-style net of depthwise
// convolutions, a convolutional autoencoder (ConvTranspose2d) and a bidirectional
// LSTM tagger: --models encoder,mobilenet,autoencoder,tagger.
//
//   memscale_bench_predict [--default-malloc] [--max-batch] [--device cuda] [--models gpt,resnet,...]
//
// MEMSCALE_BENCH_STEPS sets how many steps after the warm-up the CPU measure runs
// (3): glibc's heap can grow over several steps (the 100k GRU's at batch 64 for
// about six), which the prediction, of a steady step, includes.
//
// With --max-batch it checks max_batch_size instead, per model at its middle
// batch (max_batch_table below): under a budget of 1.3x the predicted total,
// the largest batch predict names, trained, and one batch more, against the budget.
//
// With --device cuda (a CUDA build on a GPU) the models, their inputs and AdamW live
// on the GPU, and what is compared is what the device holds: the prediction's total
// against the caching allocator's peak reserved bytes over the 3 steady steps plus
// the device memory in use outside it (the CUDA context, cuBLAS's and cuDNN's
// handles: cudaMemGetInfo's used bytes less the reserve, read after the steps),
// and the allocator's share against its peak allocated bytes. The batches are
// larger there, and the example GPT of the GPU benchmark (gpt-large: d_model 768,
// 12 layers, context 256) is added.
//
// By default both processes call memscale::fix_malloc_mmap_threshold() (see its
// comment); --default-malloc leaves glibc's dynamic threshold, to show what it does.
// With MEMSCALE_BENCH_SHOW set, each predicting process prints its whole Prediction
// (breakdown, method, notes) to stderr.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <memscale/memscale.hpp>
#if MEMSCALE_HAS_CUDA()
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "bench_predict_models.hpp"

namespace {

int child_predict(const Case& k) {
  const auto b = build(k.model, k.batch, k.device);
  torch::optim::AdamW opt(b.root->parameters(), torch::optim::AdamWOptions(3e-4));
  const auto p = b.predict(opt, config_for(k));
  if (std::getenv("MEMSCALE_BENCH_SHOW") != nullptr) std::cerr << p << "\n";
  // The same call again: what predict costs once the process has done its one-time set-up (CUDA's context,
  // cuBLAS's handles, kernels loaded at first use), which a first training step pays too.
  const auto again = b.predict(opt, config_for(k)).seconds;
  const auto& used = k.aggressive ? p.planned : p.baseline;
  const auto total = k.aggressive ? p.peak_bytes : p.baseline_peak_bytes;
  // CPU: the process's growth from once the model is built; CUDA: what the device holds.
  const auto weights = k.device.is_cpu() ? used.parameter_bytes + used.buffer_bytes : i64{0};
  std::cout << "RESULT growth=" << total - weights << " allocator=" << used.allocator_bytes() - weights
            << " outside=" << used.outside_allocator_bytes << " seconds=" << p.seconds << " again=" << again
            << " calib=" << p.fitted_batches.first << "," << p.fitted_batches.second
            << " weights=" << weights << " budget=" << p.budget_bytes
            << " max=" << (k.aggressive ? p.max_batch_size : p.baseline_max_batch_size) << "\n";
  return 0;
}

#if MEMSCALE_HAS_CUDA()
/// One steady step's peak on the GPU: the caching allocator's peak allocated and
/// reserved bytes over the 3 steps after a warm-up (the warm-up, and wrap's planning
/// before it, are the "first" figure), plus what the device holds outside the
/// caching allocator once they ran, less the batch's input.
int child_measure_cuda(const Case& k) {
  auto b = build(k.model, k.batch, k.device);
  torch::optim::AdamW opt(b.root->parameters(), torch::optim::AdamWOptions(3e-4));
  const auto index = k.device.has_index() ? k.device.index() : c10::DeviceIndex{0};
  namespace cca = c10::cuda::CUDACachingAllocator;
  cca::resetPeakStats(index);
  std::optional<memscale::OptimizationGuard> guard;
  if (k.aggressive) guard.emplace(b.optimize(config_for(k)));
  std::vector<double> times;
  i64 first = 0;
  for (int s = 0; s < 4; ++s) {
    torch::cuda::synchronize();
    if (s == 1) {
      first = static_cast<i64>(cca::getDeviceStats(index).reserved_bytes[0].peak);
      cca::resetPeakStats(index);
    }
    const auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    b.loss(b.forward(b.input)).backward();
    opt.step();
    torch::cuda::synchronize();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const auto stats = cca::getDeviceStats(index);
  const auto outside = memscale::detail::memory_outside_caching_allocator(k.device);
  // The batch's input is the data pipeline's, which predict() does not count; on
  // CUDA it counts what else is allocated on the device (here the targets, as the
  // program's other tensors).
  const auto data = static_cast<i64>(b.input.nbytes());
  const auto reserved_peak = static_cast<i64>(stats.reserved_bytes[0].peak) - data;
  times.erase(times.begin());
  std::sort(times.begin(), times.end());
  std::cout << "RESULT growth=" << reserved_peak + outside << " first=" << first - data + outside
            << " allocator=" << static_cast<i64>(stats.allocated_bytes[0].peak) - data << " outside=" << outside
            << " reserve=" << static_cast<i64>(stats.reserved_bytes[0].peak - stats.allocated_bytes[0].peak)
            << " step=" << times[times.size() / 2] << "\n";
  return 0;
}
#endif

int child_measure(const Case& k) {
  if (k.device.is_cuda()) {
#if MEMSCALE_HAS_CUDA()
    return child_measure_cuda(k);
#else
    throw std::runtime_error("--device cuda needs a CUDA build of LibTorch");
#endif
  }
  memscale::memory_tracker::install();
  auto b = build(k.model, k.batch, k.device);
  torch::optim::AdamW opt(b.root->parameters(), torch::optim::AdamWOptions(3e-4));
  // predict() is about the steady step: the process's growth over the 3 steps
  // after the warm-up, from what it held once the model was built. Planning (wrap's
  // profiling, which runs the units un-optimized) and the warm-up are measured
  // too, on their own ("first"): a plan whose steps hold less than its planning
  // did (the GPT's Aggressive plan from batch 16 on) peaks there.
  const auto built_live = memscale::memory_tracker::current_bytes();
  const auto built = memscale::detail::read_process_memory();
  memscale::memory_tracker::process_peak_scope process;
  std::optional<memscale::OptimizationGuard> guard;
  if (k.aggressive) guard.emplace(b.optimize(config_for(k)));
  std::vector<double> times;
  i64 allocator_peak = 0;
  std::optional<memscale::memory_tracker::process_peak_scope> steady;
  const char* steps = std::getenv("MEMSCALE_BENCH_STEPS");  // steady steps measured (3)
  const int n = steps != nullptr ? std::max(1, std::atoi(steps)) : 3;
  for (int s = 0; s < n + 1; ++s) {
    if (s == 1) steady.emplace();
    memscale::memory_tracker::peak_scope scope;
    const auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    b.loss(b.forward(b.input)).backward();
    opt.step();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    allocator_peak = std::max(allocator_peak, scope.peak() - built_live);
  }
  const auto growth = built && steady->active() ? steady->peak() - built->resident_bytes : i64{-1};
  const auto first = process.peak_growth();
  times.erase(times.begin());  // the warm-up
  std::sort(times.begin(), times.end());
  std::cout << "RESULT growth=" << growth << " first=" << first << " allocator=" << allocator_peak
            << " step=" << times[times.size() / 2] << "\n";
  return 0;
}

std::map<std::string, std::string> run_child(const std::string& self, const std::string& role, const Case& k,
                                             bool default_malloc) {
  std::ostringstream cmd;
  cmd << "'" << self << "' " << role << " " << k.model << " " << k.batch << " " << (k.aggressive ? 1 : 0) << " "
      << (default_malloc ? 1 : 0) << " " << k.device.str() << " " << k.budget;
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(cmd.str().c_str(), "r"), pclose);
  if (!pipe) throw std::runtime_error("cannot run " + cmd.str());
  std::map<std::string, std::string> out;
  char buf[4096];
  while (fgets(buf, sizeof buf, pipe.get()) != nullptr) {
    std::string line(buf);
    if (line.rfind("RESULT ", 0) != 0) continue;
    std::istringstream words(line.substr(7));
    for (std::string kv; words >> kv;) {
      const auto eq = kv.find('=');
      if (eq != std::string::npos) out[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
  }
  if (out.empty()) throw std::runtime_error("no result from " + cmd.str());
  return out;
}

/// --max-batch: does predict's largest batch fit its budget when trained, and one
/// batch more not? Per case (a model at its example batch, with or without the
/// Aggressive plan), in fresh processes: predict without a budget; a budget of
/// 1.3x that total (whole MiB); predict under it for the largest batch M; predict
/// at M; train at M and at M + 1 (the measure role, the plan made under the same
/// budget). The totals compared with the budget are the process's growth plus the
/// weights on CPU (Prediction::peak_bytes' terms), the device's total on CUDA.
int max_batch_table(const std::vector<Case>& cases, const std::string& self, bool default_malloc) {
  std::cout << "predict's largest batch under a budget, trained (each figure from a fresh process; budget = 1.3x "
               "the total predicted at the example batch; M = max_batch_size, or baseline_max_batch_size without "
               "the plan; under/over: the measured total against the budget)\n"
            << std::left << std::setw(18) << "model" << std::setw(12) << "plan" << std::right << std::setw(7)
            << "batch" << std::setw(13) << "budget" << std::setw(7) << "M" << std::setw(13) << "pred at M"
            << std::setw(13) << "meas at M" << std::setw(13) << "meas at M+1" << "   verdict\n";
  int failed = 0;
  for (const auto& example : cases) {
    const auto row = [&]() -> std::ostream& {
      return std::cout << std::left << std::setw(18) << example.model << std::setw(12)
                       << (example.aggressive ? "Aggressive" : "none") << std::right << std::setw(7)
                       << example.batch;
    };
    try {
      const auto total = [](const std::map<std::string, std::string>& r, double weights) {
        return std::stod(r.at("growth")) + weights;
      };
      const auto free_run = run_child(self, "predict", example, default_malloc);
      Case k = example;
      k.budget = static_cast<i64>(std::ceil(1.3 * total(free_run, std::stod(free_run.at("weights"))) / MiB)) *
                 static_cast<i64>(MiB);
      const auto under = run_child(self, "predict", k, default_malloc);
      const double weights = std::stod(under.at("weights")), budget = std::stod(under.at("budget"));
      const i64 m = std::stoll(under.at("max"));
      if (m < 1) {
        row() << std::fixed << std::setprecision(1) << std::setw(9) << budget / MiB << " MiB"
              << "   fits no batch\n";
        continue;
      }
      k.batch = m;
      const double predicted = total(run_child(self, "predict", k, default_malloc), weights);
      const double at_m = total(run_child(self, "measure", k, default_malloc), weights);
      k.batch = m + 1;
      const double at_next = total(run_child(self, "measure", k, default_malloc), weights);
      // A gap in rows, by the predicted bytes per row between the example batch and M.
      const double per_row =
          m != example.batch ? (predicted - total(under, weights)) / static_cast<double>(m - example.batch) : 0.0;
      const auto rows = [per_row](double bytes) {
        std::ostringstream b;
        if (per_row > 0) b << ", about " << std::llround(bytes / per_row) << " row(s) at the predicted " << std::fixed
                           << std::setprecision(1) << per_row / 1024.0 << " KiB a row";
        return b.str();
      };
      std::ostringstream verdict;
      verdict << std::fixed << std::setprecision(1);
      if (at_m <= budget && at_next > budget)
        verdict << "M fits (" << (budget - at_m) / MiB << " MiB under), M+1 does not";
      else if (at_m <= budget)
        verdict << "M+1 fits too: " << (budget - at_m) / MiB << " MiB left at M" << rows(budget - at_m);
      else
        verdict << "M does not fit: " << (at_m - budget) / MiB << " MiB over" << rows(at_m - budget);
      row() << std::fixed << std::setprecision(1) << std::setw(9) << budget / MiB << " MiB" << std::setw(7) << m
            << std::setw(9) << predicted / MiB << " MiB" << std::setw(9) << at_m / MiB << " MiB" << std::setw(9)
            << at_next / MiB << " MiB   " << verdict.str() << std::endl;
    } catch (const std::exception& e) {  // the row says so; the others still run
      ++failed;
      row() << "  failed: " << e.what() << "\n";
    }
  }
  return failed > 0 ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc == 8 && (std::string(argv[1]) == "predict" || std::string(argv[1]) == "measure")) {
      if (std::string(argv[5]) != "1") memscale::fix_malloc_mmap_threshold();
      const Case k{argv[2], std::stoll(argv[3]), std::string(argv[4]) == "1", torch::Device(argv[6]),
                   std::stoll(argv[7])};
      return std::string(argv[1]) == "predict" ? child_predict(k) : child_measure(k);
    }
    bool default_malloc = false, max_batch = false;
    torch::Device device = torch::kCPU;
    std::vector<std::string> models;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--default-malloc") default_malloc = true;
      else if (a == "--max-batch") max_batch = true;
      else if (a == "--device" && i + 1 < argc && (std::string(argv[i + 1]) == "cpu" ||
                                                   std::string(argv[i + 1]) == "cuda"))
        device = torch::Device(argv[++i]);
      else if (a == "--models" && i + 1 < argc) {
        models.clear();
        std::stringstream list(argv[++i]);
        for (std::string m; std::getline(list, m, ',');) models.push_back(m);
      } else {
        std::cerr << "usage: " << argv[0] << " [--default-malloc] [--max-batch] [--device cpu|cuda] "
                  << "[--models gpt,resnet,mlp,gpt-wide,cnn-deep,mlp-bn,resnet-bottleneck,gpt-large,gru,gru-big,vit,"
                  << "encoder,mobilenet,autoencoder,tagger]\n";
        return 2;
      }
    }
    const bool cuda = device.is_cuda();
    if (cuda && !torch::cuda::is_available()) throw std::runtime_error("--device cuda: no GPU is visible");
    if (models.empty()) {
      models = {"gpt", "resnet", "mlp", "gpt-wide", "cnn-deep", "mlp-bn", "resnet-bottleneck"};
      if (cuda) models.push_back("gpt-large");
      else models.insert(models.end(), {"gru", "gru-big", "vit"});
    }
    // On the GPU the same models at batches 4x larger (at the CPU's a 0.5 GiB
    // context would be most of every figure), and the GPU benchmark's GPT.
    const std::map<std::string, std::vector<i64>> batches =
        cuda ? std::map<std::string, std::vector<i64>>{{"gpt", {32, 64, 128}},       {"resnet", {64, 128, 256}},
                                                       {"mlp", {4096, 16384, 65536}}, {"gpt-wide", {32, 64, 128}},
                                                       {"cnn-deep", {64, 128, 256}},  {"mlp-bn", {8192, 32768, 131072}},
                                                       {"resnet-bottleneck", {64, 128, 256}},
                                                       {"gpt-large", {8, 16, 32}},
                                                       {"gru", {128, 512, 2048}},     {"gru-big", {128, 512, 2048}},
                                                       {"vit", {64, 128, 256}},       {"encoder", {64, 128, 256}},
                                                       {"mobilenet", {64, 128, 256}}, {"autoencoder", {64, 128, 256}},
                                                       {"tagger", {32, 64, 128}}}
             : std::map<std::string, std::vector<i64>>{{"gpt", {8, 16, 32}},      {"resnet", {16, 32, 64}},
                                                       {"mlp", {256, 1024, 4096}}, {"gpt-wide", {8, 16, 32}},
                                                       {"cnn-deep", {16, 32, 64}}, {"mlp-bn", {512, 2048, 8192}},
                                                       {"resnet-bottleneck", {16, 32, 64}}, {"gpt-large", {2, 4, 8}},
                                                       {"gru", {32, 64, 128}},    {"gru-big", {32, 64, 128}},
                                                       {"vit", {16, 32, 64}}, {"encoder", {16, 32, 64}},
                                                       {"mobilenet", {16, 32, 64}}, {"autoencoder", {16, 32, 64}},
                                                       {"tagger", {8, 16, 32}}};
    std::vector<Case> cases;
    for (const auto& m : models) {
      if (!batches.contains(m)) throw std::invalid_argument("unknown model " + m);
      const auto& list = batches.at(m);
      // --max-batch: one case per model and plan, at its middle batch.
      const auto at = max_batch ? std::vector<i64>{list[list.size() / 2]} : list;
      for (auto b : at) cases.push_back({m, b, false, device});
      if (m == "gpt" || m == "gpt-large" || m == "vit" || m == "encoder")
        for (auto b : at) cases.push_back({m, b, true, device});
    }
    const std::string self = "/proc/" + std::to_string(getpid()) + "/exe";
    if (max_batch) return max_batch_table(cases, self, default_malloc);
    const auto kind = memscale::process_malloc();
    const std::string malloc_used = kind != memscale::malloc_kind::glibc ? memscale::to_string(kind)
                                    : default_malloc                     ? "glibc's default malloc"
                                                                         : "fix_malloc_mmap_threshold()";
    if (cuda)
      std::cout << "memscale::predict vs measured on " << device.str()
                << " (AdamW; each figure from a fresh process; measured = the caching allocator's peak reserved bytes "
                   "over the 3 steps after a warm-up plus the device memory in use outside it (context), less the "
                   "batch's input; alloc = its peak allocated bytes, less the same; out = the reserve "
                   "above the allocations at their peaks plus the context; 1st+plan: the total over planning and the "
                   "warm-up)\n";
    else
      std::cout << "memscale::predict vs measured (" << malloc_used
                << "; AdamW; each figure from a fresh process; growth = the process's max RSS over the 3 steps "
                   "after a warm-up, less its RSS once the model is built; 1st+plan: the same over planning and the "
                   "warm-up)\n";
    std::cout << std::left << std::setw(10) << "model" << std::setw(12) << "plan" << std::right << std::setw(7)
              << "batch" << std::setw(13) << "predicted" << std::setw(12) << "measured" << std::setw(9) << "error"
              << std::setw(13) << "alloc pred" << std::setw(12) << "alloc meas" << std::setw(9) << "error"
              << std::setw(11) << "predict s" << std::setw(9) << "2nd s" << std::setw(9) << "step s"
              << std::setw(10) << "pred/step"
              << std::setw(12) << "calib" << std::setw(13) << "1st+plan"
              << (cuda ? "     out pred   out meas" : "") << "\n";
    double worst = 0.0;
    int failed = 0;
    for (const auto& k : cases) {
      std::map<std::string, std::string> p, m;
      try {
        p = run_child(self, "predict", k, default_malloc);
        m = run_child(self, "measure", k, default_malloc);
      } catch (const std::exception& e) {  // the row says so; the others still run
        ++failed;
        std::cout << std::left << std::setw(10) << k.model << std::setw(12) << (k.aggressive ? "Aggressive" : "none")
                  << std::right << std::setw(7) << k.batch << "  failed: " << e.what() << "\n";
        continue;
      }
      const double pg = std::stod(p.at("growth")), mg = std::stod(m.at("growth"));
      const double pa = std::stod(p.at("allocator")), ma = std::stod(m.at("allocator"));
      const double err = 100.0 * (pg - mg) / mg, aerr = 100.0 * (pa - ma) / ma;
      worst = std::max(worst, std::abs(err));
      const double ps = std::stod(p.at("seconds")), ss = std::stod(m.at("step"));
      std::cout << std::left << std::setw(10) << k.model << std::setw(12) << (k.aggressive ? "Aggressive" : "none")
                << std::right << std::setw(7) << k.batch << std::fixed << std::setprecision(1) << std::setw(9)
                << pg / MiB << " MiB" << std::setw(8) << mg / MiB << " MiB" << std::showpos << std::setw(8) << err
                << "%" << std::noshowpos << std::setw(9) << pa / MiB << " MiB" << std::setw(8) << ma / MiB << " MiB"
                << std::showpos << std::setw(8) << aerr << "%" << std::noshowpos << std::setprecision(3)
                << std::setw(11) << ps << std::setw(9) << std::stod(p.at("again")) << std::setw(9) << ss
                << std::setprecision(2) << std::setw(10) << ps / ss
                << std::setw(12) << p.at("calib") << std::setprecision(1) << std::setw(9)
                << std::stod(m.at("first")) / MiB << " MiB";
      if (cuda)
        std::cout << std::setw(9) << std::stod(p.at("outside")) / MiB << " MiB" << std::setw(7)
                  << (std::stod(m.at("outside")) + std::stod(m.at("reserve"))) / MiB << " MiB";
      std::cout << std::endl;
    }
    std::cout << std::fixed << std::setprecision(1) << "largest |error| of the "
              << (cuda ? "device total" : "process growth") << ": " << worst << "%"
              << (failed > 0 ? " (" + std::to_string(failed) + " rows failed)" : "") << "\n";
    return failed > 0 ? 1 : 0;
  } catch (const std::exception& e) {
    std::cerr << "bench_predict: " << e.what() << "\n";
    return 1;
  }
}

// Feasibility study for a memscale OOM predictor: can one steady-state CPU
// training step's peak memory (forward, loss, backward, AdamW step) at the full
// batch be predicted within 5% by running the step at a few small batch sizes and
// extrapolating linearly in the batch size? Both for LibTorch's allocator (live
// bytes, memscale::memory_tracker's counting allocator) and for the process
// (VmHWM after a reset through /proc/self/clear_refs).
//
// Build (one TU):
//   g++ -std=c++20 -O2 -DNDEBUG -D_GLIBCXX_USE_CXX11_ABI=1
//       -I../../include -I../../examples -isystem /usr/include/torch/csrc/api/include
//       predict_extrapolation.cpp -o study -Wl,--no-as-needed -ltorch -ltorch_cpu -lc10
//
// Run:
//   ./study                       driver: every (model, batch, variant, rep) in a fresh
//                                 re-exec'd child, then tables and extrapolations
//   ./study --models gpt,resnet --variants omp1,omp2 --reps 2
//   ./study child MODEL BATCH     one child: prints one "RESULT k=v ..." line
//   ./study analyze RAW...        reprint the tables from raw RESULT lines (raw.txt)
//   ./study inproc MODEL B1,B2,.. one process, one model, batches in the given order
//                                 (shows how earlier larger steps pollute RSS growth)
//
// Variants (environment of the child): omp1: OMP_NUM_THREADS=1; omp2: OMP_NUM_THREADS=2;
// arena1: OMP_NUM_THREADS=2 MALLOC_ARENA_MAX=1; mmap0: OMP_NUM_THREADS=2 and
// MALLOC_MMAP_THRESHOLD_=131072 (fixes glibc's mmap threshold: large blocks are
// always mmapped and given back at free, so RSS follows live bytes more closely);
// mmap32k: the same with a 32 KiB threshold; omp1mmap0, arena1mmap0: combinations.
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <memscale/device/memory_tracker.hpp>
#include <memscale/memscale.hpp>

#include "gpt.hpp"
#include "resnet.hpp"

namespace {

using i64 = std::int64_t;
constexpr double kMiB = 1024.0 * 1024.0;
constexpr double learning_rate = 3e-4;  // train_gpt's and bench_memscale's

// ---------------------------------------------------------------- /proc helpers

struct ProcMem {
  i64 rss = 0;  // bytes
  i64 hwm = 0;  // bytes
};

ProcMem proc_mem() {
  std::ifstream in("/proc/self/status");
  std::string line;
  ProcMem m;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) m.rss = std::stoll(line.substr(6)) * 1024;
    if (line.rfind("VmHWM:", 0) == 0) m.hwm = std::stoll(line.substr(6)) * 1024;
  }
  return m;
}

/// Resets VmHWM to the current RSS ("5" > /proc/self/clear_refs, Linux >= 4.0).
bool reset_hwm() {
  FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (f == nullptr) return false;
  const bool ok = std::fputs("5", f) >= 0;
  return std::fclose(f) == 0 && ok;
}

// ---------------------------------------------------------------- workloads

struct Workload {
  std::shared_ptr<torch::nn::Module> module;  // for parameters()
  std::function<torch::Tensor()> loss;        // forward + loss on the fixed batch
  i64 input_bytes = 0;
};

Workload make_workload(const std::string& model, i64 batch) {
  torch::manual_seed(0);
  Workload w;
  if (model == "gpt") {
    // train_gpt's defaults: context 128, d_model 128, 4 heads, 4 layers, dropout 0.1
    // (gpt::Options), vocab 256; batch 16 by default; cross-entropy; AdamW lr 3e-4.
    gpt::Options o;
    o.context = 128;
    o.d_model = 128;
    o.heads = 4;
    o.layers = 4;
    gpt::GPT net(o);
    net->train();
    const auto text = gpt::encode(gpt::training_text());
    std::mt19937_64 rng(7);
    auto b = gpt::sample_batch(text, batch, o.context, rng);
    w.module = net.ptr();
    w.input_bytes = (b.input.numel() + b.target.numel()) * 8;
    w.loss = [net, b]() mutable { return gpt::loss(net->forward(b.input), b.target); };
  } else if (model == "mlp") {
    // (Linear 64->256, GELU, Linear 256->64, LayerNorm 64) x 8; rows of width 64; MSE.
    torch::nn::Sequential seq;
    for (int i = 0; i < 8; ++i) {
      seq->push_back(torch::nn::Linear(64, 256));
      seq->push_back(torch::nn::GELU());
      seq->push_back(torch::nn::Linear(256, 64));
      seq->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({64})));
    }
    seq->train();
    auto x = torch::randn({batch, 64});
    auto y = torch::randn({batch, 64});
    w.module = seq.ptr();
    w.input_bytes = (x.numel() + y.numel()) * 4;
    w.loss = [seq, x, y]() mutable { return torch::mse_loss(seq->forward(x), y); };
  } else if (model == "resnet") {
    // benchmarks/bench_memscale.cpp's bench_cnn: ResNet(4 blocks, 64 channels),
    // input [B,3,32,32], 10 classes, cross-entropy, AdamW lr 3e-4 (batch 16 there).
    resnet::ResNet net(4, 64);
    net->train();
    auto x = torch::randn({batch, 3, 32, 32});
    auto y = torch::randint(10, {batch}, torch::kLong);
    w.module = net.ptr();
    w.input_bytes = x.numel() * 4 + y.numel() * 8;
    w.loss = [net, x, y]() mutable { return torch::cross_entropy_loss(net->forward(x), y); };
  } else {
    throw std::invalid_argument("unknown model " + model);
  }
  return w;
}

// ---------------------------------------------------------------- one measured step

struct Phases {
  i64 forward = 0, backward = 0, optimizer = 0;  // allocator peak of each phase, bytes over the step's baseline
};

struct StepFigures {
  i64 alloc_before = 0;       // live bytes when the step begins
  i64 alloc_growth = 0;       // allocator peak - live before
  i64 rss_before = 0;         // VmRSS after the VmHWM reset
  i64 hwm_reset_error = 0;    // VmHWM - VmRSS right after the reset (should be ~0)
  i64 hwm_after = 0;          // VmHWM after the step
  i64 rss_after = 0;          // VmRSS after the step
  i64 heap_free_before = 0;   // glibc free bytes retained in its arenas (mallinfo2.fordblks)
  i64 heap_mmapped_before = 0;
  Phases phases;
  i64 rss_growth() const { return hwm_after - rss_before; }
};

float train_step(Workload& w, torch::optim::Optimizer& opt, Phases* phases = nullptr, i64 base = 0) {
  using scope = memscale::memory_tracker::peak_scope;
  opt.zero_grad();  // LibTorch 1.13: zeroes the gradients in place (they persist)
  torch::Tensor loss;
  {
    scope s;
    loss = w.loss();
    if (phases) phases->forward = s.peak() - base;
  }
  {
    scope s;
    loss.backward();
    if (phases) phases->backward = s.peak() - base;
  }
  {
    scope s;
    opt.step();
    if (phases) phases->optimizer = s.peak() - base;
  }
  return loss.item<float>();
}

StepFigures measured_step(Workload& w, torch::optim::Optimizer& opt, bool trim_first) {
  StepFigures f;
  if (trim_first) malloc_trim(0);
  const auto mi = mallinfo2();
  f.heap_free_before = static_cast<i64>(mi.fordblks);
  f.heap_mmapped_before = static_cast<i64>(mi.hblkhd);
  if (!reset_hwm()) throw std::runtime_error("cannot write /proc/self/clear_refs");
  const auto before = proc_mem();
  f.rss_before = before.rss;
  f.hwm_reset_error = before.hwm - before.rss;
  {
    memscale::memory_tracker::peak_scope scope;
    f.alloc_before = scope.baseline();
    train_step(w, opt, &f.phases, f.alloc_before);
    f.alloc_growth = scope.peak_growth();
  }
  const auto after = proc_mem();
  f.hwm_after = after.hwm;
  f.rss_after = after.rss;
  return f;
}

void emit(std::ostream& os, const std::string& key, i64 v) { os << ' ' << key << '=' << v; }

int run_child(const std::string& model, i64 batch, int warmup) {
  memscale::memory_tracker::install();  // before any tensor exists
  const auto init = proc_mem();
  const i64 alloc_init = memscale::memory_tracker::current_bytes();
  auto w = make_workload(model, batch);
  torch::optim::AdamW opt(w.module->parameters(), torch::optim::AdamWOptions(learning_rate));
  i64 param_bytes = 0;
  for (const auto& p : w.module->parameters()) param_bytes += p.numel() * static_cast<i64>(p.element_size());
  const auto built = proc_mem();
  const i64 alloc_built = memscale::memory_tracker::current_bytes();

  std::ostringstream os;
  os << "RESULT model=" << model << " batch=" << batch;
  emit(os, "threads", at::get_num_threads());
  emit(os, "mkldnn", at::hasMKLDNN() && at::globalContext().userEnabledMkldnn() ? 1 : 0);
  emit(os, "param_bytes", param_bytes);
  emit(os, "input_bytes", w.input_bytes);
  emit(os, "rss_init", init.rss);
  emit(os, "rss_built", built.rss);
  emit(os, "alloc_init", alloc_init);
  emit(os, "alloc_built", alloc_built);
  // warm-up steps: step 1 creates the gradients and AdamW's state
  for (int s = 0; s < warmup; ++s) {
    const auto f = measured_step(w, opt, false);
    const std::string k = "w" + std::to_string(s + 1) + "_";
    emit(os, k + "alloc_growth", f.alloc_growth);
    emit(os, k + "rss_growth", f.rss_growth());
    emit(os, k + "hwm", f.hwm_after);
  }
  // steady state: a plain step (VmRSS before includes what glibc kept from the
  // warm-up steps), then a step after malloc_trim(0)
  const auto plain = measured_step(w, opt, false);
  const auto trimmed = measured_step(w, opt, true);
  const auto plain2 = measured_step(w, opt, false);  // again, after the trimmed one
  for (const auto& [k, f] : {std::pair<std::string, const StepFigures&>{"s_", plain}, {"t_", trimmed}, {"u_", plain2}}) {
    emit(os, k + "alloc_before", f.alloc_before);
    emit(os, k + "alloc_growth", f.alloc_growth);
    emit(os, k + "rss_before", f.rss_before);
    emit(os, k + "rss_growth", f.rss_growth());
    emit(os, k + "hwm", f.hwm_after);
    emit(os, k + "rss_after", f.rss_after);
    emit(os, k + "hwm_reset_err", f.hwm_reset_error);
    emit(os, k + "heap_free_before", f.heap_free_before);
    emit(os, k + "heap_mmapped_before", f.heap_mmapped_before);
    emit(os, k + "phase_fwd", f.phases.forward);
    emit(os, k + "phase_bwd", f.phases.backward);
    emit(os, k + "phase_opt", f.phases.optimizer);
  }
  std::cout << os.str() << "\n";
  return 0;
}

int run_inproc(const std::string& model, const std::vector<i64>& batches, int warmup) {
  memscale::memory_tracker::install();
  const auto init = proc_mem();
  std::cout << "in-process: " << model << ", batches in this order, one model and optimizer per batch, "
            << warmup << " warm-up steps each, threads " << at::get_num_threads() << "\n";
  std::cout << std::setw(6) << "batch" << std::setw(14) << "alloc growth" << std::setw(16) << "RSS growth"
            << std::setw(18) << "RSS growth trim" << std::setw(16) << "VmHWM-init" << std::setw(16)
            << "heap free" << "   (MiB)\n";
  for (auto b : batches) {
    auto w = make_workload(model, b);
    torch::optim::AdamW opt(w.module->parameters(), torch::optim::AdamWOptions(learning_rate));
    for (int s = 0; s < warmup; ++s) measured_step(w, opt, false);
    const auto p = measured_step(w, opt, false);
    const auto t = measured_step(w, opt, true);
    std::cout << std::fixed << std::setprecision(2) << std::setw(6) << b << std::setw(14) << p.alloc_growth / kMiB
              << std::setw(16) << p.rss_growth() / kMiB << std::setw(18) << t.rss_growth() / kMiB << std::setw(16)
              << (p.hwm_after - init.rss) / kMiB << std::setw(16) << p.heap_free_before / kMiB << "\n";
  }
  return 0;
}

// ---------------------------------------------------------------- driver

using Row = std::map<std::string, double>;

Row parse_result(const std::string& line, std::string* model = nullptr) {
  Row r;
  std::istringstream in(line.substr(std::string("RESULT").size()));
  std::string kv;
  while (in >> kv) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos) continue;
    const auto key = kv.substr(0, eq), value = kv.substr(eq + 1);
    if (key == "model") {
      if (model) *model = value;
      continue;
    }
    if (key == "variant") continue;
    r[key] = std::stod(value);
  }
  return r;
}

std::string self_path() {
  char buf[4096];
  const auto n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw std::runtime_error("readlink /proc/self/exe");
  buf[n] = 0;
  return buf;
}

std::string variant_env(const std::string& v) {
  if (v == "omp1") return "OMP_NUM_THREADS=1";
  if (v == "omp2") return "OMP_NUM_THREADS=2";
  if (v == "arena1") return "OMP_NUM_THREADS=2 MALLOC_ARENA_MAX=1";
  if (v == "mmap0") return "OMP_NUM_THREADS=2 MALLOC_MMAP_THRESHOLD_=131072";
  if (v == "mmap32k") return "OMP_NUM_THREADS=2 MALLOC_MMAP_THRESHOLD_=32768";
  if (v == "omp1mmap0") return "OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=131072";
  if (v == "arena1mmap0") return "OMP_NUM_THREADS=2 MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=131072";
  throw std::invalid_argument("unknown variant " + v);
}

std::string run_one(const std::string& exe, const std::string& env, const std::string& model, i64 batch,
                    int warmup) {
  const std::string cmd = "env " + env + " '" + exe + "' child " + model + " " + std::to_string(batch) +
                          " --warmup " + std::to_string(warmup);
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) throw std::runtime_error("popen failed");
  std::string out;
  char buf[8192];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  const int rc = pclose(p);
  const auto pos = out.find("RESULT");
  if (rc != 0 || pos == std::string::npos) throw std::runtime_error("child failed: " + cmd + "\n" + out);
  return out.substr(pos, out.find('\n', pos) - pos);
}

std::vector<i64> parse_list(const std::string& s) {
  std::vector<i64> v;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) v.push_back(std::stoll(item));
  return v;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) v.push_back(item);
  return v;
}

/// Least-squares line through (x, y); returns the prediction at `at`.
double linear_predict(const std::vector<double>& x, const std::vector<double>& y, double at) {
  const double n = static_cast<double>(x.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (std::size_t i = 0; i < x.size(); ++i) sx += x[i], sy += y[i], sxx += x[i] * x[i], sxy += x[i] * y[i];
  const double slope = (n * sxy - sx * sy) / (n * sxx - sx * sx);
  return (sy - slope * sx) / n + slope * at;
}

struct Measure {
  std::string name, help;
  std::function<double(const Row&)> get;
  bool extrapolate = true;
};

std::string fmt(double v, int prec = 2) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(prec) << v;
  return os.str();
}

double whole_run_hwm(const Row& r) {
  double h = 0;
  for (const auto* k : {"w1_hwm", "w2_hwm", "w3_hwm", "s_hwm", "t_hwm", "u_hwm"})
    if (r.count(k)) h = std::max(h, r.at(k));
  return h;
}

const std::map<std::string, i64> full_batch = {{"gpt", 16}, {"mlp", 32}, {"resnet", 16}};

void print_tables(const std::string& model, const std::string& variant, const std::map<i64, std::vector<Row>>& rows) {
  std::vector<i64> ladder;
  for (const auto& [b, _] : rows) ladder.push_back(b);
  const i64 full = full_batch.count(model) ? full_batch.at(model) : ladder.back();
  auto med = [&](i64 b, const std::function<double(const Row&)>& f) {
    std::vector<double> v;
    for (const auto& r : rows.at(b)) v.push_back(f(r));
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  auto spread = [&](i64 b, const std::function<double(const Row&)>& f) {
    double lo = 1e300, hi = -1e300;
    for (const auto& r : rows.at(b)) lo = std::min(lo, f(r)), hi = std::max(hi, f(r));
    return hi - lo;
  };
  const Row& any = rows.at(ladder.front()).front();
  std::cout << "\n=== " << model << " / " << variant << " (" << variant_env(variant) << "; at::get_num_threads "
            << any.at("threads") << ", mkldnn " << any.at("mkldnn") << ", reps " << rows.at(ladder.front()).size()
            << ", full batch " << full << ") ===\n";
  const double P = any.at("param_bytes");
  std::cout << "static: parameters " << fmt(P / kMiB) << " MiB; parameters+gradients+AdamW moments = 4 x = "
            << fmt(4 * P / kMiB) << " MiB; VmRSS after torch init " << fmt(any.at("rss_init") / kMiB)
            << " MiB, after model build +" << fmt((any.at("rss_built") - any.at("rss_init")) / kMiB) << " MiB\n";

  const std::vector<Measure> measures = {
      {"A", "allocator step peak growth (peak live - live before the steady step)",
       [](const Row& r) { return r.at("s_alloc_growth"); }},
      {"Ab", "allocator peak over model built (grads + AdamW state + A)",
       [](const Row& r) { return r.at("s_alloc_before") + r.at("s_alloc_growth") - r.at("alloc_built"); }},
      {"R", "RSS step growth of a plain steady step (VmHWM after - VmRSS before)",
       [](const Row& r) { return r.at("s_rss_growth"); }, false},
      {"T", "RSS step growth of a steady step run right after malloc_trim(0)",
       [](const Row& r) { return r.at("t_rss_growth"); }},
      {"Rb", "RSS peak of the steady step over model built (VmHWM - VmRSS after build)",
       [](const Row& r) { return r.at("s_hwm") - r.at("rss_built"); }},
      {"W1", "RSS peak of warm-up step 1 over model built (grads + AdamW state created)",
       [](const Row& r) { return r.at("w1_hwm") - r.at("rss_built"); }},
      {"Pk", "RSS peak of the whole run over model built (max of every step's VmHWM - VmRSS after build)",
       [](const Row& r) { return whole_run_hwm(r) - r.at("rss_built"); }},
      {"H", "absolute process VmHWM of the whole run (incl. ~150 MiB of LibTorch)",
       [](const Row& r) { return whole_run_hwm(r); }},
  };
  std::cout << "measures (MiB, median over reps; '±' = max-min over reps):\n";
  for (const auto& m : measures) std::cout << "  " << std::setw(3) << m.name << ": " << m.help << "\n";
  std::cout << "  phase: where the allocator peak of the step is (f forward+loss, b backward, o optimizer step)\n";
  std::cout << std::setw(6) << "batch";
  for (const auto& m : measures) std::cout << std::setw(15) << m.name;
  std::cout << std::setw(7) << "T/A" << std::setw(7) << "Pk/Ab" << std::setw(7) << "phase" << "\n";
  for (auto b : ladder) {
    std::cout << std::setw(6) << b;
    for (const auto& m : measures)
      std::cout << std::setw(15) << (fmt(med(b, m.get) / kMiB) + "±" + fmt(spread(b, m.get) / kMiB, 1));
    const double a = med(b, measures[0].get), t = med(b, measures[3].get);
    const double ab = med(b, measures[1].get), pk = med(b, measures[6].get);
    const Row& r = rows.at(b).front();
    std::string phase = "?";
    if (r.count("s_phase_fwd")) {
      const double f = r.at("s_phase_fwd"), bw = r.at("s_phase_bwd"), o = r.at("s_phase_opt");
      phase = f >= bw && f >= o ? "f" : bw >= o ? "b" : "o";
    }
    std::cout << std::setw(7) << (a > 0 ? fmt(t / a) : "n/a") << std::setw(7) << (ab > 0 ? fmt(pk / ab) : "n/a")
              << std::setw(7) << phase << "\n";
  }

  struct Fit {
    std::string name;
    std::function<std::vector<i64>(i64)> points;  // empty: not applicable
  };
  auto below = [&](i64 target, std::size_t k) {
    std::vector<i64> v;
    for (auto b : ladder)
      if (b < target) v.push_back(b);
    if (v.size() < k) return std::vector<i64>{};
    return std::vector<i64>(v.end() - static_cast<long>(k), v.end());
  };
  auto first = [&](std::size_t from, std::size_t k) {
    return [&, from, k](i64 t) {
      if (ladder.size() < from + k || t <= ladder[from + k - 1]) return std::vector<i64>{};
      return std::vector<i64>(ladder.begin() + static_cast<long>(from), ladder.begin() + static_cast<long>(from + k));
    };
  };
  const std::vector<Fit> fits = {
      {"{1,2}", first(0, 2)}, {"{1,2,4}", first(0, 3)}, {"{2,4,8}", first(1, 3)}, {"2 below", [&](i64 t) { return below(t, 2); }},
  };
  std::cout << "linear extrapolation in the batch size: prediction error in % of the measured value "
               "('2 below' = the two ladder batches just below: B/4 and B/2 on a doubling ladder; * = full batch)\n";
  for (const auto& m : measures) {
    if (!m.extrapolate) continue;
    std::cout << "  " << std::setw(3) << m.name << ":" << std::setw(6) << "batch" << std::setw(12) << "measured";
    for (const auto& f : fits) std::cout << std::setw(11) << f.name;
    std::cout << "\n";
    for (auto b : ladder) {
      if (ladder.size() < 3 || b <= ladder[1]) continue;
      const double actual = med(b, m.get);
      std::cout << "      " << std::setw(6) << b << (b == full ? "*" : " ") << std::setw(11) << fmt(actual / kMiB);
      for (const auto& f : fits) {
        const auto pts = f.points(b);
        if (pts.empty()) {
          std::cout << std::setw(11) << "-";
          continue;
        }
        std::vector<double> xs, ys;
        for (auto p : pts) xs.push_back(static_cast<double>(p)), ys.push_back(med(p, m.get));
        const double pred = linear_predict(xs, ys, static_cast<double>(b));
        std::cout << std::setw(11) << fmt(100.0 * (pred - actual) / actual, 1) + "%";
      }
      std::cout << "\n";
    }
  }
}

/// raw file: one "RESULT variant=V model=M batch=B ..." line per child run
void analyze(const std::vector<std::string>& files) {
  std::map<std::pair<std::string, std::string>, std::map<i64, std::vector<Row>>> all;
  std::vector<std::pair<std::string, std::string>> order;
  for (const auto& file : files) {
    std::ifstream in(file);
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("RESULT", 0) != 0) continue;
      const auto vp = line.find("variant=");
      const std::string variant = vp == std::string::npos ? "?" : line.substr(vp + 8, line.find(' ', vp) - vp - 8);
      std::string model;
      const auto row = parse_result(line, &model);
      const auto key = std::make_pair(model, variant);
      if (!all.count(key)) order.push_back(key);
      all[key][static_cast<i64>(row.at("batch"))].push_back(row);
    }
  }
  for (const auto& key : order) print_tables(key.first, key.second, all.at(key));
}

int run_driver(int argc, char** argv) {
  std::vector<std::string> models = {"gpt", "mlp", "resnet"};
  std::vector<std::string> variants = {"omp1", "omp2"};
  std::string raw = "raw.txt";
  int reps = 3, warmup = 2;
  std::map<std::string, std::vector<i64>> ladders = {
      {"gpt", {1, 2, 4, 8, 16, 32}},
      {"mlp", {1, 2, 4, 8, 16, 32, 128, 512, 2048, 8192}},
      {"resnet", {1, 2, 4, 8, 16, 32, 64}},
  };
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--models") models = split(value);
    else if (flag == "--variants") variants = split(value);
    else if (flag == "--reps") reps = std::stoi(value);
    else if (flag == "--warmup") warmup = std::stoi(value);
    else if (flag == "--raw") raw = value;
    else if (flag.rfind("--ladder-", 0) == 0) ladders[flag.substr(9)] = parse_list(value);
    else throw std::invalid_argument("unknown flag " + flag);
  }
  const auto exe = self_path();
  std::cout << "each (model, batch, variant, rep) runs in a fresh process (" << exe << " child ...): " << warmup
            << " warm-up steps, then the measured steady steps; raw lines in " << raw << "\n";
  std::ofstream out(raw, std::ios::app);
  for (const auto& model : models)
    for (const auto& variant : variants) {
      std::map<i64, std::vector<Row>> rows;
      for (int rep = 0; rep < reps; ++rep)
        for (auto b : ladders.at(model)) {
          auto line = run_one(exe, variant_env(variant), model, b, warmup);
          line.insert(std::string("RESULT").size(), " variant=" + variant);
          out << line << "\n" << std::flush;
          rows[b].push_back(parse_result(line));
          std::cerr << "." << std::flush;
        }
      std::cerr << "\n";
      print_tables(model, variant, rows);
      std::cout << std::flush;
    }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    int warmup = 2;
    for (int i = 1; i + 1 < argc; ++i)
      if (std::string(argv[i]) == "--warmup") warmup = std::stoi(argv[i + 1]);
    if (mode == "child" && argc >= 4) return run_child(argv[2], std::stoll(argv[3]), warmup);
    if (mode == "inproc" && argc >= 4) return run_inproc(argv[2], parse_list(argv[3]), warmup);
    if (mode == "analyze" && argc >= 3) {
      analyze(std::vector<std::string>(argv + 2, argv + argc));
      return 0;
    }
    return run_driver(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "study: " << e.what() << "\n";
    return 1;
  }
}

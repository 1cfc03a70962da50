// Study for issue 12: predict()'s CUDA calibration, taken apart on a CPU. Reads
// the cuda_calibration_study.json that the hidden CUDA case "predict's CUDA
// calibration recorded for study off the GPU" writes (scripts/gpu-run.sh puts
// it in $OUT): per model, the allocation timeline of a forward, loss and
// backward at each recorded batch, predict's figures and a measured step. For
// each pair of recorded batches below the full one whose timelines align, it
// extrapolates the pair to the full batch, as predict does, and prints:
//   - whether that matches the recorded full-batch timeline event by event (the
//     largest difference of live bytes), and the two peaks; how much the whole
//     steps' peaks rise a row; for a close pair (at most b2/8 apart, predict's
//     (7H/8, H)), whether the steps recorded from b2/2 below it bound its peak
//     (predict/timeline.hpp, bound_close_pair) and the peak and reserve then;
//   - the caching allocator's reserve above the allocations, replayed through
//     memscale's model (predict/cuda_reserve.hpp: parameters resident, AdamW's
//     two moments after the first step, what was allocated before the model as
//     one block) for the extrapolated and for the recorded timeline, against the
//     measured one (a full step: reserved peak - allocated peak).
// So a row says which is off: the extrapolation (small batches take other paths)
// or the model of the allocator.
//
// Not built by CMake. From this folder:
//   g++ -std=c++20 -O2 -I../../include -isystem /usr/include/torch/csrc/api/include \
//       cuda_calibration_replay.cpp -o replay -Wl,--no-as-needed -ltorch -ltorch_cpu -lc10
//   ./replay cuda_calibration_study.json
//   ./replay --record-cpu study-cpu.json    the same file's shape from CPU steps (a check of this tool)
#include <algorithm>
#include <cstdint>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memscale/predict/cuda_reserve.hpp>
#include <memscale/predict/timeline.hpp>

namespace {

using memscale::predictor::timeline;
using memscale::predictor::timeline_fit;
constexpr double MiB = 1024.0 * 1024.0;

timeline from_json(const nlohmann::json& j) {
  timeline t;
  t.live = j.at("live").get<std::vector<std::int64_t>>();
  for (const int a : j.at("allocation").get<std::vector<int>>()) t.allocation.push_back(a != 0);
  t.block = j.at("block").get<std::vector<std::uint32_t>>();
  t.marks = j.at("marks").get<std::vector<std::size_t>>();
  t.reserved_peak = j.at("reserved_peak").get<std::int64_t>();
  t.allocated_peak = j.at("allocated_peak").get<std::int64_t>();
  return t;
}

/// The reserve above the allocations that memscale's model gives for `fit` at `batch`.
std::int64_t replayed(const timeline_fit& fit, std::int64_t batch, const nlohmann::json& model) {
  std::vector<std::int64_t> resident, state;
  for (const auto bytes : model.at("parameter_bytes").get<std::vector<std::int64_t>>()) {
    resident.push_back(bytes);
    state.push_back(bytes);  // AdamW: two moments per parameter
    state.push_back(bytes);
  }
  if (const auto before = model.at("allocated_before_model").get<std::int64_t>(); before > 0)
    resident.push_back(before);
  const auto r = memscale::predictor::replay_reserve(fit, batch, resident, state, 0);
  return r ? r->reserved - r->allocated : -1;
}

int analyze(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    std::cerr << "cannot read " << path << "\n";
    return 1;
  }
  const auto all = nlohmann::json::parse(in);
  std::cout << std::fixed << std::setprecision(1);
  for (const auto& [name, model] : all.items()) {
    const auto& predicted = model.at("predicted");
    const auto& measured = model.at("measured");
    const auto full = predicted.at("batch").get<std::int64_t>();
    const auto measured_reserve =
        measured.at("reserved_peak").get<std::int64_t>() - measured.at("allocated_peak").get<std::int64_t>();
    std::cout << name << " at batch " << full << ": predict total " << predicted.at("total").get<double>() / MiB
              << " MiB (calibration " << predicted.at("calibration_batches").dump() << "), measured "
              << (measured.at("reserved_peak").get<double>() + measured.at("outside").get<double>()) / MiB
              << " MiB, reserve measured " << measured_reserve / MiB << " MiB\n";
    for (const auto& note : predicted.at("notes")) std::cout << "  note: " << note.get<std::string>() << "\n";
    std::vector<std::pair<std::int64_t, timeline>> runs;
    for (const auto& [batch, t] : model.at("timelines").items()) runs.emplace_back(std::stoll(batch), from_json(t));
    std::sort(runs.begin(), runs.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    const timeline* at_full = nullptr;
    for (const auto& [b, t] : runs)
      if (b == full) at_full = &t;
    if (at_full != nullptr) {
      const timeline_fit self(*at_full, full, *at_full, full + 1);  // the recorded timeline as it is
      std::cout << "  recorded at " << full << ": peak " << at_full->peak() / MiB << " MiB, replayed reserve "
                << replayed(self, full, model) / MiB << " MiB, its own reserve "
                << (at_full->reserved_peak - at_full->allocated_peak) / MiB << " MiB\n";
    }
    for (std::size_t i = 0; i < runs.size(); ++i)
      for (std::size_t k = i + 1; k < runs.size(); ++k) {
        const auto& [b1, t1] = runs[i];
        const auto& [b2, t2] = runs[k];
        if (b2 >= full) continue;
        std::cout << "  pair " << std::setw(5) << b1 << "," << std::setw(5) << b2 << ": ";
        if (!memscale::predictor::aligned(t1, t2)) {
          std::cout << "not aligned (" << t1.live.size() << " and " << t2.live.size() << " events)\n";
          continue;
        }
        const timeline_fit fit(t1, b1, t2, b2);
        std::cout << "peak at " << full << " " << fit.peak(full) / MiB << " MiB";
        if (at_full != nullptr && memscale::predictor::aligned(t2, *at_full)) {
          std::cout << " (recorded " << at_full->peak() / MiB << ", largest event difference "
                    << fit.largest_difference(*at_full, full) / MiB << " MiB)";
        } else if (at_full != nullptr) {
          std::cout << " (recorded " << at_full->peak() / MiB << ", its events differ: " << at_full->live.size()
                    << ")";
        }
        std::cout << ", replayed reserve " << replayed(fit, full, model) / MiB << " MiB; whole peaks rise "
                  << static_cast<double>(t2.peak() - t1.peak()) / static_cast<double>(b2 - b1) / MiB << " MiB a row";
        // A close pair (predict's (7H/8, H)) bounded by the recorded steps from b2/2 below it (bound_close_pair).
        std::vector<std::pair<std::int64_t, const timeline*>> others;
        for (const auto& [b, t] : runs)
          if (2 * b >= b2 && b < b1) others.emplace_back(b, &t);
        if (8 * (b2 - b1) <= b2 && !others.empty()) {
          auto bounded = fit;
          if (memscale::predictor::bound_close_pair(bounded, others, full).empty())
            std::cout << "; close pair, not bounded";
          else
            std::cout << "; close pair bounded: peak at " << full << " " << bounded.peak(full) / MiB
                      << " MiB, replayed reserve " << replayed(bounded, full, model) / MiB << " MiB";
        }
        // The pair's check in predict (calibration.hpp, fit_near_target): the recorded batches between them.
        for (const auto& [b, t] : runs)
          if (b > b1 && b < b2 && memscale::predictor::aligned(t, t2))
            std::cout << "; at " << b << " off by " << fit.largest_difference(t, b) / MiB << " MiB of "
                      << t.peak() / MiB;
        std::cout << "\n";
      }
  }
  return 0;
}

/// The study file's shape from CPU steps of a small MLP (no reserve: a check of this tool).
int record_cpu(const std::string& path) {
  torch::manual_seed(5);
  torch::nn::Sequential model;
  for (int i = 0; i < 4; ++i) {
    model->push_back(torch::nn::Linear(64, 256));
    model->push_back(torch::nn::GELU());
    model->push_back(torch::nn::Linear(256, 64));
    model->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({64})));
  }
  const auto x = torch::randn({512, 64}), y = torch::randn({512, 64});
  nlohmann::json j;
  for (const auto& p : model->parameters()) j["parameter_bytes"].push_back(p.nbytes());
  j["allocated_before_model"] = 0;
  for (const std::int64_t b : {2, 3, 4, 128, 256, 512}) {
    for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
    memscale::predictor::timeline_scope recorder(torch::kCPU);
    {
      const auto out = model->forward(x.narrow(0, 0, b));
      recorder.mark();
      const auto value = torch::mse_loss(out, y.narrow(0, 0, b));
      recorder.mark();
      value.backward();
    }
    const auto t = recorder.finish();
    j["timelines"][std::to_string(b)] = {{"live", t.live},
                                         {"allocation", std::vector<int>(t.allocation.begin(), t.allocation.end())},
                                         {"block", t.block},
                                         {"marks", t.marks},
                                         {"reserved_peak", 0},
                                         {"allocated_peak", 0}};
  }
  j["predicted"] = {{"batch", 512}, {"total", 0}, {"calibration_batches", {2, 3}}, {"notes", nlohmann::json::array()}};
  j["measured"] = {{"reserved_peak", 0}, {"allocated_peak", 0}, {"outside", 0}};
  std::ofstream(path) << nlohmann::json{{"mlp-cpu", j}}.dump();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--record-cpu") return record_cpu(argv[2]);
  if (argc == 2) return analyze(argv[1]);
  std::cerr << "usage: " << argv[0] << " cuda_calibration_study.json | --record-cpu OUT.json\n";
  return 2;
}

// Study: a BERT-style encoder whose layers take the batch's padding mask,
// `x = memscale::forward(*layer, x, keep)`: what memscale does with call-site
// units that pass arguments after their input (before, such calls ran directly
// and the model got whole-model offload only). Not built by CMake; build and
// run as benchmarks/studies/README.md says:
//   ./padded_encoder MODE [BATCH] [LENGTH]   (defaults: 16 128)
// MODE: baseline, balanced (Balanced, force_optimize), aggressive. Each batch
// has its own padding (the last 0-50% of each row), drawn from a fixed seed, so
// the losses of every mode are comparable bit for bit: each step's loss is
// printed in hex. Prints the allocator's step growth and the process's resident
// growth (the largest of 6 steps after 2 warm-up steps) and the median step.
#include <torch/torch.h>
#include <memscale/memscale.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>
namespace nn = torch::nn;

struct EncoderLayerImpl : nn::Module {
  EncoderLayerImpl(int64_t d, int64_t heads) : heads(heads) {
    ln1 = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({d})));
    ln2 = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({d})));
    qkv = register_module("qkv", nn::Linear(d, 3 * d));
    proj = register_module("proj", nn::Linear(d, d));
    fc1 = register_module("fc1", nn::Linear(d, 4 * d));
    fc2 = register_module("fc2", nn::Linear(4 * d, d));
    drop = register_module("drop", nn::Dropout(0.1));
  }
  // keep: [B, T], 1 for tokens, 0 for padding.
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& keep) {
    const auto B = x.size(0), T = x.size(1), C = x.size(2);
    auto parts = qkv(ln1(x)).view({B, T, 3, heads, C / heads}).permute({2, 0, 3, 1, 4});
    auto att = torch::matmul(parts[0], parts[1].transpose(-2, -1)) / std::sqrt(double(C / heads));
    att = att.masked_fill(keep.view({B, 1, 1, T}) == 0, -1e9);
    att = drop(torch::softmax(att, -1));
    auto y = torch::matmul(att, parts[2]).transpose(1, 2).reshape({B, T, C});
    x = x + drop(proj(y));
    return x + drop(fc2(torch::gelu(fc1(ln2(x)))));
  }
  int64_t heads;
  nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
  nn::Dropout drop{nullptr};
};
TORCH_MODULE(EncoderLayer);

struct EncoderImpl : nn::Module {
  EncoderImpl(int64_t vocab, int64_t d, int64_t heads, int64_t layers_count, int64_t classes) {
    tok = register_module("tok", nn::Embedding(vocab, d));
    pos = register_module("pos", nn::Embedding(512, d));
    layers = register_module("layers", nn::ModuleList());
    for (int64_t i = 0; i < layers_count; ++i) layers->push_back(EncoderLayer(d, heads));
    norm = register_module("norm", nn::LayerNorm(nn::LayerNormOptions({d})));
    head = register_module("head", nn::Linear(d, classes));
  }
  // ids: [B, T] with 0 as padding.
  torch::Tensor forward(torch::Tensor ids) {
    const auto keep = (ids != 0).to(torch::kFloat);
    auto x = tok(ids) + pos(torch::arange(ids.size(1)));
    for (const auto& layer : *layers) x = memscale::forward(*layer->as<EncoderLayer>(), x, keep);
    x = norm(x);
    auto pooled = (x * keep.unsqueeze(-1)).sum(1) / keep.sum(1, true);  // mean over the tokens
    return head(pooled);
  }
  nn::Embedding tok{nullptr}, pos{nullptr};
  nn::ModuleList layers{nullptr};
  nn::LayerNorm norm{nullptr};
  nn::Linear head{nullptr};
};
TORCH_MODULE(Encoder);

torch::Tensor batch_ids(int64_t batch, int64_t T, int step) {
  torch::manual_seed(1000 + step);
  auto ids = torch::randint(1, 8000, {batch, T});
  auto lengths = torch::randint(T / 2, T + 1, {batch});
  return ids * (torch::arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(torch::kLong);
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "aggressive";
  const int64_t batch = argc > 2 ? std::atoll(argv[2]) : 16;
  const int64_t T = argc > 3 ? std::atoll(argv[3]) : 128;
  memscale::fix_malloc_mmap_threshold();
  memscale::memory_tracker::install();
  torch::manual_seed(1);
  Encoder model(8000, 256, 4, 6, 4);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-4));
  memscale::Config cfg;
  cfg.mode = mode == "aggressive" ? memscale::OptimizationMode::Aggressive : memscale::OptimizationMode::Balanced;
  cfg.force_optimize = true;
  cfg.enable_logging = false;
  if (std::getenv("PREDICT") != nullptr) {  // before anything trains, as a user asks it
    const auto example = batch_ids(batch, T, -1);
    const auto labels = example.select(1, 0) % 4;
    const auto loss = [&](const torch::Tensor& out) {
      return torch::nn::functional::cross_entropy(out, labels.narrow(0, 0, out.size(0)));
    };
    const auto p = memscale::predict(model, example, opt, loss, cfg);
    std::printf("predicted step peak (the process: model, gradients, AdamW state and the step): baseline %.2f MiB, with the plan %.2f MiB\n",
                p.baseline_peak_bytes / 1048576.0, p.peak_bytes / 1048576.0);
    if (std::getenv("PRINT")) std::cout << p << "\n";
  }
  std::optional<memscale::OptimizationGuard> guard;
  if (mode != "baseline") guard.emplace(memscale::optimize(model, batch_ids(batch, T, -1), cfg));
  auto step = [&](int s) {
    const auto ids = batch_ids(batch, T, s);
    const auto labels = ids.select(1, 0) % 4;
    torch::manual_seed(5000 + s);  // the Dropout masks
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(ids), labels);
    loss.backward();
    opt.step();
    return loss.item<float>();
  };
  step(0);
  step(1);
  std::vector<double> times;
  int64_t growth = 0, pgrowth = 0;
  std::string losses;
  for (int i = 2; i < 8; ++i) {
    memscale::memory_tracker::process_peak_scope ps;
    memscale::memory_tracker::peak_scope s;
    const auto t0 = std::chrono::steady_clock::now();
    const float l = step(i);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    growth = std::max(growth, s.peak_growth());
    if (ps.active()) pgrowth = std::max(pgrowth, ps.peak_growth());
    char hex[16];
    std::snprintf(hex, sizeof hex, "%a ", static_cast<double>(l));
    losses += hex;
  }
  std::sort(times.begin(), times.end());
  std::printf("%-10s growth %7.2f MiB  process growth %7.2f MiB  step %7.1f ms  losses %s\n", mode.c_str(),
              growth / 1048576.0, pgrowth / 1048576.0, times[3] * 1e3, losses.c_str());
  if (guard) {
    const auto r = guard->report();
    std::printf("           %d checkpointed, %d offloaded; projected %.2f -> %.2f MiB\n", r.checkpointed_segments(),
                r.offloaded_units(), r.baseline_peak_bytes() / 1048576.0, r.planned_peak_bytes() / 1048576.0);
    if (std::getenv("PRINT")) std::cout << r << "\n";
  }
}

// Study (issue 13, "Balanced at most 1.10x"): what does freeing a MiB of the
// benchmark GPT's step growth cost on this machine, by checkpointing a unit and
// by the op-level alternatives (Dropout masks stored a bit an element, cheap
// ops recomputed from tensors autograd saves anyway)? Not built by CMake; see
// README.md.
//
// 1. memscale profiles the benchmark GPT (bench_memscale's: d_model 192, 4
//    heads, context 128, 6 blocks, dropout 0.1, batch 16) as Balanced with
//    force_optimize would; for each unit (attention half, MLP half) it prints
//    what checkpointing it frees and what its recompute costs (the planner's
//    own figures, replayed masks and kept products counted), and the least
//    recompute that halves the step's growth by checkpointing.
// 2. Plain steps and steps whose saved Dropout masks are stored a bit an
//    element (a saved-tensor hook that packs any saved tensor whose elements
//    are all +0 or one value, and unpacks it exactly) take turns in one
//    process: the median step time and the allocator's step peak growth of
//    each.
// 3. The op-level recompute a halving plan could add: times of the ops that
//    would recompute a Dropout's output (the product of the softmax and its
//    mask) and a LayerNorm's output at the block's shapes.
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <optional>
#include <random>
#include <vector>

#include <memscale/memscale.hpp>

#include "gpt.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

/// A saved tensor, or its bits where every element is +0 or one value `value`.
struct packed_saved {
  at::Tensor plain, bits;
  std::uint32_t value = 0;
  std::vector<std::int64_t> sizes;
};
std::atomic<std::int64_t> packed_bytes{0};

struct pack_masks {
  packed_saved operator()(const at::Tensor& t) const {
    packed_saved p;
    if (t.requires_grad() || t.scalar_type() != at::kFloat || !t.device().is_cpu() || t.layout() != at::kStrided ||
        !t.is_contiguous() || t.numel() < 16384) {
      p.plain = t;
      return p;
    }
    const auto n = t.numel();
    const auto* in = static_cast<const std::uint32_t*>(t.data_ptr());
    std::uint32_t v = 0;
    for (std::int64_t i = 0; i < n && v == 0; ++i) v = in[i];
    if (v == 0) {
      p.plain = t;
      return p;
    }
    auto bits = at::empty({(n + 7) / 8}, at::TensorOptions(at::kByte));
    auto* out = bits.data_ptr<std::uint8_t>();
    std::atomic<bool> other{false};
    at::parallel_for(0, bits.numel(), 1 << 13, [&](std::int64_t b, std::int64_t e) {
      unsigned ok = 1;
      for (std::int64_t i = b; i < e; ++i) {
        unsigned byte = 0;
        const auto m = std::min<std::int64_t>(8, n - 8 * i);
        for (std::int64_t j = 0; j < m; ++j) {
          const auto u = in[8 * i + j];
          ok &= static_cast<unsigned>(u == 0 || u == v);
          byte |= (u != 0 ? 1U : 0U) << j;
        }
        out[i] = static_cast<std::uint8_t>(byte);
      }
      if (ok == 0) other = true;
    });
    if (other) {
      p.plain = t;
      return p;
    }
    packed_bytes += static_cast<std::int64_t>(t.nbytes());
    p.bits = bits;
    p.value = v;
    p.sizes = t.sizes().vec();
    return p;
  }
};

struct unpack_masks {
  at::Tensor operator()(packed_saved& p) const {
    if (p.plain.defined()) return p.plain;
    auto t = at::empty(p.sizes, at::TensorOptions(at::kFloat));
    const auto n = t.numel();
    auto* o = static_cast<std::uint32_t*>(t.data_ptr());
    const auto* in = p.bits.data_ptr<std::uint8_t>();
    const auto v = p.value;
    at::parallel_for(0, p.bits.numel(), 1 << 13, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) {
        const unsigned byte = in[i];
        const auto m = std::min<std::int64_t>(8, n - 8 * i);
        for (std::int64_t j = 0; j < m; ++j) o[8 * i + j] = ((byte >> j) & 1U) != 0 ? v : 0U;
      }
    });
    return t;
  }
};

template <class F>
double median_ms(F&& f, int reps) {
  std::vector<double> t;
  for (int i = 0; i < reps + 2; ++i) {
    const auto start = clock_type::now();
    f();
    if (i >= 2) t.push_back(std::chrono::duration<double, std::milli>(clock_type::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 10;
  memscale::memory_tracker::install();
  const auto o = gpt::benchmark_options();
  const std::int64_t batch = 16;
  const auto text = gpt::encode(gpt::training_text());
  std::mt19937_64 rng(7);
  const auto sample = gpt::sample_batch(text, batch, o.context, rng);

  // 1. The planner's per-unit figures.
  {
    torch::manual_seed(1);
    gpt::GPT model(o);
    memscale::Config cfg;
    cfg.mode = memscale::OptimizationMode::Balanced;
    cfg.force_optimize = true;
    cfg.enable_offloading = false;
    auto guard = memscale::optimize(model, sample.input, cfg);
    const auto& report = guard.report();
    std::cout << "1. checkpointing one unit (the planner's figures)\n";
    std::cout << std::fixed << std::setprecision(3);
    for (const auto& chain : report.chains) {
      const std::span<const memscale::slot_cost> s(chain.slots);
      for (int k = 0; k < static_cast<int>(s.size()); ++k) {
        const auto frees = memscale::core::checkpoint_frees(s, k, k);
        const auto seconds = memscale::core::checkpoint_recompute_seconds(s, k, k);
        std::cout << "  " << std::left << std::setw(28) << chain.slot_names[static_cast<std::size_t>(k)]
                  << std::right << " frees " << std::setw(7) << mib(static_cast<double>(frees)) << " MiB for "
                  << std::setw(6) << seconds * 1e3 << " ms: " << seconds * 1e3 / mib(static_cast<double>(frees))
                  << " ms/MiB\n";
      }
    }
    const auto& plan = report.plan;
    std::cout << "  Balanced forced: target " << mib(static_cast<double>(plan.target_bytes)) << " MiB from "
              << mib(static_cast<double>(plan.baseline_peak)) << " MiB; planned "
              << mib(static_cast<double>(plan.planned_peak)) << " MiB for " << report.recompute_seconds() * 1e3
              << " ms of recompute a step, the chains' forward and backward "
              << report.profiled_step_seconds() * 1e3 << " ms\n";
  }

  // 2. Plain steps and steps with masks packed, taking turns.
  torch::manual_seed(1);
  gpt::GPT plain_model(o);
  torch::manual_seed(1);
  gpt::GPT packed_model(o);
  torch::optim::AdamW plain_opt(plain_model->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::optim::AdamW packed_opt(packed_model->parameters(), torch::optim::AdamWOptions(1e-3));
  std::vector<double> plain_ms, packed_ms;
  std::vector<std::int64_t> plain_peak, packed_peak;
  std::vector<float> plain_loss, packed_loss;
  for (int step = 0; step < steps + 2; ++step) {
    for (const bool packed : {false, true}) {
      auto& model = packed ? packed_model : plain_model;
      auto& opt = packed ? packed_opt : plain_opt;
      torch::manual_seed(100 + step);
      memscale::memory_tracker::peak_scope peak;
      const auto start = clock_type::now();
      opt.zero_grad();
      torch::Tensor loss;
      {
        std::optional<memscale::offload::saved_tensors_hooks<pack_masks, unpack_masks>> hooks;
        if (packed) hooks.emplace(pack_masks{}, unpack_masks{});
        loss = gpt::loss(model->forward(sample.input), sample.target);
      }
      loss.backward();
      opt.step();
      const double ms = std::chrono::duration<double, std::milli>(clock_type::now() - start).count();
      if (step < 2) continue;  // warm-up: AdamW's state, first-touch pages
      (packed ? packed_ms : plain_ms).push_back(ms);
      (packed ? packed_peak : plain_peak).push_back(peak.peak_growth());
      (packed ? packed_loss : plain_loss).push_back(loss.item<float>());
    }
  }
  auto median = [](auto v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double base_ms = median(plain_ms), pack_ms = median(packed_ms);
  const double base_peak = static_cast<double>(median(plain_peak)), pack_peak = static_cast<double>(median(packed_peak));
  std::cout << "2. " << steps << " steps each, taking turns (medians)\n"
            << "  plain          " << std::setw(8) << base_ms << " ms  growth " << mib(base_peak) << " MiB\n"
            << "  masks packed   " << std::setw(8) << pack_ms << " ms  growth " << mib(pack_peak) << " MiB\n"
            << "  packing frees " << mib(base_peak - pack_peak) << " MiB (" << mib(static_cast<double>(packed_bytes.load()) /
                                                                             static_cast<double>(steps + 2))
            << " MiB of masks packed a step) for " << pack_ms - base_ms << " ms: "
            << (pack_ms - base_ms) / mib(base_peak - pack_peak) << " ms/MiB; losses "
            << (plain_loss == packed_loss ? "bit-identical" : "DIFFER") << "\n";

  // 3. Op-level recompute candidates at the block's shapes.
  torch::NoGradGuard no_grad;
  const auto H = o.heads, T = o.context, C = o.d_model;
  auto probs = torch::softmax(torch::randn({batch, H, T, T}), -1);
  auto mask = torch::empty_like(probs).bernoulli_(0.9).div_(0.9);
  auto hidden = torch::randn({batch, T, C});
  torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({C}));
  const double mul_ms = median_ms([&] { return probs * mask; }, 20);
  const double ln_ms = median_ms([&] { return ln(hidden); }, 20);
  std::cout << "3. op-level recompute\n"
            << "  attention Dropout's output (softmax x mask, " << mib(static_cast<double>(probs.nbytes()))
            << " MiB): " << mul_ms << " ms: " << mul_ms / mib(static_cast<double>(probs.nbytes())) << " ms/MiB\n"
            << "  LayerNorm's output (" << mib(static_cast<double>(hidden.nbytes())) << " MiB): " << ln_ms
            << " ms: " << ln_ms / mib(static_cast<double>(hidden.nbytes())) << " ms/MiB\n";
  return 0;
}

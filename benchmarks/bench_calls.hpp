// memscale benchmark (bench_memscale.cpp): what memscale::forward costs over a
// direct call, with no guard and with a guard active on another model.
#pragma once

#include <algorithm>
#include <chrono>
#include <iomanip>
#include <iostream>

#include <torch/torch.h>

#include <memscale/memscale.hpp>

#include "bench_common.hpp"
#include "bench_runner.hpp"

namespace bench {

/// What memscale::forward costs over a direct call, per call, on a module that
/// does nothing (torch::nn::Identity): without any guard, and with a guard
/// active on another model (the call then looks its module up).
inline void bench_call_overhead(std::ostream& out) {
  torch::nn::Identity identity;
  auto x = torch::ones({1});
  constexpr int calls = 1'000'000;
  auto per_call_ns = [&](auto&& call) {
    double best = 1e300;
    for (int round = 0; round < 5; ++round) {
      const auto start = clock_type::now();
      for (int i = 0; i < calls; ++i) {
        auto y = call();
        asm volatile("" : : "r"(y.unsafeGetTensorImpl()) : "memory");
      }
      best = std::min(best, std::chrono::duration<double>(clock_type::now() - start).count() * 1e9 / calls);
    }
    return best;
  };
  const auto direct = per_call_ns([&] { return identity->forward(x); });
  const auto unguarded = per_call_ns([&] { return memscale::forward(identity, x); });
  torch::nn::Sequential other(torch::nn::Linear(8, 8));
  auto guard = memscale::optimize(other, torch::ones({2, 8}), quiet_config(memscale::OptimizationMode::Conservative));
  const auto guarded_elsewhere = per_call_ns([&] { return memscale::forward(identity, x); });
  out << "\n## memscale::forward call overhead (torch::nn::Identity, best of 5 x " << calls << " calls)\n"
      << std::fixed << std::setprecision(1) << "direct call " << direct << " ns; memscale::forward with no guard "
      << unguarded << " ns (+" << unguarded - direct << "); with a guard on another model " << guarded_elsewhere
      << " ns (+" << guarded_elsewhere - direct << ", one locked index lookup)\n";
}

}  // namespace bench

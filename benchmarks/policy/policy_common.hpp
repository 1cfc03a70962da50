// memscale_policy (benchmarks/policy/memscale_policy.cpp), shared pieces: a corpus
// row (a generated model under one budget: Stage 1's features, the rule policy's
// choice, each candidate strategy's measured peak and step time) and its constants.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <memscale/memscale.hpp>

#include "gpt.hpp"
#include "host_info.hpp"
#include "resnet.hpp"

namespace policy_tool {

constexpr int generator_version = 1;
constexpr std::size_t classes = memscale::strategy_candidates.size();
constexpr std::size_t features = memscale::StrategyContext::feature_count;
constexpr double gib = 1024.0 * 1024.0 * 1024.0;

struct shape {
  std::string family;
  int size = 0;  ///< rank of the model's size within its family (0 smallest): the held-out split
  std::int64_t width = 0, depth = 0, batch = 0;
};

struct measured {
  std::int64_t peak = -1;
  double seconds = 0.0;
  bool fits = false;
};

struct corpus_row {
  shape s;
  double fraction = 0.0;
  std::int64_t budget = 0;
  std::array<double, features> x{};
  int rule = -1;
  std::array<measured, classes> candidates{};
};

inline int candidate_index(const memscale::StrategyChoice& c) {
  for (std::size_t k = 0; k < classes; ++k)
    if (memscale::strategy_candidates[k] == c) return static_cast<int>(k);
  return -1;
}

}  // namespace policy_tool

// memscale's Stage 1 policy, measured and trained (issue 14). One program, three steps:
//
//   memscale_policy corpus [--out FILE] [--seed N] [--quick]
//     For generated models (flat MLP chains as Sequentials, GPT decoders written with
//     call sites, ResNet-style CNNs; several widths, depths and batches) under several
//     budgets (the static bytes plus a fraction of the un-optimized step's projected
//     growth above them), measures every
//     Stage 1 candidate strategy with the AutoTuner's trials (memscale::autotune: real
//     training steps, the process's measured peak held to the budget), and writes one
//     CSV row per (model, budget): the StrategyContext features, the rule policy's
//     choice, and each candidate's measured peak, step time and fit.
//   memscale_policy train [--dataset FILE] [--artifact FILE] [--header FILE] [--evaluation FILE]
//     Fits a softmax-linear classifier (LibTorch) from the features to the best
//     candidate (the fastest that fits; where none fits, the lowest peak) on the rows
//     of every family's smaller models, evaluates it on the largest size of each family
//     (held out: a split by family and size, not by row) against the rule policy and
//     each fixed strategy, and writes the artifact, the header that ships it, and the
//     evaluation table.
//
// scripts/regenerate-policy.sh runs both with the repository's paths.
#include <iostream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "policy_corpus.hpp"
#include "policy_train.hpp"

using namespace policy_tool;

int main(int argc, char** argv) try {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || (args[0] != "corpus" && args[0] != "train")) {
    std::cerr << "usage: memscale_policy corpus [--out FILE] [--seed N] [--quick]\n"
                 "       memscale_policy train [--dataset FILE] [--artifact FILE] [--header FILE] [--evaluation FILE]\n";
    return 2;
  }
  std::map<std::string, std::string> opt;
  bool quick = false;
  for (std::size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--quick") quick = true;
    else if (i + 1 < args.size() && args[i].rfind("--", 0) == 0) {
      opt[args[i].substr(2)] = args[i + 1];
      ++i;
    }
    else throw std::invalid_argument("unknown argument '" + args[i] + "'");
  }
  const auto get = [&](const std::string& key, const std::string& fallback) {
    const auto it = opt.find(key);
    return it == opt.end() ? fallback : it->second;
  };
  memscale::memory_tracker::install();
  memscale::fix_malloc_mmap_threshold();
  gpt::register_memscale_rule();
  torch::set_num_threads(1);
  if (args[0] == "corpus") {
    const std::uint64_t seed = std::stoull(get("seed", "1"));
    torch::manual_seed(seed);
    const auto rows = make_corpus(quick);
    write_corpus(rows, get("out", "benchmarks/policy/dataset.csv"), header_line(quick, seed));
    std::cerr << "[policy] " << rows.size() << " rows\n";
    return 0;
  }
  return train_and_evaluate(get("dataset", "benchmarks/policy/dataset.csv"),
                            get("artifact", "benchmarks/policy/artifact.txt"),
                            get("header", "include/memscale/policy/shipped_artifact.hpp"),
                            get("evaluation", "benchmarks/policy/evaluation.md"));
} catch (const std::exception& e) {
  std::cerr << "memscale_policy: " << e.what() << "\n";
  return 1;
}

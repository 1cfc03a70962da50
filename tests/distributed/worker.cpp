// One rank of the data parallel jobs tests/test_distributed.cpp launches: Gloo over
// a FileStore, a small Sequential trained a few steps through DataParallel (c10d's
// Reducer), without memscale and with it, with per-rank data. It is compiled into
// the test binary (tests/CMakeLists.txt; a program of its own took as long to
// compile as a tenth of the test suite), whose main() hands it the arguments after
// --dp-worker:
//
//   memscale_tests --dp-worker --rank R --world-size N --store FILE|tcp:PORT --out DIR --scenario S [--timeout-ms T]
//
// Scenarios:
//   train      the runs of job.hpp, each from the same start: a Sequential without
//              memscale, with checkpoints (planned from an example batch) and with
//              offload (planned at the first forward); the example GPT without
//              memscale and with checkpoints. Each run writes
//              DIR/rank<R>_<run>.pt (the parameters), .txt (the plan) and .notes
//              (the Report's notes).
//   structure  rank 1's model has one slot more: planning must fail on every rank.
//   die        rank 1 exits after its second step: rank 0 must fail, not hang.
// Exit status: 0 done; 1 an error (the message on stderr); 3 rank 1 exiting on purpose.
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <memscale/distributed.hpp>
#include <memscale/memscale.hpp>

#include "job.hpp"

// Named, not anonymous: the test files share its translation unit.
namespace dp_worker {

namespace fs = std::filesystem;
namespace dist = memscale::distributed;

struct arguments {
  int rank = -1;
  int world_size = 0;
  std::string store;
  fs::path out;
  std::string scenario = "train";
  std::chrono::milliseconds timeout{60000};
};

arguments parse(int argc, char** argv) {
  std::map<std::string, std::string> named;
  for (int i = 1; i + 1 < argc; i += 2) named[argv[i]] = argv[i + 1];
  arguments a;
  a.rank = std::stoi(named.at("--rank"));
  a.world_size = std::stoi(named.at("--world-size"));
  a.store = named.at("--store");
  a.out = named.at("--out");
  if (named.count("--scenario")) a.scenario = named["--scenario"];
  if (named.count("--timeout-ms")) a.timeout = std::chrono::milliseconds(std::stoll(named["--timeout-ms"]));
  return a;
}

using dp_job::run;

std::string plan_text(const memscale::OptimizationGuard& guard) {
  std::ostringstream os;
  const auto report = guard.report();
  for (const auto& chain : report.plan.units) {
    for (const auto& u : chain) os << u << "; ";
    os << "\n";
  }
  os << "checkpointed " << report.checkpointed_segments() << " offloaded " << report.offloaded_units();
  if (const auto stats = guard.offload_stats())
    os << " disk_tensors " << stats->at(memscale::offload::tier::disk).tensors;
  os << "\n";
  return os.str();
}

/// Trains `model` dp_job::steps steps through DataParallel (under memscale for the
/// memscale runs); writes its parameters and plan.
template <class Model, class Loss>
void train(Model model, const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches, Loss loss_of,
           const dist::process_group& group, const arguments& args, run r) {
  const auto scratch = args.out / ("scratch_rank" + std::to_string(args.rank));
  fs::create_directories(scratch);
  const auto config = dp_job::config_for(r, args.rank, scratch);
  std::optional<memscale::OptimizationGuard> guard;
  std::optional<dist::DataParallel<Model>> dp;
  // Both orders work: memscale never changes the parameters.
  if (r == run::offload) {  // planned at the first forward
    dp.emplace(model, group);
    guard.emplace(dist::optimize(model, config, group));
  } else {
    if (dp_job::uses_memscale(r)) guard.emplace(dist::optimize(model, batches[0].first, config, group));
    dp.emplace(model, group);
  }
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::manual_seed(7 + static_cast<std::uint64_t>(args.rank));  // Dropout: per rank, the same in every run
  for (int s = 0; s < dp_job::steps; ++s) {
    const auto& [input, target] = batches[static_cast<std::size_t>(s)];
    optimizer.zero_grad();
    loss_of(dp->forward(input), target).backward();
    optimizer.step();
    if (args.scenario == "die" && args.rank == 1 && s == 1) {
      std::cerr << "rank 1: exiting on purpose after step " << s << std::endl;
      std::_Exit(3);
    }
  }
  const auto stem = args.out / ("rank" + std::to_string(args.rank) + "_" + dp_job::name_of(r));
  std::vector<torch::Tensor> params;
  for (const auto& p : model->parameters()) params.push_back(p.detach().clone());
  torch::save(params, stem.string() + ".pt");
  std::ofstream(stem.string() + ".txt") << (guard ? plan_text(*guard) : std::string("no memscale\n"));
  std::ofstream notes(stem.string() + ".notes");
  if (guard)
    for (const auto& note : guard->report().notes) notes << note << "\n";
}

void train(const dist::process_group& group, const arguments& args, run r) {
  if (dp_job::uses_gpt(r))
    return train(dp_job::make_gpt(args.rank), dp_job::token_batches_of(args.rank), gpt::loss, group, args, r);
  auto mse = [](const torch::Tensor& y, const torch::Tensor& target) { return (y - target).pow(2).mean(); };
  train(dp_job::make_model(args.rank, args.scenario == "structure" && args.rank == 1), dp_job::batches_of(args.rank),
        mse, group, args, r);
}

/// Gloo over a FileStore at --store FILE, or over a TCPStore at --store tcp:PORT (127.0.0.1).
dist::process_group make_group(const arguments& args) {
  if (args.store.rfind("tcp:", 0) != 0)
    return dist::process_group_from(args.rank, args.world_size, args.store, args.timeout);
  const auto port = static_cast<std::uint16_t>(std::stoi(args.store.substr(4)));
  auto store = dist::tcp_store("127.0.0.1", port, args.rank, args.world_size, args.timeout);
  return dist::gloo_group(store, args.rank, args.world_size, args.timeout);
}

}  // namespace dp_worker

int memscale_dp_worker_main(int argc, char** argv) {
  using namespace dp_worker;
  arguments args;
  try {
    args = parse(argc, argv);
  } catch (const std::exception&) {
    std::cerr << "usage: memscale_tests --dp-worker --rank R --world-size N --store FILE|tcp:PORT --out DIR"
                 " [--scenario train|structure|die] [--timeout-ms T]\n";
    return 2;
  }
  // Gloo writes to its peers with writev(2), which raises SIGPIPE where a peer
  // is gone: ignored, as Python ignores it, so that the write fails with EPIPE
  // and Gloo throws (in CI, 2026-11-30, rank 0 of "die" once ended by SIGPIPE).
  ::signal(SIGPIPE, SIG_IGN);
  try {
    auto group = make_group(args);
    if (args.scenario == "structure") {
      train(group, args, run::checkpoint);
    } else if (args.scenario == "die") {
      train(group, args, run::baseline);
    } else {
      for (auto r : dp_job::runs) train(group, args, r);
    }
  } catch (const std::exception& e) {
    std::cerr << "rank " << args.rank << ": " << e.what() << std::endl;
    return 1;
  }
  return 0;
}

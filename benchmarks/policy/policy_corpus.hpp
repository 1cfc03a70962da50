// memscale_policy corpus: generated models under several budgets, every Stage 1
// candidate measured with the AutoTuner's trials, one CSV row per (model, budget).
#pragma once

#include "policy_common.hpp"

namespace policy_tool {

/// The trial of `result` that ran `choice` (a duplicate read through to the trial
/// whose plan it repeats).
inline measured trial_of(const memscale::TuneResult& result, const memscale::StrategyChoice& choice) {
  for (const auto& t : result.trials) {
    if (t.config.mode != choice.mode || t.config.enable_checkpointing != choice.checkpoint ||
        t.config.enable_offloading != choice.offload || t.config.enable_tiling)
      continue;
    const memscale::TuneTrial* ran = &t;
    if (t.outcome == memscale::TrialOutcome::duplicate) {
      const auto hash = t.detail.find('#');
      if (hash == std::string::npos) return {};
      ran = &result.trials.at(std::stoul(t.detail.substr(hash + 1)));
    }
    measured m;
    m.peak = ran->measured_peak_bytes;
    m.seconds = ran->step_seconds;
    m.fits = ran->outcome == memscale::TrialOutcome::fits;
    return m;
  }
  return {};
}

/// Measures one model under each budget fraction.
template <class M>
inline void measure_model(const shape& s, M& model, const torch::Tensor& x,
                   const std::function<torch::Tensor(const torch::Tensor&)>& loss, const std::vector<double>& fractions,
                   std::vector<corpus_row>& out) {
  memscale::Config quiet;
  quiet.enable_logging = false;
  {
    // Two forward and backward passes first (no optimizer step: the model is not
    // changed): what the process comes to hold outside the allocator at this size
    // exists then, so the projections below are a warm process's, not a cold one's.
    torch::optim::AdamW warm(model->parameters(), torch::optim::AdamWOptions(3e-4));
    for (int i = 0; i < 2; ++i) {
      warm.zero_grad();
      loss(model->forward(x)).backward();
    }
    warm.zero_grad();
  }
  std::int64_t baseline = 0, static_bytes = 0;
  {
    auto guard = memscale::optimize(model, x, quiet);
    baseline = guard.report().baseline_peak_bytes();
    static_bytes = guard.report().static_bytes();
  }
  for (const double fraction : fractions) {
    corpus_row row;
    row.s = s;
    row.fraction = fraction;
    auto config = quiet;
    // The budget leaves `fraction` of the un-optimized step's room above the static
    // bytes (parameters, gradients, AdamW state, the reserve), all of it usable.
    config.memory_budget_gb =
        (static_cast<double>(static_bytes) + fraction * static_cast<double>(baseline - static_bytes)) / gib;
    config.target_gpu_utilization = 1.0;
    {
      auto staged = config;
      staged.auto_policy = true;
      staged.policy = memscale::PolicyKind::rule;
      auto guard = memscale::optimize(model, x, staged);
      const auto report = guard.report();
      if (!report.strategy.context) throw std::runtime_error("Stage 1 saw no context for " + s.family);
      row.x = report.strategy.context->features();
      row.rule = candidate_index(report.strategy.choice);
      row.budget = report.budget_bytes;
    }
    memscale::TuneOptions options;
    options.prune_with_predictor = false;
    options.use_cache = false;
    options.progress = memscale::TuneProgress::never;
    options.max_trials = 16;
    options.timed_steps = 3;
    options.time_budget_seconds = 600.0;
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-4));
    const auto result = memscale::autotune(model, x, optimizer, loss, config, options);
    if (std::getenv("MEMSCALE_POLICY_SHOW") != nullptr) std::cerr << result.str() << "\n";
    for (std::size_t k = 0; k < classes; ++k) row.candidates[k] = trial_of(result, memscale::strategy_candidates[k]);
    std::cerr << "[policy] " << s.family << " width " << s.width << " depth " << s.depth << " batch " << s.batch
              << " budget " << std::fixed << std::setprecision(2) << fraction << ": rule "
              << (row.rule >= 0 ? memscale::to_string(memscale::strategy_candidates[static_cast<std::size_t>(row.rule)])
                                : std::string("not a candidate"))
              << "\n";
    out.push_back(row);
  }
}

inline std::vector<corpus_row> make_corpus(bool quick) {
  const std::vector<double> fractions = quick ? std::vector<double>{0.5, 0.8} : std::vector<double>{0.35, 0.5, 0.65, 0.8, 0.95};
  std::vector<corpus_row> rows;
  const std::vector<std::int64_t> widths = quick ? std::vector<std::int64_t>{64, 128} : std::vector<std::int64_t>{64, 128, 256};
  for (std::size_t w = 0; w < widths.size(); ++w)
    for (const std::int64_t depth : {4, 8})
      for (const std::int64_t batch : {16, 32}) {
        if (quick && (depth == 8 || batch == 32)) continue;
        const shape s{"mlp", static_cast<int>(w), widths[w], depth, batch};
        torch::manual_seed(11);
        torch::nn::Sequential seq;
        for (int i = 0; i < depth; ++i) {
          seq->push_back(torch::nn::Linear(widths[w], 4 * widths[w]));
          seq->push_back(torch::nn::GELU());
          seq->push_back(torch::nn::Linear(4 * widths[w], widths[w]));
          seq->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({widths[w]})));
          seq->push_back(torch::nn::Dropout(0.1));
        }
        const auto x = torch::randn({batch, 64, widths[w]});
        const auto target = torch::randn({batch, 64, widths[w]});
        measure_model(s, seq, x, [&](const torch::Tensor& y) { return torch::mse_loss(y, target.slice(0, 0, y.size(0))); },
                      fractions, rows);
      }
  const std::vector<std::int64_t> d_models = quick ? std::vector<std::int64_t>{64, 128} : std::vector<std::int64_t>{64, 128, 192};
  for (std::size_t w = 0; w < d_models.size(); ++w)
    for (const std::int64_t layers : {2, 4})
      for (const std::int64_t batch : {8, 16}) {
        if (quick && (layers == 4 || batch == 16)) continue;
        const shape s{"gpt", static_cast<int>(w), d_models[w], layers, batch};
        gpt::Options o;
        o.d_model = d_models[w];
        o.layers = layers;
        o.context = 128;
        torch::manual_seed(12);
        gpt::GPT model(o);
        const auto tokens = torch::randint(o.vocab, {batch, o.context}, torch::kLong);
        const auto target = torch::randint(o.vocab, {batch, o.context}, torch::kLong);
        measure_model(s, model, tokens,
                      [&](const torch::Tensor& y) { return gpt::loss(y, target.slice(0, 0, y.size(0))); }, fractions, rows);
      }
  const std::vector<std::int64_t> channels = quick ? std::vector<std::int64_t>{16, 32} : std::vector<std::int64_t>{16, 32, 64};
  for (std::size_t w = 0; w < channels.size(); ++w)
    for (const int blocks : {2, 4})
      for (const std::int64_t batch : {8, 16}) {
        if (quick && (blocks == 4 || batch == 16)) continue;
        const shape s{"cnn", static_cast<int>(w), channels[w], blocks, batch};
        torch::manual_seed(13);
        resnet::ResNet model(blocks, channels[w]);
        const auto x = torch::randn({batch, 3, 32, 32});
        const auto labels = torch::randint(10, {batch}, torch::kLong);
        measure_model(s, model, x,
                      [&](const torch::Tensor& y) { return torch::cross_entropy_loss(y, labels.slice(0, 0, y.size(0))); },
                      fractions, rows);
      }
  return rows;
}

inline std::string header_line(bool quick, std::uint64_t seed) {
  std::ostringstream os;
  os << "# memscale policy corpus: generator " << generator_version << (quick ? " (quick)" : "") << ", seed " << seed
     << ", StrategyContext schema " << memscale::StrategyContext::schema_version << ", memscale "
     << memscale::version_major << '.' << memscale::version_minor << '.' << memscale::version_patch << ", LibTorch "
     << TORCH_VERSION << ", " << host_info::cpu_model() << ", " << torch::get_num_threads() << " torch threads";
  return os.str();
}

inline void write_corpus(const std::vector<corpus_row>& rows, const std::string& path, const std::string& header) {
  std::ofstream out(path);
  out << header << "\nfamily,size,width,depth,batch,budget_fraction,budget_bytes";
  for (std::size_t f = 0; f < features; ++f) out << ",f" << f;
  out << ",rule";
  for (std::size_t k = 0; k < classes; ++k) out << ",peak" << k << ",seconds" << k << ",fits" << k;
  out << "\n" << std::setprecision(9);
  for (const auto& r : rows) {
    out << r.s.family << ',' << r.s.size << ',' << r.s.width << ',' << r.s.depth << ',' << r.s.batch << ','
        << r.fraction << ',' << r.budget;
    for (double v : r.x) out << ',' << v;
    out << ',' << r.rule;
    for (const auto& m : r.candidates) out << ',' << m.peak << ',' << m.seconds << ',' << (m.fits ? 1 : 0);
    out << "\n";
  }
  if (!out) throw std::runtime_error("cannot write " + path);
}

}  // namespace policy_tool

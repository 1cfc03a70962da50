// memscale_policy train: the softmax-linear policy fitted on the corpus's smaller
// models, evaluated on the largest size of each family against the rule policy and
// every fixed strategy; writes the artifact, the header that ships it, the table.
#pragma once

#include "policy_common.hpp"

namespace policy_tool {

inline std::vector<corpus_row> read_corpus(const std::string& path, std::string& header) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path + " (run: memscale_policy corpus)");
  std::vector<corpus_row> rows;
  std::string line;
  std::getline(in, header);
  std::getline(in, line);  // the column names
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::vector<std::string> cell;
    std::istringstream fields(line);
    for (std::string c; std::getline(fields, c, ',');) cell.push_back(c);
    if (cell.size() != 7 + features + 1 + 3 * classes) throw std::runtime_error("malformed row in " + path + ": " + line);
    corpus_row r;
    r.s = {cell[0], std::stoi(cell[1]), std::stoll(cell[2]), std::stoll(cell[3]), std::stoll(cell[4])};
    r.fraction = std::stod(cell[5]);
    r.budget = std::stoll(cell[6]);
    for (std::size_t f = 0; f < features; ++f) r.x[f] = std::stod(cell[7 + f]);
    r.rule = std::stoi(cell[7 + features]);
    if (r.rule < 0 || r.rule >= static_cast<int>(classes)) throw std::runtime_error("a row's rule choice is not a candidate: " + line);
    for (std::size_t k = 0; k < classes; ++k) {
      const auto at = 8 + features + 3 * k;
      r.candidates[k] = {std::stoll(cell[at]), std::stod(cell[at + 1]), cell[at + 2] == "1"};
    }
    rows.push_back(r);
  }
  return rows;
}

/// The strategy that minimizes the peak, what a policy should pick where nothing fits.
constexpr int lowest_peak = 4;
static_assert(memscale::strategy_candidates[lowest_peak] ==
              memscale::StrategyChoice{memscale::OptimizationMode::Aggressive, true, true});

inline bool anything_fits(const corpus_row& r) {
  return std::any_of(r.candidates.begin(), r.candidates.end(), [](const measured& m) { return m.fits; });
}

/// The candidate a policy should pick: the fastest that fits. Where none fits, the
/// trials measured no peak (each ran out of memory under the budget's hard limit):
/// then the one that minimizes the peak, Aggressive with both techniques (as the
/// rule policy does), so that a policy learns to press hardest where memory is shortest.
inline int best_of(const corpus_row& r) {
  int best = -1;
  for (std::size_t k = 0; k < classes; ++k)
    if (r.candidates[k].fits && (best < 0 || r.candidates[k].seconds < r.candidates[static_cast<std::size_t>(best)].seconds))
      best = static_cast<int>(k);
  return best >= 0 ? best : lowest_peak;
}

inline bool held_out(const corpus_row& r, const std::map<std::string, int>& largest) { return r.s.size == largest.at(r.s.family); }

/// The softmax-linear policy fitted on `train`, as the artifact that ships it
/// (its dataset hash left for the caller).
inline memscale::policy::trained_artifact train_softmax(const std::vector<const corpus_row*>& train) {
  const auto n = static_cast<std::int64_t>(train.size());
  auto x = torch::empty({n, static_cast<std::int64_t>(features)}, torch::kDouble);
  auto y = torch::empty({n}, torch::kLong);
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::size_t f = 0; f < features; ++f) x[i][static_cast<std::int64_t>(f)] = train[static_cast<std::size_t>(i)]->x[f];
    y[i] = best_of(*train[static_cast<std::size_t>(i)]);
  }
  memscale::policy::trained_artifact out;
  const auto mean = x.mean(0), scale = x.std(0).clamp_min(1e-6);
  const auto z = (x - mean) / scale;
  torch::manual_seed(5);
  auto w = torch::zeros({static_cast<std::int64_t>(classes), static_cast<std::int64_t>(features)},
                        torch::TensorOptions(torch::kDouble).requires_grad(true));
  auto b = torch::zeros({static_cast<std::int64_t>(classes)}, torch::TensorOptions(torch::kDouble).requires_grad(true));
  torch::optim::LBFGS lbfgs({w, b}, torch::optim::LBFGSOptions(1.0).max_iter(500).line_search_fn("strong_wolfe"));
  constexpr double l2 = 1e-2;  // the corpus is small: keep the weights small
  lbfgs.step([&] {
    lbfgs.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(torch::matmul(z, w.t()) + b, y) + l2 * w.pow(2).sum();
    loss.backward();
    return loss;
  });
  for (std::size_t f = 0; f < features; ++f) {
    out.mean[f] = mean[static_cast<std::int64_t>(f)].item<double>();
    out.scale[f] = scale[static_cast<std::int64_t>(f)].item<double>();
  }
  for (std::size_t k = 0; k < classes; ++k) {
    for (std::size_t f = 0; f < features; ++f)
      out.weights[k][f] = w[static_cast<std::int64_t>(k)][static_cast<std::int64_t>(f)].item<double>();
    out.weights[k][features] = b[static_cast<std::int64_t>(k)].item<double>();
  }
  return out;
}

/// Fit rate and regret of a policy (a choice per row) over `rows`.
struct score {
  int rows = 0, fits = 0, regret_rows = 0;
  int infeasible = 0, pressed = 0;  ///< rows where nothing fits; of them, where it chose the lowest peak
  double regret_sum = 0.0, regret_worst = 1.0;
};

inline score score_of(const std::vector<const corpus_row*>& rows, const std::function<int(const corpus_row&)>& choose) {
  score s;
  for (const auto* r : rows) {
    ++s.rows;
    const int choice = choose(*r);
    if (!anything_fits(*r)) {
      ++s.infeasible;
      s.pressed += choice == lowest_peak ? 1 : 0;
    }
    const auto& chosen = r->candidates[static_cast<std::size_t>(choice)];
    if (!chosen.fits) continue;
    ++s.fits;
    const auto& best = r->candidates[static_cast<std::size_t>(best_of(*r))];
    const double regret = chosen.seconds / best.seconds;
    ++s.regret_rows;
    s.regret_sum += regret;
    s.regret_worst = std::max(s.regret_worst, regret);
  }
  return s;
}

inline int train_and_evaluate(const std::string& dataset, const std::string& artifact_path, const std::string& header_path,
                       const std::string& evaluation_path) {
  std::string header;
  const auto rows = read_corpus(dataset, header);
  std::map<std::string, int> largest;
  for (const auto& r : rows) largest[r.s.family] = std::max(largest[r.s.family], r.s.size);
  std::vector<const corpus_row*> train, test;
  for (const auto& r : rows) (held_out(r, largest) ? test : train).push_back(&r);
  if (train.empty() || test.empty()) throw std::runtime_error("the corpus needs at least two sizes per family");
  std::ifstream dataset_bytes(dataset, std::ios::binary);
  const auto hash = memscale::policy::dataset_hash(dataset_bytes);
  auto model = train_softmax(train);
  model.dataset = hash;
  const auto text = memscale::policy::format_artifact(model);
  const auto artifact = memscale::policy::parse_artifact(text);  // what ships must load
  const auto trained = [&](const corpus_row& r) {
    return candidate_index(memscale::policy::predict_from_features(artifact, r.x).choice);
  };
  std::ofstream(artifact_path) << text;
  {
    std::ofstream h(header_path);
    h << "// memscale — the trained Stage 1 policy that ships in the headers. Generated by\n"
         "// `memscale_policy train` (scripts/regenerate-policy.sh) from benchmarks/policy/dataset.csv\n"
         "// (" << hash << "); do not edit: regenerate.\n#pragma once\n\n#include <string_view>\n\n"
         "namespace memscale::policy {\n\ninline constexpr std::string_view shipped_artifact_text = R\"memscale("
      << text << ")memscale\";\n\n}  // namespace memscale::policy\n";
  }
  std::ostringstream eval;
  eval << "Dataset: `" << dataset << "` (" << rows.size() << " rows, " << hash << "); " << header.substr(2) << ".\n\n"
       << "Held out (the largest size of each family):";
  for (const auto& [family, size] : largest) eval << ' ' << family << " size " << size;
  eval << "; " << train.size() << " rows train, " << test.size() << " rows test.\n\n"
       << "| policy | rows | fits | fit rate | mean regret (fitting rows) | worst regret | nothing fits: lowest-peak choice |\n|---|---|---|---|---|---|---|\n";
  const auto line = [&](const std::string& name, const score& s) {
    eval << "| " << name << " | " << s.rows << " | " << s.fits << " | " << std::fixed << std::setprecision(3)
         << static_cast<double>(s.fits) / s.rows << " | "
         << (s.regret_rows ? s.regret_sum / s.regret_rows : 0.0) << "x | " << s.regret_worst << "x | " << s.pressed
         << " of " << s.infeasible << " |\n";
  };
  for (const auto& [name, set] : {std::pair<std::string, const std::vector<const corpus_row*>*>{"test", &test},
                                  {"train", &train}}) {
    line("trained (" + name + ")", score_of(*set, trained));
    line("rule (" + name + ")", score_of(*set, [](const corpus_row& r) { return r.rule; }));
    for (std::size_t k = 0; k < classes; ++k)
      line(memscale::to_string(memscale::strategy_candidates[k]) + " (" + name + ")",
           score_of(*set, [k](const corpus_row&) { return static_cast<int>(k); }));
    line("best (" + name + ")", score_of(*set, best_of));
  }
  // A second split, by family: fitted on the other two families, scored on the one
  // left out (each family in turn); the rule policy and Conservative beside it.
  eval << "\nLeave one family out (fitted on the other two families, scored on this one):\n\n"
       << "| policy | rows | fits | fit rate | mean regret (fitting rows) | worst regret | nothing fits: lowest-peak choice |\n|---|---|---|---|---|---|---|\n";
  for (const auto& [family, size] : largest) {
    (void)size;
    std::vector<const corpus_row*> others, own;
    for (const auto& r : rows) (r.s.family == family ? own : others).push_back(&r);
    const auto a = train_softmax(others);
    line("trained (" + family + ")", score_of(own, [&](const corpus_row& r) {
           return candidate_index(memscale::policy::predict_from_features(a, r.x).choice);
         }));
    line("rule (" + family + ")", score_of(own, [](const corpus_row& r) { return r.rule; }));
    line("Conservative (" + family + ")", score_of(own, [](const corpus_row&) { return 0; }));
    line("best (" + family + ")", score_of(own, best_of));
  }
  std::ofstream(evaluation_path) << eval.str();
  std::cout << eval.str();
  return 0;
}

}  // namespace policy_tool

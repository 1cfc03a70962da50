// memscale — the trained Stage 1 policy: a softmax-linear classifier from
// StrategyContext::features() to strategy_candidates, read from a small text
// artifact (the one shipped in the headers, or Config::policy_artifact's). Every
// way it can be unavailable (no artifact, unreadable, truncated, corrupt, fitted
// on another feature schema or candidate list) throws PolicyFallbackNeeded with
// the reason; Stage 1 catches it and uses the rule policy (rule_fallback).
//
// The artifact, whitespace-separated tokens:
//   memscale-policy 1
//   schema <StrategyContext::schema_version> classes <n> features <m>
//   dataset <hash of the dataset it was fitted on>
//   mean <m numbers> scale <m numbers>      (the features' standardization)
//   weights <n rows of m weights then a bias>
// (format_artifact writes it.)
#pragma once

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <istream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <memscale/errors.hpp>
#include <memscale/policy/decision.hpp>
#include <memscale/policy/shipped_artifact.hpp>

namespace memscale::policy {

inline constexpr std::string_view artifact_magic = "memscale-policy";
inline constexpr int artifact_version = 1;
/// An artifact is a few kB; anything larger is not one (and is not read into memory).
inline constexpr std::size_t artifact_max_bytes = 1 << 20;

struct trained_artifact {
  std::string dataset;  ///< the hash of the dataset it was fitted on
  std::array<double, StrategyContext::feature_count> mean{}, scale{};
  std::array<std::array<double, StrategyContext::feature_count + 1>, strategy_candidates.size()> weights{};
};

namespace artifact_text {

[[noreturn]] inline void unusable(const std::string& what) {
  throw PolicyFallbackNeeded("the trained policy's artifact " + what);
}

inline void expect_word(std::istream& in, std::string_view word) {
  std::string got;
  if (!(in >> got)) unusable("ends before '" + std::string(word) + "'");
  if (got != word) unusable("has '" + got.substr(0, 40) + "' where '" + std::string(word) + "' belongs");
}

inline double read_number(std::istream& in, std::string_view what) {
  std::string token;
  if (!(in >> token)) unusable("ends inside its " + std::string(what));
  // from_chars: the C locale's format whatever the process's LC_NUMERIC says.
  const char* first = token.data() + (token.size() > 1 && token[0] == '+' ? 1 : 0);
  double value = 0.0;
  const auto [end, error] = std::from_chars(first, token.data() + token.size(), value);
  if (error != std::errc{} || end != token.data() + token.size() || !std::isfinite(value))
    unusable("has '" + token.substr(0, 40) + "' in its " + std::string(what) + " (not a finite number)");
  return value;
}

inline long read_int(std::istream& in, std::string_view what) {
  const double value = read_number(in, what);
  if (value != std::floor(value) || std::fabs(value) > 1e9)
    unusable("has " + std::to_string(value) + " for its " + std::string(what) + " (not a small integer)");
  return static_cast<long>(value);
}

}  // namespace artifact_text

/// Parses an artifact's text; throws PolicyFallbackNeeded naming what is wrong.
[[nodiscard]] inline trained_artifact parse_artifact(std::string_view text) {
  if (text.size() > artifact_max_bytes) artifact_text::unusable("is larger than " + std::to_string(artifact_max_bytes) + " bytes");
  std::istringstream in{std::string(text)};
  artifact_text::expect_word(in, artifact_magic);
  if (const auto v = artifact_text::read_int(in, "format version"); v != artifact_version)
    artifact_text::unusable("is format version " + std::to_string(v) + "; this memscale reads version " +
                     std::to_string(artifact_version));
  artifact_text::expect_word(in, "schema");
  if (const auto v = artifact_text::read_int(in, "feature schema"); v != StrategyContext::schema_version)
    artifact_text::unusable("was fitted on feature schema " + std::to_string(v) + "; this memscale computes schema " +
                     std::to_string(StrategyContext::schema_version));
  artifact_text::expect_word(in, "classes");
  if (const auto n = artifact_text::read_int(in, "class count"); n != static_cast<long>(strategy_candidates.size()))
    artifact_text::unusable("has " + std::to_string(n) + " classes; this memscale chooses among " +
                     std::to_string(strategy_candidates.size()) + " strategies");
  artifact_text::expect_word(in, "features");
  if (const auto m = artifact_text::read_int(in, "feature count"); m != static_cast<long>(StrategyContext::feature_count))
    artifact_text::unusable("has " + std::to_string(m) + " features; schema " +
                     std::to_string(StrategyContext::schema_version) + " has " +
                     std::to_string(StrategyContext::feature_count));
  trained_artifact a;
  artifact_text::expect_word(in, "dataset");
  if (!(in >> a.dataset)) artifact_text::unusable("ends before its dataset hash");
  if (a.dataset.size() > 64 || !std::all_of(a.dataset.begin(), a.dataset.end(), [](char ch) {
        return std::isalnum(static_cast<unsigned char>(ch)) || ch == '-' || ch == '_' || ch == '.';
      }))
    artifact_text::unusable("has a dataset hash that is not 1-64 letters, digits, '-', '_' or '.'");
  artifact_text::expect_word(in, "mean");
  for (auto& v : a.mean) v = artifact_text::read_number(in, "feature means");
  artifact_text::expect_word(in, "scale");
  for (auto& v : a.scale) {
    v = artifact_text::read_number(in, "feature scales");
    if (!(v > 0.0)) artifact_text::unusable("has a feature scale <= 0");
  }
  artifact_text::expect_word(in, "weights");
  for (auto& row : a.weights)
    for (auto& w : row) w = artifact_text::read_number(in, "weights");
  if (std::string extra; in >> extra) artifact_text::unusable("has text after its weights ('" + extra.substr(0, 40) + "')");
  return a;
}

/// The artifact's text, what parse_artifact reads back (every number to 17
/// significant digits, so the weights come back exactly).
[[nodiscard]] inline std::string format_artifact(const trained_artifact& a) {
  std::ostringstream os;
  os << std::setprecision(17) << artifact_magic << ' ' << artifact_version << "\nschema "
     << StrategyContext::schema_version << " classes " << strategy_candidates.size() << " features "
     << StrategyContext::feature_count << "\ndataset " << a.dataset << "\nmean";
  for (double v : a.mean) os << ' ' << v;
  os << "\nscale";
  for (double v : a.scale) os << ' ' << v;
  os << "\nweights\n";
  for (const auto& row : a.weights) {
    for (std::size_t f = 0; f < row.size(); ++f) os << (f ? " " : "") << row[f];
    os << "\n";
  }
  return os.str();
}

/// Reads and parses the artifact at `path`.
[[nodiscard]] inline trained_artifact load_artifact(const std::string& path) {
  // Only a regular file: a FIFO or a terminal would block the read, a directory misleads.
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    artifact_text::unusable("'" + path + "' is not a regular file" + (ec ? " (" + ec.message() + ")" : ""));
  std::ifstream file(path, std::ios::binary);
  if (!file) artifact_text::unusable("'" + path + "' cannot be opened");
  std::string text(artifact_max_bytes + 1, '\0');
  file.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<std::size_t>(file.gcount()));
  try {
    return parse_artifact(text);
  } catch (const PolicyFallbackNeeded& e) {
    throw PolicyFallbackNeeded(std::string(e.what()) + " (" + path + ")");
  }
}

/// The hash an artifact names for the dataset it was fitted on: FNV-1a (64 bits)
/// of the dataset file's bytes, as "fnv1a64-" and 16 hex digits.
[[nodiscard]] inline std::string dataset_hash(std::istream& in) {
  std::uint64_t h = 1469598103934665603ULL;
  for (char c; in.get(c);) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ULL;
  std::ostringstream os;
  os << "fnv1a64-" << std::hex << std::setw(16) << std::setfill('0') << h;
  return os.str();
}

/// The artifact shipped in the headers (policy/shipped_artifact.hpp, generated by
/// scripts/regenerate-policy.sh from benchmarks/policy/dataset.csv); a build could
/// ship none, which Stage 1 reports as rule_fallback.
[[nodiscard]] inline std::optional<std::string_view> shipped_artifact() noexcept { return shipped_artifact_text; }

/// The policy's choice for `c` and its probability.
struct predicted {
  StrategyChoice choice;
  double confidence = 0.0;
};

/// The policy's choice for the features `x` (StrategyContext::features()).
[[nodiscard]] inline predicted predict_from_features(const trained_artifact& a,
                                                     const std::array<double, StrategyContext::feature_count>& x) {
  std::array<double, strategy_candidates.size()> logits{};
  for (std::size_t k = 0; k < logits.size(); ++k) {
    double z = a.weights[k].back();
    for (std::size_t f = 0; f < x.size(); ++f) z += a.weights[k][f] * (x[f] - a.mean[f]) / a.scale[f];
    logits[k] = z;
  }
  std::size_t best = 0;
  for (std::size_t k = 1; k < logits.size(); ++k)
    if (logits[k] > logits[best]) best = k;
  double total = 0.0;
  for (double z : logits) total += std::exp(z - logits[best]);
  if (!std::isfinite(total) || !std::isfinite(logits[best]))
    throw PolicyFallbackNeeded("the trained policy's output is not finite for this run's features");
  return {strategy_candidates[best], 1.0 / total};
}

[[nodiscard]] inline predicted predict_strategy(const trained_artifact& a, const StrategyContext& c) {
  return predict_from_features(a, c.features());
}

}  // namespace memscale::policy

// memscale — the exception hierarchy every public call throws from.
// A call that throws leaves the model exactly as it was before the call.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>
#include <utility>

#include <c10/util/Exception.h>

namespace memscale {

/// Base of every error memscale throws for a user mistake or an unsupported input.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A Config field holds a value outside its valid range; the message names the field.
class ConfigError : public Error {
 public:
  ConfigError(std::string field, const std::string& message)
      : Error("memscale::Config::" + field + ": " + message), field_(std::move(field)) {}
  [[nodiscard]] const std::string& field() const noexcept { return field_; }

 private:
  std::string field_;
};

/// The model has no structure memscale can attach to (no torch::nn::Sequential).
class UnsupportedModelError : public Error {
 public:
  using Error::Error;
};

/// wrap()/optimize() on a model that memscale already manages.
class AlreadyOptimizedError : public Error {
 public:
  using Error::Error;
};

/// Profiling could not produce per-layer costs (static failed and the empirical
/// fallback was disabled or impossible).
class ProfilingError : public Error {
 public:
  using Error::Error;
};

/// Config::verify_correctness: the optimized step's loss, a gradient or a buffer
/// differs from the unoptimized step's beyond what the plan's techniques allow.
/// what_differs() names it ("parameter 'blocks.1.mlp.0.weight'", "the loss").
class CorrectnessError : public Error {
 public:
  CorrectnessError(std::string what_differs, const std::string& message)
      : Error(message), what_differs_(std::move(what_differs)) {}
  [[nodiscard]] const std::string& what_differs() const noexcept { return what_differs_; }

 private:
  std::string what_differs_;
};

/// Stage 1 policy could not decide; the caller falls back to the rule policy.
class PolicyFallbackNeeded : public Error {
 public:
  using Error::Error;
};

namespace detail {

/// An exception's message for a report note: a c10::Error's without its backtrace.
[[nodiscard]] inline std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

}  // namespace detail

}  // namespace memscale

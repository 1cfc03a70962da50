// memscale::core — Config::verify_correctness: one step of the example input
// (forward, the loss mean(output²), backward; no optimizer step) run on the
// model as it is, then with the plan applied, from the same RNG state, buffers
// and cleared gradients, and compared gradient by gradient. The model's
// gradients, buffers and the RNG state are put back afterwards. Internal: the
// executor runs it; the outcome is the Report's CorrectnessCheck.
#pragma once

#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <iomanip>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/core/plan.hpp>
#include <memscale/detail/buffers.hpp>
#include <memscale/detail/rng.hpp>
#include <memscale/errors.hpp>

namespace memscale::core::verify {

/// One step's results, in the order of the sandbox's parameters and buffers.
struct step_outcome {
  at::Tensor loss;                    ///< detached
  std::vector<at::Tensor> gradients;  ///< undefined where a parameter got none
  std::vector<at::Tensor> buffers;    ///< copies, after the step
};

/// The model's state a verification step changes (gradients, buffers, the RNG),
/// taken at construction: reset() puts it back between the two steps with the
/// gradients cleared, and the destructor restores it all, gradients included.
class sandbox {
 public:
  explicit sandbox(torch::nn::Module& root) : buffers_restore_(root) {
    for (const auto& item : root.named_parameters(/*recurse=*/true)) {
      parameter_names_.push_back(item.key());
      parameters_.push_back(item.value());
    }
    for (const auto& item : root.named_buffers(/*recurse=*/true)) {
      if (!item.value().defined()) continue;
      buffer_names_.push_back(item.key());
      buffers_.push_back(item.value());
    }
    rng_ = detail::capture_rng(detail::devices_of(parameters_));
    for (auto& p : parameters_) {
      saved_gradients_.push_back(p.grad());
      p.mutable_grad() = at::Tensor();
    }
  }
  sandbox(const sandbox&) = delete;
  sandbox& operator=(const sandbox&) = delete;
  ~sandbox() {
    try {
      unpark_gradients();
    } catch (...) {  // one it could not move back is dropped: a host gradient would fail the next backward
      for (std::size_t i = 0; i < parked_from_.size(); ++i)
        if (parked_from_[i]) saved_gradients_[i] = at::Tensor();
    }
    try {
      reset();
      for (std::size_t i = 0; i < parameters_.size(); ++i) parameters_[i].mutable_grad() = saved_gradients_[i];
    } catch (...) {  // never throw from a destructor
    }
  }

  /// The caller's gradients, set aside until the destructor puts them back.
  [[nodiscard]] const std::vector<at::Tensor>& saved_gradients() const noexcept { return saved_gradients_; }

  /// The state at construction again, with the gradients cleared.
  void reset() {
    detail::restore_rng(rng_);
    buffers_restore_.restore();
    for (auto& p : parameters_) p.mutable_grad() = at::Tensor();
  }

  /// Runs `forward` on `example` with gradients on, takes mean(output²) as the
  /// loss and runs backward; returns the loss, the gradients and the buffers.
  step_outcome run(const std::function<at::Tensor(const at::Tensor&)>& forward, const at::Tensor& example) {
    torch::AutoGradMode grad_on(true);
    const at::Tensor output = forward(example.detach());
    if (!output.defined() || !output.is_floating_point())
      throw Error("memscale: verify_correctness: the model's output is not a floating-point tensor (" +
                  (output.defined() ? std::string(c10::toString(output.scalar_type())) : std::string("undefined")) +
                  "), so there is no loss to differentiate; turn verify_correctness off for this model");
    const at::Tensor wide = output.scalar_type() == at::kDouble ? output : output.to(at::kFloat);
    const at::Tensor loss = wide.square().mean();
    if (loss.requires_grad()) loss.backward();
    step_outcome out;
    out.loss = loss.detach();
    for (auto& p : parameters_) {
      out.gradients.push_back(p.grad());
      p.mutable_grad() = at::Tensor();
    }
    torch::NoGradGuard no_grad;
    for (const auto& b : buffers_) out.buffers.push_back(b.clone());
    return out;
  }

  /// The gradients set aside, copied to the host (their device memory freed
  /// where nothing else holds them) until unpark_gradients() or the destructor
  /// puts them back on their devices, bit-identical. For a GPU trial: a
  /// training step does not hold them (its zero_grad() drops them).
  void park_gradients_on_host() {
    parked_from_.resize(saved_gradients_.size());
    for (std::size_t i = 0; i < saved_gradients_.size(); ++i) {
      auto& g = saved_gradients_[i];
      if (!g.defined() || g.is_cpu() || parked_from_[i]) continue;
      const auto device = g.device();
      g = g.to(at::kCPU);
      parked_from_[i] = device;
    }
  }
  void unpark_gradients() {  // each one tried; the first failure rethrown
    std::exception_ptr first;
    for (std::size_t i = 0; i < parked_from_.size(); ++i)
      if (parked_from_[i]) {
        try {
          saved_gradients_[i] = saved_gradients_[i].to(*parked_from_[i]);
        } catch (...) {
          if (!first) first = std::current_exception();
          continue;
        }
        parked_from_[i].reset();
      }
    if (first) std::rethrow_exception(first);
  }

  [[nodiscard]] const std::vector<std::string>& parameter_names() const noexcept { return parameter_names_; }
  [[nodiscard]] const std::vector<std::string>& buffer_names() const noexcept { return buffer_names_; }

 private:
  std::vector<std::string> parameter_names_;
  std::vector<at::Tensor> parameters_;
  std::vector<std::string> buffer_names_;
  std::vector<at::Tensor> buffers_;
  std::vector<at::Tensor> saved_gradients_;
  std::vector<std::optional<c10::Device>> parked_from_;  ///< where a gradient parked on the host came from
  detail::buffer_restore buffers_restore_;
  detail::rng_state rng_;
};

/// How two tensors of the two steps differ.
struct difference {
  bool differs = false;
  double relative = 0.0;  ///< ||optimized - unoptimized|| / ||unoptimized|| (L2); infinity if one is missing
  std::string what;       ///< for a message, when it differs
};

/// Whether the two tensors hold the same bits.
inline bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const auto x = a.detach().cpu().contiguous();
  const auto y = b.detach().cpu().contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.numel() * x.element_size()) == 0;
}

/// Compares `optimized` with `unoptimized`: bit-identical when `tolerance` is 0,
/// else within that relative L2 difference.
inline difference compare(const at::Tensor& unoptimized, const at::Tensor& optimized, double tolerance) {
  difference d;
  if (!unoptimized.defined() && !optimized.defined()) return d;
  if (unoptimized.defined() != optimized.defined()) {
    d.differs = true;
    d.relative = std::numeric_limits<double>::infinity();
    d.what = optimized.defined() ? "the optimized step produced one where the unoptimized step produced none"
                                 : "the optimized step produced none where the unoptimized step did";
    return d;
  }
  if (unoptimized.sizes() != optimized.sizes()) {
    d.differs = true;
    d.relative = std::numeric_limits<double>::infinity();
    std::ostringstream os;
    os << "shape " << optimized.sizes() << " instead of " << unoptimized.sizes();
    d.what = os.str();
    return d;
  }
  if (same_bits(unoptimized, optimized)) return d;
  if (!unoptimized.is_floating_point()) {  // integer buffers (num_batches_tracked): equal or not
    d.differs = true;
    d.relative = std::numeric_limits<double>::infinity();
    d.what = "different integer values";
    return d;
  }
  torch::NoGradGuard no_grad;
  const auto base = unoptimized.detach().to(at::kDouble);
  const auto delta = optimized.detach().to(at::kDouble) - base;
  const double norm = base.norm().item<double>();
  const double delta_norm = delta.norm().item<double>();
  const double max_abs = delta.abs().max().item<double>();
  d.relative = norm > 0.0 ? delta_norm / norm : (delta_norm > 0.0 ? std::numeric_limits<double>::infinity() : 0.0);
  if (std::isnan(d.relative)) d.relative = std::numeric_limits<double>::infinity();
  d.differs = tolerance == 0.0 || !(d.relative <= tolerance);
  std::ostringstream os;
  os << "relative L2 difference " << std::scientific << std::setprecision(3) << d.relative << ", largest |difference| "
     << max_abs;
  d.what = os.str();
  return d;
}

/// The outcome of comparing the steps, and, when they differ beyond the
/// tolerance, what differs first (parameters in order, then the loss, then buffers).
struct verdict {
  CorrectnessCheck check;
  std::optional<std::pair<std::string, std::string>> first_mismatch;  ///< (what, how)
};

inline verdict judge(const sandbox& box, const step_outcome& unoptimized, const step_outcome& optimized,
                     double tolerance, std::string tolerance_reason) {
  verdict v;
  auto& c = v.check;
  c.tolerance = tolerance;
  c.tolerance_reason = std::move(tolerance_reason);
  c.loss_baseline = unoptimized.loss.to(at::kDouble).item<double>();
  c.loss_optimized = optimized.loss.to(at::kDouble).item<double>();
  auto consider = [&](const std::string& where, const difference& d) {
    if (d.relative > c.max_relative_difference) {
      c.max_relative_difference = d.relative;
      c.largest_at = where;
    }
    if (d.differs && !v.first_mismatch) v.first_mismatch.emplace(where, d.what);
  };
  for (std::size_t i = 0; i < box.parameter_names().size(); ++i) {
    const auto& g = unoptimized.gradients[i];
    const auto& h = optimized.gradients[i];
    if (g.defined() || h.defined()) ++c.parameters;
    consider("parameter '" + box.parameter_names()[i] + "' (its gradient)", compare(g, h, tolerance));
  }
  consider("the loss", compare(unoptimized.loss, optimized.loss, tolerance));
  for (std::size_t i = 0; i < box.buffer_names().size(); ++i) {
    ++c.buffers;
    consider("buffer '" + box.buffer_names()[i] + "'", compare(unoptimized.buffers[i], optimized.buffers[i], tolerance));
  }
  c.passed = !v.first_mismatch.has_value();
  return v;
}

}  // namespace memscale::core::verify

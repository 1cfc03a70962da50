// Shared helpers for memscale's tests: small models, gradient snapshots,
// bit-exact comparisons and a quiet Config.
#pragma once

#include <array>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include <torch/torch.h>
// LibTorch pulls in glog, whose CHECK would shadow Catch2's: Catch2's must win.
#undef CHECK
#include <catch2/catch.hpp>

#include <memscale/memscale.hpp>

#include "gpt.hpp"

namespace test {

// GCC says __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__; Clang, __has_feature.
#if defined(__has_feature)
#define MEMSCALE_TEST_HAS_FEATURE(x) __has_feature(x)
#else
#define MEMSCALE_TEST_HAS_FEATURE(x) 0
#endif

/// Whether this build runs under AddressSanitizer. Its shadow memory and
/// quarantine are part of what the process holds, and it intercepts mallopt,
/// so the checks of the process's resident memory measure ASan, not memscale;
/// and it slows every operation, so plans chosen by measured times differ.
#if defined(__SANITIZE_ADDRESS__) || MEMSCALE_TEST_HAS_FEATURE(address_sanitizer)
inline constexpr bool under_address_sanitizer = true;
#else
inline constexpr bool under_address_sanitizer = false;
#endif

/// Whether this build runs under ThreadSanitizer, whose runtime starts a
/// thread of its own (so a count of the process's threads counts it).
#if defined(__SANITIZE_THREAD__) || MEMSCALE_TEST_HAS_FEATURE(thread_sanitizer)
inline constexpr bool under_thread_sanitizer = true;
#else
inline constexpr bool under_thread_sanitizer = false;
#endif
inline constexpr bool under_sanitizer = under_address_sanitizer || under_thread_sanitizer;

/// ||got - expected|| / ||expected|| (L2, in double): how far two results of
/// the same float sums in another order are apart as a whole. Element-wise
/// bounds (allclose) fail on an element that cancels to about 0, whose
/// rounding error is relative to the terms summed, not to itself.
inline double relative_difference(const torch::Tensor& got, const torch::Tensor& expected) {
  const auto e = expected.detach().to(torch::kDouble);
  const double norm = e.norm().item<double>();
  const double delta = (got.detach().to(torch::kDouble) - e).norm().item<double>();
  return norm > 0.0 ? delta / norm : delta;
}

/// Runs this test binary again in a new process (one that has run nothing
/// else) on the test spec `spec` (a case's name, commas escaped, or tags),
/// with `environment` ("NAME=value ...") before it; returns its exit status
/// and what it printed.
inline std::pair<int, std::string> run_child(const std::string& environment, const std::string& spec) {
  std::array<char, 4096> exe{};
  const auto n = ::readlink("/proc/self/exe", exe.data(), exe.size() - 1);
  REQUIRE(n > 0);
  const auto cmd = environment + " '" + std::string(exe.data(), static_cast<std::size_t>(n)) + "' '" + spec + "' 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(cmd.c_str(), "r"), ::pclose);
  REQUIRE(pipe != nullptr);
  std::string output;
  std::array<char, 4096> chunk{};
  while (const auto got = std::fread(chunk.data(), 1, chunk.size(), pipe.get())) output.append(chunk.data(), got);
  return {::pclose(pipe.release()), output};
}

/// run_child on the hidden test case `name`, which must pass and print a line
/// "RESULT a=1 b=2": its fields.
inline std::map<std::string, std::int64_t> run_child_case(const std::string& environment, const std::string& name) {
  const auto [status, output] = run_child(environment, name);
  INFO(output);
  REQUIRE(status == 0);
  std::map<std::string, std::int64_t> fields;
  const auto at = output.find("RESULT ");
  REQUIRE(at != std::string::npos);
  std::istringstream line(output.substr(at + 7, output.find('\n', at) - at - 7));
  for (std::string field; line >> field;)
    if (const auto eq = field.find('='); eq != std::string::npos)
      fields[field.substr(0, eq)] = std::stoll(field.substr(eq + 1));
  return fields;
}

/// The acceptance model: (Linear, GELU, Linear, LayerNorm, Dropout) x repeats.
inline torch::nn::Sequential flat_chain(int repeats, std::int64_t width = 64, std::int64_t hidden = 256,
                                        double dropout = 0.1) {
  torch::nn::Sequential seq;
  for (int i = 0; i < repeats; ++i) {
    seq->push_back(torch::nn::Linear(width, hidden));
    seq->push_back(torch::nn::GELU());
    seq->push_back(torch::nn::Linear(hidden, width));
    seq->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    seq->push_back(torch::nn::Dropout(dropout));
  }
  return seq;
}

/// A Sequential that can be a slot of another one: LibTorch's AnyModule needs a
/// concrete forward, so nesting takes a subclass (the documented idiom). Its
/// layers are pushed one by one, which registers them (and so their parameters
/// and buffers) with it: copying the Sequential kept its layers but not their
/// registration, and the model's parameters() missed them.
struct NestedSequentialImpl : torch::nn::SequentialImpl {
  explicit NestedSequentialImpl(const torch::nn::Sequential& from) {
    for (const auto& layer : *from) push_back(layer);
  }
  torch::Tensor forward(torch::Tensor x) { return torch::nn::SequentialImpl::forward(std::move(x)); }
};
TORCH_MODULE(NestedSequential);

inline gpt::Options small_gpt() {
  gpt::Options o;
  o.context = 64;
  o.d_model = 64;
  o.heads = 4;
  o.layers = 4;
  o.dropout = 0.1;
  return o;
}

/// Lets a test put LibTorch's base autograd engine in charge for a while (as
/// another library might) without costing the process its CUDA backwards:
/// LibTorch starts the autograd device threads for whichever engine runs the
/// process's first backward, so memscale's engine runs one first.
inline void before_replacing_the_engine() {
  auto x = torch::ones({1}, torch::requires_grad());
  (x * 2).sum().backward();
}

/// `steps` SGD steps of the loss mean(output^2) on `x`.
inline void train_sgd(torch::nn::Sequential& model, const torch::Tensor& x, int steps) {
  torch::optim::SGD opt(model->parameters(), 0.01);
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    model->forward(x).pow(2).mean().backward();
    opt.step();
  }
}

inline memscale::Config quiet(memscale::Config c = {}) {
  c.enable_logging = false;
  return c;
}

inline std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> g;
  for (const auto& p : m.parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return g;
}

inline void clear_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters()) p.mutable_grad() = torch::Tensor();
}

inline bool bit_equal(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && torch::equal(a, b);
}

inline bool bit_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!bit_equal(a[i], b[i])) return false;
  return true;
}

inline std::vector<torch::Tensor> buffer_values(torch::nn::Module& m) {
  std::vector<torch::Tensor> values;
  for (const auto& b : m.buffers()) values.push_back(b.clone());
  return values;
}

/// A model's state that verify_correctness and predict() must leave as they found it.
struct model_state {
  std::vector<torch::Tensor> parameters, gradients, buffers;
  torch::Tensor next_draw;  // what the RNG gives next

  explicit model_state(torch::nn::Module& m) : gradients(grads_of(m)), buffers(buffer_values(m)) {
    for (const auto& p : m.parameters()) parameters.push_back(p.detach().clone());
    const auto rng = memscale::detail::capture_rng();
    next_draw = torch::rand({8});
    memscale::detail::restore_rng(rng);
  }
  bool operator==(const model_state& other) const {
    return bit_equal(parameters, other.parameters) && bit_equal(gradients, other.gradients) &&
           bit_equal(buffers, other.buffers) && bit_equal(next_draw, other.next_draw);
  }
};

/// Every state tensor of an optimizer, serialized, in its groups' order: equal
/// lists mean bit-identical state.
inline std::vector<torch::Tensor> optimizer_state(const torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> out;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params()) {
      const auto it = optimizer.state().find(memscale::optim::state_key(p));
      if (it == optimizer.state().end()) continue;
      torch::serialize::OutputArchive archive;
      it->second->serialize(archive);
      std::ostringstream bytes;
      archive.save_to(bytes);
      const auto s = bytes.str();
      out.push_back(torch::from_blob(const_cast<char*>(s.data()), {static_cast<std::int64_t>(s.size())}, torch::kChar)
                        .clone());
    }
  return out;
}

/// One training step's loss and gradients, from a fixed RNG seed.
template <class Forward>
std::pair<torch::Tensor, std::vector<torch::Tensor>> step(torch::nn::Module& model, Forward&& forward,
                                                          std::uint64_t seed = 7) {
  clear_grads(model);
  torch::manual_seed(seed);
  auto loss = forward();
  loss.backward();
  return {loss.detach().clone(), grads_of(model)};
}

/// One step of `seq` under a guard with `config` that checkpoints something,
/// its loss and gradients `baseline`'s bit for bit; `during` runs with the guard
/// alive, after the step. Returns the guard's Report.
template <class Forward, class During>
memscale::Report checked_guarded_step(torch::nn::Sequential& seq, const torch::Tensor& x, const memscale::Config& config,
                                      Forward&& forward,
                                      const std::pair<torch::Tensor, std::vector<torch::Tensor>>& baseline,
                                      During&& during) {
  auto guard = memscale::optimize(seq, x, config);
  const auto optimized = step(*seq, forward);
  auto report = guard.report();
  REQUIRE(report.checkpointed_segments() > 0);
  CHECK(bit_equal(baseline.first, optimized.first));
  CHECK(bit_equal(baseline.second, optimized.second));
  during();
  return report;
}

/// A plan improved by one of the planner's second passes (choose_selective_recompute,
/// choose_saved_compaction) on six call-site units alike (one unit a run; 4 MiB in
/// and out, `saved_mib` saved, 10 ms forward, 20 ms backward), each then changed
/// by `tune(slot, k)`, at a target that frees half the growth. Checks that the
/// pass changed the plan, said so (its note starts with `note`), and that the
/// new plan reaches the target as projected on its costs.
struct improved_plan {
  std::vector<std::vector<memscale::slot_cost>> chains, costs;  ///< as made; as the pass left them
  memscale::core::engine_input in;
  memscale::core::engine_plan before, after;
};
template <class Tune, class Choose>
improved_plan improve_six_units(std::int64_t saved_mib, Tune&& tune, Choose&& choose, const std::string& note) {
  using namespace memscale::core;
  const std::int64_t MiB = 1 << 20;
  improved_plan r;
  std::vector<memscale::slot_cost> chain(6);
  for (int k = 0; k < 6; ++k) {
    auto& s = chain[static_cast<std::size_t>(k)];
    s.input_bytes = s.output_bytes = 4 * MiB;
    s.saved_bytes = saved_mib * MiB;
    s.saves_input = true;
    s.forward_seconds = 0.010;
    s.backward_seconds = 0.020;
    tune(s, k);
  }
  r.chains = {chain};
  r.in = engine_input{memscale::OptimizationMode::Balanced, true, true, 0, 0};
  r.in.segment_limit = {1};
  r.in.fixed_target = project_model_peak(r.chains, {keep_all(6)}, 0) / 2;
  r.costs = r.chains;
  r.before = decide(r.costs, {true}, r.in);
  REQUIRE(r.before.planned_peak <= r.in.fixed_target);
  r.after = r.before;
  const auto choice = choose(r.costs, std::vector<bool>{true}, r.in, r.after);
  REQUIRE(choice.changed);
  CHECK(choice.note.rfind(note, 0) == 0);
  CHECK(r.after.planned_peak <= r.in.fixed_target);
  CHECK(r.after.planned_peak == project_model_peak(r.costs, r.after.units, 0));
  return r;
}

/// The Report's note that starts with `prefix` (nullptr: none).
inline const std::string* note_starting(const memscale::Report& report, const std::string& prefix) {
  for (const auto& n : report.notes)
    if (n.rfind(prefix, 0) == 0) return &n;
  return nullptr;
}

/// One training step measured by the tracker: the loss mean(model(x)^2) and its
/// gradients after one warm-up step, without memscale or under
/// optimize(model, x, config); with a guard, its report and offload statistics.
struct measured_step {
  std::pair<torch::Tensor, std::vector<torch::Tensor>> result;
  std::int64_t peak_growth = 0;
  memscale::Report report;
  std::optional<memscale::offload::engine_stats> offload;
  static constexpr int steps = 2;  ///< steps the guard saw: the warm-up and the measured one
};

template <class Model>
measured_step measure_step(Model& model, const torch::Tensor& x, const std::optional<memscale::Config>& config) {
  memscale::memory_tracker::install();
  std::optional<memscale::OptimizationGuard> guard;
  if (config) guard.emplace(memscale::optimize(model, x, *config));
  auto loss = [&] { return model->forward(x).pow(2).mean(); };
  (void)step(*model, loss);  // warm-up: allocator, lazily created state
  if (x.requires_grad()) x.mutable_grad() = torch::Tensor();
  measured_step run;
  {
    memscale::memory_tracker::peak_scope scope;
    run.result = step(*model, loss);
    run.peak_growth = scope.peak_growth();
  }
  if (guard) {
    run.report = guard->report();
    run.offload = guard->offload_stats();
  }
  return run;
}

/// What identifies a model's state: parameter names and tensor identities.
inline std::vector<std::pair<std::string, const void*>> parameter_identity(torch::nn::Module& m) {
  std::vector<std::pair<std::string, const void*>> ids;
  for (const auto& item : m.named_parameters()) ids.emplace_back(item.key(), item.value().unsafeGetTensorImpl());
  for (const auto& item : m.named_buffers()) ids.emplace_back(item.key(), item.value().unsafeGetTensorImpl());
  return ids;
}

/// The module objects in each slot of a Sequential.
inline std::vector<const void*> slot_identity(torch::nn::SequentialImpl& seq) {
  std::vector<const void*> ids;
  for (const auto& slot : seq) ids.push_back(slot.ptr().get());
  return ids;
}

}  // namespace test

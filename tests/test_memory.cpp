// The tracker's two CPU sources (a reporting scope that replaces nothing, the
// opt-in counting allocator), a program's own CPU allocator surviving wrap, and
// measured savings: Aggressive halves a step's peak memory growth (profiling and
// planning included), Balanced keeps the measured peak within an explicit
// budget, and the planner's estimate tracks measurement.
#include "test_support.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/autograd/profiler_legacy.h>

#include <memscale/core/optimal_chain.hpp>
#include <memscale/device/code_pages.hpp>
#include <memscale/device/scratch_pages.hpp>

using memscale::OptimizationMode;
using memscale::memory_tracker;

namespace {

/// A program's own CPU allocator, counting its allocations. `Delegating`: it
/// allocates through c10::GetDefaultCPUAllocator(), which reports to LibTorch's
/// memory profiler; else straight from c10::alloc_cpu, which does not.
template <bool Delegating>
class program_cpu_allocator final : public c10::Allocator {
 public:
  // 1.13 declares allocate() const, 2.x non-const (see memscale's counting allocator).
  c10::DataPtr allocate(std::size_t bytes) const { return counted(bytes); }
  c10::DataPtr allocate(std::size_t bytes) { return counted(bytes); }
  c10::DeleterFnPtr raw_deleter() const override {
    return Delegating ? c10::GetDefaultCPUAllocator()->raw_deleter() : &release;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const {
    if (count != 0) std::memcpy(dest, src, count);
  }

  static inline std::atomic<std::int64_t> allocations{0};

  static program_cpu_allocator& instance() {
    static auto* self = new program_cpu_allocator();  // its blocks may outlive the test
    return *self;
  }

 private:
  static void release(void* data) { c10::free_cpu(data); }

  c10::DataPtr counted(std::size_t bytes) const {
    allocations.fetch_add(1);
    if constexpr (Delegating) return c10::GetDefaultCPUAllocator()->allocate(bytes);
    void* data = bytes == 0 ? nullptr : c10::alloc_cpu(bytes);
    return c10::DataPtr(data, data, &release, c10::Device(c10::kCPU));
  }
};
using silent_allocator = program_cpu_allocator<false>;
using reporting_allocator = program_cpu_allocator<true>;

/// Makes `allocator` LibTorch's CPU allocator as a program would (SetCPUAllocator
/// at a priority of its choosing), and puts the previous one back afterwards.
class cpu_allocator_installed {
 public:
  static constexpr std::uint8_t priority = 100;
  explicit cpu_allocator_installed(c10::Allocator* allocator) : previous_(c10::GetCPUAllocator()) {
    c10::SetCPUAllocator(allocator, priority);
  }
  cpu_allocator_installed(const cpu_allocator_installed&) = delete;
  cpu_allocator_installed& operator=(const cpu_allocator_installed&) = delete;
  ~cpu_allocator_installed() { c10::SetCPUAllocator(previous_, priority); }

 private:
  c10::Allocator* previous_;
};

/// A program's own memory reporter in the PROFILER_STATE slot (as its own profiler would put there).
class program_reporter final : public c10::MemoryReportingInfoBase {
 public:
  void reportMemoryUsage(void* /*ptr*/, std::int64_t alloc_size, memscale::detail::report_total_t /*allocated*/,
                         memscale::detail::report_total_t /*reserved*/, c10::Device device) override {
    if (!device.is_cpu()) return;
    live += alloc_size;
    ++reports;
  }
  [[nodiscard]] bool memoryProfilingEnabled() const override { return enabled; }

  std::atomic<bool> enabled{true};
  std::atomic<std::int64_t> live{0};
  std::atomic<int> reports{0};
};

c10::DebugInfoBase* profiler_slot() {
  return c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE);
}

struct ExpScaleImpl : torch::nn::Module {  // no static rule: must be measured
  torch::Tensor forward(torch::Tensor x) { return torch::exp(x) * 2.0; }
};
TORCH_MODULE(ExpScale);

template <class Allocator>
void check_allocator_survives_wrap() {
  auto& allocator = Allocator::instance();
  cpu_allocator_installed installed(&allocator);
  REQUIRE(c10::GetCPUAllocator() == &allocator);
  torch::manual_seed(15);
  auto model = test::flat_chain(3, 64, 256, 0.1);
  auto x = torch::randn({8, 32, 64});
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto train = [&](int steps) {
    for (int i = 0; i < steps; ++i) {
      optimizer.zero_grad();
      model->forward(x).pow(2).mean().backward();
      optimizer.step();
    }
  };
  {
    auto guard = memscale::optimize(model, x, test::quiet({.mode = OptimizationMode::Aggressive}));
    CHECK(c10::GetCPUAllocator() == &allocator);
    CHECK_FALSE(memory_tracker::installed());
    CHECK(guard.report().checkpointed_segments() >= 1);  // planned and applied at wrap
    const auto before = Allocator::allocations.load();
    train(3);
    CHECK(Allocator::allocations.load() > before);
    CHECK(c10::GetCPUAllocator() == &allocator);
  }
  CHECK_FALSE(memscale::is_optimized(model));
  CHECK(c10::GetCPUAllocator() == &allocator);
  const auto before = Allocator::allocations.load();
  train(1);
  CHECK(Allocator::allocations.load() > before);
  CHECK(c10::GetCPUAllocator() == &allocator);
}

}  // namespace

TEST_CASE("wrap, training and detach leave the program's own CPU allocator in place and counting", "[memory]") {
  SECTION("an allocator that does not report to LibTorch's memory profiler") {
    check_allocator_survives_wrap<silent_allocator>();
  }
  SECTION("an allocator that delegates to LibTorch's default one") {
    check_allocator_survives_wrap<reporting_allocator>();
  }
}

TEST_CASE("a reporting scope counts CPU bytes without replacing the CPU allocator", "[memory]") {
  cpu_allocator_installed default_allocator(c10::GetDefaultCPUAllocator());  // whatever earlier tests installed
  REQUIRE_FALSE(memory_tracker::installed());
  REQUIRE(profiler_slot() == nullptr);
  auto earlier = torch::empty({1 << 16}, torch::kFloat);  // 256 KiB, before the scope
  {
    memory_tracker::reporting_scope scope;
    REQUIRE(scope.active());
    {
      auto t = torch::empty({1024, 1024}, torch::kFloat);  // 4 MiB
      CHECK(scope.current_bytes() == 4 << 20);
      CHECK(memory_tracker::current_bytes() == 4 << 20);  // the tracker reads the innermost scope
    }
    CHECK(scope.current_bytes() == 0);
    CHECK(scope.peak_bytes() == 4 << 20);
    CHECK(scope.allocated_bytes() == 4 << 20);
    earlier = torch::Tensor();  // allocated before the scope: its free is not the scope's
    CHECK(scope.current_bytes() == 0);
    {
      memory_tracker::peak_scope peak;
      memory_tracker::reporting_scope inner;
      auto t = torch::empty({1 << 18}, torch::kFloat);  // 1 MiB
      CHECK(inner.current_bytes() == 1 << 20);
      CHECK(scope.current_bytes() == 1 << 20);  // nested scopes compose
      CHECK(memory_tracker::current_bytes() == 1 << 20);
      t = torch::Tensor();
      CHECK(scope.current_bytes() == 0);
      CHECK(peak.peak_growth() == 1 << 20);
    }
    CHECK(scope.peak_bytes() == 4 << 20);  // the inner peak_scope did not hide the outer peak
  }
  CHECK(c10::GetCPUAllocator() == c10::GetDefaultCPUAllocator());
  CHECK(profiler_slot() == nullptr);
  CHECK_THROWS_AS(memory_tracker::current_bytes(), memscale::Error);  // neither source: no silent zero
}

TEST_CASE("a reporting scope passes every report on to the reporter it shadows", "[memory]") {
  cpu_allocator_installed default_allocator(c10::GetDefaultCPUAllocator());
  auto program = std::make_shared<program_reporter>();
  c10::DebugInfoGuard program_scope(c10::DebugInfoKind::PROFILER_STATE, program);
  auto earlier = torch::empty({1 << 16}, torch::kFloat);  // 256 KiB, seen by the program's reporter only
  CHECK(program->live == 1 << 18);
  {
    memory_tracker::reporting_scope scope;
    REQUIRE(scope.active());
    CHECK(profiler_slot() != program.get());
    auto t = torch::empty({1024, 1024}, torch::kFloat);  // 4 MiB
    CHECK(scope.current_bytes() == 4 << 20);
    CHECK(program->live == (1 << 18) + (4 << 20));
    earlier = torch::Tensor();  // the program's reporter knew this block: it hears of the free
    CHECK(program->live == 4 << 20);
    CHECK(scope.current_bytes() == 4 << 20);
    t = torch::Tensor();
    CHECK(program->live == 0);
    CHECK(scope.current_bytes() == 0);
    // With its memory profiling off the program's reporter hears nothing, as without
    // memscale, not even the free of a block allocated meanwhile; memscale still counts.
    const int reports = program->reports;
    program->enabled = false;
    auto u = torch::empty({1024}, torch::kFloat);
    CHECK(scope.current_bytes() == 4096);
    program->enabled = true;
    u = torch::Tensor();
    CHECK(scope.current_bytes() == 0);
    CHECK(program->reports == reports);
    CHECK(program->live == 0);
  }
  CHECK(profiler_slot() == program.get());
}

TEST_CASE("a reporting scope never shadows a LibTorch profiler, profiling then says what it did not measure",
          "[memory][profiler]") {
  cpu_allocator_installed default_allocator(c10::GetDefaultCPUAllocator());
  torch::nn::Sequential seq(torch::nn::Linear(16, 16), ExpScale(), torch::nn::Linear(16, 16));
  std::vector<torch::nn::AnyModule> slots(seq->begin(), seq->end());
  auto x = torch::randn({4, 16});
  torch::autograd::profiler::TLSLegacyProfilerGuard profiler(torch::profiler::impl::ProfilerConfig(
      torch::profiler::impl::ProfilerState::CPU, /*report_input_shapes=*/false, /*profile_memory=*/true));
  auto* state = profiler_slot();
  REQUIRE(state != nullptr);
  {
    memory_tracker::reporting_scope scope;
    CHECK_FALSE(scope.active());
    CHECK_THAT(scope.inactive_reason(), Catch::Contains("profiler"));
    CHECK(profiler_slot() == state);
    auto t = torch::empty({1024}, torch::kFloat);
    CHECK(scope.allocated_bytes() == 0);
  }
  const auto profile = memscale::core::profile_chain("", slots, x, {true, true, 1, true});
  CHECK(profiler_slot() == state);
  REQUIRE(profile.sources.at(1) == memscale::profile_source::empirical);
  CHECK(profile.slots[1].saved_bytes == 4 * 16 * 4);  // exp's result, from autograd's saved tensors
  REQUIRE(profile.caveats.size() == 1);
  CHECK_THAT(profile.caveats[0], Catch::Contains("1 (") && Catch::Contains("LibTorch profiler"));
}

TEST_CASE("with a CPU allocator that does not report, profiling falls back and the Report says so",
          "[memory][profiler]") {
  auto& allocator = silent_allocator::instance();
  cpu_allocator_installed installed(&allocator);
  torch::nn::Sequential seq(torch::nn::Linear(16, 16), ExpScale(), torch::nn::Linear(16, 16));
  std::vector<torch::nn::AnyModule> slots(seq->begin(), seq->end());
  auto x = torch::randn({4, 16});
  using memscale::profile_source;
  const std::vector<profile_source> rules_then_measured{profile_source::static_rule, profile_source::empirical,
                                                        profile_source::static_rule};

  const auto mixed = memscale::core::profile_chain("", slots, x, {true, true, 1, true});
  CHECK((mixed.sources == rules_then_measured));
  CHECK(mixed.slots[1].output_bytes == 4 * 16 * 4);
  CHECK(mixed.slots[1].saved_bytes == 4 * 16 * 4);  // exp's result, from autograd's saved tensors
  CHECK_FALSE(mixed.slots[1].saves_input);
  CHECK_FALSE(mixed.slots[1].saves_output);
  REQUIRE(mixed.caveats.size() == 1);
  CHECK_THAT(mixed.caveats[0], Catch::Contains("1 (") && Catch::Contains("ExpScaleImpl") &&
                                   Catch::Contains("does not report"));

  // Static profiling off: the Linear layers' bytes come from their rules all the same, not from zeros.
  const auto measured = memscale::core::profile_chain("", slots, x, {false, true, 1, true});
  CHECK((measured.sources == rules_then_measured));
  CHECK(measured.slots[0].saved_bytes == mixed.slots[0].saved_bytes);
  CHECK(measured.slots[0].saves_input == mixed.slots[0].saves_input);
  REQUIRE(measured.caveats.size() == 1);
  CHECK_THAT(measured.caveats[0], Catch::Contains("0 (") && Catch::Contains("2 ("));

  auto guard = memscale::optimize(seq, x, test::quiet({.use_static_profiling = false}));
  CHECK_THAT(guard.report().str(), Catch::Contains("note: memory of slot(s)") && Catch::Contains("does not report"));
  CHECK(c10::GetCPUAllocator() == &allocator);
}

TEST_CASE("the tracker counts live and peak CPU bytes", "[memory]") {
  memory_tracker::install();
  REQUIRE(memory_tracker::installed());
  const auto before = memory_tracker::current_bytes();
  memory_tracker::peak_scope scope;
  {
    auto t = torch::empty({1 << 20}, torch::kFloat);  // 4 MiB
    CHECK(memory_tracker::current_bytes() - before == 4 << 20);
  }
  CHECK(memory_tracker::current_bytes() == before);
  CHECK(scope.peak_growth() == 4 << 20);
  {
    memory_tracker::peak_scope inner;
    auto t = torch::empty({1 << 18}, torch::kFloat);
    CHECK(inner.peak_growth() == 1 << 20);
  }
  CHECK(scope.peak_growth() == 4 << 20);  // the inner scope did not hide the outer peak
}

TEST_CASE("allocation failures are told from other errors, a CUDA library's own included", "[memory][oom]") {
  const c10::SourceLocation here{"test", __FILE__, __LINE__};
  const auto error = [&](const std::string& what) { return c10::Error(here, what); };
  using memscale::detail::is_out_of_memory;
  CHECK(is_out_of_memory(c10::OutOfMemoryError(here, "anything")));
  CHECK(is_out_of_memory(error("CUDA out of memory. Tried to allocate 2.00 GiB")));
  CHECK(is_out_of_memory(error("CUDA error: out of memory")));
  CHECK(is_out_of_memory(error("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")));
  CHECK(is_out_of_memory(error("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")));
  CHECK(is_out_of_memory(error("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")));
  CHECK(is_out_of_memory(error("cuFFT error: CUFFT_ALLOC_FAILED")));
  CHECK_FALSE(is_out_of_memory(error("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm`")));
  CHECK_FALSE(is_out_of_memory(error("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)")));
}

TEST_CASE("a hard limit makes a CPU allocation past it throw c10::OutOfMemoryError, and a step survives it",
          "[memory][oom]") {
  memory_tracker::install();
  CHECK_FALSE(memory_tracker::hard_limit().has_value());
  CHECK_THROWS_WITH(memory_tracker::hard_limit_scope(-1), Catch::Contains("must be >= 0"));
  const auto before = memory_tracker::current_bytes();
  {
    memory_tracker::hard_limit_scope limit(before + (2 << 20));
    CHECK(memory_tracker::hard_limit() == before + (2 << 20));
    CHECK_NOTHROW(torch::empty({1 << 18}, torch::kFloat));  // 1 MiB fits
    try {
      (void)torch::empty({1 << 20}, torch::kFloat);  // 4 MiB does not
      FAIL("the hard limit let 4 MiB through");
    } catch (const c10::OutOfMemoryError& e) {
      CHECK_THAT(e.what_without_backtrace(), Catch::Contains("CPU out of memory") && Catch::Contains("4194304"));
    }
    {
      memory_tracker::hard_limit_scope wider(before + (8 << 20));
      CHECK_NOTHROW(torch::empty({1 << 20}, torch::kFloat));
    }
    CHECK(memory_tracker::hard_limit() == before + (2 << 20));  // the inner scope restored it
    CHECK(memory_tracker::current_bytes() == before);
  }
  CHECK_FALSE(memory_tracker::hard_limit().has_value());
  CHECK_NOTHROW(torch::empty({1 << 20}, torch::kFloat));

  // A training step that runs out mid-way: the error reaches the caller, and
  // once the caller lets go of the step, everything it held is freed.
  torch::manual_seed(2);
  auto seq = test::flat_chain(2);
  const auto x = torch::randn({256, 64});
  const auto live = memory_tracker::current_bytes();
  {
    memory_tracker::hard_limit_scope limit(live + (1 << 20));
    CHECK_THROWS_AS(seq->forward(x).sum().backward(), c10::OutOfMemoryError);
  }
  test::clear_grads(*seq);
  CHECK(memory_tracker::current_bytes() == live);
  CHECK_NOTHROW(seq->forward(x).sum().backward());
}

namespace {

struct measured_step {
  std::int64_t peak_growth;
  std::pair<torch::Tensor, std::vector<torch::Tensor>> result;
};

template <class Model, class Forward>
measured_step measure(Model& model, Forward&& forward, const std::function<void()>& before_step = {}) {
  test::clear_grads(*model);
  memory_tracker::peak_scope scope;
  if (before_step) before_step();  // wrap(): profiling and planning count too
  auto result = test::step(*model, forward);
  return {scope.peak_growth(), std::move(result)};
}

}  // namespace

TEST_CASE("Aggressive halves the step's peak memory growth on the flat primitive chain", "[memory][acceptance]") {
  memory_tracker::install();
  torch::manual_seed(10);
  auto reference = test::flat_chain(6, 256, 1024, 0.1);
  torch::manual_seed(10);
  auto model = test::flat_chain(6, 256, 1024, 0.1);
  auto x = torch::randn({16, 64, 256}, torch::requires_grad());
  auto loss = [&](torch::nn::Sequential& m) { return [&] { return m->forward(x).pow(2).mean(); }; };

  const auto baseline = measure(reference, loss(reference));
  x.mutable_grad() = torch::Tensor();  // both runs allocate the input's gradient
  std::optional<memscale::OptimizationGuard> guard;
  const auto optimized = measure(model, loss(model), [&] {
    guard.emplace(memscale::optimize(model, x, test::quiet({.mode = OptimizationMode::Aggressive})));
  });
  INFO("baseline " << baseline.peak_growth << " B, memscale (with profiling) " << optimized.peak_growth << " B\n"
                   << guard->report());
  CHECK(guard->report().checkpointed_segments() >= 3);
  CHECK(optimized.peak_growth <= baseline.peak_growth / 2);
  CHECK(test::bit_equal(baseline.result.first, optimized.result.first));
  CHECK(test::bit_equal(baseline.result.second, optimized.result.second));
}

TEST_CASE("Aggressive halves the step's peak memory growth on the example GPT", "[memory][acceptance]") {
  memory_tracker::install();
  gpt::register_memscale_rule();
  gpt::Options options;
  options.context = 128;
  options.d_model = 128;
  options.layers = 6;
  torch::manual_seed(11);
  gpt::GPT reference(options);
  torch::manual_seed(11);
  gpt::GPT model(options);
  auto tokens = torch::randint(256, {8, 128}, torch::kLong);
  auto targets = torch::randint(256, {8, 128}, torch::kLong);
  auto loss = [&](gpt::GPT& m) { return [&] { return gpt::loss(m->forward(tokens), targets); }; };

  const auto baseline = measure(reference, loss(reference));
  std::optional<memscale::OptimizationGuard> guard;
  const auto optimized = measure(model, loss(model), [&] {
    guard.emplace(memscale::optimize(model, tokens, test::quiet({.mode = OptimizationMode::Aggressive})));
  });
  INFO("baseline " << baseline.peak_growth << " B, memscale (with profiling) " << optimized.peak_growth << " B\n"
                   << guard->report());
  CHECK(guard->report().checkpointed_segments() >= options.layers - 1);
  CHECK(optimized.peak_growth <= baseline.peak_growth / 2);
  CHECK(test::bit_equal(baseline.result.first, optimized.result.first));
  CHECK(test::bit_equal(baseline.result.second, optimized.result.second));
}

namespace {

/// Peak bytes of training steps with AdamW, counting the model, its gradients
/// and optimizer state: everything allocated since `origin`.
template <class Model, class Loss>
std::int64_t train_peak(Model& model, Loss&& loss, std::int64_t origin, int steps) {
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  std::int64_t peak = 0;
  for (int i = 0; i < steps; ++i) {
    memory_tracker::peak_scope scope;
    optimizer.zero_grad();
    loss().backward();
    optimizer.step();
    peak = std::max(peak, scope.peak() - origin);
  }
  return peak;
}

/// How many of the Report's notes say the budget is out of reach.
std::int64_t out_of_reach_notes(const memscale::Report& report) {
  return std::count_if(report.notes.begin(), report.notes.end(), [](const std::string& n) {
    return n.rfind(memscale::core::unreachable_budget_note, 0) == 0;
  });
}

/// Trains the baseline, then memscale under a budget of `fraction` of the
/// baseline's total peak. The budget must bind (pressure above 1) and leave
/// room for a plan: the plan's projected peak fits it, so the measured checks
/// test the plan, not a projection that happened to be pessimistic.
template <class MakeModel, class MakeLoss>
void check_balanced_budget(MakeModel&& make_model, MakeLoss&& make_loss, const torch::Tensor& example,
                           double fraction = 0.6) {
  memory_tracker::install();
  memscale::fix_malloc_mmap_threshold();  // freed blocks go back to the system: the process's figures hold
  constexpr double gib = 1024.0 * 1024.0 * 1024.0;
  std::int64_t baseline_total = 0;
  {
    const auto origin = memory_tracker::current_bytes();
    auto reference = make_model();
    baseline_total = train_peak(reference, make_loss(reference), origin, 2);
  }
  const auto budget = static_cast<std::int64_t>(fraction * static_cast<double>(baseline_total));
  const auto origin = memory_tracker::current_bytes();
  memory_tracker::process_peak_scope process;  // what the process holds, the allocator's share included
  auto model = make_model();
  memscale::Config cfg = test::quiet({.mode = OptimizationMode::Balanced});
  cfg.memory_budget_gb = static_cast<double>(budget) / gib;
  std::int64_t measured = 0;
  memscale::Report report;
  {
    memory_tracker::peak_scope planning;
    auto guard = memscale::optimize(model, example, cfg);
    report = guard.report();
    measured = train_peak(model, make_loss(model), origin, 2);
    measured = std::max(measured, planning.peak() - origin);
  }
  const auto process_growth = process.peak_growth();
  INFO("baseline total " << baseline_total << " B, budget " << budget << " B, measured " << measured
                         << " B, process " << process_growth << " B\n"
                         << report);
  CHECK(report.plan.pressure > 1.0);  // the budget really binds
  CHECK(report.checkpointed_segments() > 0);
  CHECK(report.planned_peak_bytes() < report.baseline_peak_bytes());
  // Under ASan the plan's static bytes count ASan's shadow and quarantine as
  // held outside the allocator (28 MiB of the flat chain's 76 on a 6.18 kernel,
  // 2026-11-28): the budget may then be one no plan meets, which the Report says.
  if (test::under_address_sanitizer && report.planned_peak_bytes() > budget) {
    CHECK(out_of_reach_notes(report) >= 1);
    return;
  }
  REQUIRE(report.planned_peak_bytes() <= budget);  // a budget the plan can meet, as projected
  // Where some plan reaches the target (the optimal DP says so), the rules reach it too.
  const auto optimum = memscale::core::optimal_segmentation(report.chains.at(0).slots,
                                                            report.plan.target_bytes - report.static_bytes());
  if (optimum.feasible) CHECK(report.planned_peak_bytes() <= report.plan.target_bytes);
  CHECK(measured <= budget);
  // What the process holds stays within the budget too (this process has run
  // the baseline: BLAS and oneDNN buffers made at first use exist already).
  if (test::under_address_sanitizer) return;  // the process's figure is ASan's (test_support.hpp)
  if (!process.active()) {
    WARN("/proc/self/clear_refs cannot reset the resident high-water mark here: the process's growth is unknown");
    return;
  }
  CHECK(process_growth <= budget);
}

}  // namespace

// At 60% of the baseline the flat chain's budget sat at the edge of what any
// plan reaches: its static bytes (parameters, gradients, AdamW's state) are 48
// MiB of the 71, and Balanced's lowest plan projects 66 MiB. On LibTorch 2.14
// the baseline measures 10% less (111 against 124 MB), the budget fell to 64
// MiB, below that plan, and the process's growth passed it by 0.1-0.3% in most
// runs (2026-11-26). At 75% both versions leave the plan room.
TEST_CASE("Balanced under a budget keeps the measured peak within it: flat chain", "[memory][acceptance]") {
  auto x = torch::randn({16, 64, 256});
  check_balanced_budget(
      [] {
        torch::manual_seed(12);
        return test::flat_chain(6, 256, 1024, 0.1);
      },
      [&](torch::nn::Sequential& m) { return [&m, x] { return m->forward(x).pow(2).mean(); }; }, x, 0.75);
}

TEST_CASE("Balanced under a budget keeps the measured peak within it: example GPT", "[memory][acceptance]") {
  gpt::register_memscale_rule();
  gpt::Options options;
  options.context = 128;
  options.d_model = 128;
  options.layers = 6;
  auto tokens = torch::randint(256, {8, 128}, torch::kLong);
  auto targets = torch::randint(256, {8, 128}, torch::kLong);
  check_balanced_budget(
      [&] {
        torch::manual_seed(13);
        return gpt::GPT(options);
      },
      [&](gpt::GPT& m) { return [&m, tokens, targets] { return gpt::loss(m->forward(tokens), targets); }; },
      tokens);
}

namespace {

constexpr const char* fresh_budget_case = "fresh process: Balanced on the flat chain under a CPU budget";

torch::nn::Sequential fresh_budget_model() {
  torch::manual_seed(15);
  return test::flat_chain(6, 256, 1024, 0.1);
}

/// The flat chain's example input for the fresh-process budget test.
torch::Tensor fresh_budget_input() {
  torch::manual_seed(16);
  return torch::randn({16, 64, 256});
}

/// Runs fresh_budget_case in a new process of this test binary (one that has run
/// nothing at full size), with the budget (and, with reserve false, planning
/// told there is nothing outside the allocator), and returns its RESULT fields.
std::map<std::string, std::int64_t> run_fresh_budget(std::int64_t budget, bool reserve) {
  return test::run_child_case("MEMSCALE_TEST_FRESH_BUDGET=" + std::to_string(budget) +
                                  " MEMSCALE_TEST_FRESH_RESERVE=" + (reserve ? "1" : "0"),
                              fresh_budget_case);
}

}  // namespace

// Run by the test below in a process of its own.
TEST_CASE(fresh_budget_case, "[.][fresh]") {
  const char* budget_text = std::getenv("MEMSCALE_TEST_FRESH_BUDGET");
  if (budget_text == nullptr) return;  // only meaningful as a child process
  const auto budget = std::stoll(budget_text);
  const char* reserve_text = std::getenv("MEMSCALE_TEST_FRESH_RESERVE");
  const bool reserve = reserve_text == nullptr || std::string(reserve_text) != "0";
  memory_tracker::install();
  memscale::fix_malloc_mmap_threshold();
  auto x = fresh_budget_input();
  memory_tracker::process_peak_scope process;
  const auto origin = memory_tracker::current_bytes();
  auto model = fresh_budget_model();
  memscale::Config cfg = test::quiet({.mode = OptimizationMode::Balanced});
  cfg.memory_budget_gb = static_cast<double>(budget) / (1024.0 * 1024.0 * 1024.0);
  // The default target_gpu_utilization (0.85): its margin is what covers the
  // part of the native share the reserve cannot see (checked by the parent).
  memscale::Report report;
  // What the process made outside the allocator while the model was built
  // (OpenMP's workers from its initialisation, the modules' own objects).
  const auto before = process.peak_growth() - (memory_tracker::current_bytes() - origin);
  std::int64_t allocator = 0;
  {
    memory_tracker::peak_scope peak;
    auto guard = [&] {
      // reserve false: planning is told nothing lies outside the allocator
      memscale::core::profile_scale_scope told(1.0, reserve ? -1 : 0);
      return memscale::optimize(model, x, cfg);
    }();
    report = guard.report();
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
    for (int i = 0; i < 2; ++i) {
      optimizer.zero_grad();
      model->forward(x).pow(2).mean().backward();
      optimizer.step();
    }
    allocator = peak.peak() - origin;
  }
  std::cout << "RESULT process=" << process.peak_growth() << " allocator=" << allocator
            << " outside=" << report.outside_allocator_bytes << " planned=" << report.planned_peak_bytes()
            << " usable=" << report.usable_bytes << " before=" << before
            << " segments=" << report.checkpointed_segments() << " out_of_reach=" << out_of_reach_notes(report)
            << " pressure_x100="
            << static_cast<std::int64_t>(report.plan.pressure * 100) << "\n"
            << report << std::endl;
}

TEST_CASE("a CPU budget holds for the process from its first step: the plan reserves what lies outside the "
          "allocator", "[memory][acceptance]") {
  if (test::under_address_sanitizer) {
    WARN("not under AddressSanitizer: its shadow memory is part of what the process holds");
    return;
  }
  if (!memory_tracker::process_peak_scope().active()) {
    WARN("/proc/self/clear_refs cannot reset the resident high-water mark here: nothing to check");
    return;
  }
  // The process that trains has run nothing at full size: its first steps make
  // OpenMP and BLAS worker threads' buffers and oneDNN's scratchpads, which
  // LibTorch's allocator never sees (about 5-13 MB here, measured). This process
  // sizes the budget from a real baseline step; a fresh one is planned and trained.
  memory_tracker::install();
  std::int64_t baseline_total = 0;
  {
    const auto origin = memory_tracker::current_bytes();
    auto reference = fresh_budget_model();
    const auto x = fresh_budget_input();
    baseline_total = train_peak(reference, [&] { return reference->forward(x).pow(2).mean(); }, origin, 2);
  }
  // 0.8 with the default utilization (0.85): usable 0.68x, which the rules'
  // Balanced plan reaches with the reserve in it on LibTorch 1.13 (segments of
  // five slots), and not on 2.14 (planned 0.74x, its lowest: its reserve is
  // 14 MB). Out of reach, the Report says so, and the process may exceed the
  // budget (by 2% there); the checks below then take 0.9, which it reaches.
  auto budget = static_cast<std::int64_t>(0.8 * static_cast<double>(baseline_total));
  auto with = run_fresh_budget(budget, true);
  if (with.at("planned") > with.at("usable")) {
    INFO("budget " << budget << " B, usable " << with.at("usable") << " B, planned " << with.at("planned") << " B");
    CHECK(TORCH_VERSION_MAJOR >= 2);  // 1.13's plan reaches it: a plan that no longer does is a regression
    CHECK(with.at("out_of_reach") == 1);
    budget = static_cast<std::int64_t>(0.9 * static_cast<double>(baseline_total));
    with = run_fresh_budget(budget, true);
  }
  CHECK(with.at("out_of_reach") == 0);
  CHECK(with.at("planned") <= with.at("usable"));
  const auto outside_held = with.at("process") - with.at("allocator");
  INFO("baseline " << baseline_total << " B, budget " << budget << " B, usable " << with.at("usable")
                   << " B; fresh process: grew " << with.at("process") << " B, allocator " << with.at("allocator")
                   << " B, reserved outside it " << with.at("outside") << " B, held outside it " << outside_held
                   << " B (" << with.at("before") << " B of it while the model was built), planned "
                   << with.at("planned") << " B");
  CHECK(with.at("pressure_x100") > 100);  // the budget binds
  CHECK(with.at("segments") > 0);
  // Measured from the model's first full-batch run on (the warm-up step, the
  // example forward, profiling): more than nothing on a machine with worker
  // threads, a small part of the budget, and a large part of what the process
  // comes to hold outside the allocator, never more (README: 70-75% on this chain
  // on the VMs of 2026-11; 47-48% on the AVX2-only EPYC VM of 2026-12-01, 7.3 of
  // 15.3 MB, where the process still stayed within the budget).
  CHECK(with.at("outside") > 0);
  CHECK(with.at("outside") < budget / 4);
  CHECK(with.at("outside") >= outside_held * 2 / 5);
  CHECK(with.at("outside") <= outside_held);
  // The projection, the reserve included, is within the usable part (checked
  // above; Balanced's may stop short of its target, 90% of it).
  // The rest (made while the model is built and at the optimizer's first step,
  // about 4 MB here) is what target_gpu_utilization's margin is for: it fits in
  // it, and the process stays within the budget. (Planned to the budget itself,
  // utilization 1, the process lands within about 1% of it either side.)
  CHECK(outside_held - with.at("outside") <= budget - with.at("usable"));
  CHECK(with.at("process") <= budget);
}

TEST_CASE("the planner's baseline estimate tracks the measured peak", "[memory][predict]") {
  memory_tracker::install();
  torch::manual_seed(14);
  auto model = test::flat_chain(4, 256, 1024, 0.1);
  auto x = torch::randn({16, 64, 256}, torch::requires_grad());
  for (auto& p : model->parameters()) p.mutable_grad() = torch::zeros_like(p);  // as from step 2 on
  std::int64_t measured = 0;
  {
    memory_tracker::peak_scope scope;
    model->forward(x).pow(2).mean().backward();
    measured = scope.peak_growth();
  }
  for (bool static_profile : {true, false}) {
    memscale::Config cfg = test::quiet({.mode = OptimizationMode::Aggressive});
    cfg.use_static_profiling = static_profile;
    auto guard = memscale::optimize(model, x, cfg);
    const auto report = guard.report();
    const auto projected = report.baseline_peak_bytes() - report.static_bytes();
    INFO((static_profile ? "static" : "empirical") << ": projected " << projected << " B, measured " << measured
                                                    << " B");
    CHECK(std::abs(static_cast<double>(projected - measured)) <= 0.15 * static_cast<double>(measured));
  }
}

namespace {

/// `bytes` of fresh anonymous pages, written: what the process holds grows by
/// them, whatever the allocators had kept from cases before (in one process per
/// file, a case's torch::ones could take pages a case before had left resident).
class touched_pages {
 public:
  explicit touched_pages(std::size_t bytes)
      : bytes_(bytes), pages_(memscale::predictor::detail::fresh_pages(bytes)) {
    REQUIRE(pages_ != nullptr);
    std::memset(pages_, 1, bytes_);
  }
  touched_pages(const touched_pages&) = delete;
  touched_pages& operator=(const touched_pages&) = delete;
  ~touched_pages() { ::munmap(pages_, bytes_); }

 private:
  std::size_t bytes_;
  void* pages_;
};

}  // namespace

TEST_CASE("process_peak_scope: what the process holds, nested scopes each seeing their own peak", "[memory]") {
  if (test::under_address_sanitizer) {
    WARN("not under AddressSanitizer: its shadow memory is what the process holds");
    return;
  }
  constexpr std::int64_t mib = 1 << 20;
  memory_tracker::process_peak_scope outer;
  if (!outer.active()) {
    WARN("/proc/self/clear_refs cannot reset the resident high-water mark here: nothing to check");
    return;
  }
  { const touched_pages big(64 * mib); }  // held, then handed back
  // The inner scope resets the process's one high-water mark; the outer one
  // must still see the 64 MiB it held before.
  std::int64_t inner_growth = 0;
  {
    memory_tracker::process_peak_scope inner;
    REQUIRE(inner.active());
    const touched_pages small(16 * mib);
    inner_growth = inner.peak_growth();
  }
  CHECK(inner_growth >= 15 * mib);
  CHECK(inner_growth < 48 * mib);
  CHECK(outer.peak_growth() >= 60 * mib);
}

TEST_CASE("scratch_pages: memscale's measuring buffers are zeros, resident, 2 MiB-aligned, and unmapped with their "
          "tensor", "[memory]") {
  const auto options = torch::TensorOptions().dtype(torch::kFloat);
  auto t = memscale::detail::scratch_tensor({3, 1000}, options);
  CHECK(t.sizes() == torch::IntArrayRef({3, 1000}));
  CHECK(t.is_contiguous());
  CHECK(torch::equal(t, torch::zeros({3, 1000})));
  t.fill_(2.0f);
  CHECK(torch::mm(t, torch::ones({1000, 2})).eq(2000.0f).all().item<bool>());
  const auto address = reinterpret_cast<std::uintptr_t>(t.data_ptr());
  CHECK(address % memscale::detail::scratch_pages::huge_page == 0);
  // Resident from the start: mincore sees every page of the 12 KB (the faults
  // came at construction, not in what a caller measures with it).
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const std::size_t bytes = 3 * 1000 * sizeof(float);
  std::vector<unsigned char> resident((bytes + page - 1) / page);
  REQUIRE(::mincore(t.data_ptr(), bytes, resident.data()) == 0);
  CHECK(std::all_of(resident.begin(), resident.end(), [](unsigned char r) { return (r & 1U) != 0; }));
  t = torch::Tensor();  // the last reference: the mapping goes
  const int status = ::mincore(reinterpret_cast<void*>(address), page, resident.data());
  const int error = errno;
  CHECK(status == -1);
  CHECK(error == ENOMEM);
  // A negative size is refused, naming it; zero bytes map one page rather than none.
  CHECK_THROWS_WITH(memscale::detail::scratch_tensor({2, -3}, options), Catch::Contains("negative size -3"));
  const memscale::detail::scratch_pages none(0);
  CHECK(none.size() == 1);
  CHECK(static_cast<const unsigned char*>(none.data())[0] == 0);
}

namespace {
int written_global = 0;  // a page of a writable segment, anonymous once written
}  // namespace

TEST_CASE("code_pages: the loaded code's resident pages one by one, given back and read in again on use, a "
          "written page never listed", "[memory]") {
  using memscale::detail::code_pages;
  // The set arithmetic predict() uses.
  const code_pages before{{0x1000, 0x3000}, 4096};
  const code_pages after{{0x1000, 0x2000, 0x3000, 0x5000}, 4096};
  CHECK(after.added_to(before) == std::vector<std::uintptr_t>{0x2000, 0x5000});
  CHECK(after.bytes_beyond(before) == 2 * 4096);
  CHECK(before.bytes_beyond(after) == 0);

  const auto first = memscale::detail::resident_code_pages();
  if (!first) {
    WARN("/proc/self/pagemap cannot be read here: code_pages not checked");
    return;
  }
  const auto page = static_cast<std::uintptr_t>(first->page_bytes);
  const auto page_of = [&](std::uintptr_t a) { return a & ~(page - 1); };
  const auto listed = [](const code_pages& c, std::uintptr_t a) {
    return std::binary_search(c.pages.begin(), c.pages.end(), a);
  };
  CHECK(std::is_sorted(first->pages.begin(), first->pages.end()));
  CHECK(std::adjacent_find(first->pages.begin(), first->pages.end()) == first->pages.end());
  // The code running now is resident and listed; a written global is not (its page is no longer the file's).
  CHECK(listed(*first, page_of(reinterpret_cast<std::uintptr_t>(&memscale::detail::resident_code_pages))));
  written_global = 1;
  CHECK(!listed(*memscale::detail::resident_code_pages(), page_of(reinterpret_cast<std::uintptr_t>(&written_global))));

  // libtorch_cpu's resident pages, given back: no longer resident (but for the few another thread touches in
  // between), and a tensor operation reads some in again.
  torch::Tensor x = torch::ones({64}) * 2;
  // libtorch_cpu's: the object holding one of its operators' entry points (dladdr per page searched the symbols:
  // 2.4 s for the 25,000 pages).
  const auto torch_pages = memscale::detail::pages_in_object_of(
      memscale::detail::resident_code_pages()->pages, reinterpret_cast<std::uintptr_t>(&at::_ops::add_Tensor::call));
  REQUIRE(torch_pages.size() > 16);
  const auto given = memscale::detail::give_back_code_pages(torch_pages);
  CHECK(given >= static_cast<std::int64_t>(torch_pages.size() / 2) * first->page_bytes);
  const auto resident_again = [&] {
    const auto now = memscale::detail::resident_code_pages();
    return std::count_if(torch_pages.begin(), torch_pages.end(), [&](std::uintptr_t a) { return listed(*now, a); });
  };
  const auto left = resident_again();
  CHECK(left * 10 < static_cast<std::ptrdiff_t>(torch_pages.size()));
  x = torch::ones({64}) * 2 + x;  // the same kernels: their pages again
  CHECK(x.eq(4.0f).all().item<bool>());
  CHECK(resident_again() > left);
  // Pages not resident, or not code, are left alone: nothing given back.
  CHECK(memscale::detail::give_back_code_pages({page_of(reinterpret_cast<std::uintptr_t>(&written_global))}) == 0);
}

namespace {

/// Debian's tcmalloc (libtcmalloc-minimal4), preloaded into a child below.
constexpr const char* tcmalloc_library = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4";

/// VmRSS now; -1 where /proc/self/status cannot be read.
std::int64_t resident_now() {
  const auto now = memscale::detail::read_process_memory();
  return now ? now->resident_bytes : -1;
}

}  // namespace

// Run by the test below in a process of its own, under the malloc its parent chose.
TEST_CASE("malloc case", "[.][malloc]") {
  if (std::getenv("MEMSCALE_TEST_MALLOC") == nullptr) return;  // only meaningful as a child process
  const bool fix = std::getenv("MEMSCALE_TEST_MALLOC_FIX") != nullptr;
  const bool fixed = fix && memscale::fix_malloc_mmap_threshold();
  // 64 MiB touched, freed, then handed back (release_free_heap): what comes back.
  const auto before = resident_now();
  {
    const auto big = torch::ones({16 << 20}, torch::kFloat);
    REQUIRE(big.max().item<float>() == 1.0f);
  }
  const auto freed = resident_now();
  memscale::detail::release_free_heap();
  const auto released = resident_now();
  // A plan made here: whether its Report says the process may keep freed memory.
  torch::manual_seed(3);
  auto model = test::flat_chain(2);
  auto guard = memscale::optimize(model, torch::randn({8, 16, 64}),
                                  test::quiet({.mode = OptimizationMode::Balanced, .force_optimize = true}));
  const auto& notes = guard.report().notes;
  const auto noted = std::count_if(notes.begin(), notes.end(), [](const std::string& n) {
    return n.find("malloc") != std::string::npos && n.find("tcmalloc") != std::string::npos;
  });
  std::cout << "RESULT kind=" << static_cast<int>(memscale::process_malloc()) << " fixed=" << (fixed ? 1 : 0)
            << " follows=" << (memscale::process_memory_follows_allocator() ? 1 : 0) << " noted=" << noted
            << " kept=" << (freed - before) << " released=" << (freed - released) << "\n";
}

TEST_CASE("the malloc in use: glibc's needs its mmap threshold fixed for process figures, tcmalloc (preloaded) "
          "does not, and the Report says which", "[memory]") {
  if (test::under_sanitizer) {
    WARN("not under a sanitizer: its runtime replaces malloc, and another cannot be preloaded in front of it");
    return;
  }
  // This process: glibc's malloc (nothing preloaded in the test runs).
  if (const char* preload = std::getenv("LD_PRELOAD"); preload == nullptr || *preload == '\0')
    CHECK(memscale::process_malloc() == memscale::malloc_kind::glibc);
  CHECK(std::string(memscale::to_string(memscale::malloc_kind::tcmalloc)) == "tcmalloc");

  constexpr auto glibc = static_cast<std::int64_t>(memscale::malloc_kind::glibc);
  constexpr auto tcmalloc = static_cast<std::int64_t>(memscale::malloc_kind::tcmalloc);
  constexpr std::int64_t mib = 1 << 20;
  // glibc, threshold left alone: the plan's Report advises fixing it or tcmalloc.
  auto plain = test::run_child_case("MEMSCALE_TEST_MALLOC=1 LD_PRELOAD= MALLOC_MMAP_THRESHOLD_=", "malloc case");
  CHECK(plain["kind"] == glibc);
  CHECK(plain["follows"] == 0);
  CHECK(plain["noted"] == 1);
  // glibc, threshold fixed: the 64 MiB block was mapped on its own and left when freed; no note.
  auto fixed = test::run_child_case("MEMSCALE_TEST_MALLOC=1 MEMSCALE_TEST_MALLOC_FIX=1 LD_PRELOAD=", "malloc case");
  CHECK(fixed["kind"] == glibc);
  CHECK(fixed["fixed"] == 1);
  CHECK(fixed["follows"] == 1);
  CHECK(fixed["noted"] == 0);
  CHECK(fixed["kept"] < 8 * mib);

  if (::access(tcmalloc_library, R_OK) != 0) {
    WARN("no " << tcmalloc_library << " (Debian's libtcmalloc-minimal4): the tcmalloc half is not checked");
    return;
  }
  // tcmalloc: nothing to fix (its mallopt does nothing, and fix_ says so), its
  // process follows the allocator, no note; what it kept of the 64 MiB block goes
  // back when release_free_heap asks (MallocExtension_ReleaseFreeMemory).
  auto tc = test::run_child_case(std::string("MEMSCALE_TEST_MALLOC=1 MEMSCALE_TEST_MALLOC_FIX=1 LD_PRELOAD=") +
                                     tcmalloc_library,
                                 "malloc case");
  CHECK(tc["kind"] == tcmalloc);
  CHECK(tc["fixed"] == 0);
  CHECK(tc["follows"] == 1);
  CHECK(tc["noted"] == 0);
  CHECK(tc["kept"] - tc["released"] < 8 * mib);

  // jemalloc and mimalloc, where installed: named, and the Report says memscale measured nothing there.
  using memscale::malloc_kind;
  for (const auto& [library, kind] : {std::pair{"/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", malloc_kind::jemalloc},
                                      std::pair{"/usr/lib/x86_64-linux-gnu/libmimalloc.so.2", malloc_kind::mimalloc}}) {
    if (::access(library, R_OK) != 0) continue;
    INFO(library);
    auto other = test::run_child_case(std::string("MEMSCALE_TEST_MALLOC=1 LD_PRELOAD=") + library, "malloc case");
    CHECK(other["kind"] == static_cast<std::int64_t>(kind));
    CHECK(other["follows"] == 0);
    CHECK(other["noted"] == 1);
  }
}

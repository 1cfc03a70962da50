// Study (issue 12, predict's time target): can a training step's allocation
// timeline be had without its arithmetic? LibTorch 1.13 has DispatchKey::Fake
// (torchdistx's out-of-core key, between ADInplaceOrView and the backends) and
// registers nothing for it. This registers a boxed fallback for it at run time
// and turns it on for a step with c10::impl::IncludeDispatchKeyGuard:
//   - in-place ops return their written argument without computing;
//   - views, out= ops, ops without tensor arguments (factories) and ops with
//     integer or bool results run for real (index tensors stay correct);
//   - other ops run on meta tensors for their output shapes and strides, and
//     real, uninitialised CPU outputs are allocated with those (so LibTorch's
//     allocator sees the same allocations); an op with no meta kernel runs for
//     real (remembered after its first failure), and everything a real kernel
//     calls inside runs for real too.
// Autograd records and runs backward as usual, through the same fallback.
// Prints, per model, the allocator's step peak and the step time, real and
// fake, and which operators ran which way. Not built by CMake; see README.md.
// LibTorch 2.x uses DispatchKey::Fake for its own C++ FakeTensor mode, so this
// is a 1.13-only path (2.x would need another key or mechanism).
#include <torch/torch.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <memscale/memscale.hpp>
#include <chrono>
#include <iostream>
#include <map>
#include <unordered_set>
#include "gpt.hpp"
#include "resnet.hpp"

namespace {
std::map<std::string, int> real_ops, fake_ops, inplace_ops;
std::unordered_set<const void*> no_meta;  // operators whose meta run failed once: run for real from then on

torch::Tensor to_meta(const torch::Tensor& t) {
  c10::impl::ExcludeDispatchKeyGuard no_fake(c10::DispatchKey::Fake);
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
}

void fake_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto below = ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Fake);
  const auto n = schema.arguments().size();
  bool writes = false, aliases = false, has_tensor = false;
  for (const auto& a : schema.arguments()) if (a.alias_info() && a.alias_info()->isWrite()) writes = true;
  for (const auto& r : schema.returns()) if (r.alias_info()) aliases = true;
  auto args = torch::jit::last(*stack, n);
  c10::optional<c10::Device> device;
  for (const auto& v : args) {
    if (v.isTensor() && v.toTensor().defined()) { has_tensor = true; if (!device) device = v.toTensor().device(); }
  }
  const auto real = [&] { real_ops[schema.name()]++; if (getenv("TRACE")) { std::cerr << "real " << schema.name(); for (auto& v : args) if (v.isTensor() && v.toTensor().defined()) std::cerr << " " << v.toTensor().sizes() << v.toTensor().strides() << v.toTensor().dtype() << v.toTensor().storage().nbytes(); std::cerr << "\n"; } c10::impl::ExcludeDispatchKeyGuard no_fake(c10::DispatchKey::Fake); op.redispatchBoxed(below, stack); };
  if (!has_tensor) return real();
  if (writes && schema.overload_name().find("out") == std::string::npos && schema.returns().size() == 1 &&
      schema.returns()[0].alias_info() && schema.returns()[0].alias_info()->isWrite()) {
    // in-place: the written argument is the result; no compute
    for (std::size_t i = 0; i < n; ++i) {
      const auto& a = schema.arguments()[i];
      if (a.alias_info() && a.alias_info()->isWrite()) {
        auto self = args[i];
        torch::jit::drop(*stack, n);
        stack->push_back(self);
        inplace_ops[schema.name()]++;
        return;
      }
    }
  }
  if (writes || aliases || no_meta.count(&schema)) return real();
  // functional: shapes on meta
  torch::jit::Stack meta;
  for (const auto& v : args) {
    if (v.isTensor() && v.toTensor().defined()) meta.push_back(to_meta(v.toTensor()));
    else if (v.isTensorList()) {
      std::vector<torch::Tensor> l;
      for (const auto& t : v.toTensorList()) l.push_back(torch::Tensor(t).defined() ? to_meta(t) : torch::Tensor());
      meta.push_back(l);
    } else meta.push_back(v);
  }
  try {
    c10::impl::ExcludeDispatchKeyGuard no_fake(c10::DispatchKey::Fake);
    op.callBoxed(meta);
  } catch (const c10::Error&) {
    no_meta.insert(&schema);
    return real();
  }
  for (const auto& r : meta) {
    if (!r.isTensor()) return real();
    const auto& t = r.toTensor();
    if (t.defined() && !t.is_floating_point()) return real();
  }
  torch::jit::drop(*stack, n);
  c10::impl::ExcludeDispatchKeyGuard no_fake(c10::DispatchKey::Fake);
  for (const auto& r : meta) {
    const auto& t = r.toTensor();
    stack->push_back(t.defined() ? at::empty_strided(t.sizes(), t.strides(), t.options().device(*device)) : t);
  }
  fake_ops[schema.name()]++;
}

torch::Library* lib = nullptr;
}  // namespace

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "gpt";
  const long batch = argc > 2 ? std::atol(argv[2]) : 16;
  memscale::memory_tracker::install();
  lib = new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::Fake, __FILE__, __LINE__);
  lib->fallback(torch::CppFunction::makeFromBoxedFunction<&fake_fallback>());
  torch::manual_seed(1);
  std::shared_ptr<torch::nn::Module> root;
  std::function<torch::Tensor()> loss_of;
  if (which == "gpt") {
    gpt::Options o;
    gpt::GPT model(o);
    root = model.ptr();
    auto tokens = torch::randint(0, o.vocab, {batch, o.context}, torch::kLong);
    auto targets = torch::randint(0, o.vocab, {batch, o.context}, torch::kLong);
    loss_of = [=]() mutable { return gpt::loss(model->forward(tokens), targets); };
  } else if (which == "resnet") {
    resnet::ResNet model(4, 64);
    root = model.ptr();
    auto x = torch::randn({batch, 3, 32, 32});
    auto t = torch::randint(10, {batch}, torch::kLong);
    loss_of = [=]() mutable { return torch::cross_entropy_loss(model->forward(x), t); };
  } else {
    torch::nn::Sequential seq;
    for (int i = 0; i < 8; ++i) {
      seq->push_back(torch::nn::Linear(64, 256));
      seq->push_back(torch::nn::GELU());
      seq->push_back(torch::nn::Linear(256, 64));
      seq->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({64})));
    }
    root = seq.ptr();
    auto x = torch::randn({batch, 64});
    auto t = torch::randn({batch, 64});
    loss_of = [=]() mutable { return torch::mse_loss(seq->forward(x), t); };
  }
  for (auto& p : root->parameters()) p.mutable_grad() = torch::zeros_like(p);
  auto step = [&](bool fake) {
    std::optional<c10::impl::IncludeDispatchKeyGuard> g;
    if (fake) g.emplace(c10::DispatchKey::Fake);
    memscale::memory_tracker::peak_scope peak;
    const auto t0 = std::chrono::steady_clock::now();
    loss_of().backward();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return std::make_pair(peak.peak_growth(), s);
  };
  for (int i = 0; i < 3; ++i) {
    auto r = step(false);
    auto f = step(true);
    std::cout << which << " batch " << batch << ": real peak " << r.first << " B " << r.second << " s | fake peak "
              << f.first << " B " << f.second << " s\n";
  }
  std::cout << "real-run ops:"; for (auto& [k, v] : real_ops) std::cout << " " << k << "=" << v; std::cout << "\n";
  std::cout << "fake ops:"; for (auto& [k, v] : fake_ops) std::cout << " " << k << "=" << v; std::cout << "\n";
  std::cout << "inplace ops:"; for (auto& [k, v] : inplace_ops) std::cout << " " << k << "=" << v; std::cout << "\n";
}

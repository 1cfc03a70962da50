// memscale — the modules memscale puts into chain slots
// besides technique wrappers, and the transaction that swaps slots and undoes
// the swaps unless committed (the strong guarantee of wrap()).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/core/call_sites.hpp>
#include <memscale/detail/assert.hpp>
#include <memscale/detail/fault_injection.hpp>
#include <memscale/detail/modules.hpp>

namespace memscale::core {

/// Fills a slot that belongs to a checkpointed segment starting earlier.
class PassThroughImpl : public memscale::detail::wrapper_module {
 public:
  PassThroughImpl() : wrapper_module("memscale::PassThrough") {}
  torch::Tensor forward(torch::Tensor x) { return x; }
};

/// Slot 0 while wrap() runs the example input: records what the chain receives.
class InputCaptureImpl : public memscale::detail::wrapper_module {
 public:
  explicit InputCaptureImpl(torch::nn::AnyModule original)
      : wrapper_module("memscale::InputCapture"), original_(std::move(original)) {}
  torch::Tensor forward(torch::Tensor x) {
    if (!captured_.defined()) {
      captured_ = x.detach();
      inside_call_site_ = call_sites::depth() > 0;
    }
    return original_.forward<torch::Tensor>(std::move(x));
  }
  [[nodiscard]] const torch::Tensor& captured() const noexcept { return captured_; }
  /// Whether the chain first ran inside a memscale::forward call (it is then part of that unit).
  [[nodiscard]] bool inside_call_site() const noexcept { return inside_call_site_; }

 private:
  torch::nn::AnyModule original_;
  torch::Tensor captured_;
  bool inside_call_site_ = false;
};

/// The one slot of a model with no unit boundaries: its whole forward. It
/// registers the model, so the profiler sees its parameters and puts its
/// buffers back.
class WholeModelImpl : public memscale::detail::wrapper_module {
 public:
  WholeModelImpl(const std::shared_ptr<torch::nn::Module>& model, std::function<torch::Tensor(const torch::Tensor&)> fn)
      : wrapper_module("memscale::WholeModel"), fn_(std::move(fn)) {
    register_module("model", model);
  }
  torch::Tensor forward(torch::Tensor x) { return fn_(x); }

 private:
  std::function<torch::Tensor(const torch::Tensor&)> fn_;
};

/// Slot replacements done so far; undone in reverse unless committed.
class slot_transaction {
 public:
  slot_transaction() = default;
  slot_transaction(const slot_transaction&) = delete;
  slot_transaction& operator=(const slot_transaction&) = delete;
  ~slot_transaction() { rollback(); }

  /// Puts `next` in slot `index`. Strong guarantee: the only allocation (the
  /// undo entry) happens before the slot is touched, so a throw changes nothing.
  void replace(torch::nn::SequentialImpl& seq, std::size_t index, torch::nn::AnyModule next) {
    MEMSCALE_ASSERT(index < seq.size(), "slot index out of range");
    detail::fault_point(detail::pipeline_stage::reserve);
    undo_.reserve(undo_.size() + 1);
    auto it = seq.begin() + static_cast<std::ptrdiff_t>(index);
    undo_.push_back({&seq, index, torch::nn::AnyModule()});  // cannot throw: capacity reserved
    undo_.back().previous = std::move(*it);
    *it = std::move(next);
  }
  /// Keeps the changes. `running`, when given, receives the holder that was in a
  /// slot a forward is still executing (see attachment::plan_on_first_call).
  void commit(torch::nn::AnyModule* running = nullptr) noexcept {
    if (running != nullptr && !undo_.empty() && running->is_empty()) {
      for (auto& e : undo_)
        if (e.index == 0) {
          *running = std::move(e.previous);
          break;
        }
    }
    undo_.clear();
  }
  void rollback() noexcept {
    for (auto it = undo_.rbegin(); it != undo_.rend(); ++it)
      *(it->seq->begin() + static_cast<std::ptrdiff_t>(it->index)) = std::move(it->previous);
    undo_.clear();
  }

 private:
  struct entry {
    torch::nn::SequentialImpl* seq;
    std::size_t index;
    torch::nn::AnyModule previous;
  };
  std::vector<entry> undo_;
};

}  // namespace memscale::core

// memscale — the modules memscale puts into chain slots
// besides technique wrappers, and the transaction that swaps slots and undoes
// the swaps unless committed (the strong guarantee of wrap()).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
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

/// What the example forward held as each chain began and ended (capture_inputs):
/// `bytes` reads the device's live bytes (-1: unreadable); `last_end`, the
/// bytes when the chain run latest ended (at first, when the forward began).
struct capture_clock {
  std::function<std::int64_t()> bytes;
  std::int64_t last_end = -1;
  [[nodiscard]] std::int64_t now() const { return bytes ? bytes() : -1; }
};

/// Slot 0 while wrap() runs the example input: records what the chain receives
/// and, with a clock, by how much the live bytes grew since the chain run
/// before it ended (slot_cost::made_before_bytes). `ends`: where the chain's
/// end is marked on the clock: here (a chain of one slot), by a
/// ChainEndCaptureImpl on its last slot, or nowhere (then the next chain's
/// growth is not taken).
class InputCaptureImpl : public memscale::detail::wrapper_module {
 public:
  enum class end : std::uint8_t { marked, elsewhere, unmarked };
  explicit InputCaptureImpl(torch::nn::AnyModule original, std::shared_ptr<capture_clock> clock = nullptr,
                            end ends = end::elsewhere)
      : wrapper_module("memscale::InputCapture"), original_(std::move(original)), clock_(std::move(clock)),
        ends_(ends) {}
  torch::Tensor forward(torch::Tensor x) {
    if (!captured_.defined()) {
      captured_ = x.detach();
      inside_call_site_ = call_sites::depth() > 0;
      if (clock_ && clock_->last_end >= 0)
        if (const auto now = clock_->now(); now >= 0) made_before_ = std::max<std::int64_t>(0, now - clock_->last_end);
    }
    if (clock_ && ends_ == end::unmarked) clock_->last_end = -1;
    auto y = original_.forward<torch::Tensor>(std::move(x));
    if (clock_ && ends_ == end::marked) clock_->last_end = clock_->now();
    return y;
  }
  [[nodiscard]] const torch::Tensor& captured() const noexcept { return captured_; }
  /// Whether the chain first ran inside a memscale::forward call (it is then part of that unit).
  [[nodiscard]] bool inside_call_site() const noexcept { return inside_call_site_; }
  [[nodiscard]] std::int64_t made_before_bytes() const noexcept { return made_before_; }

 private:
  torch::nn::AnyModule original_;
  std::shared_ptr<capture_clock> clock_;
  end ends_ = end::elsewhere;
  torch::Tensor captured_;
  bool inside_call_site_ = false;
  std::int64_t made_before_ = 0;
};

/// A chain's last slot while wrap() runs the example input: marks its end on
/// the clock. Only on a layer known to take and return one Tensor.
class ChainEndCaptureImpl : public memscale::detail::wrapper_module {
 public:
  ChainEndCaptureImpl(torch::nn::AnyModule original, std::shared_ptr<capture_clock> clock)
      : wrapper_module("memscale::ChainEndCapture"), original_(std::move(original)), clock_(std::move(clock)) {}
  torch::Tensor forward(torch::Tensor x) {
    auto y = original_.forward<torch::Tensor>(std::move(x));
    clock_->last_end = clock_->now();
    return y;
  }

 private:
  torch::nn::AnyModule original_;
  std::shared_ptr<capture_clock> clock_;
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

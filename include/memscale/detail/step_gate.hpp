// memscale::detail — one training step at a time per model. memscale's
// wrappers keep per-model state a step uses from its forward to its backward
// (a checkpointed segment's first-run probe and the leaves it adopts, the
// call-site cursor, the offload engine's prefetch groups), and a detach swaps
// the slots a forward is running. A second thread entering the model's forward
// while another thread's step is in flight got wrong gradients or a crash
// (measured: 8 of 30 steps wrong with a detach mid-forward, a segmentation
// fault in a segment's first forward); now it gets a memscale::Error.
//
// A step is in flight while its token lives: the wrappers' training forwards
// take it (step_scope), and what the step saves for backward (a checkpoint's
// context, an offloaded tensor's record) holds it until backward is done with
// it. A forward from another thread is refused meanwhile; once the step's graph
// is gone (backward ran, or the loss was dropped), any thread may run the next.
#pragma once

#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

#include <memscale/errors.hpp>

namespace memscale::detail {

/// The step in flight: which thread runs it.
struct step_token {
  std::thread::id owner;
};

/// The token of the step this thread runs inside a wrapper's forward (null
/// outside one): what the wrapper saves for backward keeps it.
inline std::shared_ptr<step_token>& current_step_token() noexcept {
  thread_local std::shared_ptr<step_token> token;
  return token;
}

class step_gate {
 public:
  /// The token of this thread's step: the one in flight if it is this
  /// thread's, else a new one. Throws memscale::Error while another thread's
  /// step is in flight, or after detach closed the gate.
  std::shared_ptr<step_token> enter() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto held = this_threads_step()) return held;
    auto token = std::make_shared<step_token>(step_token{std::this_thread::get_id()});
    current_ = token;
    return token;
  }

  /// Refuses (throws as enter() does) while another thread's step is in
  /// flight; takes no step of its own.
  void check() {
    std::lock_guard<std::mutex> lock(mutex_);
    (void)this_threads_step();
  }

  /// For detach: closes the gate unless another thread's step is in flight
  /// (then returns false and changes nothing).
  [[nodiscard]] bool close() noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto held = current_.lock(); held && held->owner != std::this_thread::get_id()) return false;
    closed_ = true;
    return true;
  }

 private:
  /// The step in flight if it is this thread's, null if none is; throws if
  /// another thread's is, or after detach closed the gate. Under mutex_.
  std::shared_ptr<step_token> this_threads_step() const {
    if (closed_)
      throw Error("memscale: this model was detached (from another thread) as this forward began; run it "
                  "again: it runs unoptimized now");
    auto held = current_.lock();
    const auto me = std::this_thread::get_id();
    if (!held || held->owner == me) return held;
    std::ostringstream what;
    what << "memscale: a second thread (" << me << ") entered the forward of a model memscale optimizes while "
         << "thread " << held->owner << " has a training step in flight (its forward ran and its backward "
         << "has not finished). memscale's wrappers hold per-model state from a step's forward to its "
         << "backward, so one training step runs at a time: train the model from one thread at a time (any "
         << "thread, once the other's backward is done or its loss dropped), or give each thread its own "
         << "copy of the model, each wrapped";
    throw Error(what.str());
  }

  std::mutex mutex_;
  std::weak_ptr<step_token> current_;
  bool closed_ = false;
};

/// Inside a wrapper's training forward: enters the gate (if any) and makes its
/// token this thread's current one until the scope closes.
class step_scope {
 public:
  explicit step_scope(step_gate* gate) : previous_(current_step_token()) {
    if (gate != nullptr) current_step_token() = gate->enter();
  }
  step_scope(const step_scope&) = delete;
  step_scope& operator=(const step_scope&) = delete;
  ~step_scope() { current_step_token() = std::move(previous_); }

 private:
  std::shared_ptr<step_token> previous_;
};

/// A wrapper the attachment gives its model's gate to (CheckpointSegment,
/// TileSegment, OffloadSegment).
class gated {
 public:
  virtual ~gated() = default;
  void set_step_gate(std::shared_ptr<step_gate> gate) noexcept { gate_ = std::move(gate); }
  [[nodiscard]] step_gate* gate() const noexcept { return gate_.get(); }

 private:
  std::shared_ptr<step_gate> gate_;
};

}  // namespace memscale::detail

// One training run's own stream of random numbers, for programs that train
// several identically seeded models taking turns (the example's baseline and
// memscale runs, the benchmark's rows): the CPU generator's state, set before
// each of the run's steps and kept after it, so that each run draws the dropout
// masks it would draw training alone.
#pragma once

#include <mutex>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

namespace run_rng {

class stream {
 public:
  /// Starts where the CPU generator is now (after torch::manual_seed, the seed's stream).
  stream() : state_(save()) {}

  /// Runs `f` on this stream: the generator set to where the run left it, and
  /// where `f` leaves it kept for the run's next call.
  template <class F>
  decltype(auto) run(F&& f) {
    load(state_);
    struct keep {
      stream& self;
      ~keep() {
        try {
          self.state_ = save();
        } catch (...) {  // a destructor must not throw; the run continues from its last saved state
        }
      }
    } kept{*this};
    return std::forward<F>(f)();
  }

 private:
  static at::Tensor save() {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    return gen.get_state();
  }
  static void load(const at::Tensor& state) {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }

  at::Tensor state_;
};

}  // namespace run_rng

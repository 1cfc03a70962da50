// memscale — the code a training step reads in, for predict()'s figure outside
// the allocator on the CPU. A shape-only calibration reads in other code than a
// step does: meta kernels, the fallback's boxed calls, predict's own code; and
// not all of the step's. Measured per mapping (benchmarks/RESULTS.md,
// 2026-12-02, third session) it made 1.3-2.1 MiB more code resident than a
// first training step, 3-9% of a small model's step: the autoencoder's figure
// read 6-9% over for it. step_code gives back the code pages the calibration
// read in and runs one real step (forward, loss, backward) at a small batch,
// so that the pages counted are the step's own (a step at batch 2 and one at
// 16 read in the same code, within 0.06 MiB, measured on the autoencoder, the
// encoder and the tagger; device/code_pages.hpp says how pages are told apart
// and given back).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <optional>
#include <vector>

#include <torch/torch.h>

#include <memscale/device/code_pages.hpp>
#include <memscale/predict/calibration.hpp>

namespace memscale::predictor::detail {

/// What to add to the calibration's resident growth so that its code pages are
/// a real step's: the bytes of code a real step holds beyond `before` (read
/// just before the calibration), less those the calibration read in (given
/// back first). The step runs at a batch the calibration did not run (`ran`:
/// its batches): caches keyed by shape (oneDNN's primitives) then miss as they
/// do at the example's batch, and run the code that makes their entries
/// (1.3-1.7 MiB of libdnnl on the autoencoder and the MobileNet, missed at a
/// calibration batch). Only where the code read in is at least a tenth of
/// `allocator_bytes` (the allocator's predicted peak at the example's batch):
/// the swap moves the figure by a fraction of that code (18-21% on four
/// benchmark models), about 2% or less of a larger step, and costs a real step
/// at a small batch (a quarter of the example GPT's at 16). 0 where it did not
/// run, nothing was measured (`before` nullopt) or the real step threw (at a
/// batch the calibration did not run, a model may refuse what it accepted).
[[nodiscard]] inline std::int64_t step_code_swap(calibration& c,
                                                 const std::optional<memscale::detail::code_pages>& before,
                                                 const std::vector<std::int64_t>& ran, std::int64_t allocator_bytes) {
  if (!before) return 0;
  const auto after = memscale::detail::resident_code_pages();
  if (!after) return 0;
  const auto read_in = after->added_to(*before);
  const auto read_in_bytes = static_cast<std::int64_t>(read_in.size()) * after->page_bytes;
  if (read_in_bytes * 10 < allocator_bytes) return 0;
  (void)memscale::detail::give_back_code_pages(read_in);
  try {
    c.box->reset();
    c.keep_gradients(true);
    const auto unseen = (ran.empty() ? first_calibration_batch : *std::max_element(ran.begin(), ran.end())) + 1;
    const auto x = c.batch_of(unseen);
    torch::AutoGradMode grad_on(true);
    c.loss(c.forward(x)).backward();
  } catch (const std::exception&) {  // LibTorch's errors, out of memory, the model's own: predict goes on without it
    c.box->reset();
    return 0;
  }
  c.box->reset();
  const auto stepped = memscale::detail::resident_code_pages();
  return stepped ? stepped->bytes_beyond(*before) - read_in_bytes : 0;
}

/// memscale's own code (the object it is compiled into: the user's program or
/// library) read in beyond `before` (read before the plan is attached): its
/// profiler, decision engine and executor, which a training process with the
/// plan runs too and the calibration without the plan does not (0.3 MiB more
/// code in a step with Aggressive's plan than without on the encoder, measured;
/// its shape-only code, given back above, is counted again here: an
/// over-estimate of 0.06-0.25 MiB). The largest figure measured in the process:
/// a later call (`before` nullopt) finds that code resident and reads in none.
[[nodiscard]] inline std::int64_t own_plan_code(const std::optional<memscale::detail::code_pages>& before) {
  static std::atomic<std::int64_t> most{0};
  if (const auto now = before ? memscale::detail::resident_code_pages() : std::nullopt) {
    const auto read_in = memscale::detail::bytes_in_object_of(now->added_to(*before),
                                                              reinterpret_cast<std::uintptr_t>(&own_plan_code));
    for (auto seen = most.load(); read_in > seen && !most.compare_exchange_weak(seen, read_in);) {
    }
  }
  return most.load();
}

}  // namespace memscale::predictor::detail

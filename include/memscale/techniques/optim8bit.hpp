// memscale — the 8-bit optimizer technique: AdamW whose two moments are stored
// block-wise quantized to one byte per value (about 2.03 bytes of state per
// parameter instead of fp32 AdamW's 8), as a torch::optim::Optimizer. Config's
// use_8bit_optimizer picks it through make_optimizer(); the planner budgets
// optimizer state with optimizer_state_bytes().
//
// Parts: techniques/optim8bit_state.hpp (options, per-parameter state, state
// bytes), optim8bit_update.hpp (the update rules: ATen path, CPU loop) and
// optim8bit_adamw.hpp (the AdamW8bit class, CUDA dispatch, make_optimizer).
#pragma once

#include <memscale/techniques/optim8bit_adamw.hpp>
#include <memscale/techniques/optim8bit_state.hpp>
#include <memscale/techniques/optim8bit_update.hpp>

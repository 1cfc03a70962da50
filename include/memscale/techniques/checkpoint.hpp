// memscale — activation checkpointing. Parts: checkpoint_recompute.hpp (the
// recompute's machinery: bodies, recompute scope, leaf discovery, hook
// set-aside), checkpoint_function.hpp (the autograd function and
// memscale::checkpoint()) and checkpoint_segment.hpp (CheckpointSegment and the
// Checkpoint technique).
#pragma once

#include <memscale/techniques/checkpoint_function.hpp>
#include <memscale/techniques/checkpoint_recompute.hpp>
#include <memscale/techniques/checkpoint_segment.hpp>

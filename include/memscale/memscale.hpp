// memscale — umbrella header: the stable public surface. Include this one.
// Profiler -> Decision Engine -> Execution Plan -> Executor, behind wrap(),
// optimize() (an RAII guard) and detach(); see README.md.
#pragma once

#include <memscale/api.hpp>
#include <memscale/autotuning/autotune.hpp>
#include <memscale/config.hpp>
#include <memscale/core/call_sites.hpp>
#include <memscale/device/hardware.hpp>
#include <memscale/core/layer_rules.hpp>
#include <memscale/device/memory_tracker.hpp>
#include <memscale/core/plan.hpp>
#include <memscale/errors.hpp>
#include <memscale/predict/predict.hpp>
#include <memscale/report/report_html.hpp>
#include <memscale/report/report_json.hpp>
#include <memscale/techniques/checkpoint.hpp>
#include <memscale/techniques/concepts.hpp>
#include <memscale/techniques/mixed_precision.hpp>
#include <memscale/techniques/offload.hpp>
#include <memscale/techniques/optim8bit.hpp>
#include <memscale/techniques/strategy.hpp>
#include <memscale/techniques/tile.hpp>
#include <memscale/version.hpp>

// memscale — shape-only execution: a training step whose operators
// allocate their outputs as they would but compute nothing, so that the step's
// allocation timeline costs dispatch time, not arithmetic.
//
// Its parts, bottom-up:
//   predict/shape_only_tally.hpp     what a span did (shape_only_tally), the rates
//                                    (shape_only_rates) and each operator's work
//   predict/shape_only_arena.hpp     the CPU arena and the uninitialised outputs
//   predict/shape_only_rules.hpp     output shapes of operators without a meta kernel
//   predict/shape_only_fallback.hpp  the dispatcher fallback: what each operator
//                                    does, census mode, and its registration
//   predict/shape_only_scope.hpp     shape_only_available(), shape_only_scope
//
// predict() runs its calibration steps and its plan's profile with it on CPU
// (predict.hpp's header says how); tested against real steps in
// tests/test_predict.cpp.
#pragma once

#include <memscale/predict/shape_only_arena.hpp>
#include <memscale/predict/shape_only_fallback.hpp>
#include <memscale/predict/shape_only_rules.hpp>
#include <memscale/predict/shape_only_scope.hpp>
#include <memscale/predict/shape_only_tally.hpp>

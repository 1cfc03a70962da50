// memscale::predict — an operator's inputs in a RecordFunction start callback,
// in a program built without NDEBUG as well.
//
// at::RecordFunction::inputs() asserts a member, inputs_valid_, that LibTorch's
// header declares only without NDEBUG and that the library (built with NDEBUG)
// never sets: in a program built without NDEBUG (a Debug build), every call in
// a start callback that asked for inputs fails that assert, LibTorch logs the
// error with its backtrace, and the callback sees nothing. Measured on Debian's
// LibTorch 2.14.1: predict()'s recorder of matrix products (blas_workspace.hpp)
// logged it for every product and recorded none. The member sits in the padding
// after a bool, so the members after it are where the library put them; the
// inputs are read as inputs() reads them, through a pointer to the member that
// an explicit instantiation may name (access is not checked there).
#pragma once

#include <ATen/record_function.h>
#include <c10/util/ArrayRef.h>

namespace memscale::predictor::detail {

namespace record_inputs_access {
using member = c10::ArrayRef<const c10::IValue> at::RecordFunction::*;
struct tag {
  friend member inputs_member(tag);
};
template <member M>
struct grant {
  friend member inputs_member(tag) { return M; }
};
template struct grant<&at::RecordFunction::inputs_>;
}  // namespace record_inputs_access

/// fn.inputs(), without the assert a program built without NDEBUG compiles into it.
[[nodiscard]] inline c10::ArrayRef<const c10::IValue> record_inputs(const at::RecordFunction& fn) {
#ifdef NDEBUG
  return fn.inputs();
#else
  return fn.*inputs_member(record_inputs_access::tag{});
#endif
}

}  // namespace memscale::predictor::detail

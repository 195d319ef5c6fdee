#pragma once
// Row-parallel GEMM with a fused bias: Y = X W (+ b). Rows are split in fixed-size chunks, so the
// result is bitwise the same for any thread count.

#include "attnlab/common.hpp"

namespace attnlab {

// X (rows x in, row stride ldx), W (in x out, contiguous), b (out) or null,
// Y (rows x out, row stride ldy). accumulate: Y += X W instead of Y = X W (+ b).
template <typename T>
void linear(Index rows, Index in, Index out, const T* x, Index ldx, const T* w, const T* b, T* y,
            Index ldy, bool accumulate = false);

// Backward of linear(): dX = dY W^T (rows x in, row stride lddx), or dX += dY W^T.
template <typename T>
void linear_input_grad(Index rows, Index in, Index out, const T* dy, Index lddy, const T* w, T* dx,
                       Index lddx, bool accumulate = false);

// Backward of linear(): dW = X^T dY (in x out) and db = column sums of dY (either may be null).
// Parallel over fixed blocks of dW's rows, each a full reduction over `rows`: deterministic.
template <typename T>
void linear_weight_grad(Index rows, Index in, Index out, const T* x, Index ldx, const T* dy,
                        Index lddy, T* dw, T* db);

}  // namespace attnlab

#pragma once
// The projections and their gradients: Y = X W (+ b), dX = dY W^T, dW = X^T dY. Parallel over a
// fixed grid of (row chunk, column panels) tasks, so results are bitwise the same for any
// thread count.

#include "attnlab/common.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp

// The float32/float64 GEMM's blocking chosen for this CPU at run time (build_info()).
const char* gemm_blocking();

// X (rows x in, row stride ldx), W (in x out, contiguous), b (out) or null,
// Y (rows x out, row stride ldy). accumulate: Y += X W instead of Y = X W (+ b).
// packed: W's whole column panels as pack_weight() laid them out, or null (W is then packed by
// the call): the same products in the same order, so the same bits either way.
template <typename T>
void linear(Index rows, Index in, Index out, const T* x, Index ldx, const T* w, const T* b, T* y,
            Index ldy, bool accumulate = false, const T* packed = nullptr);

// The operands of linear() that are stored as half-precision bits (`format`), each in place
// of its float pointer (null when that operand is float32): a task widens its rows of X as it
// starts, W is widened into the packed copy the kernel reads anyway, and a task rounds its block
// of Y when it has computed it. So the result is linear()'s on the widened operands (then
// rounded), bit for bit, with X and W read at half the bytes and no float32 copy of X or Y.
struct HalfOperands {
    const std::uint16_t* x = nullptr;
    const std::uint16_t* w = nullptr;
    std::uint16_t* y = nullptr;
    HalfFormat format = HalfFormat::none;
};

// One linear() of a group: Y = X W + b, with the operands `half` names stored in half
// precision (linear_half; T float), each then given there instead of x, w or y.
template <typename T>
struct LinearCall {
    Index rows, in, out;
    const T* x;
    Index ldx;
    const T* w;
    const T* b;
    T* y;
    Index ldy;
    const T* packed;  // W's panels (pack_weight) or null
    HalfOperands half = {};
};

// linear() of each of n (1 to 3) calls, their tasks in one parallel region: the same results,
// without a wait between the products (a layer's Q, K and V projections).
template <typename T>
void linear_group(const LinearCall<T>* calls, int n);

// The length of pack_weight()'s copy of an (in x out) weight: its whole column panels of this
// build's panel width (the columns past the last whole panel are read from W itself).
template <typename T>
Index packed_weight_size(Index in, Index out);

// packed (packed_weight_size(in, out)) = the whole column panels of W (in x out, contiguous),
// each contiguous, row after row: what linear() packs on every call, done once for weights
// that stay constant over many calls.
template <typename T>
void pack_weight(Index in, Index out, const T* w, T* packed);

// linear() (float32 products, Y = X W + b) with the operands h names in half precision.
void linear_half(Index rows, Index in, Index out, const float* x, Index ldx, const float* w,
                 const float* b, float* y, Index ldy, const HalfOperands& h);

// linear_half with W in half precision, and x, y when x_half, y_half are given (the kernel
// table's entry: HalfOperands is per instruction set).
void linear_half_weights(Index rows, Index in, Index out, const float* x,
                         const std::uint16_t* x_half, Index ldx, const std::uint16_t* w,
                         HalfFormat format, const float* b, float* y, std::uint16_t* y_half,
                         Index ldy);

// linear()'s gradients, dW = X^T dY and db (when dw or dw_half, db are given), then dX = dY W^T
// (or +=; when dx is), with any of X, W, dY given as half-precision bits of `format` instead of
// as floats (x_half, w_half, dy_half; the float pointer then null) and dW written as such bits
// (dw_half: rounded as each task writes it): the kernel table's entry. dY contiguous (rows x
// out), W and dW contiguous (in x out), X and dX rows ldx, lddx apart.
void linear_half_grads(Index rows, Index in, Index out, const float* x, const std::uint16_t* x_half,
                       Index ldx, const float* w, const std::uint16_t* w_half, const float* dy,
                       const std::uint16_t* dy_half, HalfFormat format, float* dx, Index lddx,
                       bool accumulate, float* dw, std::uint16_t* dw_half, float* db);

// The operands of the gradients of linear() stored as half-precision bits (`format`), each in
// place of its float pointer (null when that operand is float32; float kernels only): dY widened
// as the GEMM's tasks read its rows or pack it, X and W widened as they are transposed, dX
// rounded by the task that computed its block, after any accumulation into the float32 dx (null
// when there is none). So the result is the float32 one on the widened operands (then rounded),
// bit for bit.
struct HalfGradOperands {
    const std::uint16_t* x = nullptr;   // linear_weight_grad's X (rows x in, row stride ldx)
    const std::uint16_t* dy = nullptr;  // dY (rows x out, row stride lddy)
    std::uint16_t* dx = nullptr;        // linear_input_grad's dX (rows x in, row stride lddx)
    HalfFormat format = HalfFormat::none;
    const std::uint16_t* w = nullptr;  // linear_input_grad's W (in x out, contiguous)
    std::uint16_t* dw = nullptr;       // linear_weight_grad's dW, written as bits (dw null)
};

// Backward of linear(): dX = dY W^T (rows x in, row stride lddx), or dX += dY W^T.
template <typename T>
void linear_input_grad(Index rows, Index in, Index out, const T* dy, Index lddy, const T* w, T* dx,
                       Index lddx, bool accumulate = false, const HalfGradOperands& h = {});

// Backward of linear(): dW = X^T dY (in x out) and db = column sums of dY (either may be null).
// xt: X^T (in x rows, contiguous, from transpose_rows) when the caller has it for several weight
// gradients of one X; else null (it is then made here when X is tall, or stored in half).
template <typename T>
void linear_weight_grad(Index rows, Index in, Index out, const T* x, Index ldx, const T* dy,
                        Index lddy, T* dw, T* db, const T* xt = nullptr,
                        const HalfGradOperands& h = {});

// xt (in x rows) = X^T of X (rows x in, row stride ldx), in parallel.
template <typename T>
void transpose_rows(Index rows, Index in, const T* x, Index ldx, T* xt);

// The same of X stored as half-precision bits, widened (exactly) as it is transposed.
void transpose_rows(Index rows, Index in, const std::uint16_t* x, Index ldx, HalfFormat format,
                    float* xt);

// transpose_rows of X given as T, or as the half-precision bits x_half when set (T float).
template <typename T>
void transpose_rows(Index rows, Index in, const T* x, const std::uint16_t* x_half, Index ldx,
                    HalfFormat format, T* xt);

}  // namespace attnlab::ATTNLAB_ISA_NS

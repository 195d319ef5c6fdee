#pragma once
// One dense layer y = x W + b as the forwards of multi-head and bilinear attention call it: W
// in float or as half-precision bits, and so x and y may be (float32 or bf16 products).

#include "attnlab/attention.hpp"
#include "attnlab/gemm.hpp"
#include "bf16_gemm.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

// y = x W + b for a layer whose W is float or half-precision bits, and so may x and y be (x_half,
// y_half: in W's format, given instead of x, y); with bf16 products
template <typename T>
void project(Index rows, const T* x, const Linear<T>& l, T* y, bool bf16,
             const std::uint16_t* x_half = nullptr, std::uint16_t* y_half = nullptr) {
    if constexpr (std::is_same_v<T, float>) {
        const HalfOperands h{x_half, l.w_half, y_half, l.half};
        if (bf16) {  // the weight as it is stored
            linear_bf16(rows, x, l.in, l, y, l.out, h);
            return;
        }
        if (l.w_half || x_half || y_half) {
            linear_half(rows, l.in, l.out, x, l.in, l.w, l.b, y, l.out, h);
            return;
        }
    }
    linear(rows, l.in, l.out, x, l.in, l.w, l.b, y, l.out, /*accumulate=*/false, l.packed);
}

// The half-precision operands of a layer's gradient products: its W as stored (widened as
// transposed) and, when given, X's and dY's bits, in the layer's format, and g's dW as bits.
template <typename T>
HalfGradOperands layer_half(const Linear<T>& l, const std::uint16_t* x = nullptr,
                            const std::uint16_t* dy = nullptr, const LinearGrad<T>& g = {}) {
    HalfGradOperands h{x, dy, nullptr, l.half};
    h.w = l.w_half;
    h.dw = g.w_half;
    return h;
}

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

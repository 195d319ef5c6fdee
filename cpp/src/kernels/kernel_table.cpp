// This build's kernel table (compiled once per instruction set, like every kernel source).
#include "attnlab/gemm.hpp"
#include "attnlab/kernels.hpp"
#include "bf16_gemm.hpp"
#include "half_convert.hpp"

#ifndef ATTNLAB_ISA_NAME
#error "ATTNLAB_ISA_NAME must name the instruction-set variant (set by CMakeLists.txt)"
#endif

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp

namespace {

const char* eigen_simd() { return Eigen::SimdInstructionSetsInUse(); }

// linear()'s gradients without half-precision operands (the table is instruction-set neutral)
template <typename T>
void input_grad(Index rows, Index in, Index out, const T* dy, Index lddy, const T* w, T* dx,
                Index lddx, bool accumulate) {
    linear_input_grad<T>(rows, in, out, dy, lddy, w, dx, lddx, accumulate);
}
template <typename T>
void weight_grad(Index rows, Index in, Index out, const T* x, Index ldx, const T* dy, Index lddy,
                 T* dw, T* db) {
    linear_weight_grad<T>(rows, in, out, x, ldx, dy, lddy, dw, db);
}

template <typename T>
constexpr KernelSet<T> kernel_set() {
    return {&attention_forward<T>,
            &attention_backward<T>,
            &multi_head_attention_forward<T>,
            &multi_head_attention_backward<T>,
            &bilinear_attention_forward<T>,
            &bilinear_attention_backward<T>,
            &additive_attention_forward<T>,
            &additive_attention_backward<T>,
            &separable_attention_forward<T>,
            &separable_attention_backward<T>,
            &linear<T>,
            &merge_attention<T>,
            &input_grad<T>,
            &weight_grad<T>,
            &packed_weight_size<T>,
            &pack_weight<T>};
}

}  // namespace

// Constant-initialised (no static constructor runs at load: code built for an instruction set
// the CPU lacks must not execute before the dispatcher has chosen).
extern const KernelTable kernel_table;
constexpr KernelTable kernel_table = {ATTNLAB_ISA_NAME,
                                      ""
#if defined(__AVX512F__)
                                      "avx512f "
#endif
#if defined(__AVX2__)
                                      "avx2 "
#endif
#if defined(__FMA__)
                                      "fma "
#endif
#if defined(__AVX__)
                                      "avx "
#endif
#if defined(__SSE2__) || defined(_M_X64)
                                      "sse2 "
#endif
#if defined(__ARM_NEON) || defined(__aarch64__)
                                      "neon "
#endif
                                      ,
                                      &eigen_simd,
                                      kernel_set<float>(),
                                      kernel_set<double>(),
                                      &fma_peak,
                                      &linear_bf16,
                                      &bf16_kernel,
                                      &bf16_tiles_size,
                                      &pack_bf16_tiles,
                                      &gemm_blocking,
                                      &decode_prefetch,
                                      &widen_half,
                                      &narrow_half,
                                      &bf16_special,
                                      &linear_half_weights,
                                      &linear_bf16_half_weights,
                                      &linear_half_grads};

}  // namespace attnlab::ATTNLAB_ISA_NS

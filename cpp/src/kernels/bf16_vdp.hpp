#pragma once
// The VDPBF16PS register block of precision="bf16" without AMX (attention_bf16_avx512.hpp,
// bf16_gemm_avx512.hpp): products of bf16 operands laid out as the AMX kernels pack them, each
// float lane summing a pair of bf16 products.

#include <cstdint>

#include "attnlab/attention.hpp"
#include "bf16.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

#if defined(ATTNLAB_AMX)
constexpr int kVdpRows = 8;  // rows per register block (8 x 2 vectors of accumulators)

// C (MR rows of 16 NV floats, row stride ldc; from zero unless accumulate) += A B over `pairs`
// pairs (a multiple of 16). Row i of A: bf16 pairs (one uint32 each) at a + i lda. B in the AMX
// tile layout: pair r, lanes [16 v, 16 v + 16) at b + (r / 16) chunk + (r % 16) 32 + 512 v.
template <int MR, int NV>
ATTNLAB_BF16_TARGET inline void vdp_block(float* c, Index ldc, bool accumulate,
                                          const std::uint32_t* a, Index lda, const std::uint16_t* b,
                                          Index chunk, Index pairs) {
    __m512 acc[MR][NV];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v)
            acc[i][v] = accumulate ? _mm512_loadu_ps(c + i * ldc + 16 * v) : _mm512_setzero_ps();
    for (Index r0 = 0; r0 < pairs; r0 += 16) {
        const std::uint16_t* bb = b + (r0 / 16) * chunk;
        const std::uint32_t* ab = a + r0;
        for (Index r = 0; r < 16; ++r) {
            __m512bh bv[NV];
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v)
                bv[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(bb + r * 32 + 512 * v));
#pragma GCC unroll 16
            for (int i = 0; i < MR; ++i) {
                const __m512bh ai = reinterpret_cast<__m512bh>(
                    _mm512_set1_epi32(static_cast<int>(ab[i * lda + r])));
#pragma GCC unroll 8
                for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], ai, bv[v]);
            }
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + i * ldc + 16 * v, acc[i][v]);
}

#endif

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

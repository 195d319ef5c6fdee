#pragma once
// y = x w + b with precision="bf16" on AVX512-BF16 when AMX is not usable: the operands packed as
// for the AMX tiles (bf16_gemm.hpp: x as bf16 rows, w in the VNNI layout) and multiplied by
// VDPBF16PS register blocks (vdp_block), the products summed in float32.

#include <algorithm>
#include <cstdint>

#include "attnlab/threading.hpp"
#include "bf16.hpp"
#include "bf16_vdp.hpp"
#include "scratch.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

#if defined(ATTNLAB_AMX)
constexpr Index kVdpGroup = 8;    // blocks of 32 output columns per task
constexpr Index kVdpChunk = 256;  // input features per pass: the A and B panels stay in L1

// Rows [32 mb, 32 mb + 32) of y, column blocks [nb0, nb1) of 32, from the packed xp (rows of kp
// bf16, zero padded to whole 32-row blocks) and wp (np columns): each element one chain of
// float32 sums over the input features in order (the chunks only store and reload it).
ATTNLAB_BF16_TARGET inline void vdp_linear_block(Index rows, Index out, Index kp, Index np,
                                                 const std::uint16_t* xp, const std::uint16_t* wp,
                                                 const float* b, float* y, Index ldy, Index mb,
                                                 Index nb0, Index nb1) {
    float* c =
        scratch<float>(ScratchBuffer::kGemmTiles, static_cast<std::size_t>(kVdpGroup * 1024));
    const Index ldc = (nb1 - nb0) * 32, m_rows = std::min<Index>(32, rows - mb * 32);
    const Index mr = (m_rows + kVdpRows - 1) / kVdpRows * kVdpRows;
    const auto* a = reinterpret_cast<const std::uint32_t*>(xp) + mb * 32 * (kp / 2);
    for (Index k0 = 0; k0 == 0 || k0 < kp; k0 += kVdpChunk) {  // once (zeros) for no features
        const Index kc = std::min(kVdpChunk, kp - k0);
        for (Index nb = nb0; nb < nb1; ++nb)
            for (Index g = 0; g < mr; g += kVdpRows)
                vdp_block<kVdpRows, 2>(
                    c + g * ldc + (nb - nb0) * 32, ldc, k0 > 0, a + g * (kp / 2) + k0 / 2, kp / 2,
                    wp + ((k0 / 32) * (np / 16) + 2 * nb) * 512, (np / 16) * 512, kc / 2);
    }
    for (Index j = 0; j < ldc; j += 16) {  // y = c + b, 16 columns at a time
        const Index left = out - nb0 * 32 - j;
        if (left <= 0) break;
        const __mmask16 in = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
        const Index j0 = nb0 * 32 + j;
        const __m512 bias = b ? _mm512_maskz_loadu_ps(in, b + j0) : _mm512_setzero_ps();
        for (Index i = 0; i < m_rows; ++i)
            _mm512_mask_storeu_ps(y + (mb * 32 + i) * ldy + j0, in,
                                  _mm512_add_ps(_mm512_load_ps(c + i * ldc + j), bias));
    }
}

// The VDPBF16PS product of the packed operands: 32 rows by up to kVdpGroup column blocks per
// task (the grid depends on the shapes alone: the result does not depend on the thread count).
inline void linear_bf16_vdp(Index rows, Index out, Index kp, Index np, const std::uint16_t* xp,
                            const std::uint16_t* wp, const float* b, float* y, Index ldy) {
    const Index mblocks = (rows + 31) / 32, nblocks = np / 32;
    const Index groups = (nblocks + kVdpGroup - 1) / kVdpGroup;
    parallel_for(mblocks * groups, [&](Index t) {
        const Index mb = t / groups, nb0 = (t % groups) * kVdpGroup;
        vdp_linear_block(rows, out, kp, np, xp, wp, b, y, ldy, mb, nb0,
                         std::min(nblocks, nb0 + kVdpGroup));
    });
}
#endif

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

#pragma once
// y = x w + b with precision="bf16" on AVX512-BF16 when AMX is not usable: the operands packed as
// for the AMX tiles (bf16_gemm.hpp: x as bf16 rows, w in the VNNI layout) and multiplied by
// VDPBF16PS register blocks (vdp_block), the products summed in float32, the bias added after.

#include <algorithm>
#include <cstdint>

#include "attnlab/threading.hpp"
#include "bf16.hpp"
#include "bf16_vdp.hpp"
#include "half_convert.hpp"
#include "scratch.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

#if defined(ATTNLAB_AMX)
constexpr Index kVdpGroup = 8;    // blocks of 32 output columns per task
constexpr Index kVdpChunk = 256;  // input features per pass: the A and B panels stay in L1

// Where both bf16 products put y = x w + b of a linear layer (rows x out, row stride ldy): whole
// 32 x 32 blocks straight from the AMX tiles (direct), other blocks from the sums c (row stride
// ldc) plus the bias's 32 columns at bias (null: the sums include it, nothing is added). y_half
// (not null): y is written there instead, as bits of `format`, each float32 result rounded as
// NumPy and ml_dtypes cast it (every block then goes through finish).
struct LinearBlocks {
    Index rows, out;
    float* y;
    Index ldy;
    std::uint16_t* y_half = nullptr;
    HalfFormat format = HalfFormat::none;

    float* direct(Index mb, Index nb) const {
        return !y_half && mb * 32 + 32 <= rows && nb * 32 + 32 <= out ? y + mb * 32 * ldy + nb * 32
                                                                      : nullptr;
    }
    ATTNLAB_BF16_TARGET void finish(Index mb, Index nb, const float* c, Index ldc,
                                    const float* bias) const {
        const Index m_rows = std::min<Index>(32, rows - mb * 32);
        const Index cols = std::min<Index>(32, out - nb * 32);
        alignas(64) float row[32];  // one result row, rounded to y_half from here
        for (Index i = 0; i < m_rows; ++i) {
            const Index at = (mb * 32 + i) * ldy + nb * 32;
            for (Index half = 0; half * 16 < cols; ++half) {
                const __mmask16 in = first_lanes(cols - half * 16);
                __m512 v = _mm512_loadu_ps(c + i * ldc + half * 16);
                if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(in, bias + half * 16));
                _mm512_mask_storeu_ps(y_half ? row + half * 16 : y + at + half * 16, in, v);
            }
            if (y_half) narrow_block(row, cols, format, y_half + at);
        }
    }
};

// A packed weight of np columns (pack_weight_block): column block nb's B tiles (the VNNI
// layout) start at column(nb), k-block after k-block stride() elements apart.
struct TileColumns {
    const std::uint16_t* w;
    Index np;
    const std::uint16_t* column(Index nb) const { return w + nb * 1024; }
    Index stride(Index) const { return np / 16 * 512; }
};

// The sums of rows [32 mb, 32 mb + 32) by column blocks [nb0, nb1) of 32 into c (row stride
// (nb1 - nb0) 32), from the packed xp (rows of kp bf16, zero padded to whole 32-row blocks) and a
// packed weight's column blocks (w: TileColumns, or the fused projections' three): each element
// one chain of float32 sums over the input features in order (the chunks only store and reload
// it).
template <typename Columns>
ATTNLAB_BF16_TARGET inline void vdp_sums(Index m_rows, Index kp, const Columns& w,
                                         const std::uint16_t* xp, Index mb, Index nb0, Index nb1,
                                         float* c) {
    const Index ldc = (nb1 - nb0) * 32;
    const Index mr = (m_rows + kVdpRows - 1) / kVdpRows * kVdpRows;
    const auto* a = reinterpret_cast<const std::uint32_t*>(xp) + mb * 32 * (kp / 2);
    for (Index k0 = 0; k0 == 0 || k0 < kp; k0 += kVdpChunk) {  // once (zeros) for no features
        const Index kc = std::min(kVdpChunk, kp - k0);
        for (Index nb = nb0; nb < nb1; ++nb)
            for (Index g = 0; g < mr; g += kVdpRows)
                vdp_block<kVdpRows, 2>(
                    c + g * ldc + (nb - nb0) * 32, ldc, k0 > 0, a + g * (kp / 2) + k0 / 2, kp / 2,
                    w.column(nb) + (k0 / 32) * w.stride(nb), w.stride(nb), kc / 2);
    }
}

// The VDPBF16PS product of the packed operands (rows of them), 32 rows by up to kVdpGroup column
// blocks per task (the grid depends on the shapes alone: the result does not depend on the
// thread count); each 32 x 32 block of sums goes to blocks.finish with its 32 columns of bp (the
// bias padded to np columns), or of zeros without one: y = sums + 0, as the product always gave.
template <typename Blocks, typename Columns>
void vdp_product(Index rows, Index kp, const Columns& w, const std::uint16_t* xp, const float* bp,
                 const Blocks& blocks) {
    const Index mblocks = (rows + 31) / 32, nblocks = w.np / 32;
    const Index groups = (nblocks + kVdpGroup - 1) / kVdpGroup;
    parallel_for(mblocks * groups, [&](Index t) {
        const Index mb = t / groups, nb0 = (t % groups) * kVdpGroup;
        const Index nb1 = std::min(nblocks, nb0 + kVdpGroup), ldc = (nb1 - nb0) * 32;
        float* c =
            scratch<float>(ScratchBuffer::kGemmTiles, static_cast<std::size_t>(kVdpGroup * 1024));
        vdp_sums(std::min<Index>(32, rows - mb * 32), kp, w, xp, mb, nb0, nb1, c);
        alignas(64) static const float zeros[32] = {};
        for (Index nb = nb0; nb < nb1; ++nb)
            blocks.finish(mb, nb, c + (nb - nb0) * 32, ldc, bp ? bp + nb * 32 : zeros);
    });
}
#endif

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

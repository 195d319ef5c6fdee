#pragma once
// precision="bf16" attention on AVX512-BF16 when AMX is not usable (AMD Zen 4): amx_tile's steps
// and packed operands (attention_bf16.hpp) with its two products, S^T = K Q^T and
// O^T += V^T P^T, on VDPBF16PS register blocks (vdp_block) instead of TDPBF16PS tiles.

#include <cstdint>

#include "attnlab/attention.hpp"
#include "bf16.hpp"
#include "bf16_vdp.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

#if defined(ATTNLAB_AMX)
// The instructions of amx_tile's products.
enum class Bf16Products { amx, vdp };

// S^T = K Q^T for the keys [j0, j0 + kbp) (kbp a multiple of 32) into sb (row stride q): K
// row-major in bf16 (row stride kp), Q^T as amx_tile's B tiles qt (g_tiles of 16 queries per 32
// features).
ATTNLAB_BF16_TARGET inline void vdp_scores(const std::uint16_t* kt, Index kp,
                                           const std::uint16_t* qt, Index g_tiles, Index q,
                                           Index j0, Index kbp, float* sb) {
    for (Index j = 0; j < kbp; j += kVdpRows) {
        const auto* a = reinterpret_cast<const std::uint32_t*>(kt + (j0 + j) * kp);
        if (g_tiles == 1)  // 16 queries
            vdp_block<kVdpRows, 1>(sb + j * q, q, false, a, kp / 2, qt, 512, kp / 2);
        for (Index g = 0; g + 1 < g_tiles; g += 2)
            vdp_block<kVdpRows, 2>(sb + j * q + g * 16, q, false, a, kp / 2, qt + g * 512,
                                   g_tiles * 512, kp / 2);
    }
}

// O^T += V^T P^T for the keys [j0, j0 + kbp) into acc (vp value columns, row stride q): V^T
// row-major in bf16 (row stride np), P^T as amx_tile's B tiles pb.
ATTNLAB_BF16_TARGET inline void vdp_values(const std::uint16_t* vt, Index np, Index vp,
                                           const std::uint16_t* pb, Index g_tiles, Index q,
                                           Index j0, Index kbp, float* acc) {
    for (Index c = 0; c < vp; c += kVdpRows) {
        const auto* a = reinterpret_cast<const std::uint32_t*>(vt + c * np + j0);
        if (g_tiles == 1)  // 16 queries
            vdp_block<kVdpRows, 1>(acc + c * q, q, true, a, np / 2, pb, 512, kbp / 2);
        for (Index g = 0; g + 1 < g_tiles; g += 2)
            vdp_block<kVdpRows, 2>(acc + c * q + g * 16, q, true, a, np / 2, pb + g * 512,
                                   g_tiles * 512, kbp / 2);
    }
}
#endif

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

#pragma once
// The attention core with precision="bf16" on AVX512-BF16 when AMX is not usable (AMD Zen 4, Intel
// Cooper Lake): the AMX kernel's maths and data (attention_bf16.hpp: K and V packed once per
// (batch, kv head) by amx_pack, its online softmax with P rounded to bf16) with both products on
// VDPBF16PS, each float lane summing a pair of bf16 products, in place of the tiles.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "attention_bf16.hpp"
#include "attnlab/attention.hpp"
#include "attnlab/threading.hpp"
#include "bf16.hpp"
#include "bf16_vdp.hpp"
#include "scratch.hpp"
#include "softmax.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

#if defined(ATTNLAB_AMX)
// One (batch, head, block of up to kAmxQ queries) from the packed K and V: amx_tile's steps.
ATTNLAB_BF16_TARGET inline void vdp_tile(const AttentionProblem<float>& p, const AmxPacked& L,
                                         const std::uint16_t* kt, const std::uint16_t* vt, Index b,
                                         Index h, Index i0, Index mq) {
    const Index d = p.d, dv = p.d_v, kp = L.kp, vp = L.vp, col_tiles = vp / 16;
    std::uint16_t* qb =
        scratch<std::uint16_t>(ScratchBuffer::kBf16Queries, static_cast<std::size_t>(kAmxQ * kp));
    std::uint16_t* pb =
        scratch<std::uint16_t>(ScratchBuffer::kBf16Probs, static_cast<std::size_t>(kAmxQ * kAmxK));
    float* s = scratch<float>(ScratchBuffer::kFlashScores, static_cast<std::size_t>(kAmxQ * kAmxK));
    float* acc =
        scratch<float>(ScratchBuffer::kFlashAccumulator, static_cast<std::size_t>(kAmxQ * vp));
    float* m = scratch<float>(ScratchBuffer::kFlashStats, static_cast<std::size_t>(2 * kAmxQ));
    float* l = m + kAmxQ;
    const float* q = p.q.at(b, h) + i0 * p.q.row_stride;
    const Index mr = (mq + kVdpRows - 1) / kVdpRows * kVdpRows;  // rows computed, zero-padded
    // Q to bf16 rows of kp, 32 features at a time by masked loads (zero past d and past mq)
    auto lanes = [](Index left) {
        return left >= 16  ? __mmask16(0xffff)
               : left <= 0 ? __mmask16(0)
                           : __mmask16((1u << left) - 1);
    };
    for (Index i = 0; i < mr; ++i)
        for (Index c0 = 0; c0 < kp; c0 += 32) {
            const float* qr = q + std::min(i, mq - 1) * p.q.row_stride + c0;
            const Index left = i < mq ? d - c0 : 0;
            const __m512 lo = _mm512_maskz_loadu_ps(lanes(left), qr);
            const __m512 hi = _mm512_maskz_loadu_ps(lanes(left - 16), qr + 16);
            _mm512_storeu_si512(qb + i * kp + c0,
                                reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
        }
    std::fill(pb, pb + mr * kAmxK, std::uint16_t(0));
    std::fill(acc, acc + mr * vp, 0.0f);
    const float sink = p.mask.sinks ? p.mask.sink(b, h) : neg_inf<float>();
    std::fill(m, m + kAmxQ, sink);
    std::fill(l, l + kAmxQ, sink == neg_inf<float>() ? 0.0f : 1.0f);
    const float cap = static_cast<float>(p.mask.options.softcap);
    const Interval keys = keys_seen(p.mask, p.n_q, p.n_k, i0, i0 + mq);
    const auto* qpairs = reinterpret_cast<const std::uint32_t*>(qb);
    const auto* ppairs = reinterpret_cast<const std::uint32_t*>(pb);
    for (Index j0 = keys.lo / 32 * 32; j0 < keys.hi; j0 += kAmxK) {
        const Index kb = std::min(kAmxK, keys.hi - j0), kbp = round_up(kb, 32);
        // S = Q K^T, 32 keys (two key tiles) at a time
        for (Index jc = 0; jc < kbp; jc += 32)
            for (Index g = 0; g < mr; g += kVdpRows)
                vdp_block<kVdpRows, 2>(s + g * kAmxK + jc, kAmxK, false, qpairs + g * (kp / 2),
                                       kp / 2, kt + (j0 + jc) / 16 * 512, L.key_tiles * 512,
                                       kp / 2);
        // the scale goes into the exponential's FMA unless masks or the cap need scaled scores
        const bool masked = tile_needs_mask(p.mask, p.n_q, p.n_k, i0, i0 + mq, j0, j0 + kb);
        const bool fused = p.scale > 0 && !(cap > 0) && !masked;
        if (!fused) {
            const __m512 sc = _mm512_set1_ps(p.scale);
            for (Index i = 0; i < mq; ++i)
                for (Index c = 0; c < kbp; c += 16) {
                    float* sr = s + i * kAmxK + c;
                    _mm512_store_ps(sr, _mm512_mul_ps(sc, _mm512_load_ps(sr)));
                }
            if (cap > 0)
                for (Index i = 0; i < mq; ++i)
                    softcap_scores(cap, s + i * kAmxK, kb, (float*)nullptr);
            if (masked) apply_mask(p.mask, b, h, p.n_q, p.n_k, i0, j0, mq, kb, s, kAmxK, Index(1));
        }
        const float sc = fused ? p.scale : 1.0f;
        // online softmax row by row; P rounded to bf16 for the value product
        for (Index i = 0; i < mq; ++i) {
            const float* sr = s + i * kAmxK;
            const float bm = scaled_row_max(sr, sc, kb);
            const float mn = m[i] < bm ? bm : m[i];  // a NaN score reaches the row via its sum
            const float shift = mn == neg_inf<float>() ? 0.0f : mn;
            const float sum = exp_row_bf16(sr, sc, shift, kb, kbp, pb + i * kAmxK);
            const float alpha = m[i] == neg_inf<float>() ? 0.0f : std::exp(m[i] - shift);
            l[i] = l[i] * alpha + sum;
            m[i] = mn;
            if (alpha != 1.0f) {
                const __m512 a = _mm512_set1_ps(alpha);
                float* ar = acc + i * vp;
                for (Index c = 0; c < vp; c += 16)
                    _mm512_store_ps(ar + c, _mm512_mul_ps(a, _mm512_load_ps(ar + c)));
            }
        }
        // acc += P V, 32 value columns (two column tiles) at a time
        for (Index cb = 0; cb < col_tiles; cb += 2)
            for (Index g = 0; g < mr; g += kVdpRows)
                vdp_block<kVdpRows, 2>(acc + g * vp + cb * 16, vp, true, ppairs + g * (kAmxK / 2),
                                       kAmxK / 2, vt + ((j0 / 32) * col_tiles + cb) * 512,
                                       col_tiles * 512, kbp / 2);
    }
    float* obase = p.out.at(b, h) + i0 * p.out.row_stride;
    for (Index i = 0; i < mq; ++i) {
        float* orow = obase + i * p.out.row_stride;
        const float li = l[i];
        for (Index c = 0; c < dv; ++c) orow[c] = li == 0.0f ? 0.0f : acc[i * vp + c] / li;
        if (p.lse)
            p.lse[(b * p.heads + h) * p.n_q + i0 + i] =
                li == 0.0f ? neg_inf<float>() : m[i] + std::log(li);
    }
}

// The VDPBF16PS forward; false (nothing written) when a value row holds NaN or Inf.
inline bool vdp_forward(const AttentionProblem<float>& p) {
    const AmxPacked L = amx_layout(p.n_k, p.d, p.d_v);
    const Index heads = p.batch * p.kv_heads;
    auto kt = make_buffer<std::uint16_t>(static_cast<Index>(L.k_size) * heads);
    auto vt = make_buffer<std::uint16_t>(static_cast<Index>(L.v_size) * heads);
    std::atomic<bool> finite{true};
    parallel_for(heads, [&](Index t) {
        if (!amx_pack(p, t / p.kv_heads, t % p.kv_heads, L, kt.get() + t * L.k_size,
                      vt.get() + t * L.v_size))
            finite.store(false, std::memory_order_relaxed);
    });
    if (!finite.load()) return false;
    const Index q_tiles = (p.n_q + kAmxQ - 1) / kAmxQ;
    const Index group = p.heads / p.kv_heads;
    parallel_for(p.batch * p.heads * q_tiles, [&](Index t) {
        const Index qt = t % q_tiles, h = (t / q_tiles) % p.heads, b = t / (q_tiles * p.heads);
        const Index slot = b * p.kv_heads + h / group;
        vdp_tile(p, L, kt.get() + slot * L.k_size, vt.get() + slot * L.v_size, b, h, qt * kAmxQ,
                 std::min(kAmxQ, p.n_q - qt * kAmxQ));
    });
    return true;
}
#endif

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

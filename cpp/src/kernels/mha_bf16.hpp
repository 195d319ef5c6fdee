#pragma once
// Multi-head self-attention with precision="bf16" on AMX (or VDPBF16PS) without float32 copies: x
// (float32, or the half-precision bits of the weights' format) packed to bf16 once for the three
// projections, which run as one product whose blocks are rounded to bf16 straight into the
// layouts the attention tiles read (Q row-major per head, K row-major and V transposed per kv
// head, attention_bf16.hpp, V^T by a pass of its own); the attention writes its output as the
// bf16 rows of the output projection, whose result is float32 or rounded to x's half format. The
// same roundings of the same float32 sums as the composed path (linear_bf16, then the attention's
// packing): bitwise the same result, without the float32 projections and context going through
// memory.
//
// Shapes: x (batch * n, d_in); [w_q | w_k | w_v] (d_in, heads * d_head + 2 * kv_heads * d_head)
// as one packed weight; Q (batch, heads, q_rows, d_head), K (batch, kv_heads, n_pad, d_head), V^T
// (batch, kv_heads, d_vhead, n_pad), the context rows (round_up(batch * n, 32), heads * d_vhead).

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "attention_bf16.hpp"
#include "attnlab/attention.hpp"
#include "attnlab/threading.hpp"
#include "bf16_gemm.hpp"
#include "decode.hpp"
#include "scratch.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

#if defined(ATTNLAB_AMX)

// Where the products put the blocks of [Q | K | V] = x [w_q | w_k | w_v] + b: each 32 x 32 block
// lies in one head (d_head and d_vhead are multiples of 32), its rows are tokens, each written as
// bf16 rows (whole cache lines: a block's neighbours may be another thread's) of Q, K or V's
// staging rows (V^T is formed per kv head afterwards, transpose_values).
struct QkvBlocks {
    Index rows, n, heads, kv_heads, d, dv, q_rows;
    AmxPacked L;
    std::uint16_t *q, *kt, *vs;  // vs: V as rows (batch, kv_heads, n, dv)
    std::atomic<bool>* finite;

    float* direct(Index, Index) const { return nullptr; }

    // c: the block's sums (row stride ldc); bias: its 32 columns to add first, or null
    ATTNLAB_AMX_TARGET void finish(Index mb, Index nb, const float* c, Index ldc,
                                   const float* bias) const {
        const Index m_rows = std::min<Index>(32, rows - mb * 32), r0 = mb * 32;
        const Index wq = heads * d, wk = kv_heads * d;
        const Index col = nb * 32;
        const int part = col < wq ? 0 : col < wq + wk ? 1 : 2;  // Q, K or V
        const Index c_part = col - (part == 0 ? 0 : part == 1 ? wq : wq + wk);
        const Index width = part == 2 ? dv : d, head = c_part / width, f = c_part % width;
        const __m512i exponent = _mm512_set1_epi32(0x7f800000);
        __mmask16 nonfinite = 0;  // V's values, as the attention's packing checks them
        for (Index i = 0, b = r0 / n, t = r0 % n; i < m_rows; ++i, ++t) {
            if (t == n) t = 0, ++b;
            std::uint16_t* dst = part == 0   ? q + ((b * heads + head) * q_rows + t) * d + f
                                 : part == 1 ? kt + (b * kv_heads + head) * L.k_size + t * d + f
                                             : vs + ((b * kv_heads + head) * n + t) * dv + f;
            __m512 lo = _mm512_loadu_ps(c + i * ldc), hi = _mm512_loadu_ps(c + i * ldc + 16);
            if (bias) {
                lo = _mm512_add_ps(lo, _mm512_loadu_ps(bias));
                hi = _mm512_add_ps(hi, _mm512_loadu_ps(bias + 16));
            }
            if (part == 2) {
                nonfinite |= _mm512_cmpeq_epi32_mask(
                    _mm512_and_si512(_mm512_castps_si512(lo), exponent), exponent);
                nonfinite |= _mm512_cmpeq_epi32_mask(
                    _mm512_and_si512(_mm512_castps_si512(hi), exponent), exponent);
            }
            _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
        }
        if (nonfinite) finite->store(false, std::memory_order_relaxed);
    }
};

// V^T of one (batch, kv head) from its bf16 rows vs (n x dv): 16 x 16 transposes (of the values
// widened to float, exactly, and rounded back, exactly), zero past the n keys up to L.n_pad.
ATTNLAB_AMX_TARGET inline void transpose_values(const std::uint16_t* vs, Index n, Index dv,
                                                const AmxPacked& L, std::uint16_t* vt) {
    for (Index j0 = 0; j0 < L.n_pad; j0 += 16)
        for (Index c0 = 0; c0 < dv; c0 += 16) {
            __m512 o[16];
            for (Index r = 0; r < 16; ++r) {
                const __m256i bits =
                    j0 + r < n ? _mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(vs + (j0 + r) * dv + c0))
                               : _mm256_setzero_si256();
                o[r] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
            }
            transpose_16x16(o);
            for (Index c = 0; c < 16; ++c)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(vt + (c0 + c) * L.n_pad + j0),
                                    reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(o[c])));
        }
}

// The column blocks of [w_q | w_k | w_v] for the tile product from the three weights' own tiles
// (Linear::tiles, packed once: their widths are multiples of 32 here), in place of one packed copy.
struct QkvColumns {
    const std::uint16_t *q, *k, *v;
    Index bq, bk, bv;  // each weight's column blocks of 32
    Index np;          // all three's columns
    const std::uint16_t* column(Index nb) const {
        return nb < bq        ? q + nb * 1024
               : nb < bq + bk ? k + (nb - bq) * 1024
                              : v + (nb - bq - bk) * 1024;
    }
    Index stride(Index nb) const { return (nb < bq ? bq : nb < bq + bk ? bk : bv) * 1024; }
};

// The fused forward when it applies (AMX or else AVX512-BF16 usable, as the composed kernels
// choose; self-attention, head widths multiples of 32, no weights or kept state asked for, not
// the decode path, no projection that streams its weight); false (nothing written) otherwise or
// when a value holds NaN or Inf (the attention's careful path then runs on the composed path).
// Whether a projection of this call streams its weight (bf16_streams): the fused call then
// leaves it to the composed kernels, whose bits it gives.
inline bool streams_any(const MhaProblem<float>& p) {
    const Index rq = p.batch * p.n_q, rk = p.batch * p.n_k;
    return bf16_streams(rq, p.w_q.in, p.w_q.out) || bf16_streams(rk, p.w_k.in, p.w_k.out) ||
           bf16_streams(rk, p.w_v.in, p.w_v.out) || bf16_streams(rq, p.w_o.in, p.w_o.out);
}

inline bool mha_bf16_fused(const MhaProblem<float>& p, const AttentionProblem<float>& a) {
    const Index in = p.w_q.in, d = p.d_head, dv = p.d_vhead;
    const bool self = p.query == p.key && p.key == p.value && p.query_half == p.key_half &&
                      p.key_half == p.value_half && p.n_q == p.n_k && p.w_k.in == in &&
                      p.w_v.in == in;
    const bool amx = amx_usable();
    if (!(amx || avx512_bf16_usable()) || !self || d % 32 != 0 || dv % 32 != 0 || p.weights ||
        p.weights_half || p.state.q || p.state.lse || use_decode(a) || in <= 0 || streams_any(p))
        return false;
    const Index n = p.n_q, rows = p.batch * n, h = p.heads, hk = p.kv_heads;
    const Index mp = (rows + 31) / 32 * 32, kp = (in + 31) / 32 * 32;
    const Index wq = h * d, wk = hk * d, wv = hk * dv, np = wq + wk + wv;

    const Index wc = h * dv, d_out = p.w_o.out;  // wc a multiple of 32: no column padding
    const Index npo = (d_out + 31) / 32 * 32;
    const bool biased = p.w_q.b || p.w_k.b || p.w_v.b;
    auto bp = make_buffer<float>(biased ? np : 0);
    if (biased) {
        const auto put = [&](const float* b, Index from, Index count) {
            if (b)
                std::copy(b, b + count, bp.get() + from);
            else
                std::fill(bp.get() + from, bp.get() + from + count, 0.0f);
        };
        put(p.w_q.b, 0, wq);
        put(p.w_k.b, wq, wk);
        put(p.w_v.b, wq + wk, wv);
    }

    const AmxPacked L = amx_layout(n, d, dv);
    const Index q_rows = (n + kAmxQ - 1) / kAmxQ * kAmxQ, slots = p.batch * hk;
    auto q = make_buffer<std::uint16_t>(p.batch * h * q_rows * d);
    auto kt = make_buffer<std::uint16_t>(static_cast<Index>(L.k_size) * slots);
    auto vt = make_buffer<std::uint16_t>(static_cast<Index>(L.v_size) * slots);
    auto vs = make_buffer<std::uint16_t>(p.batch * hk * n * dv);
    auto ctx = make_buffer<std::uint16_t>(mp * wc);
    auto xp = make_buffer<std::uint16_t>(mp * kp);  // x, once for the three projections
    // the weights' tiles packed once, when all three are, read where they are; w_o's when it is
    const bool qkv_tiles = p.w_q.tiles && p.w_k.tiles && p.w_v.tiles;
    auto wp = make_buffer<std::uint16_t>(qkv_tiles ? 0 : kp * np);
    auto wpo = make_buffer<std::uint16_t>(p.w_o.tiles ? 0 : wc * npo);
    // one pass (one wait for the threads) packs x and both weights and zeroes the padding the
    // products read: queries past n, keys past n (K's rows; V^T is written whole), the context
    // rows past the last
    const Index heads = std::max(h, hk), t_x = mp / 32, t_w = t_x + kp / 32, t_o = t_w + wc / 32;
    parallel_for(t_o + p.batch * heads + 1, [&](Index t) {
        if (t < t_x) {
            if (p.query_half)  // the half-precision bits of the weights' format
                pack_rows(t * 32, t * 32 + 32, rows, in, p.query_half, in, kp, xp.get(),
                          p.w_q.half);
            else
                pack_rows(t * 32, t * 32 + 32, rows, in, p.query, in, kp, xp.get());
        } else if (t < t_w) {
            const Index kb = t - t_x;
            if (qkv_tiles) return;
            pack_weight_block(kb, p.w_q, np, 0, wq / 16, wp.get());
            pack_weight_block(kb, p.w_k, np, wq / 16, wk / 16, wp.get());
            pack_weight_block(kb, p.w_v, np, (wq + wk) / 16, wv / 16, wp.get());
        } else if (t < t_o) {
            if (!p.w_o.tiles) pack_weight_block(t - t_w, p.w_o, npo, 0, npo / 16, wpo.get());
        } else if (t < t_o + p.batch * heads) {
            const Index b = (t - t_o) / heads, head = (t - t_o) % heads;
            if (head < h) {
                std::uint16_t* qs = q.get() + (b * h + head) * q_rows * d;
                std::fill(qs + n * d, qs + q_rows * d, std::uint16_t{0});
            }
            if (head < hk) {
                std::uint16_t* ks = kt.get() + (b * hk + head) * L.k_size;
                std::fill(ks + n * d, ks + L.n_pad * d, std::uint16_t{0});
            }
        } else {
            std::fill(ctx.get() + rows * wc, ctx.get() + mp * wc, std::uint16_t{0});
        }
    });
    std::atomic<bool> finite{true};
    const QkvBlocks blocks{rows, n, h, hk, d, dv, q_rows, L, q.get(), kt.get(), vs.get(), &finite};
    const auto product = [&](const auto& columns) {
        if (amx)
            tile_product(mp, kp, np, xp.get(), columns, biased ? bp.get() : nullptr, 0, blocks);
        else
            vdp_product(rows, kp, columns, xp.get(), biased ? bp.get() : nullptr, blocks);
    };
    if (qkv_tiles)
        product(QkvColumns{p.w_q.tiles, p.w_k.tiles, p.w_v.tiles, wq / 32, wk / 32, wv / 32, np});
    else
        product(TileColumns{wp.get(), np});
    if (!finite.load()) return false;
    parallel_for(slots, [&](Index t) {
        transpose_values(vs.get() + t * n * dv, n, dv, L, vt.get() + t * L.v_size);
    });

    AmxBf16Io io;
    io.q = q.get();
    io.q_rows = q_rows;
    io.out = ctx.get();
    io.ld_out = wc;
    if (amx)
        amx_run<Bf16Products::amx>(a, L, kt.get(), vt.get(), io);
    else
        amx_run<Bf16Products::vdp>(a, L, kt.get(), vt.get(), io);
    linear_bf16_product(rows, d_out, wc, npo, ctx.get(), p.w_o.tiles ? p.w_o.tiles : wpo.get(),
                        p.w_o.b, p.out, d_out, p.out_half, p.w_o.half);
    mha_bf16_fused_calls.fetch_add(1, std::memory_order_relaxed);
    return true;
}

#endif

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

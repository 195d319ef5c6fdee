#pragma once
// The attention core with precision="bf16" (float32 only): q, k and v rounded to bfloat16, the
// scores q.k summed in float32, the softmax statistics in float32, the probabilities rounded to
// bfloat16 for the value product (their sum stays float32), the context summed in float32.
//
// With AMX (amx_forward): per (batch, kv head) K and V are packed once into bf16; each task
// (batch, head, 64 queries; a last block of at most 32 or 16 on a half or a quarter of the tiles)
// runs an online softmax over blocks of 128 keys with both products on TDPBF16PS tiles, transposed
// (S^T = K Q^T, O^T = V^T P^T) so that the queries sit in vector lanes as in the float tiles.
// Elsewhere, or when a value row holds NaN/Inf (the float tiles' careful path), bf16_operands gives
// the float32 kernels the rounded operands and they round P themselves (AttentionProblem::bf16):
// the same numbers but for the order of the float32 sums, the keys where the running maximum moves
// and the AMX exponential's polynomial (exp2_for_bf16): a probability may round to the neighbouring
// bf16, within 2**-8 max|v| of the output (tested).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "attention_bf16_avx512.hpp"
#include "attnlab/attention.hpp"
#include "attnlab/threading.hpp"
#include "bf16.hpp"
#include "half_convert.hpp"
#include "nonfinite.hpp"
#include "scratch.hpp"
#include "softmax.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

// q, k and v rounded to bfloat16 (as floats, contiguous per (batch, head)) and the problem
// reading them: what the float32 kernels compute precision="bf16" from.
template <typename T>
struct Bf16Operands {
    Buffer<T> q, k, v;
    AttentionProblem<T> p;
};

template <typename T>
void round_stack(const AttentionProblem<T>& p, Index heads, Index rows, Index cols,
                 const MatrixStack<const T>& src, Buffer<T>& buf, MatrixStack<const T>& dst) {
    buf = make_buffer<T>(p.batch * heads * rows * cols);
    T* base = buf.get();
    parallel_for(p.batch * heads, [&](Index t) {
        const T* s = src.at(t / heads, t % heads);
        T* d = base + t * rows * cols;
        for (Index i = 0; i < rows; ++i) {
            if constexpr (std::is_same_v<T, float>) {
                round_bf16_block(s + i * src.row_stride, cols, d + i * cols);  // one pass
            } else {
                std::copy(s + i * src.row_stride, s + i * src.row_stride + cols, d + i * cols);
            }
        }
    });
    dst = {base, heads * rows * cols, rows * cols, cols};
}

// Whether bfloat16 bits hold a subnormal or a NaN, the values rounding to bf16 changes
inline bool bf16_special(Index batch, Index heads, Index rows, Index cols,
                         const MatrixStack<const std::uint16_t>& s) {
    std::atomic<bool> found{false};
    parallel_for(batch * heads, [&](Index t) {
        bool special = false;
        for (Index i = 0; i < rows; ++i)
            special =
                bf16_bits_special(s.at(t / heads, t % heads) + i * s.row_stride, cols) || special;
        if (special) found.store(true, std::memory_order_relaxed);
    });
    return found.load();
}

// (r.p rounds the probabilities when p does: its operands are rounded already)
template <typename T>
Bf16Operands<T> bf16_operands(const AttentionProblem<T>& p) {
    Bf16Operands<T> r;
    r.p = p;
    round_stack(p, p.heads, p.n_q, p.d, p.q, r.q, r.p.q);
    round_stack(p, p.kv_heads, p.n_k, p.d, p.k, r.k, r.p.k);
    round_stack(p, p.kv_heads, p.n_k, p.d_v, p.v, r.v, r.p.v);
    return r;
}

#if defined(ATTNLAB_AMX)
constexpr Index kAmxQ = 64;   // queries per task: 16-column tiles, vectors of 16
constexpr Index kAmxK = 128;  // keys per softmax block (the emulation's: kTileKBf16)

inline Index round_up(Index n, Index m) { return (n + m - 1) / m * m; }

// The bf16 operands of one (batch, kv head) for the transposed products S^T = K Q^T and
// O^T = V^T P^T, which put the 64 queries of a task along the tiles' columns: the softmax then runs
// down the keys with the queries in vector lanes (no reduction across lanes, no per-query scalar
// work). K is kept row-major (A tiles: 16 keys x 32 features), V transposed (A tiles: 16 value
// columns x 32 keys); keys are zero-padded to whole 32-key chunks, features and value columns to
// whole 32s.
struct AmxPacked {
    Index kp = 0, vp = 0, n_pad = 0;
    std::size_t k_size = 0, v_size = 0;
};

inline AmxPacked amx_layout(Index n_k, Index d, Index dv) {
    AmxPacked a;
    a.n_pad = round_up(std::max<Index>(n_k, 1), 32);
    a.kp = round_up(std::max<Index>(d, 1), 32);
    a.vp = round_up(std::max<Index>(dv, 1), 32);
    a.k_size = static_cast<std::size_t>(a.n_pad * a.kp);
    a.v_size = static_cast<std::size_t>(a.vp * a.n_pad);
    return a;
}

// Packs K and V of one (batch, kv head), float32 or half-precision bits of p.half (S); false
// when a value row holds NaN or Inf.
template <typename S>
ATTNLAB_AMX_TARGET inline bool amx_pack(const AttentionProblem<float>& p, const S* k, Index ks,
                                        const S* v, Index vs, const AmxPacked& L, std::uint16_t* kt,
                                        std::uint16_t* vt) {
    const Index d = p.d, dv = p.d_v, nk = p.n_k;
    // V^T row c: value column c of keys j0 .. j0 + 31, from two 16 x 16 transposes of V
    // (zero beyond the keys and the value columns); NaN and Inf are looked for in the same read
    const __m512i exponent = _mm512_set1_epi32(0x7f800000);
    __mmask16 nonfinite = 0;
    auto check = [&](__m512 x) ATTNLAB_AMX_TARGET {
        const __m512i e = _mm512_and_si512(_mm512_castps_si512(x), exponent);
        nonfinite |= _mm512_cmpeq_epi32_mask(e, exponent);
    };
    for (Index j0 = 0; j0 < L.n_pad; j0 += 32)
        for (Index c0 = 0; c0 < L.vp; c0 += 16) {
            const __mmask16 cols = first_lanes(dv - c0);
            __m512 lo[16], hi[16];
            for (Index r = 0; r < 16; ++r) {
                lo[r] = j0 + r < nk ? load_lanes(v + (j0 + r) * vs + c0, cols, p.half)
                                    : _mm512_setzero_ps();
                hi[r] = j0 + 16 + r < nk ? load_lanes(v + (j0 + 16 + r) * vs + c0, cols, p.half)
                                         : _mm512_setzero_ps();
            }
            for (Index r = 0; r < 16; ++r) {
                check(lo[r]);
                check(hi[r]);
            }
            transpose_16x16(lo);
            transpose_16x16(hi);
            for (Index c = 0; c < 16; ++c) {
                const __m512bh r = _mm512_cvtne2ps_pbh(hi[c], lo[c]);
                _mm512_storeu_si512(vt + (c0 + c) * L.n_pad + j0, reinterpret_cast<__m512i>(r));
            }
        }
    if (nonfinite) return false;
    pack_rows(0, L.n_pad, nk, d, k, ks, L.kp, kt, p.half);
    return true;
}

ATTNLAB_AMX_TARGET inline bool amx_pack(const AttentionProblem<float>& p, Index b, Index hk,
                                        const AmxPacked& L, std::uint16_t* kt, std::uint16_t* vt) {
    if (p.half != HalfFormat::none)
        return amx_pack(p, p.k_half.at(b, hk), p.k_half.row_stride, p.v_half.at(b, hk),
                        p.v_half.row_stride, L, kt, vt);
    return amx_pack(p, p.k.at(b, hk), p.k.row_stride, p.v.at(b, hk), p.v.row_stride, L, kt, vt);
}

// 2^t for the probabilities that are rounded to bf16 next: 2^n 2^f with f = t - n in [-1/2, 1/2]
// by a degree-4 polynomial (fitted for relative error: at most 3e-6, against bf16's 2**-9 rounding
// of the result; the float32 kernels' exp_flush is exact to about 1 ulp), 2^n by VSCALEFPS, results
// below the smallest normal float (t < -126) flushed to 0 as exp_flush does, NaN kept.
ATTNLAB_AMX_TARGET inline __m512 exp2_for_bf16(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(0.009570086374878883f), f,
                               _mm512_set1_ps(0.05591785907745361f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.2402474582195282f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.6931217908859253f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.9999992847442627f));
    const __mmask16 keep = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    return _mm512_maskz_scalef_ps(keep, y, n);
}

// The queries and the output in bf16 already, as the fused multi-head forward (mha_bf16.hpp) keeps
// them: then amx_tile neither packs q nor writes float rows.
struct AmxBf16Io {
    const std::uint16_t* q = nullptr;  // per (batch, head): q_rows rows of kp bf16
    Index q_rows = 0;                  // n_q rounded up to whole tasks (the rows past n_q zero)
    std::uint16_t* out = nullptr;      // rows (batch * n_q) of ld_out bf16, head h from h * d_v
    Index ld_out = 0;
};

// The running softmax statistics of a task's queries (16 to a vector).
struct AmxStats {
    __m512 m[kAmxQ / 16], l[kAmxQ / 16];
};

// One (batch, head, block of up to kAmxQ queries) from the packed operands. The vdp instance runs
// no tile instruction (AVX512-BF16 without AMX): its AMX target only lets the helpers inline.
template <Bf16Products products, Index G = kAmxQ / 16>
ATTNLAB_AMX_TARGET inline void amx_tile(const AttentionProblem<float>& p, const AmxPacked& L,
                                        const std::uint16_t* kt, const std::uint16_t* vt,
                                        const AmxBf16Io& io, Index b, Index h, Index i0, Index mq) {
    constexpr Index Q = 16 * G;
    const Index d = p.d, dv = p.d_v, kp = L.kp, vp = L.vp, np = L.n_pad;
    // the queries in bf16, row-major (qb), then as B tiles of the score product (qt: feature pair r
    // of query n at [(chunk * 2 + n / 16) * 512 + r * 32 + 2 (n % 16) + parity])
    std::uint16_t* qb =
        scratch<std::uint16_t>(ScratchBuffer::kBf16Queries, static_cast<std::size_t>(2 * Q * kp));
    std::uint16_t* qt = qb + Q * kp;
    // two blocks of S^T (keys x queries) and of P^T (B tiles: key pair r, query n at
    // [(chunk * 2 + n / 16) * 512 + r * 32 + 2 (n % 16) + parity]): a block's tile stores and
    // vector stores are read back one step later, not while they are still on their way to L1
    std::uint16_t* pbuf =
        scratch<std::uint16_t>(ScratchBuffer::kBf16Probs, static_cast<std::size_t>(2 * Q * kAmxK));
    float* sbuf =
        scratch<float>(ScratchBuffer::kFlashScores, static_cast<std::size_t>(2 * kAmxK * Q));
    float* acc = scratch<float>(ScratchBuffer::kFlashAccumulator,
                                static_cast<std::size_t>(vp * Q));  // O^T: value columns x queries
    const std::uint16_t* qrows = qb;
    if (io.q)
        qrows = io.q + ((b * p.heads + h) * io.q_rows + i0) * kp;
    else if (p.q_half.data)
        pack_rows(0, Q, mq, d, p.q_half.at(b, h) + i0 * p.q_half.row_stride, p.q_half.row_stride,
                  kp, qb, p.half);
    else
        pack_rows(0, Q, mq, d, p.q.at(b, h) + i0 * p.q.row_stride, p.q.row_stride, kp, qb);
    for (Index c = 0; c < kp / 32; ++c)  // 16 x 16 blocks of feature-pair words, transposed
        for (Index half = 0; half < G; ++half) {
            __m512 words[16];
            for (Index n = 0; n < 16; ++n)
                words[n] = _mm512_loadu_ps(
                    reinterpret_cast<const float*>(qrows + (half * 16 + n) * kp + c * 32));
            transpose_16x16(words);
            for (Index r = 0; r < 16; ++r)
                _mm512_store_ps(reinterpret_cast<float*>(qt + (c * G + half) * 512 + r * 32),
                                words[r]);
        }
    std::fill(acc, acc + vp * Q, 0.0f);
    const float sink = p.mask.sinks ? p.mask.sink(b, h) : neg_inf<float>();
    AmxStats st;
    for (int g = 0; g < G; ++g) {
        st.m[g] = _mm512_set1_ps(sink);
        st.l[g] = _mm512_set1_ps(sink == neg_inf<float>() ? 0.0f : 1.0f);
    }
    const float cap = static_cast<float>(p.mask.options.softcap);
    const Interval keys = keys_seen(p.mask, p.n_q, p.n_k, i0, i0 + mq);
    const Index first = keys.lo / 32 * 32;
    // blocks end at whole multiples of kAmxK (the first one starts where the band does), so a
    // row's blocks do not depend on its query tile: a window gives its band-as-mask's bits
    auto block_keys = [&](Index j0) { return std::min(keys.hi, (j0 / kAmxK + 1) * kAmxK) - j0; };
    // S^T = K Q^T for the keys [j0, j0 + kbp) into sb (row stride Q)
    auto scores = [&](Index j0, float* sb) ATTNLAB_AMX_TARGET {
        const Index kbp = round_up(block_keys(j0), 32);
        if constexpr (products == Bf16Products::vdp)
            return vdp_scores(kt, kp, qt, G, Q, j0, kbp, sb);
        for (Index jc = 0; jc < kbp; jc += 32)
            for (Index g = 0; g < G; g += 2) {  // the K tiles stay in L1 for the next g
                if constexpr (G == 1) {
                    zero_2x1();
                    for (Index c = 0; c < kp / 32; ++c)
                        dp_2x1(kt + (j0 + jc) * kp + c * 32, kp, qt + c * 512);
                    store_2x1(sb + jc * Q, Q);
                    continue;
                }
                zero_2x2();
                for (Index c = 0; c < kp / 32; ++c)
                    dp_2x2(kt + (j0 + jc) * kp + c * 32, kp, qt + (c * G + g) * 512,
                           qt + (c * G + g + 1) * 512);
                store_2x2(sb + jc * Q + g * 16, Q);
            }
    };
    // O^T += V^T P^T for the keys [j0, j0 + kbp), 32 value columns x 32 queries at a time
    auto values = [&](Index j0, const std::uint16_t* pb) ATTNLAB_AMX_TARGET {
        const Index kbp = round_up(block_keys(j0), 32);
        if constexpr (products == Bf16Products::vdp)
            return vdp_values(vt, np, vp, pb, G, Q, j0, kbp, acc);
        for (Index cb = 0; cb < vp; cb += 32)
            for (Index g = 0; g < G; g += 2) {  // the V^T tiles stay in L1 for the next g
                if constexpr (G == 1) {
                    load_2x1(acc + cb * Q, Q);
                    for (Index jc = 0; jc < kbp; jc += 32)
                        dp_2x1(vt + cb * np + j0 + jc, np, pb + (jc / 32) * 512);
                    store_2x1(acc + cb * Q, Q);
                    continue;
                }
                load_2x2(acc + cb * Q + g * 16, Q);
                for (Index jc = 0; jc < kbp; jc += 32)
                    dp_2x2(vt + cb * np + j0 + jc, np, pb + ((jc / 32) * G + g) * 512,
                           pb + ((jc / 32) * G + g + 1) * 512);
                store_2x2(acc + cb * Q + g * 16, Q);
            }
    };
    const __m512 ninf = _mm512_set1_ps(neg_inf<float>()), zero = _mm512_setzero_ps();
    const __m512 one = _mm512_set1_ps(1.0f);
    if constexpr (products == Bf16Products::amx) tiles_on();
    if (first < keys.hi) scores(first, sbuf);
    Index pending = -1;  // the block whose V^T P^T is still to be added to acc
    const std::uint16_t* pending_p = nullptr;
    for (Index j0 = first, kb = 0, step = 0; j0 < keys.hi; j0 += kb, ++step) {
        kb = block_keys(j0);
        const Index kbp = round_up(kb, 32);
        float* s = sbuf + (step & 1) * kAmxK * Q;
        std::uint16_t* pb = pbuf + (step & 1) * Q * kAmxK;
        // the scale goes into the exponential's FMA unless masks or the cap need scaled scores
        const bool masked = tile_needs_mask(p.mask, p.n_q, p.n_k, i0, i0 + mq, j0, j0 + kb);
        const bool fused = p.scale > 0 && !(cap > 0) && !masked;
        if (!fused) {
            const __m512 sc = _mm512_set1_ps(p.scale);
            for (Index e = 0; e < kb * Q; e += 16)
                _mm512_store_ps(s + e, _mm512_mul_ps(sc, _mm512_load_ps(s + e)));
            if (cap > 0) softcap_scores(cap, s, kb * Q, (float*)nullptr);
            if (masked) apply_mask(p.mask, b, h, p.n_q, p.n_k, i0, j0, mq, kb, s, Index(1), Q);
        }
        const __m512 sc = _mm512_set1_ps(fused ? p.scale : 1.0f);
        // the block's maxima down the keys (four chains per half: the max's latency)
        __m512 mx[G][4];
        for (int g = 0; g < G; ++g)
            for (int u = 0; u < 4; ++u) mx[g][u] = ninf;
        Index j = 0;
        for (; j + 4 <= kb; j += 4)
            for (int u = 0; u < 4; ++u)
                for (int g = 0; g < G; ++g)
                    mx[g][u] = _mm512_max_ps(mx[g][u], _mm512_load_ps(s + (j + u) * Q + g * 16));
        for (; j < kb; ++j)
            for (int g = 0; g < G; ++g)
                mx[g][0] = _mm512_max_ps(mx[g][0], _mm512_load_ps(s + j * Q + g * 16));
        __m512 shift[G], alpha[G], m_new[G];
        bool moved = false;
        for (int g = 0; g < G; ++g) {
            const __m512 bm = _mm512_mul_ps(sc, _mm512_max_ps(_mm512_max_ps(mx[g][0], mx[g][1]),
                                                              _mm512_max_ps(mx[g][2], mx[g][3])));
            // a NaN score reaches the query via its sum
            m_new[g] =
                _mm512_mask_blend_ps(_mm512_cmp_ps_mask(st.m[g], bm, _CMP_LT_OQ), st.m[g], bm);
            shift[g] = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new[g], ninf, _CMP_EQ_OQ),
                                            m_new[g], zero);
            alpha[g] = exp_flush(_mm512_sub_ps(st.m[g], shift[g]));  // exp(0) = 1: most blocks
            alpha[g] =
                _mm512_mask_blend_ps(_mm512_cmp_ps_mask(st.m[g], ninf, _CMP_EQ_OQ), alpha[g], zero);
            moved |= _mm512_cmp_ps_mask(alpha[g], one, _CMP_NEQ_UQ) != 0;
        }
        if (moved) {
            if (pending >= 0) values(pending, pending_p);
            pending = -1;
            for (Index c = 0; c < vp; ++c)
                for (int g = 0; g < G; ++g) {
                    float* a = acc + c * Q + g * 16;
                    _mm512_store_ps(a, _mm512_mul_ps(alpha[g], _mm512_load_ps(a)));
                }
        }
        // P^T = exp(sc S^T - shift) rounded to bf16, two keys a row of the B tiles
        const __m512 vs = _mm512_mul_ps(sc, _mm512_set1_ps(1.44269504088896341f));
        __m512 vm[G], sum[G][2];
        for (int g = 0; g < G; ++g) {
            vm[g] = _mm512_mul_ps(shift[g], _mm512_set1_ps(1.44269504088896341f));
            sum[g][0] = sum[g][1] = zero;
        }
        // keys 2r and 2r + 1 into row r % 16 of the block's B tiles; past kb (the padding of
        // the last block) a probability is 0
        auto pair = [&](Index r, auto tail) ATTNLAB_AMX_TARGET {
            std::uint16_t* row = pb + (r / 16) * G * 512 + (r % 16) * 32;
            for (int g = 0; g < G; ++g) {
                auto e = [&](Index j) ATTNLAB_AMX_TARGET {
                    if (tail && j >= kb) return zero;
                    return exp2_for_bf16(
                        _mm512_fmsub_ps(_mm512_load_ps(s + j * Q + g * 16), vs, vm[g]));
                };
                const __m512 e0 = e(2 * r), e1 = e(2 * r + 1);
                sum[g][0] = _mm512_add_ps(sum[g][0], e0);
                sum[g][1] = _mm512_add_ps(sum[g][1], e1);
                _mm512_store_si512(row + g * 512, interleave_bf16(e0, e1));
            }
        };
        Index r = 0;
        for (; r < kb / 2; ++r) pair(r, std::false_type{});
        for (; r < kbp / 2; ++r) pair(r, std::true_type{});
        for (int g = 0; g < G; ++g) {
            st.l[g] = _mm512_fmadd_ps(st.l[g], alpha[g], _mm512_add_ps(sum[g][0], sum[g][1]));
            st.m[g] = m_new[g];
        }
        const Index next = j0 + kb;
        if (next < keys.hi) scores(next, sbuf + ((step + 1) & 1) * kAmxK * Q);
        if (pending >= 0) values(pending, pending_p);
        pending = j0;
        pending_p = pb;
    }
    if (pending >= 0) values(pending, pending_p);
    if constexpr (products == Bf16Products::amx) tiles_off();
    alignas(64) float m[Q], l[Q];
    for (int g = 0; g < G; ++g) {
        _mm512_store_ps(m + g * 16, st.m[g]);
        _mm512_store_ps(l + g * 16, st.l[g]);
    }
    // out = O / l (0 where l = 0): 16 x 16 blocks of O^T transposed into the queries' rows
    for (Index c = 0; c < dv; ++c)
        for (int g = 0; g < G; ++g) {
            float* a = acc + c * Q + g * 16;
            const __mmask16 seen = _mm512_cmp_ps_mask(st.l[g], zero, _CMP_NEQ_UQ);
            _mm512_store_ps(a, _mm512_maskz_div_ps(seen, _mm512_load_ps(a), st.l[g]));
        }
    for (Index c0 = 0; c0 < dv; c0 += 16) {
        const __mmask16 in = first_lanes(dv - c0);
        for (Index g = 0; g * 16 < mq; ++g) {
            __m512 o[16];
            for (Index r = 0; r < 16; ++r) o[r] = _mm512_load_ps(acc + (c0 + r) * Q + g * 16);
            transpose_16x16(o);
            for (Index n = 0; n < std::min<Index>(16, mq - g * 16); ++n) {
                const Index i = i0 + g * 16 + n;
                if (io.out) {
                    _mm256_mask_storeu_epi16(io.out + (b * p.n_q + i) * io.ld_out + h * dv + c0, in,
                                             reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(o[n])));
                } else if (p.out_half.data) {  // rounded as stored, as narrow_block rounds
                    alignas(64) float row[16];
                    _mm512_store_ps(row, o[n]);
                    narrow_block(row, std::min<Index>(16, dv - c0), p.half,
                                 p.out_half.at(b, h) + i * p.out_half.row_stride + c0);
                } else {
                    _mm512_mask_storeu_ps(p.out.at(b, h) + i * p.out.row_stride + c0, in, o[n]);
                }
            }
        }
    }
    if (p.lse)
        for (Index i = 0; i < mq; ++i)
            p.lse[(b * p.heads + h) * p.n_q + i0 + i] =
                l[i] == 0.0f ? neg_inf<float>() : m[i] + std::log(l[i]);
}

// The tasks of the AMX (or VDPBF16PS) forward over K and V packed per (batch, kv head) at kt + slot
// L.k_size and vt + slot L.v_size.
template <Bf16Products products>
inline void amx_run(const AttentionProblem<float>& p, const AmxPacked& L, const std::uint16_t* kt,
                    const std::uint16_t* vt, const AmxBf16Io& io) {
    const Index q_tiles = (p.n_q + kAmxQ - 1) / kAmxQ;
    const Index group = p.heads / p.kv_heads;
    parallel_for(p.batch * p.heads * q_tiles, [&](Index t) {
        const Index qt = t % q_tiles, h = (t / q_tiles) % p.heads, b = t / (q_tiles * p.heads);
        const Index slot = b * p.kv_heads + h / group;
        const Index i0 = qt * kAmxQ, mq = std::min(kAmxQ, p.n_q - i0);
        const std::uint16_t *k = kt + slot * L.k_size, *v = vt + slot * L.v_size;
        // a last block of few queries: a half or a quarter of the tiles, the same sums
        if (mq <= kAmxQ / 4)
            amx_tile<products, 1>(p, L, k, v, io, b, h, i0, mq);
        else if (mq <= kAmxQ / 2)
            amx_tile<products, kAmxQ / 32>(p, L, k, v, io, b, h, i0, mq);
        else
            amx_tile<products>(p, L, k, v, io, b, h, i0, mq);
    });
}

// The AMX (or VDPBF16PS) forward; false (nothing written) when a value row holds NaN or Inf.
template <Bf16Products products = Bf16Products::amx>
inline bool amx_forward(const AttentionProblem<float>& p) {
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
    amx_run<products>(p, L, kt.get(), vt.get(), AmxBf16Io{});
    return true;
}
#endif

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

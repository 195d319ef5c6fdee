#pragma once
// The attention core with precision="bf16" (float32 only): q, k and v rounded to bfloat16, the
// scores q.k summed in float32, the softmax statistics in float32, the probabilities rounded to
// bfloat16 for the value product (their sum stays float32), the context summed in float32.
//
// With AMX (amx_forward): per (batch, kv head) K and V are packed once into bf16 tiles; each task
// (batch, head, 32 queries) runs an online softmax over blocks of 128 keys with both products on
// TDPBF16PS tiles. Elsewhere, or when a value row holds NaN/Inf (the float tiles' careful path),
// bf16_operands gives the float32 kernels the rounded operands and they round P themselves
// (AttentionProblem::bf16): the same numbers but for the order of the float32 sums, the keys where
// the running maximum moves and the AMX exponential's polynomial (exp2_for_bf16): a probability
// may round to the neighbouring bf16, within 2**-8 max|v| of the output (tested).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "attnlab/attention.hpp"
#include "attnlab/threading.hpp"
#include "bf16.hpp"
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
            std::copy(s + i * src.row_stride, s + i * src.row_stride + cols, d + i * cols);
            round_bf16_inplace(d + i * cols, cols);
        }
    });
    dst = {base, heads * rows * cols, rows * cols, cols};
}

// (r.p rounds the probabilities when p does: its operands are rounded already)
template <typename T>
Bf16Operands<T> bf16_operands(const AttentionProblem<T>& p) {
    Bf16Operands<T> r;
    r.p = p;
    r.p.bf16 = p.bf16 == Bf16::probabilities ? Bf16::probabilities : Bf16::none;
    round_stack(p, p.heads, p.n_q, p.d, p.q, r.q, r.p.q);
    round_stack(p, p.kv_heads, p.n_k, p.d, p.k, r.k, r.p.k);
    round_stack(p, p.kv_heads, p.n_k, p.d_v, p.v, r.v, r.p.v);
    return r;
}

#if defined(ATTNLAB_AMX)
constexpr Index kAmxQ = 32;   // queries per task: two row tiles
constexpr Index kAmxK = 128;  // keys per softmax block (the float flash tiles' kTileK)

inline Index round_up(Index n, Index m) { return (n + m - 1) / m * m; }

// The bf16 tiles of one (batch, kv head): K as B tiles of the score product (pair r of features
// (2r, 2r + 1) of key n at [(chunk * key_tiles + n / 16) * 512 + r * 32 + 2 (n % 16) + parity]),
// V as B tiles of the value product (pair r of keys, column n of a 16-column block). Keys are
// zero-padded to whole 32-key chunks, features to whole 32-feature chunks.
struct AmxPacked {
    Index key_tiles = 0, kp = 0, vp = 0, n_pad = 0;
    std::size_t k_size = 0, v_size = 0;
};

inline AmxPacked amx_layout(Index n_k, Index d, Index dv) {
    AmxPacked a;
    a.n_pad = round_up(std::max<Index>(n_k, 1), 32);
    a.key_tiles = a.n_pad / 16;
    a.kp = round_up(std::max<Index>(d, 1), 32);
    a.vp = round_up(std::max<Index>(dv, 1), 32);
    a.k_size = static_cast<std::size_t>(a.kp * a.n_pad);
    a.v_size = static_cast<std::size_t>(a.n_pad * a.vp);
    return a;
}

// Packs K and V of one (batch, kv head); false when a value row holds NaN or Inf.
ATTNLAB_BF16_TARGET inline bool amx_pack(const AttentionProblem<float>& p, Index b, Index hk,
                                         const AmxPacked& L, std::uint16_t* kt, std::uint16_t* vt) {
    const float* k = p.k.at(b, hk);
    const float* v = p.v.at(b, hk);
    const Index ks = p.k.row_stride, vs = p.v.row_stride, d = p.d, dv = p.d_v, nk = p.n_k;
    alignas(64) float buf[32];
    // K: for each 16-key tile and 32-feature chunk, key n's 16 feature pairs go down column n
    // (the 16 keys converted into rows of pairs, then each row of the tile gathered from them)
    alignas(64) std::uint32_t keys16[16 * 16];
    const __m512i column =
        _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                           _mm512_set1_epi32(16));
    for (Index jt = 0; jt < L.key_tiles; ++jt)
        for (Index c0 = 0; c0 < L.kp; c0 += 32) {
            std::uint32_t* tile =
                reinterpret_cast<std::uint32_t*>(kt + ((c0 / 32) * L.key_tiles + jt) * 512);
            for (Index n = 0; n < 16; ++n) {
                const Index j = jt * 16 + n;
                std::uint16_t* dst = reinterpret_cast<std::uint16_t*>(keys16 + n * 16);
                if (j < nk && c0 + 32 <= d) {
                    to_bf16(k + j * ks + c0, dst);
                    continue;
                }
                for (Index t = 0; t < 32; ++t)
                    buf[t] = j < nk && c0 + t < d ? k[j * ks + c0 + t] : 0.0f;
                to_bf16(buf, dst);
            }
            for (Index r = 0; r < 16; ++r)
                _mm512_store_si512(tile + r * 16,
                                   _mm512_i32gather_epi32(
                                       _mm512_add_epi32(column, _mm512_set1_epi32(r)), keys16, 4));
        }
    // V: for each 32-key chunk and 16-column block, keys (2r, 2r + 1) interleaved in row r
    bool finite = true;
    for (Index j = 0; j < nk; ++j) finite &= !nonfinite_row(v + j * vs, dv);
    if (!finite) return false;
    const Index col_tiles = L.vp / 16;
    for (Index j0 = 0; j0 < L.n_pad; j0 += 32)
        for (Index cb = 0; cb < col_tiles; ++cb) {
            std::uint16_t* tile = vt + ((j0 / 32) * col_tiles + cb) * 512;
            for (Index r = 0; r < 16; ++r)
                _mm512_store_si512(tile + r * 32, vnni_row(v, vs, nk, dv, j0 + 2 * r, cb * 16));
        }
    return true;
}

// Lanes [c, c + 16) of a score row of kb entries (-inf beyond).
ATTNLAB_BF16_TARGET inline __m512 score_lanes(const float* s, Index c, Index kb) {
    const Index left = kb - c;
    const __mmask16 in = left >= 16  ? __mmask16(0xffff)
                         : left <= 0 ? __mmask16(0)
                                     : __mmask16((1u << left) - 1);
    return _mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf<float>()), in, s + c);
}

// Maximum of sc * s over a row of kb scores (sc > 0: the maximum of the scaled scores, as
// rounding is monotone).
ATTNLAB_BF16_TARGET inline float scaled_row_max(const float* s, float sc, Index kb) {
    __m512 mx = _mm512_set1_ps(neg_inf<float>());
    for (Index c = 0; c < kb; c += 16) mx = _mm512_max_ps(mx, score_lanes(s, c, kb));
    return sc * _mm512_reduce_max_ps(mx);
}

// 2^t for the probabilities that are rounded to bf16 next: 2^n 2^f with f = t - n in [-1/2, 1/2]
// by a degree-4 polynomial (fitted for relative error: at most 3e-6, against bf16's 2**-9 rounding
// of the result; the float32 kernels' exp_flush is exact to about 1 ulp), 2^n by VSCALEFPS, results
// below the smallest normal float (t < -126) flushed to 0 as exp_flush does, NaN kept.
ATTNLAB_BF16_TARGET inline __m512 exp2_for_bf16(__m512 t) {
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

// exp(sc * s - shift) over a row of kb scores (as 2^(s sc log2 e - shift log2 e)): the sum
// returned in float32, the values rounded to bf16 into pr (zero up to kbp, a multiple of 32).
ATTNLAB_BF16_TARGET inline float exp_row_bf16(const float* s, float sc, float shift, Index kb,
                                              Index kbp, std::uint16_t* pr) {
    constexpr float kLog2e = 1.44269504088896341f;
    const __m512 vs = _mm512_set1_ps(sc * kLog2e), vm = _mm512_set1_ps(shift * kLog2e);
    __m512 sum = _mm512_setzero_ps();
    for (Index c = 0; c < kbp; c += 32) {
        const __m512 e0 = exp2_for_bf16(_mm512_fmsub_ps(score_lanes(s, c, kb), vs, vm));
        const __m512 e1 = exp2_for_bf16(_mm512_fmsub_ps(score_lanes(s, c + 16, kb), vs, vm));
        sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
        _mm512_storeu_si512(pr + c, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0)));
    }
    return _mm512_reduce_add_ps(sum);
}

// One (batch, head, block of up to 32 queries) from the packed tiles.
ATTNLAB_AMX_TARGET inline void amx_tile(const AttentionProblem<float>& p, const AmxPacked& L,
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
    alignas(64) float buf[32];
    const float* q = p.q.at(b, h) + i0 * p.q.row_stride;
    for (Index i = 0; i < kAmxQ; ++i)
        for (Index c0 = 0; c0 < kp; c0 += 32) {
            for (Index t = 0; t < 32; ++t)
                buf[t] = i < mq && c0 + t < d ? q[i * p.q.row_stride + c0 + t] : 0.0f;
            to_bf16(buf, qb + i * kp + c0);
        }
    std::fill(pb, pb + kAmxQ * kAmxK, std::uint16_t(0));
    std::fill(acc, acc + kAmxQ * vp, 0.0f);
    const float sink = p.mask.sinks ? p.mask.sink(b, h) : neg_inf<float>();
    std::fill(m, m + kAmxQ, sink);
    std::fill(l, l + kAmxQ, sink == neg_inf<float>() ? 0.0f : 1.0f);
    const float cap = static_cast<float>(p.mask.options.softcap);
    const Interval keys = keys_seen(p.mask, p.n_q, p.n_k, i0, i0 + mq);
    // S = Q K^T for keys [j0 + jc, j0 + jc + 32) of a block into buffer sb. (Issuing the next
    // block's products between the rows of this block's softmax measured no faster.)
    auto scores = [&](Index j0, Index jc, float* sb) {
        zero_2x2();
        const Index jt = (j0 + jc) / 16;
        for (Index c = 0; c < kp / 32; ++c) {
            const std::uint16_t* kc = kt + (c * L.key_tiles + jt) * 512;
            dp_2x2(qb + c * 32, kp, kc, kc + 512);
        }
        store_2x2(sb + jc, kAmxK);
    };
    tiles_on();
    for (Index j0 = keys.lo / 32 * 32; j0 < keys.hi; j0 += kAmxK) {
        const Index kb = std::min(kAmxK, keys.hi - j0), kbp = round_up(kb, 32);
        for (Index jc = 0; jc < kbp; jc += 32) scores(j0, jc, s);
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
        // acc += P V, 32 queries x 32 value columns at a time
        for (Index cb = 0; cb < vp / 16; cb += 2) {
            load_2x2(acc + cb * 16, vp);
            for (Index jc = 0; jc < kbp; jc += 32) {
                const std::uint16_t* vb = vt + (((j0 + jc) / 32) * col_tiles + cb) * 512;
                dp_2x2(pb + jc, kAmxK, vb, vb + 512);
            }
            store_2x2(acc + cb * 16, vp);
        }
    }
    tiles_off();
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

// The AMX forward; false (nothing written) when a value row holds NaN or Inf.
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
    const Index q_tiles = (p.n_q + kAmxQ - 1) / kAmxQ;
    const Index group = p.heads / p.kv_heads;
    parallel_for(p.batch * p.heads * q_tiles, [&](Index t) {
        const Index qt = t % q_tiles, h = (t / q_tiles) % p.heads, b = t / (q_tiles * p.heads);
        const Index slot = b * p.kv_heads + h / group;
        amx_tile(p, L, kt.get() + slot * L.k_size, vt.get() + slot * L.v_size, b, h, qt * kAmxQ,
                 std::min(kAmxQ, p.n_q - qt * kAmxQ));
    });
    return true;
}
#endif

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

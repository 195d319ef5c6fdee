#pragma once
// The decode path of the attention forward: few query rows per key/value head (decoding with a
// cache, n_q * heads / kv_heads <= kDecodeRows) against many keys, split along the keys
// (FlashDecoding): each task streams one split of K and V once for all the query heads of its
// group, keeps a partial online softmax, and a last pass merges the splits by their maxima and
// sums in a fixed order. The flash tile would put these few queries in vector lanes padded to a
// packet (16 lanes for one query with AVX-512) and read K and V once per query head.
//
// Shapes per (batch b, kv head hk): the R = group * n_q rows r = g * n_q + i (query head
// hk * group + g, query i); K (n_k x d), V (n_k x d_v) through their strides.

#include <algorithm>
#include <cmath>

#include "attnlab/attention.hpp"
#include "attnlab/threading.hpp"
#include "bf16.hpp"
#include "microkernel.hpp"
#include "scratch.hpp"
#include "softmax.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

constexpr Index kDecodeRows = 16;       // query rows per kv head up to which the decode path runs
constexpr Index kDecodeSplit = 512;     // keys per split: the task grid depends on n_k alone
constexpr Index kDecodeBlock = 64;      // keys per block inside a split (scores of R rows in L1)
constexpr Index kDecodeHalfBlock = 16;  // the same from half-precision K and V
constexpr Index kDecodePrefetch = 32;   // rows ahead a streamed key or value row is requested

inline bool use_decode(Index n_q, Index heads, Index kv_heads, Index n_k) {
    return n_q * (heads / kv_heads) <= kDecodeRows && n_k >= 2 * kDecodeSplit;
}

// Partial results of one split: unnormalised context, running max and sum per row.
template <typename T>
struct DecodeParts {
    T* acc = nullptr;  // (splits, batch, heads, n_q, d_v)
    T* m = nullptr;    // (splits, batch, heads, n_q)
    T* l = nullptr;
};

// s[j] = q . k_j for four keys at a time (four independent FMA chains over the head width).
template <typename T>
void decode_scores(const T* q, const T* k, Index ks, Index kb, Index d, T* s, bool prefetch) {
    namespace ei = Eigen::internal;
    using Packet = PacketOf<T>;
    constexpr Index L = packet_size<T>();
    const Index dv = d / L * L;
    Index j = 0;
    for (; j + 4 <= kb; j += 4) {
        const T* k0 = k + j * ks;
        if (prefetch)  // the keys kDecodePrefetch rows on, requested as these are read
            for (Index u = 0; u < 4; ++u)
                for (Index b = 0; b < d * Index(sizeof(T)); b += 64)
                    __builtin_prefetch(
                        reinterpret_cast<const char*>(k0 + (kDecodePrefetch + u) * ks) + b, 0, 3);
        Packet a0 = ei::pset1<Packet>(T(0)), a1 = a0, a2 = a0, a3 = a0;
        for (Index c = 0; c < dv; c += L) {
            const Packet x = ei::ploadu<Packet>(q + c);
            a0 = ei::pmadd(x, ei::ploadu<Packet>(k0 + c), a0);
            a1 = ei::pmadd(x, ei::ploadu<Packet>(k0 + ks + c), a1);
            a2 = ei::pmadd(x, ei::ploadu<Packet>(k0 + 2 * ks + c), a2);
            a3 = ei::pmadd(x, ei::ploadu<Packet>(k0 + 3 * ks + c), a3);
        }
        T t[4] = {ei::predux(a0), ei::predux(a1), ei::predux(a2), ei::predux(a3)};
        for (Index c = dv; c < d; ++c)
            for (int u = 0; u < 4; ++u) t[u] += q[c] * k0[u * ks + c];
        for (int u = 0; u < 4; ++u) s[j + u] = t[u];
    }
    for (; j < kb; ++j) {
        const T* kj = k + j * ks;
        Packet a = ei::pset1<Packet>(T(0));
        for (Index c = 0; c < dv; c += L)
            a = ei::pmadd(ei::ploadu<Packet>(q + c), ei::ploadu<Packet>(kj + c), a);
        T t = ei::predux(a);
        for (Index c = dv; c < d; ++c) t += q[c] * kj[c];
        s[j] = t;
    }
}

// One task: rows of (b, hk) against keys [j_lo, j_hi) of split sp.
template <typename T>
void decode_split(const AttentionProblem<T>& p, const DecodeParts<T>& parts, Index sp, Index b,
                  Index hk, Index j_lo, Index j_hi) {
    namespace ei = Eigen::internal;
    using Packet = PacketOf<T>;
    constexpr Index L = packet_size<T>();
    const Index group = p.heads / p.kv_heads, R = group * p.n_q;
    const Index d = p.d, dv = p.d_v, kbp = kDecodeBlock;
    const Index dvp = (dv + L - 1) / L * L;
    T* qs = scratch<T>(ScratchBuffer::kDecodeQueries, static_cast<std::size_t>(R * d));
    T* sc = scratch<T>(ScratchBuffer::kDecodeScores, static_cast<std::size_t>(2 * R * kbp));
    T* pr = sc + R * kbp;
    T* acc = scratch<T>(ScratchBuffer::kDecodeAccumulator, static_cast<std::size_t>(R * dvp));
    T m[kDecodeRows], l[kDecodeRows];
    for (Index g = 0; g < group; ++g)
        for (Index i = 0; i < p.n_q; ++i) {
            const T* q = p.q.at(b, hk * group + g) + i * p.q.row_stride;
            for (Index c = 0; c < d; ++c) qs[(g * p.n_q + i) * d + c] = p.scale * q[c];
        }
    std::fill(acc, acc + R * dvp, T(0));
    std::fill(m, m + R, neg_inf<T>());
    std::fill(l, l + R, T(0));
    const T* kbase = p.k.at(b, hk);
    const T* vbase = p.v.at(b, hk);
    const std::uint16_t* kbase16 = p.half != HalfFormat::none ? p.k_half.at(b, hk) : nullptr;
    const std::uint16_t* vbase16 = p.half != HalfFormat::none ? p.v_half.at(b, hk) : nullptr;
    const bool capped = p.mask.options.softcap > 0;
    // half-precision keys and values are widened a block at a time: blocks small enough that the
    // widened copies stay in L1 with the scores
    const Index step = p.half != HalfFormat::none ? kDecodeHalfBlock : kbp;
    for (Index j0 = j_lo; j0 < j_hi; j0 += step) {
        const Index kb = std::min(step, j_hi - j0);
        const T* kblock = kbase + j0 * p.k.row_stride;
        const T* vblock = vbase + j0 * p.v.row_stride;
        Index ks = p.k.row_stride, vs = p.v.row_stride;
        if constexpr (std::is_same_v<T, float>) {
            if (p.half != HalfFormat::none) {  // the block's keys and values, read once, as floats
                float* kf = scratch<float>(ScratchBuffer::kDecodeKeys, std::size_t(kbp * d));
                float* vf = scratch<float>(ScratchBuffer::kDecodeValues, std::size_t(kbp * dv));
                half_rows_to_float(kbase16 + j0 * p.k_half.row_stride, p.k_half.row_stride, kb, d,
                                   p.half, kf);
                half_rows_to_float(vbase16 + j0 * p.v_half.row_stride, p.v_half.row_stride, kb, dv,
                                   p.half, vf);
                kblock = kf;
                vblock = vf;
                ks = d;
                vs = dv;
            }
        }
        // the first row streams the keys from memory (prefetching ahead); the others reread them
        for (Index r = 0; r < R; ++r)
            decode_scores(qs + r * d, kblock, ks, kb, d, sc + r * kbp,
                          r == 0 && p.half == HalfFormat::none);
        for (Index g = 0; g < group; ++g) {
            T* sg = sc + g * p.n_q * kbp;
            if (capped)
                for (Index i = 0; i < p.n_q; ++i)
                    softcap_scores(static_cast<T>(p.mask.options.softcap), sg + i * kbp, kb,
                                   (T*)nullptr);
            if (tile_needs_mask(p.mask, p.n_q, p.n_k, Index(0), p.n_q, j0, j0 + kb))
                apply_mask(p.mask, b, hk * group + g, p.n_q, p.n_k, Index(0), j0, p.n_q, kb, sg,
                           kbp, Index(1));
        }
        // online softmax per row; pr = exp(s - m_new)
        for (Index r = 0; r < R; ++r) {
            const T* s = sc + r * kbp;
            const T bm = row_max(s, kb);
            const T mn = m[r] < bm ? bm : m[r];  // a NaN score reaches the row through its sum
            const T shift = mn == neg_inf<T>() ? T(0) : mn;
            const T sum = exp_row(s, shift, pr + r * kbp, kb);
            if (p.bf16 == Bf16::probabilities)
                round_bf16_inplace(pr + r * kbp, kb);  // the sum took them unrounded
            const T alpha = m[r] == neg_inf<T>() ? T(0) : std::exp(m[r] - shift);
            l[r] = l[r] * alpha + sum;
            m[r] = mn;
            if (alpha != T(1)) {
                const Packet a = ei::pset1<Packet>(alpha);
                T* ar = acc + r * dvp;
                for (Index c = 0; c < dvp; c += L)
                    ei::pstore(ar + c, ei::pmul(a, ei::pload<Packet>(ar + c)));
            }
        }
        // acc_r += sum_j p_rj v_j, each value row read once for the R rows; a key a row may
        // not see (masked logit -inf) is skipped, so its value (even NaN) is never read for it
        for (Index j = 0; j < kb; ++j) {
            const T* vj = vblock + j * vs;
            if (p.half == HalfFormat::none)
                for (Index b = 0; b < dv * Index(sizeof(T)); b += 64)
                    __builtin_prefetch(reinterpret_cast<const char*>(vj + kDecodePrefetch * vs) + b,
                                       0, 3);
            for (Index r = 0; r < R; ++r) {
                if (sc[r * kbp + j] == neg_inf<T>()) continue;
                const T w = pr[r * kbp + j];
                const Packet pw = ei::pset1<Packet>(w);
                T* ar = acc + r * dvp;
                Index c = 0;
                for (; c + L <= dv; c += L)
                    ei::pstore(ar + c, ei::pmadd(pw, ei::ploadu<Packet>(vj + c),
                                                 ei::pload<Packet>(ar + c)));
                for (; c < dv; ++c) ar[c] += w * vj[c];
            }
        }
    }
    for (Index g = 0; g < group; ++g)
        for (Index i = 0; i < p.n_q; ++i) {
            const Index r = g * p.n_q + i;
            const Index row = ((sp * p.batch + b) * p.heads + hk * group + g) * p.n_q + i;
            std::copy(acc + r * dvp, acc + r * dvp + dv, parts.acc + row * dv);
            parts.m[row] = m[r];
            parts.l[row] = l[r];
        }
}

// The splits of (b, h, i) merged in split order, with the sink as one more part of logit
// `sink`, sum 1 and no value; the output row and the log-sum-exp.
template <typename T>
void decode_merge(const AttentionProblem<T>& p, const DecodeParts<T>& parts, Index splits, Index b,
                  Index h, Index i) {
    const Index rows = p.batch * p.heads * p.n_q;
    const Index row = (b * p.heads + h) * p.n_q + i;
    const T sink = p.mask.sinks ? p.mask.sink(b, h) : neg_inf<T>();
    T mx = sink;
    for (Index s = 0; s < splits; ++s) {
        const T ms = parts.m[s * rows + row];
        if (ms != ms)
            mx = ms;  // NaN propagates
        else if (mx == mx && ms > mx)
            mx = ms;
    }
    const T shift = mx == neg_inf<T>() ? T(0) : mx;
    T* out = p.out.at(b, h) + i * p.out.row_stride;
    std::fill(out, out + p.d_v, T(0));
    T total = sink == neg_inf<T>() ? T(0) : std::exp(sink - shift);
    for (Index s = 0; s < splits; ++s) {
        const T ms = parts.m[s * rows + row], ls = parts.l[s * rows + row];
        if (ls == T(0)) continue;  // a split this row saw no key of
        // NaN scores leave the max at -inf and the sum NaN: the NaN must still reach the row
        const T f = ms == neg_inf<T>() ? T(1) : std::exp(ms - shift);
        total += f * ls;
        const T* a = parts.acc + (s * rows + row) * p.d_v;
        for (Index c = 0; c < p.d_v; ++c) out[c] += f * a[c];
    }
    if (total == T(0)) {  // no key and no sink: zeros, lse -inf
        std::fill(out, out + p.d_v, T(0));
    } else {
        for (Index c = 0; c < p.d_v; ++c) out[c] /= total;
    }
    if (p.lse) p.lse[row] = total == T(0) ? neg_inf<T>() : shift + std::log(total);
}

template <typename T>
void decode_forward(const AttentionProblem<T>& p) {
    const Interval keys = keys_seen(p.mask, p.n_q, p.n_k, Index(0), p.n_q);
    const Index span = std::max<Index>(keys.hi - keys.lo, 0);
    const Index splits = std::max<Index>((span + kDecodeSplit - 1) / kDecodeSplit, 1);
    const Index rows = p.batch * p.heads * p.n_q;
    auto acc = make_buffer<T>(splits * rows * p.d_v);
    auto stats = make_buffer<T>(2 * splits * rows);
    const DecodeParts<T> parts{acc.get(), stats.get(), stats.get() + splits * rows};
    const Index per = p.batch * p.kv_heads;
    parallel_for(splits * per, [&](Index t) {
        const Index sp = t / per, b = (t % per) / p.kv_heads, hk = t % p.kv_heads;
        const Index lo = keys.lo + sp * kDecodeSplit;
        decode_split(p, parts, sp, b, hk, lo, std::min(keys.hi, lo + kDecodeSplit));
    });
    parallel_for(p.batch * p.heads, [&](Index t) {
        for (Index i = 0; i < p.n_q; ++i)
            decode_merge(p, parts, splits, t / p.heads, t % p.heads, i);
    });
}

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

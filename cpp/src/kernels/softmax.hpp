#pragma once
// Shared pieces of the softmax passes: masking a tile of scores and exponentiating a row.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "attnlab/common.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

template <typename T>
constexpr T neg_inf() {
    return -std::numeric_limits<T>::infinity();
}

// Applies the mask to a tile of scaled scores for queries i0.. (rows) and keys j0.. (cols) of
// (batch b, head h), entry (r, c) at s[r * rs + c * cs] (so either layout, queries or keys
// along rows): adds the float mask, sets disallowed entries to -inf.
template <typename T>
void apply_mask(const MaskSpec<T>& m, Index b, Index h, Index n_q, Index n_k, Index i0, Index j0,
                Index rows, Index cols, T* s, Index rs, Index cs) {
    const TokenMask& pad = m.key_padding;
    const std::uint8_t* kp = pad.data ? pad.data + b * pad.sb : nullptr;
    // Masks by key alone (a boolean mask the same for every query, key padding) set a key's
    // column at once, not an entry per row and key (docs/performance.md, "Padding masks in the
    // flash tiles"), each where the row loop had it: the boolean mask first, the padding after
    // the ALiBi term (-inf minus an infinite term would be NaN).
    const auto mask_keys = [&](const std::uint8_t* allowed, Index stride) {
        for (Index c = 0; c < cols; ++c)
            if (!allowed[(j0 + c) * stride])
                for (Index r = 0; r < rows; ++r) s[r * rs + c * cs] = neg_inf<T>();
    };
    const bool by_key = m.kind == MaskKind::boolean && m.sq == 0;
    if (by_key) mask_keys(m.boolean + b * m.sb + h * m.sh, m.sk);
    for (Index r = 0; r < rows; ++r) {
        T* srow = s + r * rs;
        const Index i = i0 + r;
        if (m.kind == MaskKind::additive) {
            const T* mrow = m.additive + b * m.sb + h * m.sh + i * m.sq;
            // a -inf entry masks the key out even when its score is NaN (see nonfinite_rows)
            for (Index c = 0; c < cols; ++c) {
                const T add = mrow[(j0 + c) * m.sk];
                srow[c * cs] = add == neg_inf<T>() ? add : srow[c * cs] + add;
            }
        } else if (m.kind == MaskKind::boolean && !by_key) {
            const std::uint8_t* mrow = m.boolean + b * m.sb + h * m.sh + i * m.sq;
            for (Index c = 0; c < cols; ++c)
                if (!mrow[(j0 + c) * m.sk]) srow[c * cs] = neg_inf<T>();
        }
        if (m.alibi) {  // -slope * |p(i) - j|, the distance from the aligned key
            const T slope = m.slope(b, h);
            const Index p = aligned_key(m.options, n_q, n_k, i);
            for (Index c = 0; c < cols; ++c) {
                const Index dist = p > j0 + c ? p - j0 - c : j0 + c - p;
                srow[c * cs] -= slope * static_cast<T>(dist);
            }
        }
        // the scalar options: keys outside the row's interval
        const Interval keys = key_interval(m.options, n_q, n_k, i);
        const Index lo = std::clamp<Index>(keys.lo - j0, 0, cols);
        const Index hi = std::clamp<Index>(keys.hi - j0, lo, cols);
        for (Index c = 0; c < lo; ++c) srow[c * cs] = neg_inf<T>();
        for (Index c = hi; c < cols; ++c) srow[c * cs] = neg_inf<T>();
    }
    if (kp) mask_keys(kp, pad.sk);  // after the ALiBi term, as the intervals
}

// True if the tile of queries [i0, i1) and keys [j0, j1) needs apply_mask at all: with a mask
// array, or when a key of the tile lies outside a row's interval (key_interval's ends never
// decrease, so the first row has the smallest end and the last row the largest start).
template <typename T>
bool tile_needs_mask(const MaskSpec<T>& m, Index n_q, Index n_k, Index i0, Index i1, Index j0,
                     Index j1) {
    if (m.kind != MaskKind::none || m.key_padding.data || m.alibi) return true;
    return j1 > key_interval(m.options, n_q, n_k, i0).hi ||
           j0 < key_interval(m.options, n_q, n_k, i1 - 1).lo;
}

// True if the mask arrays let no query of [i0, i1) of heads [h0, h0 + heads) of batch b see a
// key of [j0, j0 + cols): every key padding, or every entry False (boolean) or -inf (additive).
// Those scores are -inf whatever the products give, so a kernel may skip the block: the online
// softmax's max, sum and accumulator come out as after a block of -inf scores.
template <typename T>
bool block_unseen(const MaskSpec<T>& m, Index b, Index h0, Index heads, Index i0, Index i1,
                  Index j0, Index cols) {
    const TokenMask& pad = m.key_padding;
    if (pad.data) {
        bool real = false;
        for (Index c = 0; c < cols && !real; ++c) real = pad.real(b, j0 + c);
        if (!real) return true;
    }
    if (m.kind == MaskKind::none) return false;
    // a mask broadcast over heads or queries (stride 0) is read once, not once per row
    const Index h1 = m.sh == 0 ? h0 + 1 : h0 + heads, i_end = m.sq == 0 ? i0 + 1 : i1;
    for (Index h = h0; h < h1; ++h)
        for (Index i = i0; i < i_end; ++i) {
            const Index row = b * m.sb + h * m.sh + i * m.sq;
            for (Index c = 0; c < cols; ++c) {
                const Index at = row + (j0 + c) * m.sk;
                if (m.kind == MaskKind::boolean ? m.boolean[at] != 0
                                                : !(m.additive[at] == neg_inf<T>()))
                    return false;
            }
        }
    return true;
}

// The keys [lo, hi) that some query of [i0, i1) (not empty) may see: the kernels skip the rest.
template <typename T>
Interval keys_seen(const MaskSpec<T>& m, Index n_q, Index n_k, Index i0, Index i1) {
    return {key_interval(m.options, n_q, n_k, i0).lo, key_interval(m.options, n_q, n_k, i1 - 1).hi};
}

// The queries [lo, hi) that may see some key of [j0, j1) (empty if none): from key_interval by
// bisection (its ends never decrease), so that a new option needs no inverse of its own.
template <typename T>
Interval queries_seeing(const MaskSpec<T>& m, Index n_q, Index n_k, Index j0, Index j1) {
    const auto first = [n_q](auto pred) {  // the first query where pred turns true, or n_q
        Index lo = 0, hi = n_q;
        while (lo < hi) {
            const Index mid = lo + (hi - lo) / 2;
            if (pred(mid)) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        return lo;
    };
    const Index lo = first([&](Index i) { return key_interval(m.options, n_q, n_k, i).hi > j0; });
    const Index hi = first([&](Index i) { return key_interval(m.options, n_q, n_k, i).lo >= j1; });
    return {lo, std::max(lo, hi)};
}

// Row maximum (vectorised; max is exact, so the order does not matter). If the row holds NaN
// the result may or may not be NaN; either way NaN then propagates into that row's output.
template <typename T>
T row_max(const T* s, Index n) {
    if (n == 0) return neg_inf<T>();
    return Eigen::Map<const Eigen::Array<T, 1, Eigen::Dynamic>>(s, n).maxCoeff();
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // Eigen packet types as template args
#endif
// exp(x) for the softmax, x <= 0 (a score minus its row maximum) or NaN, with results below the
// smallest normal number flushed to exactly 0 (so masked entries, exp(-inf), are exactly 0, and
// only values below 1e-38 (float) / 1e-308 (double) of the row maximum are dropped).
// float: exp(x) = 2^n exp(r), n = round(x log2 e), r = x - n ln 2 in two FMA steps (exact to
// about 1 ulp), exp(r) by the degree-6 Cephes polynomial, 2^n built in the exponent bits. As
// x <= 0, n is at least -126 wherever the result is kept, so no range clamping is needed: about
// 18 vector operations against Eigen's 27 or so (counted, not timed alone). Worth it because
// the softmax is a large share of a flash tile's time (the two products the rest). exp(0) is
// exactly 1. double: Eigen's pexp. NaN propagates in both.
template <typename Packet>
Packet exp_flush(const Packet& x) {
    namespace ei = Eigen::internal;
    using T = typename ei::unpacket_traits<Packet>::type;
    const Packet zero = ei::pzero(x);
    if constexpr (std::is_same_v<T, float>) {
        using PacketI = typename ei::unpacket_traits<Packet>::integer_packet;
        const Packet n = ei::print(ei::pmul(x, ei::pset1<Packet>(1.44269504088896341f)));
        Packet r = ei::pmadd(n, ei::pset1<Packet>(-0.693359375f), x);
        r = ei::pmadd(n, ei::pset1<Packet>(2.12194440e-4f), r);
        const Packet r2 = ei::pmul(r, r);
        Packet y =
            ei::pmadd(ei::pset1<Packet>(1.9875691500e-4f), r, ei::pset1<Packet>(1.3981999507e-3f));
        y = ei::pmadd(y, r, ei::pset1<Packet>(8.3334519073e-3f));
        y = ei::pmadd(y, r, ei::pset1<Packet>(4.1665795894e-2f));
        y = ei::pmadd(y, r, ei::pset1<Packet>(1.6666665459e-1f));
        y = ei::pmadd(y, r, ei::pset1<Packet>(5.0000001201e-1f));
        y = ei::padd(ei::pmadd(y, r2, r), ei::pset1<Packet>(1.0f));
#ifdef __AVX512F__
        // y 2^n by VSCALEFPS (one operation for the four building 2^n: the same exact product,
        // as the result is normal wherever it is kept), the flush as its zeroing mask (Eigen's
        // pcmp/pselect would convert the mask register to a vector and back)
        if constexpr (std::is_same_v<Packet, ei::Packet16f>) {
            const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_NLT_UQ);
            return _mm512_maskz_scalef_ps(keep, y, n);
        }
#endif
        const PacketI e = ei::padd(ei::pcast<Packet, PacketI>(n), ei::pset1<PacketI>(127));
        const Packet two_n = ei::preinterpret<Packet>(ei::plogical_shift_left<23>(e));
        return ei::pselect(ei::pcmp_lt(x, ei::pset1<Packet>(-87.33654f)), zero, ei::pmul(y, two_n));
    } else {
        const Packet e = ei::pexp(x);
        return ei::pselect(ei::pcmp_lt(e, ei::pset1<Packet>(std::numeric_limits<T>::min())), zero,
                           e);
    }
}

// Logit soft-capping in place, s[c] -> cap * tanh(s[c] / cap), over n contiguous scores; with
// th, tanh(s[c] / cap) is kept there for the backward (its derivative is 1 - tanh^2). Every
// element goes through the same code (the tail through a padded packet), so the result does
// not depend on where a tile starts (bitwise the same for any thread count).
template <typename T>
void softcap_scores(T cap, T* s, Index n, T* th) {
    namespace ei = Eigen::internal;
    if constexpr (std::is_same_v<T, float>) {
        using Packet = typename ei::packet_traits<T>::type;
        constexpr Index L = ei::unpacket_traits<Packet>::size;
        const Packet inv = ei::pset1<Packet>(T(1) / cap), c = ei::pset1<Packet>(cap);
        const auto one = [&](const Packet x, T* out, T* tout) {
            const Packet t = ei::ptanh(ei::pmul(x, inv));
            ei::pstoreu(out, ei::pmul(c, t));
            if (tout) ei::pstoreu(tout, t);
        };
        Index i = 0;
        for (; i + L <= n; i += L) one(ei::ploadu<Packet>(s + i), s + i, th ? th + i : nullptr);
        if (i < n) {
            alignas(64) T buf[L], tbuf[L];
            for (Index k = 0; k < L; ++k) buf[k] = i + k < n ? s[i + k] : T(0);
            one(ei::pload<Packet>(buf), buf, tbuf);
            for (Index k = 0; i + k < n; ++k) {
                s[i + k] = buf[k];
                if (th) th[i + k] = tbuf[k];
            }
        }
    } else {  // no vectorised tanh for double in Eigen 3.4
        for (Index i = 0; i < n; ++i) {
            const T t = std::tanh(s[i] / cap);
            s[i] = cap * t;
            if (th) th[i] = t;
        }
    }
}

// p[c] = exp(s[c] - m) (s and p may alias); returns the sum.
// Bitwise reproducible whatever the buffers' alignment (so whatever thread ran the tile): every
// element goes through the same packet exp (the tail via a padded packet) and the sum is taken
// in packet lanes in a fixed order; Eigen's own expressions would peel a scalar prologue up to
// an aligned address.
template <typename T>
T exp_row(const T* s, T m, T* p, Index n) {
    namespace ei = Eigen::internal;
    using Packet = typename ei::packet_traits<T>::type;
    constexpr Index L = ei::unpacket_traits<Packet>::size;
    const Packet pm = ei::pset1<Packet>(m);
    const Packet zero = ei::pzero(pm);
    Packet acc = zero;
    Index c = 0;
    for (; c + L <= n; c += L) {
        const Packet e = exp_flush(ei::psub(ei::ploadu<Packet>(s + c), pm));
        ei::pstoreu(p + c, e);
        acc = ei::padd(acc, e);
    }
    if (c < n) {
        alignas(64) T buf[L];
        for (Index i = 0; i < L; ++i) buf[i] = c + i < n ? s[c + i] : neg_inf<T>();
        const Packet e = exp_flush(ei::psub(ei::pload<Packet>(buf), pm));
        ei::pstore(buf, e);
        for (Index i = 0; c + i < n; ++i) p[c + i] = buf[i];
        acc = ei::padd(acc, e);  // padding lanes are exactly 0
    }
    alignas(64) T lanes[L];
    ei::pstore(lanes, acc);
    T sum = 0;
    for (Index i = 0; i < L; ++i) sum += lanes[i];
    return sum;
}

// Dot product in a fixed order whatever the alignment (packets from the start, then the lanes
// and the tail in order): reproducible across threads.
template <typename T>
T dot(const T* a, const T* b, Index n) {
    namespace ei = Eigen::internal;
    using Packet = typename ei::packet_traits<T>::type;
    constexpr Index L = ei::unpacket_traits<Packet>::size;
    Packet acc = ei::pset1<Packet>(T(0));
    Index c = 0;
    for (; c + L <= n; c += L)
        acc = ei::pmadd(ei::ploadu<Packet>(a + c), ei::ploadu<Packet>(b + c), acc);
    alignas(64) T lanes[L];
    ei::pstore(lanes, acc);
    T sum = 0;
    for (Index i = 0; i < L; ++i) sum += lanes[i];
    for (; c < n; ++c) sum += a[c] * b[c];
    return sum;
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

template <typename T>
bool has_nan(const T* s, Index n) {
    for (Index c = 0; c < n; ++c)
        if (s[c] != s[c]) return true;
    return false;
}

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

#pragma once
// Shared pieces of the softmax passes: masking a tile of scores and exponentiating a row.

#include <cmath>
#include <limits>
#include <vector>

#include "attnlab/common.hpp"

namespace attnlab {
namespace detail {

template <typename T>
constexpr T neg_inf() {
    return -std::numeric_limits<T>::infinity();
}

// Per-thread scratch that only grows, so tiles do not allocate on every task.
template <typename T, int Slot>
T* scratch(std::size_t n) {
    thread_local std::vector<T> buf;
    if (buf.size() < n) buf.resize(n);
    return buf.data();
}

// Offset such that query i may see key j iff j <= i + offset (causal), or none.
template <typename T>
Index causal_offset(const MaskSpec<T>& m, Index n_q, Index n_k) {
    return m.causal == Causal::bottom_right ? n_k - n_q : 0;
}

// Applies the mask to a tile s (rows x cols, row stride lds) holding scaled scores for queries
// i0.. and keys j0.. of (batch b, head h): adds the float mask, sets disallowed entries to -inf.
template <typename T>
void apply_mask(const MaskSpec<T>& m, Index b, Index h, Index n_q, Index n_k, Index i0, Index j0,
                Index rows, Index cols, T* s, Index lds) {
    const Index off = causal_offset(m, n_q, n_k);
    const std::uint8_t* kp = m.key_padding ? m.key_padding + b * m.kp_sb : nullptr;
    for (Index r = 0; r < rows; ++r) {
        T* srow = s + r * lds;
        const Index i = i0 + r;
        if (m.kind == MaskKind::additive) {
            const T* mrow = m.additive + b * m.sb + h * m.sh + i * m.sq;
            for (Index c = 0; c < cols; ++c) srow[c] += mrow[(j0 + c) * m.sk];
        } else if (m.kind == MaskKind::boolean) {
            const std::uint8_t* mrow = m.boolean + b * m.sb + h * m.sh + i * m.sq;
            for (Index c = 0; c < cols; ++c)
                if (!mrow[(j0 + c) * m.sk]) srow[c] = neg_inf<T>();
        }
        if (kp) {
            for (Index c = 0; c < cols; ++c)
                if (!kp[(j0 + c) * m.kp_sk]) srow[c] = neg_inf<T>();
        }
        if (m.causal != Causal::none) {
            // keys j > i + off are in the future
            Index first_bad = i + off + 1 - j0;
            if (first_bad < 0) first_bad = 0;
            for (Index c = first_bad; c < cols; ++c) srow[c] = neg_inf<T>();
        }
    }
}

// True if the tile needs apply_mask at all (causal tiles fully below the diagonal do not).
template <typename T>
bool tile_needs_mask(const MaskSpec<T>& m, Index n_q, Index n_k, Index i0, Index j1) {
    if (m.kind != MaskKind::none || m.key_padding) return true;
    if (m.causal == Causal::none) return false;
    return j1 - 1 > i0 + causal_offset(m, n_q, n_k);
}

// Row maximum (vectorised; max is exact, so the order does not matter). If the row holds NaN
// the result may or may not be NaN; either way NaN then propagates into that row's output.
template <typename T>
T row_max(const T* s, Index n) {
    if (n == 0) return neg_inf<T>();
    return Eigen::Map<const Eigen::Array<T, 1, Eigen::Dynamic>>(s, n).maxCoeff();
}

// p[c] = exp(s[c] - m) (s and p may alias); returns the sum.
// Bitwise reproducible whatever the buffers' alignment (so whatever thread ran the tile): every
// element goes through the same packet exp (the tail via a padded packet) and the sum is taken
// in packet lanes in a fixed order; Eigen's own expressions would peel a scalar prologue up to
// an aligned address. Eigen's exp clamps its argument, so exp(-inf) would be a tiny subnormal:
// results below the smallest normal number are flushed to exactly 0, which makes masked entries
// exactly 0 and drops only values below 1e-38 (float) / 1e-308 (double) of the row maximum.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // Eigen packet types as template args
#endif
template <typename T>
T exp_row(const T* s, T m, T* p, Index n) {
    namespace ei = Eigen::internal;
    using Packet = typename ei::packet_traits<T>::type;
    constexpr Index L = ei::unpacket_traits<Packet>::size;
    const Packet pm = ei::pset1<Packet>(m);
    const Packet tiny = ei::pset1<Packet>(std::numeric_limits<T>::min());
    const Packet zero = ei::pzero(pm);
    Packet acc = zero;
    Index c = 0;
    for (; c + L <= n; c += L) {
        Packet e = ei::pexp(ei::psub(ei::ploadu<Packet>(s + c), pm));
        e = ei::pselect(ei::pcmp_lt(e, tiny), zero, e);
        ei::pstoreu(p + c, e);
        acc = ei::padd(acc, e);
    }
    if (c < n) {
        alignas(64) T buf[L];
        for (Index i = 0; i < L; ++i) buf[i] = c + i < n ? s[c + i] : neg_inf<T>();
        Packet e = ei::pexp(ei::psub(ei::pload<Packet>(buf), pm));
        e = ei::pselect(ei::pcmp_lt(e, tiny), zero, e);
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

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

template <typename T>
bool has_nan(const T* s, Index n) {
    for (Index c = 0; c < n; ++c)
        if (s[c] != s[c]) return true;
    return false;
}

// Dot product in a fixed order (no alignment-dependent peeling): reproducible across threads.
template <typename T>
T dot(const T* a, const T* b, Index n) {
    T sum = 0;
    for (Index c = 0; c < n; ++c) sum += a[c] * b[c];
    return sum;
}

}  // namespace detail
}  // namespace attnlab

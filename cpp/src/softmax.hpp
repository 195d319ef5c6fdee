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

// Row maximum (vectorised). If the row holds NaN the result may or may not be NaN; either way
// NaN then propagates through exp and the sums into that row's output.
template <typename T>
T row_max(const T* s, Index n) {
    if (n == 0) return neg_inf<T>();
    return Eigen::Map<const Eigen::Array<T, 1, Eigen::Dynamic>>(s, n).maxCoeff();
}

// p[c] = exp(s[c] - m), vectorised (s and p may alias); returns the sum. Eigen's exp clamps its
// argument, so exp(-inf) comes out as a tiny subnormal instead of 0: results below the smallest
// normal number are flushed to exactly 0. That makes masked (-inf) entries exactly 0 and only
// drops values smaller than 1e-38 (float) or 1e-308 (double) relative to the row maximum.
template <typename T>
T exp_row(const T* s, T m, T* p, Index n) {
    using Row = Eigen::Array<T, 1, Eigen::Dynamic>;
    Eigen::Map<Row> P(p, n);
    P = (Eigen::Map<const Row>(s, n) - m).exp();
    constexpr T tiny = std::numeric_limits<T>::min();
    for (Index c = 0; c < n; ++c) p[c] = p[c] < tiny ? T(0) : p[c];
    return P.sum();
}

}  // namespace detail
}  // namespace attnlab

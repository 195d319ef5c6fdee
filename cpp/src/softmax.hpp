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

// Row maximum ignoring NaN (NaN then propagates through exp and the sums).
template <typename T>
T row_max(const T* s, Index n) {
    T mx = neg_inf<T>();
    for (Index c = 0; c < n; ++c) mx = s[c] > mx ? s[c] : mx;
    return mx;
}

// p[c] = exp(s[c] - m) with exact zeros for masked (-inf) entries; returns the sum.
template <typename T>
T exp_row(const T* s, T m, T* p, Index n) {
    using Row = Eigen::Array<T, 1, Eigen::Dynamic>;
    Eigen::Map<const Row> S(s, n);
    Eigen::Map<Row> P(p, n);
    P = (S - m).exp();
    T sum = 0;
    for (Index c = 0; c < n; ++c) {
        if (s[c] == neg_inf<T>()) p[c] = T(0);
        sum += p[c];
    }
    return sum;
}

}  // namespace detail
}  // namespace attnlab

#include "attnlab/attention.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "attnlab/gemm.hpp"
#include "attnlab/threading.hpp"
#include "softmax.hpp"

namespace attnlab {

namespace detail {

// Tile sizes: a query tile's scores against a key tile stay in L1/L2 (64 x 128 x 4 B = 32 KiB).
constexpr Index kTileQ = 64;
constexpr Index kTileK = 128;

// Keys [0, end) may be visible to queries [i0, i1) under the causal rule.
template <typename T>
Index causal_key_end(const MaskSpec<T>& m, Index n_q, Index n_k, Index i1) {
    if (m.causal == Causal::none) return n_k;
    return std::clamp<Index>(i1 + causal_offset(m, n_q, n_k), 0, n_k);
}

// One (batch, head, query tile) with an online softmax over key tiles.
template <typename T>
void flash_tile(const AttentionProblem<T>& p, Index b, Index h, Index i0, Index mq) {
    const Index hk = h / (p.heads / p.kv_heads);
    const Index d = p.d, dv = p.d_v;
    ConstRowMap<T> Q(p.q.at(b, h) + i0 * p.q.row_stride, mq, d, Eigen::OuterStride<>(p.q.row_stride));
    RowMap<T> O(p.out.at(b, h) + i0 * p.out.row_stride, mq, dv, Eigen::OuterStride<>(p.out.row_stride));
    const T* kbase = p.k.at(b, hk);
    const T* vbase = p.v.at(b, hk);

    // scratch: scaled Q tile, scores/probabilities tile, accumulator, row max and row sum
    T* qs_buf = scratch<T, 0>(static_cast<std::size_t>(mq * d));
    T* s_buf = scratch<T, 1>(static_cast<std::size_t>(mq * kTileK));
    T* acc_buf = scratch<T, 2>(static_cast<std::size_t>(mq * dv));
    T* stat_buf = scratch<T, 3>(static_cast<std::size_t>(2 * mq));
    RowMap<T> Qs(qs_buf, mq, d, Eigen::OuterStride<>(d));
    RowMap<T> Acc(acc_buf, mq, dv, Eigen::OuterStride<>(dv));
    T* row_m = stat_buf;
    T* row_l = stat_buf + mq;
    Qs.noalias() = Q * p.scale;
    Acc.setZero();
    std::fill(row_m, row_m + mq, neg_inf<T>());
    std::fill(row_l, row_l + mq, T(0));

    const Index key_end = causal_key_end(p.mask, p.n_q, p.n_k, i0 + mq);
    for (Index j0 = 0; j0 < key_end; j0 += kTileK) {
        const Index kb = std::min(kTileK, key_end - j0);
        ConstRowMap<T> K(kbase + j0 * p.k.row_stride, kb, d, Eigen::OuterStride<>(p.k.row_stride));
        ConstRowMap<T> V(vbase + j0 * p.v.row_stride, kb, dv, Eigen::OuterStride<>(p.v.row_stride));
        RowMap<T> S(s_buf, mq, kb, Eigen::OuterStride<>(kb));
        S.noalias() = Qs * K.transpose();
        if (tile_needs_mask(p.mask, p.n_q, p.n_k, i0, j0 + kb))
            apply_mask(p.mask, b, h, p.n_q, p.n_k, i0, j0, mq, kb, s_buf, kb);
        for (Index r = 0; r < mq; ++r) {
            T* srow = s_buf + r * kb;
            const T m_new = std::max(row_m[r], row_max(srow, kb));
            if (m_new == neg_inf<T>()) {  // everything so far masked
                std::fill(srow, srow + kb, T(0));
                continue;
            }
            const T alpha = std::exp(row_m[r] - m_new);
            const T sum = exp_row(srow, m_new, srow, kb);
            row_l[r] = row_l[r] * alpha + sum;
            row_m[r] = m_new;
            if (alpha != T(1)) Acc.row(r) *= alpha;
        }
        Acc.noalias() += S * V;
    }
    for (Index r = 0; r < mq; ++r) {
        const T l = row_l[r];
        if (l > T(0)) {
            O.row(r) = Acc.row(r) / l;
        } else if (l == T(0)) {
            O.row(r).setZero();  // fully masked row
        } else {
            O.row(r) = Acc.row(r) / l;  // NaN propagates
        }
        if (p.lse) {
            p.lse[(b * p.heads + h) * p.n_q + i0 + r] =
                l == T(0) ? neg_inf<T>() : row_m[r] + std::log(l);
        }
    }
}

// One (batch, head, query tile) when the weights are wanted: the rows of P are materialised in
// the output weights array, normalised there, then multiplied by V.
template <typename T>
void dense_tile(const AttentionProblem<T>& p, Index b, Index h, Index i0, Index mq) {
    const Index hk = h / (p.heads / p.kv_heads);
    const Index d = p.d, dv = p.d_v, nk = p.n_k;
    ConstRowMap<T> Q(p.q.at(b, h) + i0 * p.q.row_stride, mq, d, Eigen::OuterStride<>(p.q.row_stride));
    ConstRowMap<T> K(p.k.at(b, hk), nk, d, Eigen::OuterStride<>(p.k.row_stride));
    ConstRowMap<T> V(p.v.at(b, hk), nk, dv, Eigen::OuterStride<>(p.v.row_stride));
    RowMap<T> O(p.out.at(b, h) + i0 * p.out.row_stride, mq, dv, Eigen::OuterStride<>(p.out.row_stride));
    T* wbase = p.weights + ((b * p.heads + h) * p.n_q + i0) * nk;
    RowMap<T> P(wbase, mq, nk, Eigen::OuterStride<>(nk));
    T* qs_buf = scratch<T, 0>(static_cast<std::size_t>(mq * d));
    RowMap<T> Qs(qs_buf, mq, d, Eigen::OuterStride<>(d));
    Qs.noalias() = Q * p.scale;
    P.noalias() = Qs * K.transpose();
    if (tile_needs_mask(p.mask, p.n_q, p.n_k, i0, nk))
        apply_mask(p.mask, b, h, p.n_q, p.n_k, i0, Index(0), mq, nk, wbase, nk);
    for (Index r = 0; r < mq; ++r) {
        T* row = wbase + r * nk;
        const T m = row_max(row, nk);
        T lse = neg_inf<T>();
        if (m == neg_inf<T>()) {
            std::fill(row, row + nk, T(0));
        } else {
            const T l = exp_row(row, m, row, nk);
            Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>>(row, nk) /= l;
            lse = m + std::log(l);
        }
        if (p.lse) p.lse[(b * p.heads + h) * p.n_q + i0 + r] = lse;
    }
    O.noalias() = P * V;
}

}  // namespace detail

template <typename T>
void attention_forward(const AttentionProblem<T>& p) {
    if (p.batch <= 0 || p.heads <= 0 || p.n_q <= 0) return;
    const Index q_tiles = (p.n_q + detail::kTileQ - 1) / detail::kTileQ;
    const Index tasks = p.batch * p.heads * q_tiles;
    parallel_for(tasks, [&](Index t) {
        const Index qt = t % q_tiles;
        const Index h = (t / q_tiles) % p.heads;
        const Index b = t / (q_tiles * p.heads);
        const Index i0 = qt * detail::kTileQ;
        const Index mq = std::min(detail::kTileQ, p.n_q - i0);
        if (p.weights) {
            detail::dense_tile(p, b, h, i0, mq);
        } else {
            detail::flash_tile(p, b, h, i0, mq);
        }
    });
}

template <typename T>
void multi_head_attention_forward(const MhaProblem<T>& p) {
    const Index rq = p.batch * p.n_q, rk = p.batch * p.n_k;
    const Index wq = p.heads * p.d_head, wk = p.kv_heads * p.d_head;
    const Index wv = p.kv_heads * p.d_vhead, wc = p.heads * p.d_vhead;
    auto q = make_buffer<T>(rq * wq), k = make_buffer<T>(rk * wk);
    auto v = make_buffer<T>(rk * wv), ctx = make_buffer<T>(rq * wc);
    // One GEMM per projection over all rows; heads are then column blocks of q, k, v.
    linear(rq, p.w_q.in, wq, p.query, p.w_q.in, p.w_q.w, p.w_q.b, q.get(), wq);
    linear(rk, p.w_k.in, wk, p.key, p.w_k.in, p.w_k.w, p.w_k.b, k.get(), wk);
    linear(rk, p.w_v.in, wv, p.value, p.w_v.in, p.w_v.w, p.w_v.b, v.get(), wv);

    AttentionProblem<T> a;
    a.batch = p.batch;
    a.heads = p.heads;
    a.kv_heads = p.kv_heads;
    a.n_q = p.n_q;
    a.n_k = p.n_k;
    a.d = p.d_head;
    a.d_v = p.d_vhead;
    a.scale = p.scale;
    a.q = {q.get(), p.n_q * wq, p.d_head, wq};
    a.k = {k.get(), p.n_k * wk, p.d_head, wk};
    a.v = {v.get(), p.n_k * wv, p.d_vhead, wv};
    a.out = {ctx.get(), p.n_q * wc, p.d_vhead, wc};
    a.mask = p.mask;
    a.weights = p.weights;
    attention_forward(a);

    linear(rq, wc, p.w_o.out, ctx.get(), wc, p.w_o.w, p.w_o.b, p.out, p.w_o.out);
}

template void attention_forward<float>(const AttentionProblem<float>&);
template void attention_forward<double>(const AttentionProblem<double>&);
template void multi_head_attention_forward<float>(const MhaProblem<float>&);
template void multi_head_attention_forward<double>(const MhaProblem<double>&);

}  // namespace attnlab

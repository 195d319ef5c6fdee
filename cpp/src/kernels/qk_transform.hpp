#pragma once
// The q/k norms and rotary embeddings of a multi-head layer (QkTransform, attention.hpp),
// forward and backward, on the projected rows of packed heads (rows x heads * d_head, head j in
// columns [j d_head, (j + 1) d_head)), row r being token r % n of batch entry r / n.
//
//   forward   y = rope(norm(x)),  norm(x) = x s w with s = (mean(x^2) + eps)^-1/2
//   backward  dy -> rope^T dy = g -> dx = s (g w) - x s^3 mean(g w x),  dw = sum g x s
//
// Run in the layer's threads between its projection GEMMs and the attention core.

#include <algorithm>
#include <cmath>

#include "attnlab/attention.hpp"
#include "attnlab/threading.hpp"
#include "microkernel.hpp"
#include "scratch.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

template <typename T>
using ArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
template <typename T>
using ConstArrayMap = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

// Rows per task; the norm weights' gradient is summed per task and then over the tasks in
// order, so that it does not depend on the thread count.
constexpr Index kQkRows = 32;

// One side of the transform: the queries' or the keys'.
template <typename T>
struct QkSide {
    Index rows = 0, n = 0, heads = 0, d = 0;
    const T* norm = nullptr;  // (d) or null
    T eps = T(0);
    Index rope_dim = 0;
    RotaryTables<T> rope;

    // row r's cos and sin (rope_dim / 2 each)
    const T* cos_of(Index r) const {
        return rope.cos + (rope.batched ? r : r % n) * (rope_dim / 2);
    }
    const T* sin_of(Index r) const {
        return rope.sin + (rope.batched ? r : r % n) * (rope_dim / 2);
    }
};

template <typename T>
QkSide<T> query_side(const MhaProblem<T>& p) {
    return {p.batch * p.n_q, p.n_q,    p.heads,       p.d_head,
            p.qk.q_norm,     p.qk.eps, p.qk.rope_dim, p.qk.rope_q};
}

template <typename T>
QkSide<T> key_side(const MhaProblem<T>& p) {
    return {p.batch * p.n_k, p.n_k,    p.kv_heads,    p.d_head,
            p.qk.k_norm,     p.qk.eps, p.qk.rope_dim, p.qk.rope_k};
}

// (x1, x2) <- (x1 c - x2 s, x2 c + x1 s), n pairs in place; inverse: by -s (the transpose)
template <typename T>
inline void rotate_pairs(T* x1, T* x2, const T* c, const T* s, Index n, bool inverse = false) {
    namespace ei = Eigen::internal;
    using Packet = PacketOf<T>;
    constexpr Index L = packet_size<T>();
    const T sign = inverse ? T(-1) : T(1);
    const Packet sg = ei::pset1<Packet>(sign);
    Index j = 0;
    for (; j + L <= n; j += L) {
        const Packet a = ei::ploadu<Packet>(x1 + j), b = ei::ploadu<Packet>(x2 + j);
        const Packet cj = ei::ploadu<Packet>(c + j), sj = ei::pmul(sg, ei::ploadu<Packet>(s + j));
        ei::pstoreu(x1 + j, ei::psub(ei::pmul(a, cj), ei::pmul(b, sj)));
        ei::pstoreu(x2 + j, ei::padd(ei::pmul(b, cj), ei::pmul(a, sj)));
    }
    for (; j < n; ++j) {  // the same operations, unfused, as the packets do them
        const T a = x1[j], b = x2[j], sj = sign * s[j];
        const T ac = a * c[j], bs = b * sj, bc = b * c[j], as = a * sj;
        x1[j] = ac - bs;
        x2[j] = bc + as;
    }
}

// y = rope(norm(x)) for every head of every row (y may be x); s (rows x heads): each head's
// norm scale, when given (the backward's)
template <typename T>
void qk_forward(const QkSide<T>& q, const T* x, T* y, T* s) {
    const Index width = q.heads * q.d, half = q.rope_dim / 2;
    const Index tasks = (q.rows + kQkRows - 1) / kQkRows;
    parallel_for(tasks, [&](Index task) {
        const Index r1 = std::min(q.rows, (task + 1) * kQkRows);
        for (Index r = task * kQkRows; r < r1; ++r) {
            const T* c = half ? q.cos_of(r) : nullptr;
            const T* sn = half ? q.sin_of(r) : nullptr;
            for (Index h = 0; h < q.heads; ++h) {
                const T* xh = x + r * width + h * q.d;
                T* yh = y + r * width + h * q.d;
                if (q.norm) {  // Eigen's vectorised sum: its order fixed by d_head alone
                    const T sq = ConstArrayMap<T>(xh, q.d).square().sum();
                    const T scale = T(1) / std::sqrt(sq / T(q.d) + q.eps);
                    if (s) s[r * q.heads + h] = scale;
                    ArrayMap<T>(yh, q.d) =
                        ConstArrayMap<T>(xh, q.d) * scale * ConstArrayMap<T>(q.norm, q.d);
                } else if (yh != xh) {
                    std::copy(xh, xh + q.d, yh);
                }
                rotate_pairs(yh, yh + half, c, sn, half);
            }
        }
    });
}

// g (rows x heads * d): the gradient of qk_forward's y, replaced by that of its x; x and s as
// qk_forward read and wrote them; dnorm (d): the norm weights' gradient, written when given.
template <typename T>
void qk_backward(const QkSide<T>& q, const T* x, const T* s, T* g, T* dnorm) {
    const Index width = q.heads * q.d, half = q.rope_dim / 2;
    const Index tasks = (q.rows + kQkRows - 1) / kQkRows;
    const bool sums = q.norm && dnorm;
    auto partial = make_buffer<T>(sums ? tasks * q.d : 0);  // each task's dw
    parallel_for(tasks, [&](Index task) {
        T* dw = sums ? partial.get() + task * q.d : nullptr;
        if (dw) std::fill(dw, dw + q.d, T(0));
        const Index r1 = std::min(q.rows, (task + 1) * kQkRows);
        for (Index r = task * kQkRows; r < r1; ++r) {
            const T* c = half ? q.cos_of(r) : nullptr;
            const T* sn = half ? q.sin_of(r) : nullptr;
            for (Index h = 0; h < q.heads; ++h) {
                T* gh = g + r * width + h * q.d;
                rotate_pairs(gh, gh + half, c, sn, half, true);  // the rotation's transpose
                if (!q.norm) continue;
                const T* xh = x + r * width + h * q.d;
                const T scale = s[r * q.heads + h];
                const ConstArrayMap<T> xv(xh, q.d), w(q.norm, q.d);
                ArrayMap<T> gv(gh, q.d);
                const T k = scale * scale * scale * ((gv * w * xv).sum() / T(q.d));  // mean(g w x)
                if (dw) ArrayMap<T>(dw, q.d) += gv * (xv * scale);
                gv = scale * (gv * w) - xv * k;
            }
        }
    });
    if (!sums) return;
    for (Index j = 0; j < q.d; ++j) {
        T total = 0;
        for (Index t = 0; t < tasks; ++t) total += partial.get()[t * q.d + j];
        dnorm[j] = total;
    }
}

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

#include "attnlab/bilinear.hpp"

#include <algorithm>

#include "attnlab/gemm.hpp"
#include "attnlab/threading.hpp"

namespace attnlab {

namespace detail {

// Row chunk of the per-head projections (as in linear(): fixed, so results do not depend on
// the thread count).
constexpr Index kBilinearRows = 128;

// Y[:, i*ldh : i*ldh + ...] for every head i, as one parallel GEMM over (row chunk, head)
// tasks that reads the (heads, d_q, d_k) weight in place (no transpose-copy of h d_q d_k
// numbers, which for decode would cost as much as the product itself).
//   query order: Y_i = X W_i + u_i              (X: rows x d_q, Y_i: rows x d_k)
//   key order:   Y_i = [X W_i^T | X u_i]         (X: rows x d_k, Y_i: rows x (d_q + has_u))
template <typename T>
void project_heads(const BilinearProblem<T>& p, BilinearOrder order, Index rows, const T* x,
                   T* y, Index ldh) {
    const Index heads = p.heads, dq = p.d_q, dk = p.d_k;
    const Index in = order == BilinearOrder::query ? dq : dk;
    const Index ldy = heads * ldh;
    const Index chunks = (rows + kBilinearRows - 1) / kBilinearRows;
    parallel_for(chunks * heads, [&](Index t) {
        const Index i = t % heads;
        const Index r0 = (t / heads) * kBilinearRows;
        const Index m = std::min(kBilinearRows, rows - r0);
        ConstRowMap<T> X(x + r0 * in, m, in, Eigen::OuterStride<>(in));
        ConstRowMap<T> W(p.w_qk + i * dq * dk, dq, dk, Eigen::OuterStride<>(dk));
        T* yb = y + r0 * ldy + i * ldh;
        if (order == BilinearOrder::query) {
            RowMap<T> Y(yb, m, dk, Eigen::OuterStride<>(ldy));
            Y.noalias() = X * W;
            if (p.u_k)
                Y.rowwise() += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(
                    p.u_k + i * dk, dk);
        } else {
            RowMap<T> Y(yb, m, dq, Eigen::OuterStride<>(ldy));
            Y.noalias() = X * W.transpose();
            if (p.u_k) {
                // u_i . x_k, a per-key bias, stored as the last column; queries carry a 1 there
                Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>, Eigen::Unaligned,
                           Eigen::InnerStride<>>
                    col(yb + dq, m, Eigen::InnerStride<>(ldy));
                col.noalias() = X * Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>>(
                                        p.u_k + i * dk, dk);
            }
        }
    });
}

}  // namespace detail

template <typename T>
void bilinear_attention_forward(const BilinearProblem<T>& p) {
    const Index H = p.heads, Hk = p.kv_heads, dq = p.d_q, dk = p.d_k, dvh = p.d_vhead;
    const Index rq = p.batch * p.n_q, rk = p.batch * p.n_k;
    const Index wv = Hk * dvh, wc = H * dvh;
    auto v = make_buffer<T>(rk * wv), ctx = make_buffer<T>(rq * wc);
    linear(rk, p.w_v.in, wv, p.value, p.w_v.in, p.w_v.w, p.w_v.b, v.get(), wv);

    AttentionProblem<T> a;
    a.batch = p.batch;
    a.heads = H;
    a.n_q = p.n_q;
    a.n_k = p.n_k;
    a.d_v = dvh;
    a.scale = p.scale;
    a.out = {ctx.get(), p.n_q * wc, dvh, wc};
    a.mask = p.mask;
    a.weights = p.weights;

    std::unique_ptr<T[]> proj, qpad, vexp;
    if (p.order == BilinearOrder::query) {
        // Q'_i = X_q W_i + u_i for all heads; every head reads the raw keys (head stride 0).
        proj = make_buffer<T>(rq * H * dk);
        detail::project_heads(p, BilinearOrder::query, rq, p.query, proj.get(), dk);
        a.kv_heads = Hk;
        a.d = dk;
        a.q = {proj.get(), p.n_q * H * dk, dk, H * dk};
        a.k = {p.key, p.n_k * dk, 0, dk};
        a.v = {v.get(), p.n_k * wv, dvh, wv};
    } else {
        // K'_i = [X_k W_i^T | X_k u_i]; every head reads the raw queries, padded with a 1.
        const Index e = p.u_k ? 1 : 0, w = dq + e;
        proj = make_buffer<T>(rk * H * w);
        detail::project_heads(p, BilinearOrder::key, rk, p.key, proj.get(), w);
        const T* q = p.query;
        if (e) {
            qpad = make_buffer<T>(rq * w);
            parallel_for((rq + 1023) / 1024, [&](Index c) {
                const Index r1 = std::min(rq, (c + 1) * 1024);
                for (Index r = c * 1024; r < r1; ++r) {
                    std::copy(p.query + r * dq, p.query + (r + 1) * dq, qpad.get() + r * w);
                    qpad[r * w + dq] = T(1);
                }
            });
            q = qpad.get();
        }
        a.kv_heads = H;  // keys now differ per query head
        a.d = w;
        a.q = {q, p.n_q * w, 0, w};
        a.k = {proj.get(), p.n_k * H * w, w, H * w};
        if (Hk == H) {
            a.v = {v.get(), p.n_k * wv, dvh, wv};
        } else {
            // grouped values: the core pairs keys and values by head, so give each query head
            // its group's value block
            const Index group = H / Hk;
            vexp = make_buffer<T>(rk * wc);
            parallel_for((rk + 255) / 256, [&](Index c) {
                const Index r1 = std::min(rk, (c + 1) * 256);
                for (Index r = c * 256; r < r1; ++r)
                    for (Index i = 0; i < H; ++i) {
                        const T* src = v.get() + r * wv + (i / group) * dvh;
                        std::copy(src, src + dvh, vexp.get() + r * wc + i * dvh);
                    }
            });
            a.v = {vexp.get(), p.n_k * wc, dvh, wc};
        }
    }
    attention_forward(a);

    linear(rq, wc, p.w_o.out, ctx.get(), wc, p.w_o.w, p.w_o.b, p.out, p.w_o.out);
}

template void bilinear_attention_forward<float>(const BilinearProblem<float>&);
template void bilinear_attention_forward<double>(const BilinearProblem<double>&);

}  // namespace attnlab

#include "attnlab/additive.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "attnlab/threading.hpp"

namespace attnlab {

namespace detail {
namespace {

// Rows per GEMM block: large enough for Eigen to reach its peak, fixed so that results never
// depend on the thread count.
constexpr Index kRowBlock = 128;
// Rows per task of the output pass: each task scales its own copy of the projection by the
// pooled vector, so a task must cover enough rows to amortise that D x D_out step.
constexpr Index kRowsPerTask = 1024;

template <typename T>
using Vec = Eigen::Matrix<T, 1, Eigen::Dynamic>;
template <typename T>
using VecMap = Eigen::Map<Vec<T>>;
template <typename T>
using ConstVecMap = Eigen::Map<const Vec<T>>;

// ||v||_2 as sqrt(sum v^2), the formula torch and NumPy use, falling back to Eigen's scaled
// norm only when the squares underflow or overflow (so tiny and huge rows stay exact).
template <typename Derived>
typename Derived::Scalar robust_norm(const Eigen::MatrixBase<Derived>& v) {
    using T = typename Derived::Scalar;
    const T sq = v.squaredNorm();
    if (std::isnan(sq)) return sq;
    if (sq >= std::numeric_limits<T>::min() && sq <= std::numeric_limits<T>::max())
        return std::sqrt(sq);
    return v.stableNorm();
}

// Y = X W + b over a block of rows (W row-major (in, out), possibly a strided column block).
template <typename T, typename XMap, typename YMap>
void project(const XMap& X, const ConstRowMap<T>& W, const T* b, YMap& Y) {
    if (X.cols() == 0) {
        Y.setZero();
    } else {
        Y.noalias() = X * W;
    }
    if (b) Y.rowwise() += ConstVecMap<T>(b, Y.cols());
}

// v / max(||v||, eps) in place, for every row.
template <typename T, typename M>
void normalize_rows(M& Y, T eps) {
    for (Index i = 0; i < Y.rows(); ++i) {
        const T nrm = robust_norm(Y.row(i));
        Y.row(i) /= std::max(nrm, eps);  // NaN norms propagate (std::max keeps its first arg)
    }
}

// Splits [0, rows) of each batch element into tasks of at most kRowsPerTask rows.
struct TaskGrid {
    Index batch, n, per;
    TaskGrid(Index b, Index n_) : batch(b), n(n_), per((n_ + kRowsPerTask - 1) / kRowsPerTask) {}
    Index size() const { return batch * per; }
    void at(Index t, Index& b, Index& r0, Index& r1) const {
        b = t / per;
        r0 = (t % per) * kRowsPerTask;
        r1 = std::min(n, r0 + kRowsPerTask);
    }
};

}  // namespace
}  // namespace detail

template <typename T>
void additive_attention_forward(const AdditiveProblem<T>& p) {
    using namespace detail;
    const Index B = p.batch, n = p.n, din = p.d_in, D = p.width, dout = p.d_out;
    const Index rows = B * n;
    if (rows <= 0 || dout <= 0) return;
    const bool official = p.variant == AdditiveVariant::official;
    const Index ld = 2 * D;

    // With M = w_proj w_final and c = b_proj w_final + b_final,
    //   out = (K diag(G) w_proj + b_proj + Q) w_final + b_final = K (diag(G) M) + Q w_final + c:
    // G is folded into the weights (G * K is never formed), Q w_final is computed while Q is in
    // cache, and only K has to be kept until G is known. For d_out <= D (SwiftFormer has
    // d_out = D / num_heads) this costs no more operations than the two-step form.
    const ConstRowMap<T> Wproj(p.w_proj, D, D, Eigen::OuterStride<>(D));
    const ConstRowMap<T> Wfinal(p.w_final, D, dout, Eigen::OuterStride<>(dout));
    const RowMatrix<T> M = Wproj * Wfinal;
    Vec<T> c = p.b_final ? Vec<T>(ConstVecMap<T>(p.b_final, dout)) : Vec<T>(Vec<T>::Zero(dout));
    if (p.b_proj) c.noalias() += ConstVecMap<T>(p.b_proj, D) * Wfinal;

    // [w_k | w_q] and [b_k | b_q]: both projections in one GEMM per block.
    RowMatrix<T> Wkq(din, ld);
    Wkq.leftCols(D) = ConstRowMap<T>(p.w_k, din, D, Eigen::OuterStride<>(D));
    Wkq.rightCols(D) = ConstRowMap<T>(p.w_q, din, D, Eigen::OuterStride<>(D));
    Vec<T> bkq = Vec<T>::Zero(ld);
    if (p.b_k) bkq.head(D) = ConstVecMap<T>(p.b_k, D);
    if (p.b_q) bkq.tail(D) = ConstVecMap<T>(p.b_q, D);
    const ConstRowMap<T> Wkq_map(Wkq.data(), din, ld, Eigen::OuterStride<>(ld));

    auto keys = make_buffer<T>(rows * D);
    auto score = make_buffer<T>(official ? rows : 0);
    auto pooled = make_buffer<T>(B * D);
    const Index per = (n + kRowBlock - 1) / kRowBlock;  // row blocks per batch element
    auto partial = make_buffer<double>(B * per * D);

    // 1. Per (batch element, block of rows): [K | Q] in one GEMM, both row-normalised; the
    //    official scores s = (Q w_g) * scale; the block's share of the pooling, the sum over
    //    its real tokens of s_n Q_n (official) or Q_n (hf) (the token weights are
    //    a_n = s_n / max(||s||, eps), so G = (sum s_n Q_n) / max(||s||, eps)); out = Q w_final.
    parallel_for(B * per, [&](Index task) {
        const Index b = task / per, i0 = (task % per) * kRowBlock;
        const Index m = std::min(kRowBlock, n - i0), r0 = b * n + i0;
        ConstRowMap<T> X(p.x + r0 * din, m, din, Eigen::OuterStride<>(std::max<Index>(din, 1)));
        RowMatrix<T> KQ(m, ld);
        RowMap<T> KQm(KQ.data(), m, ld, Eigen::OuterStride<>(ld));
        project<T>(X, Wkq_map, bkq.data(), KQm);
        auto K = KQ.leftCols(D);
        auto Q = KQ.rightCols(D);
        normalize_rows(K, p.eps);
        normalize_rows(Q, p.eps);
        RowMap<T>(keys.get() + r0 * D, m, D, Eigen::OuterStride<>(D)) = K;
        if (official) {
            ConstVecMap<T> wg(p.w_g, D);
            for (Index i = 0; i < m; ++i) score[r0 + i] = Q.row(i).dot(wg) * p.scale;
        }
        bool all_real = true;
        for (Index i = 0; i < m && all_real; ++i) all_real = p.key_padding.real(b, i0 + i);
        Vec<T> share(D);
        if (all_real) {
            if (official) {
                share.noalias() = ConstVecMap<T>(score.get() + r0, m) * Q;
            } else {
                share = Q.colwise().sum();
            }
        } else {  // skip padded tokens rather than weighting them by 0 (0 * NaN is NaN)
            share.setZero();
            for (Index i = 0; i < m; ++i)
                if (p.key_padding.real(b, i0 + i))
                    share += (official ? score[r0 + i] : T(1)) * Q.row(i);
        }
        Eigen::Map<Vec<double>>(partial.get() + task * D, D) = share.template cast<double>();
        RowMap<T> Y(p.out + r0 * dout, m, dout, Eigen::OuterStride<>(dout));
        Y.noalias() = Q * Wfinal;
    });

    // 2. Per batch element: the norm of the real tokens' scores and G, summing the blocks'
    //    shares in a fixed order, in double. No real token: G = 0.
    parallel_for(B, [&](Index b) {
        VecMap<T> G(pooled.get() + b * D, D);
        Index real = 0;
        for (Index j = 0; j < n; ++j) real += p.key_padding.real(b, j) ? 1 : 0;
        if (real == 0) {
            G.setZero();
            return;
        }
        Vec<double> acc = Vec<double>::Zero(D);
        for (Index k = 0; k < per; ++k)
            acc += Eigen::Map<const Vec<double>>(partial.get() + (b * per + k) * D, D);
        if (official) {
            Vec<T> s(real);  // the real tokens' scores
            Index r = 0;
            for (Index j = 0; j < n; ++j)
                if (p.key_padding.real(b, j)) s[r++] = score[b * n + j];
            acc /= static_cast<double>(std::max(robust_norm(s), p.eps));
        }
        G = acc.template cast<T>();
    });

    // 3. out += K (diag(G) M) + c, the folded weights built once per task.
    const TaskGrid grid(B, n);
    parallel_for(grid.size(), [&](Index t) {
        Index b, r0, r1;
        grid.at(t, b, r0, r1);
        const RowMatrix<T> W = ConstVecMap<T>(pooled.get() + b * D, D).asDiagonal() * M;
        for (Index i0 = r0; i0 < r1; i0 += kRowBlock) {
            const Index m = std::min(kRowBlock, r1 - i0), row = b * n + i0;
            ConstRowMap<T> K(keys.get() + row * D, m, D, Eigen::OuterStride<>(D));
            RowMap<T> Y(p.out + row * dout, m, dout, Eigen::OuterStride<>(dout));
            Y.noalias() += K * W;
            Y.rowwise() += c;
        }
    });
}

template <typename T>
void separable_attention_forward(const SeparableProblem<T>& p) {
    using namespace detail;
    const Index B = p.batch, n = p.n, d = p.d, dout = p.d_out;
    const Index rows = B * n;
    if (rows <= 0 || dout <= 0) return;
    const Index ld = 1 + 2 * d;  // block rows are [s | k | v]
    constexpr T kInf = std::numeric_limits<T>::infinity();

    const ConstRowMap<T> Wqkv(p.w_qkv, d, ld, Eigen::OuterStride<>(ld));
    const ConstRowMap<T> Wo(p.w_o, d, dout, Eigen::OuterStride<>(dout));
    auto values = make_buffer<T>(rows * d);  // relu(v): all that is kept for the output
    auto context = make_buffer<T>(B * d);
    const Index per = (n + kRowBlock - 1) / kRowBlock;
    // Per (batch element, block): the block's softmax state over its real tokens, as in an
    // online softmax: its max m_b, sum_n exp(s_n - m_b), sum_n exp(s_n - m_b) k_n.
    auto bmax = make_buffer<T>(B * per);
    auto bsum = make_buffer<double>(B * per);
    auto bctx = make_buffer<double>(B * per * d);
    auto breal = make_buffer<Index>(B * per);

    // 1. [s | k | v] in one GEMM per block, the block's softmax state while k is in cache, and
    //    relu(v) (NaN stays NaN, as torch's relu).
    parallel_for(B * per, [&](Index task) {
        const Index b = task / per, i0 = (task % per) * kRowBlock;
        const Index m = std::min(kRowBlock, n - i0), r0 = b * n + i0;
        ConstRowMap<T> X(p.x + r0 * d, m, d, Eigen::OuterStride<>(std::max<Index>(d, 1)));
        RowMatrix<T> P(m, ld);
        RowMap<T> Pm(P.data(), m, ld, Eigen::OuterStride<>(ld));
        project<T>(X, Wqkv, p.b_qkv, Pm);
        RowMap<T>(values.get() + r0 * d, m, d, Eigen::OuterStride<>(d)) =
            P.rightCols(d).unaryExpr([](T v) { return v < T(0) ? T(0) : v; });
        T mx = -kInf;
        bool nan = false;
        Index real = 0;
        for (Index i = 0; i < m; ++i) {
            if (!p.key_padding.real(b, i0 + i)) continue;
            const T s = P(i, 0);
            if (std::isnan(s)) nan = true;
            mx = std::max(mx, s);
            ++real;
        }
        if (nan) mx = std::numeric_limits<T>::quiet_NaN();
        Eigen::Map<Vec<double>> ctx(bctx.get() + task * d, d);
        ctx.setZero();
        bmax[task] = mx;
        bsum[task] = 0.0;
        breal[task] = real;
        if (real == 0 || mx == -kInf) return;  // nothing here can carry weight
        Vec<T> e(m);
        double z = 0;
        for (Index i = 0; i < m; ++i) {
            e[i] = p.key_padding.real(b, i0 + i) ? std::exp(P(i, 0) - mx) : T(0);
            z += static_cast<double>(e[i]);
        }
        bsum[task] = z;
        if (real == m) {
            ctx = (e * P.middleCols(1, d)).template cast<double>();
        } else {  // skip padded tokens rather than weighting them by 0 (0 * NaN is NaN)
            Vec<T> acc = Vec<T>::Zero(d);
            for (Index i = 0; i < m; ++i)
                if (p.key_padding.real(b, i0 + i)) acc += e[i] * P.row(i).segment(1, d);
            ctx = acc.template cast<double>();
        }
    });

    // 2. Per batch element: merge the blocks' states into ctx = sum_n c_n k_n, c the softmax
    //    over the real tokens. No real token: ctx = 0.
    parallel_for(B, [&](Index b) {
        VecMap<T> ctx(context.get() + b * d, d);
        T mx = -kInf;
        bool nan = false, any = false;
        for (Index k = 0; k < per; ++k) {
            const Index t = b * per + k;
            if (breal[t] == 0) continue;
            any = true;
            if (std::isnan(bmax[t])) nan = true;
            mx = std::max(mx, bmax[t]);
        }
        if (!any) {
            ctx.setZero();
            return;
        }
        if (nan) mx = std::numeric_limits<T>::quiet_NaN();
        double z = 0;
        Vec<double> acc = Vec<double>::Zero(d);
        for (Index k = 0; k < per; ++k) {
            const Index t = b * per + k;
            if (breal[t] == 0 || bmax[t] == -kInf) continue;
            const double f = std::exp(static_cast<double>(bmax[t]) - static_cast<double>(mx));
            z += f * bsum[t];
            acc += f * Eigen::Map<const Vec<double>>(bctx.get() + t * d, d);
        }
        // every real score -inf, or NaN/Inf among them: z is 0 or NaN and ctx NaN, as torch
        ctx = (acc / z).template cast<T>();
    });

    // 3. out = relu(v) (diag(ctx) w_o) + b_o.
    const TaskGrid grid(B, n);
    parallel_for(grid.size(), [&](Index t) {
        Index b, r0, r1;
        grid.at(t, b, r0, r1);
        const RowMatrix<T> Wb = ConstVecMap<T>(context.get() + b * d, d).asDiagonal() * Wo;
        for (Index i0 = r0; i0 < r1; i0 += kRowBlock) {
            const Index m = std::min(kRowBlock, r1 - i0), row = b * n + i0;
            ConstRowMap<T> Vv(values.get() + row * d, m, d, Eigen::OuterStride<>(d));
            RowMap<T> Y(p.out + row * dout, m, dout, Eigen::OuterStride<>(dout));
            if (d == 0) {
                Y.setZero();
            } else {
                Y.noalias() = Vv * Wb;
            }
            if (p.b_o) Y.rowwise() += ConstVecMap<T>(p.b_o, dout);
        }
    });
}

template void additive_attention_forward<float>(const AdditiveProblem<float>&);
template void additive_attention_forward<double>(const AdditiveProblem<double>&);
template void separable_attention_forward<float>(const SeparableProblem<float>&);
template void separable_attention_forward<double>(const SeparableProblem<double>&);

}  // namespace attnlab

#include "attnlab/additive.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>

#include "attnlab/gemm.hpp"
#include "attnlab/threading.hpp"
#include "bf16_block.hpp"
#include "entry_points.hpp"
#include "pooled.hpp"
#include "products.hpp"
#include "scratch.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp

namespace detail {
namespace {

// ||v||_2 as sqrt(sum v^2), the formula torch and NumPy use, falling back to Eigen's scaled
// norm only when the squares underflow or overflow (so tiny and huge rows stay exact).
// Out of line, on n contiguous values seen as a vector or (AsRow) as a 1 x n row-major matrix,
// whose reductions Eigen sums in another order: one instantiation of each per scalar type
// (Eigen's stableNorm is costly to compile, and was instantiated for every expression type).
template <typename T, bool AsRow>
EIGEN_DONT_INLINE T robust_norm(const T* data, Index n) {
    const auto v = [&] {
        if constexpr (AsRow) {
            return ConstRowMap<T>(data, 1, n, Eigen::OuterStride<>(n));
        } else {
            return ConstVecMap<T>(data, n);
        }
    }();
    const T sq = v.squaredNorm();
    if (std::isnan(sq)) return sq;
    if (sq >= std::numeric_limits<T>::min() && sq <= std::numeric_limits<T>::max())
        return std::sqrt(sq);
    return v.stableNorm();
}

// A vector expression over contiguous values, or a one-row row-major matrix view.
template <typename Derived>
typename Derived::Scalar robust_norm(const Eigen::MatrixBase<Derived>& v) {
    static_assert(Derived::InnerStrideAtCompileTime == 1, "robust_norm reads contiguous values");
    using T = typename Derived::Scalar;
    if constexpr (Derived::IsVectorAtCompileTime) {
        return robust_norm<T, false>(v.derived().data(), v.size());
    } else {
        eigen_assert(v.rows() == 1);
        return robust_norm<T, true>(v.derived().data(), v.size());
    }
}

// v / max(||v||, eps) in place, for every row; the norms into `norms` when set.
template <typename T, typename M>
void normalize_rows(M& Y, T eps, T* norms = nullptr) {
    for (Index i = 0; i < Y.rows(); ++i) {
        const T nrm = robust_norm(Y.row(i));
        if (norms) norms[i] = nrm;
        Y.row(i) /= std::max(nrm, eps);  // NaN norms propagate (std::max keeps its first arg)
    }
}

// Backward of u = v / max(||v||, eps), in place on du, as torch's autograd computes it: above
// eps the projection (du - u (u . du)) / ||v||; below it max() sends the gradient to eps, a
// constant, so du / eps.
template <typename T, typename R1, typename R2>
void normalize_backward(R1&& du, const R2& u, T nrm, T eps) {
    if (nrm >= eps) {
        const T dot = u.dot(du);
        du = (du - dot * u) / nrm;
    } else {
        du /= eps;
    }
}

}  // namespace
}  // namespace detail

namespace detail {
namespace {

// Rows of a call from which additive_pool stacks w_k and w_q (docs/performance.md).
inline constexpr Index kStackedRows = 2048;
// D from which the float forwards take the form as written (docs/performance.md).
inline constexpr Index kWrittenWidth = 256;

// The problem's weight matrices as PooledWeights (floats, or p.half_weights' bits).
template <typename T>
struct AdditiveWeights {
    PooledWeight<T> w_q, w_k, w_proj, w_final;
    explicit AdditiveWeights(const AdditiveProblem<T>& p)
        : w_q(p.w_q, p.half_weights.w_q, p.half.format, p.d_in, p.width),
          w_k(p.w_k, p.half_weights.w_k, p.half.format, p.d_in, p.width),
          w_proj(p.w_proj, p.half_weights.w_proj, p.half.format, p.width, p.width),
          w_final(p.w_final, p.half_weights.w_final, p.half.format, p.width, p.d_out) {}
};

// [w_k | w_q] (d_in x 2D) and [b_k | b_q]: both projections in one product.
template <typename T>
struct StackedKQ {
    RowMatrix<T> w;
    Vec<T> b;
    explicit StackedKQ(const AdditiveProblem<T>& p) : w(p.d_in, 2 * p.width), b(2 * p.width) {
        const Index D = p.width;
        const AdditiveWeights<T> given(p);
        given.w_k.copy_to(w.data(), 2 * D);
        given.w_q.copy_to(w.data() + D, 2 * D);
        b.setZero();
        if (p.b_k) b.head(D) = ConstVecMap<T>(p.b_k, D);
        if (p.b_q) b.tail(D) = ConstVecMap<T>(p.b_q, D);
    }
};

// Steps 1 and 2 of the additive forward, which the backward runs too when it has no kept state
// (one code path, so the two agree bitwise). Writes st.score and st.pooled; st.k, st.q and the
// norms when set (the float forward without state keeps only K); with `out`, out = Q w_final
// (the forward's first term, while Q is in cache). projected (rows x 2D, the bf16 forward's):
// where each task has fill(r0, m) write its rows [K | Q] before their normalisation, which
// then happens there, in place (the float forwards project into a block of the thread).
template <typename T>
void additive_pool(const AdditiveProblem<T>& p, const AdditiveState<T>& st, T* out,
                   T* projected = nullptr, const std::function<void(Index, Index)>& fill = {}) {
    const Index B = p.batch, n = p.n, din = p.d_in, D = p.width, dout = p.d_out;
    const bool official = p.variant == AdditiveVariant::official;
    const Index ld = 2 * D;

    // the weights' panels, packed once for the products this call runs: [w_k | w_q] stacked
    // into one product, or, for few rows (where copying the weights costs more than the edge
    // columns of two products), w_k and w_q as given
    const bool stacked = B * n >= kStackedRows;
    std::optional<StackedKQ<T>> kq;
    std::optional<PooledWeight<T>> Wkq;
    AdditiveWeights<T> w(p);
    if (!projected && stacked) {
        kq.emplace(p);
        Wkq.emplace(kq->w.data(), din, ld, ld);
        Wkq->pack();
    } else if (!projected) {
        w.w_k.pack();
        w.w_q.pack();
    }
    if (out) w.w_final.pack();

    T* score = st.score;
    const Index per = (n + kRowBlock - 1) / kRowBlock;  // row blocks per batch element
    auto partial = make_buffer<double>(B * per * D);

    // 1. Per (batch element, block of rows): [K | Q] in one GEMM, both row-normalised; the
    //    official scores s = (Q w_g) * scale; the block's share of the pooling, the sum over
    //    its real tokens of s_n Q_n (official) or Q_n (hf) (the token weights are
    //    a_n = s_n / max(||s||, eps), so G = (sum s_n Q_n) / max(||s||, eps)).
    auto pool_block = [&](auto& KQ, Index task, Index b, Index i0, Index m) {
        const Index r0 = b * n + i0;
        auto K = KQ.leftCols(D);
        auto Q = KQ.rightCols(D);
        normalize_rows(K, p.eps, st.k_norm ? st.k_norm + r0 : nullptr);
        normalize_rows(Q, p.eps, st.q_norm ? st.q_norm + r0 : nullptr);
        if (st.k) RowMap<T>(st.k + r0 * D, m, D, Eigen::OuterStride<>(D)) = K;
        if (st.q) RowMap<T>(st.q + r0 * D, m, D, Eigen::OuterStride<>(D)) = Q;
        if (official) {
            ConstVecMap<T> wg(p.w_g, D);
            for (Index i = 0; i < m; ++i) score[r0 + i] = Q.row(i).dot(wg) * p.scale;
        } else {
            std::fill(score + r0, score + r0 + m, T(1));
        }
        bool all_real = true;
        for (Index i = 0; i < m && all_real; ++i) all_real = p.key_padding.real(b, i0 + i);
        auto share = scratch_vector<T>(ScratchBuffer::kAdditiveShare, D);
        if (all_real) {
            if (official) {
                eigen_product<T>(cview<T>(score + r0, 1, m, m), cview<T>(KQ.data() + D, m, D, ld),
                                 view<T>(share.data(), 1, D, D));
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
        if (out) {
            w.w_final.product(cview<T>(KQ.data() + D, m, D, ld),
                              view<T>(out + r0 * dout, m, dout, dout));
        }
    };
    pool_blocks<T>(
        B, n, ld, projected, fill,
        [&](Index r0, Index m) {
            if (stacked) return project_block<T>(p.x, r0, m, din, {{&*Wkq, kq->b.data()}}, p.half);
            return project_block<T>(p.x, r0, m, din, {{&w.w_k, p.b_k}, {&w.w_q, p.b_q}}, p.half);
        },
        pool_block);

    // 2. Per batch element: the norm of the real tokens' scores and G, summing the blocks'
    //    shares in a fixed order, in double. No real token: G = 0.
    parallel_for(B, [&](Index b) {
        VecMap<T> G(st.pooled + b * D, D);
        if (st.score_norm) st.score_norm[b] = T(0);
        Index real = 0;
        for (Index j = 0; j < n; ++j) real += p.key_padding.real(b, j) ? 1 : 0;
        if (real == 0) {
            G.setZero();
            return;
        }
        auto acc = scratch_vector<double>(ScratchBuffer::kAdditivePooled, D);
        acc.setZero();
        for (Index k = 0; k < per; ++k)
            acc += Eigen::Map<const Vec<double>>(partial.get() + (b * per + k) * D, D);
        if (official) {
            auto s =
                scratch_vector<T>(ScratchBuffer::kAdditiveWeights, real);  // real tokens' scores
            Index r = 0;
            for (Index j = 0; j < n; ++j)
                if (p.key_padding.real(b, j)) s[r++] = score[b * n + j];
            const T nrm = robust_norm(s);
            if (st.score_norm) st.score_norm[b] = nrm;
            acc /= static_cast<double>(std::max(nrm, p.eps));
        }
        G = acc.template cast<T>();
    });
}

// The output as the module writes it, over blocks of rows: Z = G * K; H = Z w_proj +
// b_proj + Q; out = H w_final + b_final (rounded into p.half.out's rows when set). K and Q:
// normalised rows, ld apart; G: pooled (B x D). product(step, m, in, bias, y): the block's
// product with w_proj (step 0, into H) or w_final (step 1, into y), its bias added.
template <typename T, typename Product>
void as_written_rows(const AdditiveProblem<T>& p, const T* K, const T* Q, Index ld, const T* pooled,
                     Product product) {
    const Index D = p.width;
    written_rows(p.batch, p.n, D, p.d_out, K, ld, pooled, p.out, p.half,
                 [&](Index r0, Index m, const T* z, T* y) {
                     T* h = scratch<T>(ScratchBuffer::kAdditiveFolded,
                                       static_cast<std::size_t>(m * D));
                     product(0, m, z, p.b_proj, h);
                     for (Index i = 0; i < m; ++i) {
                         const T* q = Q + (r0 + i) * ld;
                         for (Index j = 0; j < D; ++j) h[i * D + j] += q[j];
                     }
                     product(1, m, h, p.b_final, y);
                 });
}

// precision="bf16": the module's four weight products as bf16 products of row blocks
// (Bf16Weight), the norms, scores and pooling between them in float32, each block's
// intermediates in cache. Not folded as the float forward is: the rounded operands are the
// ones the form names.
void additive_forward_bf16(const AdditiveProblem<float>& p) {
    const Index B = p.batch, n = p.n, din = p.d_in, D = p.width, dout = p.d_out;
    const Index rows = B * n, ld = 2 * D;
    const StackedKQ<float> kq(p);
    const Bf16Weight w_kq(kq.w.data(), din, ld),
        w_proj(p.w_proj, D, D, p.half_weights.w_proj, p.half.format),
        w_final(p.w_final, D, dout, p.half_weights.w_final, p.half.format);
    // 1. [K | Q] of every block, normalised in place; the scores and G
    auto KQ = make_buffer<float>(rows * ld);
    auto score = make_buffer<float>(rows), pooled = make_buffer<float>(B * D);
    AdditiveState<float> st;
    st.score = score.get();
    st.pooled = pooled.get();
    additive_pool(p, st, static_cast<float*>(nullptr), KQ.get(), [&](Index r0, Index m) {
        w_kq.product(m, p.x ? p.x + r0 * din : nullptr, p.half.x ? p.half.x + r0 * din : nullptr,
                     p.half.format, din, kq.b.data(), KQ.get() + r0 * ld, ld);
    });

    // 2. Per block: Z = G * K; H = Z w_proj + b_proj + Q; out = H w_final + b_final
    as_written_rows(p, KQ.get(), KQ.get() + D, ld, st.pooled,
                    [&](int step, Index m, const float* in, const float* bias, float* y) {
                        const Bf16Weight& w = step == 0 ? w_proj : w_final;
                        w.product(m, in, nullptr, HalfFormat::none, D, bias, y,
                                  step == 0 ? D : dout);
                    });
}

// The float forward as the module writes it (as_written_rows), its weights packed once: for
// few rows per batch element, where the folded form's M = w_proj w_final and its per-element
// diag(G) M would cost more than the rows' own products, and for wide rows (the caller says
// why).
template <typename T>
void additive_forward_as_written(const AdditiveProblem<T>& p) {
    const Index rows = p.batch * p.n, D = p.width, dout = p.d_out;
    Buffer<T> keys, queries, score, pooled;
    AdditiveState<T> st = p.state;
    if (!st.k) {
        keys = make_buffer<T>(rows * D);
        score = make_buffer<T>(rows);
        pooled = make_buffer<T>(p.batch * D);
        st = AdditiveState<T>{};
        st.k = keys.get();
        st.score = score.get();
        st.pooled = pooled.get();
    }
    if (!st.q) st.q = (queries = make_buffer<T>(rows * D)).get();  // (a state without Q)
    additive_pool(p, st, static_cast<T*>(nullptr));
    AdditiveWeights<T> w(p);
    w.w_proj.pack();
    w.w_final.pack();
    as_written_rows(p, st.k, st.q, D, st.pooled,
                    [&](int step, Index m, const T* in, const T* bias, T* y) {
                        const Index cols = step == 0 ? D : dout;
                        project<T>(cview<T>(in, m, D, D), step == 0 ? w.w_proj : w.w_final, bias,
                                   view<T>(y, m, cols, cols));
                    });
}

}  // namespace
}  // namespace detail

template <typename T>
void additive_attention_forward(const AdditiveProblem<T>& p) {
    using namespace detail;
    const Index B = p.batch, n = p.n, D = p.width, dout = p.d_out;
    const Index rows = B * n;
    if (rows <= 0 || dout <= 0) return;
    if constexpr (std::is_same_v<T, float>) {
        if (p.bf16) {
            additive_forward_bf16(p);
            return;
        }
    }

    // Few rows a batch element (see additive_forward_as_written), or wide rows, where the two
    // forms cost the same in float32 and a half-precision output is summed in a block of the
    // thread rather than in a float32 copy of the whole output (docs/performance.md).
    if (p.n < p.width || p.width >= kWrittenWidth) {
        additive_forward_as_written(p);
        return;
    }
    // With M = w_proj w_final and c = b_proj w_final + b_final,
    //   out = (K diag(G) w_proj + b_proj + Q) w_final + b_final = K (diag(G) M) + Q w_final + c:
    // G is folded into the weights (G * K is never formed), Q w_final is computed while Q is in
    // cache, and only K has to be kept until G is known. For d_out <= D this costs no more
    // operations a row than the two-step form, and M once (the two-step form, with both
    // blocks' products in cache, measured slower where D < 256: docs/performance.md).
    RowMatrix<T> M(D, dout);  // on the threads: serially it held the call's start back
    project<T>(D, p.w_proj,
               Linear<T>{p.w_final, nullptr, D, dout, p.half_weights.w_final, p.half.format},
               M.data(), /*bf16=*/false, p.half_weights.w_proj);
    Vec<T> c = p.b_final ? Vec<T>(ConstVecMap<T>(p.b_final, dout)) : Vec<T>(Vec<T>::Zero(dout));
    if (p.b_proj)
        AdditiveWeights<T>(p).w_final.product(cview<T>(p.b_proj, 1, D, D),
                                              view<T>(c.data(), 1, dout, dout), true);

    // Without a state to fill, only K, the scores and G, in buffers of this call.
    Buffer<T> keys, score, pooled;
    AdditiveState<T> st = p.state;
    if (!st.k) {
        keys = make_buffer<T>(rows * D);
        score = make_buffer<T>(rows);
        pooled = make_buffer<T>(B * D);
        st = AdditiveState<T>{};
        st.k = keys.get();
        st.score = score.get();
        st.pooled = pooled.get();
    }
    // the sums in float32 until step 3 rounds them (x and out in half precision)
    Buffer<T> own_out = p.out ? Buffer<T>() : make_buffer<T>(rows * dout);
    T* const out = p.out ? p.out : own_out.get();
    additive_pool(p, st, out);

    // 3. out += K (diag(G) M) + c.
    folded_rows<T>(B, n, D, dout, st.pooled, PooledWeight<T>(M.data(), D, dout, dout), st.k, out,
                   p.half, [&](const auto& K, auto& Y, const auto& W, const T* packed) {
                       block_product<T>(K, cview<T>(W.data(), D, dout, dout), Y, true, packed);
                       Y.rowwise() += c;
                   });
}

template <typename T>
void additive_attention_backward(const AdditiveProblem<T>& p, const T* grad_out,
                                 const AdditiveGrads<T>& g) {
    using namespace detail;
    const Index B = p.batch, n = p.n, din = p.d_in, D = p.width, dout = p.d_out;
    const Index rows = B * n;
    const bool official = p.variant == AdditiveVariant::official;
    fill_zero(g.w_g, D);  // hf: w_g has no effect
    if (rows <= 0 || dout <= 0) {
        fill_zero(g.x, rows * din);
        fill_zero(p.half.grad_x, rows * din);
        fill_zero(g.w_q, din * D);
        fill_zero(g.b_q, D);
        fill_zero(g.w_k, din * D);
        fill_zero(g.b_k, D);
        fill_zero(g.w_proj, D * D);
        fill_zero(g.b_proj, D);
        fill_zero(g.w_final, D * dout);
        fill_zero(g.b_final, dout);
        return;
    }
    auto row_map = [&](T* base, Index r0, Index m) {
        return RowMap<T>(base + r0 * D, m, D, Eigen::OuterStride<>(D));
    };
    auto crow = [&](const T* base, Index r0, Index m) {
        return ConstRowMap<T>(base + r0 * D, m, D, Eigen::OuterStride<>(D));
    };

    // The forward's intermediates: normalised K and Q with their norms, the scores, G. Kept by
    // the forward (attnlab.vjp), or its pooling run again here, on the same code.
    AdditiveState<T> st = p.state;
    Buffer<T> kept[7];
    if (!st.filled) {
        int next = 0;
        auto own = [&](T*& ptr, Index count) {
            kept[next] = make_buffer<T>(count);
            ptr = kept[next++].get();
        };
        own(st.q, rows * D);
        own(st.k, rows * D);
        own(st.q_norm, rows);
        own(st.k_norm, rows);
        own(st.score, rows);
        own(st.score_norm, B);
        own(st.pooled, B * D);
        additive_pool(p, st, static_cast<T*>(nullptr));
    }
    const T* Qb = st.q;
    const T* Kb = st.k;
    const T* nq = st.q_norm;
    const T* nk = st.k_norm;
    const T* score = st.score;
    const T* snorm = st.score_norm;  // ||s|| over the real tokens (official)
    const Eigen::Map<const RowMatrix<T>> G(st.pooled, B, D);
    const ConstVecMap<T> wg(p.w_g, D);
    auto real = [&](Index r) { return p.key_padding.real(r / n, r % n); };
    auto den = [&](Index b) { return official ? std::max(snorm[b], p.eps) : T(1); };
    // weighted sum over a block's real tokens of w(r) * M.row(r)
    auto real_sum = [&](const T* M, Index b, Index i0, Index m, auto w, auto& share) {
        share.setZero();
        for (Index i = 0; i < m; ++i) {
            const Index r = b * n + i0 + i;
            if (p.key_padding.real(b, i0 + i)) share += w(r) * crow(M, r, 1);
        }
    };

    // Z = G * K, H = Z w_proj + b_proj + Q; then the two output layers' gradients.
    auto Zb = make_buffer<T>(rows * D), Hb = make_buffer<T>(rows * D),
         dH = make_buffer<T>(rows * D);
    for_row_blocks(rows, [&](Index r0, Index m) {
        for (Index r = r0; r < r0 + m; ++r)
            row_map(Zb.get(), r, 1) = crow(Kb, r, 1).cwiseProduct(G.row(r / n));
    });
    // the layers, each weight float or half-precision bits (p.half_weights)
    const AdditiveTensors<const std::uint16_t*>& bits = p.half_weights;
    const HalfFormat f = p.half.format;
    const Linear<T> proj{p.w_proj, p.b_proj, D, D, bits.w_proj, f};
    const Linear<T> final{p.w_final, nullptr, D, dout, bits.w_final, f};
    project<T>(rows, Zb.get(), proj, Hb.get(), /*bf16=*/false);
    for_row_blocks(rows, [&](Index r0, Index m) { row_map(Hb.get(), r0, m) += crow(Qb, r0, m); });
    const HalfGradOperands half_go = half_grad_out(p.half);
    linear_weight_grad(rows, D, dout, Hb.get(), D, grad_out, dout, g.w_final, g.b_final,
                       static_cast<const T*>(nullptr), half_go);
    linear_input_grad(rows, D, dout, grad_out, dout, p.w_final, dH.get(), D, false,
                      layer_half(final, nullptr, p.half.grad_out));
    linear_weight_grad(rows, D, D, Zb.get(), D, dH.get(), D, g.w_proj, g.b_proj);
    T* dZ = Hb.get();  // H is no longer needed
    linear_input_grad(rows, D, D, dH.get(), D, p.w_proj, dZ, D, false, layer_half(proj));

    // dG = sum over every token (padded ones too: they have an output) of K * dZ; dK = G * dZ.
    const RowMatrix<double> dGd =
        block_sums<T>(B, n, D, [&](Index b, Index i0, Index m, auto& share) {
            const Index r0 = b * n + i0;
            share = crow(Kb, r0, m).cwiseProduct(row_map(dZ, r0, m)).colwise().sum();
        });
    const RowMatrix<T> dG = dGd.template cast<T>();
    for_row_blocks(rows, [&](Index r0, Index m) {
        for (Index r = r0; r < r0 + m; ++r) row_map(dZ, r, 1).array() *= G.row(r / n).array();
    });

    // Through the pooling: G = sum_R a_n Q_n. official: a = s / max(||s||, eps), s = (Q w_g) scale.
    auto ds = make_buffer<T>(rows);
    if (official) {
        auto da = make_buffer<T>(rows);  // dL/da_n = Q_n . dG
        for_row_blocks(rows, [&](Index r0, Index m) {
            for (Index r = r0; r < r0 + m; ++r)
                da[r] = real(r) ? crow(Qb, r, 1).row(0).dot(dG.row(r / n)) : T(0);
        });
        const RowMatrix<double> adot =
            block_sums<T>(B, n, 1, [&](Index b, Index i0, Index m, auto& acc) {
                acc.setZero();
                for (Index r = b * n + i0; r < b * n + i0 + m; ++r)
                    if (real(r)) acc[0] += score[r] / den(r / n) * da[r];
            });
        for_row_blocks(rows, [&](Index r0, Index m) {
            for (Index r = r0; r < r0 + m; ++r) {
                const Index b = r / n;
                if (!real(r)) {
                    ds[r] = T(0);
                } else if (snorm[b] >= p.eps) {
                    const T a = score[r] / snorm[b];
                    ds[r] = (da[r] - a * static_cast<T>(adot(b, 0))) / snorm[b];
                } else {
                    ds[r] = da[r] / p.eps;
                }
            }
        });
        // dw_g = scale * sum over batch elements and real tokens of ds_n Q_n
        const RowMatrix<double> dwg =
            block_sums<T>(B, n, D, [&](Index b, Index i0, Index m, auto& share) {
                real_sum(
                    Qb, b, i0, m, [&](Index r) { return ds[r]; }, share);
            });
        Vec<double> acc = Vec<double>::Zero(D);
        for (Index b = 0; b < B; ++b) acc += dwg.row(b);
        VecMap<T>(g.w_g, D) = (acc * static_cast<double>(p.scale)).template cast<T>();
    }
    // dQ = dH + [real] (a_n dG + ds_n scale w_g), in place in dH; then both normalisations.
    for_row_blocks(rows, [&](Index r0, Index m) {
        for (Index r = r0; r < r0 + m; ++r) {
            const Index b = r / n;
            auto dQ = row_map(dH.get(), r, 1);
            if (real(r)) {
                if (official) {
                    dQ += (score[r] / den(b)) * dG.row(b);
                    dQ += (ds[r] * p.scale) * wg;
                } else {
                    dQ += dG.row(b);
                }
            }
            normalize_backward(dQ.row(0), crow(Qb, r, 1).row(0), nq[r], p.eps);
            normalize_backward(row_map(dZ, r, 1).row(0), crow(Kb, r, 1).row(0), nk[r], p.eps);
        }
    });

    // The input projections; a half-precision dx summed in float32 here, rounded by the second.
    Buffer<T> dx_sums = p.half.grad_x ? make_buffer<T>(rows * din) : Buffer<T>();
    T* dx = p.half.grad_x ? dx_sums.get() : g.x;
    linear_input_grad(rows, din, D, dH.get(), D, p.w_q, dx, din, false,
                      layer_half(Linear<T>{p.w_q, nullptr, din, D, bits.w_q, f}));
    HalfGradOperands via_k = layer_half(Linear<T>{p.w_k, nullptr, din, D, bits.w_k, f});
    via_k.dx = p.half.grad_x;
    linear_input_grad(rows, din, D, dZ, D, p.w_k, dx, din, true, via_k);
    Buffer<T> xt;  // X^T once for both weight gradients
    if (((g.w_q && g.w_k) || p.half.x) && din > 0) {
        xt = make_buffer<T>(din * rows);
        transpose_rows(rows, din, p.x, p.half.x, din, p.half.format, xt.get());
    }
    linear_weight_grad(rows, din, D, p.x, din, dH.get(), D, g.w_q, g.b_q, xt.get());
    linear_weight_grad(rows, din, D, p.x, din, dZ, D, g.w_k, g.b_k, xt.get());
}

ATTNLAB_INSTANTIATE_ENTRY_POINTS(additive_attention, AdditiveProblem, AdditiveGrads);

}  // namespace attnlab::ATTNLAB_ISA_NS

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "attnlab/additive.hpp"
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

// Steps 1 and 2 of the separable forward, which the backward runs too when it has no kept
// state (one code path: the two agree bitwise). Writes st.context; st.v (relu(v)), st.s and
// st.k when set (the float forward without state keeps only relu(v)). projected (rows x
// (1 + 2d), the bf16 forward's): where each task has fill(r0, m) write its rows [s | k | v]
// (then v made relu(v) there) instead of a GEMM into a block of the thread.
template <typename T>
void separable_pool(const SeparableProblem<T>& p, const SeparableState<T>& st,
                    T* projected = nullptr, const std::function<void(Index, Index)>& fill = {}) {
    const Index B = p.batch, n = p.n, d = p.d;
    const Index ld = 1 + 2 * d;  // block rows are [s | k | v]
    constexpr T kInf = std::numeric_limits<T>::infinity();

    PooledWeight<T> Wqkv(p.w_qkv, p.half_weights.w_qkv, p.half.format, d, ld);
    if (!projected) Wqkv.pack();
    const Index per = (n + kRowBlock - 1) / kRowBlock;
    // Per (batch element, block): the block's softmax state over its real tokens, as in an
    // online softmax: its max m_b, sum_n exp(s_n - m_b), sum_n exp(s_n - m_b) k_n.
    auto bmax = make_buffer<T>(B * per);
    auto bsum = make_buffer<double>(B * per);
    auto bctx = make_buffer<double>(B * per * d);
    auto breal = make_buffer<Index>(B * per);

    // 1. [s | k | v] in one GEMM per block, the block's softmax state while k is in cache, and
    //    relu(v) (NaN stays NaN, as torch's relu).
    auto pool_block = [&](auto& P, Index task, Index b, Index i0, Index m) {
        const Index r0 = b * n + i0;
        const auto relu = P.rightCols(d).unaryExpr([](T v) { return v < T(0) ? T(0) : v; });
        if (st.v)
            RowMap<T>(st.v + r0 * d, m, d, Eigen::OuterStride<>(d)) = relu;
        else
            P.rightCols(d) = relu;  // elementwise: in place is safe
        if (st.k) RowMap<T>(st.k + r0 * d, m, d, Eigen::OuterStride<>(d)) = P.middleCols(1, d);
        if (st.s)
            for (Index i = 0; i < m; ++i) st.s[r0 + i] = P(i, 0);
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
        auto e = scratch_vector<T>(ScratchBuffer::kAdditiveWeights, m);
        double z = 0;
        for (Index i = 0; i < m; ++i) {
            e[i] = p.key_padding.real(b, i0 + i) ? std::exp(P(i, 0) - mx) : T(0);
            z += static_cast<double>(e[i]);
        }
        bsum[task] = z;
        if (real == m) {
            Vec<T> eP(d);
            eigen_product<T>(cview<T>(e.data(), 1, m, m), cview<T>(P.data() + 1, m, d, ld),
                             view<T>(eP.data(), 1, d, d));
            ctx = eP.template cast<double>();
        } else {  // skip padded tokens rather than weighting them by 0 (0 * NaN is NaN)
            auto acc = scratch_vector<T>(ScratchBuffer::kAdditiveShare, d);
            acc.setZero();
            for (Index i = 0; i < m; ++i)
                if (p.key_padding.real(b, i0 + i)) acc += e[i] * P.row(i).segment(1, d);
            ctx = acc.template cast<double>();
        }
    };
    pool_blocks<T>(
        B, n, ld, projected, fill,
        [&](Index r0, Index m) {
            return project_block<T>(p.x, r0, m, d, {{&Wqkv, p.b_qkv}}, p.half);
        },
        pool_block);

    // 2. Per batch element: merge the blocks' states into ctx = sum_n c_n k_n, c the softmax
    //    over the real tokens. No real token: ctx = 0.
    parallel_for(B, [&](Index b) {
        VecMap<T> ctx(st.context + b * d, d);
        T mx = -kInf;
        bool nan = false, any = false;
        for (Index k = 0; k < per; ++k) {
            const Index t = b * per + k;
            if (breal[t] == 0) continue;
            any = true;
            if (std::isnan(bmax[t])) nan = true;
            mx = std::max(mx, bmax[t]);
        }
        // No real token, or every real score -inf (masked out by the score itself, as a -inf
        // float mask in SDPA): nothing carries weight, ctx = 0 and out = b_o, never NaN.
        if (!any || (!nan && mx == -kInf)) {
            ctx.setZero();
            return;
        }
        if (nan) mx = std::numeric_limits<T>::quiet_NaN();
        double z = 0;
        auto acc = scratch_vector<double>(ScratchBuffer::kAdditivePooled, d);
        acc.setZero();
        for (Index k = 0; k < per; ++k) {
            const Index t = b * per + k;
            if (breal[t] == 0 || bmax[t] == -kInf) continue;
            const double f = std::exp(static_cast<double>(bmax[t]) - static_cast<double>(mx));
            z += f * bsum[t];
            acc += f * Eigen::Map<const Vec<double>>(bctx.get() + t * d, d);
        }
        // NaN among the real scores, or +inf: z or ctx is NaN (propagation, as torch)
        ctx = (acc / z).template cast<T>();
    });
}

// precision="bf16": x w_qkv + b_qkv and (relu(v) * ctx) w_o + b_o as bf16 products of row blocks
// (Bf16Weight), the softmax and ctx between them in float32; ctx is not folded into w_o, so the
// rounded operands are the ones the form names.
void separable_forward_bf16(const SeparableProblem<float>& p) {
    const Index B = p.batch, n = p.n, d = p.d, dout = p.d_out;
    const Index rows = B * n, ld = 1 + 2 * d;
    const Bf16Weight w_qkv(p.w_qkv, d, ld, p.half_weights.w_qkv, p.half.format),
        w_o(p.w_o, d, dout, p.half_weights.w_o, p.half.format);
    auto P = make_buffer<float>(rows * ld);
    auto context = make_buffer<float>(B * d);
    SeparableState<float> st;
    st.context = context.get();
    separable_pool(p, st, P.get(), [&](Index r0, Index m) {
        w_qkv.product(m, p.x ? p.x + r0 * d : nullptr, p.half.x ? p.half.x + r0 * d : nullptr,
                      p.half.format, d, p.b_qkv, P.get() + r0 * ld, ld);
    });
    // per block: U = relu(v) * ctx; out = U w_o + b_o
    written_rows(B, n, d, dout, P.get() + 1 + d, ld, st.context, p.out, p.half,
                 [&](Index, Index m, const float* u, float* y) {
                     w_o.product(m, u, nullptr, HalfFormat::none, d, p.b_o, y, dout);
                 });
}

}  // namespace
}  // namespace detail

template <typename T>
void separable_attention_forward(const SeparableProblem<T>& p) {
    using namespace detail;
    const Index B = p.batch, n = p.n, d = p.d, dout = p.d_out;
    const Index rows = B * n;
    if (rows <= 0 || dout <= 0) return;
    if constexpr (std::is_same_v<T, float>) {
        if (p.bf16) {
            separable_forward_bf16(p);
            return;
        }
    }
    PooledWeight<T> Wo(p.w_o, p.half_weights.w_o, p.half.format, d, dout);

    // Without a state to fill, only relu(v) (all the output needs) and ctx, in buffers of this
    // call.
    Buffer<T> values, context;
    SeparableState<T> st = p.state;
    if (!st.v) {
        values = make_buffer<T>(rows * d);
        context = make_buffer<T>(B * d);
        st = SeparableState<T>{};
        st.v = values.get();
        st.context = context.get();
    }
    separable_pool(p, st);

    if (16 * n <= d) {
        // few rows a batch element: per element, diag(ctx) w_o costs more than its rows
        Wo.pack();
        written_rows(B, n, d, dout, st.v, d, st.context, p.out, p.half,
                     [&](Index, Index m, const T* u, T* y) {
                         project<T>(cview<T>(u, m, d, d), Wo, p.b_o, view<T>(y, m, dout, dout));
                     });
        return;
    }
    // 3. out = relu(v) (diag(ctx) w_o) + b_o.
    folded_rows<T>(B, n, d, dout, st.context, Wo, st.v, p.out, p.half,
                   [&](const auto& Vv, auto& Y, const auto& Wb, const T* packed) {
                       if (d == 0) {
                           Y.setZero();
                       } else {
                           block_product<T>(Vv, cview<T>(Wb.data(), d, dout, dout), Y, false,
                                            packed);
                       }
                       if (p.b_o) Y.rowwise() += ConstVecMap<T>(p.b_o, dout);
                   });
}

template <typename T>
void separable_attention_backward(const SeparableProblem<T>& p, const T* grad_out,
                                  const SeparableGrads<T>& g) {
    using namespace detail;
    const Index B = p.batch, n = p.n, d = p.d, dout = p.d_out;
    const Index rows = B * n, ld = 1 + 2 * d;
    if (rows <= 0 || dout <= 0 || d <= 0) {
        fill_zero(g.x, rows * d);
        fill_zero(p.half.grad_x, rows * d);
        fill_zero(g.w_qkv, d * ld);
        fill_zero(g.b_qkv, ld);
        fill_zero(g.w_o, d * dout);
        fill_zero(g.b_o, dout);
        if (g.b_o && dout > 0) {  // out = b_o when there are no features
            Vec<T> row(dout);
            for (Index r = 0; r < rows; ++r)
                VecMap<T>(g.b_o, dout) +=
                    ConstVecMap<T>(grad_out_row(grad_out, p.half, r, dout, row.data()), dout);
        }
        return;
    }
    constexpr T kInf = std::numeric_limits<T>::infinity();
    auto drow = [&](T* base, Index r) { return VecMap<T>(base + r * d, d); };
    auto crow = [&](const T* base, Index r) { return ConstVecMap<T>(base + r * d, d); };
    auto prow = [&](T* base, Index r) { return VecMap<T>(base + r * ld, ld); };
    auto real = [&](Index r) { return p.key_padding.real(r / n, r % n); };

    // The forward's scores, keys, relu(v) and ctx: kept by the forward (attnlab.vjp), or its
    // pooling run again here, on the same code.
    SeparableState<T> st = p.state;
    Buffer<T> kept[4];
    if (!st.filled) {
        int next = 0;
        auto own = [&](T*& ptr, Index count) {
            kept[next] = make_buffer<T>(count);
            ptr = kept[next++].get();
        };
        own(st.s, rows);
        own(st.k, rows * d);
        own(st.v, rows * d);
        own(st.context, B * d);
        separable_pool(p, st);
    }
    const T* S = st.s;
    const T* Kv = st.k;
    const T* Rv = st.v;  // relu(v)
    const Eigen::Map<const RowMatrix<T>> ctx(st.context, B, d);

    // The softmax c over the real tokens (0 for padded ones).
    auto c = make_buffer<T>(rows);
    parallel_for(B, [&](Index b) {
        T mx = -kInf;
        bool nan = false;
        for (Index r = b * n; r < (b + 1) * n; ++r) {
            if (!real(r)) continue;
            nan = nan || std::isnan(S[r]);
            mx = std::max(mx, S[r]);
        }
        if (nan) mx = std::numeric_limits<T>::quiet_NaN();
        if (mx == -kInf) {  // no real token, or every real score -inf: c = 0, as the forward
            for (Index r = b * n; r < (b + 1) * n; ++r) c[r] = T(0);
            return;
        }
        double z = 0;
        for (Index r = b * n; r < (b + 1) * n; ++r) {
            c[r] = real(r) ? std::exp(S[r] - mx) : T(0);
            z += static_cast<double>(c[r]);
        }
        for (Index r = b * n; r < (b + 1) * n; ++r)
            if (real(r)) c[r] = static_cast<T>(static_cast<double>(c[r]) / z);
    });

    // U = relu(v) * ctx; out = U w_o + b_o.
    auto Ub = make_buffer<T>(rows * d), dU = make_buffer<T>(rows * d);
    for_row_blocks(rows, [&](Index r0, Index m) {
        for (Index r = r0; r < r0 + m; ++r)
            drow(Ub.get(), r) = crow(Rv, r).cwiseProduct(ctx.row(r / n));
    });
    const HalfGradOperands half_go = half_grad_out(p.half);
    linear_weight_grad(rows, d, dout, Ub.get(), d, grad_out, dout, g.w_o, g.b_o,
                       static_cast<const T*>(nullptr), half_go);
    linear_input_grad(
        rows, d, dout, grad_out, dout, p.w_o, dU.get(), d, false,
        layer_half(Linear<T>{p.w_o, nullptr, d, dout, p.half_weights.w_o, p.half.format}, nullptr,
                   p.half.grad_out));

    // dctx = sum over every token of relu(v) * dU.
    const RowMatrix<T> dctx = block_sums<T>(B, n, d, [&](Index b, Index i0, Index m, auto& share) {
                                  share.setZero();
                                  for (Index r = b * n + i0; r < b * n + i0 + m; ++r)
                                      share += crow(Rv, r).cwiseProduct(drow(dU.get(), r));
                              }).template cast<T>();

    // dP = [ds | dk | dv]: dv = [v > 0] ctx * dU (torch's relu: 0 at 0; relu(v) <= 0 exactly
    // when v <= 0, NaN passing as in torch); dk = c dctx over real tokens; ds = c (dc - sum_R
    // c dc), dc_n = k_n . dctx.
    auto dP = make_buffer<T>(rows * ld);
    auto dc = make_buffer<T>(rows);
    for_row_blocks(rows, [&](Index r0, Index m) {
        for (Index r = r0; r < r0 + m; ++r) {
            const Index b = r / n;
            const T* rv = Rv + r * d;
            auto dp = prow(dP.get(), r);
            for (Index j = 0; j < d; ++j)
                dp[1 + d + j] = rv[j] <= T(0) ? T(0) : ctx(b, j) * dU[r * d + j];
            if (real(r)) {
                dp.segment(1, d) = c[r] * dctx.row(b);
                dc[r] = crow(Kv, r).dot(dctx.row(b));
            } else {
                dp.segment(1, d).setZero();
                dc[r] = T(0);
            }
        }
    });
    const RowMatrix<double> cdot =
        block_sums<T>(B, n, 1, [&](Index b, Index i0, Index m, auto& acc) {
            acc.setZero();
            for (Index r = b * n + i0; r < b * n + i0 + m; ++r)
                if (real(r)) acc[0] += c[r] * dc[r];
        });
    for_row_blocks(rows, [&](Index r0, Index m) {
        for (Index r = r0; r < r0 + m; ++r)
            dP[r * ld] = real(r) ? c[r] * (dc[r] - static_cast<T>(cdot(r / n, 0))) : T(0);
    });

    HalfGradOperands via_qkv =
        layer_half(Linear<T>{p.w_qkv, nullptr, d, ld, p.half_weights.w_qkv, p.half.format});
    via_qkv.dx = p.half.grad_x;  // x's gradient rounded as this product writes it
    linear_input_grad(rows, d, ld, dP.get(), ld, p.w_qkv, g.x, d, false, via_qkv);
    linear_weight_grad(rows, d, ld, p.x, d, dP.get(), ld, g.w_qkv, g.b_qkv,
                       static_cast<const T*>(nullptr),
                       HalfGradOperands{p.half.x, nullptr, nullptr, p.half.format});
}

ATTNLAB_INSTANTIATE_ENTRY_POINTS(separable_attention, SeparableProblem, SeparableGrads);

}  // namespace attnlab::ATTNLAB_ISA_NS

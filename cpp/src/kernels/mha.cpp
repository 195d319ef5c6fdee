// Multi-head attention composed from its parts: the projections (gemm), the attention core
// over heads viewed as column blocks (attention_forward / attention_backward), the output
// projection.
#include "attnlab/attention.hpp"
#include "attnlab/gemm.hpp"
#include "entry_points.hpp"
#include "mha_bf16.hpp"
#include "project.hpp"
#include "qk_transform.hpp"
#include "scratch.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp

namespace detail {

// The attention over the heads of packed projections q (rows x h*d_head), k, v and the
// context buffer: heads are column blocks, viewed in place.
template <typename T>
AttentionProblem<T> head_problem(const MhaProblem<T>& p, const T* q, const T* k, const T* v,
                                 T* ctx) {
    const Index wq = p.heads * p.d_head, wk = p.kv_heads * p.d_head;
    const Index wv = p.kv_heads * p.d_vhead, wc = p.heads * p.d_vhead;
    AttentionProblem<T> a;
    a.batch = p.batch;
    a.heads = p.heads;
    a.kv_heads = p.kv_heads;
    a.n_q = p.n_q;
    a.n_k = p.n_k;
    a.d = p.d_head;
    a.d_v = p.d_vhead;
    a.scale = p.scale;
    a.q = {q, p.n_q * wq, p.d_head, wq};
    a.k = {k, p.n_k * wk, p.d_head, wk};
    a.v = {v, p.n_k * wv, p.d_vhead, wv};
    a.out = {ctx, p.n_q * wc, p.d_vhead, wc};
    a.mask = p.mask;
    return a;
}

// The forward's intermediates: in p.state when the caller keeps them, else in temporaries.
// With a QkTransform, q and k hold the projections and qt, kt the transformed heads the
// attention reads: the same arrays, unless the projections are kept (p.state) or the backward
// of a norm needs them (with the norm scales s_q, s_k).
template <typename T>
struct MhaBuffers {
    Buffer<T> own_q, own_k, own_v, own_ctx, own_lse, own_qt, own_kt, own_sq, own_sk;
    T *q, *k, *v, *ctx, *lse, *qt, *kt, *s_q = nullptr, *s_k = nullptr;

    MhaBuffers(const MhaProblem<T>& p, bool backward) {
        const Index rq = p.batch * p.n_q, rk = p.batch * p.n_k;
        const auto take = [](T* kept, Buffer<T>& own, Index n) {
            if (kept) return kept;
            own = make_buffer<T>(n);
            return own.get();
        };
        q = take(p.state.q, own_q, rq * p.heads * p.d_head);
        k = take(p.state.k, own_k, rk * p.kv_heads * p.d_head);
        v = take(p.state.v, own_v, rk * p.kv_heads * p.d_vhead);
        ctx = take(p.state.ctx, own_ctx, rq * p.heads * p.d_vhead);
        lse = p.state.lse || backward ? take(p.state.lse, own_lse, p.batch * p.heads * p.n_q)
                                      : nullptr;
        qt = q;
        kt = k;
        if (!p.qk.any()) return;
        // in place unless kept, or the backward's norm needs them (the rotation does not)
        if (p.state.q || (backward && p.qk.q_norm))
            qt = take(nullptr, own_qt, rq * p.heads * p.d_head);
        if (p.state.k || (backward && p.qk.k_norm))
            kt = take(nullptr, own_kt, rk * p.kv_heads * p.d_head);
        if (backward && p.qk.q_norm) s_q = take(nullptr, own_sq, rq * p.heads);
        if (backward && p.qk.k_norm) s_k = take(nullptr, own_sk, rk * p.kv_heads);
    }
};

// The heads the attention reads, qt and kt, from the projections q and k (p.qk).
template <typename T>
void transform_heads(const MhaProblem<T>& p, const MhaBuffers<T>& b) {
    if (!p.qk.any()) return;
    qk_forward(query_side(p), b.q, b.qt, b.s_q);
    qk_forward(key_side(p), b.k, b.kt, b.s_k);
}

// Projections (one GEMM each over all rows; heads are then column blocks of q, k, v) and the
// attention core, into b.
template <typename T>
AttentionProblem<T> mha_core_forward(const MhaProblem<T>& p, const MhaBuffers<T>& b) {
    const Index rq = p.batch * p.n_q, rk = p.batch * p.n_k;
    if (!p.bf16) {  // float32/float64 products: their tasks in one parallel region
        // (half-precision inputs and weights read as stored, widened by the tasks)
        const auto call = [](Index rows, const T* x, const std::uint16_t* x_half,
                             const Linear<T>& l, T* y) {
            LinearCall<T> c{rows, l.in, l.out, x, l.in, l.w, l.b, y, l.out, l.packed};
            c.half = HalfOperands{x_half, l.w_half, nullptr, l.half};
            return c;
        };
        const LinearCall<T> calls[3] = {call(rq, p.query, p.query_half, p.w_q, b.q),
                                        call(rk, p.key, p.key_half, p.w_k, b.k),
                                        call(rk, p.value, p.value_half, p.w_v, b.v)};
        linear_group(calls, 3);
    } else {
        project(rq, p.query, p.w_q, b.q, p.bf16, p.query_half);
        project(rk, p.key, p.w_k, b.k, p.bf16, p.key_half);
        project(rk, p.value, p.w_v, b.v, p.bf16, p.value_half);
    }
    transform_heads(p, b);
    AttentionProblem<T> a = head_problem(p, b.qt, b.kt, b.v, b.ctx);
    a.lse = b.lse;
    if (p.bf16) a.bf16 = Bf16::probabilities;
    return a;
}

}  // namespace detail

template <typename T>
void multi_head_attention_forward(const MhaProblem<T>& p) {
    const Index rq = p.batch * p.n_q;
#if defined(ATTNLAB_AMX)
    if constexpr (std::is_same_v<T, float>) {
        if (p.bf16 && !p.qk.any()) {
            AttentionProblem<T> a = detail::head_problem<T>(p, nullptr, nullptr, nullptr, nullptr);
            a.bf16 = Bf16::probabilities;
            if (detail::mha_bf16_fused(p, a)) return;
        }
    }
#endif
    detail::MhaBuffers<T> b(p, false);
    AttentionProblem<T> a = detail::mha_core_forward(p, b);
    a.weights = p.weights;
    a.weights_half = p.weights_half;
    a.weights_format = p.w_o.half;
    attention_forward(a);
    detail::project(rq, b.ctx, p.w_o, p.out, p.bf16, nullptr, p.out_half);
}

template <typename T>
void multi_head_attention_backward(const MhaProblem<T>& p, const T* grad_out,
                                   const MhaGrads<T>& g) {
    const Index rq = p.batch * p.n_q, rk = p.batch * p.n_k;
    const Index wq = p.heads * p.d_head, wk = p.kv_heads * p.d_head;
    const Index wv = p.kv_heads * p.d_vhead, wc = p.heads * p.d_vhead;
    const Index d_out = p.w_o.out;
    detail::MhaBuffers<T> b(p, true);
    AttentionProblem<T> a;
    if (p.state.filled) {               // attnlab.vjp: the forward kept everything
        detail::transform_heads(p, b);  // but the normalised, rotated heads (O(n d))
        a = detail::head_problem(p, b.qt, b.kt, b.v, b.ctx);
        a.lse = b.lse;
    } else {
        a = detail::mha_core_forward(p, b);
    }
    // bf16: the function differentiated rounds Q, K, V only, once for its forward and backward
    detail::Bf16Operands<T> rounded;
    if (a.bf16 != Bf16::none) {
        rounded = detail::bf16_operands(a);
        rounded.p.bf16 = Bf16::none;
        a = rounded.p;
    }
    if (!p.state.filled) attention_forward(a);
    const T* ctx = b.ctx;
    // output projection: dW_o = ctx^T dY, db_o = sum dY, dctx = dY W_o^T
    linear_weight_grad(rq, wc, d_out, ctx, wc, grad_out, d_out, g.w_o.w, g.w_o.b,
                       static_cast<const T*>(nullptr),
                       detail::layer_half(p.w_o, nullptr, g.grad_out_half, g.w_o));
    auto dctx = make_buffer<T>(rq * wc);
    linear_input_grad(rq, wc, d_out, grad_out, d_out, p.w_o.w, dctx.get(), wc, false,
                      detail::layer_half(p.w_o, nullptr, g.grad_out_half));

    auto dq = make_buffer<T>(rq * wq), dk = make_buffer<T>(rk * wk), dv = make_buffer<T>(rk * wv);
    AttentionGrad<T> ag;
    ag.d_out = {dctx.get(), p.n_q * wc, p.d_vhead, wc};
    ag.d_q = {dq.get(), p.n_q * wq, p.d_head, wq};
    ag.d_k = {dk.get(), p.n_k * wk, p.d_head, wk};
    ag.d_v = {dv.get(), p.n_k * wv, p.d_vhead, wv};
    ag.d_mask = g.mask;
    ag.d_sinks = g.sinks;
    attention_backward(a, ag);
    if (p.qk.any()) {  // through the rotation and the norms: the projections' gradients
        detail::qk_backward(detail::query_side(p), b.q, b.s_q, dq.get(), g.q_norm);
        detail::qk_backward(detail::key_side(p), b.k, b.s_k, dk.get(), g.k_norm);
    }

    // self-attention: X^T once for the three weight gradients
    Buffer<T> xt;
    const bool shared = p.query == p.key && p.key == p.value && p.query_half == p.key_half &&
                        p.key_half == p.value_half;
    const auto wanted = [](const LinearGrad<T>& l) { return l.w || l.w_half ? 1 : 0; };
    if (shared && wanted(g.w_q) + wanted(g.w_k) + wanted(g.w_v) > 1 && p.w_q.in > 0) {
        xt = make_buffer<T>(p.w_q.in * rq);
        transpose_rows(rq, p.w_q.in, p.query, p.query_half, p.w_q.in, p.w_q.half, xt.get());
    }
    const T* x_t = xt.get();
    linear_weight_grad(rq, p.w_q.in, wq, p.query, p.w_q.in, dq.get(), wq, g.w_q.w, g.w_q.b, x_t,
                       detail::layer_half(p.w_q, p.query_half, nullptr, g.w_q));
    linear_weight_grad(rk, p.w_k.in, wk, p.key, p.w_k.in, dk.get(), wk, g.w_k.w, g.w_k.b, x_t,
                       detail::layer_half(p.w_k, p.key_half, nullptr, g.w_k));
    linear_weight_grad(rk, p.w_v.in, wv, p.value, p.w_v.in, dv.get(), wv, g.w_v.w, g.w_v.b, x_t,
                       detail::layer_half(p.w_v, p.value_half, nullptr, g.w_v));

    // dX = dY W^T for value, key, query in that order. An input that is another one
    // (self-attention: key = value = query) may share its gradient buffer: the later products
    // add into it. Half-precision gradients so shared are summed in float32 here, the last
    // product rounding them.
    struct Input {
        Index rows;
        const Linear<T>& l;
        const T* dy;
        Index width;
        T* out;
        std::uint16_t* bits;
    };
    const Input inputs[3] = {{rk, p.w_v, dv.get(), wv, g.value, g.value_half},
                             {rk, p.w_k, dk.get(), wk, g.key, g.key_half},
                             {rq, p.w_q, dq.get(), wq, g.query, g.query_half}};
    Buffer<T> sums;  // at most one group of shared inputs (three inputs)
    for (int i = 0; i < 3; ++i) {
        const Input& x = inputs[i];
        if (!x.out && !x.bits) continue;
        bool earlier = false, later = false;
        for (int j = 0; j < 3; ++j) {
            const bool same = x.out ? inputs[j].out == x.out : inputs[j].bits == x.bits;
            earlier = earlier || (j < i && same);
            later = later || (j > i && same);
        }
        T* dx = x.out;
        if (x.bits && (earlier || later)) {
            if (!sums) sums = make_buffer<T>(x.rows * x.l.in);
            dx = sums.get();
        }
        HalfGradOperands h = detail::layer_half(x.l);
        h.dx = later ? nullptr : x.bits;
        linear_input_grad(x.rows, x.l.in, x.width, x.dy, x.width, x.l.w, dx, x.l.in, earlier, h);
    }
}

ATTNLAB_INSTANTIATE_ENTRY_POINTS(multi_head_attention, MhaProblem, MhaGrads);

}  // namespace attnlab::ATTNLAB_ISA_NS

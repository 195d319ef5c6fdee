#include "attnlab/bilinear.hpp"

#include <algorithm>
#include <atomic>

#include "attnlab/gemm.hpp"
#include "attnlab/threading.hpp"
#include "bf16.hpp"
#include "entry_points.hpp"
#include "half_convert.hpp"
#include "products.hpp"
#include "project.hpp"
#include "scratch.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp

namespace detail {

// Row chunk of the per-head projections (as in linear(): fixed, so results do not depend on
// the thread count).
constexpr Index kBilinearRows = 128;

// Half-precision w_qk: a head's W_i is widened into a thread's scratch, kept for the next task
// of the same head in the same call (the tasks then run head by head). Heads larger than this
// (the scratch never shrinks) are widened once for the call instead.
constexpr Index kHalfHeadWeightFloats = Index(1) << 20;

struct WidenedWeight {  // which head of which call this thread's scratch holds
    std::uint64_t call = 0;
    Index head = -1;
};

inline std::atomic<std::uint64_t> g_bilinear_half_calls{0};

// Y[:, i*ldh : i*ldh + ...] for every head i, as one parallel GEMM over (row chunk, head)
// tasks that reads the (heads, d_q, d_k) weight in place (no transpose-copy of h d_q d_k
// numbers, which for decode would cost as much as the product itself).
//   query order: Y_i = X W_i + u_i              (X: rows x d_q, Y_i: rows x d_k)
//   key order:   Y_i = [X W_i^T | X u_i]         (X: rows x d_k, Y_i: rows x (d_q + has_u))
// X as float, or as the half-precision bits x_half (T float), a task's row chunk widened (exact)
// into its thread's scratch: 1 / d_k of the task's multiply-adds.
template <typename T>
void project_heads(const BilinearProblem<T>& p, BilinearOrder order, Index rows, const T* x,
                   const std::uint16_t* x_half, T* y, Index ldh) {
    const Index heads = p.heads, dq = p.d_q, dk = p.d_k;
    const Index in = order == BilinearOrder::query ? dq : dk;
    const Index ldy = heads * ldh;
    const Index chunks = (rows + kBilinearRows - 1) / kBilinearRows;
    const Index wsize = dq * dk;
    const T* w_qk = p.w_qk;
    Buffer<T> wide;  // the call-wide widened w_qk (large heads)
    bool per_thread = false;
    std::uint64_t call = 0;
    if constexpr (std::is_same_v<T, float>) {
        if (p.w_qk_half) {
            per_thread = wsize <= kHalfHeadWeightFloats;
            if (per_thread) {
                call = ++g_bilinear_half_calls;
            } else {
                wide = make_buffer<T>(heads * wsize);
                widen_half(p.w_qk_half, heads * wsize, p.half, wide.get());
                w_qk = wide.get();
            }
        }
    }
    parallel_for(chunks * heads, [&](Index t) {
        const Index i = per_thread ? t / chunks : t % heads;
        const Index r0 = (per_thread ? t % chunks : t / heads) * kBilinearRows;
        const Index m = std::min(kBilinearRows, rows - r0);
        const T* wi = w_qk ? w_qk + i * wsize : nullptr;
        if constexpr (std::is_same_v<T, float>) {
            if (per_thread) {
                thread_local WidenedWeight held;
                float* wf =
                    scratch<float>(ScratchBuffer::kBilinearWeight, static_cast<std::size_t>(wsize));
                if (held.call != call || held.head != i) {
                    half_to_float(p.w_qk_half + i * wsize, wsize, p.half, wf);
                    held = {call, i};
                }
                wi = wf;
            }
        }
        const T* xr = x ? x + r0 * in : nullptr;
        if constexpr (std::is_same_v<T, float>) {
            if (x_half) {
                float* xf =
                    scratch<float>(ScratchBuffer::kBilinearRows, static_cast<std::size_t>(m * in));
                half_to_float(x_half + r0 * in, m * in, p.half, xf);
                xr = xf;
            }
        }
        ConstRowMap<T> X(xr, m, in, Eigen::OuterStride<>(in));
        ConstRowMap<T> W(wi, dq, dk, Eigen::OuterStride<>(dk));
        T* yb = y + r0 * ldy + i * ldh;
        if (order == BilinearOrder::query) {
            RowMap<T> Y(yb, m, dk, Eigen::OuterStride<>(ldy));
            eigen_product<T>(X, W, Y);
            if (p.u_k)
                Y.rowwise() +=
                    Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(p.u_k + i * dk, dk);
        } else {
            RowMap<T> Y(yb, m, dq, Eigen::OuterStride<>(ldy));
            eigen_product_bt<T>(X, W, Y);
            if (p.u_k) {
                // u_i . x_k, a per-key bias, stored as the last column; queries carry a 1 there
                eigen_product<T>(X, cview<T>(p.u_k + i * dk, dk, 1, 1),
                                 view<T>(yb + dq, m, 1, ldy));
            }
        }
    });
}

// The raw rows every head reads (the query order's keys, the key order's queries): x itself,
// or its half-precision bits widened once for the call into `own` (one copy for all heads,
// where the half-precision tiles would widen them per head).
template <typename T>
const T* shared_rows(const T* x, const std::uint16_t* x_half, Index n, HalfFormat half,
                     Buffer<T>& own) {
    if constexpr (std::is_same_v<T, float>) {
        if (x_half) {
            own = make_buffer<T>(n);
            widen_half(x_half, n, half, own.get());
            return own.get();
        }
    }
    return x;
}

}  // namespace detail

template <typename T>
void bilinear_attention_forward(const BilinearProblem<T>& p) {
    const Index H = p.heads, Hk = p.kv_heads, dq = p.d_q, dk = p.d_k, dvh = p.d_vhead;
    const Index rq = p.batch * p.n_q, rk = p.batch * p.n_k;
    const Index wv = Hk * dvh, wc = H * dvh;
    const bool keep = p.state.v != nullptr;  // vjp: keep what the backward needs
    const BilinearOrder order = keep ? BilinearOrder::query : p.order;
    Buffer<T> own_v, own_ctx;
    T* v = keep ? p.state.v : (own_v = make_buffer<T>(rk * wv)).get();
    T* ctx = keep ? p.state.ctx : (own_ctx = make_buffer<T>(rq * wc)).get();
    // w_v and value as stored (float or half bits)
    detail::project(rk, p.value, p.w_v, v, false, p.value_half);

    AttentionProblem<T> a;
    a.batch = p.batch;
    a.heads = H;
    a.n_q = p.n_q;
    a.n_k = p.n_k;
    a.d_v = dvh;
    a.scale = p.scale;
    a.out = {ctx, p.n_q * wc, dvh, wc};
    a.mask = p.mask;
    a.weights = p.weights;
    a.weights_half = p.weights_half;
    a.weights_format = p.w_o.half;
    a.lse = p.state.lse;

    Buffer<T> proj, qpad, vexp, raw;
    if (order == BilinearOrder::query) {
        // Q'_i = X_q W_i + u_i for all heads; every head reads the raw keys (head stride 0).
        T* pq = keep ? p.state.proj : (proj = make_buffer<T>(rq * H * dk)).get();
        detail::project_heads(p, BilinearOrder::query, rq, p.query, p.query_half, pq, dk);
        a.kv_heads = Hk;
        a.d = dk;
        a.q = {pq, p.n_q * H * dk, dk, H * dk};
        a.k = {detail::shared_rows(p.key, p.key_half, rk * dk, p.half, raw), p.n_k * dk, 0, dk};
        a.v = {v, p.n_k * wv, dvh, wv};
    } else {
        // K'_i = [X_k W_i^T | X_k u_i]; every head reads the raw queries, padded with a 1.
        const Index e = p.u_k ? 1 : 0, w = dq + e;
        proj = make_buffer<T>(rk * H * w);
        detail::project_heads(p, BilinearOrder::key, rk, p.key, p.key_half, proj.get(), w);
        const T* q = p.query;
        if (e) {
            qpad = make_buffer<T>(rq * w);
            parallel_for((rq + 1023) / 1024, [&](Index c) {
                const Index r1 = std::min(rq, (c + 1) * 1024);
                for (Index r = c * 1024; r < r1; ++r) {
                    T* dst = qpad.get() + r * w;
                    bool widened = false;
                    if constexpr (std::is_same_v<T, float>) {
                        if ((widened = p.query_half != nullptr))
                            detail::half_to_float(p.query_half + r * dq, dq, p.half, dst);
                    }
                    if (!widened) std::copy(p.query + r * dq, p.query + (r + 1) * dq, dst);
                    dst[dq] = T(1);
                }
            });
            q = qpad.get();
        } else {
            q = detail::shared_rows(p.query, p.query_half, rq * dq, p.half, raw);
        }
        a.kv_heads = H;  // keys now differ per query head
        a.d = w;
        a.q = {q, p.n_q * w, 0, w};
        a.k = {proj.get(), p.n_k * H * w, w, H * w};
        if (Hk == H) {
            a.v = {v, p.n_k * wv, dvh, wv};
        } else {
            // grouped values: the core pairs keys and values by head, so give each query head
            // its group's value block
            const Index group = H / Hk;
            vexp = make_buffer<T>(rk * wc);
            parallel_for((rk + 255) / 256, [&](Index c) {
                const Index r1 = std::min(rk, (c + 1) * 256);
                for (Index r = c * 256; r < r1; ++r)
                    for (Index i = 0; i < H; ++i) {
                        const T* src = v + r * wv + (i / group) * dvh;
                        std::copy(src, src + dvh, vexp.get() + r * wc + i * dvh);
                    }
            });
            a.v = {vexp.get(), p.n_k * wc, dvh, wc};
        }
    }
    attention_forward(a);

    detail::project(rq, ctx, p.w_o, p.out, false, nullptr, p.out_half);
}

template <typename T>
void bilinear_attention_backward(const BilinearProblem<T>& p, const T* grad_out,
                                 const BilinearGrads<T>& given) {
    const Index H = p.heads, Hk = p.kv_heads, dq = p.d_q, dk = p.d_k, dvh = p.d_vhead;
    const Index rq = p.batch * p.n_q, rk = p.batch * p.n_k;
    const Index wv = Hk * dvh, wc = H * dvh, wp = H * dk, d_out = p.w_o.out;
    const Index d_v = p.w_v.in;
    // Half-precision input gradients: computed in float32 below (in buffers shared as their
    // bits are), then rounded into place
    BilinearGrads<T> g = given;
    std::uint16_t* const bits[3] = {g.query_half, g.key_half, g.value_half};
    T** const wide[3] = {&g.query, &g.key, &g.value};
    const Index sizes[3] = {rq * dq, rk * dk, rk * d_v};
    Buffer<T> own[3];
    for (int i = 0; i < 3; ++i) {
        if (!bits[i]) continue;
        const int first = bits[0] == bits[i] ? 0 : bits[1] == bits[i] ? 1 : 2;
        *wide[i] = first < i ? *wide[first] : (own[i] = make_buffer<T>(sizes[i])).get();
    }

    // Forward in the query order, keeping the log-sum-exp (or what vjp's forward kept).
    const bool kept = p.state.filled;
    Buffer<T> own_v, own_ctx, own_proj, own_lse;
    T* v = kept ? p.state.v : (own_v = make_buffer<T>(rk * wv)).get();
    T* ctx = kept ? p.state.ctx : (own_ctx = make_buffer<T>(rq * wc)).get();
    T* proj = kept ? p.state.proj : (own_proj = make_buffer<T>(rq * wp)).get();
    T* lse = kept ? p.state.lse : (own_lse = make_buffer<T>(p.batch * H * p.n_q)).get();
    if (!kept) {  // the weights and inputs as stored (float or half bits)
        detail::project(rk, p.value, p.w_v, v, false, p.value_half);
        detail::project_heads(p, BilinearOrder::query, rq, p.query, p.query_half, proj, dk);
    }
    Buffer<T> raw;

    AttentionProblem<T> a;
    a.batch = p.batch;
    a.heads = H;
    a.kv_heads = Hk;
    a.n_q = p.n_q;
    a.n_k = p.n_k;
    a.d = dk;
    a.d_v = dvh;
    a.scale = p.scale;
    a.q = {proj, p.n_q * wp, dk, wp};
    a.k = {detail::shared_rows(p.key, p.key_half, rk * dk, p.half, raw), p.n_k * dk, 0, dk};
    a.v = {v, p.n_k * wv, dvh, wv};
    a.out = {ctx, p.n_q * wc, dvh, wc};
    a.mask = p.mask;
    a.lse = lse;
    if (!kept) attention_forward(a);

    // Output projection.
    linear_weight_grad(rq, wc, d_out, ctx, wc, grad_out, d_out, g.w_o.w, g.w_o.b,
                       static_cast<const T*>(nullptr),
                       detail::layer_half(p.w_o, nullptr, g.grad_out_half, g.w_o));
    auto dctx = make_buffer<T>(rq * wc);
    linear_input_grad(rq, wc, d_out, grad_out, d_out, p.w_o.w, dctx.get(), wc, false,
                      detail::layer_half(p.w_o, nullptr, g.grad_out_half));

    // Attention core. The keys are shared by all heads (head stride 0) but the core writes
    // d_k per kv head, so give each kv head its own column block and sum them afterwards.
    auto dproj = make_buffer<T>(rq * wp), dkh = make_buffer<T>(rk * Hk * dk);
    auto dv = make_buffer<T>(rk * wv);
    AttentionGrad<T> ag;
    ag.d_out = {dctx.get(), p.n_q * wc, dvh, wc};
    ag.d_q = {dproj.get(), p.n_q * wp, dk, wp};
    ag.d_k = {dkh.get(), p.n_k * Hk * dk, dk, Hk * dk};
    ag.d_v = {dv.get(), p.n_k * wv, dvh, wv};
    ag.d_mask = g.mask;
    ag.d_sinks = g.sinks;
    attention_backward(a, ag);

    // Values.
    linear_weight_grad(rk, d_v, wv, p.value, d_v, dv.get(), wv, g.w_v.w, g.w_v.b,
                       static_cast<const T*>(nullptr),
                       detail::layer_half(p.w_v, p.value_half, nullptr, g.w_v));
    if (g.value)
        linear_input_grad(rk, d_v, wv, dv.get(), wv, p.w_v.w, g.value, d_v, false,
                          detail::layer_half(p.w_v));

    // Keys: d key = sum over kv heads, in head order (fixed, thread-count independent). An
    // input that is another one (self-attention) may share its gradient buffer: the later
    // gradients add into it, in the order value, key, query.
    if (g.key) {
        const bool add = g.key == g.value;
        parallel_for((rk + 255) / 256, [&](Index c) {
            const Index r1 = std::min(rk, (c + 1) * 256);
            for (Index r = c * 256; r < r1; ++r) {
                Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>> dst(g.key + r * dk, dk);
                const T* src = dkh.get() + r * Hk * dk;
                if (add) {
                    dst += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(src, dk);
                } else {
                    dst = Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(src, dk);
                }
                for (Index i = 1; i < Hk; ++i)
                    dst += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(src + i * dk, dk);
            }
        });
    }

    // Q'_i = X_q W_i + u_i for all heads is X_q [W_1 | ... | W_h] + [u_1 | ... | u_h]: one
    // linear layer of width h d_k. Its weight packed as (d_q, h d_k) serves both the weight
    // gradient (one GEMM, then unpacked) and the query gradient (one GEMM).
    if (g.w_qk || g.u_k) {
        // db of the packed layer is laid out exactly as (h, d_k): the u_k gradient
        auto packed = g.w_qk ? make_buffer<T>(dq * wp) : nullptr;
        linear_weight_grad(rq, dq, wp, p.query, dq, dproj.get(), wp, packed.get(), g.u_k,
                           static_cast<const T*>(nullptr),
                           HalfGradOperands{p.query_half, nullptr, nullptr, p.half});
        if (g.w_qk)
            parallel_for(H, [&](Index i) {
                for (Index r = 0; r < dq; ++r) {
                    const T* src = packed.get() + r * wp + i * dk;
                    std::copy(src, src + dk, g.w_qk + (i * dq + r) * dk);
                }
            });
    }
    if (g.query) {
        auto packed = make_buffer<T>(dq * wp);
        parallel_for(H, [&](Index i) {
            for (Index r = 0; r < dq; ++r) {
                T* dst = packed.get() + r * wp + i * dk;
                if constexpr (std::is_same_v<T, float>) {
                    if (p.w_qk_half) {  // widened as it is packed
                        detail::half_to_float(p.w_qk_half + (i * dq + r) * dk, dk, p.half, dst);
                        continue;
                    }
                }
                const T* src = p.w_qk + (i * dq + r) * dk;
                std::copy(src, src + dk, dst);
            }
        });
        linear_input_grad(rq, dq, wp, dproj.get(), wp, packed.get(), g.query, dq,
                          g.query == g.key || g.query == g.value);
    }
    if constexpr (std::is_same_v<T, float>) {
        for (int i = 0; i < 3; ++i)
            if (own[i]) narrow_half(own[i].get(), sizes[i], p.half, bits[i]);
    }
}

ATTNLAB_INSTANTIATE_ENTRY_POINTS(bilinear_attention, BilinearProblem, BilinearGrads);

}  // namespace attnlab::ATTNLAB_ISA_NS

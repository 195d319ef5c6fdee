// attnlab_selftest: every kernel of every instruction-set variant built (and supported by this
// CPU) against a naive reference, without Python. Built by CMake with -DATTNLAB_SELFTEST=ON
// -DATTNLAB_PYTHON=OFF; scripts/check-aarch64.sh cross-compiles it for aarch64 and runs it under
// qemu-aarch64. Forwards are compared with plain loops in double precision (float kernels at a
// float tolerance); backwards with central finite differences of the kernel's own forward along a
// random direction, per input. Exit status 0 only when every check passes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "attnlab/kernels.hpp"
#include "attnlab/threading.hpp"

namespace attnlab {
namespace selftest {
namespace {

using Vec = std::vector<double>;
int failures = 0;
int checks = 0;

Vec random_vec(std::mt19937& g, std::size_t n, double s = 0.5) {
    std::normal_distribution<double> d(0.0, s);
    Vec v(n);
    for (auto& x : v) x = d(g);
    return v;
}

template <typename T>
std::vector<T> as(const Vec& v) {
    return std::vector<T>(v.begin(), v.end());
}

void expect_close(const char* isa, const char* what, const Vec& got, const Vec& want, double tol) {
    ++checks;
    double err = 0, scale = 1e-30;
    for (std::size_t i = 0; i < want.size(); ++i) {
        err = std::max(err, std::abs(got[i] - want[i]));
        scale = std::max(scale, std::abs(want[i]));
    }
    const bool ok =
        got.size() == want.size() && err <= tol * std::max(1.0, scale) && std::isfinite(err);
    if (!ok) ++failures;
    std::printf("  %-8s %-46s max error %.2e %s\n", isa, what, err, ok ? "ok" : "FAILED");
}

// --- naive references (double)

// y (rows x out) = x (rows x in) w (in x out) + b
Vec naive_linear(const Vec& x, const Vec& w, const Vec* b, long rows, long in, long out) {
    Vec y(rows * out, 0.0);
    for (long r = 0; r < rows; ++r)
        for (long j = 0; j < out; ++j) {
            double s = b ? (*b)[j] : 0.0;
            for (long t = 0; t < in; ++t) s += x[r * in + t] * w[t * out + j];
            y[r * out + j] = s;
        }
    return y;
}

// softmax(scale q k^T, causal top-left) v for q (B, H, nq, d), k (B, Hk, nk, d), v (B, Hk, nk, dv)
Vec naive_sdpa(const Vec& q, const Vec& k, const Vec& v, long B, long H, long Hk, long nq, long nk,
               long d, long dv, double scale, bool causal) {
    Vec out(B * H * nq * dv, 0.0);
    for (long b = 0; b < B; ++b)
        for (long h = 0; h < H; ++h) {
            const long hk = h / (H / Hk);
            for (long i = 0; i < nq; ++i) {
                Vec s(nk, -INFINITY);
                double m = -INFINITY;
                for (long j = 0; j < nk; ++j) {
                    if (causal && j > i) continue;
                    double t = 0;
                    for (long c = 0; c < d; ++c)
                        t +=
                            q[((b * H + h) * nq + i) * d + c] * k[((b * Hk + hk) * nk + j) * d + c];
                    s[j] = scale * t;
                    m = std::max(m, s[j]);
                }
                double z = 0;
                for (long j = 0; j < nk; ++j)
                    z += (s[j] = std::isfinite(s[j]) ? std::exp(s[j] - m) : 0.0);
                for (long j = 0; j < nk; ++j)
                    for (long c = 0; c < dv; ++c)
                        out[((b * H + h) * nq + i) * dv + c] +=
                            s[j] / z * v[((b * Hk + hk) * nk + j) * dv + c];
            }
        }
    return out;
}

// (rows, H*dh) packed <-> (B, H, n, dh) contiguous
Vec repack(const Vec& in, long B, long n, long H, long dh, bool to_heads) {
    Vec y(in.size());
    for (long b = 0; b < B; ++b)
        for (long i = 0; i < n; ++i)
            for (long h = 0; h < H; ++h)
                for (long c = 0; c < dh; ++c) {
                    const long packed = (b * n + i) * H * dh + h * dh + c;
                    const long heads = ((b * H + h) * n + i) * dh + c;
                    if (to_heads) {
                        y[heads] = in[packed];
                    } else {
                        y[packed] = in[heads];
                    }
                }
    return y;
}

double dot(const Vec& a, const Vec& b) {
    double s = 0;
    for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
    return s;
}

// Directional derivative of f at p along u by central differences, against <grad, u>.
void check_grad(const char* isa, const char* what, Vec& p, const Vec& grad,
                const std::function<double()>& f, std::mt19937& g) {
    const Vec u = random_vec(g, p.size(), 1.0);
    const double h = 1e-5;
    const Vec p0 = p;
    for (std::size_t i = 0; i < p.size(); ++i) p[i] = p0[i] + h * u[i];
    const double fp = f();
    for (std::size_t i = 0; i < p.size(); ++i) p[i] = p0[i] - h * u[i];
    const double fm = f();
    p = p0;
    expect_close(isa, what, {dot(grad, u)}, {(fp - fm) / (2 * h)}, 1e-6);
}

// <out, go> once forward() has written out: the scalar whose gradient a backward given go
// computes.
template <typename F>
std::function<double()> objective(const Vec& out, const Vec& go, F forward) {
    return [&out, &go, forward]() {
        forward();
        return dot(out, go);
    };
}

// check_grad for several inputs of one function, in order: "<fn> <name>".
struct GradCase {
    const char* name;
    Vec& param;
    const Vec& grad;
};
void check_grads(const char* isa, const std::string& fn, std::initializer_list<GradCase> cases,
                 const std::function<double()>& f, std::mt19937& g) {
    for (const GradCase& c : cases)
        check_grad(isa, (fn + " " + c.name).c_str(), c.param, c.grad, f, g);
}

// --- the checks, per variant

// Shapes: batch 2, 4 query heads over 2 kv heads, 37 queries, 45 keys (not multiples of any tile).
constexpr long B = 2, H = 4, Hk = 2, NQ = 37, NK = 45, DQ = 12, DK = 10, DV = 9, DH = 6, DVH = 5,
               DOUT = 7;

// Scaled dot-product attention at the shapes above, scale 0.4, over contiguous (batch, head)
// blocks: q (B, H, NQ, DH), k (B, Hk, NK, DH), v (B, Hk, NK, DVH), out (B, H, NQ, DVH).
template <typename T>
AttentionProblem<T> sdpa_problem(const T* q, const T* k, const T* v, T* out, T* lse,
                                 Causal causal) {
    AttentionProblem<T> p;
    p.batch = B, p.heads = H, p.kv_heads = Hk, p.n_q = NQ, p.n_k = NK, p.d = DH, p.d_v = DVH;
    p.scale = T(0.4);
    p.q = {q, H * NQ * DH, NQ * DH, DH};
    p.k = {k, Hk * NK * DH, NK * DH, DH};
    p.v = {v, Hk * NK * DVH, NK * DVH, DVH};
    p.out = {out, H * NQ * DVH, NQ * DVH, DVH};
    p.mask.options.causal = causal;
    p.lse = lse;
    return p;
}

// Multi-head and bilinear attention at the shapes above: x_q (B*NQ, DQ), x_k (B*NK, DK),
// x_v (B*NK, DV), head widths DH (query/key) and DVH (value), output (B*NQ, DOUT). Any bias may
// be null.
template <typename T>
void projected_problem(ProjectedAttention<T>& p, const T* xq, const T* xk, const T* xv, const T* wv,
                       const T* bv, const T* wo, const T* bo, T scale, T* out) {
    p.batch = B, p.n_q = NQ, p.n_k = NK, p.heads = H, p.kv_heads = Hk, p.d_vhead = DVH;
    p.query = xq, p.key = xk, p.value = xv;
    p.w_v = {wv, bv, DV, Hk * DVH};
    p.w_o = {wo, bo, H * DVH, DOUT};
    p.scale = scale;
    p.out = out;
}

template <typename T>
MhaProblem<T> mha_problem(const T* xq, const T* xk, const T* xv, const T* wq, const T* bq,
                          const T* wk, const T* wv, const T* bv, const T* wo, const T* bo, T scale,
                          T* out) {
    MhaProblem<T> p;
    projected_problem<T>(p, xq, xk, xv, wv, bv, wo, bo, scale, out);
    p.d_head = DH;
    p.w_q = {wq, bq, DQ, H * DH};
    p.w_k = {wk, nullptr, DK, Hk * DH};
    return p;
}

template <typename T>
BilinearProblem<T> bilinear_problem(const T* xq, const T* xk, const T* xv, const T* wqk,
                                    const T* uk, const T* wv, const T* bv, const T* wo, const T* bo,
                                    T scale, T* out) {
    BilinearProblem<T> p;
    projected_problem<T>(p, xq, xk, xv, wv, bv, wo, bo, scale, out);
    p.d_q = DQ, p.d_k = DK;
    p.w_qk = wqk, p.u_k = uk;
    return p;
}

template <typename T>
void check_forwards(const KernelTable& kt, std::mt19937& g) {
    const KernelSet<T>& ks = kt.get<T>();
    const double tol = sizeof(T) == 4 ? 2e-5 : 1e-12;
    const char* isa = kt.isa;
    const std::string tn = sizeof(T) == 4 ? " float32" : " float64";
    // linear
    {
        Vec x = random_vec(g, 50 * DQ), w = random_vec(g, DQ * DOUT), b = random_vec(g, DOUT);
        auto xt = as<T>(x), wt = as<T>(w), bt = as<T>(b);
        std::vector<T> y(50 * DOUT);
        ks.linear(50, DQ, DOUT, xt.data(), DQ, wt.data(), bt.data(), y.data(), DOUT, false,
                  nullptr);
        expect_close(isa, ("linear" + tn).c_str(), Vec(y.begin(), y.end()),
                     naive_linear(x, w, &b, 50, DQ, DOUT), tol);
    }
    // scaled dot-product attention, grouped-query, causal
    {
        Vec q = random_vec(g, B * H * NQ * DH), k = random_vec(g, B * Hk * NK * DH),
            v = random_vec(g, B * Hk * NK * DVH);
        auto qt = as<T>(q), kt_ = as<T>(k), vt = as<T>(v);
        std::vector<T> out(B * H * NQ * DVH), lse(B * H * NQ);
        ks.attention_forward(sdpa_problem(qt.data(), kt_.data(), vt.data(), out.data(), lse.data(),
                                          Causal::top_left));
        expect_close(isa, ("attention_forward causal gqa" + tn).c_str(),
                     Vec(out.begin(), out.end()),
                     naive_sdpa(q, k, v, B, H, Hk, NQ, NK, DH, DVH, double(T(0.4)), true), tol);
    }
    // multi-head attention with biases, and the bilinear-collapsed form of the same function
    {
        Vec xq = random_vec(g, B * NQ * DQ), xk = random_vec(g, B * NK * DK),
            xv = random_vec(g, B * NK * DV);
        Vec wq = random_vec(g, DQ * H * DH), wk = random_vec(g, DK * Hk * DH),
            wv = random_vec(g, DV * Hk * DVH), wo = random_vec(g, H * DVH * DOUT);
        Vec bq = random_vec(g, H * DH), bv = random_vec(g, Hk * DVH), bo = random_vec(g, DOUT);
        const double scale = 1.0 / std::sqrt(double(DH));
        Vec Q = repack(naive_linear(xq, wq, &bq, B * NQ, DQ, H * DH), B, NQ, H, DH, true);
        Vec K = repack(naive_linear(xk, wk, nullptr, B * NK, DK, Hk * DH), B, NK, Hk, DH, true);
        Vec V = repack(naive_linear(xv, wv, &bv, B * NK, DV, Hk * DVH), B, NK, Hk, DVH, true);
        Vec ctx = repack(naive_sdpa(Q, K, V, B, H, Hk, NQ, NK, DH, DVH, double(T(scale)), false), B,
                         NQ, H, DVH, false);
        Vec want = naive_linear(ctx, wo, &bo, B * NQ, H * DVH, DOUT);
        auto xqt = as<T>(xq), xkt = as<T>(xk), xvt = as<T>(xv), wqt = as<T>(wq), wkt = as<T>(wk),
             wvt = as<T>(wv), wot = as<T>(wo), bqt = as<T>(bq), bvt = as<T>(bv), bot = as<T>(bo);
        std::vector<T> out(B * NQ * DOUT);
        ks.multi_head_attention_forward(mha_problem(xqt.data(), xkt.data(), xvt.data(), wqt.data(),
                                                    bqt.data(), wkt.data(), wvt.data(), bvt.data(),
                                                    wot.data(), bot.data(), T(scale), out.data()));
        expect_close(isa, ("multi_head_attention_forward" + tn).c_str(),
                     Vec(out.begin(), out.end()), want, tol);
        // W_i = Wq_i Wk_i^T (DQ x DK), u_i = Wk_i bq_i (DK)
        Vec wqk(H * DQ * DK, 0.0), uk(H * DK, 0.0);
        for (long h = 0; h < H; ++h) {
            const long hk = h / (H / Hk);
            for (long a = 0; a < DQ; ++a)
                for (long c = 0; c < DK; ++c)
                    for (long t = 0; t < DH; ++t)
                        wqk[(h * DQ + a) * DK + c] +=
                            wq[a * H * DH + h * DH + t] * wk[c * Hk * DH + hk * DH + t];
            for (long c = 0; c < DK; ++c)
                for (long t = 0; t < DH; ++t)
                    uk[h * DK + c] += wk[c * Hk * DH + hk * DH + t] * bq[h * DH + t];
        }
        auto wqkt = as<T>(wqk), ukt = as<T>(uk);
        for (int order = 0; order < 2; ++order) {
            std::vector<T> bout(B * NQ * DOUT);
            BilinearProblem<T> bp = bilinear_problem(
                xqt.data(), xkt.data(), xvt.data(), wqkt.data(), ukt.data(), wvt.data(), bvt.data(),
                wot.data(), bot.data(), T(scale), bout.data());
            bp.order = order ? BilinearOrder::key : BilinearOrder::query;
            ks.bilinear_attention_forward(bp);
            expect_close(
                isa,
                (std::string("bilinear_attention_forward ") + (order ? "key" : "query") + tn)
                    .c_str(),
                Vec(bout.begin(), bout.end()), want, sizeof(T) == 4 ? 1e-4 : 1e-11);
        }
    }
    // additive (official SwiftFormer) and separable attention
    {
        const long n = 29, din = 8, D = 6, dout = 5;
        Vec x = random_vec(g, B * n * din), wq = random_vec(g, din * D), bq = random_vec(g, D),
            wk = random_vec(g, din * D), bk = random_vec(g, D), wg = random_vec(g, D),
            wp = random_vec(g, D * D), bp_ = random_vec(g, D), wf = random_vec(g, D * dout),
            bf = random_vec(g, dout);
        const double scale = 0.7, eps = 1e-12;
        Vec want(B * n * dout);
        auto normalize_rows = [&](Vec m, long rows, long cols) {
            for (long r = 0; r < rows; ++r) {
                double s = 0;
                for (long c = 0; c < cols; ++c) s += m[r * cols + c] * m[r * cols + c];
                s = std::max(std::sqrt(s), eps);
                for (long c = 0; c < cols; ++c) m[r * cols + c] /= s;
            }
            return m;
        };
        for (long b = 0; b < B; ++b) {
            Vec xb(x.begin() + b * n * din, x.begin() + (b + 1) * n * din);
            Vec Qm = normalize_rows(naive_linear(xb, wq, &bq, n, din, D), n, D);
            Vec Km = normalize_rows(naive_linear(xb, wk, &bk, n, din, D), n, D);
            Vec a = naive_linear(Qm, wg, nullptr, n, D, 1);
            for (auto& t : a) t *= scale;
            a = normalize_rows(a, 1, n);
            Vec G(D, 0.0);
            for (long i = 0; i < n; ++i)
                for (long c = 0; c < D; ++c) G[c] += a[i] * Qm[i * D + c];
            Vec KG(n * D);
            for (long i = 0; i < n; ++i)
                for (long c = 0; c < D; ++c) KG[i * D + c] = Km[i * D + c] * G[c];
            Vec Hm = naive_linear(KG, wp, &bp_, n, D, D);
            for (long i = 0; i < n * D; ++i) Hm[i] += Qm[i];
            Vec o = naive_linear(Hm, wf, &bf, n, D, dout);
            std::copy(o.begin(), o.end(), want.begin() + b * n * dout);
        }
        auto xt = as<T>(x), wqt = as<T>(wq), bqt = as<T>(bq), wkt = as<T>(wk), bkt = as<T>(bk),
             wgt = as<T>(wg), wpt = as<T>(wp), bpt = as<T>(bp_), wft = as<T>(wf), bft = as<T>(bf);
        std::vector<T> out(B * n * dout);
        AdditiveProblem<T> p;
        p.batch = B, p.n = n, p.d_in = din, p.width = D, p.d_out = dout;
        p.x = xt.data(), p.w_q = wqt.data(), p.b_q = bqt.data(), p.w_k = wkt.data(),
        p.b_k = bkt.data(), p.w_g = wgt.data(), p.w_proj = wpt.data(), p.b_proj = bpt.data(),
        p.w_final = wft.data(), p.b_final = bft.data();
        p.scale = T(scale), p.eps = T(eps), p.out = out.data();
        ks.additive_attention_forward(p);
        expect_close(isa, ("additive_attention_forward" + tn).c_str(), Vec(out.begin(), out.end()),
                     want, sizeof(T) == 4 ? 1e-4 : 1e-11);

        const long d = 6;
        Vec xs = random_vec(g, B * n * d), wqkv = random_vec(g, d * (1 + 2 * d)),
            bqkv = random_vec(g, 1 + 2 * d), wo = random_vec(g, d * dout), bo = random_vec(g, dout);
        Vec swant(B * n * dout);
        for (long b = 0; b < B; ++b) {
            Vec xb(xs.begin() + b * n * d, xs.begin() + (b + 1) * n * d);
            Vec P = naive_linear(xb, wqkv, &bqkv, n, d, 1 + 2 * d);
            double m = -INFINITY, z = 0;
            for (long i = 0; i < n; ++i) m = std::max(m, P[i * (1 + 2 * d)]);
            Vec c(n);
            for (long i = 0; i < n; ++i) z += (c[i] = std::exp(P[i * (1 + 2 * d)] - m));
            Vec ctx(d, 0.0);
            for (long i = 0; i < n; ++i)
                for (long j = 0; j < d; ++j) ctx[j] += c[i] / z * P[i * (1 + 2 * d) + 1 + j];
            Vec U(n * d);
            for (long i = 0; i < n; ++i)
                for (long j = 0; j < d; ++j)
                    U[i * d + j] = std::max(0.0, P[i * (1 + 2 * d) + 1 + d + j]) * ctx[j];
            Vec o = naive_linear(U, wo, &bo, n, d, dout);
            std::copy(o.begin(), o.end(), swant.begin() + b * n * dout);
        }
        auto xst = as<T>(xs), wqkvt = as<T>(wqkv), bqkvt = as<T>(bqkv), wot = as<T>(wo),
             bot = as<T>(bo);
        std::vector<T> sout(B * n * dout);
        SeparableProblem<T> sp;
        sp.batch = B, sp.n = n, sp.d = d, sp.d_out = dout;
        sp.x = xst.data(), sp.w_qkv = wqkvt.data(), sp.b_qkv = bqkvt.data(), sp.w_o = wot.data(),
        sp.b_o = bot.data(), sp.out = sout.data();
        ks.separable_attention_forward(sp);
        expect_close(isa, ("separable_attention_forward" + tn).c_str(),
                     Vec(sout.begin(), sout.end()), swant, sizeof(T) == 4 ? 1e-4 : 1e-11);
    }
}

// Backwards, in double: gradients against finite differences of the same variant's forward.
void check_backwards(const KernelTable& kt, std::mt19937& g) {
    const KernelSet<double>& ks = kt.f64;
    const char* isa = kt.isa;
    // attention_backward
    {
        Vec q = random_vec(g, B * H * NQ * DH), k = random_vec(g, B * Hk * NK * DH),
            v = random_vec(g, B * Hk * NK * DVH), go = random_vec(g, B * H * NQ * DVH);
        Vec out(go.size()), lse(B * H * NQ);
        auto problem = [&]() {
            return sdpa_problem(q.data(), k.data(), v.data(), out.data(), lse.data(),
                                Causal::bottom_right);
        };
        const auto f = objective(out, go, [&] { ks.attention_forward(problem()); });
        f();
        Vec dq(q.size()), dk(k.size()), dv(v.size());
        AttentionGrad<double> gr;
        gr.d_out = {go.data(), H * NQ * DVH, NQ * DVH, DVH};
        gr.d_q = {dq.data(), H * NQ * DH, NQ * DH, DH};
        gr.d_k = {dk.data(), Hk * NK * DH, NK * DH, DH};
        gr.d_v = {dv.data(), Hk * NK * DVH, NK * DVH, DVH};
        ks.attention_backward(problem(), gr);
        check_grads(isa, "attention_backward", {{"d_q", q, dq}, {"d_k", k, dk}, {"d_v", v, dv}}, f,
                    g);
    }
    // multi_head_attention_backward and bilinear_attention_backward
    {
        Vec xq = random_vec(g, B * NQ * DQ), xk = random_vec(g, B * NK * DK),
            xv = random_vec(g, B * NK * DV);
        Vec wq = random_vec(g, DQ * H * DH), wk = random_vec(g, DK * Hk * DH),
            wv = random_vec(g, DV * Hk * DVH), wo = random_vec(g, H * DVH * DOUT),
            bq = random_vec(g, H * DH), bo = random_vec(g, DOUT);
        Vec go = random_vec(g, B * NQ * DOUT), out(go.size());
        auto mha = [&]() {
            MhaProblem<double> p = mha_problem<double>(xq.data(), xk.data(), xv.data(), wq.data(),
                                                       bq.data(), wk.data(), wv.data(), nullptr,
                                                       wo.data(), bo.data(), 0.3, out.data());
            p.mask.options.causal = Causal::top_left;
            return p;
        };
        const auto f = objective(out, go, [&] { ks.multi_head_attention_forward(mha()); });
        Vec gxq(xq.size()), gxk(xk.size()), gxv(xv.size()), gwq(wq.size()), gbq(bq.size()),
            gwk(wk.size()), gwv(wv.size()), gwo(wo.size()), gbo(bo.size());
        MhaGrads<double> gr;
        gr.query = gxq.data(), gr.key = gxk.data(), gr.value = gxv.data();
        gr.w_q = {gwq.data(), gbq.data()}, gr.w_k = {gwk.data(), nullptr},
        gr.w_v = {gwv.data(), nullptr}, gr.w_o = {gwo.data(), gbo.data()};
        ks.multi_head_attention_backward(mha(), go.data(), gr);
        check_grads(isa, "multi_head_attention_backward",
                    {{"query", xq, gxq},
                     {"key", xk, gxk},
                     {"value", xv, gxv},
                     {"w_q", wq, gwq},
                     {"b_q", bq, gbq},
                     {"w_k", wk, gwk},
                     {"w_o", wo, gwo}},
                    f, g);

        Vec wqk = random_vec(g, H * DQ * DK, 0.2), uk = random_vec(g, H * DK);
        auto bil = [&]() {
            return bilinear_problem<double>(xq.data(), xk.data(), xv.data(), wqk.data(), uk.data(),
                                            wv.data(), nullptr, wo.data(), bo.data(), 0.3,
                                            out.data());
        };
        const auto fb = objective(out, go, [&] { ks.bilinear_attention_forward(bil()); });
        Vec gwqk(wqk.size()), guk(uk.size());
        BilinearGrads<double> bg;
        bg.query = gxq.data(), bg.key = gxk.data(), bg.value = gxv.data(), bg.w_qk = gwqk.data(),
        bg.u_k = guk.data(), bg.w_v = {gwv.data(), nullptr}, bg.w_o = {gwo.data(), gbo.data()};
        ks.bilinear_attention_backward(bil(), go.data(), bg);
        check_grads(isa, "bilinear_attention_backward",
                    {{"query", xq, gxq},
                     {"key", xk, gxk},
                     {"w_qk", wqk, gwqk},
                     {"u_k", uk, guk},
                     {"w_v", wv, gwv}},
                    fb, g);
    }
    // additive_attention_backward and separable_attention_backward
    {
        const long n = 23, din = 7, D = 6, dout = 5, d = 6;
        Vec x = random_vec(g, B * n * din), wq = random_vec(g, din * D), bq = random_vec(g, D),
            wk = random_vec(g, din * D), bk = random_vec(g, D), wg = random_vec(g, D),
            wp = random_vec(g, D * D), bp = random_vec(g, D), wf = random_vec(g, D * dout),
            bf = random_vec(g, dout), go = random_vec(g, B * n * dout), out(go.size());
        auto add = [&]() {
            AdditiveProblem<double> p;
            p.batch = B, p.n = n, p.d_in = din, p.width = D, p.d_out = dout;
            p.x = x.data(), p.w_q = wq.data(), p.b_q = bq.data(), p.w_k = wk.data(),
            p.b_k = bk.data(), p.w_g = wg.data(), p.w_proj = wp.data(), p.b_proj = bp.data(),
            p.w_final = wf.data(), p.b_final = bf.data();
            p.scale = 0.7, p.out = out.data();
            return p;
        };
        const auto f = objective(out, go, [&] { ks.additive_attention_forward(add()); });
        Vec gx(x.size()), gwq(wq.size()), gbq(bq.size()), gwk(wk.size()), gbk(bk.size()),
            gwg(wg.size()), gwp(wp.size()), gbp(bp.size()), gwf(wf.size()), gbf(bf.size());
        AdditiveGrads<double> ag{gx.data(),  gwq.data(), gbq.data(), gwk.data(), gbk.data(),
                                 gwg.data(), gwp.data(), gbp.data(), gwf.data(), gbf.data()};
        ks.additive_attention_backward(add(), go.data(), ag);
        check_grads(isa, "additive_attention_backward",
                    {{"x", x, gx},
                     {"w_q", wq, gwq},
                     {"w_k", wk, gwk},
                     {"w_g", wg, gwg},
                     {"w_proj", wp, gwp},
                     {"w_final", wf, gwf}},
                    f, g);

        Vec xs = random_vec(g, B * n * d), wqkv = random_vec(g, d * (1 + 2 * d)),
            bqkv = random_vec(g, 1 + 2 * d), wo = random_vec(g, d * dout), bo = random_vec(g, dout);
        auto sep = [&]() {
            SeparableProblem<double> p;
            p.batch = B, p.n = n, p.d = d, p.d_out = dout;
            p.x = xs.data(), p.w_qkv = wqkv.data(), p.b_qkv = bqkv.data(), p.w_o = wo.data(),
            p.b_o = bo.data(), p.out = out.data();
            return p;
        };
        const auto fs = objective(out, go, [&] { ks.separable_attention_forward(sep()); });
        Vec gxs(xs.size()), gwqkv(wqkv.size()), gbqkv(bqkv.size()), gwo(wo.size()), gbo(bo.size());
        SeparableGrads<double> sg{gxs.data(), gwqkv.data(), gbqkv.data(), gwo.data(), gbo.data()};
        ks.separable_attention_backward(sep(), go.data(), sg);
        check_grads(
            isa, "separable_attention_backward",
            {{"x", xs, gxs}, {"w_qkv", wqkv, gwqkv}, {"b_qkv", bqkv, gbqkv}, {"w_o", wo, gwo}}, fs,
            g);
    }
}

}  // namespace
}  // namespace selftest
}  // namespace attnlab

int main() {
    using namespace attnlab;
    std::printf("attnlab_selftest: cpu features:");
    for (const auto& f : cpu_features())
        if (f.second) std::printf(" %s", f.first.c_str());
    std::printf("\n");
    int ran = 0;
    for (const std::string& isa : built_isas()) {
        if (!isa_supported(isa)) {
            std::printf("attnlab_selftest: %s built, not supported by this CPU: skipped\n",
                        isa.c_str());
            continue;
        }
        const KernelTable& kt = select_kernels(isa.c_str());
        std::printf("attnlab_selftest: variant %s (compiled for: %s; Eigen SIMD: %s)\n", kt.isa,
                    kt.compiled_for, kt.eigen_simd());
        for (int threads : {1, 3}) {
            set_num_threads(threads);
            std::mt19937 g(1234);
            selftest::check_forwards<float>(kt, g);
            selftest::check_forwards<double>(kt, g);
            selftest::check_backwards(kt, g);
            // The FMA peak kernel: a finite positive rate from every task (not a timing check).
            std::vector<double> per(static_cast<std::size_t>(threads), -1.0), cpu(per);
            const double peak = kt.fma_peak(0.02, per.data(), cpu.data(), threads);
            ++selftest::checks;
            if (!(std::isfinite(peak) && peak > 0) ||
                std::any_of(per.begin(), per.end(), [](double r) { return !(r > 0); })) {
                ++selftest::failures;
                std::printf("FAIL %s fma_peak: %g GFLOP/s\n", kt.isa, peak);
            }
        }
        ++ran;
    }
    std::printf("attnlab_selftest: %d variant(s), %d checks, %d failed\n", ran, selftest::checks,
                selftest::failures);
    return (selftest::failures == 0 && ran > 0 && selftest::checks > 0) ? 0 : 1;
}

// Bindings for scaled dot-product and multi-head attention.
#include "attnlab/attention.hpp"
#include "attnlab/gemm.hpp"
#include "common.hpp"

namespace attnlab {
namespace bind {

namespace {

template <typename T>
MatrixStack<const T> const_stack(const std::vector<Index>& st, const py::array& a) {
    return {static_cast<const T*>(a.data()), st[0], st[1], st[2]};
}

void check_heads(Index heads, Index kv_heads) {
    if (heads < 1 || kv_heads < 1 || heads % kv_heads != 0)
        throw py::value_error("num_heads must be a positive multiple of num_kv_heads, got " +
                              std::to_string(heads) + " and " + std::to_string(kv_heads));
}

// The checked (batch, heads, n, d) views of q, k, v shared by forward and backward.
template <typename T>
AttentionProblem<T> sdpa_problem(const py::array& q, const py::array& k, const py::array& v,
                                 double scale) {
    if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4)
        throw py::value_error("q, k, v: expected (batch, heads, n, d) arrays");
    const Index B = q.shape(0), H = q.shape(1), nq = q.shape(2), d = q.shape(3);
    const Index Hk = k.shape(1), nk = k.shape(2), dv = v.shape(3);
    check_heads(H, Hk);
    AttentionProblem<T> p;
    p.batch = B;
    p.heads = H;
    p.kv_heads = Hk;
    p.n_q = nq;
    p.n_k = nk;
    p.d = d;
    p.d_v = dv;
    p.scale = static_cast<T>(scale);
    p.q = const_stack<T>(check<T>(q, "q", {B, H, nq, d}), q);
    p.k = const_stack<T>(check<T>(k, "k", {B, Hk, nk, d}), k);
    p.v = const_stack<T>(check<T>(v, "v", {B, Hk, nk, dv}), v);
    return p;
}

void sdpa_forward(py::array q, py::array k, py::array v, py::array out, py::object mask,
                  py::object key_padding_mask, int causal, double scale, py::object weights,
                  py::object lse) {
    dispatch(q, "q", [&](auto tag) {
        using T = decltype(tag);
        AttentionProblem<T> p = sdpa_problem<T>(q, k, v, scale);
        const Index B = p.batch, H = p.heads, nq = p.n_q, nk = p.n_k, dv = p.d_v;
        auto so = check<T>(out, "out", {B, H, nq, dv}, true);
        p.out = {static_cast<T*>(out.mutable_data()), so[0], so[1], so[2]};
        p.mask = mask_spec<T>(mask, key_padding_mask, causal, B, H, nq, nk);
        if (!weights.is_none())
            p.weights = contiguous<T>(weights.cast<py::array>(), "weights", {B, H, nq, nk}, true);
        if (!lse.is_none()) p.lse = contiguous<T>(lse.cast<py::array>(), "lse", {B, H, nq}, true);
        py::gil_scoped_release release;
        attention_forward(p);
        return 0;
    });
}

template <typename T>
Linear<T> linear_arg(const py::array& w, const py::object& b, const char* wname,
                     const char* bname, Index in, Index out) {
    Linear<T> l;
    l.w = contiguous<T>(w, wname, {in, out});
    l.b = optional_vector<T>(b, bname, out);
    l.in = in;
    l.out = out;
    return l;
}

// vjp's buffers: the projections, the attention output and the log-sum-exp (or none).
template <typename T>
MhaState<T> mha_state(const py::object& state, Index batch, Index n_q, Index n_k, Index heads,
                      Index kv_heads, Index d_head, Index d_vhead) {
    MhaState<T> s;
    s.q = state_array<T>(state, "q", {batch * n_q, heads * d_head});
    s.k = state_array<T>(state, "k", {batch * n_k, kv_heads * d_head});
    s.v = state_array<T>(state, "v", {batch * n_k, kv_heads * d_vhead});
    s.ctx = state_array<T>(state, "ctx", {batch * n_q, heads * d_vhead});
    s.lse = state_array<T>(state, "lse", {batch, heads, n_q});
    return s;
}

void mha_forward(py::array query, py::array key, py::array value, py::array w_q, py::object b_q,
                 py::array w_k, py::object b_k, py::array w_v, py::object b_v, py::array w_o,
                 py::object b_o, Index batch, Index n_q, Index n_k, Index heads, Index kv_heads,
                 py::object mask, py::object key_padding_mask, int causal, double scale,
                 py::array out, py::object weights, py::object state) {
    dispatch(query, "query", [&](auto tag) {
        using T = decltype(tag);
        check_heads(heads, kv_heads);
        if (w_q.ndim() != 2 || w_k.ndim() != 2 || w_v.ndim() != 2 || w_o.ndim() != 2)
            throw py::value_error("w_q, w_k, w_v, w_o: expected 2-d arrays");
        if (batch < 0 || n_q < 0 || n_k < 0) throw py::value_error("negative sizes");
        const Index d_q = w_q.shape(0), d_k = w_k.shape(0), d_v = w_v.shape(0);
        if (w_q.shape(1) % heads != 0 || w_v.shape(1) % kv_heads != 0)
            throw py::value_error("projection widths must divide into heads");
        const Index d_head = w_q.shape(1) / heads, d_vhead = w_v.shape(1) / kv_heads;
        const Index d_out = w_o.shape(1);
        MhaProblem<T> p;
        p.batch = batch;
        p.n_q = n_q;
        p.n_k = n_k;
        p.heads = heads;
        p.kv_heads = kv_heads;
        p.d_head = d_head;
        p.d_vhead = d_vhead;
        p.query = contiguous<T>(query, "query", {batch * n_q, d_q});
        p.key = contiguous<T>(key, "key", {batch * n_k, d_k});
        p.value = contiguous<T>(value, "value", {batch * n_k, d_v});
        p.w_q = linear_arg<T>(w_q, b_q, "w_q", "b_q", d_q, heads * d_head);
        p.w_k = linear_arg<T>(w_k, b_k, "w_k", "b_k", d_k, kv_heads * d_head);
        p.w_v = linear_arg<T>(w_v, b_v, "w_v", "b_v", d_v, kv_heads * d_vhead);
        p.w_o = linear_arg<T>(w_o, b_o, "w_o", "b_o", heads * d_vhead, d_out);
        p.scale = static_cast<T>(scale);
        p.mask = mask_spec<T>(mask, key_padding_mask, causal, batch, heads, n_q, n_k);
        p.out = contiguous<T>(out, "out", {batch * n_q, d_out}, true);
        if (!weights.is_none())
            p.weights =
                contiguous<T>(weights.cast<py::array>(), "weights", {batch, heads, n_q, n_k}, true);
        p.state = mha_state<T>(state, batch, n_q, n_k, heads, kv_heads, d_head, d_vhead);
        py::gil_scoped_release release;
        multi_head_attention_forward(p);
        return 0;
    });
}

// Forward with log-sum-exp (unless recompute is false: out and lse are then the forward's),
// then backward: gradients of q, k, v for grad_out.
void sdpa_backward(py::array grad_out, py::array q, py::array k, py::array v, py::object mask,
                   py::object key_padding_mask, int causal, double scale, py::array out,
                   py::array lse, py::array d_q, py::array d_k, py::array d_v, bool recompute) {
    dispatch(q, "q", [&](auto tag) {
        using T = decltype(tag);
        AttentionProblem<T> p = sdpa_problem<T>(q, k, v, scale);
        const Index B = p.batch, H = p.heads, Hk = p.kv_heads, nq = p.n_q, nk = p.n_k;
        const Index d = p.d, dv = p.d_v;
        T* po = contiguous<T>(out, "out", {B, H, nq, dv}, true);
        p.out = {po, H * nq * dv, nq * dv, dv};
        p.mask = mask_spec<T>(mask, key_padding_mask, causal, B, H, nq, nk);
        p.lse = contiguous<T>(lse, "lse", {B, H, nq}, true);
        AttentionGrad<T> g;
        g.d_out = const_stack<T>(check<T>(grad_out, "grad_out", {B, H, nq, dv}), grad_out);
        T* gq = contiguous<T>(d_q, "d_q", {B, H, nq, d}, true);
        T* gk = contiguous<T>(d_k, "d_k", {B, Hk, nk, d}, true);
        T* gv = contiguous<T>(d_v, "d_v", {B, Hk, nk, dv}, true);
        g.d_q = {gq, H * nq * d, nq * d, d};
        g.d_k = {gk, Hk * nk * d, nk * d, d};
        g.d_v = {gv, Hk * nk * dv, nk * dv, dv};
        py::gil_scoped_release release;
        if (recompute) attention_forward(p);  // else out and lse are the forward's (vjp)
        attention_backward(p, g);
        return 0;
    });
}

template <typename T>
T* optional_out(const py::object& o, const char* name, std::vector<Index> shape) {
    if (o.is_none()) return nullptr;
    return contiguous<T>(o.cast<py::array>(), name, std::move(shape), true);
}

void mha_backward(py::array grad_out, py::array query, py::array key, py::array value,
                  py::array w_q, py::object b_q, py::array w_k, py::object b_k, py::array w_v,
                  py::object b_v, py::array w_o, py::object b_o, Index batch, Index n_q,
                  Index n_k, Index heads, Index kv_heads, py::object mask,
                  py::object key_padding_mask, int causal, double scale, py::dict grads,
                  py::object state) {
    dispatch(query, "query", [&](auto tag) {
        using T = decltype(tag);
        check_heads(heads, kv_heads);
        if (w_q.ndim() != 2 || w_k.ndim() != 2 || w_v.ndim() != 2 || w_o.ndim() != 2)
            throw py::value_error("w_q, w_k, w_v, w_o: expected 2-d arrays");
        if (batch < 0 || n_q < 0 || n_k < 0) throw py::value_error("negative sizes");
        const Index d_q = w_q.shape(0), d_k = w_k.shape(0), d_v = w_v.shape(0);
        if (w_q.shape(1) % heads != 0 || w_v.shape(1) % kv_heads != 0)
            throw py::value_error("projection widths must divide into heads");
        const Index d_head = w_q.shape(1) / heads, d_vhead = w_v.shape(1) / kv_heads;
        const Index d_out = w_o.shape(1);
        const Index wq = heads * d_head, wk = kv_heads * d_head, wv = kv_heads * d_vhead;
        MhaProblem<T> p;
        p.batch = batch;
        p.n_q = n_q;
        p.n_k = n_k;
        p.heads = heads;
        p.kv_heads = kv_heads;
        p.d_head = d_head;
        p.d_vhead = d_vhead;
        p.query = contiguous<T>(query, "query", {batch * n_q, d_q});
        p.key = contiguous<T>(key, "key", {batch * n_k, d_k});
        p.value = contiguous<T>(value, "value", {batch * n_k, d_v});
        p.w_q = linear_arg<T>(w_q, b_q, "w_q", "b_q", d_q, wq);
        p.w_k = linear_arg<T>(w_k, b_k, "w_k", "b_k", d_k, wk);
        p.w_v = linear_arg<T>(w_v, b_v, "w_v", "b_v", d_v, wv);
        p.w_o = linear_arg<T>(w_o, b_o, "w_o", "b_o", heads * d_vhead, d_out);
        p.scale = static_cast<T>(scale);
        p.mask = mask_spec<T>(mask, key_padding_mask, causal, batch, heads, n_q, n_k);
        const T* gout = contiguous<T>(grad_out, "grad_out", {batch * n_q, d_out});
        auto get = [&](const char* name) -> py::object {
            return grads.contains(name) ? py::object(grads[name]) : py::object(py::none());
        };
        MhaGrads<T> g;
        g.query = optional_out<T>(get("query"), "query", {batch * n_q, d_q});
        g.key = optional_out<T>(get("key"), "key", {batch * n_k, d_k});
        g.value = optional_out<T>(get("value"), "value", {batch * n_k, d_v});
        g.w_q = {optional_out<T>(get("w_q"), "w_q", {d_q, wq}), optional_out<T>(get("b_q"), "b_q", {wq})};
        g.w_k = {optional_out<T>(get("w_k"), "w_k", {d_k, wk}), optional_out<T>(get("b_k"), "b_k", {wk})};
        g.w_v = {optional_out<T>(get("w_v"), "w_v", {d_v, wv}), optional_out<T>(get("b_v"), "b_v", {wv})};
        g.w_o = {optional_out<T>(get("w_o"), "w_o", {heads * d_vhead, d_out}),
                 optional_out<T>(get("b_o"), "b_o", {d_out})};
        p.state = mha_state<T>(state, batch, n_q, n_k, heads, kv_heads, d_head, d_vhead);
        p.state.filled = !state.is_none();  // only vjp passes it, after its forward
        py::gil_scoped_release release;
        multi_head_attention_backward(p, gout, g);
        return 0;
    });
}

// y = x w + b over all rows (for the bench's GEMM peak and projection timings).
void linear_forward(py::array x, py::array w, py::object b, py::array y) {
    dispatch(x, "x", [&](auto tag) {
        using T = decltype(tag);
        if (x.ndim() != 2 || w.ndim() != 2) throw py::value_error("x, w: expected 2-d arrays");
        const Index rows = x.shape(0), in = x.shape(1), out = w.shape(1);
        const T* px = contiguous<T>(x, "x", {rows, in});
        const T* pw = contiguous<T>(w, "w", {in, out});
        const T* pb = optional_vector<T>(b, "b", out);
        T* py_ = contiguous<T>(y, "y", {rows, out}, true);
        py::gil_scoped_release release;
        linear(rows, in, out, px, in, pw, pb, py_, out);
        return 0;
    });
}

}  // namespace

void bind_mha(py::module_& m) {
    m.def("sdpa_forward", &sdpa_forward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
          py::arg("mask"), py::arg("key_padding_mask"), py::arg("causal"), py::arg("scale"),
          py::arg("weights"), py::arg("lse"));
    m.def("mha_forward", &mha_forward, py::arg("query"), py::arg("key"), py::arg("value"),
          py::arg("w_q"), py::arg("b_q"), py::arg("w_k"), py::arg("b_k"), py::arg("w_v"),
          py::arg("b_v"), py::arg("w_o"), py::arg("b_o"), py::arg("batch"), py::arg("n_q"),
          py::arg("n_k"), py::arg("heads"), py::arg("kv_heads"), py::arg("mask"),
          py::arg("key_padding_mask"), py::arg("causal"), py::arg("scale"), py::arg("out"),
          py::arg("weights"), py::arg("state") = py::none());
    m.def("sdpa_backward", &sdpa_backward, py::arg("grad_out"), py::arg("q"), py::arg("k"),
          py::arg("v"), py::arg("mask"), py::arg("key_padding_mask"), py::arg("causal"),
          py::arg("scale"), py::arg("out"), py::arg("lse"), py::arg("d_q"), py::arg("d_k"),
          py::arg("d_v"), py::arg("recompute") = true);
    m.def("mha_backward", &mha_backward, py::arg("grad_out"), py::arg("query"), py::arg("key"),
          py::arg("value"), py::arg("w_q"), py::arg("b_q"), py::arg("w_k"), py::arg("b_k"),
          py::arg("w_v"), py::arg("b_v"), py::arg("w_o"), py::arg("b_o"), py::arg("batch"),
          py::arg("n_q"), py::arg("n_k"), py::arg("heads"), py::arg("kv_heads"), py::arg("mask"),
          py::arg("key_padding_mask"), py::arg("causal"), py::arg("scale"), py::arg("grads"),
          py::arg("state") = py::none());
    m.def("linear_forward", &linear_forward, py::arg("x"), py::arg("w"), py::arg("b"),
          py::arg("y"));
}

}  // namespace bind
}  // namespace attnlab

// Bindings for bilinear-collapsed attention.
#include "attnlab/bilinear.hpp"
#include "common.hpp"

namespace attnlab {
namespace bind {

namespace {

// Checks the shapes the kernel relies on and fills the problem (outputs are set by callers).
template <typename T>
BilinearProblem<T> make_problem(py::array& query, py::array& key, py::array& value,
                                py::array& w_qk, py::object& u_k, py::array& w_v,
                                py::object& b_v, py::array& w_o, py::object& b_o, Index batch,
                                Index n_q, Index n_k, Index heads, Index kv_heads,
                                py::object& mask, py::object& key_padding_mask, int causal,
                                double scale, int order) {
    if (heads < 1 || kv_heads < 1 || heads % kv_heads != 0)
        throw py::value_error("num_heads must be a positive multiple of num_kv_heads");
    if (w_qk.ndim() != 3 || w_v.ndim() != 2 || w_o.ndim() != 2)
        throw py::value_error("w_qk, w_v, w_o: expected 3-d, 2-d and 2-d arrays");
    if (batch < 0 || n_q < 0 || n_k < 0) throw py::value_error("negative sizes");
    if (order != 0 && order != 1) throw py::value_error("order: expected 0 or 1");
    const Index d_q = w_qk.shape(1), d_k = w_qk.shape(2), d_v = w_v.shape(0);
    if (w_v.shape(1) % kv_heads != 0)
        throw py::value_error("w_v: width must divide into kv heads");
    const Index d_vhead = w_v.shape(1) / kv_heads, d_out = w_o.shape(1);
    BilinearProblem<T> p;
    p.batch = batch;
    p.n_q = n_q;
    p.n_k = n_k;
    p.heads = heads;
    p.kv_heads = kv_heads;
    p.d_q = d_q;
    p.d_k = d_k;
    p.d_vhead = d_vhead;
    p.query = contiguous<T>(query, "query", {batch * n_q, d_q});
    p.key = contiguous<T>(key, "key", {batch * n_k, d_k});
    p.value = contiguous<T>(value, "value", {batch * n_k, d_v});
    p.w_qk = contiguous<T>(w_qk, "w_qk", {heads, d_q, d_k});
    if (!u_k.is_none()) p.u_k = contiguous<T>(u_k.cast<py::array>(), "u_k", {heads, d_k});
    p.w_v.w = contiguous<T>(w_v, "w_v", {d_v, kv_heads * d_vhead});
    p.w_v.b = optional_vector<T>(b_v, "b_v", kv_heads * d_vhead);
    p.w_v.in = d_v;
    p.w_v.out = kv_heads * d_vhead;
    p.w_o.w = contiguous<T>(w_o, "w_o", {heads * d_vhead, d_out});
    p.w_o.b = optional_vector<T>(b_o, "b_o", d_out);
    p.w_o.in = heads * d_vhead;
    p.w_o.out = d_out;
    p.scale = static_cast<T>(scale);
    p.order = static_cast<BilinearOrder>(order);
    p.mask = mask_spec<T>(mask, key_padding_mask, causal, batch, heads, n_q, n_k);
    return p;
}

// vjp's buffers (BilinearState), or none.
template <typename T>
BilinearState<T> bilinear_state(const py::object& state, const BilinearProblem<T>& p) {
    const Index rq = p.batch * p.n_q;
    BilinearState<T> s;
    s.v = state_array<T>(state, "v", {p.batch * p.n_k, p.w_v.out});
    s.proj = state_array<T>(state, "proj", {rq, p.heads * p.d_k});
    s.ctx = state_array<T>(state, "ctx", {rq, p.heads * p.d_vhead});
    s.lse = state_array<T>(state, "lse", {p.batch, p.heads, p.n_q});
    return s;
}

void bilinear_forward(py::array query, py::array key, py::array value, py::array w_qk,
                      py::object u_k, py::array w_v, py::object b_v, py::array w_o,
                      py::object b_o, Index batch, Index n_q, Index n_k, Index heads,
                      Index kv_heads, py::object mask, py::object key_padding_mask, int causal,
                      double scale, int order, py::array out, py::object weights,
                      py::object state) {
    dispatch(query, "query", [&](auto tag) {
        using T = decltype(tag);
        BilinearProblem<T> p =
            make_problem<T>(query, key, value, w_qk, u_k, w_v, b_v, w_o, b_o, batch, n_q, n_k,
                            heads, kv_heads, mask, key_padding_mask, causal, scale, order);
        p.out = contiguous<T>(out, "out", {batch * n_q, p.w_o.out}, true);
        if (!weights.is_none())
            p.weights =
                contiguous<T>(weights.cast<py::array>(), "weights", {batch, heads, n_q, n_k}, true);
        p.state = bilinear_state<T>(state, p);
        py::gil_scoped_release release;
        bilinear_attention_forward(p);
        return 0;
    });
}

// grads: dict of preallocated outputs keyed by argument name; only the keys present are
// computed ("query", "key", "value", "w_qk", "u_k", "w_v", "b_v", "w_o", "b_o").
void bilinear_backward(py::array grad_out, py::array query, py::array key, py::array value,
                       py::array w_qk, py::object u_k, py::array w_v, py::object b_v,
                       py::array w_o, py::object b_o, Index batch, Index n_q, Index n_k,
                       Index heads, Index kv_heads, py::object mask,
                       py::object key_padding_mask, int causal, double scale, py::dict grads,
                       py::object state) {
    dispatch(query, "query", [&](auto tag) {
        using T = decltype(tag);
        BilinearProblem<T> p =
            make_problem<T>(query, key, value, w_qk, u_k, w_v, b_v, w_o, b_o, batch, n_q, n_k,
                            heads, kv_heads, mask, key_padding_mask, causal, scale, 0);
        const Index d_q = p.d_q, d_k = p.d_k, d_v = p.w_v.in;
        const Index wv = p.w_v.out, wc = p.w_o.in, d_out = p.w_o.out;
        const T* gout = contiguous<T>(grad_out, "grad_out", {batch * n_q, d_out});
        auto get = [&](const char* name, std::vector<Index> shape) -> T* {
            if (!grads.contains(name)) return nullptr;
            py::object o = grads[name];
            // an array owned by the dict: a converted temporary would be written and lost
            if (!py::isinstance<py::array>(o))
                throw py::type_error(std::string(name) + ": gradient output must be an ndarray");
            return contiguous<T>(o.cast<py::array>(), name, std::move(shape), true);
        };
        BilinearGrads<T> g;
        g.query = get("query", {batch * n_q, d_q});
        g.key = get("key", {batch * n_k, d_k});
        g.value = get("value", {batch * n_k, d_v});
        g.w_qk = get("w_qk", {heads, d_q, d_k});
        if (grads.contains("u_k")) {
            if (!p.u_k) throw py::value_error("u_k: a gradient was requested but u_k is None");
            g.u_k = get("u_k", {heads, d_k});
        }
        g.w_v = {get("w_v", {d_v, wv}), get("b_v", {wv})};
        g.w_o = {get("w_o", {wc, d_out}), get("b_o", {d_out})};
        p.state = bilinear_state<T>(state, p);
        p.state.filled = !state.is_none();  // only vjp passes it, after its forward
        py::gil_scoped_release release;
        bilinear_attention_backward(p, gout, g);
        return 0;
    });
}

}  // namespace

void bind_bilinear(py::module_& m) {
    m.def("bilinear_forward", &bilinear_forward, py::arg("query"), py::arg("key"),
          py::arg("value"), py::arg("w_qk"), py::arg("u_k"), py::arg("w_v"), py::arg("b_v"),
          py::arg("w_o"), py::arg("b_o"), py::arg("batch"), py::arg("n_q"), py::arg("n_k"),
          py::arg("heads"), py::arg("kv_heads"), py::arg("mask"), py::arg("key_padding_mask"),
          py::arg("causal"), py::arg("scale"), py::arg("order"), py::arg("out"),
          py::arg("weights"), py::arg("state") = py::none());
    m.def("bilinear_backward", &bilinear_backward, py::arg("grad_out"), py::arg("query"),
          py::arg("key"), py::arg("value"), py::arg("w_qk"), py::arg("u_k"), py::arg("w_v"),
          py::arg("b_v"), py::arg("w_o"), py::arg("b_o"), py::arg("batch"), py::arg("n_q"),
          py::arg("n_k"), py::arg("heads"), py::arg("kv_heads"), py::arg("mask"),
          py::arg("key_padding_mask"), py::arg("causal"), py::arg("scale"), py::arg("grads"),
          py::arg("state") = py::none());
}

}  // namespace bind
}  // namespace attnlab

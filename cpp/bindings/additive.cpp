// Bindings for efficient additive attention (SwiftFormer) and separable self-attention
// (MobileViT-v2): dtype dispatch, raw-buffer checks and GIL release only.
#include "attnlab/additive.hpp"
#include "common.hpp"

namespace attnlab {
namespace bind {

namespace {

TokenMask token_mask(const py::object& kpm, Index batch, Index n) {
    TokenMask m;
    if (kpm.is_none()) return m;
    py::array a = kpm.cast<py::array>();
    // the dtype parameter is unused for boolean arrays
    auto st = check<float>(a, "key_padding_mask", {batch, n}, false, true, false);
    m.data = static_cast<const std::uint8_t*>(a.data());
    m.sb = st[0];
    m.sk = st[1];
    return m;
}

void check_sizes(Index batch, Index n) {
    if (batch < 0 || n < 0) throw py::value_error("negative sizes");
}

void additive_forward(py::array x, py::array w_q, py::object b_q, py::array w_k, py::object b_k,
                      py::array w_g, py::array w_proj, py::object b_proj, py::array w_final,
                      py::object b_final, Index batch, Index n, double scale, double eps,
                      int variant, py::object key_padding_mask, py::array out) {
    dispatch(x, "x", [&](auto tag) {
        using T = decltype(tag);
        check_sizes(batch, n);
        if (variant != 0 && variant != 1) throw py::value_error("variant: expected 0 or 1");
        if (w_q.ndim() != 2 || w_final.ndim() != 2)
            throw py::value_error("w_q, w_final: expected 2-d arrays");
        const Index d_in = w_q.shape(0), D = w_q.shape(1), d_out = w_final.shape(1);
        if (D < 1) throw py::value_error("w_q: expected at least one output column");
        AdditiveProblem<T> p;
        p.batch = batch;
        p.n = n;
        p.d_in = d_in;
        p.width = D;
        p.d_out = d_out;
        p.x = contiguous<T>(x, "x", {batch * n, d_in});
        p.w_q = contiguous<T>(w_q, "w_q", {d_in, D});
        p.b_q = optional_vector<T>(b_q, "b_q", D);
        p.w_k = contiguous<T>(w_k, "w_k", {d_in, D});
        p.b_k = optional_vector<T>(b_k, "b_k", D);
        p.w_g = contiguous<T>(w_g, "w_g", {D});
        p.w_proj = contiguous<T>(w_proj, "w_proj", {D, D});
        p.b_proj = optional_vector<T>(b_proj, "b_proj", D);
        p.w_final = contiguous<T>(w_final, "w_final", {D, d_out});
        p.b_final = optional_vector<T>(b_final, "b_final", d_out);
        p.scale = static_cast<T>(scale);
        p.eps = static_cast<T>(eps);
        p.variant = static_cast<AdditiveVariant>(variant);
        p.key_padding = token_mask(key_padding_mask, batch, n);
        p.out = contiguous<T>(out, "out", {batch * n, d_out}, true);
        py::gil_scoped_release release;
        additive_attention_forward(p);
        return 0;
    });
}

void separable_forward(py::array x, py::array w_qkv, py::object b_qkv, py::array w_o,
                       py::object b_o, Index batch, Index n, py::object key_padding_mask,
                       py::array out) {
    dispatch(x, "x", [&](auto tag) {
        using T = decltype(tag);
        check_sizes(batch, n);
        if (w_qkv.ndim() != 2 || w_o.ndim() != 2)
            throw py::value_error("w_qkv, w_o: expected 2-d arrays");
        const Index d = w_qkv.shape(0), d_out = w_o.shape(1);
        SeparableProblem<T> p;
        p.batch = batch;
        p.n = n;
        p.d = d;
        p.d_out = d_out;
        p.x = contiguous<T>(x, "x", {batch * n, d});
        p.w_qkv = contiguous<T>(w_qkv, "w_qkv", {d, 1 + 2 * d});
        p.b_qkv = optional_vector<T>(b_qkv, "b_qkv", 1 + 2 * d);
        p.w_o = contiguous<T>(w_o, "w_o", {d, d_out});
        p.b_o = optional_vector<T>(b_o, "b_o", d_out);
        p.key_padding = token_mask(key_padding_mask, batch, n);
        p.out = contiguous<T>(out, "out", {batch * n, d_out}, true);
        py::gil_scoped_release release;
        separable_attention_forward(p);
        return 0;
    });
}

// The gradient buffer grads[name] (allocated by Python, shaped like the argument), or null when
// the argument was not given.
template <typename T>
T* grad_buffer(const py::dict& grads, const char* name, std::vector<Index> shape) {
    if (!grads.contains(name)) return nullptr;
    return contiguous<T>(grads[name].cast<py::array>(), name, std::move(shape), true);
}

void additive_backward(py::array grad_out, py::array x, py::array w_q, py::object b_q,
                       py::array w_k, py::object b_k, py::array w_g, py::array w_proj,
                       py::object b_proj, py::array w_final, py::object b_final, Index batch,
                       Index n, double scale, double eps, int variant,
                       py::object key_padding_mask, py::dict grads) {
    dispatch(x, "x", [&](auto tag) {
        using T = decltype(tag);
        check_sizes(batch, n);
        if (variant != 0 && variant != 1) throw py::value_error("variant: expected 0 or 1");
        if (w_q.ndim() != 2 || w_final.ndim() != 2)
            throw py::value_error("w_q, w_final: expected 2-d arrays");
        const Index d_in = w_q.shape(0), D = w_q.shape(1), d_out = w_final.shape(1);
        if (D < 1) throw py::value_error("w_q: expected at least one output column");
        AdditiveProblem<T> p;
        p.batch = batch;
        p.n = n;
        p.d_in = d_in;
        p.width = D;
        p.d_out = d_out;
        p.x = contiguous<T>(x, "x", {batch * n, d_in});
        p.w_q = contiguous<T>(w_q, "w_q", {d_in, D});
        p.b_q = optional_vector<T>(b_q, "b_q", D);
        p.w_k = contiguous<T>(w_k, "w_k", {d_in, D});
        p.b_k = optional_vector<T>(b_k, "b_k", D);
        p.w_g = contiguous<T>(w_g, "w_g", {D});
        p.w_proj = contiguous<T>(w_proj, "w_proj", {D, D});
        p.b_proj = optional_vector<T>(b_proj, "b_proj", D);
        p.w_final = contiguous<T>(w_final, "w_final", {D, d_out});
        p.b_final = optional_vector<T>(b_final, "b_final", d_out);
        p.scale = static_cast<T>(scale);
        p.eps = static_cast<T>(eps);
        p.variant = static_cast<AdditiveVariant>(variant);
        p.key_padding = token_mask(key_padding_mask, batch, n);
        const T* gout = contiguous<T>(grad_out, "grad_out", {batch * n, d_out});
        AdditiveGrads<T> g;
        g.x = grad_buffer<T>(grads, "x", {batch * n, d_in});
        g.w_q = grad_buffer<T>(grads, "w_q", {d_in, D});
        g.b_q = grad_buffer<T>(grads, "b_q", {D});
        g.w_k = grad_buffer<T>(grads, "w_k", {d_in, D});
        g.b_k = grad_buffer<T>(grads, "b_k", {D});
        g.w_g = grad_buffer<T>(grads, "w_g", {D});
        g.w_proj = grad_buffer<T>(grads, "w_proj", {D, D});
        g.b_proj = grad_buffer<T>(grads, "b_proj", {D});
        g.w_final = grad_buffer<T>(grads, "w_final", {D, d_out});
        g.b_final = grad_buffer<T>(grads, "b_final", {d_out});
        if (!g.x || !g.w_q || !g.w_k || !g.w_g || !g.w_proj || !g.w_final)
            throw py::value_error("grads: expected buffers for x, w_q, w_k, w_g, w_proj, w_final");
        py::gil_scoped_release release;
        additive_attention_backward(p, gout, g);
        return 0;
    });
}

void separable_backward(py::array grad_out, py::array x, py::array w_qkv, py::object b_qkv,
                        py::array w_o, py::object b_o, Index batch, Index n,
                        py::object key_padding_mask, py::dict grads) {
    dispatch(x, "x", [&](auto tag) {
        using T = decltype(tag);
        check_sizes(batch, n);
        if (w_qkv.ndim() != 2 || w_o.ndim() != 2)
            throw py::value_error("w_qkv, w_o: expected 2-d arrays");
        const Index d = w_qkv.shape(0), d_out = w_o.shape(1);
        SeparableProblem<T> p;
        p.batch = batch;
        p.n = n;
        p.d = d;
        p.d_out = d_out;
        p.x = contiguous<T>(x, "x", {batch * n, d});
        p.w_qkv = contiguous<T>(w_qkv, "w_qkv", {d, 1 + 2 * d});
        p.b_qkv = optional_vector<T>(b_qkv, "b_qkv", 1 + 2 * d);
        p.w_o = contiguous<T>(w_o, "w_o", {d, d_out});
        p.b_o = optional_vector<T>(b_o, "b_o", d_out);
        p.key_padding = token_mask(key_padding_mask, batch, n);
        const T* gout = contiguous<T>(grad_out, "grad_out", {batch * n, d_out});
        SeparableGrads<T> g;
        g.x = grad_buffer<T>(grads, "x", {batch * n, d});
        g.w_qkv = grad_buffer<T>(grads, "w_qkv", {d, 1 + 2 * d});
        g.b_qkv = grad_buffer<T>(grads, "b_qkv", {1 + 2 * d});
        g.w_o = grad_buffer<T>(grads, "w_o", {d, d_out});
        g.b_o = grad_buffer<T>(grads, "b_o", {d_out});
        if (!g.x || !g.w_qkv || !g.w_o)
            throw py::value_error("grads: expected buffers for x, w_qkv, w_o");
        py::gil_scoped_release release;
        separable_attention_backward(p, gout, g);
        return 0;
    });
}

}  // namespace

void bind_additive(py::module_& m) {
    m.def("additive_forward", &additive_forward, py::arg("x"), py::arg("w_q"), py::arg("b_q"),
          py::arg("w_k"), py::arg("b_k"), py::arg("w_g"), py::arg("w_proj"), py::arg("b_proj"),
          py::arg("w_final"), py::arg("b_final"), py::arg("batch"), py::arg("n"),
          py::arg("scale"), py::arg("eps"), py::arg("variant"), py::arg("key_padding_mask"),
          py::arg("out"));
    m.def("separable_forward", &separable_forward, py::arg("x"), py::arg("w_qkv"),
          py::arg("b_qkv"), py::arg("w_o"), py::arg("b_o"), py::arg("batch"), py::arg("n"),
          py::arg("key_padding_mask"), py::arg("out"));
    m.def("additive_backward", &additive_backward, py::arg("grad_out"), py::arg("x"),
          py::arg("w_q"), py::arg("b_q"), py::arg("w_k"), py::arg("b_k"), py::arg("w_g"),
          py::arg("w_proj"), py::arg("b_proj"), py::arg("w_final"), py::arg("b_final"),
          py::arg("batch"), py::arg("n"), py::arg("scale"), py::arg("eps"), py::arg("variant"),
          py::arg("key_padding_mask"), py::arg("grads"));
    m.def("separable_backward", &separable_backward, py::arg("grad_out"), py::arg("x"),
          py::arg("w_qkv"), py::arg("b_qkv"), py::arg("w_o"), py::arg("b_o"), py::arg("batch"),
          py::arg("n"), py::arg("key_padding_mask"), py::arg("grads"));
}

}  // namespace bind
}  // namespace attnlab

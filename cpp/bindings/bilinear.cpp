// Bindings for bilinear-collapsed attention.
#include "attnlab/bilinear.hpp"

#include "common.hpp"
#include "interrupt.hpp"

namespace attnlab {
namespace bind {

namespace {

// The arguments bilinear_forward and bilinear_backward share: core.BilinearArgs.
struct BilinearArgs : SharedArgs {
    Array query, key, value;
    Array w_qk;
    py::object u_k;
    int weights_half;  // 0: w_qk, w_v, w_o in the inputs' dtype; 1, 2: float16, bfloat16 bits
    int inputs_half;   // 1: query, key, value (and the forward's out) as bits of weights_half

    static constexpr auto fields() {
        return std::tuple_cat(
            std::make_tuple(field("query", &BilinearArgs::query), field("key", &BilinearArgs::key),
                            field("value", &BilinearArgs::value),
                            field("w_qk", &BilinearArgs::w_qk), field("u_k", &BilinearArgs::u_k),
                            field("weights_half", &BilinearArgs::weights_half),
                            field("inputs_half", &BilinearArgs::inputs_half)),
            SharedArgs::fields());
    }
};

// Checks the shapes the kernel relies on and fills the problem (forward and backward; the
// outputs are set by the callers). `state`: vjp's buffers (BilinearState), or none.
template <typename T>
BilinearProblem<T> bilinear_problem(const BilinearArgs& a, int order, const py::object& state) {
    const SharedArgs& s = a;
    const Index batch = s.batch, n_q = s.n_q, n_k = s.n_k, heads = s.heads, kv_heads = s.kv_heads;
    if (heads < 1 || kv_heads < 1 || heads % kv_heads != 0)
        throw py::value_error("num_heads must be a positive multiple of num_kv_heads");
    if (a.w_qk.ndim() != 3 || s.w_v.ndim() != 2 || s.w_o.ndim() != 2)
        throw py::value_error("w_qk, w_v, w_o: expected 3-d, 2-d and 2-d arrays");
    if (batch < 0 || n_q < 0 || n_k < 0) throw py::value_error("negative sizes");
    if (order != 0 && order != 1) throw py::value_error("order: expected 0 or 1");
    check_half_codes(a.weights_half, "inputs_half", a.inputs_half);
    const Index d_q = a.w_qk.shape(1), d_k = a.w_qk.shape(2), d_v = s.w_v.shape(0);
    if (s.w_v.shape(1) % kv_heads != 0)
        throw py::value_error("w_v: width must divide into kv heads");
    BilinearProblem<T> p;
    projected_inputs<T>(p, a, d_q, d_k, d_v, a.inputs_half != 0);
    p.d_q = d_q;
    p.d_k = d_k;
    const auto half = static_cast<HalfFormat>(a.weights_half);
    if (half == HalfFormat::none) {
        p.w_qk = contiguous<T>(a.w_qk, "w_qk", {heads, d_q, d_k});
    } else {
        if (!std::is_same_v<T, float>)
            throw py::type_error("w_qk: half-precision weights go with float32");
        p.w_qk_half = contiguous<std::uint16_t>(a.w_qk, "w_qk", {heads, d_q, d_k});
        p.half = half;
    }
    if (!a.u_k.is_none()) p.u_k = contiguous<T>(a.u_k.cast<py::array>(), "u_k", {heads, d_k});
    projected_values<T>(p, s, s.w_v.shape(1) / kv_heads, state, half);
    p.order = static_cast<BilinearOrder>(order);
    p.state.proj = state_array<T>(state, "proj", {batch * n_q, heads * d_k});
    return p;
}

void bilinear_forward(const BilinearArgs& a, int order, py::array out, py::object weights,
                      py::object state) {
    if (a.inputs_half) {  // computed in float32, out written as bits
        BilinearProblem<float> p = bilinear_problem<float>(a, order, state);
        projected_outputs<float, BilinearProblem<float>, std::uint16_t>(p, out, weights);
        ReleaseGil release;
        kernels_for<float>().bilinear_attention_forward(p);
        return;
    }
    dispatch(a.query, "query", [&](auto tag) {
        using T = decltype(tag);
        BilinearProblem<T> p = bilinear_problem<T>(a, order, state);
        projected_outputs<T>(p, out, weights);
        ReleaseGil release;
        kernels_for<T>().bilinear_attention_forward(p);
        return 0;
    });
}

// grads: dict of preallocated outputs keyed by argument name; only the keys present are
// computed ("query", "key", "value", "w_qk", "u_k", "w_v", "b_v", "w_o", "b_o"). state: only
// vjp passes it, after its forward filled it.
// Half-precision weights (weights_half; and inputs, inputs_half): computed in float32, the
// input gradients written as bits when the inputs are, grad_out read as bits when it is uint16
// (with half-precision inputs), the bias gradients and w_qk's float32, w_v's and w_o's written
// as bits when given as uint16 (linear_grad), else float32.
void bilinear_backward(py::array grad_out, const BilinearArgs& a, py::dict grads,
                       py::object state) {
    check_half_codes(a.weights_half, "inputs_half", a.inputs_half);  // before query's dtype
    const auto run = [&](auto tag) {
        using T = decltype(tag);
        BilinearProblem<T> p = bilinear_problem<T>(a, 0, state);
        p.state.filled = !state.is_none();
        const std::vector<Index> rows{p.batch * p.n_q, p.w_o.out};
        BilinearGrads<T> g;
        const T* gout = nullptr;
        if (a.weights_half != 0 && is_dtype<std::uint16_t>(grad_out)) {
            if (!a.inputs_half)
                throw py::type_error("grad_out: half-precision bits go with inputs_half");
            g.grad_out_half = contiguous<std::uint16_t>(grad_out, "grad_out", rows);
        } else {
            gout = contiguous<T>(grad_out, "grad_out", rows);
        }
        projected_grads<T>(g, grads, p, p.d_q, p.d_k, a.inputs_half != 0);
        g.w_qk = grad_buffer<T>(grads, "w_qk", {p.heads, p.d_q, p.d_k});
        if (grads.contains("u_k")) {
            if (!p.u_k) throw py::value_error("u_k: a gradient was requested but u_k is None");
            g.u_k = grad_buffer<T>(grads, "u_k", {p.heads, p.d_k});
        }
        ReleaseGil release;
        kernels_for<T>().bilinear_attention_backward(p, gout, g);
        return 0;
    };
    if (a.inputs_half) {  // uint16 bits: computed in float32
        run(float{});
        return;
    }
    dispatch(a.query, "query", run);
}

}  // namespace

void bind_bilinear(py::module_& m) {
    bind_args<BilinearArgs>(m, "BilinearArgs");
    m.def("bilinear_forward", &bilinear_forward, py::arg("args"), py::arg("order"), py::arg("out"),
          py::arg("weights"), py::arg("state") = py::none());
    m.def("bilinear_backward", &bilinear_backward, py::arg("grad_out"), py::arg("args"),
          py::arg("grads"), py::arg("state") = py::none());
}

}  // namespace bind
}  // namespace attnlab

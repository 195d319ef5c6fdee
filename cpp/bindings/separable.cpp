// Bindings for separable self-attention (MobileViT-v2): dtype dispatch, raw-buffer checks and
// GIL release only.
#include "attnlab/additive.hpp"
#include "pooled.hpp"

namespace attnlab {
namespace bind {

namespace {

template <typename Args, typename P, typename F>
void visit_separable(const Args& a, SeparableTensors<P>& t, Index rows, Index d, Index d_out,
                     F&& f) {
    f(t.x, a.x, "x", {rows, d}, false);
    f(t.w_qkv, a.w_qkv, "w_qkv", {d, 1 + 2 * d}, false);
    f(t.b_qkv, a.b_qkv, "b_qkv", {1 + 2 * d}, true);
    f(t.w_o, a.w_o, "w_o", {d, d_out}, false);
    f(t.b_o, a.b_o, "b_o", {d_out}, true);
}

// The arguments separable_forward and separable_backward share: core.SeparableArgs.
struct SeparableArgs {
    Array x, w_qkv;
    py::object b_qkv;
    Array w_o;
    py::object b_o;
    Index batch, n;
    py::object key_padding_mask;

    static constexpr auto fields() {
        return std::make_tuple(field("x", &SeparableArgs::x), field("w_qkv", &SeparableArgs::w_qkv),
                               field("b_qkv", &SeparableArgs::b_qkv),
                               field("w_o", &SeparableArgs::w_o), field("b_o", &SeparableArgs::b_o),
                               field("batch", &SeparableArgs::batch), field("n", &SeparableArgs::n),
                               field("key_padding_mask", &SeparableArgs::key_padding_mask));
    }
};

// What pooled_forward, pooled_backward and bind_pooled (pooled.hpp) need of separable
// self-attention.
struct Separable {
    using Args = SeparableArgs;

    // Checks every buffer and fills the problem (forward and backward; out is set by the
    // forward).
    template <typename T>
    static SeparableProblem<T> problem(const Args& a) {
        check_sizes(a.batch, a.n);
        if (a.w_qkv.ndim() != 2 || a.w_o.ndim() != 2)
            throw py::value_error("w_qkv, w_o: expected 2-d arrays");
        SeparableProblem<T> p;
        p.batch = a.batch;
        p.n = a.n;
        p.d = a.w_qkv.shape(0);
        p.d_out = a.w_o.shape(1);
        visit_separable(a, p, a.batch * a.n, p.d, p.d_out, check_input<T>);
        p.key_padding = token_mask(a.key_padding_mask, a.batch, a.n);
        return p;
    }

    // attnlab.vjp's state dict (SeparableState): every buffer or none.
    template <typename T>
    static void set_state(SeparableProblem<T>& p, const py::object& state) {
        const Index rows = p.batch * p.n;
        auto& s = p.state;
        s.s = state_array<T>(state, "s", {rows});
        s.k = state_array<T>(state, "k", {rows, p.d});
        s.v = state_array<T>(state, "v", {rows, p.d});
        s.context = state_array<T>(state, "context", {p.batch, p.d});
    }

    // The gradient buffers, through the visitor that checked the inputs (the same names and
    // shapes).
    template <typename T>
    static SeparableGrads<T> grad_buffers(const Args& a, const SeparableProblem<T>& p,
                                          const py::dict& grads) {
        SeparableGrads<T> g;
        visit_separable(a, g, a.batch * a.n, p.d, p.d_out, grad_from<T>(grads));
        if (!g.x || !g.w_qkv || !g.w_o)
            throw py::value_error("grads: expected buffers for x, w_qkv, w_o");
        return g;
    }

    template <typename T>
    static void forward(const SeparableProblem<T>& p) {
        kernels_for<T>().separable_attention_forward(p);
    }
    template <typename T>
    static void backward(const SeparableProblem<T>& p, const T* grad_out,
                         const SeparableGrads<T>& g) {
        kernels_for<T>().separable_attention_backward(p, grad_out, g);
    }
};

}  // namespace

void bind_separable(py::module_& m) { bind_pooled<Separable>(m, "separable", "SeparableArgs"); }

}  // namespace bind
}  // namespace attnlab

// Bindings for efficient additive attention (SwiftFormer): dtype dispatch, raw-buffer checks
// and GIL release only.
#include "attnlab/additive.hpp"

#include "pooled.hpp"

namespace attnlab {
namespace bind {

namespace {

// Fills each tensor pointer of `t` (the problem's arguments or their gradients) through
// f(pointer, Python argument, name, shape, optional), in argument order: one list of names and
// shapes for the forward, the backward and the gradient buffers.
template <typename Args, typename P, typename F>
void visit_additive(const Args& a, AdditiveTensors<P>& t, Index rows, Index d_in, Index D,
                    Index d_out, F&& f) {
    f(t.x, a.x, "x", {rows, d_in}, false);
    f(t.w_q, a.w_q, "w_q", {d_in, D}, false);
    f(t.b_q, a.b_q, "b_q", {D}, true);
    f(t.w_k, a.w_k, "w_k", {d_in, D}, false);
    f(t.b_k, a.b_k, "b_k", {D}, true);
    f(t.w_g, a.w_g, "w_g", {D}, false);
    f(t.w_proj, a.w_proj, "w_proj", {D, D}, false);
    f(t.b_proj, a.b_proj, "b_proj", {D}, true);
    f(t.w_final, a.w_final, "w_final", {D, d_out}, false);
    f(t.b_final, a.b_final, "b_final", {d_out}, true);
}

// The arguments additive_forward and additive_backward share: core.AdditiveArgs.
struct AdditiveArgs {
    Array x, w_q;
    py::object b_q;
    Array w_k;
    py::object b_k;
    Array w_g, w_proj;
    py::object b_proj;
    Array w_final;
    py::object b_final;
    Index batch, n;
    double scale, eps;
    int variant;
    py::object key_padding_mask;

    static constexpr auto fields() {
        return std::make_tuple(
            field("x", &AdditiveArgs::x), field("w_q", &AdditiveArgs::w_q),
            field("b_q", &AdditiveArgs::b_q), field("w_k", &AdditiveArgs::w_k),
            field("b_k", &AdditiveArgs::b_k), field("w_g", &AdditiveArgs::w_g),
            field("w_proj", &AdditiveArgs::w_proj), field("b_proj", &AdditiveArgs::b_proj),
            field("w_final", &AdditiveArgs::w_final), field("b_final", &AdditiveArgs::b_final),
            field("batch", &AdditiveArgs::batch), field("n", &AdditiveArgs::n),
            field("scale", &AdditiveArgs::scale), field("eps", &AdditiveArgs::eps),
            field("variant", &AdditiveArgs::variant),
            field("key_padding_mask", &AdditiveArgs::key_padding_mask));
    }
};

// What pooled_forward, pooled_backward and bind_pooled (pooled.hpp) need of additive attention.
struct Additive {
    using Args = AdditiveArgs;

    // Checks every buffer and fills the problem (forward and backward; out is set by the
    // forward).
    template <typename T>
    static AdditiveProblem<T> problem(const Args& a) {
        check_sizes(a.batch, a.n);
        if (a.variant != 0 && a.variant != 1) throw py::value_error("variant: expected 0 or 1");
        if (a.w_q.ndim() != 2 || a.w_final.ndim() != 2)
            throw py::value_error("w_q, w_final: expected 2-d arrays");
        const Index d_in = a.w_q.shape(0), D = a.w_q.shape(1), d_out = a.w_final.shape(1);
        if (D < 1) throw py::value_error("w_q: expected at least one output column");
        AdditiveProblem<T> p;
        p.batch = a.batch;
        p.n = a.n;
        p.d_in = d_in;
        p.width = D;
        p.d_out = d_out;
        visit_additive(a, p, a.batch * a.n, d_in, D, d_out, check_input<T>);
        p.scale = static_cast<T>(a.scale);
        p.eps = static_cast<T>(a.eps);
        p.variant = static_cast<AdditiveVariant>(a.variant);
        p.key_padding = token_mask(a.key_padding_mask, a.batch, a.n);
        return p;
    }

    // attnlab.vjp's state dict (AdditiveState): every buffer or none.
    template <typename T>
    static void set_state(AdditiveProblem<T>& p, const py::object& state) {
        const Index rows = p.batch * p.n;
        auto& s = p.state;
        s.q = state_array<T>(state, "q", {rows, p.width});
        s.k = state_array<T>(state, "k", {rows, p.width});
        s.q_norm = state_array<T>(state, "q_norm", {rows});
        s.k_norm = state_array<T>(state, "k_norm", {rows});
        s.score = state_array<T>(state, "score", {rows});
        s.score_norm = state_array<T>(state, "score_norm", {p.batch});
        s.pooled = state_array<T>(state, "pooled", {p.batch, p.width});
    }

    // The gradient buffers, through the visitor that checked the inputs (the same names and
    // shapes).
    template <typename T>
    static AdditiveGrads<T> grad_buffers(const Args& a, const AdditiveProblem<T>& p,
                                         const py::dict& grads) {
        AdditiveGrads<T> g;
        visit_additive(a, g, a.batch * a.n, p.d_in, p.width, p.d_out, grad_from<T>(grads));
        if (!g.x || !g.w_q || !g.w_k || !g.w_g || !g.w_proj || !g.w_final)
            throw py::value_error("grads: expected buffers for x, w_q, w_k, w_g, w_proj, w_final");
        return g;
    }

    template <typename T>
    static void forward(const AdditiveProblem<T>& p) {
        kernels_for<T>().additive_attention_forward(p);
    }
    template <typename T>
    static void backward(const AdditiveProblem<T>& p, const T* grad_out,
                         const AdditiveGrads<T>& g) {
        kernels_for<T>().additive_attention_backward(p, grad_out, g);
    }
};

}  // namespace

void bind_additive(py::module_& m) { bind_pooled<Additive>(m, "additive", "AdditiveArgs"); }

}  // namespace bind
}  // namespace attnlab

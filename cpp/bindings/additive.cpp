// Bindings for efficient additive attention (SwiftFormer): dtype dispatch, raw-buffer checks
// and GIL release only.
#include "attnlab/additive.hpp"

#include "pooled.hpp"

namespace attnlab {
namespace bind {

namespace {

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
    int half;  // 0; 1, 2: x and out (and any weight matrix) as float16, bfloat16 bits

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
            field("key_padding_mask", &AdditiveArgs::key_padding_mask),
            field("half", &AdditiveArgs::half));
    }
};

// What pooled_forward, pooled_backward and bind_pooled (pooled.hpp) need of additive attention.
struct Additive {
    using Args = AdditiveArgs;
    template <typename T>
    using Problem = AdditiveProblem<T>;
    template <typename T>
    using Grads = AdditiveGrads<T>;
    template <typename T>
    static constexpr auto forward = &KernelSet<T>::additive_attention_forward;
    template <typename T>
    static constexpr auto backward = &KernelSet<T>::additive_attention_backward;

    // The checks of this family's own arguments, its widths and its scalar options.
    template <typename T>
    static void widths(const Args& a, Problem<T>& p) {
        if (a.variant != 0 && a.variant != 1) throw py::value_error("variant: expected 0 or 1");
        if (a.w_q.ndim() != 2 || a.w_final.ndim() != 2)
            throw py::value_error("w_q, w_final: expected 2-d arrays");
        p.d_in = a.w_q.shape(0);
        p.width = a.w_q.shape(1);
        p.d_out = a.w_final.shape(1);
        if (p.width < 1) throw py::value_error("w_q: expected at least one output column");
        p.scale = static_cast<T>(a.scale);
        p.eps = static_cast<T>(a.eps);
        p.variant = static_cast<AdditiveVariant>(a.variant);
    }

    // Fills each tensor pointer of `t` (the problem's arguments or their gradients) through
    // f(pointer, Python argument, name, shape, optional), in argument order, with the sizes of
    // `s`: one list of names and shapes for the forward, the backward and the gradient buffers.
    template <typename T, typename P, typename F>
    static void visit(const Args& a, const Problem<T>& s, AdditiveTensors<P>& t, F&& f) {
        const Index rows = s.batch * s.n, d_in = s.d_in, D = s.width, d_out = s.d_out;
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

    // attnlab.vjp's state dict (AdditiveState): every buffer or none.
    template <typename T>
    static void set_state(Problem<T>& p, const py::object& state) {
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
};

}  // namespace

void bind_additive(py::module_& m) { bind_pooled<Additive>(m, "additive", "AdditiveArgs"); }

}  // namespace bind
}  // namespace attnlab

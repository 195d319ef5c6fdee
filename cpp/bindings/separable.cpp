// Bindings for separable self-attention (MobileViT-v2): dtype dispatch, raw-buffer checks and
// GIL release only.
#include "attnlab/additive.hpp"
#include "pooled.hpp"

namespace attnlab {
namespace bind {

namespace {

// The arguments separable_forward and separable_backward share: core.SeparableArgs.
struct SeparableArgs {
    Array x, w_qkv;
    py::object b_qkv;
    Array w_o;
    py::object b_o;
    Index batch, n;
    py::object key_padding_mask;
    int half;  // 0; 1, 2: x and out (and any weight matrix) as float16, bfloat16 bits

    static constexpr auto fields() {
        return std::make_tuple(field("x", &SeparableArgs::x), field("w_qkv", &SeparableArgs::w_qkv),
                               field("b_qkv", &SeparableArgs::b_qkv),
                               field("w_o", &SeparableArgs::w_o), field("b_o", &SeparableArgs::b_o),
                               field("batch", &SeparableArgs::batch), field("n", &SeparableArgs::n),
                               field("key_padding_mask", &SeparableArgs::key_padding_mask),
                               field("half", &SeparableArgs::half));
    }
};

// What pooled_forward, pooled_backward and bind_pooled (pooled.hpp) need of separable
// self-attention.
struct Separable {
    using Args = SeparableArgs;
    template <typename T>
    using Problem = SeparableProblem<T>;
    template <typename T>
    using Grads = SeparableGrads<T>;
    template <typename T>
    static constexpr auto forward = &KernelSet<T>::separable_attention_forward;
    template <typename T>
    static constexpr auto backward = &KernelSet<T>::separable_attention_backward;

    // The checks of this family's own arguments and its widths.
    template <typename T>
    static void widths(const Args& a, Problem<T>& p) {
        if (a.w_qkv.ndim() != 2 || a.w_o.ndim() != 2)
            throw py::value_error("w_qkv, w_o: expected 2-d arrays");
        p.d = a.w_qkv.shape(0);
        p.d_out = a.w_o.shape(1);
    }

    // The tensors in argument order, as Additive::visit names them, with the sizes of `s`.
    template <typename T, typename P, typename F>
    static void visit(const Args& a, const Problem<T>& s, SeparableTensors<P>& t, F&& f) {
        const Index rows = s.batch * s.n, d = s.d, d_out = s.d_out;
        f(t.x, a.x, "x", {rows, d}, false);
        f(t.w_qkv, a.w_qkv, "w_qkv", {d, 1 + 2 * d}, false);
        f(t.b_qkv, a.b_qkv, "b_qkv", {1 + 2 * d}, true);
        f(t.w_o, a.w_o, "w_o", {d, d_out}, false);
        f(t.b_o, a.b_o, "b_o", {d_out}, true);
    }

    // attnlab.vjp's state dict (SeparableState): every buffer or none.
    template <typename T>
    static void set_state(Problem<T>& p, const py::object& state) {
        const Index rows = p.batch * p.n;
        auto& s = p.state;
        s.s = state_array<T>(state, "s", {rows});
        s.k = state_array<T>(state, "k", {rows, p.d});
        s.v = state_array<T>(state, "v", {rows, p.d});
        s.context = state_array<T>(state, "context", {p.batch, p.d});
    }
};

}  // namespace

void bind_separable(py::module_& m) { bind_pooled<Separable>(m, "separable", "SeparableArgs"); }

}  // namespace bind
}  // namespace attnlab

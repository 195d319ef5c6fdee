// Bindings for efficient additive attention (SwiftFormer) and separable self-attention
// (MobileViT-v2): dtype dispatch, raw-buffer checks and GIL release only.
#include "attnlab/additive.hpp"

#include "common.hpp"
#include "interrupt.hpp"

namespace attnlab {
namespace bind {

namespace {

void check_sizes(Index batch, Index n) {
    if (batch < 0 || n < 0) throw py::value_error("negative sizes");
}

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

template <typename Args, typename P, typename F>
void visit_separable(const Args& a, SeparableTensors<P>& t, Index rows, Index d, Index d_out,
                     F&& f) {
    f(t.x, a.x, "x", {rows, d}, false);
    f(t.w_qkv, a.w_qkv, "w_qkv", {d, 1 + 2 * d}, false);
    f(t.b_qkv, a.b_qkv, "b_qkv", {1 + 2 * d}, true);
    f(t.w_o, a.w_o, "w_o", {d, d_out}, false);
    f(t.b_o, a.b_o, "b_o", {d_out}, true);
}

// For the visitors: an input checked as C-contiguous T of its shape (null for an absent bias).
template <typename T>
void check_input(const T*& ptr, const py::object& arg, const char* name, std::vector<Index> shape,
                 bool optional) {
    ptr = optional && arg.is_none() ? nullptr
                                    : contiguous<T>(arg.cast<py::array>(), name, std::move(shape));
}

// For the visitors: the gradient buffer of each tensor (null when not wanted).
template <typename T>
auto grad_from(const py::dict& grads) {
    return [&grads](T*& ptr, const py::object&, const char* name, std::vector<Index> shape, bool) {
        ptr = grad_buffer<T>(grads, name, std::move(shape));
    };
}

// The arguments additive_forward and additive_backward share, in their positional order.
struct AdditiveArgs {
    py::array x, w_q;
    py::object b_q;
    py::array w_k;
    py::object b_k;
    py::array w_g, w_proj;
    py::object b_proj;
    py::array w_final;
    py::object b_final;
    Index batch, n;
    double scale, eps;
    int variant;
    py::object key_padding_mask;
};
using AdditiveSignature =
    Signature<AdditiveArgs, Types<py::array, py::array, py::object, py::array, py::object,
                                  py::array, py::array, py::object, py::array, py::object, Index,
                                  Index, double, double, int, py::object>>;
auto additive_arg_names() {
    return std::make_tuple(py::arg("x"), py::arg("w_q"), py::arg("b_q"), py::arg("w_k"),
                           py::arg("b_k"), py::arg("w_g"), py::arg("w_proj"), py::arg("b_proj"),
                           py::arg("w_final"), py::arg("b_final"), py::arg("batch"), py::arg("n"),
                           py::arg("scale"), py::arg("eps"), py::arg("variant"),
                           py::arg("key_padding_mask"));
}

// Checks every buffer and fills the problem (forward and backward; out is set by the forward).
template <typename T>
AdditiveProblem<T> additive_problem(const AdditiveArgs& a) {
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

// The arguments separable_forward and separable_backward share, in their positional order.
struct SeparableArgs {
    py::array x, w_qkv;
    py::object b_qkv;
    py::array w_o;
    py::object b_o;
    Index batch, n;
    py::object key_padding_mask;
};
using SeparableSignature =
    Signature<SeparableArgs, Types<py::array, py::array, py::object, py::array, py::object, Index,
                                   Index, py::object>>;
auto separable_arg_names() {
    return std::make_tuple(py::arg("x"), py::arg("w_qkv"), py::arg("b_qkv"), py::arg("w_o"),
                           py::arg("b_o"), py::arg("batch"), py::arg("n"),
                           py::arg("key_padding_mask"));
}

template <typename T>
SeparableProblem<T> separable_problem(const SeparableArgs& a) {
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

// What pooled_forward and pooled_backward need of each family, by overload on its types: the
// problem builder, the gradient buffers (through the visitor that checked the inputs, so the
// same names and shapes) and the kernels.
template <typename T>
AdditiveProblem<T> problem(const AdditiveArgs& a) {
    return additive_problem<T>(a);
}
template <typename T>
SeparableProblem<T> problem(const SeparableArgs& a) {
    return separable_problem<T>(a);
}

// attnlab.vjp's state dict (AdditiveState, SeparableState): every buffer or none.
template <typename T>
void set_state(AdditiveProblem<T>& p, const py::object& state) {
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
template <typename T>
void set_state(SeparableProblem<T>& p, const py::object& state) {
    const Index rows = p.batch * p.n;
    auto& s = p.state;
    s.s = state_array<T>(state, "s", {rows});
    s.k = state_array<T>(state, "k", {rows, p.d});
    s.v = state_array<T>(state, "v", {rows, p.d});
    s.context = state_array<T>(state, "context", {p.batch, p.d});
}

template <typename T>
AdditiveGrads<T> grad_buffers(const AdditiveArgs& a, const AdditiveProblem<T>& p,
                              const py::dict& grads) {
    AdditiveGrads<T> g;
    visit_additive(a, g, a.batch * a.n, p.d_in, p.width, p.d_out, grad_from<T>(grads));
    if (!g.x || !g.w_q || !g.w_k || !g.w_g || !g.w_proj || !g.w_final)
        throw py::value_error("grads: expected buffers for x, w_q, w_k, w_g, w_proj, w_final");
    return g;
}
template <typename T>
SeparableGrads<T> grad_buffers(const SeparableArgs& a, const SeparableProblem<T>& p,
                               const py::dict& grads) {
    SeparableGrads<T> g;
    visit_separable(a, g, a.batch * a.n, p.d, p.d_out, grad_from<T>(grads));
    if (!g.x || !g.w_qkv || !g.w_o)
        throw py::value_error("grads: expected buffers for x, w_qkv, w_o");
    return g;
}

template <typename T>
void run(const AdditiveProblem<T>& p) {
    kernels_for<T>().additive_attention_forward(p);
}
template <typename T>
void run(const SeparableProblem<T>& p) {
    kernels_for<T>().separable_attention_forward(p);
}
template <typename T>
void run(const AdditiveProblem<T>& p, const T* grad_out, const AdditiveGrads<T>& g) {
    kernels_for<T>().additive_attention_backward(p, grad_out, g);
}
template <typename T>
void run(const SeparableProblem<T>& p, const T* grad_out, const SeparableGrads<T>& g) {
    kernels_for<T>().separable_attention_backward(p, grad_out, g);
}

// Forward and backward of either family (Args: AdditiveArgs or SeparableArgs). state: only
// attnlab.vjp passes it, a dict of buffers the forward fills and the backward then reads.
template <typename Args>
void pooled_forward(const Args& a, py::array out, py::object state) {
    dispatch(a.x, "x", [&](auto tag) {
        using T = decltype(tag);
        auto p = problem<T>(a);
        p.out = contiguous<T>(out, "out", {a.batch * a.n, p.d_out}, true);
        set_state(p, state);
        ReleaseGil release;
        run(p);
        return 0;
    });
}

// grads: dict of preallocated outputs keyed by argument name (the biases' may be missing).
template <typename Args>
void pooled_backward(py::array grad_out, const Args& a, py::dict grads, py::object state) {
    dispatch(a.x, "x", [&](auto tag) {
        using T = decltype(tag);
        auto p = problem<T>(a);
        set_state(p, state);
        p.state.filled = !state.is_none();
        const T* gout = contiguous<T>(grad_out, "grad_out", {a.batch * a.n, p.d_out});
        const auto g = grad_buffers<T>(a, p, grads);
        ReleaseGil release;
        run(p, gout, g);
        return 0;
    });
}

}  // namespace

void bind_additive(py::module_& m) {
    def(m, "additive_forward",
        AdditiveSignature::After<>::wrap<py::array, py::object>(&pooled_forward<AdditiveArgs>),
        std::tuple_cat(additive_arg_names(),
                       std::make_tuple(py::arg("out"), py::arg("state") = py::none())));
    def(m, "separable_forward",
        SeparableSignature::After<>::wrap<py::array, py::object>(&pooled_forward<SeparableArgs>),
        std::tuple_cat(separable_arg_names(),
                       std::make_tuple(py::arg("out"), py::arg("state") = py::none())));
    def(m, "additive_backward",
        AdditiveSignature::After<py::array>::wrap<py::dict, py::object>(
            &pooled_backward<AdditiveArgs>),
        std::tuple_cat(std::make_tuple(py::arg("grad_out")), additive_arg_names(),
                       std::make_tuple(py::arg("grads"), py::arg("state") = py::none())));
    def(m, "separable_backward",
        SeparableSignature::After<py::array>::wrap<py::dict, py::object>(
            &pooled_backward<SeparableArgs>),
        std::tuple_cat(std::make_tuple(py::arg("grad_out")), separable_arg_names(),
                       std::make_tuple(py::arg("grads"), py::arg("state") = py::none())));
}

}  // namespace bind
}  // namespace attnlab

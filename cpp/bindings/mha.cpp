// Bindings for scaled dot-product and multi-head attention.
#include <string>
#include <vector>

#include "attnlab/attention.hpp"
#include "common.hpp"
#include "interrupt.hpp"

namespace attnlab {
namespace bind {

namespace {

template <typename T>
MatrixStack<const T> const_stack(const Dims& st, const py::array& a) {
    return {static_cast<const T*>(a.data()), st[0], st[1], st[2]};
}

void check_heads(Index heads, Index kv_heads) {
    if (heads < 1 || kv_heads < 1 || heads % kv_heads != 0)
        throw py::value_error("num_heads must be a positive multiple of num_kv_heads, got " +
                              std::to_string(heads) + " and " + std::to_string(kv_heads));
}

// The sizes of (batch, heads, n, d) arrays q, k, v and the scale (the arrays are viewed by the
// caller, in the dtype they are stored in).
template <typename T>
AttentionProblem<T> sdpa_sizes(const py::array& q, const py::array& k, const py::array& v,
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
    return p;
}

// The checked (batch, heads, n, d) views of q, k, v shared by forward and backward.
template <typename T>
AttentionProblem<T> sdpa_problem(const py::array& q, const py::array& k, const py::array& v,
                                 double scale, bool bf16) {
    if (bf16 && !std::is_same_v<T, float>)
        throw py::type_error("bf16: bf16 products take float32 operands, got float64 q");
    AttentionProblem<T> p = sdpa_sizes<T>(q, k, v, scale);
    p.q = const_stack<T>(check<T>(q, "q", {p.batch, p.heads, p.n_q, p.d}), q);
    p.k = const_stack<T>(check<T>(k, "k", {p.batch, p.kv_heads, p.n_k, p.d}), k);
    p.v = const_stack<T>(check<T>(v, "v", {p.batch, p.kv_heads, p.n_k, p.d_v}), v);
    p.bf16 = bf16 ? Bf16::probabilities : Bf16::none;
    return p;
}

void sdpa_forward(py::array q, py::array k, py::array v, py::array out, const MaskArgs& mask,
                  double scale, py::object weights, py::object lse, bool bf16) {
    dispatch(q, "q", [&](auto tag) {
        using T = decltype(tag);
        AttentionProblem<T> p = sdpa_problem<T>(q, k, v, scale, bf16);
        const Index B = p.batch, H = p.heads, nq = p.n_q, nk = p.n_k, dv = p.d_v;
        auto so = check<T>(out, "out", {B, H, nq, dv}, true);
        p.out = {static_cast<T*>(out.mutable_data()), so[0], so[1], so[2]};
        p.mask = mask_spec<T>(mask, B, H, nq, nk);
        if (!weights.is_none())
            p.weights = contiguous<T>(weights.cast<py::array>(), "weights", {B, H, nq, nk}, true);
        if (!lse.is_none()) p.lse = contiguous<T>(lse.cast<py::array>(), "lse", {B, H, nq}, true);
        ReleaseGil release;
        kernels_for<T>().attention_forward(p);
        return 0;
    });
}

// The sizes and the half-precision views of q, k, v (their bits as uint16 arrays; half 1:
// float16, 2: bfloat16) of an SDPA call computed in float32; with float_q, q is float32.
AttentionProblem<float> half_problem(const py::array& q, const py::array& k, const py::array& v,
                                     int half, double scale, bool float_q = false) {
    if (half != 1 && half != 2) throw py::value_error("half: expected 1 (float16) or 2 (bfloat16)");
    AttentionProblem<float> p = sdpa_sizes<float>(q, k, v, scale);
    const Index B = p.batch, H = p.heads, Hk = p.kv_heads, nq = p.n_q, nk = p.n_k;
    using Bits = std::uint16_t;
    p.half = half == 1 ? HalfFormat::float16 : HalfFormat::bfloat16;
    if (float_q)
        p.q = const_stack<float>(check<float>(q, "q", {B, H, nq, p.d}), q);
    else
        p.q_half = const_stack<Bits>(check<Bits>(q, "q", {B, H, nq, p.d}), q);
    p.k_half = const_stack<Bits>(check<Bits>(k, "k", {B, Hk, nk, p.d}), k);
    p.v_half = const_stack<Bits>(check<Bits>(v, "v", {B, Hk, nk, p.d_v}), v);
    return p;
}

// The forward with q, k, v and out in half precision (their bits as uint16 arrays; half 1:
// float16, 2: bfloat16), computed in float32 (bf16: with bf16 products); lse float32; out and
// the weights, when wanted, as bits or float32. q may be float32 (k and v a half-precision
// cache): out is then float32.
void sdpa_forward_half(py::array q, py::array k, py::array v, int half, py::array out,
                       const MaskArgs& mask, double scale, py::object lse, py::object weights,
                       bool bf16) {
    const bool float_q = is_dtype<float>(q);
    if (float_q && !is_dtype<float>(out))
        throw py::type_error("out: float32 q writes a float32 out");
    AttentionProblem<float> p = half_problem(q, k, v, half, scale, float_q);
    if (bf16) p.bf16 = Bf16::probabilities;
    const Index B = p.batch, H = p.heads, nq = p.n_q, nk = p.n_k, dv = p.d_v;
    using Bits = std::uint16_t;
    if (is_dtype<float>(out)) {  // kept in float32 (attnlab.vjp's forward)
        auto so = check<float>(out, "out", {B, H, nq, dv}, true);
        p.out = {static_cast<float*>(out.mutable_data()), so[0], so[1], so[2]};
    } else {
        auto so = check<Bits>(out, "out", {B, H, nq, dv}, true);
        p.out_half = {static_cast<Bits*>(out.mutable_data()), so[0], so[1], so[2]};
    }
    p.mask = mask_spec<float>(mask, B, H, nq, nk);
    if (!lse.is_none()) p.lse = contiguous<float>(lse.cast<py::array>(), "lse", {B, H, nq}, true);
    if (!weights.is_none()) {  // as bits, or float32 (their mean over the heads is taken so)
        py::array w = weights.cast<py::array>();
        if (is_dtype<float>(w))
            p.weights = contiguous<float>(w, "weights", {B, H, nq, nk}, true);
        else
            p.weights_half = contiguous<Bits>(w, "weights", {B, H, nq, nk}, true);
    }
    ReleaseGil release;
    kernels_for<float>().attention_forward(p);
}

// An SDPA backward's gradient buffer (B, heads, n, d) of elements U (T, or the bits of a half
// format), checked, as a stack.
template <typename U>
MatrixStack<U> grad_stack(const py::array& a, const char* name, Index B, Index heads, Index n,
                          Index d) {
    return {contiguous<U>(a, name, {B, heads, n, d}, true), heads * n * d, n * d, d};
}

// An SDPA backward's buffers, checked against the problem's sizes: d_q, d_k, d_v (elements U:
// T, or the bits of a half format; d_q's UQ) into the stacks gq, gk, gv, and the optional
// gradients of an additive mask and of the sinks (T) into g.
template <typename U, typename T, typename UQ = U>
void grad_buffers(const AttentionProblem<T>& p, const py::array& d_q, const py::array& d_k,
                  const py::array& d_v, const py::object& d_mask, const py::object& d_sinks,
                  AttentionGrad<T>& g, MatrixStack<UQ>& gq, MatrixStack<U>& gk,
                  MatrixStack<U>& gv) {
    const Index B = p.batch, H = p.heads, Hk = p.kv_heads, nq = p.n_q, nk = p.n_k;
    gq = grad_stack<UQ>(d_q, "d_q", B, H, nq, p.d);
    gk = grad_stack<U>(d_k, "d_k", B, Hk, nk, p.d);
    gv = grad_stack<U>(d_v, "d_v", B, Hk, nk, p.d_v);
    if (!d_mask.is_none())
        g.d_mask = contiguous<T>(d_mask.cast<py::array>(), "d_mask", {B, H, nq, nk}, true);
    if (!d_sinks.is_none())
        g.d_sinks = contiguous<T>(d_sinks.cast<py::array>(), "d_sinks", {B, H}, true);
}

// Forward with log-sum-exp (unless recompute is false: out and lse are then the forward's),
// then backward: gradients of q, k, v for grad_out.
void sdpa_backward(py::array grad_out, py::array q, py::array k, py::array v, const MaskArgs& mask,
                   double scale, py::array out, py::array lse, py::array d_q, py::array d_k,
                   py::array d_v, bool recompute, py::object d_mask, py::object d_sinks,
                   bool bf16) {
    dispatch(q, "q", [&](auto tag) {
        using T = decltype(tag);
        AttentionProblem<T> p = sdpa_problem<T>(q, k, v, scale, bf16);
        const Index B = p.batch, H = p.heads, nq = p.n_q, nk = p.n_k, dv = p.d_v;
        T* po = contiguous<T>(out, "out", {B, H, nq, dv}, true);
        p.out = {po, H * nq * dv, nq * dv, dv};
        p.mask = mask_spec<T>(mask, B, H, nq, nk);
        p.lse = contiguous<T>(lse, "lse", {B, H, nq}, true);
        AttentionGrad<T> g;
        g.d_out = const_stack<T>(check<T>(grad_out, "grad_out", {B, H, nq, dv}), grad_out);
        grad_buffers(p, d_q, d_k, d_v, d_mask, d_sinks, g, g.d_q, g.d_k, g.d_v);
        g.recompute = recompute;  // else out and lse are the forward's (vjp)
        ReleaseGil release;
        kernels_for<T>().attention_backward(p, g);
        return 0;
    });
}

// sdpa_backward with q, k, v and the gradients d_q, d_k, d_v in half precision (their bits as
// uint16 arrays; half 1: float16, 2: bfloat16), computed in float32: grad_out as bits of the
// same format when grad_out_half, else float32; out, lse, d_mask and d_sinks float32. q may be
// float32 (k and v a half-precision cache): d_q is then float32, and so is grad_out. bf16: the
// gradients of precision="bf16" (the float32 function at q, k, v rounded to bf16).
void sdpa_backward_half(py::array grad_out, py::array q, py::array k, py::array v, int half,
                        const MaskArgs& mask, double scale, py::array out, py::array lse,
                        py::array d_q, py::array d_k, py::array d_v, bool grad_out_half,
                        bool recompute, py::object d_mask, py::object d_sinks, bool bf16) {
    const bool float_q = is_dtype<float>(q);
    if (float_q && grad_out_half)
        throw py::type_error("grad_out: float32 q's output, and so its gradient, is float32");
    AttentionProblem<float> p = half_problem(q, k, v, half, scale, float_q);
    if (bf16) p.bf16 = Bf16::probabilities;
    const Index B = p.batch, H = p.heads, nq = p.n_q, nk = p.n_k, dv = p.d_v;
    using Bits = std::uint16_t;
    float* po = contiguous<float>(out, "out", {B, H, nq, dv}, true);
    p.out = {po, H * nq * dv, nq * dv, dv};
    p.mask = mask_spec<float>(mask, B, H, nq, nk);
    p.lse = contiguous<float>(lse, "lse", {B, H, nq}, true);
    AttentionGrad<float> g;
    if (grad_out_half)
        g.d_out_half =
            const_stack<Bits>(check<Bits>(grad_out, "grad_out", {B, H, nq, dv}), grad_out);
    else
        g.d_out = const_stack<float>(check<float>(grad_out, "grad_out", {B, H, nq, dv}), grad_out);
    if (float_q)
        grad_buffers(p, d_q, d_k, d_v, d_mask, d_sinks, g, g.d_q, g.d_k_half, g.d_v_half);
    else
        grad_buffers(p, d_q, d_k, d_v, d_mask, d_sinks, g, g.d_q_half, g.d_k_half, g.d_v_half);
    g.recompute = recompute;  // out in float32: out_half is not set
    ReleaseGil release;
    kernels_for<float>().attention_backward(p, g);
}

// merge_attention's weighted sum: parts, a list of (rows, d) arrays of frac's dtype (or, with
// half 1 / 2 and float32 frac, of float16 / bfloat16 bits); frac (count, rows); out (rows, d)
// like the parts.
void merge_parts(const py::list& parts, int half, const py::array& frac, const py::array& out) {
    if (half < 0 || half > 2)
        throw py::value_error("half: expected 0, 1 (float16) or 2 (bfloat16), got " +
                              std::to_string(half));
    dispatch(frac, "frac", [&](auto tag) {
        using T = decltype(tag);
        using Bits = std::uint16_t;
        if (half && !std::is_same_v<T, float>)
            throw py::type_error("frac: half-precision parts are summed in float32");
        MergeProblem<T> p;
        p.count = static_cast<Index>(parts.size());
        if (frac.ndim() != 2 || out.ndim() != 2)
            throw py::value_error("frac, out: expected 2-d arrays (count, rows), (rows, d)");
        p.rows = frac.shape(1);
        p.d = out.shape(1);
        p.frac = contiguous<T>(frac, "frac", {p.count, p.rows});
        std::vector<const T*> floats;
        std::vector<const Bits*> bits;
        for (Index k = 0; k < p.count; ++k) {
            const std::string name = "parts[" + std::to_string(k) + "]";
            const auto a = py::cast<py::array>(parts[static_cast<std::size_t>(k)]);
            if (half)
                bits.push_back(contiguous<Bits>(a, name.c_str(), {p.rows, p.d}));
            else
                floats.push_back(contiguous<T>(a, name.c_str(), {p.rows, p.d}));
        }
        if (half) {
            p.half = static_cast<HalfFormat>(half);
            p.parts_half = bits.data();
            p.out_half = contiguous<Bits>(out, "out", {p.rows, p.d}, true);
        } else {
            p.parts = floats.data();
            p.out = contiguous<T>(out, "out", {p.rows, p.d}, true);
        }
        ReleaseGil release;
        kernels_for<T>().merge_attention(p);
        return 0;
    });
}

// The arguments mha_forward and mha_backward share: core.MhaArgs.
struct MhaArgs : SharedArgs {
    Array query, key, value;
    Array w_q;
    py::object b_q;
    Array w_k;
    py::object b_k;
    int weights_half;  // 0: the weights in the inputs' dtype; 1, 2: float16, bfloat16 bits
    int inputs_half;   // 1: query, key, value (and the forward's out) as bits of weights_half
    // None, or (w_q, w_k, w_v, w_o)'s core.pack_weight arrays or None each (with bf16 products:
    // their core.pack_bf16_tiles arrays)
    py::object packed;

    static constexpr auto fields() {
        return std::tuple_cat(
            std::make_tuple(
                field("query", &MhaArgs::query), field("key", &MhaArgs::key),
                field("value", &MhaArgs::value), field("w_q", &MhaArgs::w_q),
                field("b_q", &MhaArgs::b_q), field("w_k", &MhaArgs::w_k),
                field("b_k", &MhaArgs::b_k), field("weights_half", &MhaArgs::weights_half),
                field("inputs_half", &MhaArgs::inputs_half), field("packed", &MhaArgs::packed)),
            SharedArgs::fields());
    }
};

// The panels of a weight (in x out) packed by core.pack_weight, checked: null for None.
template <typename T>
const T* packed_panels(const py::handle& o, const char* name, Index in, Index out) {
    if (o.is_none()) return nullptr;
    if (!py::isinstance<py::array>(o))
        throw py::type_error(std::string(name) + ": expected an array from core.pack_weight");
    return contiguous<T>(py::reinterpret_borrow<py::array>(o), name,
                         {kernels_for<T>().packed_weight_size(in, out)});
}

// p's projections read the panels a.packed holds (float weights only): float panels, or with
// bf16 products (float32) the bf16 tiles.
template <typename T>
void attach_packed(MhaProblem<T>& p, const MhaArgs& a, bool bf16) {
    if (a.packed.is_none()) return;
    if (!py::isinstance<py::tuple>(a.packed) || py::len(a.packed) != 4)
        throw py::type_error("packed: expected None or a tuple of 4 (w_q, w_k, w_v, w_o)");
    if (a.weights_half) throw py::value_error("packed: not with half-precision weights");
    const py::tuple t = a.packed.cast<py::tuple>();
    Linear<T>* layers[4] = {&p.w_q, &p.w_k, &p.w_v, &p.w_o};
    const char* names[4] = {"packed[0] (w_q)", "packed[1] (w_k)", "packed[2] (w_v)",
                            "packed[3] (w_o)"};
    for (int i = 0; i < 4; ++i) {
        Linear<T>& l = *layers[i];
        if (!bf16) {
            l.packed = packed_panels<T>(t[i], names[i], l.in, l.out);
        } else if (!t[i].is_none()) {
            const Index size = kernels().bf16_tiles_size(l.in, l.out);
            if (size == 0)
                throw py::value_error(std::string(names[i]) +
                                      ": bf16 tiles given where the bf16 products run emulated");
            l.tiles = contiguous<std::uint16_t>(py::reinterpret_borrow<py::array>(t[i]), names[i],
                                                {size});
        }
    }
}

// The q/k norms and rotary embeddings of a multi-head call: core.QkArgs (QkTransform).
struct QkArgs {
    py::object q_norm, k_norm;  // (d_head,) or None
    double norm_eps;
    Index rope_dim;                         // 0: no rotation
    py::object cos_q, sin_q, cos_k, sin_k;  // (batch or 1, n, rope_dim / 2), or None

    static constexpr auto fields() {
        return std::make_tuple(field("q_norm", &QkArgs::q_norm), field("k_norm", &QkArgs::k_norm),
                               field("norm_eps", &QkArgs::norm_eps),
                               field("rope_dim", &QkArgs::rope_dim), field("cos_q", &QkArgs::cos_q),
                               field("sin_q", &QkArgs::sin_q), field("cos_k", &QkArgs::cos_k),
                               field("sin_k", &QkArgs::sin_k));
    }
};

// A rotary table pair of n positions, one for all batch entries or one per entry.
template <typename T>
RotaryTables<T> rotary_tables(const py::object& cos, const py::object& sin, const char* cname,
                              const char* sname, Index batch, Index n, Index half) {
    const py::array c = cos.cast<py::array>(), s = sin.cast<py::array>();
    const Index tb = c.ndim() == 3 ? c.shape(0) : -1;
    if (tb != 1 && tb != batch)
        throw py::value_error(std::string(cname) + ": expected (1 or batch, n, rope_dim / 2)");
    return {contiguous<T>(c, cname, {tb, n, half}), contiguous<T>(s, sname, {tb, n, half}),
            tb != 1 || batch == 1};
}

// p.qk from qk (None: no transform); after mha_problem (the sizes).
template <typename T>
void qk_transform(MhaProblem<T>& p, const py::object& qk) {
    if (qk.is_none()) return;
    if (!py::isinstance<QkArgs>(qk)) throw py::type_error("qk: expected core.QkArgs or None");
    const QkArgs& a = qk.cast<const QkArgs&>();
    p.qk.q_norm = optional_vector<T>(a.q_norm, "q_norm", p.d_head);
    p.qk.k_norm = optional_vector<T>(a.k_norm, "k_norm", p.d_head);
    if (!(a.norm_eps >= 0)) throw py::value_error("norm_eps: expected a number >= 0");
    p.qk.eps = static_cast<T>(a.norm_eps);
    if (a.rope_dim < 0 || a.rope_dim % 2 || a.rope_dim > p.d_head)
        throw py::value_error("rope_dim: expected an even number in [0, d_head], got " +
                              std::to_string(a.rope_dim));
    p.qk.rope_dim = a.rope_dim;
    if (a.rope_dim == 0) return;
    const Index half = a.rope_dim / 2;
    p.qk.rope_q = rotary_tables<T>(a.cos_q, a.sin_q, "cos_q", "sin_q", p.batch, p.n_q, half);
    p.qk.rope_k = rotary_tables<T>(a.cos_k, a.sin_k, "cos_k", "sin_k", p.batch, p.n_k, half);
}

// Checks every buffer against the sizes and fills the problem (forward and backward; the
// outputs are set by the callers). `state`: vjp's buffers, the projections, the attention
// output and the log-sum-exp (or none).
template <typename T>
MhaProblem<T> mha_problem(const MhaArgs& a, const py::object& state, bool bf16 = false) {
    const SharedArgs& s = a;
    const Index batch = s.batch, n_q = s.n_q, n_k = s.n_k, heads = s.heads, kv_heads = s.kv_heads;
    check_heads(heads, kv_heads);
    if (a.w_q.ndim() != 2 || a.w_k.ndim() != 2 || s.w_v.ndim() != 2 || s.w_o.ndim() != 2)
        throw py::value_error("w_q, w_k, w_v, w_o: expected 2-d arrays");
    if (batch < 0 || n_q < 0 || n_k < 0) throw py::value_error("negative sizes");
    const Index d_q = a.w_q.shape(0), d_k = a.w_k.shape(0), d_v = s.w_v.shape(0);
    if (a.w_q.shape(1) % heads != 0 || s.w_v.shape(1) % kv_heads != 0)
        throw py::value_error("projection widths must divide into heads");
    const Index d_head = a.w_q.shape(1) / heads, d_vhead = s.w_v.shape(1) / kv_heads;
    const Index wq = heads * d_head, wk = kv_heads * d_head;
    MhaProblem<T> p;
    check_half_codes(a.weights_half, "inputs_half", a.inputs_half);
    projected_inputs<T>(p, a, d_q, d_k, d_v, a.inputs_half != 0);
    p.d_head = d_head;
    const auto half = static_cast<HalfFormat>(a.weights_half);
    p.w_q = linear_arg<T>(a.w_q, a.b_q, "w_q", "b_q", d_q, wq, half);
    p.w_k = linear_arg<T>(a.w_k, a.b_k, "w_k", "b_k", d_k, wk, half);
    projected_values<T>(p, s, d_vhead, state, half);
    attach_packed(p, a, bf16);
    p.state.q = state_array<T>(state, "q", {batch * n_q, wq});
    p.state.k = state_array<T>(state, "k", {batch * n_k, wk});
    return p;
}

void mha_forward(const MhaArgs& a, py::array out, py::object weights, py::object state, bool bf16,
                 py::object qk) {
    if (a.inputs_half) {  // computed in float32 (bf16 products), out written as bits
        MhaProblem<float> p = mha_problem<float>(a, state, bf16);
        qk_transform(p, qk);
        p.bf16 = bf16;
        projected_outputs<float, MhaProblem<float>, std::uint16_t>(p, out, weights);
        ReleaseGil release;
        kernels_for<float>().multi_head_attention_forward(p);
        return;
    }
    dispatch(a.query, "query", [&](auto tag) {
        using T = decltype(tag);
        if (bf16 && !std::is_same_v<T, float>)
            throw py::type_error("bf16: bf16 products take float32 operands, got float64 query");
        MhaProblem<T> p = mha_problem<T>(a, state, bf16);
        qk_transform(p, qk);
        p.bf16 = bf16;
        projected_outputs<T>(p, out, weights);
        ReleaseGil release;
        kernels_for<T>().multi_head_attention_forward(p);
        return 0;
    });
}

// grads: dict of preallocated outputs keyed by argument name; only the keys present are
// computed. state: only vjp passes it, after its forward filled it.
// Half-precision weights (weights_half; and inputs, inputs_half): computed in float32, the
// input gradients written as bits when the inputs are, grad_out read as bits when it is uint16
// (with half-precision inputs), the bias gradients float32, the weights' written as bits when
// given as uint16 (linear_grad), else float32.
// bf16 (precision="bf16", float32, no state): the recomputed forward's projections and
// attention in bf16 as in the forward, the gradient products in float32.
void mha_backward(py::array grad_out, const MhaArgs& a, py::dict grads, py::object state,
                  py::object qk, bool bf16) {
    check_half_codes(a.weights_half, "inputs_half", a.inputs_half);  // before query's dtype
    const auto run = [&](auto tag, bool half) {
        using T = decltype(tag);
        if (bf16 && !std::is_same_v<T, float>)
            throw py::type_error("bf16: bf16 products take float32 operands, got float64 query");
        if (bf16 && !state.is_none())
            throw py::value_error("bf16: the backward recomputes its forward (no state)");
        MhaProblem<T> p = mha_problem<T>(a, state, bf16);
        qk_transform(p, qk);
        p.bf16 = bf16;
        p.state.filled = !state.is_none();
        const std::vector<Index> rows{p.batch * p.n_q, p.w_o.out};
        MhaGrads<T> g;
        const T* gout = nullptr;
        if (half && is_dtype<std::uint16_t>(grad_out)) {
            if (!a.inputs_half)
                throw py::type_error("grad_out: half-precision bits go with inputs_half");
            g.grad_out_half = contiguous<std::uint16_t>(grad_out, "grad_out", rows);
        } else {
            gout = contiguous<T>(grad_out, "grad_out", rows);
        }
        projected_grads<T>(g, grads, p, p.w_q.in, p.w_k.in, a.inputs_half != 0);
        g.w_q = linear_grad(grads, p.w_q, "w_q", "b_q");
        g.w_k = linear_grad(grads, p.w_k, "w_k", "b_k");
        if (!p.qk.q_norm && grads.contains("q_norm"))
            throw py::value_error("grads['q_norm']: the call has no q_norm");
        if (!p.qk.k_norm && grads.contains("k_norm"))
            throw py::value_error("grads['k_norm']: the call has no k_norm");
        g.q_norm = grad_buffer<T>(grads, "q_norm", {p.d_head});
        g.k_norm = grad_buffer<T>(grads, "k_norm", {p.d_head});
        ReleaseGil release;
        kernels_for<T>().multi_head_attention_backward(p, gout, g);
        return 0;
    };
    if (a.weights_half != 0) {
        run(float{}, true);
        return;
    }
    dispatch(a.query, "query", [&](auto tag) { return run(tag, false); });
}

// y = x w + b over all rows (the bench's GEMM peak and projection timings; latent attention's
// projections). w_half 1 / 2: w given as float16 / bfloat16 bits (uint16), x, b, y float32
// (or x, y such bits with x_half, y_half), with float32 or bf16 products.
void linear_forward(py::array x, py::array w, py::object b, py::array y, bool bf16, int w_half,
                    bool x_half, bool y_half, py::object packed) {
    if (!packed.is_none() && (bf16 || w_half))
        throw py::value_error("packed: only with float weights and float products");
    if ((x_half || y_half) && w_half == 0)
        throw py::value_error("x_half, y_half: only with w_half 1 (float16) or 2 (bfloat16)");
    if (w_half != 0) {
        using Bits = std::uint16_t;
        if (w_half != 1 && w_half != 2)
            throw py::value_error("w_half: expected 0, 1 (float16) or 2 (bfloat16), got " +
                                  std::to_string(w_half));
        if (x.ndim() != 2 || w.ndim() != 2) throw py::value_error("x, w: expected 2-d arrays");
        const Index rows = x.shape(0), in = x.shape(1), out = w.shape(1);
        const float* px = x_half ? nullptr : contiguous<float>(x, "x", {rows, in});
        const Bits* px16 = x_half ? contiguous<Bits>(x, "x", {rows, in}) : nullptr;
        const auto* pw = contiguous<Bits>(w, "w", {in, out});
        const float* pb = optional_vector<float>(b, "b", out);
        float* py_ = y_half ? nullptr : contiguous<float>(y, "y", {rows, out}, true);
        Bits* py16 = y_half ? contiguous<Bits>(y, "y", {rows, out}, true) : nullptr;
        ReleaseGil release;
        (bf16 ? kernels().linear_bf16_half_weights : kernels().linear_half_weights)(
            rows, in, out, px, px16, in, pw, static_cast<HalfFormat>(w_half), pb, py_, py16, out);
        return;
    }
    dispatch(x, "x", [&](auto tag) {
        using T = decltype(tag);
        if (bf16 && !std::is_same_v<T, float>)
            throw py::type_error("x: bf16 products take float32 arrays, got float64");
        if (x.ndim() != 2 || w.ndim() != 2) throw py::value_error("x, w: expected 2-d arrays");
        const Index rows = x.shape(0), in = x.shape(1), out = w.shape(1);
        const T* px = contiguous<T>(x, "x", {rows, in});
        const T* pw = contiguous<T>(w, "w", {in, out});
        const T* pb = optional_vector<T>(b, "b", out);
        T* py_ = contiguous<T>(y, "y", {rows, out}, true);
        const T* pp = packed_panels<T>(packed, "packed", in, out);
        ReleaseGil release;
        if constexpr (std::is_same_v<T, float>) {
            if (bf16) {
                kernels().linear_bf16(rows, in, out, px, in, pw, pb, py_, out);
                return 0;
            }
        }
        kernels_for<T>().linear(rows, in, out, px, in, pw, pb, py_, out, /*accumulate=*/false, pp);
        return 0;
    });
}

// w's whole column panels (w: (in, out), float32 or float64) in the layout this build's linear
// reads (a 1-d array of w's dtype; empty when out is narrower than a panel).
py::array pack_weight(py::array w) {
    return dispatch(w, "w", [&](auto tag) -> py::array {
        using T = decltype(tag);
        if (w.ndim() != 2) throw py::value_error("w: expected a 2-d array");
        const Index in = w.shape(0), out = w.shape(1);
        const T* pw = contiguous<T>(w, "w", {in, out});
        const KernelSet<T>& k = kernels_for<T>();
        py::array_t<T> packed = aligned_array<T>(k.packed_weight_size(in, out));
        T* dst = packed.mutable_data();
        ReleaseGil release;
        k.pack_weight(in, out, pw, dst);
        return std::move(packed);
    });
}

// w (in, out; float32) as the bf16 tiles precision="bf16" products read (Linear::tiles): a 1-d
// uint16 array, or None where those products run emulated (they then read w itself).
py::object pack_bf16_tiles(py::array w) {
    if (w.ndim() != 2) throw py::value_error("w: expected a 2-d array");
    const Index in = w.shape(0), out = w.shape(1);
    const float* pw = contiguous<float>(w, "w", {in, out});
    const Index size = kernels().bf16_tiles_size(in, out);
    if (size == 0) return py::none();
    py::array_t<std::uint16_t> tiles = aligned_array<std::uint16_t>(size);
    std::uint16_t* dst = tiles.mutable_data();
    ReleaseGil release;
    kernels().pack_bf16_tiles(in, out, pw, dst);
    return std::move(tiles);
}

}  // namespace

// The gradients of y = x w + b for dy (2-d arrays of one float dtype): dx = dy w^T (added to
// dx when accumulate), dw = x^T dy, db = column sums of dy; each output None when not wanted;
// x and dx may have row strides of their own (latent attention's backward: no copies). With
// half 1 / 2, computed in float32, any of x, w, dy given as uint16 read as float16 / bfloat16
// bits (widened as the products read them), and a uint16 dw written as such bits (rounded as
// its tasks write it; dx and db float32).
void linear_backward(py::array x, py::array w, py::array dy, py::object dx, py::object dw,
                     py::object db, bool accumulate, int half) {
    if (half < 0 || half > 2)
        throw py::value_error("half: expected 0, 1 (float16) or 2 (bfloat16), got " +
                              std::to_string(half));
    const auto run = [&](auto tag) {
        using T = decltype(tag);
        using Bits = std::uint16_t;
        if (x.ndim() != 2 || w.ndim() != 2 || dy.ndim() != 2)
            throw py::value_error("x, w, dy: expected 2-d arrays");
        const Index rows = dy.shape(0), out = dy.shape(1), in = w.shape(0);
        // with `half`, each of x, w, dy given as uint16 is read as bits of that format
        const bool x16 = half && is_dtype<Bits>(x), w16 = half && is_dtype<Bits>(w);
        const bool dy16 = half && is_dtype<Bits>(dy);
        const T* pdy = dy16 ? nullptr : contiguous<T>(dy, "dy", {rows, out});
        const Bits* pdy16 = dy16 ? contiguous<Bits>(dy, "dy", {rows, out}) : nullptr;
        const void* px = nullptr;
        Index ldx = in;
        if (!dw.is_none()) {
            const auto st = x16 ? check<Bits>(x, "x", {rows, in}) : check<T>(x, "x", {rows, in});
            px = x.data();
            ldx = rows > 1 ? st[0] : in;
            if (ldx < in) throw py::value_error("x: rows overlap (row stride below in)");
        }
        const void* pw = nullptr;
        if (!dx.is_none())
            pw = w16 ? static_cast<const void*>(contiguous<Bits>(w, "w", {in, out}))
                     : static_cast<const void*>(contiguous<T>(w, "w", {in, out}));
        // with `half`, a uint16 dw is written as bits of that format (rounded as it is written)
        const bool dw16 = half && !dw.is_none() && is_dtype<Bits>(dw.cast<py::array>());
        T* pdw = dw.is_none() || dw16 ? nullptr
                                      : contiguous<T>(dw.cast<py::array>(), "dw", {in, out}, true);
        Bits* pdw16 =
            dw16 ? contiguous<Bits>(dw.cast<py::array>(), "dw", {in, out}, true) : nullptr;
        T* pdb = db.is_none() ? nullptr : contiguous<T>(db.cast<py::array>(), "db", {out}, true);
        T* pdx = nullptr;
        Index lddx = in;
        if (!dx.is_none()) {
            py::array a = dx.cast<py::array>();
            const auto st = check<T>(a, "dx", {rows, in}, true);
            pdx = static_cast<T*>(a.mutable_data());
            lddx = rows > 1 ? st[0] : in;
            if (lddx < in) throw py::value_error("dx: rows overlap (row stride below in)");
        }
        ReleaseGil release;
        if constexpr (std::is_same_v<T, float>) {
            if (half) {
                kernels().linear_half_grads(
                    rows, in, out, x16 ? nullptr : static_cast<const float*>(px),
                    x16 ? static_cast<const Bits*>(px) : nullptr, ldx,
                    w16 ? nullptr : static_cast<const float*>(pw),
                    w16 ? static_cast<const Bits*>(pw) : nullptr, pdy, pdy16,
                    static_cast<HalfFormat>(half), pdx, lddx, accumulate, pdw, pdw16, pdb);
                return 0;
            }
        }
        const KernelSet<T>& k = kernels_for<T>();
        const T* xt = static_cast<const T*>(px);
        if (pdw || pdb) k.linear_weight_grad(rows, in, out, xt, ldx, pdy, out, pdw, pdb);
        if (pdx)
            k.linear_input_grad(rows, in, out, pdy, out, static_cast<const T*>(pw), pdx, lddx,
                                accumulate);
        return 0;
    };
    if (half) {  // computed in float32
        run(float{});
        return;
    }
    dispatch(dy, "dy", run);
}

void bind_mha(py::module_& m) {
    m.def("sdpa_forward", &sdpa_forward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
          py::arg("mask"), py::arg("scale"), py::arg("weights"), py::arg("lse"),
          py::arg("bf16") = false);
    m.def("sdpa_forward_half", &sdpa_forward_half, py::arg("q"), py::arg("k"), py::arg("v"),
          py::arg("half"), py::arg("out"), py::arg("mask"), py::arg("scale"), py::arg("lse"),
          py::arg("weights") = py::none(), py::arg("bf16") = false);
    m.def("sdpa_backward", &sdpa_backward, py::arg("grad_out"), py::arg("q"), py::arg("k"),
          py::arg("v"), py::arg("mask"), py::arg("scale"), py::arg("out"), py::arg("lse"),
          py::arg("d_q"), py::arg("d_k"), py::arg("d_v"), py::arg("recompute") = true,
          py::arg("d_mask") = py::none(), py::arg("d_sinks") = py::none(), py::arg("bf16") = false);
    m.def("sdpa_backward_half", &sdpa_backward_half, py::arg("grad_out"), py::arg("q"),
          py::arg("k"), py::arg("v"), py::arg("half"), py::arg("mask"), py::arg("scale"),
          py::arg("out"), py::arg("lse"), py::arg("d_q"), py::arg("d_k"), py::arg("d_v"),
          py::arg("grad_out_half"), py::arg("recompute") = true, py::arg("d_mask") = py::none(),
          py::arg("d_sinks") = py::none(), py::arg("bf16") = false);
    m.def("merge_parts", &merge_parts, py::arg("parts"), py::arg("half"), py::arg("frac"),
          py::arg("out"));
    bind_args<MhaArgs>(m, "MhaArgs");
    bind_args<QkArgs>(m, "QkArgs");
    m.def("mha_bf16_fused_calls", [] { return mha_bf16_fused_calls.load(); });
    m.def("attention_copied_calls", [] { return attention_copied_calls.load(); });
    m.def("mha_forward", &mha_forward, py::arg("args"), py::arg("out"), py::arg("weights"),
          py::arg("state") = py::none(), py::arg("bf16") = false, py::arg("qk") = py::none());
    m.def("mha_backward", &mha_backward, py::arg("grad_out"), py::arg("args"), py::arg("grads"),
          py::arg("state") = py::none(), py::arg("qk") = py::none(), py::arg("bf16") = false);
    m.def("linear_backward", &linear_backward, py::arg("x"), py::arg("w"), py::arg("dy"),
          py::arg("dx"), py::arg("dw"), py::arg("db"), py::arg("accumulate") = false,
          py::arg("half") = 0);
    m.def("linear_forward", &linear_forward, py::arg("x"), py::arg("w"), py::arg("b"), py::arg("y"),
          py::arg("bf16") = false, py::arg("w_half") = 0, py::arg("x_half") = false,
          py::arg("y_half") = false, py::arg("packed") = py::none());
    m.def("pack_weight", &pack_weight, py::arg("w"));
    m.def("pack_bf16_tiles", &pack_bf16_tiles, py::arg("w"));
}

}  // namespace bind
}  // namespace attnlab

#pragma once
// Raw-buffer checks shared by the bindings. The Python layer validates user input and prepares
// arrays; these checks are a second line of defence so that nothing can reach the kernels with
// a shape, dtype or stride that would read out of bounds.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "attnlab/common.hpp"
#include "attnlab/kernels.hpp"

namespace attnlab {
namespace bind {

namespace py = pybind11;

inline std::string shape_str(const py::array& a) {
    std::string s = "(";
    for (py::ssize_t i = 0; i < a.ndim(); ++i) {
        if (i) s += ", ";
        s += std::to_string(a.shape(i));
    }
    if (a.ndim() == 1) s += ",";
    return s + ")";
}

// A shape or the element strides of an array of up to 4 axes, held in place: the checks of
// a call allocate nothing (a std::vector each was a heap allocation and a free per array).
class Dims {
  public:
    static constexpr std::size_t kMax = 4;
    Dims(std::initializer_list<Index> l) : n_(l.size()) {
        if (n_ > kMax) throw std::logic_error("attnlab::bind::Dims: more than 4 axes");
        std::copy(l.begin(), l.end(), v_.begin());
    }
    Dims(const std::vector<Index>& s) : n_(s.size()) {  // NOLINT: the pooled families' shapes
        if (n_ > kMax) throw std::logic_error("attnlab::bind::Dims: more than 4 axes");
        std::copy(s.begin(), s.end(), v_.begin());
    }
    explicit Dims(std::size_t n) : n_(n) {  // n zeros
        if (n_ > kMax) throw std::logic_error("attnlab::bind::Dims: more than 4 axes");
    }
    Index operator[](std::size_t i) const { return v_[i]; }
    Index& operator[](std::size_t i) { return v_[i]; }
    std::size_t size() const { return n_; }
    bool empty() const { return n_ == 0; }
    Index back() const { return v_[n_ - 1]; }

  private:
    std::array<Index, kMax> v_{};
    std::size_t n_;
};

template <typename T>
bool is_dtype(const py::array& a) {
    return py::dtype::of<T>().is(a.dtype()) || a.dtype().equal(py::dtype::of<T>());
}

// Checks ndim, dtype (T, or bool when boolean), expected shape (-1 = any) and that strides are
// whole elements with a unit last stride; returns element strides.
template <typename T>
Dims check(const py::array& a, const char* name, const Dims& shape, bool writable = false,
           bool boolean = false, bool unit_last = true) {
    if (a.ndim() != static_cast<py::ssize_t>(shape.size()))
        throw py::value_error(std::string(name) + ": expected " + std::to_string(shape.size()) +
                              " dimensions, got shape " + shape_str(a));
    if (boolean ? a.dtype().kind() != 'b' : !is_dtype<T>(a))
        throw py::type_error(std::string(name) + ": unexpected dtype " +
                             std::string(py::str(a.dtype())));
    const Index item = static_cast<Index>(a.itemsize());
    Dims strides(shape.size());
    for (std::size_t i = 0; i < shape.size(); ++i) {
        if (shape[i] >= 0 && a.shape(i) != shape[i])
            throw py::value_error(std::string(name) + ": shape " + shape_str(a) +
                                  " does not match the other arguments");
        if (a.shape(i) <= 1) {  // never stepped along: NumPy leaves any stride there
            strides[i] = 0;
            continue;
        }
        if (a.strides(i) % item != 0)
            throw py::value_error(std::string(name) + ": strides are not whole elements");
        strides[i] = a.strides(i) / item;
        if (strides[i] < 0) throw py::value_error(std::string(name) + ": negative strides");
    }
    if (a.size() == 0) return Dims(shape.size());  // nothing will be read
    // Reading a T at an address that is not a multiple of its alignment is undefined.
    if (reinterpret_cast<std::uintptr_t>(a.data()) % (boolean ? 1 : alignof(T)) != 0)
        throw py::value_error(std::string(name) + ": data is not aligned");
    if (unit_last && !shape.empty() && a.shape(shape.size() - 1) > 1 && strides.back() != 1)
        throw py::value_error(std::string(name) + ": last axis must be contiguous");
    if (writable && !a.writeable()) throw py::value_error(std::string(name) + ": not writable");
    return strides;
}

// A C-contiguous array of dtype T and the given shape (for outputs and packed inputs).
template <typename T>
T* contiguous(const py::array& a, const char* name, const Dims& shape, bool writable = false) {
    check<T>(a, name, shape, writable);
    if (!(a.flags() & py::array::c_style))
        throw py::value_error(std::string(name) + ": must be C-contiguous");
    return static_cast<T*>(const_cast<void*>(a.data()));
}

// A 1-d array of n elements whose data starts on a 64-byte boundary (a view into a slightly
// longer one): packed weights are read by whole-cache-line vector and tile loads, which NumPy's
// 16-byte alignment would split across two lines.
template <typename T>
py::array_t<T> aligned_array(Index n) {
    constexpr Index extra = 64 / sizeof(T);
    py::array_t<T> base(static_cast<py::ssize_t>(n + extra));
    const auto at = reinterpret_cast<std::uintptr_t>(base.data());
    const auto skip = static_cast<Index>((64 - at % 64) % 64 / sizeof(T));
    return py::array_t<T>({static_cast<py::ssize_t>(n)}, {static_cast<py::ssize_t>(sizeof(T))},
                          base.mutable_data() + skip, base);
}

template <typename T>
const T* optional_vector(const py::object& o, const char* name, Index n) {
    if (o.is_none()) return nullptr;
    return contiguous<T>(o.cast<py::array>(), name, {n});
}

// A buffer of attnlab.vjp's state dict (an ndarray the caller owns, written by the forward and
// read by the backward); null when there is no state.
template <typename T>
T* state_array(const py::object& state, const char* name, const Dims& shape) {
    if (state.is_none()) return nullptr;
    const py::dict d = state.cast<py::dict>();
    if (!d.contains(name)) throw py::value_error(std::string("state: missing '") + name + "'");
    const py::object o = d[name];
    if (!py::isinstance<py::array>(o))
        throw py::type_error(std::string("state['") + name + "']: expected an ndarray");
    return contiguous<T>(o.cast<py::array>(), name, shape, true);
}

// The mask options of scaled dot-product, multi-head and bilinear attention: a boolean or
// float mask viewed as (batch, heads, n_q, n_k) (zero strides broadcast), a boolean key padding
// mask (batch, n_k) and the scalar options (MaskOptions: causal, ...). Every binding that masks
// takes them as one argument, `mask`, which mask_args converts. A new scalar option changes
// nothing here (mask_args reads MaskOptions' fields through for_each_option); a new array is
// a field here, its reading in mask_args and its check in mask_spec.
struct MaskArgs {
    py::object mask;
    py::object key_padding_mask;
    MaskOptions options;
    py::object alibi_slopes;  // (batch, heads) or None
    py::object sinks;         // (batch, heads) or None
    py::tuple given;          // the tuple as passed (the `mask` attribute of MhaArgs, ...)
};

// The number of items of Python's mask tuple and, for errors, their names:
// "(mask, key_padding_mask, causal, ...)".
inline std::size_t mask_items() {
    std::size_t n = 4;
    MaskOptions o;
    for_each_option(o, [&](const char*, auto&, auto, auto) { ++n; });
    return n;
}
inline std::string mask_fields() {
    std::string s = "(mask, key_padding_mask";
    MaskOptions o;
    for_each_option(o, [&](const char* name, auto&, auto, auto) { s += std::string(", ") + name; });
    return s + ", alibi_slopes, sinks)";
}

// An item of the mask tuple for the scalar option `name`: an int in [min, max].
inline Index option_value(py::handle v, const char* name, Index min, Index max) {
    const auto out_of_range = [&](const std::string& got) {
        return py::value_error(std::string(name) + ": expected an int from " + std::to_string(min) +
                               " to " + std::to_string(max) + ", got " + got);
    };
    long long x = 0;
    try {
        x = v.cast<long long>();
    } catch (const py::cast_error&) {
        if (py::isinstance<py::int_>(v)) throw out_of_range(std::string(py::str(v)));  // > 64 bits
        throw py::type_error(std::string(name) + ": expected an int, got " +
                             std::string(py::str(py::type::of(v).attr("__name__"))));
    }
    if (x < min || x > max) throw out_of_range(std::to_string(x));
    return static_cast<Index>(x);
}

// An item of the mask tuple for the real scalar option `name`: a float in [min, max].
inline double option_value(py::handle v, const char* name, double min, double max) {
    double x = 0;
    try {
        x = v.cast<double>();
    } catch (const py::cast_error&) {
        throw py::type_error(std::string(name) + ": expected a float, got " +
                             std::string(py::str(py::type::of(v).attr("__name__"))));
    }
    if (!(x >= min && x <= max))
        throw py::value_error(std::string(name) + ": expected a float from " + std::to_string(min) +
                              " to " + std::to_string(max) + ", got " + std::to_string(x));
    return x;
}

// The one place Python's mask argument becomes MaskArgs: the tuple (mask, key_padding_mask,
// <MaskOptions' fields>) that attnlab._args.Masks.core_mask builds. Its arrays are checked in
// mask_spec, against the sizes of the call.
inline MaskArgs mask_args(py::handle o) {
    if (!py::isinstance<py::tuple>(o))
        throw py::type_error("mask: expected a tuple " + mask_fields() + ", got " +
                             std::string(py::str(py::type::of(o).attr("__name__"))));
    const auto t = py::reinterpret_borrow<py::tuple>(o);
    if (t.size() != mask_items())
        throw py::value_error("mask: expected a tuple " + mask_fields() + ", got " +
                              std::to_string(t.size()) + " items");
    MaskArgs a;
    a.mask = t[0];
    a.key_padding_mask = t[1];
    std::size_t k = 2;
    for_each_option(a.options, [&](const char* name, auto& field, auto min, auto max) {
        using Field = std::remove_reference_t<decltype(field)>;
        if constexpr (std::is_floating_point_v<Field>) {
            field = option_value(t[k++], name, double(min), double(max));
        } else {
            field = static_cast<Field>(option_value(t[k++], name, Index(min), Index(max)));
        }
    });
    a.alibi_slopes = t[k++];
    a.sinks = t[k++];
    a.given = t;
    return a;
}

// A boolean (batch, n) token mask, or none.
inline TokenMask token_mask(const py::object& kpm, Index batch, Index n) {
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

// The one place Python's mask arguments become the kernels' MaskSpec (all families).
template <typename T>
MaskSpec<T> mask_spec(const MaskArgs& args, Index batch, Index heads, Index n_q, Index n_k) {
    MaskSpec<T> m;
    m.options = args.options;  // checked by mask_args
    if (!args.mask.is_none()) {
        py::array a = args.mask.cast<py::array>();
        const bool boolean = a.dtype().kind() == 'b';
        auto st = check<T>(a, "mask", {batch, heads, n_q, n_k}, false, boolean, false);
        m.kind = boolean ? MaskKind::boolean : MaskKind::additive;
        if (boolean) {
            m.boolean = static_cast<const std::uint8_t*>(a.data());
        } else {
            m.additive = static_cast<const T*>(a.data());
        }
        m.sb = st[0];
        m.sh = st[1];
        m.sq = st[2];
        m.sk = st[3];
    }
    m.key_padding = token_mask(args.key_padding_mask, batch, n_k);
    // the per-(batch, head) arrays, broadcast along either axis (stride 0)
    const auto per_head = [&](const py::object& arg, const char* name, const T*& data, Index& sb,
                              Index& sh) {
        if (arg.is_none()) return;
        py::array a = arg.cast<py::array>();
        auto st = check<T>(a, name, {batch, heads}, false, false, false);
        data = static_cast<const T*>(a.data());
        sb = st[0];
        sh = st[1];
    };
    per_head(args.alibi_slopes, "alibi_slopes", m.alibi, m.alibi_sb, m.alibi_sh);
    per_head(args.sinks, "sinks", m.sinks, m.sinks_sb, m.sinks_sh);
    return m;
}

// The half-precision codes of a projected family's arguments: weights_half 0 (the inputs'
// dtype), 1 (float16) or 2 (bfloat16) bits; `flag` (named `name`: which further arrays are bits
// of that format) 0, or 1 with half-precision weights.
inline void check_half_codes(int weights_half, const char* name, int flag) {
    if (weights_half < 0 || weights_half > 2)
        throw py::value_error("weights_half: expected 0, 1 (float16) or 2 (bfloat16), got " +
                              std::to_string(weights_half));
    if (flag != 0 && (flag != 1 || weights_half == 0))
        throw py::value_error(std::string(name) +
                              ": expected 0, or 1 with the weights in half precision "
                              "(weights_half 1 or 2), got " +
                              std::to_string(flag) + " with weights_half " +
                              std::to_string(weights_half));
}

// A dense layer's checked weight (in, out) and optional bias (out); with `half`, the weight as
// the uint16 bits of that format (float only).
template <typename T>
Linear<T> linear_arg(const py::array& w, const py::object& b, const char* wname, const char* bname,
                     Index in, Index out, HalfFormat half = HalfFormat::none) {
    Linear<T> l;
    if (half != HalfFormat::none) {
        if (!std::is_same_v<T, float>)
            throw py::type_error(std::string(wname) + ": half-precision weights go with float32");
        l.w_half = contiguous<std::uint16_t>(w, wname, {in, out});
        l.half = half;
    } else {
        l.w = contiguous<T>(w, wname, {in, out});
    }
    l.b = optional_vector<T>(b, bname, out);
    l.in = in;
    l.out = out;
    return l;
}

// The gradient buffer grads[name] (allocated by Python, shaped like the argument), or null when
// that gradient is not wanted.
template <typename T>
T* grad_buffer(const py::dict& grads, const char* name, const Dims& shape) {
    if (!grads.contains(name)) return nullptr;
    py::object o = grads[name];
    // an array owned by the dict: a converted temporary would be written and lost
    if (!py::isinstance<py::array>(o))
        throw py::type_error(std::string(name) + ": gradient output must be an ndarray");
    return contiguous<T>(o.cast<py::array>(), name, shape, true);
}

// The gradient buffers of a dense layer's weight and bias (either null when not wanted).
template <typename T>
LinearGrad<T> linear_grad(const py::dict& grads, const Linear<T>& l, const char* wname,
                          const char* bname) {
    LinearGrad<T> g;
    // a half-precision weight's gradient may be its format's bits, rounded as it is written
    const py::object w = grads.contains(wname) ? py::object(grads[wname]) : py::none();
    if (l.half != HalfFormat::none && py::isinstance<py::array>(w) &&
        is_dtype<std::uint16_t>(w.cast<py::array>()))
        g.w_half = grad_buffer<std::uint16_t>(grads, wname, {l.in, l.out});
    else
        g.w = grad_buffer<T>(grads, wname, {l.in, l.out});
    g.b = grad_buffer<T>(grads, bname, {l.out});
    return g;
}

// Calls f.template operator()<float>() or <double>() by the dtype of `a`.
template <typename F>
auto dispatch(const py::array& a, const char* name, F&& f) {
    if (is_dtype<float>(a)) return f(float{});
    if (is_dtype<double>(a)) return f(double{});
    throw py::type_error(std::string(name) + ": expected float32 or float64, got " +
                         std::string(py::str(a.dtype())));
}

// An array field of a bound argument object: null until bind_args sets it (py::array's own
// default constructor allocates an empty array, which every call would make for nothing).
struct Array : py::array {
    Array() : py::array(py::handle(), borrowed_t{}) {}
    Array(py::handle h, borrowed_t) : py::array(h, borrowed_t{}) {}
    Array(py::handle h, stolen_t) : py::array(h, stolen_t{}) {}
};

// A field of a bound argument object (bind_args): its Python name and the member it fills.
template <typename C, typename M>
struct Field {
    const char* name;
    M C::*member;
};
template <typename C, typename M>
constexpr Field<C, M> field(const char* name, M C::*member) {
    return {name, member};
}

// --- Multi-head and bilinear attention: the fields their argument objects (MhaArgs,
// BilinearArgs, derived from this) share after the inputs and the query-key weights.
struct SharedArgs {
    Array w_v;
    py::object b_v;
    Array w_o;
    py::object b_o;
    Index batch, n_q, n_k, heads, kv_heads;
    MaskArgs mask;
    double scale;

    static constexpr auto fields() {
        return std::make_tuple(field("w_v", &SharedArgs::w_v), field("b_v", &SharedArgs::b_v),
                               field("w_o", &SharedArgs::w_o), field("b_o", &SharedArgs::b_o),
                               field("batch", &SharedArgs::batch), field("n_q", &SharedArgs::n_q),
                               field("n_k", &SharedArgs::n_k), field("heads", &SharedArgs::heads),
                               field("kv_heads", &SharedArgs::kv_heads),
                               field("mask", &SharedArgs::mask),
                               field("scale", &SharedArgs::scale));
    }
};

// The fields of MhaProblem and BilinearProblem filled from their common arguments, checked in
// argument order by both builders (Problem: MhaProblem or BilinearProblem).

// Sizes and the three inputs (Args: MhaArgs or BilinearArgs), rows of widths d_q, d_k, d_v;
// with `half`, as the bits of a half format (their float pointers stay null).
template <typename T, typename Problem, typename Args>
void projected_inputs(Problem& p, const Args& a, Index d_q, Index d_k, Index d_v,
                      bool half = false) {
    const SharedArgs& s = a;
    p.batch = s.batch;
    p.n_q = s.n_q;
    p.n_k = s.n_k;
    p.heads = s.heads;
    p.kv_heads = s.kv_heads;
    const Dims q{s.batch * s.n_q, d_q}, k{s.batch * s.n_k, d_k}, v{s.batch * s.n_k, d_v};
    if (half) {
        p.query_half = contiguous<std::uint16_t>(a.query, "query", q);
        p.key_half = contiguous<std::uint16_t>(a.key, "key", k);
        p.value_half = contiguous<std::uint16_t>(a.value, "value", v);
        return;
    }
    p.query = contiguous<T>(a.query, "query", q);
    p.key = contiguous<T>(a.key, "key", k);
    p.value = contiguous<T>(a.value, "value", v);
}

// The value and output projections, the scale, the mask and vjp's buffers both keep (values,
// attention output, log-sum-exp; none without a state dict).
template <typename T, typename Problem>
void projected_values(Problem& p, const SharedArgs& s, Index d_vhead, const py::object& state,
                      HalfFormat half = HalfFormat::none) {
    p.d_vhead = d_vhead;
    p.w_v = linear_arg<T>(s.w_v, s.b_v, "w_v", "b_v", s.w_v.shape(0), s.kv_heads * d_vhead, half);
    p.w_o = linear_arg<T>(s.w_o, s.b_o, "w_o", "b_o", s.heads * d_vhead, s.w_o.shape(1), half);
    p.scale = static_cast<T>(s.scale);
    p.mask = mask_spec<T>(s.mask, s.batch, s.heads, s.n_q, s.n_k);
    p.state.v = state_array<T>(state, "v", {s.batch * s.n_k, p.w_v.out});
    p.state.ctx = state_array<T>(state, "ctx", {s.batch * s.n_q, p.w_o.in});
    p.state.lse = state_array<T>(state, "lse", {s.batch, s.heads, s.n_q});
}

// The forward's outputs: out (batch * n_q, d_out) and, when given, the weights; out as the
// bits of a half format instead when U is std::uint16_t (the forwards of half arrays), and
// the weights too when given so.
template <typename T, typename Problem, typename U = T>
void projected_outputs(Problem& p, const py::array& out, const py::object& weights) {
    U* o = contiguous<U>(out, "out", {p.batch * p.n_q, p.w_o.out}, true);
    if constexpr (std::is_same_v<U, T>) {
        p.out = o;
    } else {
        p.out_half = o;
    }
    if (weights.is_none()) return;
    const py::array w = weights.cast<py::array>();
    const Dims shape{p.batch, p.heads, p.n_q, p.n_k};
    if constexpr (!std::is_same_v<U, T>) {  // the weights as bits too, or float (their mean)
        if (is_dtype<U>(w)) {
            p.weights_half = contiguous<U>(w, "weights", shape, true);
            return;
        }
    }
    p.weights = contiguous<T>(w, "weights", shape, true);
}

// The backward's gradient buffers of the three inputs (as half-precision bits, uint16, when
// inputs_half) and of the value and output layers.
template <typename T, typename Problem, typename Grads>
void projected_grads(Grads& g, const py::dict& grads, const Problem& p, Index d_q, Index d_k,
                     bool inputs_half = false) {
    const auto input = [&](T*& out, std::uint16_t*& bits, const char* name, const Dims& shape) {
        if (inputs_half)
            bits = grad_buffer<std::uint16_t>(grads, name, shape);
        else
            out = grad_buffer<T>(grads, name, shape);
    };
    input(g.query, g.query_half, "query", {p.batch * p.n_q, d_q});
    input(g.key, g.key_half, "key", {p.batch * p.n_k, d_k});
    input(g.value, g.value_half, "value", {p.batch * p.n_k, p.w_v.in});
    g.w_v = linear_grad(grads, p.w_v, "w_v", "b_v");
    g.w_o = linear_grad(grads, p.w_o, "w_o", "b_o");
    g.mask = grad_buffer<T>(grads, "mask", {p.batch, p.heads, p.n_q, p.n_k});
    g.sinks = grad_buffer<T>(grads, "sinks", {p.batch, p.heads});
}

// The kernels of the table chosen at import (attnlab::kernels()) for element type T: the
// bindings are compiled once and never see a particular instruction-set build.
template <typename T>
const KernelSet<T>& kernels_for() {
    return kernels().get<T>();
}

// Sets the field f of `a` to `value`: an array, any object (an optional array, checked where
// it is read), an int, a float or the mask tuple (its caster's errors).
template <typename Args, typename C, typename M>
void set_field(Args& a, const Field<C, M>& f, py::handle value, const char* type) {
    using Cast = std::conditional_t<std::is_same_v<M, Array>, py::array, M>;
    py::detail::make_caster<Cast> caster;
    if (!caster.load(value, true)) {
        const char* expected = std::is_same_v<Cast, py::array> ? "an ndarray"
                               : std::is_floating_point_v<M>   ? "a float"
                                                               : "an int";
        throw py::type_error(std::string(type) + "." + f.name + ": expected " + expected +
                             ", got " + std::string(py::str(py::type::of(value).attr("__name__"))));
    }
    if constexpr (std::is_same_v<M, Array>) {
        a.*f.member = py::reinterpret_borrow<Array>(value);
    } else {
        a.*f.member = py::detail::cast_op<M>(caster);
    }
}

// Sets the field number i of Args::fields() (i < its count) to `value`.
template <typename Args, typename Fields>
void set_field_at(Args& a, const Fields& fields, std::size_t i, py::handle value,
                  const char* type) {
    std::apply(
        [&](const auto&... f) {
            std::size_t j = 0;
            ((j++ == i ? set_field(a, f, value, type) : void()), ...);
        },
        fields);
}

// A family's arguments as one Python object, core.<type>(field=..., ...): every field by
// keyword and no other, each a read-only attribute. Args::fields() lists them once, each as
// field(name, &Args::member); C++ reads them by name.
template <typename Args>
void bind_args(py::module_& m, const char* type) {
    constexpr auto fields = Args::fields();
    constexpr std::size_t n = std::tuple_size_v<decltype(fields)>;
    // The names as interned str: the keywords of a call written in Python are interned too, so
    // a keyword is found by its address, first at the place after the previous one (callers
    // pass them in the order of fields()), by its text only when neither finds it.
    static std::array<PyObject*, n> names{};
    std::size_t k = 0;
    std::apply([&](const auto&... f) { ((names[k++] = PyUnicode_InternFromString(f.name)), ...); },
               fields);
    for (PyObject* name : names)
        if (!name) throw py::error_already_set();
    const auto find = [](PyObject* key, std::size_t guess) -> std::size_t {
        if (guess < n && names[guess] == key) return guess;
        for (std::size_t i = 0; i < n; ++i)
            if (names[i] == key) return i;
        for (std::size_t i = 0; i < n; ++i) {
            const int cmp = PyUnicode_Compare(key, names[i]);
            if (cmp == 0) return i;
            if (cmp == -1 && PyErr_Occurred()) throw py::error_already_set();
        }
        return n;
    };
    py::class_<Args> c(m, type);
    c.def(py::init([type, find](const py::kwargs& kw) {
        constexpr auto fields = Args::fields();
        Args a;
        std::size_t next = 0;
        for (const auto& [key, value] : kw) {
            const std::size_t i = find(key.ptr(), next);
            if (i == n) {
                const char* name = PyUnicode_AsUTF8(key.ptr());  // keywords are str
                if (!name) throw py::error_already_set();
                throw py::type_error(std::string(type) + ": unexpected keyword argument '" + name +
                                     "'");
            }
            set_field_at(a, fields, i, value, type);
            next = i + 1;
        }
        if (kw.size() != n) {  // each key set one field
            std::apply(
                [&](const auto&... f) {
                    ((kw.contains(f.name)
                          ? void()
                          : throw py::type_error(std::string(type) +
                                                 ": missing keyword argument '" + f.name + "'")),
                     ...);
                },
                fields);
        }
        return a;
    }));
    std::apply([&](const auto&... f) { (c.def_readonly(f.name, f.member), ...); }, Args::fields());
}

}  // namespace bind
}  // namespace attnlab

namespace pybind11 {
namespace detail {
template <>
struct handle_type_name<attnlab::bind::Array> {
    static constexpr auto name = const_name("numpy.ndarray");
};
// MaskArgs as the type of a binding's argument: pybind11 finds its caster here, the conversion
// is mask_args. (Errors are thrown, not reported as a failed load: pybind11's "incompatible
// function arguments" would not say what is wrong with the mask.)
template <>
struct type_caster<attnlab::bind::MaskArgs> {
    PYBIND11_TYPE_CASTER(attnlab::bind::MaskArgs, const_name("tuple"));
    bool load(handle src, bool) {
        value = attnlab::bind::mask_args(src);
        return true;
    }
    // the attribute `mask` of a bound argument object: the tuple it was built from
    static handle cast(const attnlab::bind::MaskArgs& src, return_value_policy, handle) {
        return src.given.inc_ref();
    }
};
}  // namespace detail
}  // namespace pybind11

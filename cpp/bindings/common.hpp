#pragma once
// Raw-buffer checks shared by the bindings. The Python layer validates user input and prepares
// arrays; these checks are a second line of defence so that nothing can reach the kernels with
// a shape, dtype or stride that would read out of bounds.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "attnlab/common.hpp"
#include "attnlab/gemm.hpp"
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

template <typename T>
bool is_dtype(const py::array& a) {
    return py::dtype::of<T>().is(a.dtype()) || a.dtype().equal(py::dtype::of<T>());
}

// Checks ndim, dtype (T, or bool when boolean), expected shape (-1 = any) and that strides are
// whole elements with a unit last stride; returns element strides.
template <typename T>
std::vector<Index> check(const py::array& a, const char* name, std::vector<Index> shape,
                         bool writable = false, bool boolean = false, bool unit_last = true) {
    if (a.ndim() != static_cast<py::ssize_t>(shape.size()))
        throw py::value_error(std::string(name) + ": expected " + std::to_string(shape.size()) +
                              " dimensions, got shape " + shape_str(a));
    if (boolean ? a.dtype().kind() != 'b' : !is_dtype<T>(a))
        throw py::type_error(std::string(name) + ": unexpected dtype " +
                             std::string(py::str(a.dtype())));
    const Index item = static_cast<Index>(a.itemsize());
    std::vector<Index> strides(shape.size());
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
    if (a.size() == 0) return std::vector<Index>(shape.size(), 0);  // nothing will be read
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
T* contiguous(const py::array& a, const char* name, std::vector<Index> shape,
              bool writable = false) {
    check<T>(a, name, shape, writable);
    if (!(a.flags() & py::array::c_style))
        throw py::value_error(std::string(name) + ": must be C-contiguous");
    return static_cast<T*>(const_cast<void*>(a.data()));
}

template <typename T>
const T* optional_vector(const py::object& o, const char* name, Index n) {
    if (o.is_none()) return nullptr;
    return contiguous<T>(o.cast<py::array>(), name, {n});
}

// A mask viewed as (batch, heads, n_q, n_k), bool or T, possibly with zero (broadcast) strides,
// plus a boolean key padding mask (batch, n_k).
// A buffer of attnlab.vjp's state dict (an ndarray the caller owns, written by the forward and
// read by the backward); null when there is no state.
template <typename T>
T* state_array(const py::object& state, const char* name, std::vector<Index> shape) {
    if (state.is_none()) return nullptr;
    const py::dict d = state.cast<py::dict>();
    if (!d.contains(name)) throw py::value_error(std::string("state: missing '") + name + "'");
    const py::object o = d[name];
    if (!py::isinstance<py::array>(o))
        throw py::type_error(std::string("state['") + name + "']: expected an ndarray");
    return contiguous<T>(o.cast<py::array>(), name, std::move(shape), true);
}

template <typename T>
MaskSpec<T> mask_spec(const py::object& mask, const py::object& key_padding, int causal,
                      Index batch, Index heads, Index n_q, Index n_k) {
    MaskSpec<T> m;
    if (causal < 0 || causal > 2) throw py::value_error("causal: expected 0, 1 or 2");
    m.causal = static_cast<Causal>(causal);
    if (!mask.is_none()) {
        py::array a = mask.cast<py::array>();
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
    if (!key_padding.is_none()) {
        py::array a = key_padding.cast<py::array>();
        auto st = check<T>(a, "key_padding_mask", {batch, n_k}, false, true, false);
        m.key_padding = static_cast<const std::uint8_t*>(a.data());
        m.kp_sb = st[0];
        m.kp_sk = st[1];
    }
    return m;
}

// Calls f.template operator()<float>() or <double>() by the dtype of `a`.
template <typename F>
auto dispatch(const py::array& a, const char* name, F&& f) {
    if (is_dtype<float>(a)) return f(float{});
    if (is_dtype<double>(a)) return f(double{});
    throw py::type_error(std::string(name) + ": expected float32 or float64, got " +
                         std::string(py::str(a.dtype())));
}

// The kernels, called through the table chosen at import (attnlab::kernels()): the bindings
// are compiled once and never see a particular instruction-set build.
template <typename T>
void attention_forward(const AttentionProblem<T>& p) {
    kernels().get<T>().attention_forward(p);
}
template <typename T>
void attention_backward(const AttentionProblem<T>& p, const AttentionGrad<T>& g) {
    kernels().get<T>().attention_backward(p, g);
}
template <typename T>
void multi_head_attention_forward(const MhaProblem<T>& p) {
    kernels().get<T>().multi_head_attention_forward(p);
}
template <typename T>
void multi_head_attention_backward(const MhaProblem<T>& p, const T* grad_out,
                                   const MhaGrads<T>& g) {
    kernels().get<T>().multi_head_attention_backward(p, grad_out, g);
}
template <typename T>
void bilinear_attention_forward(const BilinearProblem<T>& p) {
    kernels().get<T>().bilinear_attention_forward(p);
}
template <typename T>
void bilinear_attention_backward(const BilinearProblem<T>& p, const T* grad_out,
                                 const BilinearGrads<T>& g) {
    kernels().get<T>().bilinear_attention_backward(p, grad_out, g);
}
template <typename T>
void additive_attention_forward(const AdditiveProblem<T>& p) {
    kernels().get<T>().additive_attention_forward(p);
}
template <typename T>
void additive_attention_backward(const AdditiveProblem<T>& p, const T* grad_out,
                                 const AdditiveGrads<T>& g) {
    kernels().get<T>().additive_attention_backward(p, grad_out, g);
}
template <typename T>
void separable_attention_forward(const SeparableProblem<T>& p) {
    kernels().get<T>().separable_attention_forward(p);
}
template <typename T>
void separable_attention_backward(const SeparableProblem<T>& p, const T* grad_out,
                                  const SeparableGrads<T>& g) {
    kernels().get<T>().separable_attention_backward(p, grad_out, g);
}
template <typename T>
void linear(Index rows, Index in, Index out, const T* x, Index ldx, const T* w, const T* b, T* y,
            Index ldy, bool accumulate = false) {
    kernels().get<T>().linear(rows, in, out, x, ldx, w, b, y, ldy, accumulate);
}

}  // namespace bind
}  // namespace attnlab

#pragma once
// What the bindings of the two pooled families (additive.cpp: SwiftFormer's additive attention,
// separable.cpp: MobileViT-v2's separable self-attention) share: the buffer checks of their
// tensor visitors, and their forward and backward and its binding, written once over a Family
// (Additive or Separable) that supplies the family's arguments, problem builder, state,
// gradient buffers and kernels.

#include <string>
#include <utility>
#include <vector>

#include "common.hpp"
#include "interrupt.hpp"

namespace attnlab {
namespace bind {

inline void check_sizes(Index batch, Index n) {
    if (batch < 0 || n < 0) throw py::value_error("negative sizes");
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

// Forward and backward of either family (Family: Additive or Separable, with its Args). state:
// only attnlab.vjp passes it, a dict of buffers the forward fills and the backward then reads.
template <typename Family>
void pooled_forward(const typename Family::Args& a, py::array out, py::object state) {
    dispatch(a.x, "x", [&](auto tag) {
        using T = decltype(tag);
        auto p = Family::template problem<T>(a);
        p.out = contiguous<T>(out, "out", {a.batch * a.n, p.d_out}, true);
        Family::set_state(p, state);
        ReleaseGil release;
        Family::forward(p);
        return 0;
    });
}

// grads: dict of preallocated outputs keyed by argument name (the biases' may be missing).
template <typename Family>
void pooled_backward(py::array grad_out, const typename Family::Args& a, py::dict grads,
                     py::object state) {
    dispatch(a.x, "x", [&](auto tag) {
        using T = decltype(tag);
        auto p = Family::template problem<T>(a);
        Family::set_state(p, state);
        p.state.filled = !state.is_none();
        const T* gout = contiguous<T>(grad_out, "grad_out", {a.batch * a.n, p.d_out});
        const auto g = Family::grad_buffers(a, p, grads);
        ReleaseGil release;
        Family::backward(p, gout, g);
        return 0;
    });
}

// <name>_forward(args, out, state=None), <name>_backward(grad_out, args, grads, state=None)
// and the type of args, Family::Args bound as `type`.
template <typename Family>
void bind_pooled(py::module_& m, const std::string& name, const char* type) {
    bind_args<typename Family::Args>(m, type);
    m.def((name + "_forward").c_str(), &pooled_forward<Family>, py::arg("args"), py::arg("out"),
          py::arg("state") = py::none());
    m.def((name + "_backward").c_str(), &pooled_backward<Family>, py::arg("grad_out"),
          py::arg("args"), py::arg("grads"), py::arg("state") = py::none());
}

}  // namespace bind
}  // namespace attnlab

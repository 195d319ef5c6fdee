#pragma once
// What the bindings of the two pooled families (additive.cpp: SwiftFormer's additive attention,
// separable.cpp: MobileViT-v2's separable self-attention) share: the problem and the gradient
// buffers built through the family's tensor visitor, the forward and backward and their binding,
// written once over a Family (Additive or Separable) that supplies its arguments, problem and
// gradient types, widths, visitor, state and kernels.

#include <string>
#include <utility>
#include <vector>

#include "common.hpp"
#include "interrupt.hpp"

namespace attnlab {
namespace bind {

// For the visitors: an input checked as C-contiguous T of its shape (null for an absent bias).
template <typename T>
void check_input(const T*& ptr, const py::object& arg, const char* name, std::vector<Index> shape,
                 bool optional) {
    ptr = optional && arg.is_none() ? nullptr
                                    : contiguous<T>(arg.cast<py::array>(), name, std::move(shape));
}

// The problem (forward and backward; out is set by the forward): the sizes, the family's own
// checks and widths, every buffer through the family's visitor in argument order, the padding.
// a.half (1 float16, 2 bfloat16; T float): x is given as the bits of that dtype, and so may each
// weight matrix be (uint16: p.half_weights).
template <typename Family, typename T>
auto pooled_problem(const typename Family::Args& a) {
    if (a.batch < 0 || a.n < 0) throw py::value_error("negative sizes");
    typename Family::template Problem<T> p;
    p.batch = a.batch;
    p.n = a.n;
    Family::widths(a, p);
    // a weight matrix given as bits (the vectors never are)
    const auto bits = [&](const py::object& arg, const std::vector<Index>& shape) {
        return a.half != 0 && shape.size() == 2 && is_dtype<std::uint16_t>(arg.cast<py::array>());
    };
    Family::visit(a, p, p,
                  [&](const T*& ptr, const py::object& arg, const char* name,
                      std::vector<Index> shape, bool optional) {
                      if (a.half != 0 && &ptr == &p.x) {  // its bits: the float pointer stays null
                          p.half.x = contiguous<std::uint16_t>(arg.cast<py::array>(), name,
                                                               std::move(shape));
                          return;
                      }
                      if (&ptr != &p.x && bits(arg, shape)) return;  // p.half_weights, below
                      check_input<T>(ptr, arg, name, std::move(shape), optional);
                  });
    Family::visit(a, p, p.half_weights,
                  [&](const std::uint16_t*& ptr, const py::object& arg, const char* name,
                      std::vector<Index> shape, bool) {
                      if (&ptr != &p.half_weights.x && bits(arg, shape))
                          ptr = contiguous<std::uint16_t>(arg.cast<py::array>(), name,
                                                          std::move(shape));
                  });
    if (a.half != 0) p.half.format = static_cast<HalfFormat>(a.half);
    p.key_padding = token_mask(a.key_padding_mask, a.batch, a.n);
    return p;
}

// The gradient buffers, through the visitor that checked the inputs (the same names and
// shapes); every input but the biases must have one. x's is half-precision bits (uint16), set
// in p.half.grad_x, when p.half.x is set.
template <typename Family, typename T>
auto pooled_grads(const typename Family::Args& a, typename Family::template Problem<T>& p,
                  const py::dict& grads) {
    typename Family::template Grads<T> g;
    std::string required;
    bool complete = true;
    Family::visit(
        a, p, g,
        [&](T*& ptr, const py::object&, const char* name, std::vector<Index> shape, bool optional) {
            const bool bits = p.half.x && &ptr == &g.x;
            if (bits)
                p.half.grad_x = grad_buffer<std::uint16_t>(grads, name, std::move(shape));
            else
                ptr = grad_buffer<T>(grads, name, std::move(shape));
            if (optional) return;
            required += (required.empty() ? "" : ", ") + std::string(name);
            complete = complete && (bits ? p.half.grad_x != nullptr : ptr != nullptr);
        });
    if (!complete) throw py::value_error("grads: expected buffers for " + required);
    return g;
}

// Runs f(T{}) for the problem's element type: float when a.half is set (1 float16, 2 bfloat16:
// x given as those bits, computed in float32), else x's dtype.
template <typename Args, typename F>
void pooled_dispatch(const Args& a, F&& f) {
    if (a.half == 0) {
        dispatch(a.x, "x", [&](auto tag) {
            f(tag);
            return 0;
        });
        return;
    }
    if (a.half != 1 && a.half != 2)
        throw py::value_error("half: expected 0, 1 (float16) or 2 (bfloat16), got " +
                              std::to_string(a.half));
    f(float{});
}

// Forward and backward of either family (Family: Additive or Separable, with its Args). state:
// only attnlab.vjp passes it, a dict of buffers the forward fills and the backward then reads.
// a.half: x and out (the backward: x, x's gradient, and grad_out when it is uint16) are the
// bits of that half dtype, computed in float32 (the state too). bf16: precision="bf16" (float32
// or half x; no state: its pullback runs the float32 backward at the rounded operands).
template <typename Family>
void pooled_forward(const typename Family::Args& a, py::array out, py::object state, bool bf16) {
    pooled_dispatch(a, [&](auto tag) {
        using T = decltype(tag);
        if (bf16 && !std::is_same_v<T, float>)
            throw py::type_error("bf16: bf16 products take float32 operands, got float64 x");
        if (bf16 && !state.is_none())
            throw py::value_error("state: precision='bf16' keeps no state");
        auto p = pooled_problem<Family, T>(a);
        p.bf16 = bf16;
        const std::vector<Index> shape{a.batch * a.n, p.d_out};
        if (p.half.x)
            p.half.out = contiguous<std::uint16_t>(out, "out", shape, true);
        else
            p.out = contiguous<T>(out, "out", shape, true);
        Family::set_state(p, state);
        ReleaseGil release;
        (kernels_for<T>().*Family::template forward<T>)(p);
    });
}

// grads: dict of preallocated outputs keyed by argument name (the biases' may be missing).
template <typename Family>
void pooled_backward(py::array grad_out, const typename Family::Args& a, py::dict grads,
                     py::object state) {
    pooled_dispatch(a, [&](auto tag) {
        using T = decltype(tag);
        auto p = pooled_problem<Family, T>(a);
        Family::set_state(p, state);
        p.state.filled = !state.is_none();
        const std::vector<Index> shape{a.batch * a.n, p.d_out};
        const T* gout = nullptr;
        if (p.half.x && is_dtype<std::uint16_t>(grad_out))
            p.half.grad_out = contiguous<std::uint16_t>(grad_out, "grad_out", shape);
        else
            gout = contiguous<T>(grad_out, "grad_out", shape);
        const auto g = pooled_grads<Family, T>(a, p, grads);
        ReleaseGil release;
        (kernels_for<T>().*Family::template backward<T>)(p, gout, g);
    });
}

// <name>_forward(args, out, state=None, bf16=False), <name>_backward(grad_out, args, grads,
// state=None) and the type of args, Family::Args bound as `type`.
template <typename Family>
void bind_pooled(py::module_& m, const std::string& name, const char* type) {
    bind_args<typename Family::Args>(m, type);
    m.def((name + "_forward").c_str(), &pooled_forward<Family>, py::arg("args"), py::arg("out"),
          py::arg("state") = py::none(), py::arg("bf16") = false);
    m.def((name + "_backward").c_str(), &pooled_backward<Family>, py::arg("grad_out"),
          py::arg("args"), py::arg("grads"), py::arg("state") = py::none());
}

}  // namespace bind
}  // namespace attnlab

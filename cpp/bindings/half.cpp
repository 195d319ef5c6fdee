// Half-precision arrays in and out: float16 / bfloat16 bits (viewed as uint16) to float32 and
// back through the kernel table's conversions (NumPy's astype converted one element at a time).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "attnlab/kernels.hpp"
#include "common.hpp"
#include "interrupt.hpp"

namespace attnlab {
namespace bind {
namespace {

HalfFormat half_format(int half) {
    if (half != 1 && half != 2) throw py::value_error("half: expected 1 (float16) or 2 (bfloat16)");
    return half == 1 ? HalfFormat::float16 : HalfFormat::bfloat16;
}

// A C-contiguous array of dtype T holding n elements (any shape: the conversions are elementwise).
template <typename T>
T* flat(const py::array& a, const char* name, py::ssize_t n, bool writable = false) {
    if (!py::isinstance<py::array_t<T>>(a) || !(a.flags() & py::array::c_style))
        throw py::type_error(std::string(name) + ": expected a C-contiguous " +
                             py::str(py::dtype::of<T>()).cast<std::string>() + " array, got " +
                             py::str(a.dtype()).cast<std::string>());
    if (a.size() != n)
        throw py::value_error(std::string(name) + ": expected " + std::to_string(n) +
                              " elements, got " + std::to_string(a.size()));
    if (writable && !a.writeable()) throw py::value_error(std::string(name) + ": not writable");
    return static_cast<T*>(const_cast<void*>(a.data()));
}

// dst (float32) = src (uint16 bits of the half format), elementwise
void widen_half(const py::array& src, const py::array& dst, int half) {
    const HalfFormat format = half_format(half);
    const auto* s = flat<std::uint16_t>(src, "src", src.size());
    float* d = flat<float>(dst, "dst", src.size(), true);
    ReleaseGil release;
    kernels().widen_half(s, static_cast<Index>(src.size()), format, d);
}

// dst (uint16 bits of the half format) = src (float32) rounded, elementwise
void narrow_half(const py::array& src, const py::array& dst, int half) {
    const HalfFormat format = half_format(half);
    const float* s = flat<float>(src, "src", src.size());
    auto* d = flat<std::uint16_t>(dst, "dst", src.size(), true);
    ReleaseGil release;
    kernels().narrow_half(s, static_cast<Index>(src.size()), format, d);
}

// whether bits (uint16 of bfloat16) hold a subnormal or a NaN, the values rounding to bf16
// changes: the others are their own rounding
bool bf16_special(const py::array& bits) {
    const auto* s = flat<std::uint16_t>(bits, "bits", bits.size());
    ReleaseGil release;
    return kernels().bf16_special(s, static_cast<Index>(bits.size()));
}

}  // namespace

void bind_half(py::module_& m) {
    m.def("bf16_special", &bf16_special, py::arg("bits"));
    m.def("widen_half", &widen_half, py::arg("src"), py::arg("dst"), py::arg("half"));
    m.def("narrow_half", &narrow_half, py::arg("src"), py::arg("dst"), py::arg("half"));
}

}  // namespace bind
}  // namespace attnlab

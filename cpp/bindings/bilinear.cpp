// Bindings for the bilinear family (placeholder until its kernels land).
#include <pybind11/pybind11.h>

namespace attnlab {
namespace bind {
void bind_bilinear(pybind11::module_& m) { (void)m; }
}  // namespace bind
}  // namespace attnlab

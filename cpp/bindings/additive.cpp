// Bindings for the additive family (placeholder until its kernels land).
#include <pybind11/pybind11.h>

namespace attnlab {
namespace bind {
void bind_additive(pybind11::module_& m) { (void)m; }
}  // namespace bind
}  // namespace attnlab

// The extension module: one per instruction set (_core_generic, _core_avx2, _core_avx512).
#include <pybind11/pybind11.h>

#include <Eigen/Core>

#include "attnlab/threading.hpp"

namespace py = pybind11;

namespace attnlab {
namespace bind {
void bind_mha(py::module_& m);
void bind_bilinear(py::module_& m);
void bind_additive(py::module_& m);
}  // namespace bind
}  // namespace attnlab

#ifndef ATTNLAB_VERSION
#define ATTNLAB_VERSION "0.0.0"
#endif

static py::dict cpu_features() {
    py::dict d;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    d["sse2"] = static_cast<bool>(__builtin_cpu_supports("sse2"));
    d["avx"] = static_cast<bool>(__builtin_cpu_supports("avx"));
    d["avx2"] = static_cast<bool>(__builtin_cpu_supports("avx2"));
    d["fma"] = static_cast<bool>(__builtin_cpu_supports("fma"));
    d["bmi2"] = static_cast<bool>(__builtin_cpu_supports("bmi2"));
    d["avx512f"] = static_cast<bool>(__builtin_cpu_supports("avx512f"));
    d["avx512bw"] = static_cast<bool>(__builtin_cpu_supports("avx512bw"));
    d["avx512dq"] = static_cast<bool>(__builtin_cpu_supports("avx512dq"));
    d["avx512vl"] = static_cast<bool>(__builtin_cpu_supports("avx512vl"));
    d["avx512cd"] = static_cast<bool>(__builtin_cpu_supports("avx512cd"));
#endif
    return d;
}

PYBIND11_MODULE(ATTNLAB_MODULE_NAME, m) {
    m.doc() = "attnlab compiled kernels (private; use the attnlab package)";
    m.attr("__version__") = ATTNLAB_VERSION;
    m.attr("ISA") = ATTNLAB_ISA_NAME;
    m.def("cpu_features", &cpu_features, "Instruction sets the running CPU supports.");
    m.def("get_num_threads", &attnlab::get_num_threads);
    m.def("set_num_threads", &attnlab::set_num_threads, py::arg("n"));
    m.attr("MAX_THREADS") = attnlab::kMaxThreads;
    m.def("cgroup_cpu_limit", &attnlab::detail::cgroup_cpu_limit, py::arg("sysroot"),
          "CPU limit of this process's cgroups read under sysroot (tests use a fake tree).");
    m.def("build_info", [] {
        py::dict d;
        d["version"] = ATTNLAB_VERSION;
        d["isa"] = ATTNLAB_ISA_NAME;
#if defined(__VERSION__)
        d["compiler"] = std::string(
#if defined(__clang__)
            "clang "
#else
            "gcc "
#endif
            __VERSION__);
#endif
        d["eigen_version"] = ATTNLAB_EIGEN_VERSION_STR;
        d["eigen_simd"] = std::string(Eigen::SimdInstructionSetsInUse());
        std::string simd;
#if defined(__AVX512F__)
        simd += "avx512f ";
#endif
#if defined(__AVX2__)
        simd += "avx2 ";
#endif
#if defined(__FMA__)
        simd += "fma ";
#endif
#if defined(__AVX__)
        simd += "avx ";
#endif
#if defined(__SSE2__)
        simd += "sse2";
#endif
        d["compiled_for"] = simd;
        d["num_threads"] = attnlab::get_num_threads();
        d["num_threads_source"] = attnlab::num_threads_source();
        return d;
    });
    attnlab::bind::bind_mha(m);
    attnlab::bind::bind_bilinear(m);
    attnlab::bind::bind_additive(m);
}

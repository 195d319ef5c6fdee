// The extension module attnlab._core: bindings compiled once, calling the kernel table that
// cpp/src/runtime/dispatch.cpp picks at import (ATTNLAB_ISA forces one).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "attnlab/kernels.hpp"
#include "attnlab/threading.hpp"
#include "interrupt.hpp"

namespace py = pybind11;

namespace attnlab {
namespace bind {
void bind_mha(py::module_& m);
void bind_bilinear(py::module_& m);
void bind_additive(py::module_& m);
void bind_separable(py::module_& m);
void bind_half(py::module_& m);
}  // namespace bind
}  // namespace attnlab

#ifndef ATTNLAB_VERSION
#define ATTNLAB_VERSION "0.0.0"
#endif

static py::tuple built_isas() {
    py::list l;
    for (const auto& isa : attnlab::built_isas()) l.append(py::str(isa));
    return py::tuple(l);
}

static py::dict cpu_features() {
    py::dict d;
    for (const auto& f : attnlab::cpu_features()) d[py::str(f.first)] = f.second;
    return d;
}

// copy_arrays(pairs): each (dst, src) a C-contiguous ndarray pair of the same byte size, dst
// writeable and not overlapping src; copied on the pool.
static void copy_arrays(const py::list& pairs) {
    std::vector<const void*> src;
    std::vector<void*> dst;
    std::vector<std::size_t> bytes;
    std::vector<py::array> keep;  // the arrays stay referenced while the GIL is released
    for (const py::handle item : pairs) {
        if (!py::isinstance<py::tuple>(item) || py::len(item) != 2)
            throw py::type_error("copy_arrays: expected (dst, src) pairs of arrays, got " +
                                 py::repr(item).cast<std::string>());
        const auto pair = py::reinterpret_borrow<py::tuple>(item);
        if (!py::isinstance<py::array>(pair[0]) || !py::isinstance<py::array>(pair[1]))
            throw py::type_error("copy_arrays: expected NumPy arrays in every pair");
        auto d = py::reinterpret_borrow<py::array>(pair[0]);
        auto s = py::reinterpret_borrow<py::array>(pair[1]);
        const int contiguous = py::array::c_style;
        if ((d.flags() & contiguous) == 0 || (s.flags() & contiguous) == 0)
            throw py::value_error("copy_arrays: expected C-contiguous arrays");
        if (!d.writeable()) throw py::value_error("copy_arrays: dst is read-only");
        if (d.nbytes() != s.nbytes())
            throw py::value_error("copy_arrays: dst has " + std::to_string(d.nbytes()) +
                                  " bytes, src " + std::to_string(s.nbytes()));
        dst.push_back(d.mutable_data());
        src.push_back(s.data());
        bytes.push_back(static_cast<std::size_t>(s.nbytes()));
        keep.push_back(d);
        keep.push_back(s);
    }
    attnlab::bind::ReleaseGil release;
    attnlab::parallel_copy(src.data(), dst.data(), bytes.data(), bytes.size());
}

PYBIND11_MODULE(_core, m) {
    // Before anything else: an unknown, unbuilt or unsupported ATTNLAB_ISA is an ImportError
    // (pybind11 turns the std::runtime_error into one), never an illegal instruction.
    const attnlab::KernelTable& table = attnlab::select_kernels(std::getenv("ATTNLAB_ISA"));
    m.doc() = "attnlab compiled kernels (private; use the attnlab package)";
    attnlab::bind::g_main_thread =
        py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
    // An interrupted call: the exception its signal handler raised is already pending (see
    // interrupt.hpp); KeyboardInterrupt if, unexpectedly, there is none.
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const attnlab::Interrupted&) {
            if (!PyErr_Occurred()) PyErr_SetNone(PyExc_KeyboardInterrupt);
        }
    });
    m.attr("__version__") = ATTNLAB_VERSION;
    m.attr("ISA") = table.isa;
    m.attr("BUILT_ISAS") = built_isas();
    m.def("cpu_features", &cpu_features, "Instruction sets the running CPU (and OS) supports.");
    m.def(
        "isa_supported", [](const std::string& isa) { return attnlab::isa_supported(isa); },
        py::arg("isa"), "Whether this CPU and OS can run the variant (built or not).");
    m.def("get_num_threads", &attnlab::get_num_threads);
    m.def("copy_arrays", &copy_arrays, py::arg("pairs"),
          "Copies each (dst, src) pair of C-contiguous arrays of one size, on the thread pool.");
    m.def("set_num_threads", &attnlab::set_num_threads, py::arg("n"));
    m.attr("MAX_THREADS") = attnlab::kMaxThreads;
    m.def("cgroup_cpu_limit", &attnlab::detail::cgroup_cpu_limit, py::arg("sysroot"),
          "CPU limit of this process's cgroups read under sysroot (tests use a fake tree).");
    m.def(
        "fma_peak",
        [](double seconds) {
            if (!std::isfinite(seconds) || seconds <= 0.0 || seconds > 60.0)
                throw py::value_error("seconds: expected a duration in (0, 60], got " +
                                      py::str(py::float_(seconds)).cast<std::string>());
            const auto n = static_cast<std::size_t>(attnlab::get_num_threads());
            std::vector<double> per(n), per_cpu(n);
            double total = 0.0;
            {
                py::gil_scoped_release release;
                total = attnlab::kernels().fma_peak(seconds, per.data(), per_cpu.data(),
                                                    static_cast<attnlab::Index>(n));
            }
            py::list each, each_cpu;
            for (std::size_t i = 0; i < n; ++i) {
                each.append(per[i]);
                each_cpu.append(per_cpu[i]);
            }
            return py::make_tuple(total, each, each_cpu);
        },
        py::arg("seconds"),
        "float32 FMA peak of the variant in use: (GFLOP/s of all threads over the wall time, "
        "[GFLOP/s of each thread over its wall time], [... over its CPU time, or 0]).");
    m.def("build_info", [] {
        py::dict d;
        d["version"] = ATTNLAB_VERSION;
        const attnlab::KernelTable& t = attnlab::kernels();
        d["isa"] = t.isa;
        d["built_isas"] = built_isas();
#if defined(_MSC_VER) && !defined(__clang__)
        d["compiler"] = "msvc " + std::to_string(_MSC_VER);
#elif defined(__VERSION__)
        d["compiler"] = std::string(
#if defined(__clang__)
            "clang "
#else
            "gcc "
#endif
            __VERSION__);
#endif
        d["eigen_version"] = ATTNLAB_EIGEN_VERSION_STR;
        d["eigen_simd"] = std::string(t.eigen_simd());
        std::string simd = t.compiled_for;
        while (!simd.empty() && simd.back() == ' ') simd.pop_back();
        d["compiled_for"] = simd;
        d["bf16_kernel"] = std::string(t.bf16_kernel());
        d["gemm_blocking"] = std::string(t.gemm_blocking());
        const attnlab::CpuIdentity cpu = attnlab::cpu_identity();
        d["cpu_vendor"] = cpu.vendor;
        d["cpu_family"] = cpu.family;
        d["cpu_model"] = cpu.model;
        d["l2_cache_bytes"] = attnlab::l2_cache_bytes();
        d["decode_prefetch"] = std::string(t.decode_prefetch());
        d["num_threads"] = attnlab::get_num_threads();
        d["num_threads_source"] = attnlab::num_threads_source();
        return d;
    });
    attnlab::bind::bind_mha(m);
    attnlab::bind::bind_bilinear(m);
    attnlab::bind::bind_additive(m);
    attnlab::bind::bind_separable(m);
    attnlab::bind::bind_half(m);
}

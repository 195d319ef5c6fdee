#pragma once
// The kernel table: every entry point of one instruction-set build of the kernels, as plain
// function pointers over the shared problem structs. cpp/src/kernels/kernel_table.cpp defines one
// table per build (attnlab::isa_<name>::kernel_table); cpp/src/runtime/dispatch.cpp picks one at
// import from the CPU's features (or ATTNLAB_ISA) and the bindings call through it. Pure C++.

#include <cstddef>
#include <string>
#include <vector>

#include "attnlab/additive.hpp"
#include "attnlab/attention.hpp"
#include "attnlab/bilinear.hpp"
#include "attnlab/common.hpp"
#include "attnlab/peak.hpp"

namespace attnlab {

template <typename T>
struct KernelSet {
    void (*attention_forward)(const AttentionProblem<T>&);
    void (*attention_backward)(const AttentionProblem<T>&, const AttentionGrad<T>&);
    void (*multi_head_attention_forward)(const MhaProblem<T>&);
    void (*multi_head_attention_backward)(const MhaProblem<T>&, const T*, const MhaGrads<T>&);
    void (*bilinear_attention_forward)(const BilinearProblem<T>&);
    void (*bilinear_attention_backward)(const BilinearProblem<T>&, const T*,
                                        const BilinearGrads<T>&);
    void (*additive_attention_forward)(const AdditiveProblem<T>&);
    void (*additive_attention_backward)(const AdditiveProblem<T>&, const T*,
                                        const AdditiveGrads<T>&);
    void (*separable_attention_forward)(const SeparableProblem<T>&);
    void (*separable_attention_backward)(const SeparableProblem<T>&, const T*,
                                         const SeparableGrads<T>&);
    // attnlab/gemm.hpp: linear() (its last argument: W's panels from pack_weight, or null)
    void (*linear)(Index, Index, Index, const T*, Index, const T*, const T*, T*, Index, bool,
                   const T*);
    void (*merge_attention)(const MergeProblem<T>&);
    // linear()'s gradients (attnlab/gemm.hpp): dX = dY W^T (or +=), and dW = X^T dY, db
    void (*linear_input_grad)(Index rows, Index in, Index out, const T* dy, Index lddy, const T* w,
                              T* dx, Index lddx, bool accumulate);
    void (*linear_weight_grad)(Index rows, Index in, Index out, const T* x, Index ldx, const T* dy,
                               Index lddy, T* dw, T* db);
    // a weight's panels packed once for linear() in this build's layout (attnlab/gemm.hpp)
    Index (*packed_weight_size)(Index in, Index out);
    void (*pack_weight)(Index in, Index out, const T* w, T* packed);
};

struct KernelTable {
    const char* isa;           // "generic", "avx2", "avx512", "native"
    const char* compiled_for;  // the compiler's SIMD macros in this build, e.g. "avx2 fma avx sse2"
    const char* (*eigen_simd)();  // Eigen::SimdInstructionSetsInUse() of this build
    KernelSet<float> f32;
    KernelSet<double> f64;
    // The float32 FMA peak of this build's widest vector (attnlab/peak.hpp): the benchmark's
    // denominator, per variant since each variant has its own vector width.
    double (*fma_peak)(double seconds, double* per_task, double* per_task_cpu, Index tasks);
    // float32 y = x w + b with bf16 products and float32 sums (precision="bf16"; x rows of
    // stride ldx, w contiguous, b or null, y rows of stride ldy), and the kernel it runs
    // here: "amx" (tiles) or "emulated" (the same rounding on the float32 GEMM)
    void (*linear_bf16)(Index rows, Index in, Index out, const float* x, Index ldx, const float* w,
                        const float* b, float* y, Index ldy);
    const char* (*bf16_kernel)();
    // a float32 weight (in x out, contiguous) as the bf16 tiles precision="bf16" reads from
    // Linear::tiles: their element count here (0 where bf16_kernel() is "emulated", whose
    // products read the weight itself), and the packing
    Index (*bf16_tiles_size)(Index in, Index out);
    void (*pack_bf16_tiles)(Index in, Index out, const float* w, std::uint16_t* tiles);
    const char* (*gemm_blocking)();    // the float GEMM's blocking chosen here (attnlab/gemm.hpp)
    const char* (*decode_prefetch)();  // where decoding requests K and V (attnlab/attention.hpp)
    // float16 / bfloat16 bits (format) to float32 and back, n elements, as NumPy casts them
    void (*widen_half)(const std::uint16_t* src, Index n, HalfFormat format, float* dst);
    void (*narrow_half)(const float* src, Index n, HalfFormat format, std::uint16_t* dst);
    // whether n bfloat16 bits hold a subnormal or a NaN (what rounding to bf16 changes)
    bool (*bf16_special)(const std::uint16_t* src, Index n);
    // y = x w + b in float32 with w given as float16 / bfloat16 bits (format), widened as
    // packed; x and y as bits of that format too when x_half, y_half are given (x, y null)
    void (*linear_half_weights)(Index rows, Index in, Index out, const float* x,
                                const std::uint16_t* x_half, Index ldx, const std::uint16_t* w,
                                HalfFormat format, const float* b, float* y, std::uint16_t* y_half,
                                Index ldy);
    // the same with bf16 products (precision="bf16": linear_bf16's roundings)
    void (*linear_bf16_half_weights)(Index rows, Index in, Index out, const float* x,
                                     const std::uint16_t* x_half, Index ldx, const std::uint16_t* w,
                                     HalfFormat format, const float* b, float* y,
                                     std::uint16_t* y_half, Index ldy);
    // linear()'s gradients in float32 with X, W, dY each given as floats or as bits of
    // `format`, dW written as either (attnlab/gemm.hpp, linear_half_grads)
    void (*linear_half_grads)(Index rows, Index in, Index out, const float* x,
                              const std::uint16_t* x_half, Index ldx, const float* w,
                              const std::uint16_t* w_half, const float* dy,
                              const std::uint16_t* dy_half, HalfFormat format, float* dx,
                              Index lddx, bool accumulate, float* dw, std::uint16_t* dw_half,
                              float* db);

    template <typename T>
    const KernelSet<T>& get() const {
        if constexpr (sizeof(T) == sizeof(float)) {
            return f32;
        } else {
            return f64;
        }
    }
};

// --- cpp/src/runtime/dispatch.cpp (compiled once, without any instruction-set flag)

// What the running CPU and operating system support, by name: the x86-64-v3/v4 features
// (cpuid) and whether the OS saves the AVX / AVX-512 registers (XGETBV); {"neon": true} on
// aarch64.
std::vector<std::pair<std::string, bool>> cpu_features();

// The variants compiled into this module, best first.
std::vector<std::string> built_isas();

// Whether this CPU and OS can run variant `isa` (false for unknown names).
bool isa_supported(const std::string& isa);

// Who made the running CPU and which family and model it is (cpuid leaves 0 and 1: the vendor
// string, and the displayed family and model, extended fields included); {"", 0, 0} off x86-64.
// The kernels choose by the vendor (cpu.hpp); these name the CPU in reports.
struct CpuIdentity {
    std::string vendor;
    unsigned family = 0;
    unsigned model = 0;
};
CpuIdentity cpu_identity();

// The L2 cache of the core running this, in bytes (cpuid 0x80000006, Intel and AMD alike); 0 when
// the CPU does not say, or off x86-64. The kernels' blocking may depend on it, never the results.
std::size_t l2_cache_bytes();

// Chooses the table: `forced` (the value of ATTNLAB_ISA; null or empty = the best variant
// built that this CPU supports). Throws std::runtime_error naming ATTNLAB_ISA when the forced
// variant is unknown, not built or not supported here: nothing compiled for an instruction set
// the CPU lacks is ever called.
const KernelTable& select_kernels(const char* forced);

// The table chosen by select_kernels (which the module calls once, at import).
const KernelTable& kernels();

}  // namespace attnlab

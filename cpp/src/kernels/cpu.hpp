#pragma once
// What the kernels choose by at run time beyond their variant (dispatch.cpp chose that): the CPU's
// vendor, and the cache level streamed operands are requested into.

#include <cstring>

#include "attnlab/common.hpp"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif
#if !defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#endif

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

// Whether cpuid's vendor string is `name` (12 characters: "GenuineIntel", "AuthenticAMD");
// false off x86-64.
inline bool cpu_vendor_is(const char* name) {
#if defined(__x86_64__) && defined(__GNUC__)
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
    char vendor[12];
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    return std::memcmp(vendor, name, 12) == 0;
#else
    (void)name;
    return false;
#endif
}

// Whether the GEMM's weight rows, ldb apart as a row block packs them, are requested into L2
// rather than L1: on AMD (Zen 4) requests into L1 held the loads' miss buffers; Intel keeps L1,
// as measured there (docs/performance.md, "Weight rows requested into L2"). Decided when the
// module loads: a function-local static made GCC call a function per request, spilling the
// kernels' accumulators around it.
inline const bool kPrefetchToL2 = cpu_vendor_is("AuthenticAMD");

// A read prefetch into all cache levels, always inlined: GCC 12 finds a plain inline wrapper of
// __builtin_prefetch (Eigen's internal::prefetch is one) free of side effects and deletes its
// calls before inlining them, so the panel kernel issued no prefetch at all until this was
// found in its disassembly.
EIGEN_ALWAYS_INLINE void prefetch_read(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p, 0, 3);
#else
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#endif
}

// The request with the level fixed at compile time, for loops that must stay free of branches.
enum class Fetch { none, l1, l2 };

// Where decode requests the K and V rows it streams: L2, whose requests hold no L1 miss buffer,
// so more of them are in flight, on AMD and Intel alike (docs/performance.md, "Decode prefetch").
inline constexpr Fetch kDecodeFetch = Fetch::l2;

template <Fetch P>
EIGEN_ALWAYS_INLINE void prefetch_to(const void* p) {
    if constexpr (P == Fetch::l1) {
        prefetch_read(p);
    } else if constexpr (P == Fetch::l2) {
#if defined(__GNUC__) || defined(__clang__)
        __builtin_prefetch(p, 0, 2);
#else
        _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
#endif
    }
}

// A row of w elements (as stored) requested into level P: a line at a time, then its last
// element (the row may end in a line the steps skip).
template <Fetch P, typename E>
EIGEN_ALWAYS_INLINE void prefetch_row(const E* row, Index w) {
    for (Index j = 0; j < w; j += 64 / Index(sizeof(E))) prefetch_to<P>(row + j);
    prefetch_to<P>(row + w - 1);
}

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

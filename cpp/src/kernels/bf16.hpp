#pragma once
// bfloat16 for precision="bf16": the rounding (round to nearest even; subnormal inputs to zero,
// as the hardware conversion does) and, in the AVX-512 build on Linux, the AMX tiles (TDPBF16PS):
// whether the CPU and the OS provide them, their configuration and the float-to-bf16 packing.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "attnlab/common.hpp"

#if defined(__AVX512F__) && defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define ATTNLAB_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

// x rounded to the nearest bfloat16 (ties to even), as a float; subnormals to signed zero, NaN
// to a quiet NaN: what VCVTNE2PS2BF16 gives.
inline float round_bf16(float x) {
    std::uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0) {
        u &= 0x80000000u;
    } else if ((u & 0x7fffffffu) > 0x7f800000u) {
        u = (u | 0x00400000u) & 0xffff0000u;
    } else {
        u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    }
    float r;
    std::memcpy(&r, &u, 4);
    return r;
}

// x[0, n) rounded in place (float only: precision="bf16" takes float32 operands)
template <typename T>
void round_bf16_inplace(T* x, Index n) {
    if constexpr (std::is_same_v<T, float>)
        for (Index i = 0; i < n; ++i) x[i] = round_bf16(x[i]);
}

#if defined(ATTNLAB_AMX)
#define ATTNLAB_AMX_TARGET \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

// AMX bf16 tiles usable here: the CPU has them (cpuid), the OS saves their state (XCR0) and
// grants this process the tile data (Linux's arch_prctl permission request, once). ATTNLAB_AMX=0
// turns them off (the emulation then runs: a way to compare both on one machine).
inline bool amx_usable() {
    static const bool usable = [] {
        const char* env = std::getenv("ATTNLAB_AMX");
        if (env && std::strcmp(env, "0") == 0) return false;
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        if (!((d >> 24) & 1u) || !((d >> 22) & 1u) || !((b >> 16) & 1u)) return false;
        if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1u)) return false;  // bf16
        if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !((c >> 27) & 1u)) return false;
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        if (((lo >> 17) & 3u) != 3u) return false;
        constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
        return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
    }();
    return usable;
}

struct alignas(64) TileConfig {
    std::uint8_t palette = 1, start_row = 0;
    std::uint8_t reserved[14] = {};
    std::uint16_t colsb[16] = {};
    std::uint8_t rows[16] = {};
};

// Eight tiles of 16 rows x 64 bytes: C (0-3, 16 x 16 floats), A (4-5, 16 x 32 bf16), B (6-7, 16
// pairs x 16 columns).
ATTNLAB_AMX_TARGET inline void tiles_on() {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    // GCC 12 deletes the stores above as dead without this: ldtilecfg would read garbage
    __asm__ volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}
ATTNLAB_AMX_TARGET inline void tiles_off() { _tile_release(); }

// 32 floats to 32 bf16 (src[0..16) in the low half).
ATTNLAB_AMX_TARGET inline void to_bf16(const float* src, std::uint16_t* dst) {
    const __m512bh r = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
    _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(r));
}

#endif

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

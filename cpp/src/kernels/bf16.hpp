#pragma once
// bfloat16 for precision="bf16": the rounding (round to nearest even; subnormal inputs to zero,
// as the hardware conversion does) and, in the AVX-512 build on Linux, the AMX tiles (TDPBF16PS):
// whether the CPU and the OS provide them, their configuration and the float-to-bf16 packing.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "attnlab/attention.hpp"
#include "cpu.hpp"
#include "microkernel.hpp"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif
#if defined(__AVX512F__) && defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define ATTNLAB_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

// x rounded to the nearest bfloat16 (ties to even), as a float; subnormals to signed zero, NaN
// to a quiet NaN: what VCVTNE2PS2BF16 gives. Branch-free, so that loops over it vectorise.
inline float round_bf16(float x) {
    std::uint32_t u;
    std::memcpy(&u, &x, 4);
    const std::uint32_t even = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const std::uint32_t quiet = (u | 0x00400000u) & 0xffff0000u;
    std::uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? quiet : even;
    r = (u & 0x7f800000u) == 0 ? (u & 0x80000000u) : r;
    float y;
    std::memcpy(&y, &r, 4);
    return y;
}

// dst = round_bf16(src) elementwise
inline void round_bf16_block(const float* src, Index n, float* dst) {
    for (Index i = 0; i < n; ++i) dst[i] = round_bf16(src[i]);
}

// dst = round_bf16(src) on bfloat16 bits: the identity but for subnormals (to signed zero) and
// NaN (quietened), as round_bf16 treats the same values given as floats
inline void round_bf16_bits(const std::uint16_t* src, Index n, std::uint16_t* dst) {
    for (Index i = 0; i < n; ++i) {
        const std::uint16_t b = src[i];
        const std::uint16_t r = (b & 0x7fffu) > 0x7f80u ? std::uint16_t(b | 0x0040u) : b;
        dst[i] = (b & 0x7f80u) == 0 ? std::uint16_t(b & 0x8000u) : r;
    }
}

// Whether n bfloat16 bits hold a subnormal or a NaN, the values round_bf16 changes (no early
// exit, so that the loop vectorises)
inline bool bf16_bits_special(const std::uint16_t* src, Index n) {
    unsigned special = 0;
    for (Index i = 0; i < n; ++i) {
        const unsigned e = src[i] & 0x7f80u, m = src[i] & 0x007fu;
        special |= unsigned((e == 0 || e == 0x7f80u) && m != 0);
    }
    return special != 0;
}

// round_bf16 of each lane of a packet of floats, widened from F: bfloat16 values change only
// where subnormal or NaN, float16 ones are never float32 subnormals
template <HalfFormat F>
PacketOf<float> round_bf16_packet(PacketOf<float> x) {
#if defined(__AVX512F__)
    static_assert(packet_size<float>() == 16);
    const __m512i u = _mm512_castps_si512(x), high = _mm512_set1_epi32(int(0xffff0000u));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    __m512i r = u;
    if constexpr (F != HalfFormat::bfloat16) {
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
        r = _mm512_and_si512(_mm512_add_epi32(u, bias), high);
    }
    r = _mm512_mask_and_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x00400000)), high);
    if constexpr (F != HalfFormat::float16) {
        const __mmask16 tiny = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000));
        r = _mm512_mask_and_epi32(r, tiny, u, _mm512_set1_epi32(int(0x80000000u)));
    }
    return _mm512_castsi512_ps(r);
#elif defined(__AVX2__)
    static_assert(packet_size<float>() == 8);
    const __m256i u = _mm256_castps_si256(x), high = _mm256_set1_epi32(int(0xffff0000u));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    __m256i r = u;
    if constexpr (F != HalfFormat::bfloat16) {
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff));
        r = _mm256_and_si256(_mm256_add_epi32(u, bias), high);
    }
    const __m256i quiet = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), high);
    r = _mm256_blendv_epi8(r, quiet, nan);
    if constexpr (F != HalfFormat::float16) {
        const __m256i tiny = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7f800000)),
                                                _mm256_setzero_si256());
        const __m256i sign = _mm256_and_si256(u, _mm256_set1_epi32(int(0x80000000u)));
        r = _mm256_blendv_epi8(r, sign, tiny);
    }
    return _mm256_castsi256_ps(r);
#else
    constexpr Index L = packet_size<float>();
    alignas(64) float lanes[L];
    Eigen::internal::pstore(lanes, x);
    for (Index i = 0; i < L; ++i) lanes[i] = round_bf16(lanes[i]);
    return Eigen::internal::pload<PacketOf<float> >(lanes);
#endif
}

// An operand as stored (load_stored_packet, load_stored), rounded to bf16 with B (float only:
// precision="bf16" reads an array so where it is, without a rounded copy)
template <typename T, HalfFormat F, bool B>
PacketOf<T> load_operand_packet(const StoredElem<T, F>* x) {
    if constexpr (B) return round_bf16_packet<F>(load_stored_packet<T, F>(x));
    return load_stored_packet<T, F>(x);
}

template <typename T, HalfFormat F, bool B>
T load_operand(const StoredElem<T, F>* x) {
    if constexpr (B) return round_bf16(load_stored<T, F>(x));
    return load_stored<T, F>(x);
}

// x[0, n) rounded in place (float only: precision="bf16" takes float32 operands)
template <typename T>
void round_bf16_inplace(T* x, Index n) {
    if constexpr (std::is_same_v<T, float>) round_bf16_block(x, n, x);
}

constexpr Index kPrefetchRows = 32;

// n half-precision bits to floats: exact.
inline void half_to_float(const std::uint16_t* s, Index n, HalfFormat format, float* o) {
    const auto widen = [&](auto f) {
        constexpr HalfFormat F = decltype(f)::value;
        constexpr Index L = packet_size<float>();
        const Index whole = n / L * L;
        for (Index c = 0; c < whole; c += L)
            Eigen::internal::pstoreu(o + c, load_stored_packet<float, F>(s + c));
        for (Index c = whole; c < n; ++c) o[c] = load_stored<float, F>(s + c);
    };
    if (format == HalfFormat::float16)
        widen(std::integral_constant<HalfFormat, HalfFormat::float16>{});
    else
        widen(std::integral_constant<HalfFormat, HalfFormat::bfloat16>{});
}

// n half-precision bits widened, then rounded as round_bf16_block rounds floats
inline void half_to_bf16_block(const std::uint16_t* s, Index n, HalfFormat format, float* o) {
    half_to_float(s, n, format, o);
    round_bf16_block(o, n, o);
}

// Rows of half-precision bits (row stride ld) to float rows (row stride cols), each row
// kPrefetchRows ahead requested as one is converted: the decode path streams a cache through
// this.
inline void half_rows_to_float(const std::uint16_t* src, Index ld, Index rows, Index cols,
                               HalfFormat format, float* dst) {
    for (Index i = 0; i < rows; ++i) {
        const std::uint16_t* s = src + i * ld;
#if defined(__AVX512F__)
        for (Index b = 0; b < cols * 2; b += 64)
            _mm_prefetch(reinterpret_cast<const char*>(s + kPrefetchRows * ld) + b, _MM_HINT_T0);
#endif
        half_to_float(s, cols, format, dst + i * cols);
    }
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

// AVX512-BF16 (VDPBF16PS) usable here, in the AVX-512 build (whose dispatch checked the ZMM state),
// for precision="bf16" when AMX is not: by default on AMD only, as on the Intel cores measured
// VDPBF16PS gives fewer products per cycle than float32 FMA (the emulation is faster there).
// ATTNLAB_AVX512_BF16=1 turns it on wherever the CPU has it, =0 off (the emulation then runs).
#define ATTNLAB_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
inline bool avx512_bf16_usable() {
    static const bool usable = [] {
        const char* env = std::getenv("ATTNLAB_AVX512_BF16");
        if (env && std::strcmp(env, "0") == 0) return false;
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1u)) return false;
        if (env && std::strcmp(env, "1") == 0) return true;
        return cpu_vendor_is("AuthenticAMD");
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

// The 2 x 2 block of accumulator tiles 0-3 (32 x 32 floats): C += A B with A's two 16-row tiles
// at a and a + 16 rows (row stride lda elements, 32 bf16 per row read) and B's tiles b0, b1
// (the two 16-column halves, 64-byte rows), through tiles 4-7.
ATTNLAB_AMX_TARGET inline void dp_2x2(const std::uint16_t* a, Index lda, const std::uint16_t* b0,
                                      const std::uint16_t* b1) {
    // each load just before the first product that reads it: tiles are not renamed, so a
    // step's loads wait for the previous step's products reading their tile
    _tile_loadd(4, a, lda * 2);
    _tile_loadd(6, b0, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b1, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + 16 * lda, lda * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

// The 2 x 1 block of accumulator tiles 0 and 2 (32 x 16 floats): C += A B with A's two 16-row
// tiles as in dp_2x2 and one B tile b0, through tiles 4, 5 and 6 (a block of 16 queries).
ATTNLAB_AMX_TARGET inline void dp_2x1(const std::uint16_t* a, Index lda, const std::uint16_t* b0) {
    _tile_loadd(4, a, lda * 2);
    _tile_loadd(6, b0, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, a + 16 * lda, lda * 2);
    _tile_dpbf16ps(2, 5, 6);
}
ATTNLAB_AMX_TARGET inline void zero_2x1() {
    _tile_zero(0);
    _tile_zero(2);
}
ATTNLAB_AMX_TARGET inline void load_2x1(const float* c, Index ldc) {
    _tile_loadd(0, c, ldc * 4);
    _tile_loadd(2, c + 16 * ldc, ldc * 4);
}
ATTNLAB_AMX_TARGET inline void store_2x1(float* c, Index ldc) {
    _tile_stored(0, c, ldc * 4);
    _tile_stored(2, c + 16 * ldc, ldc * 4);
}

// Accumulator tiles 0-3 zeroed, loaded from or stored to a 32 x 32 float block (row stride ldc).
ATTNLAB_AMX_TARGET inline void zero_2x2() {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}
ATTNLAB_AMX_TARGET inline void load_2x2(const float* c, Index ldc) {
    _tile_loadd(0, c, ldc * 4);
    _tile_loadd(1, c + 16, ldc * 4);
    _tile_loadd(2, c + 16 * ldc, ldc * 4);
    _tile_loadd(3, c + 16 * ldc + 16, ldc * 4);
}
ATTNLAB_AMX_TARGET inline void store_2x2(float* c, Index ldc) {
    _tile_stored(0, c, ldc * 4);
    _tile_stored(1, c + 16, ldc * 4);
    _tile_stored(2, c + 16 * ldc, ldc * 4);
    _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
}

// rows[0, 16) transposed in registers as a 16 x 16 block (lane j of row i to lane i of row j);
// a template so that the packet type, whose attributes a PacketBlock<__m512, 16> would drop
// with a warning, is deduced
template <typename Packet>
inline void transpose_16x16(Packet (&rows)[16]) {
    Eigen::internal::PacketBlock<Packet, 16> block;
    for (int i = 0; i < 16; ++i) block.packet[i] = rows[i];
    Eigen::internal::ptranspose(block);
    for (int i = 0; i < 16; ++i) rows[i] = block.packet[i];
}

// The first n of 16 lanes (none for n <= 0, all for n >= 16).
inline __mmask16 first_lanes(Index n) {
    return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// lo and hi rounded to bf16 and interleaved in pairs (lo[0], hi[0], lo[1], hi[1], ...): a row of
// a B tile in the VNNI layout.
ATTNLAB_BF16_TARGET inline __m512i interleave_bf16(__m512 lo, __m512 hi) {
    const __m512i pairs =
        _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(pairs, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
}

// 16 lanes of a row as floats, the lanes off the mask zero and not read: float32 as it is,
// half-precision bits (`format`) widened exactly, as half_to_float does.
ATTNLAB_BF16_TARGET inline __m512 load_lanes(const float* p, __mmask16 m, HalfFormat) {
    return _mm512_maskz_loadu_ps(m, p);
}
ATTNLAB_BF16_TARGET inline __m512 load_lanes(const std::uint16_t* p, __mmask16 m,
                                             HalfFormat format) {
    const __m256i bits = _mm256_maskz_loadu_epi16(m, p);
    return format == HalfFormat::float16
               ? _mm512_cvtph_ps(bits)
               : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Row r of a B tile (VNNI layout) from a row-major matrix m (rows x cols, row stride ld; float32,
// or half-precision bits of `format`): rows k0 and k0 + 1, columns [c0, c0 + 16), rounded to
// bf16 and interleaved in pairs; zero outside the matrix.
template <typename S>
ATTNLAB_BF16_TARGET inline __m512i vnni_row(const S* m, Index ld, Index rows, Index cols, Index k0,
                                            Index c0, HalfFormat format) {
    const __mmask16 in = first_lanes(cols - c0);
    const __m512 lo = k0 < rows ? load_lanes(m + k0 * ld + c0, in, format) : _mm512_setzero_ps();
    const __m512 hi =
        k0 + 1 < rows ? load_lanes(m + (k0 + 1) * ld + c0, in, format) : _mm512_setzero_ps();
    return interleave_bf16(lo, hi);
}

// 32 floats to 32 bf16 (src[0..16) in the low half).
ATTNLAB_BF16_TARGET inline void to_bf16(const float* src, std::uint16_t* dst) {
    const __m512bh r = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
    _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(r));
}

// Rows [i0, i1) of x (rows x in, row stride ldx; float32, or half-precision bits of `format`) as
// bf16 rows of kp (>= in, a multiple of 32) columns at xp + i kp, zero padded (rows from `rows`
// on all zero).
template <typename S>
ATTNLAB_BF16_TARGET inline void pack_rows(Index i0, Index i1, Index rows, Index in, const S* x,
                                          Index ldx, Index kp, std::uint16_t* xp,
                                          HalfFormat format = HalfFormat::none) {
    for (Index i = i0; i < i1; ++i) {
        const S* src = i < rows ? x + i * ldx : x;  // masked loads: nothing read past a row
        const Index cols = i < rows ? in : 0;
        for (Index k = 0; k < kp; k += 32) {
            const __m512 lo = load_lanes(src + k, first_lanes(cols - k), format);
            const __m512 hi = load_lanes(src + k + 16, first_lanes(cols - k - 16), format);
            _mm512_storeu_si512(xp + i * kp + k,
                                reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
        }
    }
}

#endif

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

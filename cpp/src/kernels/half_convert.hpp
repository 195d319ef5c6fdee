#pragma once
// float16 / bfloat16 bits to float32 and back, elementwise, as NumPy and ml_dtypes cast them
// (exact one way; round to nearest even the other, subnormals kept, NaN kept as NaN): the way in
// of half-precision arrays and the way out of their results, on the thread pool.

#include <atomic>
#include <cstdint>

#include "attnlab/attention.hpp"
#include "attnlab/threading.hpp"
#include "bf16.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp

namespace detail {

constexpr Index kConvertBlock = 1 << 15;  // elements a task: blocks of whole 16-lane vectors

inline std::uint16_t float_to_half_bits(float x, HalfFormat format) {
    if (format == HalfFormat::float16)
        return Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(x));
    return Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(x));
}

inline void narrow_block(const float* src, Index n, HalfFormat format, std::uint16_t* dst) {
    Index i = 0;
#if defined(__AVX512F__)
    if (format == HalfFormat::float16) {
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                                _mm512_cvtps_ph(_mm512_loadu_ps(src + i),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        // round to nearest even on the bits (VCVTNEPS2BF16 would flush subnormals); NaN keeps
        // its sign and becomes the quiet NaN Eigen::bfloat16 gives
        const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
        for (; i + 16 <= n; i += 16) {
            const __m512 f = _mm512_loadu_ps(src + i);
            const __m512i u = _mm512_castps_si512(f);
            const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
            __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), lsb), 16);
            const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
            const __m512i quiet = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000)),
                _mm512_set1_epi32(0x7fc0));
            r = _mm512_mask_mov_epi32(r, nan, quiet);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(r));
        }
    }
#elif defined(__AVX2__) && defined(__F16C__)
    if (format == HalfFormat::float16) {
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {  // as the AVX-512 loop above, 8 lanes
        const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
        for (; i + 8 <= n; i += 8) {
            const __m256 f = _mm256_loadu_ps(src + i);
            const __m256i u = _mm256_castps_si256(f);
            const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
            __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias), lsb), 16);
            const __m256i quiet = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)),
                _mm256_set1_epi32(0x7fc0));
            r = _mm256_blendv_epi8(r, quiet,
                                   _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
            // 32-bit lanes (all below 2^16) to 16: packed per 128-bit half, the halves joined
            const __m256i pairs = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(pairs));
        }
    }
#endif
    for (; i < n; ++i) dst[i] = float_to_half_bits(src[i], format);
}

}  // namespace detail

// dst[i] = src[i] widened (exact), for i < n
inline void widen_half(const std::uint16_t* src, Index n, HalfFormat format, float* dst) {
    const Index tasks = (n + detail::kConvertBlock - 1) / detail::kConvertBlock;
    parallel_for(tasks, [&](Index t) {
        const Index i0 = t * detail::kConvertBlock;
        detail::half_to_float(src + i0, std::min(detail::kConvertBlock, n - i0), format, dst + i0);
    });
}

// Whether n bfloat16 bits hold a subnormal or a NaN (what rounding to bf16 would change)
inline bool bf16_special(const std::uint16_t* src, Index n) {
    const Index tasks = (n + detail::kConvertBlock - 1) / detail::kConvertBlock;
    std::atomic<bool> found{false};
    parallel_for(tasks, [&](Index t) {
        const Index i0 = t * detail::kConvertBlock;
        if (detail::bf16_bits_special(src + i0, std::min(detail::kConvertBlock, n - i0)))
            found.store(true, std::memory_order_relaxed);
    });
    return found.load();
}

// dst[i] = src[i] rounded to the half format, for i < n
inline void narrow_half(const float* src, Index n, HalfFormat format, std::uint16_t* dst) {
    const Index tasks = (n + detail::kConvertBlock - 1) / detail::kConvertBlock;
    parallel_for(tasks, [&](Index t) {
        const Index i0 = t * detail::kConvertBlock;
        detail::narrow_block(src + i0, std::min(detail::kConvertBlock, n - i0), format, dst + i0);
    });
}

}  // namespace attnlab::ATTNLAB_ISA_NS

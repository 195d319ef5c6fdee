#pragma once
// A register-blocked product kernel on Eigen packets, for the attention tiles.
//
// The tiles of flash attention are small (tens to hundreds of rows) and one operand is always a
// strided view of the projections. A general GEMM packs both operands on every call; this kernel
// packs nothing: the "A" operand is read by scalar broadcasts through arbitrary strides, and the
// "B" operand is a buffer we own whose lanes are queries (padded to a whole panel). Written with
// Eigen's packet primitives, so it compiles to SSE2, AVX2+FMA or AVX-512 with the module's flags.

#include <cmath>

#include "attnlab/common.hpp"
#include "cpu.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // Eigen packet types as template args
#endif

template <typename T>
using PacketOf = typename Eigen::internal::packet_traits<T>::type;

template <typename T>
constexpr Index packet_size() {
    return Eigen::internal::unpacket_traits<PacketOf<T>>::size;
}

// A panel is three packets wide and the kernel computes four rows of it at once: 12
// accumulators, 3 B packets and a broadcast fill the 16 vector registers of SSE2/AVX2 and need
// 7 loads per 12 FMAs (6 rows x 2 packets would need 8). 4 divides the usual head widths and
// key tiles; 3 packets divide a 96-query tile for every packet size (4, 8, 16 lanes).
// Elements as stored: T, or the bits of a half format F, converted as they are loaded, exactly
// (a kernel then does the same FMAs as on the widened values, reading half the bytes: the decode
// path's K and V, the GEMM's half-precision weights)
template <typename T, HalfFormat F>
using StoredElem = std::conditional_t<F == HalfFormat::none, T, std::uint16_t>;

template <typename T, HalfFormat F>
T load_stored(const StoredElem<T, F>* x) {
    if constexpr (F == HalfFormat::none) {
        return *x;
    } else if constexpr (F == HalfFormat::float16) {
        return static_cast<T>(Eigen::numext::bit_cast<Eigen::half>(*x));
    } else {
        return static_cast<T>(Eigen::numext::bit_cast<Eigen::bfloat16>(*x));
    }
}

// c + a * b, rounded once where the CPU has FMA and twice where it has not: written out, as the
// compiler may fuse `c += a * b` in one instantiation of a kernel (float elements) and not in
// another (half-precision ones), which then disagree in the last bit.
template <typename T>
T mul_add(T a, T b, T c) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
}

template <typename T, HalfFormat F>
PacketOf<T> load_stored_packet(const StoredElem<T, F>* x) {
    namespace ei = Eigen::internal;
    using Packet = PacketOf<T>;
    if constexpr (F == HalfFormat::none) {
        return ei::ploadu<Packet>(x);
    } else {
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<T, float> && packet_size<T>() == 16) {
            const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
            if constexpr (F == HalfFormat::float16) return _mm512_cvtph_ps(b);
            return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
        }
#endif
#if defined(__AVX2__) && defined(__F16C__)
        if constexpr (std::is_same_v<T, float> && packet_size<T>() == 8) {
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
            if constexpr (F == HalfFormat::float16) return _mm256_cvtph_ps(b);
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
        }
#endif
        constexpr Index L = packet_size<T>();
        alignas(64) T lanes[L];
        for (Index i = 0; i < L; ++i) lanes[i] = load_stored<T, F>(x + i);
        return ei::pload<Packet>(lanes);
    }
}

constexpr int kPanelPackets = 3;
#if defined(__AVX512F__)
constexpr int kPanelRows = 8;  // 32 registers: 24 accumulators, 11 loads per 24 FMAs
#else
constexpr int kPanelRows = 4;
#endif

template <typename T>
constexpr Index panel_width() {
    return kPanelPackets * packet_size<T>();
}

// Rows at a time for a panel of NP packets: narrower panels take more rows, so that the
// accumulators still fill the registers (4 x 3 or 8 x 3, 6 x 2, 8 x 1; 6 x 4 with AVX-512).
template <int NP>
constexpr int rows_for_packets() {
    return NP == 4 ? 6 : NP >= kPanelPackets ? kPanelRows : NP == 2 ? 6 : 8;
}

// C[r, 0:NP L) (+)= sum_{t < depth} A(r, t) * B[t, 0:NP L) for r < MR, L = packet_size<T>().
// A(r, t) = a[r * a_rs + t * a_ts]; B rows are ldb apart, C rows ldc apart, any alignment
// (unaligned loads cost the same as aligned ones on aligned data on AVX2/AVX-512 CPUs). The sum
// over t runs in order, so the result does not depend on the thread. Always inlined: with more
// callers GCC kept it out of line and flash_tile got slower.
//
// PackB: B is also copied (widened, if half), row by row, to `packed` (rows ldp apart) as it is
// read, so that the next row blocks read it from there: the copy's loads (of weights that are
// often out of L2) overlap this block's FMAs instead of running alone before them; B's rows
// being ldb apart, a stride the hardware prefetchers follow late, the row kPrefetchAhead on is
// requested early into L1 (P = Fetch::l1), or the row kPrefetchAheadL2 on into L2 (Fetch::l2,
// kPrefetchToL2: AMD), where requests hold no L1 miss buffer, so more of them may be in flight.
constexpr Index kPrefetchAhead = 16;
constexpr Index kPrefetchAheadL2 = 64;

// Blocked summation (Join): each element sums at most kChain products in one chain, each chain
// then added to C: a single chain over a depth K errs like sqrt(K) roundings, chains of 256
// stay near BLAS's error for a load, an add and a store of the accumulators per 256 steps
// (docs/performance.md, "GEMMs in blocked sums"). The GEMM joins, and so do the attention's
// sums over key tiles (P V, dQ) and over head widths past 256 (a key tile is 256 keys: one
// chain each). Without Join one chain over the depth, going on from C's when Accumulate: the
// same bits wherever the tiles start (the backward's dK and dV chains of 256 query rows).
constexpr Index kChain = 256;

// Rows ahead a packed B block's rows are requested when its reader asks for it (PB, the GEMM on
// Intel: Blocking::fetch_packed in gemm.cpp): contiguous rows the L1 prefetchers fetch too late.
constexpr Index kPackedAhead = 16;

template <typename T, int MR, int NP, bool Accumulate, bool PackB = false,
          HalfFormat F = HalfFormat::none, bool Join = false, Fetch P = Fetch::l1,
          Fetch PB = Fetch::none>
EIGEN_ALWAYS_INLINE void panel_kernel(Index depth, const T* a, Index a_rs, Index a_ts,
                                      const StoredElem<T, F>* b, Index ldb, T* c, Index ldc,
                                      T* packed = nullptr, Index ldp = 0) {
    namespace ei = Eigen::internal;
    using Packet = PacketOf<T>;
    constexpr Index L = packet_size<T>();
    Packet acc[MR][NP];
    Index t0 = 0;
    do {  // Join: chains of at most kChain products per element, each added to C
        const Index t1 = Join ? std::min(depth, t0 + kChain) : depth;
        const bool from_c = Accumulate && !Join && t0 == 0;  // the chain C holds goes on
        for (int r = 0; r < MR; ++r)
            for (int q = 0; q < NP; ++q)
                acc[r][q] =
                    from_c ? ei::ploadu<Packet>(c + r * ldc + q * L) : ei::pset1<Packet>(T(0));
        for (Index t = t0; t < t1; ++t) {
            Packet bt[NP];
            for (int q = 0; q < NP; ++q) bt[q] = load_stored_packet<T, F>(b + t * ldb + q * L);
            if constexpr (PackB) {
                for (int q = 0; q < NP; ++q) ei::pstoreu(packed + t * ldp + q * L, bt[q]);
                // past the end: a hint, no access
                constexpr Index kAhead = P == Fetch::l2 ? kPrefetchAheadL2 : kPrefetchAhead;
                prefetch_row<P>(b + (t + kAhead) * ldb, NP * L);
            }
            if constexpr (PB != Fetch::none)  // past the end: a hint, no access
                for (int q = 0; q < NP; ++q) prefetch_to<PB>(b + (t + kPackedAhead) * ldb + q * L);
            const T* at = a + t * a_ts;
            for (int r = 0; r < MR; ++r) {
                const Packet ar = ei::pset1<Packet>(at[r * a_rs]);
                for (int q = 0; q < NP; ++q) acc[r][q] = ei::pmadd(ar, bt[q], acc[r][q]);
            }
        }
        const bool join = (Accumulate && Join) || t0 > 0;
        for (int r = 0; r < MR; ++r)
            for (int q = 0; q < NP; ++q) {
                T* cq = c + r * ldc + q * L;
                ei::pstoreu(cq, join ? ei::padd(ei::ploadu<Packet>(cq), acc[r][q]) : acc[r][q]);
            }
        t0 = t1;
    } while (t0 < depth);
}

// Rows [0, rows) of C for one panel of NP packets, MR rows at a time, the rest with fewer; B as
// stored (F: half-precision bits, widened as loaded); Join and PB as panel_kernel.
template <typename T, int NP, int MR, bool Accumulate, HalfFormat F = HalfFormat::none,
          bool Join = false, Fetch PB = Fetch::none>
void panel_rows(Index rows, Index depth, const T* a, Index a_rs, Index a_ts,
                const StoredElem<T, F>* b, Index ldb, T* c, Index ldc) {
    Index r = 0;
    // A's rows read along the depth (a_ts = 1), short and far apart (the keys of packed
    // projections: d_head of every h d_head): the next row block's rows are fetched while this
    // one runs, the hardware prefetchers seeing too little of each page to follow them (only
    // for such rows: a GEMM's contiguous rows lose by it; docs/performance.md)
    const bool fetch = a_ts == 1 && a_rs * Index(sizeof(T)) > 1024 && a_rs >= 4 * depth;
    for (; r + MR <= rows; r += MR) {
        if (fetch && r + 2 * MR <= rows)
            for (int i = 0; i < MR; ++i) {
                const T* next = a + (r + MR + i) * a_rs;
                for (Index t = 0; t < depth; t += 64 / Index(sizeof(T))) prefetch_read(next + t);
            }
        panel_kernel<T, MR, NP, Accumulate, false, F, Join, Fetch::l1, PB>(
            depth, a + r * a_rs, a_rs, a_ts, b, ldb, c + r * ldc, ldc);
    }
    if constexpr (MR > 1) {
        if (r < rows)
            panel_rows<T, NP, MR - 1, Accumulate, F, Join, PB>(rows - r, depth, a + r * a_rs, a_rs,
                                                               a_ts, b, ldb, c + r * ldc, ldc);
    }
}

// The three panel shapes (3, 2 and 1 packets, rows_for_packets rows at a time), each with and
// without accumulation, for float and double: instantiated once, in gemm.cpp, and called from
// there by every kernel source (each is the kernel inlined for every row count up to MR): built
// in every source that used them, they lengthened the whole build (docs/performance.md).
#define ATTNLAB_PANEL_ROWS_J(prefix, T, NP, ACC, JOIN)                                           \
    prefix template void panel_rows<T, NP, rows_for_packets<NP>(), ACC, HalfFormat::none, JOIN>( \
        Index, Index, const T*, Index, Index, const T*, Index, T*, Index);
#define ATTNLAB_PANEL_ROWS(prefix, T, NP, ACC)      \
    ATTNLAB_PANEL_ROWS_J(prefix, T, NP, ACC, false) \
    ATTNLAB_PANEL_ROWS_J(prefix, T, NP, ACC, true)
#define ATTNLAB_PANEL_ROWS_ALL(prefix)           \
    ATTNLAB_PANEL_ROWS(prefix, float, 3, true)   \
    ATTNLAB_PANEL_ROWS(prefix, float, 3, false)  \
    ATTNLAB_PANEL_ROWS(prefix, float, 2, true)   \
    ATTNLAB_PANEL_ROWS(prefix, float, 2, false)  \
    ATTNLAB_PANEL_ROWS(prefix, float, 1, true)   \
    ATTNLAB_PANEL_ROWS(prefix, float, 1, false)  \
    ATTNLAB_PANEL_ROWS(prefix, double, 3, true)  \
    ATTNLAB_PANEL_ROWS(prefix, double, 3, false) \
    ATTNLAB_PANEL_ROWS(prefix, double, 2, true)  \
    ATTNLAB_PANEL_ROWS(prefix, double, 2, false) \
    ATTNLAB_PANEL_ROWS(prefix, double, 1, true)  \
    ATTNLAB_PANEL_ROWS(prefix, double, 1, false)
#if defined(__AVX512F__)
// A panel of 4 packets, 6 rows at a time: 24 accumulators of AVX-512's 32 registers (AVX2's 16
// hold no such block: 4 packets run as 2 + 2 there)
constexpr bool kWidePanel = true;
#define ATTNLAB_PANEL_ROWS_WIDE(prefix)         \
    ATTNLAB_PANEL_ROWS(prefix, float, 4, true)  \
    ATTNLAB_PANEL_ROWS(prefix, float, 4, false) \
    ATTNLAB_PANEL_ROWS(prefix, double, 4, true) \
    ATTNLAB_PANEL_ROWS(prefix, double, 4, false)
#else
constexpr bool kWidePanel = false;
#define ATTNLAB_PANEL_ROWS_WIDE(prefix)
#endif
ATTNLAB_PANEL_ROWS_ALL(extern)
ATTNLAB_PANEL_ROWS_WIDE(extern)

// Rows [0, rows) of C for one panel (W = panel_width<T>() lanes), kPanelRows at a time.
template <typename T, bool Accumulate, bool Join = false>
void panel_product(Index rows, Index depth, const T* a, Index a_rs, Index a_ts, const T* b,
                   Index ldb, T* c, Index ldc) {
    panel_rows<T, kPanelPackets, kPanelRows, Accumulate, HalfFormat::none, Join>(
        rows, depth, a, a_rs, a_ts, b, ldb, c, ldc);
}

// C[0:rows, 0:cols) (+)= A B with cols a whole number of packets (callers pad): three-packet
// panels, then two-packet ones for the rest (a last single packet only when cols is one
// packet). Narrower panels take more rows at a time (6 x 2, 8 x 1), so that the accumulators
// still fill the registers. With AVX-512, panels of 4 packets (6 rows at a time) instead of
// those of 2 where the count allows (4 = 4, 7 = 3 + 4, 8 = 4 + 4; docs/performance.md, "A 6 x
// 4 panel"); else 4 packets as 2 + 2 rather than 3 + 1 (faster in L1 on AVX-512, the same on
// AVX2: docs/performance.md, lanes_product).
template <typename T, bool Accumulate, bool Join = false>
void lanes_product(Index rows, Index cols, Index depth, const T* a, Index a_rs, Index a_ts,
                   const T* b, Index ldb, T* c, Index ldc) {
    constexpr Index L = packet_size<T>();
    const Index packets = cols / L;
    if constexpr (kWidePanel) {
        // panels of 3 and 4 packets, none of 2 (but for 2 and 5 packets)
        const Index fours = packets % 3 == 1 && packets > 1   ? 1
                            : packets % 3 == 2 && packets > 5 ? 2
                                                              : 0;
        if (fours > 0) {
            Index j = 0;
            for (; j + 4 * fours * L < cols; j += kPanelPackets * L)
                panel_product<T, Accumulate, Join>(rows, depth, a, a_rs, a_ts, b + j, ldb, c + j,
                                                   ldc);
            for (; j < cols; j += 4 * L)
                panel_rows<T, 4, rows_for_packets<4>(), Accumulate, HalfFormat::none, Join>(
                    rows, depth, a, a_rs, a_ts, b + j, ldb, c + j, ldc);
            return;
        }
    }
    const Index wide = packets % 3 == 1 && packets > 1 ? packets / 3 - 1 : packets / 3;
    Index j = 0;
    for (Index i = 0; i < wide; ++i, j += kPanelPackets * L)
        panel_product<T, Accumulate, Join>(rows, depth, a, a_rs, a_ts, b + j, ldb, c + j, ldc);
    for (; j + 2 * L <= cols; j += 2 * L)
        panel_rows<T, 2, rows_for_packets<2>(), Accumulate, HalfFormat::none, Join>(
            rows, depth, a, a_rs, a_ts, b + j, ldb, c + j, ldc);
    if (j < cols)
        panel_rows<T, 1, rows_for_packets<1>(), Accumulate, HalfFormat::none, Join>(
            rows, depth, a, a_rs, a_ts, b + j, ldb, c + j, ldc);
}

// A block of L x L packets transposed in registers. AVX-512 float: 64 in-register shuffles
// (two stages within 128-bit lanes, two across them); Eigen's version goes through 256-bit
// halves (extracts, permutes and inserts besides its shuffles).
template <typename Packet, int L>
EIGEN_ALWAYS_INLINE void transpose_block(Eigen::internal::PacketBlock<Packet, L>& block) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<Packet, Eigen::internal::Packet16f>) {
        __m512* r = block.packet;
        __m512 t[16], u[16];
        for (int i = 0; i < 8; ++i) {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        for (int i = 0; i < 4; ++i) {
            u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
            u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
            u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
            u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
        }
        for (int h = 0; h < 2; ++h)  // 128-bit lanes 0 and 2, then 1 and 3, of row pairs
            for (int i = 0; i < 4; ++i) {
                t[8 * h + i] = _mm512_shuffle_f32x4(u[8 * h + i], u[8 * h + 4 + i], 0x88);
                t[8 * h + 4 + i] = _mm512_shuffle_f32x4(u[8 * h + i], u[8 * h + 4 + i], 0xDD);
            }
        for (int i = 0; i < 8; ++i) {
            r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
            r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
        }
        return;
    }
#endif
    Eigen::internal::ptranspose(block);
}

// What transpose does to each element on its way: nothing, or op(x, c) for the element written
// to row c of dst (a packet: the L elements of that row).
struct AsIs {
    template <typename X>
    X operator()(const X& x, Index) const {
        return x;
    }
};

// dst[c * ldd + r] = op(src[r * lds + c], c) for r < rows, c < cols: blocks of L x L through
// packet transposes, scalar at the edges (strided scalar copies of the backward's K, V, dK and
// dV tiles showed in its profile; most of what is left is the first write of dK, dV). src as
// stored: T, or the bits of a half format F, widened (exactly) as they are loaded.
template <typename T, HalfFormat F = HalfFormat::none, typename Op = AsIs>
void transpose(Index rows, Index cols, const StoredElem<T, F>* src, Index lds, T* dst, Index ldd,
               Op op = {}) {
    namespace ei = Eigen::internal;
    using Packet = PacketOf<T>;
    constexpr int L = static_cast<int>(packet_size<T>());
    Index r = 0;
    for (; r + L <= rows; r += L) {
        Index c = 0;
        for (; c + L <= cols; c += L) {
            ei::PacketBlock<Packet, L> block;
            for (int i = 0; i < L; ++i)
                block.packet[i] = load_stored_packet<T, F>(src + (r + i) * lds + c);
            transpose_block<Packet, L>(block);
            for (int i = 0; i < L; ++i)
                ei::pstoreu(dst + (c + i) * ldd + r, op(block.packet[i], c + i));
        }
        for (; c < cols; ++c)
            for (Index i = 0; i < L; ++i)
                dst[c * ldd + r + i] = op(load_stored<T, F>(src + (r + i) * lds + c), c);
    }
    for (; r < rows; ++r)
        for (Index c = 0; c < cols; ++c)
            dst[c * ldd + r] = op(load_stored<T, F>(src + r * lds + c), c);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

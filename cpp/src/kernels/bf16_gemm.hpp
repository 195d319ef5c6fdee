#pragma once
// y = x w + b for float32 arrays with bf16 products and float32 accumulation (precision="bf16"):
// the operands rounded to bfloat16 (round to nearest even; subnormal inputs to zero, as the
// hardware conversion does), their products summed in float32. With AMX (TDPBF16PS tiles) where
// the CPU and the OS provide it, in the AVX-512 build, else with VDPBF16PS where the CPU has
// AVX512-BF16 (bf16_gemm_avx512.hpp); elsewhere the same rounding emulated on the float32 GEMM,
// so the answers agree across CPUs to the order of the float32 sums. A few rows against a large
// weight stream it instead (linear_bf16_streamed: the emulation's bits on every CPU).
//
// Shapes: x (rows x in, row stride ldx), w (in x out), b (out) or null, y (rows x out). A layer's
// w may be stored as half-precision bits (Linear::w_half): read as stored, widened exactly and
// rounded to bf16 as the float32 copy of it would be (a bfloat16 w is taken as it is).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "attnlab/attention.hpp"
#include "attnlab/gemm.hpp"
#include "attnlab/threading.hpp"
#include "bf16.hpp"
#include "bf16_gemm_avx512.hpp"
#include "half_convert.hpp"
#include "scratch.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

#if defined(ATTNLAB_AMX)
// The k-block kb (32 input features) of w (in x cols, row stride ldw; float32, or half-precision
// bits of `format`) as the B tiles [t0, t0 + tiles) of a packed weight of np columns, one per 16
// columns (zero beyond w's): pair r (features 2r, 2r + 1) of column n at [(t * 16 + r) * 32 + 2n
// + parity] (the VNNI layout).
template <typename S>
ATTNLAB_BF16_TARGET inline void pack_weight_block(Index kb, Index in, Index cols, const S* w,
                                                  Index ldw, HalfFormat format, Index np, Index t0,
                                                  Index tiles, std::uint16_t* wp) {
    std::uint16_t* block = wp + kb * (np / 16) * 512;
    for (Index t = 0; t < tiles; ++t)
        for (Index r = 0; r < 16; ++r)
            _mm512_storeu_si512(block + ((t0 + t) * 16 + r) * 32,
                                vnni_row(w, ldw, in, cols, kb * 32 + 2 * r, t * 16, format));
}

// The same for a layer's weight (l.in x l.out), as it is stored.
inline void pack_weight_block(Index kb, const Linear<float>& l, Index np, Index t0, Index tiles,
                              std::uint16_t* wp) {
    if (l.w_half)
        pack_weight_block(kb, l.in, l.out, l.w_half, l.out, l.half, np, t0, tiles, wp);
    else
        pack_weight_block(kb, l.in, l.out, l.w, l.out, HalfFormat::none, np, t0, tiles, wp);
}

// C (32 x 32 floats) = c_in (row stride ldc_in; 0: one row for all, null: zero) + rows
// [32 mb, 32 mb + 32) of xp times a packed weight's column block over the k-blocks [kb0, kb1)
// (its two B tiles of k-block kb at b + kb b_stride), stored to c_out (row stride ldc_out): the
// tiles sum the input features in order, so splitting them is exact.
ATTNLAB_AMX_TARGET inline void tile_block(Index kp, const std::uint16_t* xp, Index mb,
                                          const std::uint16_t* b, Index b_stride, Index kb0,
                                          Index kb1, const float* c_in, Index ldc_in, float* c_out,
                                          Index ldc_out) {
    if (c_in)
        load_2x2(c_in, ldc_in);
    else
        zero_2x2();
    for (Index kb = kb0; kb < kb1; ++kb) {
        const std::uint16_t* bk = b + kb * b_stride;
        dp_2x2(xp + mb * 32 * kp + kb * 32, kp, bk, bk + 512);
    }
    store_2x2(c_out, ldc_out);
}

// The task shape of the tile product: k-blocks (32 input features each) per span of one
// accumulation in the tiles (a 32-row panel's span, 16 KB, stays in L1 while the weight's tiles
// stream through it from L2: a whole-L1 panel is evicted by them and reloaded per column block),
// blocks of 32 columns per task (wide when at least kWideRows row blocks keep the threads busy).
constexpr Index kSpan = 8, kWideGroup = 24, kNarrowGroup = 8, kWideRows = 16;

// The tile product of packed operands, xp (mp rows of kp bf16, zero padded to whole 32-row
// blocks) times w (kp x np in blocks of 32 columns, each where w.column(nb) says: TileColumns,
// or the three weights of the fused projections), the sums starting from bp (np floats) or zero:
// 32 x 32 blocks of the result as tasks (the grid depends on the shapes alone; each element is
// one chain of tile sums over the input features, so the result does not depend on the thread
// count). A finished block goes to blocks.direct(mb, nb) (row stride ld) when that is not null,
// else to blocks.finish(mb, nb, c, 32, nullptr) from the task's sums (32 x 32, the bias in them)
// after the task's tiles.
template <typename Blocks, typename Columns>
void tile_product(Index mp, Index kp, Index np, const std::uint16_t* xp, const Columns& w,
                  const float* bp, Index ld, const Blocks& blocks) {
    const Index mblocks = mp / 32, nblocks = np / 32;
    // a task: 32 rows by up to `group` blocks of 32 columns, the tiles configured once and the
    // row panel of xp kept in L1 across its column blocks; wide groups (fewer reloads of the
    // panel) when there are row blocks enough to share among the threads
    const Index group = mblocks >= kWideRows ? kWideGroup : kNarrowGroup;
    const Index groups = (nblocks + group - 1) / group, kblocks = kp / 32;
    // column group outermost: a group's weight panel stays in L2 while the row panels stream
    // (row-major tasks read the whole packed weight once per row block, from L3 when it
    // exceeds L2)
    parallel_for(mblocks * groups, [&](Index t) {
        const Index mb = t % mblocks, nb0 = (t / mblocks) * group;
        const Index nb1 = std::min(nblocks, nb0 + group);
        float* cs =
            scratch<float>(ScratchBuffer::kGemmTiles, static_cast<std::size_t>(group * 1024));
        tiles_on();
        // the input features in spans of kSpan k-blocks: the sums stay in the tiles over a
        // span, the span of the row panel in cache across the group's column blocks
        for (Index kb0 = 0; kb0 < kblocks; kb0 += kSpan) {
            const Index kb1 = std::min(kblocks, kb0 + kSpan);
            for (Index nb = nb0; nb < nb1; ++nb) {
                float* c = cs + (nb - nb0) * 1024;
                const bool first = kb0 == 0, last = kb1 == kblocks;
                const float* c_in = !first ? c : bp ? bp + nb * 32 : nullptr;
                float* direct = last ? blocks.direct(mb, nb) : nullptr;
                float* c_out = direct ? direct : c;
                tile_block(kp, xp, mb, w.column(nb), w.stride(nb), kb0, kb1, c_in, first ? 0 : 32,
                           c_out, direct ? ld : 32);
            }
        }
        tiles_off();
        for (Index nb = nb0; nb < nb1; ++nb)
            if (!blocks.direct(mb, nb)) blocks.finish(mb, nb, cs + (nb - nb0) * 1024, 32, nullptr);
    });
}

// b padded to np columns (zero beyond out), where the tile sums start; no elements without b.
inline Buffer<float> padded_bias(const float* b, Index out, Index np) {
    auto bp = make_buffer<float>(b ? np : 0);
    if (b) {
        std::copy(b, b + out, bp.get());
        std::fill(bp.get() + out, bp.get() + np, 0.0f);
    }
    return bp;
}

// y = x w + b from both operands packed (xp: rows of kp bf16, zero padded to whole 32-row
// blocks; wp: np columns, pack_weight_block): the tile product, or without AMX the VDPBF16PS one.
// y_half (not null): y written there as bits of `format` instead (LinearBlocks).
inline void linear_bf16_product(Index rows, Index out, Index kp, Index np, const std::uint16_t* xp,
                                const std::uint16_t* wp, const float* b, float* y, Index ldy,
                                std::uint16_t* y_half = nullptr,
                                HalfFormat format = HalfFormat::none) {
    // the bias padded to np columns: with AMX the sums start from it (a stride-0 tile load
    // repeats its row), with VDPBF16PS it is added after them
    const Buffer<float> bp = padded_bias(b, out, np);
    const float* bias = b ? bp.get() : nullptr;
    const LinearBlocks blocks{rows, out, y, ldy, y_half, format};
    if (amx_usable())
        tile_product((rows + 31) / 32 * 32, kp, np, xp, TileColumns{wp, np}, bias, ldy, blocks);
    else
        vdp_product(rows, kp, TileColumns{wp, np}, xp, bias, blocks);
}

// The product with both operands packed to bf16 first, in one parallel pass (h.x, h.y: x and y
// as half-precision bits, as in linear_bf16); w as l.tiles holds it when given.
inline void linear_bf16_packed(Index rows, const float* x, Index ldx, const Linear<float>& l,
                               float* y, Index ldy, const HalfOperands& h) {
    const Index in = l.in, out = l.out;
    const Index mp = (rows + 31) / 32 * 32, kp = (in + 31) / 32 * 32, np = (out + 31) / 32 * 32;
    auto xp = make_buffer<std::uint16_t>(mp * kp);
    auto packed = make_buffer<std::uint16_t>(l.tiles ? 0 : kp * np);
    const std::uint16_t* wp = l.tiles ? l.tiles : packed.get();
    parallel_for(mp / 32 + (l.tiles ? 0 : kp / 32), [&](Index t) {
        if (t >= mp / 32)
            pack_weight_block(t - mp / 32, l, np, 0, np / 16, packed.get());
        else if (h.x)
            pack_rows(t * 32, t * 32 + 32, rows, in, h.x, ldx, kp, xp.get(), h.format);
        else
            pack_rows(t * 32, t * 32 + 32, rows, in, x, ldx, kp, xp.get());
    });
    linear_bf16_product(rows, out, kp, np, xp.get(), wp, l.b, y, ldy, h.y, h.format);
}
#endif

// A precision="bf16" product of few rows (a decode step) with a large weight streams the weight,
// each row rounded to bf16 as it is read, instead of packing both operands into blocks of 32
// rows: a weight of 4 MiB or more is read from memory on every call, and rounding it as it is
// read costs less than packing it; smaller ones stay in cache, where packing is cheap and the
// packed product faster (docs/performance.md, "bf16 products of few rows").
inline constexpr Index kBf16StreamRows = 4;
inline constexpr Index kBf16StreamElements = Index(1) << 20;
inline constexpr Index kBf16StreamCols = 256;  // columns per task: its sums stay in L1

inline bool bf16_streams(Index rows, Index in, Index out) {
    return rows <= kBf16StreamRows && in > 0 && in * out >= kBf16StreamElements;
}

// y = x w + b with bf16 operands when bf16_streams, on any CPU: x's rows rounded once,
// w read once, a row at a time, rounded as it is read. Each element sums chains of kChain
// products (in order, as the float32 GEMM's panel kernel does), joined in order, then the bias:
// bit for bit the emulated path below (the float32 GEMM on rounded copies). Tasks are blocks of
// columns, so the result does not depend on the thread count.
inline void linear_bf16_streamed(Index rows, const float* x, Index ldx, const Linear<float>& l,
                                 float* y, Index ldy, const HalfOperands& h) {
    namespace ei = Eigen::internal;
    using Packet = PacketOf<float>;
    constexpr Index L = packet_size<float>();
    const Index in = l.in, out = l.out;
    auto xr = make_buffer<float>(std::max<Index>(rows * in, 1));
    for (Index r = 0; r < rows; ++r) {
        float* row = xr.get() + r * in;
        if (h.x)
            half_to_float(h.x + r * ldx, in, h.format, row);
        else
            std::copy(x + r * ldx, x + r * ldx + in, row);
        round_bf16_block(row, in, row);
    }
    parallel_for((out + kBf16StreamCols - 1) / kBf16StreamCols, [&](Index t) {
        const Index j0 = t * kBf16StreamCols, nc = std::min(kBf16StreamCols, out - j0);
        const Index np = (nc + L - 1) / L, width = np * L;  // whole packets, zero padded
        float* wr = scratch<float>(ScratchBuffer::kBf16Streamed,
                                   static_cast<std::size_t>((1 + 2 * rows) * width));
        float* total = wr + width;            // rows x width: the joined chains
        float* chain = total + rows * width;  // rows x width: the current chain
        std::fill(wr + nc, wr + width, 0.0f);
        for (Index k0 = 0; k0 < in; k0 += kChain) {
            std::fill(chain, chain + rows * width, 0.0f);
            for (Index k = k0; k < std::min(in, k0 + kChain); ++k) {
                // the row kPrefetchAheadL2 on requested now: rows out apart, a stride the
                // hardware prefetchers follow late (as the GEMM's panel kernel does)
                if (k + kPrefetchAheadL2 < in) {
                    if (l.w_half)
                        prefetch_row<Fetch::l2>(l.w_half + (k + kPrefetchAheadL2) * out + j0, nc);
                    else
                        prefetch_row<Fetch::l2>(l.w + (k + kPrefetchAheadL2) * out + j0, nc);
                }
                if (l.w_half)
                    half_to_bf16_block(l.w_half + k * out + j0, nc, l.half, wr);
                else
                    round_bf16_block(l.w + k * out + j0, nc, wr);
                for (Index r = 0; r < rows; ++r) {
                    const Packet xv = ei::pset1<Packet>(xr[r * in + k]);
                    float* c = chain + r * width;
                    for (Index q = 0; q < width; q += L)
                        ei::pstoreu(c + q, ei::pmadd(xv, ei::ploadu<Packet>(wr + q),
                                                     ei::ploadu<Packet>(c + q)));
                }
            }
            for (Index i = 0; i < rows * width; i += L)
                ei::pstoreu(total + i, k0 == 0 ? ei::ploadu<Packet>(chain + i)
                                               : ei::padd(ei::ploadu<Packet>(total + i),
                                                          ei::ploadu<Packet>(chain + i)));
        }
        for (Index r = 0; r < rows; ++r) {
            float* sums = total + r * width;
            if (l.b)
                for (Index j = 0; j < nc; ++j) sums[j] += l.b[j0 + j];
            if (h.y)
                narrow_block(sums, nc, h.format, h.y + r * ldy + j0);
            else
                std::copy(sums, sums + nc, y + r * ldy + j0);
        }
    });
}

}  // namespace detail

// Which kernel precision="bf16" runs here: "amx", "avx512_bf16" or "emulated".
inline const char* bf16_kernel() {
#if defined(ATTNLAB_AMX)
    if (detail::amx_usable()) return "amx";
    if (detail::avx512_bf16_usable()) return "avx512_bf16";
#endif
    return "emulated";
}

// The element count of a float32 weight's bf16 tiles (Linear::tiles) where the products read
// them, else 0 (the emulation reads the weight).
inline Index bf16_tiles_size(Index in, Index out) {
#if defined(ATTNLAB_AMX)
    if (in > 0 && out > 0 && (detail::amx_usable() || detail::avx512_bf16_usable()))
        return (in + 31) / 32 * 32 * ((out + 31) / 32 * 32);
#endif
    (void)in, (void)out;
    return 0;
}

// w (in x out, contiguous) as bf16 tiles (bf16_tiles_size elements): what a precision="bf16"
// product packs of its weight on every call, packed once.
inline void pack_bf16_tiles(Index in, Index out, const float* w, std::uint16_t* tiles) {
#if defined(ATTNLAB_AMX)
    if (bf16_tiles_size(in, out) == 0) return;
    const Index np = (out + 31) / 32 * 32;
    parallel_for((in + 31) / 32, [&](Index kb) {
        detail::pack_weight_block(kb, in, out, w, out, HalfFormat::none, np, 0, np / 16, tiles);
    });
#else
    (void)in, (void)out, (void)w, (void)tiles;
#endif
}

// y = x l.w + l.b, l.w float32 or stored as half-precision bits. h.x, h.y (not null): x and y
// stored as bits of h.format instead (x then null, y unused): x widened exactly as it is packed,
// y rounded from the float32 result as NumPy and ml_dtypes cast it (h.w unused: l has w).
inline void linear_bf16(Index rows, const float* x, Index ldx, const Linear<float>& l, float* y,
                        Index ldy, const HalfOperands& h = {}) {
    const Index in = l.in, out = l.out;
    if (rows <= 0 || out <= 0) return;
    if (detail::bf16_streams(rows, in, out)) {
        detail::linear_bf16_streamed(rows, x, ldx, l, y, ldy, h);
        return;
    }
#if defined(ATTNLAB_AMX)
    // no features: the float32 path below writes y = b
    if (in > 0 && (detail::amx_usable() || detail::avx512_bf16_usable())) {
        detail::linear_bf16_packed(rows, x, ldx, l, y, ldy, h);
        return;
    }
#endif
    // the same rounding on the float32 GEMM: the products of bf16 values are exact in float32
    auto xr = make_buffer<float>(rows * in), wr = make_buffer<float>(in * out);
    parallel_for(rows, [&](Index i) {
        float* row = xr.get() + i * in;
        if (h.x)
            detail::half_to_float(h.x + i * ldx, in, h.format, row);
        else
            std::copy(x + i * ldx, x + i * ldx + in, row);
        detail::round_bf16_block(row, in, row);
    });
    parallel_for(in, [&](Index k) {
        float* row = wr.get() + k * out;
        if (l.w_half)
            detail::half_to_float(l.w_half + k * out, out, l.half, row);
        else
            std::copy(l.w + k * out, l.w + (k + 1) * out, row);
        detail::round_bf16_block(row, out, row);
    });
    if (!h.y) {
        linear<float>(rows, in, out, xr.get(), in, wr.get(), l.b, y, ldy, false);
        return;
    }
    auto yf = make_buffer<float>(rows * out);
    linear<float>(rows, in, out, xr.get(), in, wr.get(), l.b, yf.get(), out, false);
    parallel_for(rows, [&](Index i) {
        detail::narrow_block(yf.get() + i * out, out, h.format, h.y + i * ldy);
    });
}

// The kernel table's bf16 product of a weight stored as half-precision bits (linear_bf16 above):
// linear_half_weights' arguments.
inline void linear_bf16_half_weights(Index rows, Index in, Index out, const float* x,
                                     const std::uint16_t* x_half, Index ldx, const std::uint16_t* w,
                                     HalfFormat format, const float* b, float* y,
                                     std::uint16_t* y_half, Index ldy) {
    const Linear<float> l{/*w=*/nullptr, b, in, out, /*w_half=*/w, format};
    linear_bf16(rows, x, ldx, l, y, ldy, HalfOperands{x_half, nullptr, y_half, format});
}

inline void linear_bf16(Index rows, Index in, Index out, const float* x, Index ldx, const float* w,
                        const float* b, float* y, Index ldy) {
    linear_bf16(rows, x, ldx, Linear<float>{w, b, in, out}, y, ldy);
}

}  // namespace attnlab::ATTNLAB_ISA_NS

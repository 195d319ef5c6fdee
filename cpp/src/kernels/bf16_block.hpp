#pragma once
// The precision="bf16" product of a block of rows inside a parallel task (the pooled families'
// row blocks, which keep a block's intermediates in cache between their products): Y = X W + b
// with X and W rounded to bfloat16 and float32 sums, in the calling thread, against a weight
// packed once per call (Bf16Weight). The kernels and roundings of linear_bf16 (bf16_gemm.hpp):
// AMX tiles or VDPBF16PS where usable, else the emulation (the float32 panel kernel on rounded
// copies), so the answers agree across CPUs to the order of the float32 sums. Each element is
// one chain of sums over the input features in order, then the bias: blocks of any size give
// the same bits.

#include <algorithm>
#include <cstdint>

#include "attnlab/common.hpp"
#include "attnlab/gemm.hpp"
#include "attnlab/threading.hpp"
#include "bf16.hpp"
#include "bf16_gemm.hpp"
#include "half_convert.hpp"
#include "products.hpp"
#include "scratch.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

class Bf16Weight {
  public:
    // w: (in x out) float32, or with w_half its half-precision bits of `format` (read as
    // stored), row-major contiguous; packed in parallel (call it outside tasks)
    Bf16Weight(const float* w, Index in, Index out, const std::uint16_t* w_half = nullptr,
               HalfFormat format = HalfFormat::none)
        : in_(in), out_(out) {
        if (in <= 0 || out <= 0) return;  // the product is its bias (or zero)
#if defined(ATTNLAB_AMX)
        if (amx_usable() || avx512_bf16_usable()) {
            kp_ = (in + 31) / 32 * 32;
            np_ = (out + 31) / 32 * 32;
            tiles_ = make_buffer<std::uint16_t>(kp_ * np_);
            parallel_for(kp_ / 32, [&](Index kb) {
                if (w_half)
                    pack_weight_block(kb, in, out, w_half, out, format, np_, 0, np_ / 16,
                                      tiles_.get());
                else
                    pack_weight_block(kb, in, out, w, out, HalfFormat::none, np_, 0, np_ / 16,
                                      tiles_.get());
            });
            return;
        }
#endif
        rounded_ = make_buffer<float>(in * out);
        parallel_for(in, [&](Index k) {
            float* row = rounded_.get() + k * out;
            if (w_half)
                half_to_bf16_block(w_half + k * out, out, format, row);
            else
                round_bf16_block(w + k * out, out, row);
        });
        panels_ = make_buffer<float>(std::max<Index>(packed_block_size<float>(in, out), 1));
        pack_block<float>(in, out, rounded_.get(), nullptr, HalfFormat::none, panels_.get(),
                          /*parallel=*/true);
    }

    // y (m x out, row stride ldy) = x w + b for m rows of x (row stride ldx: float32, or the
    // half-precision bits x_half of `format` when x_half is set), in this thread.
    void product(Index m, const float* x, const std::uint16_t* x_half, HalfFormat format, Index ldx,
                 const float* b, float* y, Index ldy) const {
        if (m <= 0 || out_ <= 0) return;
        RowMap<float> Y(y, m, out_, Eigen::OuterStride<>(ldy));
        if (in_ <= 0) {
            if (b)
                Y.rowwise() = ConstRowMap<float>(b, 1, out_, Eigen::OuterStride<>(out_)).row(0);
            else
                Y.setZero();
            return;
        }
#if defined(ATTNLAB_AMX)
        if (tiles_) {
            tiled(m, x, x_half, format, ldx, b, y, ldy);
            return;
        }
#endif
        // the emulation: x's rows rounded, then the float32 panel kernel (exact products)
        float* xr =
            scratch<float>(ScratchBuffer::kBf16BlockRows, static_cast<std::size_t>(m * in_));
        for (Index i = 0; i < m; ++i) {
            float* row = xr + i * in_;
            if (x_half)
                half_to_float(x_half + i * ldx, in_, format, row);
            else
                std::copy(x + i * ldx, x + i * ldx + in_, row);
            round_bf16_block(row, in_, row);
        }
        block_product<float>(cview<float>(xr, m, in_, in_),
                             cview<float>(rounded_.get(), in_, out_, out_), Y, false,
                             panels_.get());
        if (b) Y.rowwise() += ConstRowMap<float>(b, 1, out_, Eigen::OuterStride<>(out_)).row(0);
    }

  private:
#if defined(ATTNLAB_AMX)
    // x's rows packed to bf16, then 32 rows at a time: the sums of every column block (AMX
    // tiles or VDPBF16PS) into this thread's block, then y = sums + b
    void tiled(Index m, const float* x, const std::uint16_t* x_half, HalfFormat format, Index ldx,
               const float* b, float* y, Index ldy) const {
        const Index mp = (m + 31) / 32 * 32;
        std::uint16_t* xp = scratch<std::uint16_t>(ScratchBuffer::kBf16BlockRows,
                                                   static_cast<std::size_t>(mp * kp_));
        if (x_half)
            pack_rows(0, mp, m, in_, x_half, ldx, kp_, xp, format);
        else
            pack_rows(0, mp, m, in_, x, ldx, kp_, xp);
        float* c =
            scratch<float>(ScratchBuffer::kBf16BlockSums, static_cast<std::size_t>(32 * np_));
        const bool amx = amx_usable();
        const TileColumns columns{tiles_.get(), np_};
        if (amx) tiles_on();
        for (Index mb = 0; mb < mp / 32; ++mb) {
            const Index rows = std::min<Index>(32, m - mb * 32);
            if (amx) {
                for (Index nb = 0; nb < np_ / 32; ++nb)
                    tile_block(kp_, xp, mb, columns.column(nb), columns.stride(nb), 0, kp_ / 32,
                               nullptr, 0, c + nb * 32, np_);
            } else {
                vdp_sums(rows, kp_, columns, xp, mb, 0, np_ / 32, c);
            }
            for (Index i = 0; i < rows; ++i) {
                float* yr = y + (mb * 32 + i) * ldy;
                const float* cr = c + i * np_;
                if (b)
                    for (Index j = 0; j < out_; ++j) yr[j] = cr[j] + b[j];
                else
                    std::copy(cr, cr + out_, yr);
            }
        }
        if (amx) tiles_off();
    }
#endif

    Index in_ = 0, out_ = 0;
#if defined(ATTNLAB_AMX)
    Index kp_ = 0, np_ = 0;        // the tiles' padded sizes
    Buffer<std::uint16_t> tiles_;  // AMX / VDPBF16PS: w in the VNNI layout (pack_weight_block)
#endif
    Buffer<float> rounded_, panels_;  // the emulation: w rounded, and its panels (pack_block)
};

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

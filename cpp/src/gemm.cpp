#include "attnlab/gemm.hpp"

#include "attnlab/threading.hpp"
#include "microkernel.hpp"

#include <algorithm>

namespace attnlab {

namespace {
// Fixed chunk height (rows per task), independent of the thread count.
constexpr Index kRowChunk = 128;
}  // namespace

namespace {
// Forward projection blocking: a task is 128 rows x 8 panels of output columns; the depth runs
// in chunks of 256 so that the W panel chunk (256 x panel width) stays in L1 while the rows of
// the task pass. Fixed sizes: the summation order never depends on the thread count.
constexpr Index kPanelsPerTask = 8;
constexpr Index kGemmDepth = 256;

// Y[0:m, 0:W) (+)= X[0:m, :] W[:, j0:j0+nw) (nw <= W), Y initialised by the caller. Each depth
// chunk of the W panel is first copied to a contiguous buffer (zero-padded to W columns): read
// in place, its rows would be `out` apart, and a power-of-two `out` maps them all onto the same
// L1 sets (measured: 51 against 79 GFLOP/s at 1024^3).
template <typename T>
void panel_gemm(Index m, Index in, const T* x, Index ldx, const T* w, Index out, Index j0, Index nw,
                T* y, Index ldy) {
    constexpr Index W = detail::panel_width<T>();
    T* wp = detail::scratch<T, 5>(static_cast<std::size_t>(kGemmDepth * W));
    for (Index k0 = 0; k0 < in; k0 += kGemmDepth) {
        const Index kc = std::min(kGemmDepth, in - k0);
        for (Index k = 0; k < kc; ++k) {
            const T* wr = w + (k0 + k) * out + j0;
            std::copy(wr, wr + nw, wp + k * W);
            std::fill(wp + k * W + nw, wp + (k + 1) * W, T(0));
        }
        detail::panel_product<T, true>(m, kc, x + k0, ldx, 1, wp, W, y, ldy);
    }
}
}  // namespace

// Y = X W (+ b) with the panel kernel of the attention tiles: X rows are broadcast in place,
// W is copied panel chunk by panel chunk (see panel_gemm).
template <typename T>
void linear(Index rows, Index in, Index out, const T* x, Index ldx, const T* w, const T* b, T* y,
            Index ldy, bool accumulate) {
    if (rows <= 0 || out <= 0) return;
    constexpr Index W = detail::panel_width<T>();
    const Index panels = (out + W - 1) / W;
    const Index row_chunks = (rows + kRowChunk - 1) / kRowChunk;
    const Index col_groups = (panels + kPanelsPerTask - 1) / kPanelsPerTask;
    parallel_for(row_chunks * col_groups, [&](Index t) {
        const Index r0 = (t / col_groups) * kRowChunk;
        const Index m = std::min(kRowChunk, rows - r0);
        const Index p0 = (t % col_groups) * kPanelsPerTask;
        const Index p1 = std::min(panels, p0 + kPanelsPerTask);
        const T* xr = x + r0 * ldx;
        for (Index p = p0; p < p1; ++p) {
            const Index j0 = p * W, nw = std::min(W, out - j0);
            if (nw == W) {
                T* yb = y + r0 * ldy + j0;
                if (!accumulate) {
                    for (Index r = 0; r < m; ++r) {
                        T* yr = yb + r * ldy;
                        if (b) {
                            std::copy(b + j0, b + j0 + W, yr);
                        } else {
                            std::fill(yr, yr + W, T(0));
                        }
                    }
                }
                panel_gemm(m, in, xr, ldx, w, out, j0, W, yb, ldy);
            } else {  // the last, partial panel: through a padded copy of Y
                T* ypad = detail::scratch<T, 6>(static_cast<std::size_t>(m * W));
                for (Index r = 0; r < m; ++r) {
                    T* yr = ypad + r * W;
                    const T* src = accumulate ? y + (r0 + r) * ldy + j0 : (b ? b + j0 : nullptr);
                    if (src) {
                        std::copy(src, src + nw, yr);
                    } else {
                        std::fill(yr, yr + nw, T(0));
                    }
                    std::fill(yr + nw, yr + W, T(0));
                }
                panel_gemm(m, in, xr, ldx, w, out, j0, nw, ypad, W);
                for (Index r = 0; r < m; ++r)
                    std::copy(ypad + r * W, ypad + r * W + nw, y + (r0 + r) * ldy + j0);
            }
        }
    });
}

template <typename T>
void linear_input_grad(Index rows, Index in, Index out, const T* dy, Index lddy, const T* w, T* dx,
                       Index lddx, bool accumulate) {
    if (rows <= 0 || in <= 0) return;
    const Index chunks = (rows + kRowChunk - 1) / kRowChunk;
    parallel_for(chunks, [&](Index c) {
        const Index r0 = c * kRowChunk;
        const Index m = std::min(kRowChunk, rows - r0);
        RowMap<T> DX(dx + r0 * lddx, m, in, Eigen::OuterStride<>(lddx));
        if (out == 0) {
            if (!accumulate) DX.setZero();
            return;
        }
        ConstRowMap<T> DY(dy + r0 * lddy, m, out, Eigen::OuterStride<>(lddy));
        ConstRowMap<T> W(w, in, out, Eigen::OuterStride<>(out));
        if (accumulate) {
            DX.noalias() += DY * W.transpose();
        } else {
            DX.noalias() = DY * W.transpose();
        }
    });
}

template <typename T>
void linear_weight_grad(Index rows, Index in, Index out, const T* x, Index ldx, const T* dy,
                        Index lddy, T* dw, T* db) {
    if (out <= 0) return;
    if (dw && in > 0) {
        constexpr Index kBlock = 64;
        const Index blocks = (in + kBlock - 1) / kBlock;
        parallel_for(blocks, [&](Index c) {
            const Index i0 = c * kBlock;
            const Index m = std::min(kBlock, in - i0);
            RowMap<T> DW(dw + i0 * out, m, out, Eigen::OuterStride<>(out));
            if (rows == 0) {
                DW.setZero();
                return;
            }
            ConstRowMap<T> X(x + i0, rows, m, Eigen::OuterStride<>(ldx));
            ConstRowMap<T> DY(dy, rows, out, Eigen::OuterStride<>(lddy));
            DW.noalias() = X.transpose() * DY;
        });
    }
    if (db) {
        Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>> DB(db, out);
        DB.setZero();
        for (Index r = 0; r < rows; ++r)
            DB += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(dy + r * lddy, out);
    }
}

template void linear_input_grad<float>(Index, Index, Index, const float*, Index, const float*,
                                       float*, Index, bool);
template void linear_input_grad<double>(Index, Index, Index, const double*, Index, const double*,
                                        double*, Index, bool);
template void linear_weight_grad<float>(Index, Index, Index, const float*, Index, const float*,
                                        Index, float*, float*);
template void linear_weight_grad<double>(Index, Index, Index, const double*, Index,
                                         const double*, Index, double*, double*);

template void linear<float>(Index, Index, Index, const float*, Index, const float*, const float*,
                            float*, Index, bool);
template void linear<double>(Index, Index, Index, const double*, Index, const double*,
                             const double*, double*, Index, bool);

}  // namespace attnlab

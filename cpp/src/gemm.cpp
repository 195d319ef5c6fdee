#include "attnlab/gemm.hpp"

#include "attnlab/threading.hpp"

namespace attnlab {

namespace {
// Fixed chunk height: large enough for Eigen's GEMM to reach its peak, independent of threads.
constexpr Index kRowChunk = 128;
}  // namespace

template <typename T>
void linear(Index rows, Index in, Index out, const T* x, Index ldx, const T* w, const T* b, T* y,
            Index ldy, bool accumulate) {
    if (rows <= 0 || out <= 0) return;
    const Index chunks = (rows + kRowChunk - 1) / kRowChunk;
    parallel_for(chunks, [&](Index c) {
        const Index r0 = c * kRowChunk;
        const Index m = std::min(kRowChunk, rows - r0);
        RowMap<T> Y(y + r0 * ldy, m, out, Eigen::OuterStride<>(ldy));
        if (in == 0) {
            if (!accumulate) {
                if (b) {
                    Y.rowwise() = Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(b, out);
                } else {
                    Y.setZero();
                }
            }
            return;
        }
        ConstRowMap<T> X(x + r0 * ldx, m, in, Eigen::OuterStride<>(ldx));
        ConstRowMap<T> W(w, in, out, Eigen::OuterStride<>(out));
        if (accumulate) {
            Y.noalias() += X * W;
        } else {
            Y.noalias() = X * W;
            if (b) Y.rowwise() += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(b, out);
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

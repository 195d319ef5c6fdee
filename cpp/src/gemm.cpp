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

template void linear<float>(Index, Index, Index, const float*, Index, const float*, const float*,
                            float*, Index, bool);
template void linear<double>(Index, Index, Index, const double*, Index, const double*,
                             const double*, double*, Index, bool);

}  // namespace attnlab

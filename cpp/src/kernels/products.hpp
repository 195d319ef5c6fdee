#pragma once
// Eigen's matrix products, compiled once per instruction set (in gemm.cpp) and called from every
// kernel source through these two functions. Written inline at each call site, every distinct
// expression type (Map, Block, Matrix, their transposes) instantiated Eigen's GEMM and GEMV
// machinery again, for float and double, in every source file of every variant: a third of the
// kernels' compile time. The results are those of the inline expressions: the same Eigen
// product path (GEMM, or GEMV when C has one row or one column; storage orders unchanged).

#include "attnlab/common.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

// C = A B, or C += A B when accumulate (row-major views).
template <typename T>
void eigen_product(const ConstRowMap<T>& a, const ConstRowMap<T>& b, const RowMap<T>& c,
                   bool accumulate = false);

// C = A B^T, or C += A B^T when accumulate (B as stored, row-major).
template <typename T>
void eigen_product_bt(const ConstRowMap<T>& a, const ConstRowMap<T>& b, const RowMap<T>& c,
                      bool accumulate = false);

// C = A B, or C += A B when accumulate, on the panel kernel of the projections (gemm.cpp), in
// this thread: for blocks of rows inside a parallel task. Each entry is one FMA chain over the
// depth, in order (faster than Eigen's GEMM on these blocks: docs/performance.md).
// packed: B's panels as pack_block() laid them out (B contiguous), or null (each call then
// packs them as it goes): the same bits either way.
template <typename T>
void block_product(const ConstRowMap<T>& a, const ConstRowMap<T>& b, const RowMap<T>& c,
                   bool accumulate = false, const T* packed = nullptr);

// block_product with B (a.cols() x c.cols(), contiguous) given as half-precision bits
// (`format`), widened as they are read: the same bits as block_product on the widened B.
void block_product_half(const ConstRowMap<float>& a, const std::uint16_t* b, HalfFormat format,
                        const RowMap<float>& c, bool accumulate = false,
                        const float* packed = nullptr);

// The length of pack_block's copy of a (rows x cols) B.
template <typename T>
Index packed_block_size(Index rows, Index cols);

// B (rows x cols, contiguous: b, or its half-precision bits when set, widened; T float) packed
// into `packed` (packed_block_size(rows, cols)): its whole panels, each contiguous, row after
// row (as pack_weight lays them out), then the last, partial one, its rows padded with zeros to
// whole packets: for a B that block_product reads for many blocks of rows, packed once instead
// of by each call. In this thread, or over the threads when `parallel` (outside a parallel
// region).
template <typename T>
void pack_block(Index rows, Index cols, const T* b, const std::uint16_t* bits, HalfFormat format,
                T* packed, bool parallel = false);

// Row-major views of contiguous or strided blocks.
template <typename T>
ConstRowMap<T> cview(const T* data, Index rows, Index cols, Index stride) {
    return ConstRowMap<T>(data, rows, cols, Eigen::OuterStride<>(stride));
}
template <typename T>
RowMap<T> view(T* data, Index rows, Index cols, Index stride) {
    return RowMap<T>(data, rows, cols, Eigen::OuterStride<>(stride));
}

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

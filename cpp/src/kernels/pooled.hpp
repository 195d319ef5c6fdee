#pragma once
// What the two pooled families' kernels (additive.cpp: SwiftFormer's additive attention,
// separable.cpp: MobileViT-v2's separable self-attention) share: their weights as given
// (PooledWeight), their row blocks and tasks, the projection of a block of rows, the output
// pass with the weights folded with the pooled vector, per-element sums over blocks.

#include <algorithm>
#include <functional>
#include <initializer_list>
#include <type_traits>

#include "attnlab/additive.hpp"
#include "attnlab/common.hpp"
#include "attnlab/gemm.hpp"
#include "attnlab/threading.hpp"
#include "half_convert.hpp"
#include "products.hpp"
#include "project.hpp"
#include "scratch.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

// Rows per GEMM block: large enough for Eigen to reach its peak, fixed so that results never
// depend on the thread count.
inline constexpr Index kRowBlock = 128;
// Rows per task of the output pass: each task scales its own copy of the projection by the
// pooled vector, so a task must cover enough rows to amortise that D x D_out step.
inline constexpr Index kRowsPerTask = 1024;

template <typename T>
using Vec = Eigen::Matrix<T, 1, Eigen::Dynamic>;
template <typename T>
using VecMap = Eigen::Map<Vec<T>>;
template <typename T>
using ConstVecMap = Eigen::Map<const Vec<T>>;

// A weight of the pooled forwards (rows x cols, row-major): its floats (contiguous, or a strided
// column block), or, in the float kernels, the bits of a half dtype as the caller stored them
// (contiguous), widened exactly as they are read: so a half-precision weight is never copied
// whole in float32. pack(): its panels (the last, partial one padded) packed once, in parallel,
// for the products of every block of rows, rather than by each block (the same bits).
template <typename T>
class PooledWeight {
  public:
    PooledWeight(const T* w, Index rows, Index cols, Index stride)
        : w_(w), rows_(rows), cols_(cols), stride_(stride) {}
    // the floats w, or the bits when set (T float)
    PooledWeight(const T* w, const std::uint16_t* bits, HalfFormat format, Index rows, Index cols)
        : w_(w), bits_(bits), format_(format), rows_(rows), cols_(cols), stride_(cols) {}

    Index rows() const { return rows_; }
    Index cols() const { return cols_; }

    // a strided view (a column block) is read in place by each block instead
    void pack() {
        if (stride_ != cols_ || rows_ == 0) return;
        packed_ = make_buffer<T>(packed_block_size<T>(rows_, cols_));
        pack_block<T>(rows_, cols_, w_, bits_, format_, packed_.get(), /*parallel=*/true);
    }

    // Y = X W, or Y += X W when accumulate (X: m x rows; in this thread)
    void product(const ConstRowMap<T>& X, const RowMap<T>& Y, bool accumulate = false) const {
        if constexpr (std::is_same_v<T, float>) {
            if (bits_) {
                block_product_half(X, bits_, format_, Y, accumulate, packed_.get());
                return;
            }
        }
        block_product<T>(X, ConstRowMap<T>(w_, rows_, cols_, Eigen::OuterStride<>(stride_)), Y,
                         accumulate, packed_.get());
    }

    // dst (rows x cols, row stride ld) = W
    void copy_to(T* dst, Index ld) const {
        for (Index i = 0; i < rows_; ++i) row_to(i, dst + i * ld);
    }

    // dst (rows x cols, row stride ld) = diag(scale) W: each element one product, as Eigen's
    void scaled_to(const T* scale, T* dst, Index ld) const {
        for (Index i = 0; i < rows_; ++i) {
            row_to(i, dst + i * ld);
            VecMap<T>(dst + i * ld, cols_) *= scale[i];
        }
    }

  private:
    // row i of W into dst (cols floats)
    void row_to(Index i, T* dst) const {
        if constexpr (std::is_same_v<T, float>) {
            if (bits_) {
                half_to_float(bits_ + i * cols_, cols_, format_, dst);
                return;
            }
        }
        std::copy(w_ + i * stride_, w_ + i * stride_ + cols_, dst);
    }

    const T* w_ = nullptr;
    const std::uint16_t* bits_ = nullptr;
    HalfFormat format_ = HalfFormat::none;
    Index rows_ = 0, cols_ = 0, stride_ = 0;
    Buffer<T> packed_;
};

// Y = X W + b over a block of rows (X: m x W.rows()).
template <typename T>
void project(const ConstRowMap<T>& X, const PooledWeight<T>& W, const T* b, const RowMap<T>& Y) {
    RowMap<T> dst = Y;  // the view is const, not what it maps
    if (X.cols() == 0) {
        dst.setZero();
    } else {
        W.product(X, Y);
    }
    if (b) dst.rowwise() += ConstVecMap<T>(b, Y.cols());
}

// One product of project_block: X W + b.
template <typename T>
struct Projection {
    const PooledWeight<T>* w;
    const T* b = nullptr;
};

// Rows [r0, r0 + m) of x (width in) times each projection, side by side, into this thread's
// kAdditiveRows block (m x the sum of their widths): the first step of both forwards (the
// additive one's [K | Q] from w_k and w_q as given: no stacked copy of them). With h.x, x's
// rows are those half-precision bits, widened into a block of this thread first (exactly: the
// same products).
template <typename T>
auto project_block(const T* x, Index r0, Index m, Index in,
                   std::initializer_list<Projection<T>> products, const HalfTokens& h) {
    if constexpr (std::is_same_v<T, float>) {
        if (h.x) {
            float* w = scratch<float>(ScratchBuffer::kAdditiveHalfRows,
                                      static_cast<std::size_t>(std::max<Index>(m * in, 1)));
            half_rows_to_float(h.x + r0 * in, in, m, in, h.format, w);
            x = w - r0 * in;
        }
    }
    ConstRowMap<T> X(x + r0 * in, m, in, Eigen::OuterStride<>(std::max<Index>(in, 1)));
    Index width = 0;
    for (const Projection<T>& q : products) width += q.w->cols();
    auto Y = scratch_matrix<T>(ScratchBuffer::kAdditiveRows, m, width);
    Index c0 = 0;
    for (const Projection<T>& q : products) {
        project<T>(X, *q.w, q.b, view<T>(Y.data() + c0, m, q.w->cols(), width));
        c0 += q.w->cols();
    }
    return Y;
}

// Calls fn(task, b, i0, m) for every block of kRowBlock rows [i0, i0 + m) of every batch
// element b, in parallel; task = b * blocks_per_element + block (fixed: thread-count free).
template <typename F>
void for_batch_blocks(Index B, Index n, F fn) {
    const Index per = (n + kRowBlock - 1) / kRowBlock;
    parallel_for(B * per, [&](Index task) {
        const Index b = task / per, i0 = (task % per) * kRowBlock;
        fn(task, b, i0, std::min(kRowBlock, n - i0));
    });
}

// Rows [r0, r0 + m) of a forward's output (d_out wide): out's own rows, or, when out is null
// (written in half precision, h.out), this thread's block, which finish_output_rows rounds.
template <typename T>
T* output_rows(T* out, Index r0, Index m, Index dout) {
    return out ? out + r0 * dout
               : scratch<T>(ScratchBuffer::kAdditiveHalfOut,
                            static_cast<std::size_t>(std::max<Index>(m * dout, 1)));
}

template <typename T>
void finish_output_rows(const T* y, const HalfTokens& h, Index r0, Index m, Index dout) {
    if constexpr (std::is_same_v<T, float>)
        if (h.out) narrow_block(y, m * dout, h.format, h.out + r0 * dout);
}

// The last step of both forwards. Per task of at most kRowsPerTask rows of batch element b: the
// weights folded with b's pooled vector, Wb = diag(pooled_b) W (width x d_out), once per task,
// and its panels packed (block_product's `packed`); then apply(X, Y, Wb, packed) for each block
// of kRowBlock rows, X the block of x (rows x width) and Y the same rows of y (rows x d_out).
// With h.out, Y's rows are then rounded to those half-precision rows; y may then be null (Y is
// a block of this thread).
template <typename T, typename F>
void folded_rows(Index B, Index n, Index width, Index dout, const T* pooled,
                 const PooledWeight<T>& W, const T* x, T* y, const HalfTokens& h, F apply) {
    const auto ceil_div = [](Index a, Index b) { return (a + b - 1) / b; };
    const Index wanted =
        2 * static_cast<Index>(get_num_threads());  // (results do not depend on it)
    const Index per =
        std::max(ceil_div(n, kRowsPerTask), std::min(ceil_div(wanted, B), ceil_div(n, kRowBlock)));
    const Index len = ceil_div(n, std::max<Index>(per, 1));
    parallel_for(B * per, [&](Index t) {
        const Index b = t / per, r0 = (t % per) * len;
        const Index r1 = std::min(n, r0 + len);
        auto Wb = scratch_matrix<T>(ScratchBuffer::kAdditiveFolded, width, dout);
        W.scaled_to(pooled + b * width, Wb.data(), dout);
        T* packed = scratch<T>(
            ScratchBuffer::kAdditivePacked,
            static_cast<std::size_t>(std::max<Index>(packed_block_size<T>(width, dout), 1)));
        pack_block<T>(width, dout, Wb.data(), nullptr, HalfFormat::none, packed);
        for (Index i0 = r0; i0 < r1; i0 += kRowBlock) {
            const Index m = std::min(kRowBlock, r1 - i0), row = b * n + i0;
            ConstRowMap<T> X(x + row * width, m, width, Eigen::OuterStride<>(width));
            T* yb = output_rows(y, row, m, dout);
            RowMap<T> Y(yb, m, dout, Eigen::OuterStride<>(dout));
            apply(X, Y, Wb, packed);
            finish_output_rows(yb, h, row, m, dout);
        }
    });
}

// Step 1 of both forwards over every block of rows (for_batch_blocks): pool(P, task, b, i0, m)
// with P the block's projected rows (width wide), project(r0, m)'s block of this thread, or,
// with `projected` (rows x width, the bf16 forwards'), those rows there once fill(r0, m) wrote
// them.
template <typename T, typename Project, typename Pool>
void pool_blocks(Index B, Index n, Index width, T* projected,
                 const std::function<void(Index, Index)>& fill, Project project, Pool pool) {
    for_batch_blocks(B, n, [&](Index task, Index b, Index i0, Index m) {
        const Index r0 = b * n + i0;
        if (projected) {
            fill(r0, m);
            RowMap<T> P(projected + r0 * width, m, width, Eigen::OuterStride<>(width));
            pool(P, task, b, i0, m);
        } else {
            auto P = project(r0, m);
            pool(P, task, b, i0, m);
        }
    });
}

// Per batch element, the sum over its blocks of kRowBlock rows of the shares fn(b, i0, m,
// share) writes (length `width`): blocks in parallel, then added in block order in double
// (B x width).
template <typename T, typename F>
RowMatrix<double> block_sums(Index B, Index n, Index width, F fn) {
    const Index per = (n + kRowBlock - 1) / kRowBlock;
    auto partial_buf = make_buffer<double>(B * per * width);
    Eigen::Map<RowMatrix<double>> partial(partial_buf.get(), B * per, width);
    for_batch_blocks(B, n, [&](Index task, Index b, Index i0, Index m) {
        auto share = scratch_vector<T>(ScratchBuffer::kAdditiveShare, width);
        fn(b, i0, m, share);
        partial.row(task) = share.template cast<double>();
    });
    RowMatrix<double> sums = RowMatrix<double>::Zero(B, width);
    parallel_for(B, [&](Index b) {
        for (Index k = 0; k < per; ++k) sums.row(b) += partial.row(b * per + k);
    });
    return sums;
}

// Calls fn(r0, m) for fixed blocks of kRowBlock rows of [0, rows), in parallel (row-local work).
// With min_blocks (for work whose results do not depend on the blocks): that many blocks of
// equal size at least, so that few rows still keep every thread busy.
template <typename F>
void for_row_blocks(Index rows, F fn, Index min_blocks = 1) {
    Index count = (rows + kRowBlock - 1) / kRowBlock, len = kRowBlock;
    if (count < min_blocks && rows > 0) {
        count = std::min(min_blocks, rows);
        len = (rows + count - 1) / count;
        count = (rows + len - 1) / len;
    }
    parallel_for(count, [&](Index c) {
        const Index r0 = c * len;
        fn(r0, std::min(len, rows - r0));
    });
}

// The output pass of both forms as written, over blocks of the B n rows (equal, at least two a
// thread: each row's result is the same in any block): per block, Z = its rows of X (ld apart,
// width wide) each times its batch element's pooled vector (pooled: B x width, n rows an
// element), then rows(r0, m, Z, Y) writes the block's output Y (m x d_out: out's rows, or a
// block of this thread rounded into h.out's rows).
template <typename T, typename F>
void written_rows(Index B, Index n, Index width, Index dout, const T* X, Index ld, const T* pooled,
                  T* out, const HalfTokens& h, F rows) {
    for_row_blocks(
        B * n,
        [&](Index r0, Index m) {
            T* z = scratch<T>(ScratchBuffer::kAdditiveRows, static_cast<std::size_t>(m * width));
            for (Index i = 0; i < m; ++i) {
                const T* x = X + (r0 + i) * ld;
                const T* g = pooled + ((r0 + i) / n) * width;
                for (Index j = 0; j < width; ++j) z[i * width + j] = g[j] * x[j];
            }
            T* y = output_rows(out, r0, m, dout);
            rows(r0, m, static_cast<const T*>(z), y);
            finish_output_rows(y, h, r0, m, dout);
        },
        2 * static_cast<Index>(get_num_threads()));
}

template <typename T>
void fill_zero(T* p, Index count) {
    if (p) std::fill(p, p + std::max<Index>(count, 0), T(0));
}

// The backward's products that read grad_out (d_out wide), as HalfGradOperands: its bits when
// h has them.
inline HalfGradOperands half_grad_out(const HalfTokens& h) {
    return {nullptr, h.grad_out, nullptr, h.format};
}

// Row r of grad_out (d_out wide) as T: in place, or widened from h.grad_out into `row`.
template <typename T>
const T* grad_out_row(const T* grad_out, const HalfTokens& h, Index r, Index dout, T* row) {
    if constexpr (std::is_same_v<T, float>) {
        if (h.grad_out) {
            half_to_float(h.grad_out + r * dout, dout, h.format, row);
            return row;
        }
    }
    return grad_out + r * dout;
}

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

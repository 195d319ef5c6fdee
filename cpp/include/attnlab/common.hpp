#pragma once
// Types shared by every kernel: strided matrix views and the mask description.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>

#include <Eigen/Core>

namespace attnlab {

using Index = std::int64_t;

template <typename T>
using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using RowMap = Eigen::Map<RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <typename T>
using ConstRowMap = Eigen::Map<const RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

// A stack of row-major matrices indexed by (batch, head); element (b, h, i, j) is at
// data[b * batch_stride + h * head_stride + i * row_stride + j]. Heads of a packed projection
// are column blocks: head_stride = d_head, row_stride = h * d_head. A zero stride broadcasts.
template <typename T>
struct MatrixStack {
    T* data = nullptr;
    Index batch_stride = 0;
    Index head_stride = 0;
    Index row_stride = 0;

    T* at(Index b, Index h) const { return data + b * batch_stride + h * head_stride; }
};

struct FreeDeleter {
    void operator()(void* p) const noexcept { std::free(p); }
};
template <typename T>
using Buffer = std::unique_ptr<T[], FreeDeleter>;

// An uninitialised heap buffer (no zero-fill cost), 64-byte aligned; throws std::bad_alloc when
// it cannot be allocated (also under AddressSanitizer, whose failing operator new aborts).
template <typename T>
Buffer<T> make_buffer(Index n) {
    const std::size_t count = static_cast<std::size_t>(n > 0 ? n : 1);
    if (count > (std::numeric_limits<std::size_t>::max() - 63) / sizeof(T)) throw std::bad_alloc();
    void* p = std::aligned_alloc(64, (count * sizeof(T) + 63) / 64 * 64);
    if (!p) throw std::bad_alloc();
    return Buffer<T>(static_cast<T*>(p));
}

enum class Causal : int { none = 0, top_left = 1, bottom_right = 2 };
enum class MaskKind : int { none = 0, boolean = 1, additive = 2 };

// Which (query, key) pairs may attend, and what is added to their scaled scores.
// mask element (b, h, i, j) at mask[b*sb + h*sh + i*sq + j*sk]; key_padding (b, j) at
// key_padding[b*kp_sb + j*kp_sk]. Booleans are bytes, nonzero meaning "may attend".
template <typename T>
struct MaskSpec {
    MaskKind kind = MaskKind::none;
    const std::uint8_t* boolean = nullptr;
    const T* additive = nullptr;
    Index sb = 0, sh = 0, sq = 0, sk = 0;
    const std::uint8_t* key_padding = nullptr;
    Index kp_sb = 0, kp_sk = 0;
    Causal causal = Causal::none;
};

}  // namespace attnlab

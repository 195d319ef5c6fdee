#pragma once
// Types shared by every kernel: strided matrix views and the mask description.
//
// The kernel sources (cpp/src) are compiled once per instruction set, each build inside its own
// namespace attnlab::ATTNLAB_ISA_NS (isa_generic, isa_avx2, ...; set by CMake), with Eigen's
// namespace renamed per build too (-DEigen=attnlab_eigen_<isa>), so that no inline function or
// template instantiation compiled for one instruction set can stand in for another's at link
// time. The plain structs here are shared with the bindings (compiled once); what touches Eigen
// or is only used by the kernels lives in the per-ISA namespace, in kernel builds only.

#include <cstddef>
#include <cstdint>

#if defined(ATTNLAB_ISA_NS)
#define ATTNLAB_KERNEL_BUILD 1
#include <Eigen/Core>
#else
#define ATTNLAB_ISA_NS isa_declarations_only  // bindings and shared code: never defined
#endif

namespace attnlab {

using Index = std::int64_t;

#if defined(ATTNLAB_KERNEL_BUILD)
namespace ATTNLAB_ISA_NS {
template <typename T>
using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using RowMap = Eigen::Map<RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <typename T>
using ConstRowMap = Eigen::Map<const RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
}  // namespace ATTNLAB_ISA_NS
#endif

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

enum class Causal : int { none = 0, top_left = 1, bottom_right = 2 };
enum class MaskKind : int { none = 0, boolean = 1, additive = 2 };

// Optional per-batch token mask: element (b, j) at data[b * sb + j * sk], nonzero = real token.
// The key padding of every family (additive and separable attention have no other mask).
struct TokenMask {
    const std::uint8_t* data = nullptr;
    Index sb = 0, sk = 0;

    bool real(Index b, Index j) const { return !data || data[b * sb + j * sk] != 0; }
};

// Which (query, key) pairs may attend, and what is added to their scaled scores: the one
// struct that carries every mask option from the bindings to the kernels (a new option is a
// field here, read in apply_mask / tile_needs_mask, cpp/src/softmax.hpp).
// mask element (b, h, i, j) at mask[b*sb + h*sh + i*sq + j*sk]. Booleans are bytes, nonzero
// meaning "may attend".
template <typename T>
struct MaskSpec {
    MaskKind kind = MaskKind::none;
    const std::uint8_t* boolean = nullptr;
    const T* additive = nullptr;
    Index sb = 0, sh = 0, sq = 0, sk = 0;
    TokenMask key_padding;
    Causal causal = Causal::none;
};

}  // namespace attnlab

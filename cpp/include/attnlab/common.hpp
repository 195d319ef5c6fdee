#pragma once
// Types shared by every kernel: strided matrix views and the mask description.
//
// The kernel sources (cpp/src/kernels) are compiled once per instruction set, each build inside its
// own namespace attnlab::ATTNLAB_ISA_NS (isa_generic, isa_avx2, ...; set by CMake), with Eigen's
// namespace renamed per build too (-DEigen=attnlab_eigen_<isa>), so that no inline function or
// template instantiation compiled for one instruction set can stand in for another's at link
// time. The plain structs here are shared with the bindings (compiled once); what touches Eigen
// or is only used by the kernels lives in the per-ISA namespace, in kernel builds only.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

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

// Arrays stored in half precision, passed as their bits: float16 or bfloat16
enum class HalfFormat : int { none = 0, float16 = 1, bfloat16 = 2 };
enum class MaskKind : int { none = 0, boolean = 1, additive = 2 };

// Optional per-batch token mask: element (b, j) at data[b * sb + j * sk], nonzero = real token.
// The key padding of every family (additive and separable attention have no other mask).
struct TokenMask {
    const std::uint8_t* data = nullptr;
    Index sb = 0, sk = 0;

    bool real(Index b, Index j) const { return !data || data[b * sb + j * sk] != 0; }
};

// The scalar mask options. Each lets query i see only an interval of keys, key_interval
// below; a new one is a field here, its entry in for_each_option and its rule in key_interval:
// this header alone (the bindings read the fields through for_each_option, the kernels skip
// and mask by key_interval; docs/architecture.md §4).
struct MaskOptions {
    Causal causal = Causal::none;
    // sliding window around the query's aligned key p(i): keys p(i) - left .. p(i) + right;
    // -1 leaves that side unbounded
    Index window_left = -1;
    Index window_right = -1;
    // logit soft-capping s -> softcap * tanh(s / softcap) before masks and biases; 0: off
    double softcap = 0;
};

// f(name, field, min, max) for each field of o, in the order of Python's mask tuple after its
// arrays (attnlab._args.CoreMask): the name errors give, the values the kernels accept. Used by
// the bindings alone (their conversion of the tuple, mask_args).
template <typename F>
void for_each_option(MaskOptions& o, F&& f) {
    f("causal", o.causal, 0, 2);
    f("window_left", o.window_left, -1, std::numeric_limits<Index>::max());
    f("window_right", o.window_right, -1, std::numeric_limits<Index>::max());
    f("softcap", o.softcap, 0.0, std::numeric_limits<double>::max());
}

// Which (query, key) pairs may attend, and what is added to their scaled scores: the one
// struct that carries every mask option from the bindings to the kernels (the arrays read in
// apply_mask, cpp/src/kernels/softmax.hpp; the scalar options through key_interval).
// mask element (b, h, i, j) at mask[b*sb + h*sh + i*sq + j*sk]. Booleans are bytes, nonzero
// meaning "may attend".
template <typename T>
struct MaskSpec {
    MaskKind kind = MaskKind::none;
    const std::uint8_t* boolean = nullptr;
    const T* additive = nullptr;
    Index sb = 0, sh = 0, sq = 0, sk = 0;
    TokenMask key_padding;
    MaskOptions options;
    // per (batch, head) arrays, element (b, h) at [b * sb + h * sh]: ALiBi slopes (adds
    // -slope * |p(i) - j| to the logits) and sinks (a logit with no value in every row's softmax)
    const T* alibi = nullptr;
    Index alibi_sb = 0, alibi_sh = 0;
    const T* sinks = nullptr;
    Index sinks_sb = 0, sinks_sh = 0;

    T slope(Index b, Index h) const { return alibi[b * alibi_sb + h * alibi_sh]; }
    T sink(Index b, Index h) const { return sinks[b * sinks_sb + h * sinks_sh]; }
};

#if defined(ATTNLAB_KERNEL_BUILD)
namespace ATTNLAB_ISA_NS {
// A run [lo, hi) of keys or queries.
struct Interval {
    Index lo = 0, hi = 0;
};

// The keys [lo, hi) (0 <= lo <= hi <= n_k) that query i of n_q may see under the scalar mask
// options: their meaning, in one place. Both ends never decrease as i grows; the tile ranges
// and tile_needs_mask (cpp/src/kernels/softmax.hpp) rely on that.
// The key p(i) query i is aligned with: i, or i + n_k - n_q for bottom_right (the last query
// with the last key). The window and ALiBi distances count from it.
inline Index aligned_key(const MaskOptions& o, Index n_q, Index n_k, Index i) {
    return i + (o.causal == Causal::bottom_right ? n_k - n_q : 0);
}

inline Interval key_interval(const MaskOptions& o, Index n_q, Index n_k, Index i) {
    const Index align = aligned_key(o, n_q, n_k, i);
    Index lo = 0, hi = n_k;
    if (o.causal != Causal::none) hi = std::min(hi, align + 1);  // no key after the aligned one
    // the window's sides clamped to n_q + n_k first, so that no sum overflows
    const Index reach = n_q + n_k;
    if (o.window_left >= 0) lo = std::max(lo, align - std::min(o.window_left, reach));
    if (o.window_right >= 0) hi = std::min(hi, align + std::min(o.window_right, reach) + 1);
    lo = std::clamp<Index>(lo, 0, n_k);
    return {lo, std::clamp<Index>(hi, lo, n_k)};
}
}  // namespace ATTNLAB_ISA_NS
#endif

}  // namespace attnlab

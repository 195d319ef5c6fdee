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
#include <cstdlib>
#if defined(_MSC_VER)
#include <malloc.h>
#endif
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <new>

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

#if defined(ATTNLAB_KERNEL_BUILD)
namespace ATTNLAB_ISA_NS {
namespace detail {

// Recycles the kernels' large temporary buffers. Fresh memory from the OS costs a page fault per
// 4 KiB on first touch; for an MHA forward at the ViT-S shape (five 2.4 MB buffers) that was a
// quarter of the time. Blocks are kept by exact (page-rounded) size up to kCapBytes in all, so
// repeated calls with the same shapes reuse them and the memory held stays bounded.
class BufferPool {
public:
    static BufferPool& instance() {
        static BufferPool* pool = new BufferPool;  // never destroyed: no exit-order hazards
        return *pool;
    }
    static std::size_t round(std::size_t bytes) { return (bytes + 4095) / 4096 * 4096; }

    void* get(std::size_t bytes) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            auto it = free_.find(bytes);
            if (it != free_.end()) {
                void* p = it->second;
                free_.erase(it);
                cached_ -= bytes;
                return p;
            }
        }
#if defined(_MSC_VER)
        void* p = _aligned_malloc(bytes, 64);  // the MSVC runtime has no std::aligned_alloc
#else
        void* p = std::aligned_alloc(64, bytes);
#endif
        if (!p) throw std::bad_alloc();
        return p;
    }
    void put(void* p, std::size_t bytes) noexcept {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (cached_ + bytes <= kCapBytes) {
                try {
                    free_.emplace(bytes, p);
                    cached_ += bytes;
                    return;
                } catch (...) {  // no room for the entry: just free the block
                }
            }
        }
#if defined(_MSC_VER)
        _aligned_free(p);
#else
        std::free(p);
#endif
    }

private:
    static constexpr std::size_t kCapBytes = std::size_t(64) << 20;
    std::mutex mutex_;
    std::multimap<std::size_t, void*> free_;
    std::size_t cached_ = 0;
};

struct PoolDeleter {
    std::size_t bytes = 0;
    void operator()(void* p) const noexcept { BufferPool::instance().put(p, bytes); }
};

}  // namespace detail

template <typename T>
using Buffer = std::unique_ptr<T[], detail::PoolDeleter>;

// An uninitialised heap buffer (no zero-fill cost), 64-byte aligned, recycled through
// detail::BufferPool; throws std::bad_alloc when it cannot be allocated (also under
// AddressSanitizer, whose failing operator new aborts).
template <typename T>
Buffer<T> make_buffer(Index n) {
    const std::size_t count = static_cast<std::size_t>(n > 0 ? n : 1);
    if (count > (std::numeric_limits<std::size_t>::max() - 8191) / sizeof(T)) throw std::bad_alloc();
    const std::size_t bytes = detail::BufferPool::round(count * sizeof(T));
    return Buffer<T>(static_cast<T*>(detail::BufferPool::instance().get(bytes)),
                     detail::PoolDeleter{bytes});
}
}  // namespace ATTNLAB_ISA_NS
#endif

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

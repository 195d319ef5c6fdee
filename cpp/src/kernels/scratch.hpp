#pragma once
// The kernels' temporary memory: one mechanism, two lifetimes, every buffer named.
//
//   scratch<T>(ScratchBuffer::kFlashScores, n)   per-thread tile memory, for the work of one
//       parallel_for task (a tile, a block of rows). Each thread keeps one block per name that
//       only grows, so tasks never allocate once the shapes have been seen. 64-byte aligned
//       (the tiles use aligned packet loads). Valid until the same thread asks for the same
//       name again: a name belongs to one function, which never calls another user of it.
//   make_buffer<T>(n)                            per-call working arrays shared by the tasks of
//       a call (projections, partial sums, gradients). Owned by the caller (Buffer<T>, freed
//       at scope exit) and recycled by size through detail::BufferPool, so repeated calls with
//       the same shapes reuse pages instead of faulting fresh ones in.
//
// Both are uninitialised. Nothing else allocates in hot code: no std::vector, no Eigen
// matrices held by value inside tasks (scratch_matrix gives an Eigen view of a named block with
// the same alignment and strides as the matrix it replaces, so Eigen evaluates it the same way
// and results stay bitwise the same). Internal to cpp/src/kernels: not part of the public headers.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(_MSC_VER)
#include <malloc.h>
#endif
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <new>

#include "attnlab/common.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp

// The per-thread tile buffers, by owner. Adding one: a name here and its user's comment.
enum class ScratchBuffer : int {
    kFlashQueries,       // flash_tile: scale * Q^T of the query tile (d x padded queries)
    kFlashScores,        // flash_tile: S^T then P^T of one key block (keys x padded queries)
    kFlashAccumulator,   // flash_tile: P V (queries x d_v) or (P V)^T, unnormalised
    kFlashStats,         // flash_tile: running max, sum and rescale (3 x padded queries)
    kValueFlags,         // flash_tile: which value rows of a key block hold NaN/Inf
    kDenseQueries,       // dense_tile: scale * Q of the query tile
    kDenseProbs,         // dense_tile: the weights rounded to bf16 (precision="bf16")
    kBf16Queries,        // amx_tile: the query block in bf16, row-major then as B tiles
    kBf16Probs,          // amx_tile: P^T of two key blocks in bf16 (B tiles)
    kFlaggedRows,        // flash_tile, dense_tile: value rows holding NaN/Inf in a key block
    kFlaggedSees,        // flash_tile, dense_tile: which queries may see each flagged row
    kValueCopy,          // flash_tile, dense_tile: a value block with the flagged rows zeroed
    kDecodeQueries,      // decode_split: scale * q of the rows of a kv head group
    kDecodeScores,       // decode_split: scores and probabilities of a key block (rows x keys)
    kDecodeAccumulator,  // decode_split: unnormalised context of the rows (rows x padded d_v)
    kDecodeRounded,      // decode_split: a block of K and V rounded to bf16 (precision="bf16")
    kHalfKeys,           // forward_half_tiles: a kv head's keys widened (n_k x d), kept
    kHalfValues,         // forward_half_tiles: its values widened (n_k x d_v)
    kHalfFlags,          // forward_half_tiles: which of its value rows hold NaN/Inf
    kHalfQueries,        // forward_half_tiles: the query tile widened (rows x d)
    kHalfOutput,         // forward_half_tiles: the output tile before rounding (rows x d_v)
    kHalfWeights,        // forward_half_tiles: the tile's weights before rounding (rows x n_k)
    kBilinearWeight,     // project_heads: a head's half-precision W_i widened (d_q x d_k), kept
    kBilinearRows,       // project_heads: a row chunk of half-precision X widened (rows x d)
    kMergeRows,          // merge_attention: a row's sum (rounded into a half-precision output)
    kBackwardTiles,      // backward_task: K^T, V^T, padded K, dK^T, dV^T, S/P, dP/dS of a tile
    kGemmPanel,          // panel_gemm: a depth chunk of the B panel, zero-padded
    kGemmEdge,           // gemm_panel: the padded copy of a partial last panel of Y
    kGemmHalfRows,       // gemm: a row chunk of a half-precision X widened (rows x depth), kept
    kGemmHalfOut,        // gemm: a task's rows of Y before rounding to half (rows x cols)
    kGemmTiles,          // linear_bf16_packed, vdp_linear_block: the sums of a task's column blocks
    kBf16Streamed,       // linear_bf16_streamed: a rounded weight row and a task's sums
    kBf16BlockRows,      // Bf16Weight::product: the block's rows rounded (packed, or floats)
    kBf16BlockSums,      // Bf16Weight::product: a 32-row block's sums (32 x padded columns)
    kAdditiveRows,       // additive/separable forward: one row block's projections
    kAdditiveShare,      // additive/separable forward: a row block's share of the pooled vector
    kAdditiveWeights,    // additive/separable: a row block's token weights, a batch row's scores
    kAdditivePooled,     // additive/separable forward: a batch row's pooled vector, in double
    kAdditiveFolded,     // additive/separable forward: the weights folded with the pooled vector
    kAdditivePacked,     // additive/separable forward: those folded weights' panels, packed
    kAdditiveHalfRows,   // additive/separable forward: a row block of half-precision x widened
    kAdditiveHalfOut,    // separable forward: a row block of the output before rounding to half
    kCount
};

namespace detail {

// Blocks from this size on are placed on 2 MiB boundaries and asked for transparent huge
// pages, as NumPy and attnlab's Python arrays are (where the system's setting is "madvise").
inline constexpr std::size_t kHugePageBytes = std::size_t(4) << 20;

inline void* aligned_bytes(std::size_t bytes) {
#if defined(_MSC_VER)
    void* p = _aligned_malloc(bytes, 64);  // the MSVC runtime has no std::aligned_alloc
#elif defined(MADV_HUGEPAGE)
    constexpr std::size_t kHuge = std::size_t(2) << 20;
    void* p = nullptr;
    if (bytes >= kHugePageBytes) {
        const std::size_t whole = (bytes + kHuge - 1) / kHuge * kHuge;
        p = std::aligned_alloc(kHuge, whole);
        if (p) madvise(p, whole, MADV_HUGEPAGE);  // a hint: ignored where it cannot apply
    } else {
        p = std::aligned_alloc(64, bytes);
    }
#else
    void* p = std::aligned_alloc(64, bytes);
#endif
    if (!p) throw std::bad_alloc();
    return p;
}

inline void free_aligned(void* p) noexcept {
#if defined(_MSC_VER)
    _aligned_free(p);
#else
    std::free(p);
#endif
}

// Bytes for n elements of T, rounded up to whole 4 KiB pages; throws std::bad_alloc on
// overflow (also under AddressSanitizer, whose failing operator new aborts).
template <typename T>
std::size_t page_bytes(Index n) {
    const std::size_t count = static_cast<std::size_t>(n > 0 ? n : 1);
    if (count > (std::numeric_limits<std::size_t>::max() - 8191) / sizeof(T))
        throw std::bad_alloc();
    return (count * sizeof(T) + 4095) / 4096 * 4096;
}

// Recycles the per-call buffers. Fresh memory from the OS costs a page fault per 4 KiB on first
// touch; for an MHA forward at the ViT-S shape (five 2.4 MB buffers) that was a quarter of the
// time. Blocks are kept by exact (page-rounded) size up to kCapBytes in all, so repeated calls
// with the same shapes reuse them and the memory held stays bounded.
class BufferPool {
  public:
    static BufferPool& instance() {
        static BufferPool* pool = new BufferPool;  // never destroyed: no exit-order hazards
        return *pool;
    }

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
        return aligned_bytes(bytes);
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
        free_aligned(p);
    }

  private:
    static constexpr std::size_t kCapBytes = std::size_t(256) << 20;  // as Python's arrays
    std::mutex mutex_;
    std::multimap<std::size_t, void*> free_;
    std::size_t cached_ = 0;
};

struct PoolDeleter {
    std::size_t bytes = 0;
    void operator()(void* p) const noexcept { BufferPool::instance().put(p, bytes); }
};

// One thread's named blocks for element type T.
template <typename T>
class ThreadScratch {
  public:
    ThreadScratch() = default;
    ThreadScratch(const ThreadScratch&) = delete;
    ThreadScratch& operator=(const ThreadScratch&) = delete;
    ~ThreadScratch() {
        for (Block& b : blocks_) free_aligned(b.data);
    }

    T* get(ScratchBuffer name, std::size_t n) {
        Block& b = blocks_[static_cast<int>(name)];
        if (b.size < n || !b.data) {  // grows only: the next task of the same shape finds it ready
            if (n > std::numeric_limits<std::size_t>::max() / sizeof(T) - 64)
                throw std::bad_alloc();
            void* fresh = aligned_bytes((std::max<std::size_t>(n, 1) * sizeof(T) + 63) / 64 * 64);
            free_aligned(b.data);
            b.data = static_cast<T*>(fresh);
            b.size = n;
        }
        return b.data;
    }

  private:
    struct Block {
        T* data = nullptr;
        std::size_t size = 0;
    };
    Block blocks_[static_cast<int>(ScratchBuffer::kCount)];
};

}  // namespace detail

// This thread's block `name`, at least n elements, 64-byte aligned, uninitialised.
template <typename T>
T* scratch(ScratchBuffer name, std::size_t n) {
    thread_local detail::ThreadScratch<T> blocks;
    return blocks.get(name, n);
}

// scratch() seen as a rows x cols row-major Eigen matrix (or a row vector): the same type of
// view Eigen gives its own aligned temporaries, so expressions over it evaluate identically.
template <typename T>
Eigen::Map<RowMatrix<T>, Eigen::AlignedMax> scratch_matrix(ScratchBuffer name, Index rows,
                                                           Index cols) {
    return {scratch<T>(name, static_cast<std::size_t>(rows * cols)), rows, cols};
}
template <typename T>
Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>, Eigen::AlignedMax> scratch_vector(
    ScratchBuffer name, Index n) {
    return {scratch<T>(name, static_cast<std::size_t>(n)), n};
}

template <typename T>
using Buffer = std::unique_ptr<T[], detail::PoolDeleter>;

// A per-call buffer of n elements (uninitialised, 64-byte aligned), recycled through
// detail::BufferPool when it goes out of scope.
template <typename T>
Buffer<T> make_buffer(Index n) {
    const std::size_t bytes = detail::page_bytes<T>(n);
    return Buffer<T>(static_cast<T*>(detail::BufferPool::instance().get(bytes)),
                     detail::PoolDeleter{bytes});
}

}  // namespace attnlab::ATTNLAB_ISA_NS

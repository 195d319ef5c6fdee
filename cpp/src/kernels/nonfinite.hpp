#pragma once
// The value-row NaN/Inf scan of the attention forward (flash and weights tiles).
//
// Masked-out keys are never read. The rule, for both the flash and the weights path: a key
// whose masked, scaled logit is -inf (boolean mask False, key padding, causal, a float mask of
// -inf) has weight exactly 0 and its value row is not read, so NaN or Inf there reaches no
// output of that query; every other key contributes weight x value (0 x NaN = NaN included).
// The tiles' products would compute 0 x NaN for masked keys, so value rows holding NaN or Inf
// (found once per call by nonfinite_rows, or per key block by value_flags; rare) are taken out
// of the product and added back for the queries that may see them.

#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attnlab/attention.hpp"
#include "attnlab/threading.hpp"
#include "scratch.hpp"
#include "softmax.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

// True where a value row holds NaN or Inf, on the bits: a row's largest magnitude pattern is
// that of infinity or above exactly when it holds Inf or NaN, and an integer max vectorises.
template <typename T>
bool nonfinite_row(const T* row, Index n) {
    using Bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
    static_assert(sizeof(Bits) == sizeof(T));
    constexpr Bits kMagnitude = ~Bits(0) >> 1;  // all but the sign bit
    const T inf = std::numeric_limits<T>::infinity();
    Bits inf_bits;
    std::memcpy(&inf_bits, &inf, sizeof inf_bits);
    Bits largest = 0;
    for (Index c = 0; c < n; ++c) {
        Bits u;
        std::memcpy(&u, row + c, sizeof u);
        largest = std::max(largest, static_cast<Bits>(u & kMagnitude));
    }
    return largest >= inf_bits;
}

// Flags (batch, kv_heads, n_k): 1 where the value row holds NaN or Inf. Null when none does.
// In parallel over (batch, kv head) (a scalar isfinite per element, on the calling thread
// alone, showed in a ViT-S call's profile). For the weights path and long sequences; short
// ones scan each key block in the tile instead (value_flags).
template <typename T>
Buffer<std::uint8_t> nonfinite_rows(const AttentionProblem<T>& p) {
    const Index heads = p.batch * p.kv_heads;
    Buffer<std::uint8_t> flags = make_buffer<std::uint8_t>(heads * p.n_k);
    std::atomic<bool> any{false};
    parallel_for(heads, [&](Index t) {
        const T* v = p.v.at(t / p.kv_heads, t % p.kv_heads);
        std::uint8_t* f = flags.get() + t * p.n_k;
        bool found = false;
        for (Index j = 0; j < p.n_k; ++j) {
            f[j] = nonfinite_row(v + j * p.v.row_stride, p.d_v);
            found |= f[j] != 0;
        }
        if (found) any.store(true, std::memory_order_relaxed);
    });
    if (!any.load()) return Buffer<std::uint8_t>();
    return flags;
}

// The flags of value rows [0, kb) (row stride vs), scanned in the tile just before its value
// product reads them (so from cache): null when none holds NaN/Inf. With a few query tiles per
// head this is cheaper than the call's scan over all of V from memory (docs/performance.md),
// and it is one parallel pass fewer.
template <typename T>
const std::uint8_t* value_flags(const T* v, Index vs, Index kb, Index dv) {
    std::uint8_t* flags = nullptr;
    for (Index j = 0; j < kb; ++j)
        if (nonfinite_row(v + j * vs, dv)) {
            if (!flags) {
                flags = scratch<std::uint8_t>(ScratchBuffer::kValueFlags, std::size_t(kb));
                std::fill(flags, flags + kb, std::uint8_t(0));
            }
            flags[j] = 1;
        }
    return flags;
}

// The flagged value rows j of a key block (flags[j] for j < kb, or null) and, for each, which of
// the mq queries may see it: its masked score, entry (query i, key j) at s[i * qs + j * ks], is not
// -inf. Taken before the exp overwrites the scores.
struct FlaggedRows {
    const Index* rows = nullptr;
    const std::uint8_t* sees = nullptr;  // (count, mq)
    Index count = 0;
};

template <typename T>
FlaggedRows flagged_rows(const std::uint8_t* flags, Index kb, const T* s, Index qs, Index ks,
                         Index mq) {
    FlaggedRows f;
    if (!flags) return f;
    Index* rows = nullptr;
    for (Index j = 0; j < kb; ++j)
        if (flags[j]) {
            if (!rows)
                rows = scratch<Index>(ScratchBuffer::kFlaggedRows, static_cast<std::size_t>(kb));
            rows[f.count++] = j;
        }
    if (f.count == 0) return f;
    std::uint8_t* sees =
        scratch<std::uint8_t>(ScratchBuffer::kFlaggedSees, static_cast<std::size_t>(f.count * mq));
    for (Index r = 0; r < f.count; ++r)
        for (Index i = 0; i < mq; ++i) sees[r * mq + i] = s[i * qs + rows[r] * ks] != neg_inf<T>();
    f.rows = rows;
    f.sees = sees;
    return f;
}

// A copy of value rows [0, kb) (row stride vs) with the flagged rows zeroed, row stride dv.
template <typename T>
const T* value_copy_without(const T* v, Index vs, Index kb, Index dv, const FlaggedRows& bad) {
    T* buf = scratch<T>(ScratchBuffer::kValueCopy, static_cast<std::size_t>(kb * dv));
    for (Index j = 0; j < kb; ++j) std::copy(v + j * vs, v + j * vs + dv, buf + j * dv);
    for (Index r = 0; r < bad.count; ++r)
        std::fill(buf + bad.rows[r] * dv, buf + (bad.rows[r] + 1) * dv, T(0));
    return buf;
}

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

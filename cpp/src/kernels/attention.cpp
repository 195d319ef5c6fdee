#include "attnlab/attention.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "attnlab/gemm.hpp"
#include "attnlab/threading.hpp"
#include "decode.hpp"
#include "microkernel.hpp"
#include "products.hpp"
#include "scratch.hpp"
#include "softmax.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp

namespace detail {

// Tile sizes. Forward: 96 queries (a whole number of panels for 4, 8 and 16 lanes) against 128
// keys; the score tile (48 KiB in float) streams through L2 row by row. 4 x 3-packet panels
// with 96 queries against 6 x 2 with 64: 2-3% faster at d_head = 64 in CPU-time measurements
// on a 2-core AVX2 machine (n = 2048). Backward: see backward_pair.
constexpr Index kTileQ = 96;
constexpr Index kTileK = 128;
constexpr Index kDepth = 256;  // head-width chunk of the score product
// Up to this many query tiles per head, each flash tile scans its key blocks' value rows for
// NaN/Inf itself (from cache, just before its product reads them): by operation count about
// 1/mp of the value product per tile, so a call's single scan of V costs less once a head has
// many tiles. 8 is chosen by that count, not measured.
constexpr Index kScanInTilesMax = 8;

// Tiles of `size` over n rows, a last one shorter than size / 4 joining the one before (n = 197
// in tiles of 96: 96 and 101, not 96, 96 and 5, whose lanes, padded to a packet, were mostly
// padding: 5% of a ViT-S forward, 4% of its backward in perf). No result depends on where the
// tiles start (each entry is one chain over the depth, and sums run across tiles in order) but
// the backward's dQ when its keys are split into segments, whose bounds are whole tiles: that
// depends on the tiles, never on the thread count.
inline Index tile_count(Index n, Index size) {
    if (n <= 0) return 0;
    return n / size + (n < size || n % size >= size / 4 ? 1 : 0);
}
// Rows in tile t of tile_count(n, size) = count.
inline Index tile_rows(Index n, Index size, Index count, Index t) {
    return t + 1 == count ? n - t * size : size;
}

// Masked-out keys are never read. The rule, for both the flash and the weights path: a key
// whose masked, scaled logit is -inf (boolean mask False, key padding, causal, a float mask of
// -inf) has weight exactly 0 and its value row is not read, so NaN or Inf there reaches no
// output of that query; every other key contributes weight x value (0 x NaN = NaN included).
// The products below would compute 0 x NaN for masked keys, so value rows holding NaN or Inf
// (found once per call by nonfinite_rows, or per key block by value_flags; rare) are taken out
// of the product and added back for the queries that may see them.

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
// alone, was 4% of a ViT-S attention call). For the weights path and long sequences; short
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
// head this is cheaper than the call's scan over all of V from memory, which was 3.4% of a
// one-thread ViT-S attention call, and it is one parallel pass fewer.
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

// One (batch, head, query tile) with an online softmax over key tiles.
//
// Layout: queries run along the vector lanes. The tile keeps Q^T (scaled), S^T = K Q^T (keys x
// queries) and the accumulator (P V)^T (d_v x queries), the query count padded to whole packets.
// Then the softmax statistics (running max m, running sum l) are whole packets, updated by
// vertical max/exp/add over the keys without horizontal reductions, and both products run in
// lanes_product without packing K or V (their entries are broadcast through their strides).
template <typename T>
void flash_tile(const AttentionProblem<T>& p, Index b, Index h, Index i0, Index mq,
                const std::uint8_t* v_flags, bool scan_values) {
    namespace ei = Eigen::internal;
    using Packet = PacketOf<T>;
    constexpr Index L = packet_size<T>();
    const Index hk = h / (p.heads / p.kv_heads);
    const Index d = p.d, dv = p.d_v;
    // Queries padded to whole packets, not panels: the last tile of n = 197 (5 queries) is then
    // one 16-lane packet with AVX-512, not a 48-lane panel (240 lanes for 197 queries, now 208).
    const Index mp = (mq + L - 1) / L * L;
    const T* qbase = p.q.at(b, h) + i0 * p.q.row_stride;
    const T* kbase = p.k.at(b, hk);
    const T* vbase = p.v.at(b, hk);
    const Index ks = p.k.row_stride, vs = p.v.row_stride;

    T* qt = scratch<T>(ScratchBuffer::kFlashQueries, static_cast<std::size_t>(d * mp));
    T* st = scratch<T>(ScratchBuffer::kFlashScores, static_cast<std::size_t>(kTileK * mp));
    T* acc = scratch<T>(ScratchBuffer::kFlashAccumulator, static_cast<std::size_t>(dv * mp));
    T* stats = scratch<T>(ScratchBuffer::kFlashStats, static_cast<std::size_t>(2 * mp));
    T* row_m = stats;
    T* row_l = stats + mp;
    // Q^T by packet transposes, then scaled in place (the same products as scale * Q; the
    // scalar transpose with scaling was an eighth of this function's time in a ViT-S layer)
    transpose(mq, d, qbase, p.q.row_stride, qt, mp);
    {
        const Packet sc = ei::pset1<Packet>(p.scale);
        for (Index c = 0; c < d; ++c) {
            T* row = qt + c * mp;
            Index i = 0;
            for (; i + L <= mq; i += L)
                ei::pstoreu(row + i, ei::pmul(sc, ei::ploadu<Packet>(row + i)));
            for (; i < mq; ++i) row[i] = p.scale * row[i];
            std::fill(row + mq, row + mp, T(0));
        }
    }
    std::fill(acc, acc + dv * mp, T(0));
    // a sink is a first key of logit `sink` and value 0: it starts the running max and sum
    const T sink = p.mask.sinks ? p.mask.sink(b, h) : neg_inf<T>();
    std::fill(row_m, row_m + mp, sink);
    std::fill(row_l, row_l + mp, sink == neg_inf<T>() ? T(0) : T(1));

    const Packet ninf = ei::pset1<Packet>(neg_inf<T>());
    const Packet zero = ei::pzero(ninf);
    const Interval keys = keys_seen(p.mask, p.n_q, p.n_k, i0, i0 + mq);
    for (Index j0 = keys.lo; j0 < keys.hi; j0 += kTileK) {
        const Index kb = std::min(kTileK, keys.hi - j0);
        // S^T[j, i] = sum_c K[j0 + j, c] * qt[c, i], over head widths in chunks of kDepth so
        // that a chunk of the Q^T panel stays in L1 while the key rows pass (wide heads)
        for (Index c0 = 0; c0 < d; c0 += kDepth) {
            const Index dc = std::min(kDepth, d - c0);
            const T* kc = kbase + j0 * ks + c0;
            if (c0 == 0) {
                lanes_product<T, false>(kb, mp, dc, kc, ks, 1, qt, mp, st, mp);
            } else {
                lanes_product<T, true>(kb, mp, dc, kc, ks, 1, qt + c0 * mp, mp, st, mp);
            }
        }
        if (d == 0) std::fill(st, st + kb * mp, T(0));
        if (p.mask.options.softcap > 0)
            softcap_scores(static_cast<T>(p.mask.options.softcap), st, kb * mp, (T*)nullptr);
        if (tile_needs_mask(p.mask, p.n_q, p.n_k, i0, i0 + mq, j0, j0 + kb))
            apply_mask(p.mask, b, h, p.n_q, p.n_k, i0, j0, mq, kb, st, Index(1), mp);
        // nonfinite value rows: which queries may read them, before the exp overwrites S^T
        const std::uint8_t* block_flags = scan_values ? value_flags(vbase + j0 * vs, vs, kb, dv)
                                          : v_flags   ? v_flags + j0
                                                      : nullptr;
        const FlaggedRows bad = flagged_rows(block_flags, kb, st, Index(1), mp, mq);
        // Online softmax, queries in lanes, one packet of queries at a time down the tile's keys:
        // that column of S^T (kb lines) stays in L1 from the max to the exp, and the max and the
        // sum stay in registers (row by row, with the statistics in memory, each key's max and
        // sum waited on the store of the key before). A column masked so far keeps m = -inf and
        // is shifted by 0 instead, so that its exponentials are exactly 0 rather than NaN.
        for (Index io = 0; io < mp; io += L) {
            T* col = st + io;
            // two chains of maxima (the max is exact: the same result in any order)
            Packet m0 = ei::pload<Packet>(row_m + io), m1 = m0;
            Index j = 0;
            for (; j + 2 <= kb; j += 2) {
                m0 = ei::pmax(m0, ei::pload<Packet>(col + j * mp));
                m1 = ei::pmax(m1, ei::pload<Packet>(col + (j + 1) * mp));
            }
            if (j < kb) m0 = ei::pmax(m0, ei::pload<Packet>(col + j * mp));
            const Packet mn = ei::pmax(m0, m1);
            const Packet shift = ei::pselect(ei::pcmp_eq(mn, ninf), zero, mn);
            Packet sum = zero;
            for (j = 0; j < kb; ++j) {
                const Packet e = exp_flush(ei::psub(ei::pload<Packet>(col + j * mp), shift));
                ei::pstore(col + j * mp, e);
                sum = ei::padd(sum, e);
            }
            const Packet alpha = exp_flush(ei::psub(ei::pload<Packet>(row_m + io), shift));
            ei::pstore(row_l + io, ei::padd(ei::pmul(ei::pload<Packet>(row_l + io), alpha), sum));
            ei::pstore(row_m + io, mn);
            for (Index c = 0; c < dv; ++c) {
                T* ac = acc + c * mp + io;
                ei::pstore(ac, ei::pmul(ei::pload<Packet>(ac), alpha));
            }
        }
        // acc[c, i] += sum_j V[j0 + j, c] * P^T[j, i]
        if (bad.count == 0) {
            lanes_product<T, true>(dv, mp, kb, vbase + j0 * vs, 1, vs, st, mp, acc, mp);
        } else {
            const T* vclean = value_copy_without(vbase + j0 * vs, vs, kb, dv, bad);
            lanes_product<T, true>(dv, mp, kb, vclean, 1, dv, st, mp, acc, mp);
            for (Index r = 0; r < bad.count; ++r) {
                const T* vrow = vbase + (j0 + bad.rows[r]) * vs;
                for (Index i = 0; i < mq; ++i)
                    if (bad.sees[r * mq + i])
                        for (Index c = 0; c < dv; ++c)
                            acc[c * mp + i] += vrow[c] * st[bad.rows[r] * mp + i];
            }
        }
    }
    // O = (acc / l)^T: divided in the lanes, written back by packet transposes (not scalar
    // divisions reading acc a column at a time)
    for (Index c = 0; c < dv; ++c)
        for (Index io = 0; io < mp; io += L) {
            T* ac = acc + c * mp + io;
            ei::pstore(ac, ei::pdiv(ei::pload<Packet>(ac), ei::pload<Packet>(row_l + io)));
        }
    T* obase = p.out.at(b, h) + i0 * p.out.row_stride;
    transpose(dv, mq, acc, mp, obase, p.out.row_stride);
    for (Index i = 0; i < mq; ++i) {
        const T l = row_l[i];
        if (l == T(0)) {  // fully masked row: zeros, not 0 / 0
            T* orow = obase + i * p.out.row_stride;
            std::fill(orow, orow + dv, T(0));
        }
        if (p.lse) {
            p.lse[(b * p.heads + h) * p.n_q + i0 + i] =
                l == T(0) ? neg_inf<T>() : row_m[i] + std::log(l);
        }
    }
}

// One (batch, head, query tile) when the weights are wanted: the rows of P are materialised in
// the output weights array, normalised there, then multiplied by V.
template <typename T>
void dense_tile(const AttentionProblem<T>& p, Index b, Index h, Index i0, Index mq,
                const std::uint8_t* v_flags) {
    const Index hk = h / (p.heads / p.kv_heads);
    const Index d = p.d, dv = p.d_v, nk = p.n_k;
    ConstRowMap<T> Q(p.q.at(b, h) + i0 * p.q.row_stride, mq, d,
                     Eigen::OuterStride<>(p.q.row_stride));
    ConstRowMap<T> K(p.k.at(b, hk), nk, d, Eigen::OuterStride<>(p.k.row_stride));
    ConstRowMap<T> V(p.v.at(b, hk), nk, dv, Eigen::OuterStride<>(p.v.row_stride));
    RowMap<T> O(p.out.at(b, h) + i0 * p.out.row_stride, mq, dv,
                Eigen::OuterStride<>(p.out.row_stride));
    T* wbase = p.weights + ((b * p.heads + h) * p.n_q + i0) * nk;
    RowMap<T> P(wbase, mq, nk, Eigen::OuterStride<>(nk));
    T* qs_buf = scratch<T>(ScratchBuffer::kDenseQueries, static_cast<std::size_t>(mq * d));
    RowMap<T> Qs(qs_buf, mq, d, Eigen::OuterStride<>(d));
    Qs.noalias() = Q * p.scale;
    eigen_product_bt<T>(cview<T>(qs_buf, mq, d, d), K, P);
    if (p.mask.options.softcap > 0)
        softcap_scores(static_cast<T>(p.mask.options.softcap), wbase, mq * nk, (T*)nullptr);
    if (tile_needs_mask(p.mask, p.n_q, p.n_k, i0, i0 + mq, Index(0), nk))
        apply_mask(p.mask, b, h, p.n_q, p.n_k, i0, Index(0), mq, nk, wbase, nk, Index(1));
    const FlaggedRows bad = flagged_rows(v_flags, nk, wbase, nk, Index(1), mq);  // as in flash_tile
    const T sink = p.mask.sinks ? p.mask.sink(b, h) : neg_inf<T>();
    for (Index r = 0; r < mq; ++r) {
        T* row = wbase + r * nk;
        const T rm = row_max(row, nk);
        const T m = rm < sink ? sink : rm;  // NaN stays
        T lse = neg_inf<T>();
        if (m == neg_inf<T>()) {  // fully masked: zeros; NaN scores propagate
            const T fillv = has_nan(row, nk) ? std::numeric_limits<T>::quiet_NaN() : T(0);
            std::fill(row, row + nk, fillv);
            lse = fillv == T(0) ? neg_inf<T>() : fillv;
        } else {
            const T l =
                exp_row(row, m, row, nk) + (sink == neg_inf<T>() ? T(0) : std::exp(sink - m));
            Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>>(row, nk) /= l;
            lse = m + std::log(l);
        }
        if (p.lse) p.lse[(b * p.heads + h) * p.n_q + i0 + r] = lse;
    }
    if (bad.count == 0) {
        eigen_product<T>(cview<T>(wbase, mq, nk, nk), V, O);
        return;
    }
    ConstRowMap<T> Vclean(value_copy_without(V.data(), p.v.row_stride, nk, dv, bad), nk, dv,
                          Eigen::OuterStride<>(dv));
    eigen_product<T>(cview<T>(wbase, mq, nk, nk), Vclean, O);
    for (Index c = 0; c < bad.count; ++c)
        for (Index r = 0; r < mq; ++r)
            if (bad.sees[c * mq + r]) O.row(r) += P(r, bad.rows[c]) * V.row(bad.rows[c]);
}

// Backward. Keys run along the vector lanes here (the forward has queries there): the tile
// holds S = scale Q K^T as (queries x keys), so that recomputing P = exp(S - lse) and forming
// dS = P * (dP - D) are whole-packet operations with one broadcast per query row, and the
// products that sum over queries (dV^T += dO^T P, dK^T += Q^T dS) write whole key packets.
// Every product runs in lanes_product: dO is read in place through its strides, scale Q comes
// from a first pass (with D, once per query row instead of once per tile pair), and the key
// tile's K and V are transposed once and reused by every query tile.
//
// Tasks are (key segment, batch, kv head): a task owns dK and dV of its keys (no races) and
// loops over the query heads of its group and the query tiles that can see each key tile
// (tiles the scalar mask options hide, as causal ones above the diagonal, are skipped). dQ sums
// over all keys, so each segment writes its share into its own buffer and a last pass adds the
// segments in a fixed order: the result does not depend on the thread count. Segments are added
// only when batch x kv heads gives too few tasks, so the buffers stay at most kBwdMaxSegments times
// the size of dQ (the alternative, a dQ pass and a dK/dV pass each recomputing P, costs two more
// products).
constexpr Index kBwdTileQ = 64;
constexpr Index kBwdTileK = 96;  // a whole number of panels for 4, 8 and 16 lanes
// the longest key tile (a short last one joins the one before: tile_count), padded to packets
constexpr Index kBwdTileKMax = 128;
static_assert(kBwdTileK + kBwdTileK / 4 <= kBwdTileKMax);
constexpr Index kBwdTasks = 16;
constexpr Index kBwdMaxSegments = 8;

template <typename T>
struct BackwardPlan {
    Index q_tiles = 0, k_tiles = 0;
    Index segments = 0, seg_tiles = 0;  // segments of seg_tiles key tiles each (the last fewer)
    Index dp = 0;                       // head width padded to whole packets
    T* dq_part = nullptr;               // (segments, batch, heads, n_q, dp): dQ / scale per segment
    T* qs = nullptr;                    // (batch, heads, n_q, d): scale Q
    T* dsum = nullptr;                  // (batch, heads, n_q): D = rowsum(dO * O)
    T* sink_part = nullptr;             // (batch, heads, q_tiles): each tile's share of d sink

    Index head(const AttentionProblem<T>& p, Index b, Index h) const {
        return (b * p.heads + h) * p.n_q;
    }
    T* part(const AttentionProblem<T>& p, Index s, Index b, Index h) const {
        return dq_part + (s * p.batch * p.heads * p.n_q + head(p, b, h)) * dp;
    }
    // Per key tile, the query tiles [lo, hi) that may see one of its keys (the others are
    // skipped). Both ends never decrease with the key tile, so the key tiles that see a query
    // tile are consecutive: the first of a segment writes its share of dQ, the rest add.
    Buffer<Interval> query_tiles;

    bool sees(Index kt, Index qt) const {
        return query_tiles[kt].lo <= qt && qt < query_tiles[kt].hi;
    }
    bool segment_sees(Index s, Index qt) const {
        for (Index kt = s * seg_tiles; kt < std::min(k_tiles, (s + 1) * seg_tiles); ++kt)
            if (sees(kt, qt)) return true;
        return false;
    }
};

template <typename T>
BackwardPlan<T> backward_plan(const AttentionProblem<T>& p) {
    constexpr Index L = packet_size<T>();
    BackwardPlan<T> plan;
    plan.q_tiles = (p.n_q + kBwdTileQ - 1) / kBwdTileQ;
    plan.k_tiles = tile_count(p.n_k, kBwdTileK);
    plan.dp = (p.d + L - 1) / L * L;
    if (plan.k_tiles == 0) return plan;
    plan.query_tiles = make_buffer<Interval>(plan.k_tiles);
    for (Index kt = 0; kt < plan.k_tiles; ++kt) {
        const Index j0 = kt * kBwdTileK, kb = tile_rows(p.n_k, kBwdTileK, plan.k_tiles, kt);
        const Interval q = queries_seeing(p.mask, p.n_q, p.n_k, j0, j0 + kb);
        plan.query_tiles[kt] = q.lo < q.hi
                                   ? Interval{q.lo / kBwdTileQ, (q.hi + kBwdTileQ - 1) / kBwdTileQ}
                                   : Interval{};
    }
    const Index heads = p.batch * p.kv_heads;
    const Index want = std::clamp<Index>((kBwdTasks + heads - 1) / heads, 1,
                                         std::min(kBwdMaxSegments, plan.k_tiles));
    plan.seg_tiles = (plan.k_tiles + want - 1) / want;
    plan.segments = (plan.k_tiles + plan.seg_tiles - 1) / plan.seg_tiles;
    return plan;
}

// Per-thread tile buffers of the backward, carved from one scratch block.
template <typename T>
struct BackwardScratch {
    T *kt, *vt, *kp, *dkt, *dvt, *s, *dp, *th;

    BackwardScratch(Index d, Index dv, Index dp_width) {
        constexpr Index tk = kBwdTileKMax, tq = kBwdTileQ;
        const Index sizes[] = {d * tk,  dv * tk, tk * dp_width, d * tk,
                               dv * tk, tq * tk, tq * tk,       tq * tk};
        T** slots[] = {&kt, &vt, &kp, &dkt, &dvt, &s, &dp, &th};
        auto round = [](Index n) { return (n + 15) / 16 * 16; };  // keep every slot 64-byte aligned
        Index total = 0;
        for (Index n : sizes) total += round(n);
        T* base = scratch<T>(ScratchBuffer::kBackwardTiles, static_cast<std::size_t>(total));
        for (int i = 0; i < 8; ++i) {
            *slots[i] = base;
            base += round(sizes[i]);
        }
    }
};

// One (batch, query head, query tile) against the key tile held in w (kt, vt, kp: K^T, V^T and
// K padded to dp columns, kbp = kb padded to whole packets). Adds into w.dkt, w.dvt (dK^T, dV^T
// of the tile) and writes or adds the tile's share of dQ / scale at dq.
template <typename T>
void backward_pair(const AttentionProblem<T>& p, const AttentionGrad<T>& g,
                   const BackwardPlan<T>& plan, const BackwardScratch<T>& w, Index b, Index h,
                   Index i0, Index mq, Index j0, Index kb, Index kbp, T* dq, bool accumulate_dq) {
    namespace ei = Eigen::internal;
    using Packet = PacketOf<T>;
    constexpr Index L = packet_size<T>();
    const Index d = p.d, dv = p.d_v, dp = plan.dp;
    const T* dout = g.d_out.at(b, h) + i0 * g.d_out.row_stride;
    const Index ds = g.d_out.row_stride;
    const T* qs = plan.qs + (plan.head(p, b, h) + i0) * d;
    const T* lse = p.lse + plan.head(p, b, h) + i0;
    const T* dsum = plan.dsum + plan.head(p, b, h) + i0;

    // S = (scale Q) K^T: the products of flash_tile in the same order, so the same S
    lanes_product<T, false>(mq, kbp, d, qs, d, 1, w.kt, kbp, w.s, kbp);
    const bool capped = p.mask.options.softcap > 0;
    if (capped) softcap_scores(static_cast<T>(p.mask.options.softcap), w.s, mq * kbp, w.th);
    if (tile_needs_mask(p.mask, p.n_q, p.n_k, i0, i0 + mq, j0, j0 + kb))
        apply_mask(p.mask, b, h, p.n_q, p.n_k, i0, j0, mq, kb, w.s, kbp, Index(1));
    // dP = dO V^T
    lanes_product<T, false>(mq, kbp, dv, dout, ds, 1, w.vt, kbp, w.dp, kbp);
    // P = exp(S - lse) in place of S (0 on a fully masked row and in the padding lanes), then
    // dS = P * (dP - D) in place of dP
    for (Index i = 0; i < mq; ++i) {
        T* si = w.s + i * kbp;
        T* dpi = w.dp + i * kbp;
        if (lse[i] == neg_inf<T>()) {
            std::fill(si, si + kbp, T(0));
        } else {
            std::fill(si + kb, si + kbp, neg_inf<T>());
            const Packet l = ei::pset1<Packet>(lse[i]);
            for (Index j = 0; j < kbp; j += L)
                ei::pstoreu(si + j, exp_flush(ei::psub(ei::ploadu<Packet>(si + j), l)));
        }
        const Packet di = ei::pset1<Packet>(dsum[i]);
        for (Index j = 0; j < kbp; j += L)
            ei::pstoreu(dpi + j, ei::pmul(ei::ploadu<Packet>(si + j),
                                          ei::psub(ei::ploadu<Packet>(dpi + j), di)));
        // dS is the gradient of the final logits, so of an additive mask; through the soft cap
        // the scaled scores get dS (1 - tanh^2)
        if (g.d_mask) {
            T* dm = g.d_mask + ((b * p.heads + h) * p.n_q + i0 + i) * p.n_k + j0;
            std::copy(dpi, dpi + kb, dm);
        }
        if (capped) {
            const T* ti = w.th + i * kbp;
            const Packet one = ei::pset1<Packet>(T(1));
            for (Index j = 0; j < kbp; j += L) {
                const Packet t = ei::ploadu<Packet>(ti + j);
                ei::pstoreu(dpi + j,
                            ei::pmul(ei::ploadu<Packet>(dpi + j), ei::psub(one, ei::pmul(t, t))));
            }
        }
    }
    // dV^T += dO^T P; dK^T += (scale Q)^T dS; dQ / scale (+)= dS K
    lanes_product<T, true>(dv, kbp, mq, dout, 1, ds, w.s, kbp, w.dvt, kbp);
    lanes_product<T, true>(d, kbp, mq, qs, 1, d, w.dp, kbp, w.dkt, kbp);
    if (accumulate_dq) {
        lanes_product<T, true>(mq, dp, kb, w.dp, kbp, 1, w.kp, dp, dq, dp);
    } else {
        lanes_product<T, false>(mq, dp, kb, w.dp, kbp, 1, w.kp, dp, dq, dp);
    }
}

// Rows [j0, j0 + kb) of x (row stride xs, width n) transposed into t (n x kbp), padding zeroed.
template <typename T>
void key_tile_transposed(const T* x, Index xs, Index j0, Index kb, Index kbp, Index n, T* t) {
    transpose(kb, n, x + j0 * xs, xs, t, kbp);
    for (Index c = 0; c < n; ++c) std::fill(t + c * kbp + kb, t + (c + 1) * kbp, T(0));
}

// One task: the key tiles of segment s of (batch b, kv head hk).
template <typename T>
void backward_task(const AttentionProblem<T>& p, const AttentionGrad<T>& g,
                   const BackwardPlan<T>& plan, Index s, Index b, Index hk) {
    constexpr Index L = packet_size<T>();
    const Index group = p.heads / p.kv_heads;
    const Index d = p.d, dv = p.d_v, dp = plan.dp;
    const T* kbase = p.k.at(b, hk);
    const Index ks = p.k.row_stride;
    const BackwardScratch<T> w(d, dv, dp);
    const Index t0 = s * plan.seg_tiles, t1 = std::min(plan.k_tiles, t0 + plan.seg_tiles);
    for (Index kt = t0; kt < t1; ++kt) {
        interruption_point();  // a task is a sixteenth of the call: too long to wait for
        const Index j0 = kt * kBwdTileK, kb = tile_rows(p.n_k, kBwdTileK, plan.k_tiles, kt);
        const Index kbp = (kb + L - 1) / L * L;
        key_tile_transposed(kbase, ks, j0, kb, kbp, d, w.kt);
        key_tile_transposed(p.v.at(b, hk), p.v.row_stride, j0, kb, kbp, dv, w.vt);
        for (Index j = 0; j < kb; ++j) {
            std::copy(kbase + (j0 + j) * ks, kbase + (j0 + j) * ks + d, w.kp + j * dp);
            std::fill(w.kp + j * dp + d, w.kp + (j + 1) * dp, T(0));
        }
        std::fill(w.dkt, w.dkt + d * kbp, T(0));
        std::fill(w.dvt, w.dvt + dv * kbp, T(0));
        for (Index gi = 0; gi < group; ++gi) {
            const Index h = hk * group + gi;
            T* part = plan.part(p, s, b, h);
            for (Index qt = plan.query_tiles[kt].lo; qt < plan.query_tiles[kt].hi; ++qt) {
                const Index i0 = qt * kBwdTileQ, mq = std::min(kBwdTileQ, p.n_q - i0);
                const bool added = kt != t0 && plan.sees(kt - 1, qt);  // a share is there
                backward_pair(p, g, plan, w, b, h, i0, mq, j0, kb, kbp, part + i0 * dp, added);
            }
        }
        transpose(d, kb, w.dkt, kbp, g.d_k.at(b, hk) + j0 * g.d_k.row_stride, g.d_k.row_stride);
        transpose(dv, kb, w.dvt, kbp, g.d_v.at(b, hk) + j0 * g.d_v.row_stride, g.d_v.row_stride);
    }
}

// Before the tasks, per (batch, head, query tile): scale Q and D = rowsum(dO * O).
template <typename T>
void backward_prepare(const AttentionProblem<T>& p, const AttentionGrad<T>& g,
                      const BackwardPlan<T>& plan, Index b, Index h, Index qt) {
    const Index i0 = qt * kBwdTileQ, mq = std::min(kBwdTileQ, p.n_q - i0);
    const T* q = p.q.at(b, h);
    const T* o = p.out.at(b, h);
    const T* dout = g.d_out.at(b, h);
    T* qs = plan.qs + plan.head(p, b, h) * p.d;
    for (Index i = i0; i < i0 + mq; ++i) {
        for (Index c = 0; c < p.d; ++c) qs[i * p.d + c] = p.scale * q[i * p.q.row_stride + c];
        plan.dsum[plan.head(p, b, h) + i] =
            dot(dout + i * g.d_out.row_stride, o + i * p.out.row_stride, p.d_v);
    }
    // d sink = -sum_i P_i(sink) D_i, P_i(sink) = exp(sink - lse_i)
    if (g.d_sinks && p.mask.sinks) {
        const T sink = p.mask.sink(b, h);
        T share = 0;
        for (Index i = i0; i < i0 + mq; ++i) {
            const T lse = p.lse[plan.head(p, b, h) + i];
            if (sink != neg_inf<T>())
                share -= std::exp(sink - lse) * plan.dsum[plan.head(p, b, h) + i];
        }
        plan.sink_part[(b * p.heads + h) * plan.q_tiles + qt] = share;
    }
}

// After the tasks, per (batch, head, query tile): dQ = scale times the sum of the segments'
// shares, in segment order. A segment no key of which the tile sees wrote nothing there.
template <typename T>
void backward_dq(const AttentionProblem<T>& p, const AttentionGrad<T>& g,
                 const BackwardPlan<T>& plan, Index b, Index h, Index qt) {
    const Index i0 = qt * kBwdTileQ, mq = std::min(kBwdTileQ, p.n_q - i0);
    T* dq = g.d_q.at(b, h) + i0 * g.d_q.row_stride;
    for (Index i = 0; i < mq; ++i)
        std::fill(dq + i * g.d_q.row_stride, dq + i * g.d_q.row_stride + p.d, T(0));
    for (Index s = 0; s < plan.segments; ++s) {
        if (!plan.segment_sees(s, qt)) continue;
        const T* part = plan.part(p, s, b, h) + i0 * plan.dp;
        for (Index i = 0; i < mq; ++i)
            for (Index c = 0; c < p.d; ++c) dq[i * g.d_q.row_stride + c] += part[i * plan.dp + c];
    }
    for (Index i = 0; i < mq; ++i)
        for (Index c = 0; c < p.d; ++c) dq[i * g.d_q.row_stride + c] *= p.scale;
}

// The attention over the heads of packed projections q (rows x h*d_head), k, v and the
// context buffer: heads are column blocks, viewed in place.
template <typename T>
AttentionProblem<T> head_problem(const MhaProblem<T>& p, const T* q, const T* k, const T* v,
                                 T* ctx) {
    const Index wq = p.heads * p.d_head, wk = p.kv_heads * p.d_head;
    const Index wv = p.kv_heads * p.d_vhead, wc = p.heads * p.d_vhead;
    AttentionProblem<T> a;
    a.batch = p.batch;
    a.heads = p.heads;
    a.kv_heads = p.kv_heads;
    a.n_q = p.n_q;
    a.n_k = p.n_k;
    a.d = p.d_head;
    a.d_v = p.d_vhead;
    a.scale = p.scale;
    a.q = {q, p.n_q * wq, p.d_head, wq};
    a.k = {k, p.n_k * wk, p.d_head, wk};
    a.v = {v, p.n_k * wv, p.d_vhead, wv};
    a.out = {ctx, p.n_q * wc, p.d_vhead, wc};
    a.mask = p.mask;
    return a;
}

}  // namespace detail

template <typename T>
void attention_backward(const AttentionProblem<T>& p, const AttentionGrad<T>& g) {
    if (p.batch <= 0 || p.kv_heads <= 0) return;
    detail::BackwardPlan<T> plan = detail::backward_plan(p);
    const Index rows = p.batch * p.heads * p.n_q;
    auto dq_part = make_buffer<T>(plan.segments * rows * plan.dp);
    auto qs = make_buffer<T>(rows * p.d), dsum = make_buffer<T>(rows);
    const bool sink_grad = g.d_sinks && p.mask.sinks;
    auto sink_part = make_buffer<T>(sink_grad ? p.batch * p.heads * plan.q_tiles : 0);
    plan.dq_part = dq_part.get();
    plan.qs = qs.get();
    plan.dsum = dsum.get();
    plan.sink_part = sink_part.get();
    const Index q_tasks = p.batch * p.heads * plan.q_tiles;
    const auto per_query_tile = [&](auto f) {
        parallel_for(q_tasks, [&](Index t) {
            f(p, g, plan, t / (p.heads * plan.q_tiles), (t / plan.q_tiles) % p.heads,
              t % plan.q_tiles);
        });
    };
    per_query_tile(detail::backward_prepare<T>);
    // heaviest segments first (under the causal rule the first keys are seen by most queries)
    const Index heads = p.batch * p.kv_heads;
    parallel_for(plan.segments * heads, [&](Index t) {
        detail::backward_task(p, g, plan, t / heads, (t % heads) / p.kv_heads, t % p.kv_heads);
    });
    per_query_tile(detail::backward_dq<T>);
    if (g.d_sinks) {  // the tiles' shares in a fixed order: thread-count independent
        for (Index bh = 0; bh < p.batch * p.heads; ++bh) {
            T sum = 0;
            for (Index qt = 0; sink_grad && qt < plan.q_tiles; ++qt)
                sum += plan.sink_part[bh * plan.q_tiles + qt];
            g.d_sinks[bh] = sum;
        }
    }
}

template <typename T>
void attention_forward(const AttentionProblem<T>& p) {
    if (p.batch <= 0 || p.heads <= 0 || p.n_q <= 0) return;
    if (!p.weights && detail::use_decode(p.n_q, p.heads, p.kv_heads, p.n_k)) {
        detail::decode_forward(p);  // few queries per kv head: split along the keys
        return;
    }
    const Index q_tiles = detail::tile_count(p.n_q, detail::kTileQ);
    const Index tasks = p.batch * p.heads * q_tiles;
    // Value rows holding NaN/Inf: scanned per key block in the flash tiles when each head has few
    // query tiles (value_flags), else once for the call (each block would be scanned too often).
    const bool scan_in_tiles = !p.weights && q_tiles <= detail::kScanInTilesMax;
    const Buffer<std::uint8_t> v_flags =
        scan_in_tiles ? Buffer<std::uint8_t>() : detail::nonfinite_rows(p);
    parallel_for(tasks, [&](Index t) {
        const Index qt = t % q_tiles;
        const Index h = (t / q_tiles) % p.heads;
        const Index b = t / (q_tiles * p.heads);
        const Index i0 = qt * detail::kTileQ;
        const Index mq = detail::tile_rows(p.n_q, detail::kTileQ, q_tiles, qt);
        const Index hk = h / (p.heads / p.kv_heads);
        const std::uint8_t* flags =
            v_flags ? v_flags.get() + (b * p.kv_heads + hk) * p.n_k : nullptr;
        if (p.weights) {
            detail::dense_tile(p, b, h, i0, mq, flags);
        } else {
            detail::flash_tile(p, b, h, i0, mq, flags, scan_in_tiles);
        }
    });
}

namespace detail {

// The forward's intermediates: in p.state when the caller keeps them, else in temporaries.
template <typename T>
struct MhaBuffers {
    Buffer<T> own_q, own_k, own_v, own_ctx, own_lse;
    T *q, *k, *v, *ctx, *lse;

    MhaBuffers(const MhaProblem<T>& p, bool need_lse) {
        const Index rq = p.batch * p.n_q, rk = p.batch * p.n_k;
        const auto take = [](T* kept, Buffer<T>& own, Index n) {
            if (kept) return kept;
            own = make_buffer<T>(n);
            return own.get();
        };
        q = take(p.state.q, own_q, rq * p.heads * p.d_head);
        k = take(p.state.k, own_k, rk * p.kv_heads * p.d_head);
        v = take(p.state.v, own_v, rk * p.kv_heads * p.d_vhead);
        ctx = take(p.state.ctx, own_ctx, rq * p.heads * p.d_vhead);
        lse = p.state.lse || need_lse ? take(p.state.lse, own_lse, p.batch * p.heads * p.n_q)
                                      : nullptr;
    }
};

// Projections (one GEMM each over all rows; heads are then column blocks of q, k, v) and the
// attention core, into b.
template <typename T>
AttentionProblem<T> mha_core_forward(const MhaProblem<T>& p, const MhaBuffers<T>& b) {
    const Index rq = p.batch * p.n_q, rk = p.batch * p.n_k;
    const Index wq = p.heads * p.d_head, wk = p.kv_heads * p.d_head;
    const Index wv = p.kv_heads * p.d_vhead;
    linear(rq, p.w_q.in, wq, p.query, p.w_q.in, p.w_q.w, p.w_q.b, b.q, wq);
    linear(rk, p.w_k.in, wk, p.key, p.w_k.in, p.w_k.w, p.w_k.b, b.k, wk);
    linear(rk, p.w_v.in, wv, p.value, p.w_v.in, p.w_v.w, p.w_v.b, b.v, wv);
    AttentionProblem<T> a = head_problem(p, b.q, b.k, b.v, b.ctx);
    a.lse = b.lse;
    return a;
}

}  // namespace detail

template <typename T>
void multi_head_attention_forward(const MhaProblem<T>& p) {
    const Index rq = p.batch * p.n_q, wc = p.heads * p.d_vhead;
    detail::MhaBuffers<T> b(p, false);
    AttentionProblem<T> a = detail::mha_core_forward(p, b);
    a.weights = p.weights;
    attention_forward(a);
    linear(rq, wc, p.w_o.out, b.ctx, wc, p.w_o.w, p.w_o.b, p.out, p.w_o.out);
}

template <typename T>
void multi_head_attention_backward(const MhaProblem<T>& p, const T* grad_out,
                                   const MhaGrads<T>& g) {
    const Index rq = p.batch * p.n_q, rk = p.batch * p.n_k;
    const Index wq = p.heads * p.d_head, wk = p.kv_heads * p.d_head;
    const Index wv = p.kv_heads * p.d_vhead, wc = p.heads * p.d_vhead;
    const Index d_out = p.w_o.out;
    detail::MhaBuffers<T> b(p, true);
    AttentionProblem<T> a;
    if (p.state.filled) {  // attnlab.vjp: the forward kept everything
        a = detail::head_problem(p, b.q, b.k, b.v, b.ctx);
        a.lse = b.lse;
    } else {
        a = detail::mha_core_forward(p, b);
        attention_forward(a);
    }
    const T* ctx = b.ctx;

    // output projection: dW_o = ctx^T dY, db_o = sum dY, dctx = dY W_o^T
    linear_weight_grad(rq, wc, d_out, ctx, wc, grad_out, d_out, g.w_o.w, g.w_o.b);
    auto dctx = make_buffer<T>(rq * wc);
    linear_input_grad(rq, wc, d_out, grad_out, d_out, p.w_o.w, dctx.get(), wc);

    auto dq = make_buffer<T>(rq * wq), dk = make_buffer<T>(rk * wk), dv = make_buffer<T>(rk * wv);
    AttentionGrad<T> ag;
    ag.d_out = {dctx.get(), p.n_q * wc, p.d_vhead, wc};
    ag.d_q = {dq.get(), p.n_q * wq, p.d_head, wq};
    ag.d_k = {dk.get(), p.n_k * wk, p.d_head, wk};
    ag.d_v = {dv.get(), p.n_k * wv, p.d_vhead, wv};
    ag.d_mask = g.mask;
    ag.d_sinks = g.sinks;
    attention_backward(a, ag);

    linear_weight_grad(rq, p.w_q.in, wq, p.query, p.w_q.in, dq.get(), wq, g.w_q.w, g.w_q.b);
    linear_weight_grad(rk, p.w_k.in, wk, p.key, p.w_k.in, dk.get(), wk, g.w_k.w, g.w_k.b);
    linear_weight_grad(rk, p.w_v.in, wv, p.value, p.w_v.in, dv.get(), wv, g.w_v.w, g.w_v.b);
    // An input that is another one (self-attention: key = value = query) may share its
    // gradient buffer: the later products add into it, in the order value, key, query.
    if (g.value) linear_input_grad(rk, p.w_v.in, wv, dv.get(), wv, p.w_v.w, g.value, p.w_v.in);
    if (g.key)
        linear_input_grad(rk, p.w_k.in, wk, dk.get(), wk, p.w_k.w, g.key, p.w_k.in,
                          g.key == g.value);
    if (g.query)
        linear_input_grad(rq, p.w_q.in, wq, dq.get(), wq, p.w_q.w, g.query, p.w_q.in,
                          g.query == g.key || g.query == g.value);
}

template void attention_backward<float>(const AttentionProblem<float>&,
                                        const AttentionGrad<float>&);
template void attention_backward<double>(const AttentionProblem<double>&,
                                         const AttentionGrad<double>&);
template void multi_head_attention_backward<float>(const MhaProblem<float>&, const float*,
                                                   const MhaGrads<float>&);
template void multi_head_attention_backward<double>(const MhaProblem<double>&, const double*,
                                                    const MhaGrads<double>&);
template void attention_forward<float>(const AttentionProblem<float>&);
template void attention_forward<double>(const AttentionProblem<double>&);
template void multi_head_attention_forward<float>(const MhaProblem<float>&);
template void multi_head_attention_forward<double>(const MhaProblem<double>&);

}  // namespace attnlab::ATTNLAB_ISA_NS

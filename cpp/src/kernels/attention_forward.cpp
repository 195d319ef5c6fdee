// The attention forward: flash tiles (online softmax over key tiles), weights tiles (the
// rows of P materialised), and the decode path (decode.hpp) for few query rows per kv head.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "attention_bf16.hpp"
#include "attnlab/attention.hpp"
#include "attnlab/kernels.hpp"
#include "attnlab/threading.hpp"
#include "cpu.hpp"
#include "decode.hpp"
#include "half_convert.hpp"
#include "microkernel.hpp"
#include "nonfinite.hpp"
#include "products.hpp"
#include "scratch.hpp"
#include "softmax.hpp"
#include "tiles.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp

namespace detail {

// Tile sizes. Forward: 96 queries (a whole number of panels for 4, 8 and 16 lanes) against 256
// keys; the score tile (96 KiB in float) streams through L2 row by row. 4 x 3-packet panels
// with 96 queries rather than 6 x 2 with 64: faster at d_head = 64 (docs/performance.md,
// kTileQ). 256 keys rather than 128: half the online softmax's rescales and per-tile passes,
// and one tile for n <= 256 (docs/performance.md, kTileK); in float the tile, Q^T, the
// accumulator and a key block stay within 512 KiB, the L2 of a Zen 2 or 3 core. precision="bf16"
// keeps 128-key blocks, those of its AMX and VDPBF16PS kernels (kAmxK), so that the emulation
// rounds the same probabilities. Backward: see backward_pair.
constexpr Index kTileQ = 96;
// A last query tile shorter than kTileQ / kTileQJoin joins the one before (n = 128: one tile of
// 128, not 96 and 32: a short tile's own passes over K and V, in narrow panels, cost more than
// the longer tile's wider ones; docs/performance.md, "Query tiles of BERT's 128 tokens")
constexpr Index kTileQJoin = 2;
constexpr Index kTileK = 256;
constexpr Index kTileKBf16 = 128;
constexpr Index kDepth = 256;  // head-width chunk of the score product
// Up to this many query tiles per head, each flash tile scans its key blocks' value rows for
// NaN/Inf itself (from cache, just before its product reads them): by operation count about
// 1/mp of the value product per tile, so a call's single scan of V costs less once a head has
// many tiles. 8 is chosen by that count, not measured.
constexpr Index kScanInTilesMax = 8;
// K and V whose rows lie apart (heads as column blocks of (batch * n, heads * d) projections, or
// transposed views of (B, n, h, d) arrays) are copied to contiguous rows before the tiles when at
// least this many query tiles read each head: rows a power-of-two multiple of 512 bytes apart
// share a few L1 sets, so a key block's rows evict one another between the products' passes
// over them (docs/performance.md, "Strided heads"). So are rows of whole cache lines that do not
// start on one (NumPy aligns arrays to 16 bytes): every vector load of them spans two lines. The
// copies in groups of kv heads of up to kCopyGroupBytes (a larger head is read where it is: no
// copy that size).
constexpr Index kCopyMinTiles = 8;
constexpr Index kCopyGroupBytes = Index(64) << 20;

// Whether some row of a stack does not start on a cache line (its data or a stride off 64 bytes)
template <typename T>
bool rows_off_line(const MatrixStack<const T>& s) {
    const auto off = [](Index elements) { return elements * Index(sizeof(T)) % 64 != 0; };
    return reinterpret_cast<std::uintptr_t>(s.data) % 64 != 0 || off(s.row_stride) ||
           off(s.head_stride) || off(s.batch_stride);
}

template <typename T>
struct TileOperands {  // where a flash tile reads Q (from its first query), K and V, and writes O
    const T* q;
    Index qs;
    const T* k;
    Index ks;
    const T* v;
    Index vs;
    T* out;
    Index os;
};

template <typename T>
TileOperands<T> tile_operands(const AttentionProblem<T>& p, Index b, Index h, Index i0) {
    const Index hk = h / (p.heads / p.kv_heads);
    return {p.q.at(b, h) + i0 * p.q.row_stride,
            p.q.row_stride,
            p.k.at(b, hk),
            p.k.row_stride,
            p.v.at(b, hk),
            p.v.row_stride,
            p.out.at(b, h) + i0 * p.out.row_stride,
            p.out.row_stride};
}

// One (batch, head, query tile) with an online softmax over key tiles.
//
// Layout: queries run along the vector lanes. The tile keeps Q^T (scaled) and S^T = K Q^T (keys
// x queries), the query count padded to whole packets. Then the softmax statistics (running max
// m, running sum l) are whole packets, updated by vertical max/exp/add over the keys without
// horizontal reductions, and both products run in lanes_product without packing K or V (their
// entries are broadcast through their strides, or read as rows). The accumulator P V has the
// queries in rows when d_v is a whole number of packets (V's rows are the product's B, and the
// output rows are written as they are), else (P V)^T, queries in lanes, written back by
// packet transposes: the same products in the same order either way.
//
// ready(j0, j1): called before key rows [j0, j1) of x.k and x.v are read (the half-precision
// path widens them there); nullptr: they are ready.
template <typename T, typename Ready = std::nullptr_t>
void flash_tile(const AttentionProblem<T>& p, Index b, Index h, Index i0, Index mq,
                const std::uint8_t* v_flags, bool scan_values, const TileOperands<T>& x,
                Ready&& ready = nullptr) {
    namespace ei = Eigen::internal;
    using Packet = PacketOf<T>;
    constexpr Index L = packet_size<T>();
    const Index d = p.d, dv = p.d_v;
    // Queries padded to whole packets, not panels: the last tile of n = 197 (5 queries) is then
    // one 16-lane packet with AVX-512, not a 48-lane panel (240 lanes for 197 queries, now 208).
    const Index mp = (mq + L - 1) / L * L;
    const T* qbase = x.q;
    const T* kbase = x.k;
    const T* vbase = x.v;
    const Index ks = x.ks, vs = x.vs;

    T* qt = scratch<T>(ScratchBuffer::kFlashQueries, static_cast<std::size_t>(d * mp));
    const Index tile_k = p.bf16 == Bf16::probabilities ? kTileKBf16 : kTileK;
    T* st = scratch<T>(ScratchBuffer::kFlashScores, static_cast<std::size_t>(tile_k * mp));
    T* acc = scratch<T>(ScratchBuffer::kFlashAccumulator, static_cast<std::size_t>(dv * mp));
    T* stats = scratch<T>(ScratchBuffer::kFlashStats, static_cast<std::size_t>(3 * mp));
    T* row_m = stats;
    T* row_l = stats + mp;
    T* row_alpha = stats + 2 * mp;  // the rescale of each query's row of acc (rows)
    // the value product with queries in rows, acc (mq x dv), when d_v is whole packets: the
    // output rows are then written as they are, not transposed (docs/performance.md)
    const bool rows = dv > 0 && dv % L == 0;
    // Q^T by packet transposes, scaled on the way (the same products as scale * Q; a separate
    // pass over Q^T, and before it a scalar transpose, showed in ViT-S's profile)
    const Packet sc = ei::pset1<Packet>(p.scale);
    transpose<T, HalfFormat::none>(mq, d, qbase, x.qs, qt, mp, [&](const auto& v, Index) {
        if constexpr (std::is_same_v<std::decay_t<decltype(v)>, T>) {
            return p.scale * v;
        } else {
            return ei::pmul(sc, v);
        }
    });
    if (mq < mp)
        for (Index c = 0; c < d; ++c) std::fill(qt + c * mp + mq, qt + (c + 1) * mp, T(0));
    bool first = true;  // no key block in acc yet: its product writes acc (no zeroing, no rescale)
    // a sink is a first key of logit `sink` and value 0: it starts the running max and sum
    const T sink = p.mask.sinks ? p.mask.sink(b, h) : neg_inf<T>();
    std::fill(row_m, row_m + mp, sink);
    std::fill(row_l, row_l + mp, sink == neg_inf<T>() ? T(0) : T(1));

    const Packet ninf = ei::pset1<Packet>(neg_inf<T>());
    const Packet zero = ei::pzero(ninf);
    const Interval keys = keys_seen(p.mask, p.n_q, p.n_k, i0, i0 + mq);
    const bool mask_arrays = p.mask.kind != MaskKind::none || p.mask.key_padding.data;
    // key tiles at whole multiples of tile_k (the first one cut at keys.lo): a row's tiles, and
    // so its sums, do not depend on where its query tile starts (a window moves keys.lo)
    for (Index j0 = keys.lo, j1 = 0; j0 < keys.hi; j0 = j1) {
        j1 = std::min(keys.hi, (j0 / tile_k + 1) * tile_k);
        const Index kb = j1 - j0;
        // keys no query of the tile may see by the mask arrays (padding): not read at all
        if (mask_arrays && block_unseen(p.mask, b, h, 1, i0, i0 + mq, j0, kb)) continue;
        if constexpr (!std::is_same_v<std::decay_t<Ready>, std::nullptr_t>) ready(j0, j0 + kb);
        // S^T[j, i] = sum_c K[j0 + j, c] * qt[c, i], over head widths in chunks of kDepth so
        // that a chunk of the Q^T panel stays in L1 while the key rows pass (wide heads)
        for (Index c0 = 0; c0 < d; c0 += kDepth) {
            const Index dc = std::min(kDepth, d - c0);
            const T* kc = kbase + j0 * ks + c0;
            if (c0 == 0) {
                lanes_product<T, false>(kb, mp, dc, kc, ks, 1, qt, mp, st, mp);
            } else {
                lanes_product<T, true, true>(kb, mp, dc, kc, ks, 1, qt + c0 * mp, mp, st, mp);
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
            if (rows) {
                ei::pstore(row_alpha + io, alpha);
            } else if (!first) {
                for (Index c = 0; c < dv; ++c) {
                    T* ac = acc + c * mp + io;
                    ei::pstore(ac, ei::pmul(ei::pload<Packet>(ac), alpha));
                }
            }
        }
        if (p.bf16 == Bf16::probabilities)
            round_bf16_inplace(st, kb * mp);  // the sums above took P unrounded
        // rows: acc[i, c] = acc[i, c] alpha_i + sum_j P^T[j, i] V[j0 + j, c]; lanes: acc[c, i]
        // (rescaled above) += sum_j V[j0 + j, c] P^T[j, i]: the same products in the same order,
        // the tile's sum one chain added to acc (Join: one chain over all the keys errs like
        // sqrt(n_k) roundings; docs/performance.md, "Blocked sums in the attention")
        if (rows && !first)
            for (Index i = 0; i < mq; ++i) {
                const Packet a = ei::pset1<Packet>(row_alpha[i]);
                for (Index c = 0; c < dv; c += L) {
                    T* ac = acc + i * dv + c;
                    ei::pstoreu(ac, ei::pmul(ei::ploadu<Packet>(ac), a));
                }
            }
        const T* vb = vbase + j0 * vs;
        Index ldv = vs;
        if (bad.count > 0) {  // value rows holding NaN/Inf: out of the product, added below
            vb = value_copy_without(vb, vs, kb, dv, bad);
            ldv = dv;
        }
        const auto product = [&](auto accumulate) {
            constexpr bool Acc = decltype(accumulate)::value;
            if (rows) {
                lanes_product<T, Acc, true>(mq, dv, kb, st, 1, mp, vb, ldv, acc, dv);
            } else {
                lanes_product<T, Acc, true>(dv, mp, kb, vb, 1, ldv, st, mp, acc, mp);
            }
        };
        if (first) {
            product(std::false_type{});
        } else {
            product(std::true_type{});
        }
        const Index qs = rows ? dv : 1, cs = rows ? 1 : mp;  // acc's strides: query, column
        for (Index r = 0; r < bad.count; ++r) {
            const T* vrow = vbase + (j0 + bad.rows[r]) * vs;
            for (Index i = 0; i < mq; ++i)
                if (bad.sees[r * mq + i])
                    for (Index c = 0; c < dv; ++c)
                        acc[i * qs + c * cs] += vrow[c] * st[bad.rows[r] * mp + i];
        }
        first = false;
    }
    if (first) std::fill(acc, acc + dv * mp, T(0));  // no key seen
    if (rows) {                                      // O = acc / l, row by row
        for (Index i = 0; i < mq; ++i) {
            const Packet l = ei::pset1<Packet>(row_l[i]);
            for (Index c = 0; c < dv; c += L)
                ei::pstoreu(x.out + i * x.os + c,
                            ei::pdiv(ei::ploadu<Packet>(acc + i * dv + c), l));
        }
    } else {  // O = (acc / l)^T: packet transposes, each query's row divided on the way
        transpose<T, HalfFormat::none>(dv, mq, acc, mp, x.out, x.os, [&](const auto& v, Index i) {
            if constexpr (std::is_same_v<std::decay_t<decltype(v)>, T>) {
                return v / row_l[i];
            } else {
                return ei::pdiv(v, ei::pset1<Packet>(row_l[i]));
            }
        });
    }
    for (Index i = 0; i < mq; ++i) {
        const T l = row_l[i];
        if (l == T(0)) {  // fully masked row: zeros, not 0 / 0
            T* orow = x.out + i * x.os;
            std::fill(orow, orow + dv, T(0));
        }
        if (p.lse) {
            p.lse[(b * p.heads + h) * p.n_q + i0 + i] =
                l == T(0) ? neg_inf<T>() : row_m[i] + std::log(l);
        }
    }
}

// One (batch, head, query tile) when the weights are wanted: the rows of P are materialised in
// wbase (mq x n_k: the tile's rows of the weights array), normalised there, then multiplied by
// V. Q, K, V and O where x says (as for flash_tile).
template <typename T>
void dense_tile(const AttentionProblem<T>& p, Index b, Index h, Index i0, Index mq,
                const std::uint8_t* v_flags, const TileOperands<T>& x, T* wbase) {
    const Index d = p.d, dv = p.d_v, nk = p.n_k;
    ConstRowMap<T> Q(x.q, mq, d, Eigen::OuterStride<>(x.qs));
    ConstRowMap<T> K(x.k, nk, d, Eigen::OuterStride<>(x.ks));
    ConstRowMap<T> V(x.v, nk, dv, Eigen::OuterStride<>(x.vs));
    RowMap<T> O(x.out, mq, dv, Eigen::OuterStride<>(x.os));
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
    const T* probs = wbase;  // precision="bf16": the product takes the weights rounded
    if (p.bf16 == Bf16::probabilities) {
        T* r = scratch<T>(ScratchBuffer::kDenseProbs, static_cast<std::size_t>(mq * nk));
        std::copy(wbase, wbase + mq * nk, r);
        round_bf16_inplace(r, mq * nk);
        probs = r;
    }
    if (bad.count == 0) {
        eigen_product<T>(cview<T>(probs, mq, nk, nk), V, O);
        return;
    }
    ConstRowMap<T> Vclean(value_copy_without(V.data(), x.vs, nk, dv, bad), nk, dv,
                          Eigen::OuterStride<>(dv));
    eigen_product<T>(cview<T>(probs, mq, nk, nk), Vclean, O);
    for (Index c = 0; c < bad.count; ++c)
        for (Index r = 0; r < mq; ++r)
            if (bad.sees[c * mq + r]) O.row(r) += P(r, bad.rows[c]) * V.row(bad.rows[c]);
}

}  // namespace detail

namespace detail {

template <typename T>
void forward_tiles(const AttentionProblem<T>& p) {
    if (detail::use_decode(p)) {
        detail::decode_forward(p);  // few queries per kv head: split along the keys
        return;
    }
    const Index q_tiles = detail::tile_count(p.n_q, detail::kTileQ, detail::kTileQJoin);
    // Value rows holding NaN/Inf: scanned per key block in the flash tiles when each head has few
    // query tiles (value_flags), else once for the call (each block would be scanned too often).
    const bool weights_wanted = p.weights || p.weights_half;
    const bool scan_in_tiles = !weights_wanted && q_tiles <= detail::kScanInTilesMax;
    const Buffer<std::uint8_t> v_flags =
        scan_in_tiles ? Buffer<std::uint8_t>() : detail::nonfinite_rows(p);
    const Index nk = p.n_k, d = p.d, dv = p.d_v, group = p.heads / p.kv_heads;
    const Index kv_all = p.batch * p.kv_heads, per_head = nk * (d + dv);
    // (rows of whole lines, as copied, where they start off one)
    const bool lines = d * Index(sizeof(T)) % 64 == 0 && dv * Index(sizeof(T)) % 64 == 0;
    const bool copy = !weights_wanted && q_tiles >= detail::kCopyMinTiles && per_head > 0 &&
                      per_head <= detail::kCopyGroupBytes / Index(sizeof(T)) &&
                      (p.k.row_stride != d || p.v.row_stride != dv ||
                       (lines && (detail::rows_off_line(p.k) || detail::rows_off_line(p.v))));
    const Index span =
        copy ? std::clamp<Index>(detail::kCopyGroupBytes / Index(sizeof(T)) / per_head, 1, kv_all)
             : kv_all;
    Buffer<T> kv = copy ? make_buffer<T>(span * per_head) : Buffer<T>();
    if (copy) attention_copied_calls.fetch_add(1, std::memory_order_relaxed);
    for (Index g0 = 0; g0 < kv_all; g0 += span) {  // kv heads [g0, g1), b * kv_heads + hk
        const Index g1 = std::min(kv_all, g0 + span);
        if (copy)
            parallel_for(g1 - g0, [&](Index i) {
                const Index b = (g0 + i) / p.kv_heads, hk = (g0 + i) % p.kv_heads;
                T* kc = kv.get() + i * per_head;
                T* vc = kc + nk * d;
                for (Index j = 0; j < nk; ++j) {
                    const T* kr = p.k.at(b, hk) + j * p.k.row_stride;
                    const T* vr = p.v.at(b, hk) + j * p.v.row_stride;
                    std::copy(kr, kr + d, kc + j * d);
                    std::copy(vr, vr + dv, vc + j * dv);
                }
            });
        // tasks by kv head, then its query heads, then query tiles: (batch, head, tile) order
        parallel_for((g1 - g0) * group * q_tiles, [&](Index t) {
            const Index kvh = g0 + t / (group * q_tiles);
            const Index b = kvh / p.kv_heads, hk = kvh % p.kv_heads;
            const Index h = hk * group + (t / q_tiles) % group;
            const Index qt = t % q_tiles;
            const Index i0 = qt * detail::kTileQ;
            const Index mq = detail::tile_rows(p.n_q, detail::kTileQ, q_tiles, qt);
            const std::uint8_t* flags = v_flags ? v_flags.get() + kvh * nk : nullptr;
            detail::TileOperands<T> x = detail::tile_operands(p, b, h, i0);
            if (weights_wanted) {
                const Index at = ((b * p.heads + h) * p.n_q + i0) * nk;
                if (p.weights) {
                    detail::dense_tile(p, b, h, i0, mq, flags, x, p.weights + at);
                } else if constexpr (std::is_same_v<T, float>) {  // rounded into place
                    float* wf = scratch<float>(ScratchBuffer::kHalfWeights,
                                               static_cast<std::size_t>(mq * nk));
                    detail::dense_tile(p, b, h, i0, mq, flags, x, wf);
                    detail::narrow_block(wf, mq * nk, p.weights_format, p.weights_half + at);
                }
                return;
            }
            if (copy) {  // the same values, as contiguous rows
                x.k = kv.get() + (kvh - g0) * per_head;
                x.ks = d;
                x.v = x.k + nk * d;
                x.vs = dv;
            }
            detail::flash_tile(p, b, h, i0, mq, flags, scan_in_tiles, x);
        });
    }
}

// Half-precision Q, K, V and output. A thread widens the key blocks of a kv head as its tiles
// first read them, with the flags of nonfinite value rows, into its scratch, and keeps them while
// its tasks stay on that head: the tiles read K and V from cache, and the widening overlaps the
// products instead of being a pass before them (on Zen 4 so also for heads of 4096 keys x 128
// features: faster than one pass from memory, docs/performance.md). A task is a kv head's tiles (a
// strided share of them when kv heads are fewer than four a thread), so that each head is widened
// by one thread, not by every thread that claims one of its tiles. Q is widened per tile, O rounded
// as it is written. Heads too large to keep (the thread scratch never shrinks: 4 MiB here) are
// widened once for the call instead.
constexpr Index kHalfHeadFloats = Index(1) << 20;  // K + V floats of a head kept per thread

// The K + V floats of a head a thread keeps: kHalfHeadFloats on Zen 4 (AMD with AVX-512), else
// at most half the L2 (a head that fills the L2 evicts the tiles' own rows from it on Intel and
// on the AVX2 EPYC's 512 KiB, where the widening for the call is the faster; Zen 4 measured the
// opposite: docs/performance.md, "Half-precision heads widened for the call on Intel").
// Decided when the module loads.
#if defined(__AVX512F__)
inline const bool kHalfHeadsOfL2 = !cpu_vendor_is("AuthenticAMD");
#else
inline const bool kHalfHeadsOfL2 = true;
#endif
inline const Index kHalfHeadFloatsHere = kHalfHeadsOfL2 && l2_cache_bytes() > 0
                                             ? std::min<Index>(kHalfHeadFloats,
                                                               Index(l2_cache_bytes() / 2 /
                                                                     sizeof(float)))
                                             : kHalfHeadFloats;

struct WidenedHead {  // which kv head of which call this thread's scratch holds, and which rows
    std::uint64_t call = 0;
    Index head = -1;
    Index lo = 0, hi = 0;
};

inline std::atomic<std::uint64_t> g_half_calls{0};

// Rows [j0, j1) of a head's K and V widened (rows at their own index), with V's nonfinite flags.
inline void widen_key_rows(const AttentionProblem<float>& p, Index b, Index hk, Index j0, Index j1,
                           float* kf, float* vf, std::uint8_t* flags) {
    const Index d = p.d, dv = p.d_v;
    half_rows_to_float(p.k_half.at(b, hk) + j0 * p.k_half.row_stride, p.k_half.row_stride, j1 - j0,
                       d, p.half, kf + j0 * d);
    if (p.bf16 != Bf16::none) round_bf16_block(kf + j0 * d, (j1 - j0) * d, kf + j0 * d);
    const std::uint16_t* v16 = p.v_half.at(b, hk);
    for (Index j = j0; j < j1; ++j) {
        half_to_float(v16 + j * p.v_half.row_stride, dv, p.half, vf + j * dv);
        if (p.bf16 != Bf16::none) round_bf16_block(vf + j * dv, dv, vf + j * dv);
        flags[j] = nonfinite_row(vf + j * dv, dv);
    }
}

inline void forward_half_tiles(const AttentionProblem<float>& p) {
    const Index nk = p.n_k, d = p.d, dv = p.d_v, heads_kv = p.batch * p.kv_heads;
    const bool per_thread = nk * (d + dv) <= kHalfHeadFloatsHere;
    Buffer<float> kw, vw;  // the call-wide copies (large heads)
    Buffer<std::uint8_t> flags_all;
    if (!per_thread) {
        kw = make_buffer<float>(heads_kv * nk * d);
        vw = make_buffer<float>(heads_kv * nk * dv);
        flags_all = make_buffer<std::uint8_t>(heads_kv * nk);
        parallel_for(heads_kv, [&](Index t) {
            widen_key_rows(p, t / p.kv_heads, t % p.kv_heads, 0, nk, kw.get() + t * nk * d,
                           vw.get() + t * nk * dv, flags_all.get() + t * nk);
        });
    }
    const std::uint64_t call = ++g_half_calls;
    const Index q_tiles = tile_count(p.n_q, kTileQ, kTileQJoin);
    const auto tile = [&](Index t) {
        const Index qt = t % q_tiles;
        const Index h = (t / q_tiles) % p.heads;
        const Index b = t / (q_tiles * p.heads);
        const Index i0 = qt * kTileQ;
        const Index mq = tile_rows(p.n_q, kTileQ, q_tiles, qt);
        const Index hk = h / (p.heads / p.kv_heads);
        const Index head = b * p.kv_heads + hk;
        // the output rounded into out_half, or kept in float32 in out (the backward's recompute,
        // or float queries)
        const bool rounded = p.out_half.data != nullptr;
        float* of =
            rounded ? scratch<float>(ScratchBuffer::kHalfOutput, static_cast<std::size_t>(mq * dv))
                    : p.out.at(b, h) + i0 * p.out.row_stride;
        const Index os = rounded ? dv : p.out.row_stride;
        const float* qf;  // half-precision queries widened per tile, float ones read in place
        Index qs;
        if (p.q_half.data || p.bf16 != Bf16::none) {
            float* w =
                scratch<float>(ScratchBuffer::kHalfQueries, static_cast<std::size_t>(mq * d));
            if (p.q_half.data)
                half_rows_to_float(p.q_half.at(b, h) + i0 * p.q_half.row_stride,
                                   p.q_half.row_stride, mq, d, p.half, w);
            else
                for (Index i = 0; i < mq; ++i)
                    std::copy_n(p.q.at(b, h) + (i0 + i) * p.q.row_stride, d, w + i * d);
            if (p.bf16 != Bf16::none) round_bf16_block(w, mq * d, w);  // as the emulation's copies
            qf = w;
            qs = d;
        } else {
            qf = p.q.at(b, h) + i0 * p.q.row_stride;
            qs = p.q.row_stride;
        }
        // per-row flags, never null: whether V holds NaN/Inf is known only as rows are widened
        TileOperands<float> x{qf, qs, nullptr, d, nullptr, dv, of, os};
        // the weights wanted: the tile's rows computed in float32, then rounded into place (or
        // kept in float32 in p.weights: their mean over the heads is taken in float32)
        const bool weights_wanted = p.weights_half || p.weights;
        const auto weights_tile = [&](const std::uint8_t* flags) {
            const Index at = ((b * p.heads + h) * p.n_q + i0) * nk;
            if (p.weights) {
                dense_tile(p, b, h, i0, mq, flags, x, p.weights + at);
                return;
            }
            float* wf =
                scratch<float>(ScratchBuffer::kHalfWeights, static_cast<std::size_t>(mq * nk));
            dense_tile(p, b, h, i0, mq, flags, x, wf);
            narrow_block(wf, mq * nk, p.half, p.weights_half + at);
        };
        if (per_thread) {
            thread_local WidenedHead held;
            float* kf = scratch<float>(ScratchBuffer::kHalfKeys, static_cast<std::size_t>(nk * d));
            float* vf =
                scratch<float>(ScratchBuffer::kHalfValues, static_cast<std::size_t>(nk * dv));
            std::uint8_t* fl =
                scratch<std::uint8_t>(ScratchBuffer::kHalfFlags, static_cast<std::size_t>(nk));
            if (held.call != call || held.head != head) held = {call, head, 0, 0};
            x.k = kf;
            x.v = vf;
            const auto ready = [&](Index j0, Index j1) {
                if (j0 >= held.lo && j1 <= held.hi) return;
                if (j0 >= held.lo && j0 <= held.hi) {  // the next blocks: the range grows
                    widen_key_rows(p, b, hk, held.hi, j1, kf, vf, fl);
                    held.hi = j1;
                } else {
                    widen_key_rows(p, b, hk, j0, j1, kf, vf, fl);
                    held.lo = j0;
                    held.hi = j1;
                }
            };
            if (weights_wanted) {
                ready(0, nk);
                weights_tile(fl);
            } else {
                flash_tile(p, b, h, i0, mq, fl, false, x, ready);
            }
        } else {
            x.k = kw.get() + head * nk * d;
            x.v = vw.get() + head * nk * dv;
            if (weights_wanted)
                weights_tile(flags_all.get() + head * nk);
            else
                flash_tile(p, b, h, i0, mq, flags_all.get() + head * nk, false, x);
        }
        if (!rounded) return;
        std::uint16_t* ob = p.out_half.at(b, h) + i0 * p.out_half.row_stride;
        for (Index i = 0; i < mq; ++i)
            narrow_block(of + i * dv, dv, p.half, ob + i * p.out_half.row_stride);
    };
    // tiles t = ((b kv_heads + hk) group + g) q_tiles + qt: a kv head's tiles are contiguous
    const Index per_kv = p.heads / p.kv_heads * q_tiles;
    if (per_thread) {  // a task: a kv head's tiles, or every chunks-th of them for few heads
        const Index want = 4 * static_cast<Index>(get_num_threads());
        const Index chunks = std::min(per_kv, std::max<Index>(1, (want + heads_kv - 1) / heads_kv));
        parallel_for(heads_kv * chunks, [&](Index c) {
            const Index kvh = c / chunks;
            for (Index i = c % chunks; i < per_kv; i += chunks) tile(kvh * per_kv + i);
        });
        return;
    }
    parallel_for(heads_kv * per_kv, tile);
}

// The decode path with half-precision K and V: it reads them as stored; half-precision query
// rows are widened and the output rows rounded around it (or, without out_half, the output
// kept in float32 in out: the backward's recompute, or float queries read in place).
inline void decode_half(const AttentionProblem<float>& p) {
    const Index rows = p.batch * p.heads * p.n_q;
    const bool rounded = p.out_half.data != nullptr;
    Buffer<float> q = make_buffer<float>(p.q_half.data ? rows * p.d : 0);
    Buffer<float> out = make_buffer<float>(rounded ? rows * p.d_v : 0);
    AttentionProblem<float> r = p;
    if (p.q_half.data) {
        for (Index b = 0; b < p.batch; ++b)
            for (Index h = 0; h < p.heads; ++h)
                half_rows_to_float(p.q_half.at(b, h), p.q_half.row_stride, p.n_q, p.d, p.half,
                                   q.get() + (b * p.heads + h) * p.n_q * p.d);
        r.q = {q.get(), p.heads * p.n_q * p.d, p.n_q * p.d, p.d};
    }
    if (rounded) r.out = {out.get(), p.heads * p.n_q * p.d_v, p.n_q * p.d_v, p.d_v};
    decode_forward(r);
    if (!rounded) return;
    for (Index b = 0; b < p.batch; ++b)
        for (Index h = 0; h < p.heads; ++h)
            for (Index i = 0; i < p.n_q; ++i)
                narrow_block(r.out.at(b, h) + i * p.d_v, p.d_v, p.half,
                             p.out_half.at(b, h) + i * p.out_half.row_stride);
}

#if defined(ATTNLAB_AMX)
// Whether precision="bf16" on p runs the emulation (the float32 tiles on operands rounded to
// bf16): with the attention weights, or where neither AMX nor VDPBF16PS tiles run
inline bool bf16_emulated(const AttentionProblem<float>& p) {
    return !(p.bf16 == Bf16::probabilities && !p.weights && !p.weights_half &&
             (amx_usable() || avx512_bf16_usable()));
}
#endif

}  // namespace detail

template <typename T>
void attention_forward(const AttentionProblem<T>& p) {
    if (p.batch <= 0 || p.heads <= 0 || p.n_q <= 0) return;
    if constexpr (std::is_same_v<T, float>) {
        if (p.half != HalfFormat::none) {
            // bf16 products: the AMX or VDPBF16PS tiles pack half-precision operands as they
            // pack floats (a value row holding NaN or Inf: the emulation, as for floats); the
            // decode path and the emulation round what they widen
#if defined(ATTNLAB_AMX)
            if (p.bf16 != Bf16::none && !detail::use_decode(p) && !detail::bf16_emulated(p)) {
                if (detail::amx_usable() ? detail::amx_forward(p)
                                         : detail::amx_forward<detail::Bf16Products::vdp>(p))
                    return;
            }
#endif
            if (detail::use_decode(p)) {
                detail::decode_half(p);
            } else {
                detail::forward_half_tiles(p);
            }
            return;
        }
    }
    if (p.bf16 == Bf16::none) {
        detail::forward_tiles(p);
        return;
    }
#if defined(ATTNLAB_AMX)
    if constexpr (std::is_same_v<T, float>) {
        const bool tiles = p.bf16 == Bf16::probabilities && !p.weights && !p.weights_half &&
                           !detail::use_decode(p);
        if (tiles && detail::amx_usable() && detail::amx_forward(p)) return;
        if (tiles && !detail::amx_usable() && detail::avx512_bf16_usable() &&
            detail::amx_forward<detail::Bf16Products::vdp>(p))
            return;
    }
#endif
    if constexpr (std::is_same_v<T, float>) {
        if (detail::use_decode(p)) {  // rounds q and each block of K and V as it reads them
            detail::decode_forward(p);
            return;
        }
    }
    const detail::Bf16Operands<T> r = detail::bf16_operands(p);  // the emulation
    detail::forward_tiles(r.p);
}

const char* decode_prefetch() {
    static_assert(detail::kDecodeFetch == detail::Fetch::l2, "the name below says L2");
    return "l2: K and V rows requested into L2";
}

namespace detail {

// Row r of the merge: o[c] = sum_k frac[k, r] part_k[r, c], each part read as stored (F: its
// half-precision bits, widened as loaded), in packets, the parts' products chained in order.
template <typename T, HalfFormat F>
void merge_row(const MergeProblem<T>& p, Index r, T* o) {
    namespace ei = Eigen::internal;
    using Packet = PacketOf<T>;
    constexpr Index L = packet_size<T>();
    const auto part = [&](Index k) -> const StoredElem<T, F>* {
        if constexpr (F == HalfFormat::none) {
            return p.parts[k] + r * p.d;
        } else {
            return p.parts_half[k] + r * p.d;
        }
    };
    Index c = 0;
    for (; c + L <= p.d; c += L) {
        Packet acc = ei::pzero(Packet{});
        // every part's row added, a weight of 0 too: NaN in it reaches the output
        for (Index k = 0; k < p.count; ++k)
            acc = ei::pmadd(ei::pset1<Packet>(p.frac[k * p.rows + r]),
                            load_stored_packet<T, F>(part(k) + c), acc);
        ei::pstoreu(o + c, acc);
    }
    for (; c < p.d; ++c) {
        T acc = T(0);
        for (Index k = 0; k < p.count; ++k)
            acc = mul_add(p.frac[k * p.rows + r], load_stored<T, F>(part(k) + c), acc);
        o[c] = acc;
    }
}

}  // namespace detail

template <typename T>
void merge_attention(const MergeProblem<T>& p) {
    constexpr Index kRows = 64;  // rows a task
    const Index d = p.d, tasks = (p.rows + kRows - 1) / kRows;
    parallel_for(tasks, [&](Index t) {
        const Index r0 = t * kRows, r1 = std::min(p.rows, r0 + kRows);
        T* sum = scratch<T>(ScratchBuffer::kMergeRows, static_cast<std::size_t>(d));
        for (Index r = r0; r < r1; ++r) {
            T* o = p.out_half ? sum : p.out + r * d;
            if constexpr (std::is_same_v<T, float>) {
                if (!p.parts) {
                    if (p.half == HalfFormat::float16) {
                        detail::merge_row<T, HalfFormat::float16>(p, r, o);
                    } else {
                        detail::merge_row<T, HalfFormat::bfloat16>(p, r, o);
                    }
                } else {
                    detail::merge_row<T, HalfFormat::none>(p, r, o);
                }
                if (p.out_half) detail::narrow_block(o, d, p.half, p.out_half + r * d);
            } else {
                detail::merge_row<T, HalfFormat::none>(p, r, o);
            }
        }
    });
}

template void attention_forward<float>(const AttentionProblem<float>&);
template void attention_forward<double>(const AttentionProblem<double>&);
template void merge_attention<float>(const MergeProblem<float>&);
template void merge_attention<double>(const MergeProblem<double>&);

}  // namespace attnlab::ATTNLAB_ISA_NS

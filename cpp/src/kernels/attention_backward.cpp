// The attention backward: P recomputed from the log-sum-exp tile by tile, tasks per (key
// segment, batch, kv head), dQ summed over the segments in a fixed order.
#include <algorithm>
#include <cmath>
#include <tuple>

#include "attention_bf16.hpp"
#include "attnlab/attention.hpp"
#include "attnlab/threading.hpp"
#include "bf16.hpp"
#include "microkernel.hpp"
#include "scratch.hpp"
#include "softmax.hpp"
#include "tiles.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp

namespace detail {

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
// the longest query tile: a last one shorter than a quarter joins the one before (tile_count;
// n = 197: 64, 64, 69, not 64, 64, 64, 5, whose products summing over 5 queries load and store
// the tile's whole dK^T and dV^T accumulators for 5 FMAs each)
constexpr Index kBwdTileQMax = 80;
static_assert(kBwdTileQ + kBwdTileQ / 4 <= kBwdTileQMax);
constexpr Index kBwdTileK = 96;  // a whole number of panels for 4, 8 and 16 lanes
// the longest key tile (a short last one joins the one before: tile_count), padded to packets
constexpr Index kBwdTileKMax = 128;
static_assert(kBwdTileK + kBwdTileK / 4 <= kBwdTileKMax);
// dK and dV sum over the query rows one chain per kBwdChainRows rows of each head, counted from
// its first row (so the query tiles change no bit), each chain then added (blocked sums, as the
// forward's over keys: one chain over all the rows erred like sqrt(n_q) roundings)
constexpr Index kBwdChainRows = 256;
static_assert(kBwdChainRows % kBwdTileQ == 0);
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
    T* dout = nullptr;                  // (batch, heads, n_q, d_v): a half-precision dO widened

    // rows of query tile qt (of tile_count(n_q, kBwdTileQ) = q_tiles)
    Index q_rows(Index n_q, Index qt) const { return tile_rows(n_q, kBwdTileQ, q_tiles, qt); }
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
    plan.q_tiles = tile_count(p.n_q, kBwdTileQ);
    plan.k_tiles = tile_count(p.n_k, kBwdTileK);
    plan.dp = (p.d + L - 1) / L * L;
    if (plan.k_tiles == 0) return plan;
    plan.query_tiles = make_buffer<Interval>(plan.k_tiles);
    for (Index kt = 0; kt < plan.k_tiles; ++kt) {
        const Index j0 = kt * kBwdTileK, kb = tile_rows(p.n_k, kBwdTileK, plan.k_tiles, kt);
        const Interval q = queries_seeing(p.mask, p.n_q, p.n_k, j0, j0 + kb);
        // the tiles of rows q.lo and q.hi - 1 (the last tile holds every row from its start)
        plan.query_tiles[kt] =
            q.lo < q.hi ? Interval{std::min(q.lo / kBwdTileQ, plan.q_tiles - 1),
                                   std::min((q.hi + kBwdTileQ - 1) / kBwdTileQ, plan.q_tiles)}
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
// dkt, dvt: the key tile's dK^T and dV^T; dkc, dvc: the chain of query rows being summed into
// them (kBwdChainRows). kr, vr (half-precision storage only): the tile's K and V rows widened,
// then its dK and dV rows before rounding.
template <typename T>
struct BackwardScratch {
    T *kt, *vt, *kp, *dkt, *dvt, *dkc, *dvc, *s, *dp, *th, *kr, *vr;

    BackwardScratch(Index d, Index dv, Index dp_width, bool half) {
        constexpr Index tk = kBwdTileKMax, tq = kBwdTileQMax;
        const Index rows = half ? tk : 0;
        const Index sizes[] = {d * tk,  dv * tk, tk * dp_width, d * tk,  dv * tk,  d * tk,
                               dv * tk, tq * tk, tq * tk,       tq * tk, d * rows, dv * rows};
        T** slots[] = {&kt, &vt, &kp, &dkt, &dvt, &dkc, &dvc, &s, &dp, &th, &kr, &vr};
        auto round = [](Index n) { return (n + 15) / 16 * 16; };  // keep every slot 64-byte aligned
        Index total = 0;
        for (Index n : sizes) total += round(n);
        T* base = scratch<T>(ScratchBuffer::kBackwardTiles, static_cast<std::size_t>(total));
        for (int i = 0; i < 12; ++i) {
            *slots[i] = base;
            base += round(sizes[i]);
        }
    }
};

// One (batch, query head, query tile) against the key tile held in w (kt, vt, kp: K^T, V^T and
// K padded to dp columns, kbp = kb padded to whole packets): leaves P in w.s and dS in w.dp (for
// dkv_chain) and writes or adds the tile's share of dQ / scale at dq.
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
    lanes_product<T, false, true>(mq, kbp, d, qs, d, 1, w.kt, kbp, w.s, kbp);
    const bool capped = p.mask.options.softcap > 0;
    if (capped) softcap_scores(static_cast<T>(p.mask.options.softcap), w.s, mq * kbp, w.th);
    if (tile_needs_mask(p.mask, p.n_q, p.n_k, i0, i0 + mq, j0, j0 + kb))
        apply_mask(p.mask, b, h, p.n_q, p.n_k, i0, j0, mq, kb, w.s, kbp, Index(1));
    // dP = dO V^T
    lanes_product<T, false, true>(mq, kbp, dv, dout, ds, 1, w.vt, kbp, w.dp, kbp);
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
    // dQ / scale (+)= dS K
    if (accumulate_dq) {
        lanes_product<T, true, true>(mq, dp, kb, w.dp, kbp, 1, w.kp, dp, dq, dp);
    } else {
        lanes_product<T, false, true>(mq, dp, kb, w.dp, kbp, 1, w.kp, dp, dq, dp);
    }
}

// Rows [r, r + n) of the query tile at i0 (P in w.s, dS in w.dp, from backward_pair) into the
// chain in w.dvc, w.dkc: dV^T (+)= dO^T P, dK^T (+)= (scale Q)^T dS, going on from the chain's
// sums when `more` (a new chain starts from zero accumulators otherwise).
template <typename T>
void dkv_chain(const AttentionProblem<T>& p, const AttentionGrad<T>& g, const BackwardPlan<T>& plan,
               const BackwardScratch<T>& w, Index b, Index h, Index i0, Index r, Index n, Index kbp,
               bool more) {
    const Index d = p.d, dv = p.d_v, ds = g.d_out.row_stride;
    const T* dout = g.d_out.at(b, h) + (i0 + r) * ds;
    const T* qs = plan.qs + (plan.head(p, b, h) + i0 + r) * d;
    if (more) {
        lanes_product<T, true>(dv, kbp, n, dout, 1, ds, w.s + r * kbp, kbp, w.dvc, kbp);
        lanes_product<T, true>(d, kbp, n, qs, 1, d, w.dp + r * kbp, kbp, w.dkc, kbp);
    } else {
        lanes_product<T, false>(dv, kbp, n, dout, 1, ds, w.s + r * kbp, kbp, w.dvc, kbp);
        lanes_product<T, false>(d, kbp, n, qs, 1, d, w.dp + r * kbp, kbp, w.dkc, kbp);
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
    const bool half = p.half != HalfFormat::none;
    const BackwardScratch<T> w(d, dv, dp, half);
    const Index t0 = s * plan.seg_tiles, t1 = std::min(plan.k_tiles, t0 + plan.seg_tiles);
    for (Index kt = t0; kt < t1; ++kt) {
        interruption_point();  // a task is a sixteenth of the call: too long to wait for
        const Index j0 = kt * kBwdTileK, kb = tile_rows(p.n_k, kBwdTileK, plan.k_tiles, kt);
        const Index kbp = (kb + L - 1) / L * L;
        // the tile's K and V rows (from row j0): in place, or widened from half precision
        const T* krows = w.kr;
        const T* vrows = w.vr;
        Index ks = d, vs = dv;
        if (!half) {
            krows = p.k.at(b, hk) + j0 * p.k.row_stride;
            vrows = p.v.at(b, hk) + j0 * p.v.row_stride;
            ks = p.k.row_stride;
            vs = p.v.row_stride;
        } else if constexpr (std::is_same_v<T, float>) {
            half_rows_to_float(p.k_half.at(b, hk) + j0 * p.k_half.row_stride, p.k_half.row_stride,
                               kb, d, p.half, w.kr);
            half_rows_to_float(p.v_half.at(b, hk) + j0 * p.v_half.row_stride, p.v_half.row_stride,
                               kb, dv, p.half, w.vr);
            if (p.bf16 == Bf16::operands) {
                round_bf16_block(w.kr, kb * d, w.kr);
                round_bf16_block(w.vr, kb * dv, w.vr);
            }
        }
        key_tile_transposed(krows, ks, 0, kb, kbp, d, w.kt);
        key_tile_transposed(vrows, vs, 0, kb, kbp, dv, w.vt);
        for (Index j = 0; j < kb; ++j) {
            std::copy(krows + j * ks, krows + j * ks + d, w.kp + j * dp);
            std::fill(w.kp + j * dp + d, w.kp + (j + 1) * dp, T(0));
        }
        // dK^T, dV^T: each chain of query rows (kBwdChainRows of a head, or fewer where the
        // tiles seen start or end) summed in w.dkc, w.dvc, then added to w.dkt, w.dvt
        bool chain = false, summed = false;  // a chain open; w.dkt, w.dvt hold a sum
        const auto close_chain = [&] {
            if (!chain) return;
            for (auto [sum, c, n] : {std::tuple{w.dkt, w.dkc, d * kbp}, {w.dvt, w.dvc, dv * kbp}}) {
                if (summed) {
                    for (Index i = 0; i < n; ++i) sum[i] += c[i];
                } else {
                    std::copy(c, c + n, sum);
                }
            }
            summed = true;
            chain = false;
        };
        for (Index gi = 0; gi < group; ++gi) {
            const Index h = hk * group + gi;
            T* part = plan.part(p, s, b, h);
            for (Index qt = plan.query_tiles[kt].lo; qt < plan.query_tiles[kt].hi; ++qt) {
                const Index i0 = qt * kBwdTileQ, mq = plan.q_rows(p.n_q, qt);
                const bool added = kt != t0 && plan.sees(kt - 1, qt);  // a share is there
                backward_pair(p, g, plan, w, b, h, i0, mq, j0, kb, kbp, part + i0 * dp, added);
                for (Index r = 0; r < mq;) {  // the tile's rows, cut where a chain ends
                    const Index end =
                        std::min(mq, ((i0 + r) / kBwdChainRows + 1) * kBwdChainRows - i0);
                    dkv_chain(p, g, plan, w, b, h, i0, r, end - r, kbp, chain);
                    chain = true;
                    r = end;
                    if ((i0 + r) % kBwdChainRows == 0) close_chain();
                }
            }
            close_chain();  // a chain never spans two heads
        }
        if (!summed) {  // no query sees the tile: dK, dV are zero
            std::fill(w.dkt, w.dkt + d * kbp, T(0));
            std::fill(w.dvt, w.dvt + dv * kbp, T(0));
        }
        if constexpr (std::is_same_v<T, float>) {
            if (half) {  // rows of dK, dV in kr, vr (K and V are read), then rounded into place
                transpose(d, kb, w.dkt, kbp, w.kr, d);
                transpose(dv, kb, w.dvt, kbp, w.vr, dv);
                for (Index j = 0; j < kb; ++j) {
                    narrow_block(w.kr + j * d, d, p.half,
                                 g.d_k_half.at(b, hk) + (j0 + j) * g.d_k_half.row_stride);
                    narrow_block(w.vr + j * dv, dv, p.half,
                                 g.d_v_half.at(b, hk) + (j0 + j) * g.d_v_half.row_stride);
                }
                continue;
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
    const Index i0 = qt * kBwdTileQ, mq = plan.q_rows(p.n_q, qt);
    // half-precision Q and dO when their bits are given (Q float beside a half-precision K, V)
    const bool half_q = p.half != HalfFormat::none && p.q_half.data;
    const bool half_dout = p.half != HalfFormat::none && g.d_out_half.data;
    const T* q = half_q ? nullptr : p.q.at(b, h);
    const T* o = p.out.at(b, h);
    const T* dout = g.d_out.at(b, h);
    T* qs = plan.qs + plan.head(p, b, h) * p.d;
    for (Index i = i0; i < i0 + mq; ++i) {
        if constexpr (std::is_same_v<T, float>) {
            if (half_q) {  // widened, then the same products as below
                half_to_float(p.q_half.at(b, h) + i * p.q_half.row_stride, p.d, p.half,
                              qs + i * p.d);
                if (p.bf16 == Bf16::operands) round_bf16_block(qs + i * p.d, p.d, qs + i * p.d);
                for (Index c = 0; c < p.d; ++c) qs[i * p.d + c] *= p.scale;
            }
            if (half_dout)  // into plan.dout, which g.d_out views
                half_to_float(g.d_out_half.at(b, h) + i * g.d_out_half.row_stride, p.d_v, p.half,
                              plan.dout + (plan.head(p, b, h) + i) * p.d_v);
        }
        if (!half_q) {
            const T* qi = q + i * p.q.row_stride;
            T* si = qs + i * p.d;
            if constexpr (std::is_same_v<T, float>)
                if (p.bf16 == Bf16::operands) {  // float q beside a half-precision cache
                    round_bf16_block(qi, p.d, si);
                    qi = si;
                }
            for (Index c = 0; c < p.d; ++c) si[c] = p.scale * qi[c];
        }
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
    const Index i0 = qt * kBwdTileQ, mq = plan.q_rows(p.n_q, qt);
    // the segments that see the tile, in order (at most kBwdMaxSegments)
    const T* parts[kBwdMaxSegments];
    Index count = 0;
    for (Index s = 0; s < plan.segments; ++s)
        if (plan.segment_sees(s, qt)) parts[count++] = plan.part(p, s, b, h) + i0 * plan.dp;
    // row by row (in L1), each element 0 + its shares in order, times the scale; with
    // half-precision storage summed in place of the first share, then rounded into d_q_half
    const bool half = p.half != HalfFormat::none && g.d_q_half.data;
    T* dq = half ? nullptr : g.d_q.at(b, h) + i0 * g.d_q.row_stride;
    std::uint16_t* dq_half = half ? g.d_q_half.at(b, h) + i0 * g.d_q_half.row_stride : nullptr;
    for (Index i = 0; i < mq; ++i) {
        if (half && count == 0) {  // +0 in both formats
            std::fill(dq_half + i * g.d_q_half.row_stride,
                      dq_half + i * g.d_q_half.row_stride + p.d, std::uint16_t(0));
            continue;
        }
        T* row = half ? const_cast<T*>(parts[0]) + i * plan.dp : dq + i * g.d_q.row_stride;
        const T* first = count > 0 ? parts[0] + i * plan.dp : nullptr;
        for (Index c = 0; c < p.d; ++c) row[c] = first ? T(0) + first[c] : T(0);
        for (Index s = 1; s < count; ++s) {
            const T* share = parts[s] + i * plan.dp;
            for (Index c = 0; c < p.d; ++c) row[c] += share[c];
        }
        for (Index c = 0; c < p.d; ++c) row[c] *= p.scale;
        if constexpr (std::is_same_v<T, float>)
            if (half) narrow_block(row, p.d, p.half, dq_half + i * g.d_q_half.row_stride);
    }
}

}  // namespace detail

template <typename T>
void attention_backward(const AttentionProblem<T>& p, const AttentionGrad<T>& given) {
    if (p.batch <= 0 || p.kv_heads <= 0) return;
    if constexpr (std::is_same_v<T, float>) {
        if (p.bf16 == Bf16::probabilities && p.half != HalfFormat::none) {
            // bfloat16 q, k, v are their own rounding but for subnormals and NaN: read as
            // stored when they hold none (the scan is O(n d), the backward O(n^2 d)); else
            // rounded where they are widened
            const bool as_stored =
                p.half == HalfFormat::bfloat16 && p.q_half.data &&
                !detail::bf16_special(p.batch, p.heads, p.n_q, p.d, p.q_half) &&
                !detail::bf16_special(p.batch, p.kv_heads, p.n_k, p.d, p.k_half) &&
                !detail::bf16_special(p.batch, p.kv_heads, p.n_k, p.d_v, p.v_half);
            AttentionProblem<T> e = p;
            e.bf16 = as_stored ? Bf16::none : Bf16::operands;
            attention_backward(e, given);
            return;
        }
    }
    if (p.bf16 == Bf16::probabilities) {  // differentiated in float32 at the operands rounded
        detail::Bf16Operands<T> r = detail::bf16_operands(p);
        r.p.bf16 = Bf16::none;
        attention_backward(r.p, given);
        return;
    }
    if (given.recompute) attention_forward(p);
    detail::BackwardPlan<T> plan = detail::backward_plan(p);
    const Index rows = p.batch * p.heads * p.n_q;
    auto dq_part = make_buffer<T>(plan.segments * rows * plan.dp);
    auto qs = make_buffer<T>(rows * p.d), dsum = make_buffer<T>(rows);
    const bool sink_grad = given.d_sinks && p.mask.sinks;
    auto sink_part = make_buffer<T>(sink_grad ? p.batch * p.heads * plan.q_tiles : 0);
    // a half-precision dO is widened by backward_prepare into dout, which the products then read
    const bool dout_half = p.half != HalfFormat::none && given.d_out_half.data;
    auto dout = make_buffer<T>(dout_half ? rows * p.d_v : 0);
    AttentionGrad<T> g = given;
    if (dout_half) g.d_out = {dout.get(), p.heads * p.n_q * p.d_v, p.n_q * p.d_v, p.d_v};
    plan.dq_part = dq_part.get();
    plan.qs = qs.get();
    plan.dsum = dsum.get();
    plan.sink_part = sink_part.get();
    plan.dout = dout.get();
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

template void attention_backward<float>(const AttentionProblem<float>&,
                                        const AttentionGrad<float>&);
template void attention_backward<double>(const AttentionProblem<double>&,
                                         const AttentionGrad<double>&);

}  // namespace attnlab::ATTNLAB_ISA_NS

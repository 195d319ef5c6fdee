#pragma once
// The decode path of the attention forward: few query rows per key/value head (decoding with a
// cache, n_q * heads / kv_heads <= kDecodeRows) against any number of keys, split along the keys
// (FlashDecoding): each task streams one split of K and V once for all the query heads of its
// group, keeps a partial online softmax, and a last pass merges the splits by their maxima and
// sums in a fixed order. The flash tile would put these few queries in vector lanes padded to a
// packet (16 lanes for one query with AVX-512) and read K and V once per query head.
//
// Shapes per (batch b, kv head hk): the R = group * n_q rows r = g * n_q + i (query head
// hk * group + g, query i); K (n_k x d), V (n_k x d_v) through their strides.

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "attnlab/attention.hpp"
#include "attnlab/threading.hpp"
#include "bf16.hpp"
#include "cpu.hpp"
#include "microkernel.hpp"
#include "scratch.hpp"
#include "softmax.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

constexpr Index kDecodeRows = 16;         // query rows per kv head up to which the decode path runs
constexpr Index kDecodeSplit = 512;       // keys per split at most
constexpr Index kDecodeTasks = 8;         // tasks a call is cut into at least, while keys allow
constexpr Index kDecodeBlock = 64;        // keys per block inside a split (scores of R rows in L1)
constexpr Index kDecodePrefetch = 16384;  // bytes of rows ahead a streamed K or V row is
                                          // requested: what L1 holds beside the block's work
constexpr int kDecodeKeys = 4;            // keys a score pass takes at once
#if defined(__AVX512F__)
// rows a pass holds in registers: 4 rows x 4 keys (or value packets) of accumulators with their
// operands fit the 32 vector registers, 16 of SSE2/AVX2 take 2 rows
constexpr int kDecodeRowBlock = 4;
constexpr int kDecodeAccumulators = 16;
#else
constexpr int kDecodeRowBlock = 2;
constexpr int kDecodeAccumulators = 8;
#endif

// Whether p runs the decode path. Below two splits of keys, the query rows of one head that fill
// a packet (no group to share K and V, e.g. latent attention's heads as rows) keep the flash
// tile, which holds them in one vector across a key tile (docs/performance.md, "Decode against
// short caches").
template <typename T>
bool use_decode(const AttentionProblem<T>& p) {
    const Index group = p.heads / p.kv_heads;
    if (p.weights || p.weights_half || p.n_q * group > kDecodeRows) return false;
    return group > 1 || p.n_q < packet_size<T>() || p.n_k >= 2 * kDecodeSplit;
}

// Keys per split: kDecodeSplit, or fewer (whole blocks) when the call has few (batch, kv head)
// pairs, so that both its long and its short caches give every core work; from the shapes
// alone, so that any thread count splits (and rounds) alike.
inline Index decode_split_keys(Index span, Index pairs) {
    const Index want = (kDecodeTasks + pairs - 1) / pairs;  // splits per pair
    const Index blocks = ((span + want - 1) / want + kDecodeBlock - 1) / kDecodeBlock;
    return std::min(kDecodeSplit, std::max<Index>(blocks, 1) * kDecodeBlock);
}

// Rows ahead of the one read that a streamed row of `bytes` is requested: none where the rows'
// queries or accumulators (`rows_bytes`) would leave L1 no room for the rows requested.
inline Index decode_ahead(Index bytes, Index rows_bytes) {
    if (rows_bytes > kDecodePrefetch) return 0;
    return std::max<Index>(kDecodePrefetch / std::max<Index>(bytes, 1), 1);
}

// Partial results of one split: unnormalised context, running max and sum per row.
template <typename T>
struct DecodeParts {
    T* acc = nullptr;  // (splits, batch, heads, n_q, d_v)
    T* m = nullptr;    // (splits, batch, heads, n_q)
    T* l = nullptr;
};

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"  // GCC 12's _mm512_undefined_pd in predux (105593)
#endif

// s[r * ss + u] = q_r . k_u for RB rows (q_r at q + r * d) and KB keys (k_u at k + u * ks):
// RB x KB independent FMA chains over the head width; the sum of each is the same whatever
// the block, so every row gets the same scores however the rows are grouped.
template <typename T, HalfFormat F, bool B, int RB, int KB, Fetch P>
void decode_dots(const T* q, const StoredElem<T, F>* k, Index ks, Index d, T* s, Index ss,
                 Index ahead) {
    namespace ei = Eigen::internal;
    using Packet = PacketOf<T>;
    constexpr Index L = packet_size<T>();
    const Index dw = d / L * L;  // the whole packets of a row
    // the keys `ahead` rows on, requested as these are read
    if (P != Fetch::none && ahead > 0)
        for (int u = 0; u < KB; ++u)
            for (Index b = 0; b < d * Index(sizeof(StoredElem<T, F>)); b += 64)
                prefetch_to<P>(reinterpret_cast<const char*>(k + (ahead + u) * ks) + b);
    // (every loop over the sums unrolled before GCC decides where they live, and no copy of
    // them: else GCC 12 kept them on the stack, stored and loaded again around the width's loop)
    Packet a[RB][KB];
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
        for (int u = 0; u < KB; ++u) a[r][u] = ei::pset1<Packet>(T(0));
    for (Index c = 0; c < dw; c += L) {
        Packet x[KB];
#pragma GCC unroll 16
        for (int u = 0; u < KB; ++u) x[u] = load_operand_packet<T, F, B>(k + u * ks + c);
#pragma GCC unroll 16
        for (int r = 0; r < RB; ++r) {
            const Packet y = ei::ploadu<Packet>(q + r * d + c);
#pragma GCC unroll 16
            for (int u = 0; u < KB; ++u) a[r][u] = ei::pmadd(y, x[u], a[r][u]);
        }
    }
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float> && L == 16 && RB == 4 && KB == 4) {
        // the 16 sums at once, by shuffles between them: each adds the same lanes in the same
        // order as predux (i + 8, then + 4, + 2, + 1), so the same bits, with half the shuffles
        // and a quarter of the adds; lane 4 r + u of z is row r's score of key u
        __m512 t[8], w[4], x[2];
        // (a[r][u] as v[4 u + r]: pair i is v[2 i], v[2 i + 1])
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
            const __m512 lo = a[(2 * i) % 4][(2 * i) / 4], hi = a[(2 * i + 1) % 4][(2 * i + 1) / 4];
            t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x44),
                                 _mm512_shuffle_f32x4(lo, hi, 0xEE));
        }
        for (int i = 0; i < 4; ++i)
            w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                                 _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
        for (int i = 0; i < 2; ++i)
            x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
        const __m512 z =
            _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xDD));
        _mm_storeu_ps(s, _mm512_extractf32x4_ps(z, 0));
        _mm_storeu_ps(s + ss, _mm512_extractf32x4_ps(z, 1));
        _mm_storeu_ps(s + 2 * ss, _mm512_extractf32x4_ps(z, 2));
        _mm_storeu_ps(s + 3 * ss, _mm512_extractf32x4_ps(z, 3));
        if (dw < d)
            for (int r = 0; r < 4; ++r)
                for (int u = 0; u < 4; ++u) {
                    T tail = s[r * ss + u];
                    for (Index c = dw; c < d; ++c)
                        tail = mul_add(q[r * d + c], load_operand<T, F, B>(k + u * ks + c), tail);
                    s[r * ss + u] = tail;
                }
        return;
    }
#endif
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
        for (int u = 0; u < KB; ++u) {
            T t = ei::predux(a[r][u]);
            for (Index c = dw; c < d; ++c)
                t = mul_add(q[r * d + c], load_operand<T, F, B>(k + u * ks + c), t);
            s[r * ss + u] = t;
        }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// decode_dots for `rows` <= RB rows
template <typename T, HalfFormat F, bool B, int RB, int KB, Fetch P>
void decode_dots_rows(Index rows, const T* q, const StoredElem<T, F>* k, Index ks, Index d, T* s,
                      Index ss, Index ahead) {
    if constexpr (RB > 1)
        if (rows < RB)
            return decode_dots_rows<T, F, B, RB - 1, KB, P>(rows, q, k, ks, d, s, ss, ahead);
    decode_dots<T, F, B, RB, KB, P>(q, k, ks, d, s, ss, ahead);
}

// acc_r[c0, c0 + NP L) += sum_{j < kb} p_rj v_j[c0, c0 + NP L) for RB rows (p_r at pr + r * ss,
// acc_r at acc + r * as), the columns held in registers across the keys. With Skip, a key a row
// may not see (score -inf) is skipped for it, so its value (even NaN) never reaches that row.
// The row `ahead` on is requested as P says, the choice a template argument: a branch in this
// loop made GCC 12 keep the sums on the stack (docs/performance.md, "Decode sums in registers").
template <typename T, HalfFormat F, bool B, int RB, int NP, bool Skip, Fetch P>
void decode_values(const T* sc, const T* pr, Index ss, const StoredElem<T, F>* v, Index vs,
                   Index kb, T* acc, Index as, Index c0, Index ahead) {
    namespace ei = Eigen::internal;
    using Packet = PacketOf<T>;
    constexpr Index L = packet_size<T>();
    constexpr Index kLineBytes = NP * L * Index(sizeof(StoredElem<T, F>));
    // (loops over rows and packets unrolled first: see decode_dots)
    Packet a[RB][NP];
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
        for (int u = 0; u < NP; ++u) a[r][u] = ei::pload<Packet>(acc + r * as + c0 + u * L);
    for (Index j = 0; j < kb; ++j) {
        const StoredElem<T, F>* vj = v + j * vs + c0;
        if constexpr (P != Fetch::none)
            for (Index b = 0; b < kLineBytes; b += 64)
                prefetch_to<P>(reinterpret_cast<const char*>(vj + ahead * vs) + b);
        Packet x[NP];
#pragma GCC unroll 16
        for (int u = 0; u < NP; ++u) x[u] = load_operand_packet<T, F, B>(vj + u * L);
#pragma GCC unroll 16
        for (int r = 0; r < RB; ++r) {
            if (Skip && sc[r * ss + j] == neg_inf<T>()) continue;
            const Packet w = ei::pset1<Packet>(pr[r * ss + j]);
#pragma GCC unroll 16
            for (int u = 0; u < NP; ++u) a[r][u] = ei::pmadd(w, x[u], a[r][u]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
        for (int u = 0; u < NP; ++u) ei::pstore(acc + r * as + c0 + u * L, a[r][u]);
}

// decode_values for `rows` <= RB rows
template <typename T, HalfFormat F, bool B, int RB, int NP, bool Skip, Fetch P>
void decode_values_rows(Index rows, const T* sc, const T* pr, Index ss, const StoredElem<T, F>* v,
                        Index vs, Index kb, T* acc, Index as, Index c0, Index ahead) {
    if constexpr (RB > 1)
        if (rows < RB)
            return decode_values_rows<T, F, B, RB - 1, NP, Skip, P>(rows, sc, pr, ss, v, vs, kb,
                                                                    acc, as, c0, ahead);
    decode_values<T, F, B, RB, NP, Skip, P>(sc, pr, ss, v, vs, kb, acc, as, c0, ahead);
}

// decode_values for the R rows over the whole packets of [c, dv), in chunks of NP, NP / 2, ...,
// 1 packets, each chunk through every row block while its values are in L1 (the first block
// streams them); returns the first column after them
template <typename T, HalfFormat F, bool B, int NP, bool Skip, Fetch P>
Index decode_values_cols(Index R, const T* sc, const T* pr, Index ss, const StoredElem<T, F>* v,
                         Index vs, Index kb, T* acc, Index as, Index c, Index dv, Index ahead) {
    constexpr Index W = NP * packet_size<T>();
    for (; c + W <= dv; c += W) {
        // the first row block streams the values (and requests those ahead), the others
        // read them from L1
        decode_values_rows<T, F, B, kDecodeRowBlock, NP, Skip, P>(
            std::min<Index>(kDecodeRowBlock, R), sc, pr, ss, v, vs, kb, acc, as, c, ahead);
        for (Index r0 = kDecodeRowBlock; r0 < R; r0 += kDecodeRowBlock)
            decode_values_rows<T, F, B, kDecodeRowBlock, NP, Skip, Fetch::none>(
                std::min<Index>(kDecodeRowBlock, R - r0), sc + r0 * ss, pr + r0 * ss, ss, v, vs, kb,
                acc + r0 * as, as, c, 0);
    }
    if constexpr (NP > 1)
        c = decode_values_cols<T, F, B, NP / 2, Skip, P>(R, sc, pr, ss, v, vs, kb, acc, as, c, dv,
                                                         ahead);
    return c;
}

// acc += P V for the R rows over the whole packets of the value rows (see decode_values_cols):
// value packets per row as many as leave the registers to the accumulators of a row block; a
// single row takes all of them (AVX2 and SSE2 then stream a value row of 128 in two passes,
// not four: docs/performance.md, "Decode of one query row on AVX2")
template <typename T, HalfFormat F, bool B, bool Skip, Fetch P>
Index decode_values_all(Index R, const T* sc, const T* pr, Index ss, const StoredElem<T, F>* v,
                        Index vs, Index kb, T* acc, Index as, Index dv, Index ahead) {
    constexpr int wide = kDecodeAccumulators / 2, narrow = kDecodeAccumulators / kDecodeRowBlock;
    if (R == 1)
        return decode_values_cols<T, F, B, kDecodeAccumulators, Skip, P>(R, sc, pr, ss, v, vs, kb,
                                                                         acc, as, 0, dv, ahead);
    if (R <= 2)
        return decode_values_cols<T, F, B, wide, Skip, P>(R, sc, pr, ss, v, vs, kb, acc, as, 0, dv,
                                                          ahead);
    return decode_values_cols<T, F, B, narrow, Skip, P>(R, sc, pr, ss, v, vs, kb, acc, as, 0, dv,
                                                        ahead);
}

// One task: rows of (b, hk) against keys [j_lo, j_hi) of split sp; K and V stored as F says, and
// with B (precision="bf16", float only) q, K and V rounded to bf16 (the same bits as rounded
// copies of the arrays, none made): q here; K and V with Loads as the kernels load them (rows
// that fit one row block: each value is loaded once), else a block at a time into scratch
// first, which the kernels then read (more rows would round each value again for every row
// block: docs/performance.md)
template <typename T, HalfFormat F, bool B, bool Loads>
void decode_split(const AttentionProblem<T>& p, const DecodeParts<T>& parts, Index sp, Index b,
                  Index hk, Index j_lo, Index j_hi) {
    namespace ei = Eigen::internal;
    using Packet = PacketOf<T>;
    constexpr Index L = packet_size<T>();
    const Index group = p.heads / p.kv_heads, R = group * p.n_q;
    const Index d = p.d, dv = p.d_v, kbp = kDecodeBlock;
    const Index dvp = (dv + L - 1) / L * L;
    T* qs = scratch<T>(ScratchBuffer::kDecodeQueries, static_cast<std::size_t>(R * d));
    T* sc = scratch<T>(ScratchBuffer::kDecodeScores, static_cast<std::size_t>(2 * R * kbp));
    T* pr = sc + R * kbp;
    T* acc = scratch<T>(ScratchBuffer::kDecodeAccumulator, static_cast<std::size_t>(R * dvp));
    T m[kDecodeRows], l[kDecodeRows];
    for (Index g = 0; g < group; ++g)
        for (Index i = 0; i < p.n_q; ++i) {
            const T* q = p.q.at(b, hk * group + g) + i * p.q.row_stride;
            T* qr = qs + (g * p.n_q + i) * d;
            if constexpr (B) {
                round_bf16_block(q, d, qr);
                q = qr;
            }
            for (Index c = 0; c < d; ++c) qr[c] = p.scale * q[c];
        }
    std::fill(acc, acc + R * dvp, T(0));
    std::fill(m, m + R, neg_inf<T>());
    std::fill(l, l + R, T(0));
    using E = StoredElem<T, F>;
    constexpr bool kRoundLoads = B && Loads, kRoundBlocks = B && !Loads;
    // what the kernels read: the cache, or its rounded block (floats; a bfloat16 cache's bits)
    constexpr HalfFormat FK = kRoundBlocks && F != HalfFormat::bfloat16 ? HalfFormat::none : F;
    using EK = StoredElem<T, FK>;
    EK* rounded = kRoundBlocks ? scratch<EK>(ScratchBuffer::kDecodeRounded,
                                             static_cast<std::size_t>(kbp * (d + dv)))
                               : nullptr;
    const E *kbase, *vbase;
    Index ks, vs;
    if constexpr (F == HalfFormat::none) {
        kbase = p.k.at(b, hk);
        vbase = p.v.at(b, hk);
        ks = p.k.row_stride;
        vs = p.v.row_stride;
    } else {
        kbase = p.k_half.at(b, hk);
        vbase = p.v_half.at(b, hk);
        ks = p.k_half.row_stride;
        vs = p.v_half.row_stride;
    }
    const bool capped = p.mask.options.softcap > 0;
    // streamed rows (half the bytes when stored in half precision) are requested ahead
    const Index rows_bytes = R * std::max(d, dvp) * Index(sizeof(T));
    // (rounded blocks are read from L1 or L2: nothing to request)
    const Index k_ahead = kRoundBlocks ? 0 : decode_ahead(d * Index(sizeof(E)), rows_bytes);
    const Index v_ahead = kRoundBlocks ? 0 : decode_ahead(dv * Index(sizeof(E)), rows_bytes);
    // (the rounding touches no query row or accumulator: L1 has room for the rows requested)
    const Index round_ahead_k = kRoundBlocks ? decode_ahead(d * Index(sizeof(E)), 0) : 0;
    const Index round_ahead_v = kRoundBlocks ? decode_ahead(dv * Index(sizeof(E)), 0) : 0;
    const bool mask_arrays = p.mask.kind != MaskKind::none || p.mask.key_padding.data;
    for (Index j0 = j_lo; j0 < j_hi; j0 += kbp) {
        const Index kb = std::min(kbp, j_hi - j0);
        // keys no row may see by the mask arrays (a padded batch element's cache past its
        // length): not read at all
        if (mask_arrays && block_unseen(p.mask, b, hk * group, group, 0, p.n_q, j0, kb)) continue;
        const EK* kblock;
        const EK* vblock;
        Index kst = ks, vst = vs;  // the block's row strides
        if constexpr (kRoundBlocks) {
            // the rounding is the block's first read of the cache: rows ahead requested
            const auto fetch = [&](const E* row, Index ahead, Index bytes) {
                const char* at = reinterpret_cast<const char*>(row) + ahead;
                for (Index c = 0; c < bytes; c += 64) prefetch_to<kDecodeFetch>(at + c);
            };
            const auto round_row = [&](const E* src, Index n, EK* dst) {
                if constexpr (F == HalfFormat::bfloat16) {
                    round_bf16_bits(src, n, dst);  // only subnormals and NaN change
                } else if constexpr (F == HalfFormat::float16) {
                    half_to_bf16_block(src, n, F, dst);
                } else {
                    round_bf16_block(src, n, dst);
                }
            };
            for (Index u = 0; u < kb; ++u) {
                const E* krow = kbase + (j0 + u) * ks;
                const E* vrow = vbase + (j0 + u) * vs;
                if (round_ahead_k)
                    fetch(krow, round_ahead_k * ks * Index(sizeof(E)), d * Index(sizeof(E)));
                if (round_ahead_v)
                    fetch(vrow, round_ahead_v * vs * Index(sizeof(E)), dv * Index(sizeof(E)));
                round_row(krow, d, rounded + u * d);
                round_row(vrow, dv, rounded + kbp * d + u * dv);
            }
            kblock = rounded;
            vblock = rounded + kbp * d;
            kst = d;
            vst = dv;
        } else {
            kblock = kbase + j0 * ks;
            vblock = vbase + j0 * vs;
        }
        // scores a few keys at a time for every row while those keys are in L1; the first
        // rows stream them from memory (and request those ahead as P says)
        const auto scores = [&](auto fetch) {
            constexpr Fetch P = decltype(fetch)::value;
            // the value rows of keys [j, j + n) requested as their scores are computed: the
            // value stream stays in flight through the score pass, which grouped heads make
            // long (docs/performance.md, "Value rows requested during the score pass")
            const auto request_values = [&](Index j, Index n) {
                if constexpr (P != Fetch::none)
                    for (Index u = 0; u < n; ++u) prefetch_row<P>(vblock + (j + u) * vst, dv);
            };
            Index j = 0;
            // more than two rows where a row block holds two (16 registers: AVX2, SSE2): two
            // keys for four rows at a time, so that the keys are read once (four keys for two
            // rows read them again, from L1, for every further two rows)
            if constexpr (kDecodeRowBlock == 2) {  // not compiled where a block holds four
                for (; R > 2 && j + 2 <= kb; j += 2) {
                    decode_dots_rows<T, FK, kRoundLoads, 4, 2, P>(
                        std::min<Index>(4, R), qs, kblock + j * kst, kst, d, sc + j, kbp, k_ahead);
                    request_values(j, 2);
                    for (Index r0 = 4; r0 < R; r0 += 4)
                        decode_dots_rows<T, FK, kRoundLoads, 4, 2, Fetch::none>(
                            std::min<Index>(4, R - r0), qs + r0 * d, kblock + j * kst, kst, d,
                            sc + r0 * kbp + j, kbp, 0);
                }
            }
            for (; j + kDecodeKeys <= kb; j += kDecodeKeys) {
                decode_dots_rows<T, FK, kRoundLoads, kDecodeRowBlock, kDecodeKeys, P>(
                    std::min<Index>(kDecodeRowBlock, R), qs, kblock + j * kst, kst, d, sc + j, kbp,
                    k_ahead);
                request_values(j, kDecodeKeys);
                for (Index r0 = kDecodeRowBlock; r0 < R; r0 += kDecodeRowBlock)
                    decode_dots_rows<T, FK, kRoundLoads, kDecodeRowBlock, kDecodeKeys, Fetch::none>(
                        std::min<Index>(kDecodeRowBlock, R - r0), qs + r0 * d, kblock + j * kst,
                        kst, d, sc + r0 * kbp + j, kbp, 0);
            }
            for (; j < kb; ++j)
                for (Index r0 = 0; r0 < R; r0 += kDecodeRowBlock)
                    decode_dots_rows<T, FK, kRoundLoads, kDecodeRowBlock, 1, Fetch::none>(
                        std::min<Index>(kDecodeRowBlock, R - r0), qs + r0 * d, kblock + j * kst,
                        kst, d, sc + r0 * kbp + j, kbp, 0);
        };
        if (k_ahead == 0)
            scores(std::integral_constant<Fetch, Fetch::none>{});
        else
            scores(std::integral_constant<Fetch, kDecodeFetch>{});
        for (Index g = 0; g < group; ++g) {
            T* sg = sc + g * p.n_q * kbp;
            if (capped)
                for (Index i = 0; i < p.n_q; ++i)
                    softcap_scores(static_cast<T>(p.mask.options.softcap), sg + i * kbp, kb,
                                   (T*)nullptr);
            if (tile_needs_mask(p.mask, p.n_q, p.n_k, Index(0), p.n_q, j0, j0 + kb))
                apply_mask(p.mask, b, hk * group + g, p.n_q, p.n_k, Index(0), j0, p.n_q, kb, sg,
                           kbp, Index(1));
        }
        // online softmax per row; pr = exp(s - m_new)
        for (Index r = 0; r < R; ++r) {
            const T* s = sc + r * kbp;
            const T bm = row_max(s, kb);
            const T mn = m[r] < bm ? bm : m[r];  // a NaN score reaches the row through its sum
            const T shift = mn == neg_inf<T>() ? T(0) : mn;
            const T sum = exp_row(s, shift, pr + r * kbp, kb);
            if (p.bf16 == Bf16::probabilities)
                round_bf16_inplace(pr + r * kbp, kb);  // the sum took them unrounded
            const T alpha = m[r] == neg_inf<T>() ? T(0) : std::exp(m[r] - shift);
            l[r] = l[r] * alpha + sum;
            m[r] = mn;
            if (alpha != T(1)) {
                const Packet a = ei::pset1<Packet>(alpha);
                T* ar = acc + r * dvp;
                for (Index c = 0; c < dvp; c += L)
                    ei::pstore(ar + c, ei::pmul(a, ei::pload<Packet>(ar + c)));
            }
        }
        // acc += P V: each value row read once for the R rows, a few column packets of a few
        // rows in registers across the block's keys; the skip test only where some row may
        // not see some key
        // (a loop, not std::find: a std:: template instantiated out of line in an AVX variant
        // is a weak symbol the generic variant's callers may link to)
        bool masked = false;
        const Packet ninf = ei::pset1<Packet>(neg_inf<T>());
        for (Index r = 0; r < R && !masked; ++r) {  // a packet of scores at a time
            const T* s = sc + r * kbp;
            Index j = 0;
            for (; j + L <= kb && !masked; j += L)
                masked = ei::predux_any(ei::pcmp_eq(ei::pload<Packet>(s + j), ninf));
            for (; j < kb && !masked; ++j) masked = s[j] == neg_inf<T>();
        }
        const auto values = [&](auto skip) {
            constexpr bool S = decltype(skip)::value;
            if (v_ahead == 0)
                return decode_values_all<T, FK, kRoundLoads, S, Fetch::none>(
                    R, sc, pr, kbp, vblock, vst, kb, acc, dvp, dv, 0);
            return decode_values_all<T, FK, kRoundLoads, S, kDecodeFetch>(
                R, sc, pr, kbp, vblock, vst, kb, acc, dvp, dv, v_ahead);
        };
        const Index c = masked ? values(std::true_type{}) : values(std::false_type{});
        for (Index j = 0; j < kb && c < dv; ++j)  // the columns after the last whole packet
            for (Index r = 0; r < R; ++r)
                if (sc[r * kbp + j] != neg_inf<T>())
                    for (Index cc = c; cc < dv; ++cc)
                        acc[r * dvp + cc] =
                            mul_add(pr[r * kbp + j],
                                    load_operand<T, FK, kRoundLoads>(vblock + j * vst + cc),
                                    acc[r * dvp + cc]);
    }
    for (Index g = 0; g < group; ++g)
        for (Index i = 0; i < p.n_q; ++i) {
            const Index r = g * p.n_q + i;
            const Index row = ((sp * p.batch + b) * p.heads + hk * group + g) * p.n_q + i;
            std::copy(acc + r * dvp, acc + r * dvp + dv, parts.acc + row * dv);
            parts.m[row] = m[r];
            parts.l[row] = l[r];
        }
}

// The splits of (b, h, i) merged in split order, with the sink as one more part of logit
// `sink`, sum 1 and no value; the output row and the log-sum-exp.
template <typename T>
void decode_merge(const AttentionProblem<T>& p, const DecodeParts<T>& parts, Index splits, Index b,
                  Index h, Index i) {
    const Index rows = p.batch * p.heads * p.n_q;
    const Index row = (b * p.heads + h) * p.n_q + i;
    const T sink = p.mask.sinks ? p.mask.sink(b, h) : neg_inf<T>();
    T mx = sink;
    for (Index s = 0; s < splits; ++s) {
        const T ms = parts.m[s * rows + row];
        if (ms != ms)
            mx = ms;  // NaN propagates
        else if (mx == mx && ms > mx)
            mx = ms;
    }
    const T shift = mx == neg_inf<T>() ? T(0) : mx;
    T* out = p.out.at(b, h) + i * p.out.row_stride;
    std::fill(out, out + p.d_v, T(0));
    T total = sink == neg_inf<T>() ? T(0) : std::exp(sink - shift);
    for (Index s = 0; s < splits; ++s) {
        const T ms = parts.m[s * rows + row], ls = parts.l[s * rows + row];
        if (ls == T(0)) continue;  // a split this row saw no key of
        // NaN scores leave the max at -inf and the sum NaN: the NaN must still reach the row
        const T f = ms == neg_inf<T>() ? T(1) : std::exp(ms - shift);
        total += f * ls;
        const T* a = parts.acc + (s * rows + row) * p.d_v;
        for (Index c = 0; c < p.d_v; ++c) out[c] += f * a[c];
    }
    if (total == T(0)) {  // no key and no sink: zeros, lse -inf
        std::fill(out, out + p.d_v, T(0));
    } else {
        for (Index c = 0; c < p.d_v; ++c) out[c] /= total;
    }
    if (p.lse) p.lse[row] = total == T(0) ? neg_inf<T>() : shift + std::log(total);
}

template <typename T>
void decode_forward(const AttentionProblem<T>& p) {
    const Interval keys = keys_seen(p.mask, p.n_q, p.n_k, Index(0), p.n_q);
    const Index span = std::max<Index>(keys.hi - keys.lo, 0);
    const Index pairs = p.batch * p.kv_heads, group = p.heads / p.kv_heads;
    const Index split = decode_split_keys(span, pairs);
    const Index splits = std::max<Index>((span + split - 1) / split, 1);
    const Index rows = p.batch * p.heads * p.n_q;
    auto acc = make_buffer<T>(splits * rows * p.d_v);
    auto stats = make_buffer<T>(2 * splits * rows);
    const DecodeParts<T> parts{acc.get(), stats.get(), stats.get() + splits * rows};
    parallel_for(splits * pairs, [&](Index t) {
        const Index sp = t / pairs, b = (t % pairs) / p.kv_heads, hk = t % p.kv_heads;
        const Index lo = keys.lo + sp * split;
        const Index hi = std::min(keys.hi, lo + split);
        const auto split_as = [&](auto format) {
            constexpr HalfFormat F = decltype(format)::value;
            // (half formats and bf16 products: float only)
            if constexpr (std::is_same_v<T, float>) {
                if (p.bf16 == Bf16::none)
                    decode_split<T, F, false, false>(p, parts, sp, b, hk, lo, hi);
                else if (group * p.n_q <= kDecodeRowBlock)
                    decode_split<T, F, true, true>(p, parts, sp, b, hk, lo, hi);
                else
                    decode_split<T, F, true, false>(p, parts, sp, b, hk, lo, hi);
            } else if constexpr (F == HalfFormat::none) {
                decode_split<T, F, false, false>(p, parts, sp, b, hk, lo, hi);
            }
        };
        if (std::is_same_v<T, float> && p.half == HalfFormat::float16)
            split_as(std::integral_constant<HalfFormat, HalfFormat::float16>{});
        else if (std::is_same_v<T, float> && p.half == HalfFormat::bfloat16)
            split_as(std::integral_constant<HalfFormat, HalfFormat::bfloat16>{});
        else
            split_as(std::integral_constant<HalfFormat, HalfFormat::none>{});
        if (splits == 1)  // the task holds its rows whole: merged here, with no second pass
            for (Index h = hk * group; h < (hk + 1) * group; ++h)
                for (Index i = 0; i < p.n_q; ++i) decode_merge(p, parts, splits, b, h, i);
    });
    if (splits > 1)
        parallel_for(p.batch * p.heads, [&](Index t) {
            for (Index i = 0; i < p.n_q; ++i)
                decode_merge(p, parts, splits, t / p.heads, t % p.heads, i);
        });
}

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS

#include "attnlab/gemm.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "attnlab/kernels.hpp"
#include "attnlab/threading.hpp"
#include "half_convert.hpp"
#include "microkernel.hpp"
#include "products.hpp"
#include "scratch.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp

namespace {

// B given as half-precision bits instead (linear_half): widened as its chunks are packed
struct HalfB {
    const std::uint16_t* bits = nullptr;
    HalfFormat format = HalfFormat::none;
};

// Blocking: a task is 128 rows x 8 panels of output columns, the depth runs in chunks (see
// Blocking below). Fixed sizes: the summation order never depends on the thread count, nor on
// the depth chunks, whole numbers of kChain (each element sums chains of kChain products,
// microkernel.hpp, and adds each to its result in depth order).
constexpr Index kRowChunk = 128;
constexpr Index kPanelsPerTask = 8;
constexpr int kMaxGemmGroup = 3;  // products gemm_group() runs together (a layer's Q, K, V)

// Chosen per instruction-set variant (gemm_blocking() names it in build_info()).
struct Blocking {
    Index depth;          // depth chunk of a B panel (the last one shorter), A's rows contiguous
    Index depth_strided;  // the same, A read across its rows (X^T of a weight gradient)
    bool pack_once;       // whole B panels packed before the products when more than 2 row chunks
    const char* name;
    bool fetch_packed = false;  // packed B rows requested into L1 ahead of the products
};

// AVX-512 (Intel with two 512-bit FMA ports and AMD Zen 4 alike): the kernel streams B panels
// from L2 at nearly full rate, so long chunks save the stores and reloads of Y, and packing B
// once, by rows read in order, replaces a strided copy per row chunk; but an A read across its
// rows takes a cache line per step of the depth, which long chunks evict before the next row
// block reuses them. AVX2 with an L2 of 1 MiB or more per core (Intel client cores, Zen 4 when
// forced to AVX2): the same, in chunks of 512 (a row chunk of A, 256 KiB, stays in L2). AVX2
// with a smaller L2 (Zen 2 and 3: 512 KiB): chunks of 256 keep the B panel chunk in a 32 KiB L1,
// B packed once too (a copy per row chunk's task re-read the weights' strided rows from L3).
// Generic: chunks of 256, each row chunk's task packing its own copy (docs/performance.md,
// issue 30).
// On Intel with AVX-512 the kernels reading a packed block also request its rows
// detail::kPackedAhead ahead into L1 (docs/performance.md, "Intel again: prefetches chosen for
// it").
// ATTNLAB_GEMM_BLOCKING=default forces the default (the same bits: every chunk is whole chains
// of kChain products, and a prefetch changes no arithmetic).
const Blocking& blocking() {
    static const Blocking chosen = [] {
        const Blocking standard{256, 256, false,
                                "default: depth chunks of 256, B packed by each row chunk"};
        const char* env = std::getenv("ATTNLAB_GEMM_BLOCKING");
        if (env && std::strcmp(env, "default") == 0) return standard;
#if defined(__AVX512F__)
        if (detail::cpu_vendor_is("GenuineIntel"))
            return Blocking{2048, 256, true,
                            "avx512-intel: depth chunks of 2048 (256 for A^T), B packed once per "
                            "call, its rows requested into L1 16 ahead",
                            true};
        return Blocking{2048, 256, true,
                        "avx512: depth chunks of 2048 (256 for A^T), B packed once per call"};
#elif defined(__AVX2__)
        constexpr std::size_t kLargeL2 = std::size_t(1) << 20;
        if (l2_cache_bytes() >= kLargeL2)
            return Blocking{512, 256, true,
                            "avx2-large-l2: depth chunks of 512 (256 for A^T), B packed once per "
                            "call (an L2 of 1 MiB or more per core)"};
        return Blocking{256, 256, true,
                        "avx2: depth chunks of 256, B packed once per call (an L2 under 1 MiB)"};
#else
        return standard;
#endif
    }();
    return chosen;
}

struct WidenedRows {  // which row chunk of which call this thread's kGemmHalfRows holds
    std::uint64_t call = 0;
    Index r0 = -1;
};
inline std::atomic<std::uint64_t> g_gemm_calls{0};

// Y[0:m, 0:W) += A[0:m, :] B[:, j0:j0+nw) (nw <= W), A(r, t) = a[r * a_rs + t * a_ts],
// B(t, j) = b[t * ldb + j], or b[j * ldb + t] when b_transposed; Y initialised by the caller,
// or Y = A B when zero_start (depth > 0). Each depth chunk of the B panel is copied to a
// contiguous buffer, zero-padded to W columns: read in place, its rows would be ldb apart, and a
// power-of-two ldb maps them all onto the same L1 sets (docs/performance.md, "GEMM packing").
// A whole panel is copied by the first row block's kernel as it reads it (a copy before the
// products mostly waited for the weights). The same FMAs in the same order either way: the result
// does not depend on which rows packed.
//
// packed: the whole panel, packed by gemm before the products (Blocking::pack_once), else null.
// bias: the panel's nw biases, added to each register block's rows as soon as its last depth
// chunk is computed, while they are in L1 (a pass after the panel found them evicted by the B
// stream: docs/performance.md, "Weights packed once"), or null.
// NP: the panel's width in packets, W = NP packets; 3 but for the last panel of a width that is
// not a whole number of 3-packet panels (64 columns with AVX-512: 48 + 16, not 48 + 48).
template <typename T, int NP>
void panel_gemm(Index m, Index depth, const T* a, Index a_rs, Index a_ts, const HalfB& bh,
                const T* b, Index ldb, bool b_transposed, Index j0, Index nw, T* y, Index ldy,
                bool zero_start, bool next_panel, const T* packed, const T* bias) {
    constexpr Index W = NP * detail::packet_size<T>();
    constexpr int MR = detail::rows_for_packets<NP>();
    const Index chunk = a_ts == 1 ? blocking().depth : blocking().depth_strided;
    T* bp = packed ? nullptr
                   : scratch<T>(ScratchBuffer::kGemmPanel,
                                static_cast<std::size_t>(std::min(chunk, depth) * W));
    // rows computed before the bias is added to them: one register block (a second block's
    // pass over the B panel would evict the first's Y rows from L1)
    constexpr Index kSlice = MR;
    for (Index k0 = 0; k0 < depth; k0 += chunk) {
        const Index kc = std::min(chunk, depth - k0);
        const T* ak = a + k0 * a_ts;
        // rows [r0, r1) are final: the bias, after their products (not as their start: a bias
        // larger than the products would make every FMA round at its scale)
        const auto finish = [&](Index r0, Index r1) {
            if (!bias || k0 + kc < depth) return;
            for (Index r = r0; r < r1; ++r) {
                T* yr = y + r * ldy;
                for (Index j = 0; j < nw; ++j) yr[j] += bias[j];
            }
        };
        // rows [r, r + n) from the packed block bk (rows W apart), its rows requested ahead
        // where the blocking says so
        const auto packed_rows = [&](auto acc, Index r, Index n, const T* bk) {
            constexpr bool Acc = decltype(acc)::value;
            if (blocking().fetch_packed)
                detail::panel_rows<T, NP, MR, Acc, HalfFormat::none, true, detail::Fetch::l1>(
                    n, kc, ak + r * a_rs, a_rs, a_ts, bk, W, y + r * ldy, ldy);
            else
                detail::panel_rows<T, NP, MR, Acc, HalfFormat::none, true>(
                    n, kc, ak + r * a_rs, a_rs, a_ts, bk, W, y + r * ldy, ldy);
        };
        // rows [0, m) from the packed block bk, kSlice at a time
        const auto sliced = [&](auto acc, const T* bk) {
            for (Index r = 0; r < m; r += kSlice) {
                const Index n = std::min(kSlice, m - r);
                packed_rows(acc, r, n, bk);
                finish(r, r + n);
            }
        };
        // The first depth chunk of a Y that holds nothing yet starts from zero accumulators.
        const auto product = [&](auto accumulate) {
            constexpr bool Acc = decltype(accumulate)::value;
            if (packed) {  // the whole panel, packed before the products (gemm)
                sliced(accumulate, packed + k0 * W);
                return;
            }
            // Rows [r0, m) on the packed block bp, in slices, while the B block packed next
            // (this panel's next depth chunk, else the next panel's first) is requested (into L2
            // where detail::kPrefetchToL2 says so), a share after each slice, so that its packing
            // waits less for memory (when the weights are not in cache; no change when warm).
            // base: b, or the half-precision bits.
            const auto rows_fetching_next = [&](Index r0, const auto* base) {
                using E = std::remove_cv_t<std::remove_pointer_t<decltype(base)>>;
                const bool more_depth = k0 + kc < depth;
                const E* next = more_depth   ? base + (k0 + kc) * ldb + j0
                                : next_panel ? base + j0 + W
                                             : nullptr;
                const Index next_rows =
                    more_depth ? std::min(chunk, depth - k0 - kc) : std::min(chunk, depth);
                const Index slices = (m - r0 + kSlice - 1) / kSlice;
                const Index per_slice = slices > 0 ? (next_rows + slices - 1) / slices : 0;
                Index fetched = 0;
                for (Index r = r0; r < m; r += kSlice) {
                    packed_rows(std::bool_constant<Acc>{}, r, std::min(kSlice, m - r), bp);
                    finish(r, std::min(m, r + kSlice));
                    if (!next) continue;
                    const Index upto = std::min(next_rows, fetched + per_slice);
                    for (; fetched < upto; ++fetched) {
                        const E* row = next + fetched * ldb;
                        if (detail::kPrefetchToL2)
                            detail::prefetch_row<detail::Fetch::l2>(row, W);
                        else
                            detail::prefetch_row<detail::Fetch::l1>(row, W);
                    }
                }
            };
            // the first row block's kernel, packing the B block bk (stored as F) as it reads it,
            // its rows requested ahead into the level the CPU wants (detail::kPrefetchToL2)
            const auto packing_block = [&](auto format, const auto* bk) {
                constexpr HalfFormat F = decltype(format)::value;
                if (detail::kPrefetchToL2)
                    detail::panel_kernel<T, MR, NP, Acc, true, F, true, detail::Fetch::l2>(
                        kc, ak, a_rs, a_ts, bk, ldb, y, ldy, bp, W);
                else
                    detail::panel_kernel<T, MR, NP, Acc, true, F, true, detail::Fetch::l1>(
                        kc, ak, a_rs, a_ts, bk, ldb, y, ldy, bp, W);
            };
            if constexpr (NP == detail::kPanelPackets) {  // whole panels only: compile time
                if (!b_transposed && !bh.bits && nw == W && m >= MR) {
                    // the first row block packs B as it goes, the others read the packed copy
                    packing_block(std::integral_constant<HalfFormat, HalfFormat::none>{},
                                  b + k0 * ldb + j0);
                    finish(0, MR);
                    rows_fetching_next(MR, b);
                    return;
                }
                if constexpr (std::is_same_v<T, float>) {
                    if (!b_transposed && bh.bits && nw == W && m >= MR) {
                        // half-precision weights: the same, widened as the first block packs
                        const std::uint16_t* bk = bh.bits + k0 * ldb + j0;
                        if (bh.format == HalfFormat::float16)
                            packing_block(std::integral_constant<HalfFormat, HalfFormat::float16>{},
                                          bk);
                        else
                            packing_block(
                                std::integral_constant<HalfFormat, HalfFormat::bfloat16>{}, bk);
                        finish(0, MR);
                        rows_fetching_next(MR, bh.bits);
                        return;
                    }
                }
            }
            // fewer rows than a row block: B is read once, so in place (packing it would copy
            // each of its rows, a strided walk, for a single use)
            if (!b_transposed && !bh.bits && nw == W && m < MR) {
                detail::panel_rows<T, NP, MR, Acc, HalfFormat::none, true>(
                    m, kc, ak, a_rs, a_ts, b + k0 * ldb + j0, ldb, y, ldy);
                finish(0, m);
                return;
            }
            if constexpr (std::is_same_v<T, float>) {  // so for half-precision weights too,
                if (!b_transposed && bh.bits && nw == W && m < MR) {  // widened as loaded
                    const std::uint16_t* bb = bh.bits + k0 * ldb + j0;
                    if (bh.format == HalfFormat::float16)
                        detail::panel_rows<T, NP, MR, Acc, HalfFormat::float16, true>(
                            m, kc, ak, a_rs, a_ts, bb, ldb, y, ldy);
                    else
                        detail::panel_rows<T, NP, MR, Acc, HalfFormat::bfloat16, true>(
                            m, kc, ak, a_rs, a_ts, bb, ldb, y, ldy);
                    finish(0, m);
                    return;
                }
            }
            // B^T blocks by packet transposes (a scalar gather dominated this function in the
            // attention backward)
            if (b_transposed && bh.bits) {  // (float only) widened as transposed
                if constexpr (std::is_same_v<T, float>) {
                    const std::uint16_t* bb = bh.bits + j0 * ldb + k0;
                    if (bh.format == HalfFormat::float16)
                        detail::transpose<T, HalfFormat::float16>(nw, kc, bb, ldb, bp, W);
                    else
                        detail::transpose<T, HalfFormat::bfloat16>(nw, kc, bb, ldb, bp, W);
                }
            } else if (b_transposed) {
                detail::transpose(nw, kc, b + j0 * ldb + k0, ldb, bp, W);
            } else if (bh.bits) {  // float only: half weights are computed in float32
                if constexpr (std::is_same_v<T, float>)
                    for (Index k = 0; k < kc; ++k)
                        detail::half_rows_to_float(bh.bits + (k0 + k) * ldb + j0, ldb, 1, nw,
                                                   bh.format, bp + k * W);
            } else {
                for (Index k = 0; k < kc; ++k) {
                    const T* src = b + (k0 + k) * ldb + j0;
                    std::copy(src, src + nw, bp + k * W);
                }
            }
            if (nw < W)
                for (Index k = 0; k < kc; ++k) std::fill(bp + k * W + nw, bp + (k + 1) * W, T(0));
            sliced(accumulate, bp);
        };
        if (zero_start && k0 == 0) {
            product(std::false_type{});
        } else {
            product(std::true_type{});
        }
    }
}

// Panel p (columns [p W, p W + W) and fewer at the edge) of Y (m x cols, row stride ldy) = A B
// (+ bias), or Y += A B when accumulate; A (m x depth) and B (depth x cols) as in panel_gemm.
// then_next: the caller computes panel p + 1 next (its B block may be fetched meanwhile).
template <typename T>
void gemm_panel(Index m, Index depth, Index cols, const T* a, Index a_rs, Index a_ts,
                const HalfB& bh, const T* b, Index ldb, bool b_transposed, const T* bias, T* y,
                Index ldy, bool accumulate, Index p, bool then_next, const T* packed = nullptr) {
    constexpr Index W = detail::panel_width<T>(), L = detail::packet_size<T>();
    const Index j0 = p * W, nw = std::min(W, cols - j0);
    // the last panel as narrow as whole packets allow; if still wider than the columns left,
    // through a padded copy of its Y block
    const Index np = (nw + L - 1) / L, wp = np * L;
    const bool full = nw == wp;
    T* yb = full ? y + j0 : scratch<T>(ScratchBuffer::kGemmEdge, static_cast<std::size_t>(m * wp));
    const Index ldb_y = full ? ldy : wp;
    for (Index r = 0; r < m; ++r) {
        T* yr = yb + r * ldb_y;
        if (!full) {
            const T* src = accumulate ? y + r * ldy + j0 : nullptr;
            if (src) std::copy(src, src + nw, yr);
            std::fill(yr + (src ? nw : 0), yr + wp, T(0));
        }
        if (!accumulate && full && depth == 0) std::fill(yr, yr + wp, T(0));
    }
    const bool zero_start = !accumulate && full;
    const bool next_panel = then_next && j0 + 2 * W <= cols;  // a whole panel follows
    // added after the products (panel_gemm), or alone when there are none
    const T* pb = bias && !accumulate && depth > 0 ? bias + j0 : nullptr;
    if (np == 3) {
        panel_gemm<T, 3>(m, depth, a, a_rs, a_ts, bh, b, ldb, b_transposed, j0, nw, yb, ldb_y,
                         zero_start, next_panel, packed, pb);
    } else if (np == 2) {
        panel_gemm<T, 2>(m, depth, a, a_rs, a_ts, bh, b, ldb, b_transposed, j0, nw, yb, ldb_y,
                         zero_start, next_panel, packed, pb);
    } else {
        panel_gemm<T, 1>(m, depth, a, a_rs, a_ts, bh, b, ldb, b_transposed, j0, nw, yb, ldb_y,
                         zero_start, next_panel, packed, pb);
    }
    if (bias && !accumulate && depth <= 0)
        for (Index r = 0; r < m; ++r) {
            T* yr = yb + r * ldb_y;
            for (Index j = 0; j < nw; ++j) yr[j] += bias[j0 + j];
        }
    if (!full)
        for (Index r = 0; r < m; ++r) std::copy(yb + r * wp, yb + r * wp + nw, y + r * ldy + j0);
}

// Rows [t0, t1) of B (depth rows, ldb apart; or its half-precision bits bh, widened) into its
// first `whole` panels packed in `dst`: panel after panel, each depth rows of W contiguous
// columns (what panel_gemm reads as `packed`).
template <typename T>
void pack_rows(const T* b, const HalfB& bh, Index ldb, Index depth, Index whole, Index t0, Index t1,
               T* dst) {
    constexpr Index W = detail::panel_width<T>();
    if constexpr (std::is_same_v<T, float>) {
        // half-precision weights widened as they are packed, a packet at a time (the format
        // chosen once, not per panel row)
        const auto widened = [&](auto format) {
            constexpr HalfFormat F = decltype(format)::value;
            constexpr Index L = detail::packet_size<T>();
            for (Index t = t0; t < t1; ++t)
                for (Index p = 0; p < whole; ++p)
                    for (Index c = 0; c < W; c += L)
                        Eigen::internal::pstoreu(
                            dst + (p * depth + t) * W + c,
                            detail::load_stored_packet<T, F>(bh.bits + t * ldb + p * W + c));
        };
        if (bh.bits && bh.format == HalfFormat::float16) {
            widened(std::integral_constant<HalfFormat, HalfFormat::float16>{});
            return;
        }
        if (bh.bits) {
            widened(std::integral_constant<HalfFormat, HalfFormat::bfloat16>{});
            return;
        }
    }
    // a copy of constant size, inlined (std::copy called memmove for each panel row)
    for (Index t = t0; t < t1; ++t)
        for (Index p = 0; p < whole; ++p)
            std::memcpy(dst + (p * depth + t) * W, b + t * ldb + p * W, sizeof(T) * W);
}

// Y (rows x cols, row stride ldy) = A B (+ bias), or Y += A B when accumulate. Tasks:
// kRowChunk rows x kPanelsPerTask panels, or fewer panels when that would leave threads idle (a
// weight gradient of 384 x 384 is 3 tasks: one of 2 threads would wait for the third) or give
// a call of few row chunks few tasks per thread. What an element sums, and in which order,
// depends only on the depth chunks, never on the grid: the result does not depend on the
// thread count.
// h: operands stored in half precision instead (float only, A read along its rows): the rows of
// A a task reads are widened first, and the block of Y it writes is computed in float32 (in its
// scratch, or in y when y is given: accumulated there) and rounded last.
// prepacked: B's whole panels packed by pack_weight (B neither transposed nor half), or null.
// A plan: the grid and the packing of one such product, its tasks run by gemm() or, with other
// plans', in one parallel region by gemm_group().
template <typename T>
struct GemmPlan {
    static constexpr Index W = detail::panel_width<T>();
    static constexpr Index kPackRows = 16;  // rows of B a packing task copies

    Index rows, depth, cols;
    const T* a;
    Index a_rs, a_ts;
    const T* b;
    Index ldb;
    bool b_transposed;
    const T* bias;
    T* y;
    Index ldy;
    bool accumulate;
    HalfOperands h;
    HalfB bh;
    Index panels = 0, row_chunks = 0, per_task = 0, col_groups = 0, whole = 0;
    bool pack_once = false, panels_packed = false;
    Buffer<T> packed;
    const T* bpk = nullptr;
    std::uint64_t call = 0;

    GemmPlan(Index rows_, Index depth_, Index cols_, const T* a_, Index a_rs_, Index a_ts_,
             const T* b_, Index ldb_, bool b_transposed_, const T* bias_, T* y_, Index ldy_,
             bool accumulate_, const HalfOperands& h_, const T* prepacked)
        : rows(rows_),
          depth(depth_),
          cols(cols_),
          a(a_),
          a_rs(a_rs_),
          a_ts(a_ts_),
          b(b_),
          ldb(ldb_),
          b_transposed(b_transposed_),
          bias(bias_),
          y(y_),
          ldy(ldy_),
          accumulate(accumulate_),
          h(h_),
          bh{h_.w, h_.format} {
        if (rows <= 0 || cols <= 0) return;
        panels = (cols + W - 1) / W;
        row_chunks = (rows + kRowChunk - 1) / kRowChunk;
        // fewer row chunks than two per thread: at least 8 tasks per thread, so that the last
        // task of a thread that started late (or was descheduled) costs little (BERT's 128
        // rows: 16 tasks of one panel, not 4 of four; docs/performance.md, "GEMM tasks"); else
        // 2 per thread (more splits re-read each row chunk of A for little gain)
        const Index threads = static_cast<Index>(get_num_threads());
        const Index enough = (row_chunks < 2 * threads ? 8 : 2) * threads;
        per_task = kPanelsPerTask;
        while (per_task > 1 && row_chunks * ((panels + per_task - 1) / per_task) < enough)
            per_task = (per_task + 1) / 2;
        col_groups = (panels + per_task - 1) / per_task;
        // The whole panels of B packed first (Blocking::pack_once), in parallel by blocks of
        // its rows, each row read whole and in order: once per call instead of once per row
        // chunk; up to kPackOnceBytes, so that a very large B does not double the call's memory.
        constexpr Index kPackOnceBytes = Index(64) << 20;
        whole = cols / W;
        pack_once = !prepacked && blocking().pack_once && row_chunks > 2 && !b_transposed &&
                    whole > 0 && depth > 0 &&
                    whole * depth * W * Index(sizeof(T)) <= kPackOnceBytes;
        if (pack_once) packed = make_buffer<T>(whole * depth * W);
        bpk = prepacked ? prepacked : packed.get();
        panels_packed = pack_once || (prepacked && depth > 0);
        call = ++g_gemm_calls;
    }

    Index pack_tasks() const { return pack_once ? (depth + kPackRows - 1) / kPackRows : 0; }
    Index tasks() const { return row_chunks * col_groups; }

    // Rows [i kPackRows, (i + 1) kPackRows) of B into the packed panels.
    void pack(Index i) const {
        pack_rows(b, bh, ldb, depth, whole, i * kPackRows, std::min(depth, (i + 1) * kPackRows),
                  packed.get());
    }

    // Task t: a row chunk's block of panels.
    void run(Index t) const {
        const Index r0 = (t / col_groups) * kRowChunk;
        const Index m = std::min(kRowChunk, rows - r0);
        const Index p0 = (t % col_groups) * per_task;
        const Index p1 = std::min(panels, p0 + per_task);
        const T* at = a ? a + r0 * a_rs : nullptr;  // null when given as half bits
        Index at_rs = a_rs;
        T* yt = y ? y + r0 * ldy : nullptr;
        Index yt_ld = ldy;
        if constexpr (std::is_same_v<T, float>) {
            // widened per task (a few times per row chunk), not by one pass before the GEMM:
            // the products then read X from cache, not a float32 copy from memory
            // (docs/performance.md, "Half-precision MHA inputs")
            if (h.x) {
                T* w =
                    scratch<T>(ScratchBuffer::kGemmHalfRows, static_cast<std::size_t>(m * depth));
                // a thread's next task on the same row chunk reuses its widened rows (BERT's
                // 128 rows: 24 tasks of one row chunk)
                thread_local WidenedRows held;
                if (held.call != call || held.r0 != r0) {
                    for (Index r = 0; r < m; ++r)
                        detail::half_to_float(h.x + (r0 + r) * a_rs, depth, h.format,
                                              w + r * depth);
                    held = {call, r0};
                }
                at = w;
                at_rs = depth;
            }
            if (h.y && !y) {
                yt = scratch<T>(ScratchBuffer::kGemmHalfOut, static_cast<std::size_t>(m * cols));
                yt_ld = cols;
            }
        }
        for (Index p = p0; p < p1; ++p)
            gemm_panel(m, depth, cols, at, at_rs, a_ts, bh, b, ldb, b_transposed, bias, yt, yt_ld,
                       accumulate, p, p + 1 < p1,
                       panels_packed && p < whole ? bpk + p * depth * W : nullptr);
        if constexpr (std::is_same_v<T, float>) {
            if (h.y) {
                const Index c0 = p0 * W, c1 = std::min(cols, p1 * W);
                for (Index r = 0; r < m; ++r)
                    detail::narrow_block(yt + r * yt_ld + c0, c1 - c0, h.format,
                                         h.y + (r0 + r) * ldy + c0);
            }
        }
    }
};

template <typename T>
void gemm(Index rows, Index depth, Index cols, const T* a, Index a_rs, Index a_ts, const T* b,
          Index ldb, bool b_transposed, const T* bias, T* y, Index ldy, bool accumulate,
          const HalfOperands& h = {}, const T* prepacked = nullptr) {
    if (rows <= 0 || cols <= 0) return;
    const GemmPlan<T> plan(rows, depth, cols, a, a_rs, a_ts, b, ldb, b_transposed, bias, y, ldy,
                           accumulate, h, prepacked);
    if (plan.pack_once) parallel_for(plan.pack_tasks(), [&](Index i) { plan.pack(i); });
    parallel_for(plan.tasks(), [&](Index t) { plan.run(t); });
}

// Whether the plans read the same half-precision rows of A (a layer's Q, K, V of one input).
template <typename T>
bool shares_half_rows(const GemmPlan<T>* plans, int n) {
    if (n < 2 || !plans[0].h.x) return false;
    for (int i = 1; i < n; ++i) {
        const GemmPlan<T>& p = plans[i];
        if (p.h.x != plans[0].h.x || p.a_rs != plans[0].a_rs || p.depth != plans[0].depth ||
            p.rows != plans[0].rows || p.h.format != plans[0].h.format)
            return false;
    }
    return true;
}

// The plans' tasks in one parallel region (their packing in one before): no thread waits at
// the end of one product for the other threads' last tasks before the next starts. The tasks
// are those gemm() runs: the same results.
template <typename T>
void gemm_group(GemmPlan<T>* plans, int n) {
    Index first[kMaxGemmGroup + 1] = {0}, packs[kMaxGemmGroup + 1] = {0};
    for (int i = 0; i < n; ++i) {
        first[i + 1] = first[i] + plans[i].tasks();
        packs[i + 1] = packs[i] + plans[i].pack_tasks();
    }
    const auto at = [&](const Index* starts, Index t) {  // the plan of global task t
        int i = 0;
        while (t >= starts[i + 1]) ++i;
        return i;
    };
    // Plans reading the same half-precision rows: a thread widens a row chunk once for all of
    // them, its tasks on that chunk taken one after another (row chunk by row chunk; the same
    // tasks, so the same results).
    const bool shared = shares_half_rows(plans, n);
    if (shared)
        for (int i = 1; i < n; ++i) plans[i].call = plans[0].call;
    if (packs[n] > 0)
        parallel_for(packs[n], [&](Index t) {
            const int i = at(packs, t);
            plans[i].pack(t - packs[i]);
        });
    if (shared) {
        Index groups[kMaxGemmGroup + 1] = {0};  // column groups of each plan in a row chunk
        for (int i = 0; i < n; ++i) groups[i + 1] = groups[i] + plans[i].col_groups;
        parallel_for(first[n], [&](Index t) {
            const Index c = t / groups[n], o = t % groups[n];
            const int i = at(groups, o);
            plans[i].run(c * plans[i].col_groups + (o - groups[i]));
        });
        return;
    }
    parallel_for(first[n], [&](Index t) {
        const int i = at(first, t);
        plans[i].run(t - first[i]);
    });
}
}  // namespace

const char* gemm_blocking() { return blocking().name; }

// All three run on the panel kernel of the attention tiles (see gemm above).
template <typename T>
void linear(Index rows, Index in, Index out, const T* x, Index ldx, const T* w, const T* b, T* y,
            Index ldy, bool accumulate, const T* packed) {
    gemm(rows, in, out, x, ldx, Index(1), w, out, false, b, y, ldy, accumulate, HalfOperands{},
         packed);
}

template <typename T>
void linear_group(const LinearCall<T>* calls, int n) {
    if (n < 1 || n > kMaxGemmGroup) throw std::invalid_argument("linear_group: 1 to 3 calls");
    std::vector<GemmPlan<T>> plans;  // each owns its packing buffer: built in place
    plans.reserve(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) {
        const LinearCall<T>& c = calls[i];
        const HalfOperands& h = c.half;  // as linear_half: the bits in place of the floats
        plans.emplace_back(c.rows, c.in, c.out, h.x ? nullptr : c.x, c.ldx, Index(1),
                           h.w ? nullptr : c.w, c.out, false, c.b, h.y ? nullptr : c.y, c.ldy,
                           false, h, c.packed);
    }
    gemm_group(plans.data(), n);
}

template <typename T>
Index packed_weight_size(Index in, Index out) {
    constexpr Index W = detail::panel_width<T>();
    return out / W * in * W;
}

// The layout gemm's Blocking::pack_once makes (pack_rows), by the same blocks of rows.
template <typename T>
void pack_weight(Index in, Index out, const T* w, T* packed) {
    constexpr Index W = detail::panel_width<T>(), kRows = GemmPlan<T>::kPackRows;
    parallel_for((in + kRows - 1) / kRows, [&](Index i) {
        pack_rows(w, HalfB{}, out, in, out / W, i * kRows, std::min(in, (i + 1) * kRows), packed);
    });
}

template void linear_group<float>(const LinearCall<float>*, int);
template void linear_group<double>(const LinearCall<double>*, int);
template Index packed_weight_size<float>(Index, Index);
template Index packed_weight_size<double>(Index, Index);
template void pack_weight<float>(Index, Index, const float*, float*);
template void pack_weight<double>(Index, Index, const double*, double*);

void linear_half(Index rows, Index in, Index out, const float* x, Index ldx, const float* w,
                 const float* b, float* y, Index ldy, const HalfOperands& h) {
    gemm<float>(rows, in, out, h.x ? nullptr : x, ldx, Index(1), h.w ? nullptr : w, out, false, b,
                h.y ? nullptr : y, ldy, false, h);
}

void linear_half_weights(Index rows, Index in, Index out, const float* x,
                         const std::uint16_t* x_half, Index ldx, const std::uint16_t* w,
                         HalfFormat format, const float* b, float* y, std::uint16_t* y_half,
                         Index ldy) {
    linear_half(rows, in, out, x, ldx, nullptr, b, y, ldy, HalfOperands{x_half, w, y_half, format});
}

void linear_half_grads(Index rows, Index in, Index out, const float* x, const std::uint16_t* x_half,
                       Index ldx, const float* w, const std::uint16_t* w_half, const float* dy,
                       const std::uint16_t* dy_half, HalfFormat format, float* dx, Index lddx,
                       bool accumulate, float* dw, std::uint16_t* dw_half, float* db) {
    const HalfGradOperands h{x_half, dy_half, nullptr, format, w_half, dw_half};
    if (dw || dw_half || db)
        linear_weight_grad<float>(rows, in, out, x, ldx, dy, out, dw, db,
                                  static_cast<const float*>(nullptr), h);
    if (dx) linear_input_grad<float>(rows, in, out, dy, out, w, dx, lddx, accumulate, h);
}

template <typename T>
void linear_input_grad(Index rows, Index in, Index out, const T* dy, Index lddy, const T* w, T* dx,
                       Index lddx, bool accumulate, const HalfGradOperands& h) {
    const HalfOperands half{h.dy, nullptr, h.dx, h.format};
    if (h.dy) dy = nullptr;
    if constexpr (std::is_same_v<T, float>) {
        if (h.w && in > 0 && out > 0 && rows <= kRowChunk) {  // blocks widened as transposed
            gemm(rows, out, in, dy, lddy, Index(1), static_cast<const T*>(nullptr), out, true,
                 static_cast<const T*>(nullptr), dx, lddx, accumulate,
                 HalfOperands{h.dy, h.w, h.dx, h.format});
            return;
        }
        if (h.w && in > 0 && out > 0) {  // W^T once, widened as it is transposed
            auto wt = make_buffer<T>(out * in);
            transpose_rows(in, out, h.w, out, h.format, wt.get());
            gemm(rows, out, in, dy, lddy, Index(1), static_cast<const T*>(wt.get()), in, false,
                 static_cast<const T*>(nullptr), dx, lddx, accumulate, half);
            return;
        }
    }
    // dX = dY W^T: B(t, j) = W[j, t]
    if (rows <= kRowChunk || in <= 0 || out <= 0) {
        gemm(rows, out, in, dy, lddy, Index(1), w, out, true, static_cast<const T*>(nullptr), dx,
             lddx, accumulate, half);
        return;
    }
    // More than one row chunk: W^T once, in parallel, then the plain path (each row chunk's
    // task transposed every B block it packed: 13 times W^T for a ViT-S input gradient). The
    // same products in the same order: bitwise the same.
    auto wt = make_buffer<T>(out * in);
    transpose_rows(in, out, w, out, wt.get());
    gemm(rows, out, in, dy, lddy, Index(1), static_cast<const T*>(wt.get()), in, false,
         static_cast<const T*>(nullptr), dx, lddx, accumulate, half);
}

template <typename T>
void transpose_rows(Index rows, Index in, const T* x, Index ldx, T* xt) {
    constexpr Index kBlock = 64;  // columns of X a task
    parallel_for((in + kBlock - 1) / kBlock, [&](Index i) {
        const Index j0 = i * kBlock, nj = std::min(kBlock, in - j0);
        detail::transpose(rows, nj, x + j0, ldx, xt + j0 * rows, rows);
    });
}

template <typename T>
void linear_weight_grad(Index rows, Index in, Index out, const T* x, Index ldx, const T* dy,
                        Index lddy, T* dw, T* db, const T* xt, const HalfGradOperands& h) {
    if (out <= 0) return;
    // dW = X^T dY: A(r, t) = X^T[r, t], read along its rows. More than one row chunk of X, or
    // X in half precision: X^T first (read across the rows of X, A takes a cache line per step
    // of the depth; docs/performance.md, "Weight gradients on X^T"). The same products in the
    // same order either way: bitwise the same.
    Buffer<T> own;
    const bool want_dw = (dw || h.dw) && in > 0;  // (h.dw: rounded as each task writes it)
    if (want_dw && !xt && (rows > kRowChunk || h.x)) {
        own = make_buffer<T>(in * rows);
        transpose_rows(rows, in, x, h.x, ldx, h.format, own.get());
        xt = own.get();
    }
    const HalfOperands half{nullptr, h.dy, h.dw, h.format};  // dY is the B operand
    const T* b = h.dy ? nullptr : dy;
    T* y = h.dw ? nullptr : dw;
    if (want_dw && xt)
        gemm(in, rows, out, xt, rows, Index(1), b, lddy, false, static_cast<const T*>(nullptr), y,
             out, false, half);
    else if (want_dw)
        gemm(in, rows, out, x, Index(1), ldx, b, lddy, false, static_cast<const T*>(nullptr), y,
             out, false, half);
    if (db) {  // column sums in row order, in blocks of columns (the order does not change)
        constexpr Index kCols = 128;
        using RowVec = Eigen::Matrix<T, 1, Eigen::Dynamic>;
        parallel_for((out + kCols - 1) / kCols, [&](Index c) {
            const Index j0 = c * kCols, n = std::min(kCols, out - j0);
            Eigen::Map<RowVec> DB(db + j0, n);
            DB.setZero();
            T widened[kCols];  // a row of a half-precision dY
            for (Index r = 0; r < rows; ++r) {
                const T* row = widened;  // (dY is null when given as half bits)
                if constexpr (std::is_same_v<T, float>) {
                    if (h.dy) detail::half_to_float(h.dy + r * lddy + j0, n, h.format, widened);
                }
                if (!h.dy) row = dy + r * lddy + j0;
                DB += Eigen::Map<const RowVec>(row, n);
            }
        });
    }
}

template <typename T>
void transpose_rows(Index rows, Index in, const T* x, const std::uint16_t* x_half, Index ldx,
                    HalfFormat format, T* xt) {
    if constexpr (std::is_same_v<T, float>) {
        if (x_half) {
            transpose_rows(rows, in, x_half, ldx, format, xt);
            return;
        }
    }
    transpose_rows(rows, in, x, ldx, xt);
}

void transpose_rows(Index rows, Index in, const std::uint16_t* x, Index ldx, HalfFormat format,
                    float* xt) {
    constexpr Index kBlock = 64;  // columns of X a task, widened as the transposes load them
    parallel_for((in + kBlock - 1) / kBlock, [&](Index i) {
        const Index j0 = i * kBlock, nj = std::min(kBlock, in - j0);
        if (format == HalfFormat::float16) {
            detail::transpose<float, HalfFormat::float16>(rows, nj, x + j0, ldx, xt + j0 * rows,
                                                          rows);
        } else {
            detail::transpose<float, HalfFormat::bfloat16>(rows, nj, x + j0, ldx, xt + j0 * rows,
                                                           rows);
        }
    });
}

template void linear_input_grad<float>(Index, Index, Index, const float*, Index, const float*,
                                       float*, Index, bool, const HalfGradOperands&);
template void linear_input_grad<double>(Index, Index, Index, const double*, Index, const double*,
                                        double*, Index, bool, const HalfGradOperands&);
template void linear_weight_grad<float>(Index, Index, Index, const float*, Index, const float*,
                                        Index, float*, float*, const float*,
                                        const HalfGradOperands&);
template void linear_weight_grad<double>(Index, Index, Index, const double*, Index, const double*,
                                         Index, double*, double*, const double*,
                                         const HalfGradOperands&);
template void transpose_rows<float>(Index, Index, const float*, Index, float*);
template void transpose_rows<float>(Index, Index, const float*, const std::uint16_t*, Index,
                                    HalfFormat, float*);
template void transpose_rows<double>(Index, Index, const double*, const std::uint16_t*, Index,
                                     HalfFormat, double*);
template void transpose_rows<double>(Index, Index, const double*, Index, double*);

template void linear<float>(Index, Index, Index, const float*, Index, const float*, const float*,
                            float*, Index, bool, const float*);
template void linear<double>(Index, Index, Index, const double*, Index, const double*,
                             const double*, double*, Index, bool, const double*);

namespace detail {

ATTNLAB_PANEL_ROWS_ALL()  // the definitions the other sources link to (see microkernel.hpp)
ATTNLAB_PANEL_ROWS_WIDE()

// block_product of B's floats b (row stride ldb) or of the half-precision bits bh names
// (contiguous, T float).
template <typename T>
void block_product_of(const ConstRowMap<T>& a, const T* b, Index ldb, const HalfB& bh,
                      const RowMap<T>& c, bool accumulate, const T* packed) {
    RowMap<T> dst = c;  // the view is const, not what it maps
    const Index rows = c.rows(), cols = c.cols(), depth = a.cols();
    if (rows <= 0 || cols <= 0) return;
    constexpr Index W = panel_width<T>();
    const Index panels = (cols + W - 1) / W;
    for (Index p = 0; p < panels; ++p)
        gemm_panel<T>(rows, depth, cols, a.data(), a.outerStride(), Index(1), bh, b, ldb, false,
                      static_cast<const T*>(nullptr), dst.data(), dst.outerStride(), accumulate, p,
                      p + 1 < panels, packed && depth > 0 ? packed + p * depth * W : nullptr);
}

template <typename T>
void block_product(const ConstRowMap<T>& a, const ConstRowMap<T>& b, const RowMap<T>& c,
                   bool accumulate, const T* packed) {
    block_product_of(a, b.data(), b.outerStride(), HalfB{}, c, accumulate, packed);
}

void block_product_half(const ConstRowMap<float>& a, const std::uint16_t* b, HalfFormat format,
                        const RowMap<float>& c, bool accumulate, const float* packed) {
    block_product_of(a, static_cast<const float*>(nullptr), c.cols(), HalfB{b, format}, c,
                     accumulate, packed);
}

template <typename T>
Index packed_block_size(Index rows, Index cols) {
    constexpr Index W = panel_width<T>(), L = packet_size<T>();
    const Index whole = cols / W, rest = cols - whole * W;
    return (whole * W + (rest + L - 1) / L * L) * rows;
}

template <typename T>
void pack_block(Index rows, Index cols, const T* b, const std::uint16_t* bits, HalfFormat format,
                T* packed, bool parallel) {
    constexpr Index W = panel_width<T>(), L = packet_size<T>();
    const Index whole = cols / W, rest = cols - whole * W, wp = (rest + L - 1) / L * L;
    T* edge = packed + whole * W * rows;  // the last panel: rows of wp columns
    const auto pack = [&](Index t0, Index t1) {
        pack_rows(b, HalfB{bits, format}, cols, rows, whole, t0, t1, packed);
        for (Index t = rest ? t0 : t1; t < t1; ++t) {
            T* d = edge + t * wp;
            if constexpr (std::is_same_v<T, float>) {
                if (bits) {
                    half_to_float(bits + t * cols + whole * W, rest, format, d);
                    std::fill(d + rest, d + wp, T(0));
                    continue;
                }
            }
            std::copy(b + t * cols + whole * W, b + t * cols + cols, d);
            std::fill(d + rest, d + wp, T(0));
        }
    };
    if (!parallel) {
        pack(0, rows);
        return;
    }
    constexpr Index kRows = GemmPlan<T>::kPackRows;
    parallel_for((rows + kRows - 1) / kRows,
                 [&](Index i) { pack(i * kRows, std::min(rows, (i + 1) * kRows)); });
}

template void block_product<float>(const ConstRowMap<float>&, const ConstRowMap<float>&,
                                   const RowMap<float>&, bool, const float*);
template void block_product<double>(const ConstRowMap<double>&, const ConstRowMap<double>&,
                                    const RowMap<double>&, bool, const double*);
template Index packed_block_size<float>(Index, Index);
template Index packed_block_size<double>(Index, Index);
template void pack_block<float>(Index, Index, const float*, const std::uint16_t*, HalfFormat,
                                float*, bool);
template void pack_block<double>(Index, Index, const double*, const std::uint16_t*, HalfFormat,
                                 double*, bool);

template <typename T>
void eigen_product(const ConstRowMap<T>& a, const ConstRowMap<T>& b, const RowMap<T>& c,
                   bool accumulate) {
    RowMap<T> dst = c;
    if (accumulate) {
        dst.noalias() += a * b;
    } else {
        dst.noalias() = a * b;
    }
}

template <typename T>
void eigen_product_bt(const ConstRowMap<T>& a, const ConstRowMap<T>& b, const RowMap<T>& c,
                      bool accumulate) {
    RowMap<T> dst = c;
    if (accumulate) {
        dst.noalias() += a * b.transpose();
    } else {
        dst.noalias() = a * b.transpose();
    }
}

template void eigen_product<float>(const ConstRowMap<float>&, const ConstRowMap<float>&,
                                   const RowMap<float>&, bool);
template void eigen_product<double>(const ConstRowMap<double>&, const ConstRowMap<double>&,
                                    const RowMap<double>&, bool);
template void eigen_product_bt<float>(const ConstRowMap<float>&, const ConstRowMap<float>&,
                                      const RowMap<float>&, bool);
template void eigen_product_bt<double>(const ConstRowMap<double>&, const ConstRowMap<double>&,
                                       const RowMap<double>&, bool);

}  // namespace detail

}  // namespace attnlab::ATTNLAB_ISA_NS

#pragma once
// Scaled dot-product attention over strided head views, and multi-head attention with per-head
// projections. Pure C++: no Python here.

#include <atomic>
#include <cstdint>

#include "attnlab/common.hpp"

namespace attnlab {

// Calls of the fused precision="bf16" multi-head forward (cpp/src/kernels/mha_bf16.hpp) in this
// process: how the tests know that it ran, not the composed path it falls back to.
inline std::atomic<std::uint64_t> mha_bf16_fused_calls{0};
// Calls of the attention forward that copied K and V to contiguous rows first (strided heads,
// attention_forward.cpp): the same check for that path.
inline std::atomic<std::uint64_t> attention_copied_calls{0};

// softmax(scale * q k^T + mask) v for every (batch, head); query head j reads kv head
// j / (heads / kv_heads). Fully masked rows give a zero output row, zero weights and lse = -inf.
// precision="bf16" (float only): q, k and v rounded to bfloat16, and in the forward the
// probabilities too before their product with V (cpp/src/kernels/attention_bf16.hpp); the
// backward differentiates the float32 function at the rounded operands. `operands`: q, k, v
// rounded where the kernels read them, nothing else (the backward on half-precision arrays: the
// float32 function at their rounding, with no rounded copies made)
enum class Bf16 : int { none = 0, probabilities = 1, operands = 2 };

// Q, K, V and the output may be stored in half precision (HalfFormat, common.hpp): read
// converted to float (the decode path as its kernels load them, half the bytes of a float cache;
// the flash tiles a kv head's key blocks at a time), the output rounded as it is written

template <typename T>
struct AttentionProblem {
    Index batch = 0, heads = 0, kv_heads = 0;
    Index n_q = 0, n_k = 0, d = 0, d_v = 0;
    T scale = T(1);
    MatrixStack<const T> q, k, v;  // (n_q x d), (n_k x d), (n_k x d_v) per (batch, head)
    MatrixStack<T> out;            // (n_q x d_v) per (batch, head)
    MaskSpec<T> mask;
    T* weights = nullptr;  // optional (batch, heads, n_q, n_k) contiguous: the attention weights
    T* lse = nullptr;      // optional (batch, heads, n_q) contiguous: log-sum-exp of the logits
    Bf16 bf16 = Bf16::none;
    HalfFormat half = HalfFormat::none;  // float only; then the *_half views replace q, k, v, out
    // (the forward: q_half unset reads float queries from q, out_half unset writes out)
    MatrixStack<const std::uint16_t> q_half, k_half, v_half;
    MatrixStack<std::uint16_t> out_half;
    std::uint16_t* weights_half = nullptr;  // or the weights as bits of `half` (weights null)
    // weights_half's format when q, k, v are float (half none): a layer's weights stored so
    HalfFormat weights_format = HalfFormat::none;
};

// Gradients of attention_forward. Needs p.out and p.lse as attention_forward left them (the
// backward recomputes P = exp(S - lse) tile by tile: no O(n^2) memory). d_q is written per query
// head; d_k, d_v per kv head (summed over the query heads of its group). Fully masked rows give
// zero gradients.
template <typename T>
struct AttentionGrad {
    MatrixStack<const T> d_out;  // (n_q x d_v) per (batch, head)
    MatrixStack<T> d_q;          // (n_q x d) per (batch, head)
    MatrixStack<T> d_k, d_v;     // (n_k x d), (n_k x d_v) per (batch, kv head)
    // optional: the logits' gradient (batch, heads, n_q, n_k), i.e. that of an additive mask,
    // written where a key tile is visited (zero it first), and the sinks' (batch, heads)
    T* d_mask = nullptr;
    T* d_sinks = nullptr;
    // run attention_forward first (p.out, p.lse) at the operands differentiated: with bf16,
    // q, k and v are rounded once for both
    bool recompute = false;
    // Half-precision storage (float only, with AttentionProblem::half set: k, v read from its
    // *_half views, and q when q_half is given): d_k, d_v written as bits of that format through
    // these views (their float views unused), d_q so when q is (else into d_q), and d_out read
    // from d_out_half when its data is set.
    MatrixStack<const std::uint16_t> d_out_half;
    MatrixStack<std::uint16_t> d_q_half, d_k_half, d_v_half;
};

// merge_attention's weighted sum of the parts' outputs: out = sum_k frac[k] part_k, row by row
// (rows x d each, contiguous), in part order. The parts are float (parts) or, float only, the
// bits of a half format (parts_half); out is float or bits of that format (out_half). frac:
// (count, rows), each row's weight of each part.
template <typename T>
struct MergeProblem {
    Index count = 0, rows = 0, d = 0;
    const T* const* parts = nullptr;
    const std::uint16_t* const* parts_half = nullptr;
    HalfFormat half = HalfFormat::none;
    const T* frac = nullptr;
    T* out = nullptr;
    std::uint16_t* out_half = nullptr;
};

// A dense projection y = x w + b; w is (in, out) row-major, b may be null.
template <typename T>
struct Linear {
    const T* w = nullptr;
    const T* b = nullptr;
    Index in = 0, out = 0;
    const std::uint16_t* w_half = nullptr;  // or w's half bits (w null): MHA
    HalfFormat half = HalfFormat::none;
    const T* packed = nullptr;  // w's column panels packed once (pack_weight), or null
    // w's bf16 tiles packed once for precision="bf16" (pack_bf16_tiles; float only), or null
    const std::uint16_t* tiles = nullptr;
};

// What a forward can keep for its backward (attnlab.vjp): the values, the attention output
// before w_o, the log-sum-exp (here), and the family's projections (MhaState, BilinearState).
// Buffers the caller owns, O(n d); any forward given them fills them, and a backward given them
// with `filled` set skips its recompute of the forward.
template <typename T>
struct KeptForward {
    T* v = nullptr;    // (batch * n_k, kv_heads * d_vhead)
    T* ctx = nullptr;  // (batch * n_q, heads * d_vhead)
    T* lse = nullptr;  // (batch, heads, n_q)
    bool filled = false;
};

template <typename T>
struct MhaState : KeptForward<T> {
    T* q = nullptr;  // (batch * n_q, heads * d_head), before QkTransform when there is one
    T* k = nullptr;  // (batch * n_k, kv_heads * d_head)
};

// cos and sin of the rotary angles, (batch or 1, n, rope_dim / 2) each, contiguous; the
// multiplier of transformers' scaled rope types already in them
template <typename T>
struct RotaryTables {
    const T* cos = nullptr;
    const T* sin = nullptr;
    bool batched = false;  // one table per batch entry, else one for all
};

// What modern layers apply to each projected query and key head before the attention, in this
// order (cpp/src/kernels/qk_transform.hpp): an RMSNorm over its d_head features with weights
// (Qwen3, Gemma 3: x (mean(x^2) + eps)^-1/2 w), then rotary embeddings on its first rope_dim
// features, feature j paired with j + rope_dim / 2 (transformers' rotate_half).
template <typename T>
struct QkTransform {
    const T* q_norm = nullptr;  // (d_head) or null: no norm
    const T* k_norm = nullptr;
    T eps = T(0);
    Index rope_dim = 0;  // 0: no rotation
    RotaryTables<T> rope_q, rope_k;
    bool any() const { return q_norm || k_norm || rope_dim > 0; }
};

// What multi-head and bilinear attention share: the sizes, the rows of the three inputs, the
// value and output projections, the scale and mask, the outputs. Each family adds how it forms
// the scores (MhaProblem, BilinearProblem).
template <typename T>
struct ProjectedAttention {
    Index batch = 0, n_q = 0, n_k = 0;
    Index heads = 0, kv_heads = 0, d_vhead = 0;
    const T* query = nullptr;  // (batch * n_q, d_q) row-major
    const T* key = nullptr;    // (batch * n_k, d_k)
    const T* value = nullptr;  // (batch * n_k, d_v)
    Linear<T> w_v, w_o;        // (d_v, kv_heads * d_vhead), (heads * d_vhead, d_out)
    T scale = T(1);
    MaskSpec<T> mask;
    T* out = nullptr;      // (batch * n_q, d_out)
    T* weights = nullptr;  // optional (batch, heads, n_q, n_k)
    // or the weights as bits of w_o's half format (float only, with half-precision weights)
    std::uint16_t* weights_half = nullptr;
    // Half-precision arrays (float only, float32 products, the weights' half format): query,
    // key, value and the forward's out as bits, instead of their float pointers (null)
    const std::uint16_t *query_half = nullptr, *key_half = nullptr, *value_half = nullptr;
    std::uint16_t* out_half = nullptr;
};

template <typename T>
struct MhaProblem : ProjectedAttention<T> {
    Index d_head = 0;
    Linear<T> w_q, w_k;  // (d_q, heads * d_head), (d_k, kv_heads * d_head)
    MhaState<T> state;   // optional: all five buffers or none
    QkTransform<T> qk;   // optional: q/k norms and rotary embeddings
    // precision="bf16" (float only): the forward's products in bf16 (in the backward, its
    // recomputed forward's; the gradient products stay float32)
    bool bf16 = false;
};

// Gradient of a dense projection: weight and bias gradients, input gradient (any may be null).
template <typename T>
struct LinearGrad {
    T* w = nullptr;  // (in, out)
    T* b = nullptr;  // (out)
    // or w as bits of the layer's half format (float only, half-precision weights; w null)
    std::uint16_t* w_half = nullptr;
};

// The gradients of what ProjectedAttention holds, and those of each family; any may be null.
template <typename T>
struct ProjectedGrads {
    T* query = nullptr;  // (batch * n_q, d_q)
    T* key = nullptr;    // (batch * n_k, d_k)
    T* value = nullptr;  // (batch * n_k, d_v)
    LinearGrad<T> w_v, w_o;
    T* mask = nullptr;   // (batch, heads, n_q, n_k), zeroed by the caller
    T* sinks = nullptr;  // (batch, heads)
    // Half precision (float only, in the weights' half format): the input gradients written as
    // bits instead (query, key, value then null; shared as those would be), and grad_out read
    // from bits (the kernel's grad_out then null).
    std::uint16_t *query_half = nullptr, *key_half = nullptr, *value_half = nullptr;
    const std::uint16_t* grad_out_half = nullptr;
};

template <typename T>
struct MhaGrads : ProjectedGrads<T> {
    LinearGrad<T> w_q, w_k;
    T* q_norm = nullptr;  // (d_head): the gradients of QkTransform's norm weights
    T* k_norm = nullptr;
};

// The kernels, compiled once per instruction set (see common.hpp).
namespace ATTNLAB_ISA_NS {

// The flash-style core: tiles of queries against tiles of keys with an online softmax, O(n d)
// memory; when weights are requested they are written and used directly (O(n^2), as asked).
template <typename T>
void attention_forward(const AttentionProblem<T>& p);

// Where the decode path requests the K and V rows it streams, chosen for this CPU at run time
// (build_info()).
const char* decode_prefetch();

template <typename T>
void attention_backward(const AttentionProblem<T>& p, const AttentionGrad<T>& g);

template <typename T>
void merge_attention(const MergeProblem<T>& p);

template <typename T>
void multi_head_attention_forward(const MhaProblem<T>& p);

// Recomputes the forward (projections, attention with log-sum-exp), unless p.state holds it,
// and back-propagates grad_out (batch * n_q, d_out) into every gradient pointer that is not null.
template <typename T>
void multi_head_attention_backward(const MhaProblem<T>& p, const T* grad_out, const MhaGrads<T>& g);
}  // namespace ATTNLAB_ISA_NS

}  // namespace attnlab

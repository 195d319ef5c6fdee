#pragma once
// Efficient additive attention (SwiftFormer) and separable self-attention (MobileViT-v2): the
// token-pooling attentions whose cost is linear in the number of tokens. Pure C++: no Python.

#include "attnlab/common.hpp"

namespace attnlab {

// official: Amshaker/SwiftFormer after July 2023 (L2 normalisation of the scores over tokens).
// hf: the Hugging Face port and the original release (softmax over a singleton axis: every
// token weight is 1, so w_g and scale have no effect).
enum class AdditiveVariant : int { official = 0, hf = 1 };

// Per batch element, x (n, d_in):
//   Q = normalize_rows(x w_q + b_q), K = normalize_rows(x w_k + b_k)       (n, D)
//   official: a = normalize_tokens((Q w_g) * scale); hf: a = 1
//   G = sum over real tokens of a_n Q_n                                    (D)
//   out = ((K diag(G)) w_proj + b_proj + Q) w_final + b_final              (n, d_out)
// normalize(v) = v / max(||v||, eps). No real token: G = 0. Biases may be null.
//
// The tensors are named once, in AdditiveTensors: the problem holds them as inputs (P = const
// T*) and AdditiveGrads, their gradients, is the same struct of outputs (P = T*).
template <typename P>
struct AdditiveTensors {
    P x = nullptr;                           // (batch * n, d_in) row-major contiguous
    P w_q = nullptr, b_q = nullptr;          // (d_in, D), (D)
    P w_k = nullptr, b_k = nullptr;          // (d_in, D), (D)
    P w_g = nullptr;                         // (D); its gradient is zero for the hf variant
    P w_proj = nullptr, b_proj = nullptr;    // (D, D), (D)
    P w_final = nullptr, b_final = nullptr;  // (D, d_out), (d_out)
};

// What the forward keeps for the backward (attnlab.vjp): caller-owned buffers, O(n D), all
// set or none. The forward given them fills them with its exact intermediates; a backward given
// them with `filled` set reads them instead of running the forward's pooling again (the
// backward without them runs that same pooling into its own buffers, so both agree bitwise).
template <typename T>
struct AdditiveState {
    T* q = nullptr;           // (batch * n, D): normalize_rows(x w_q + b_q)
    T* k = nullptr;           // (batch * n, D): normalize_rows(x w_k + b_k)
    T* q_norm = nullptr;      // (batch * n): ||x w_q + b_q|| before the normalisation
    T* k_norm = nullptr;      // (batch * n)
    T* score = nullptr;       // (batch * n): official (Q w_g) * scale; hf 1
    T* score_norm = nullptr;  // (batch): official ||s|| over the real tokens; hf 0
    T* pooled = nullptr;      // (batch, D): G
    bool filled = false;
};

// x and out, or the backward's grad_out and x's gradient, stored in half precision (float
// kernels): x's rows are read as float16 or bfloat16 bits and widened a row block at a time (or
// as they are transposed), out's rows rounded a block at a time as they are finished, grad_out
// widened by the products that read it, x's gradient rounded by the last one that sums into it;
// so none is copied whole in float32. The float pointer each replaces is null (out and the
// backward's grad_out may instead be float32: the kernel's own buffer for out, or a float32
// grad_out), and the results are the float32 kernel's on the widened values, rounded.
struct HalfTokens {
    const std::uint16_t* x = nullptr;         // (batch * n, d_in) bits
    std::uint16_t* out = nullptr;             // (batch * n, d_out) bits (the forward)
    const std::uint16_t* grad_out = nullptr;  // (batch * n, d_out) bits (the backward)
    std::uint16_t* grad_x = nullptr;          // (batch * n, d_in) bits (the backward)
    HalfFormat format = HalfFormat::none;
};

template <typename T>
struct AdditiveProblem : AdditiveTensors<const T*> {
    Index batch = 0, n = 0, d_in = 0, width = 0, d_out = 0;  // width is D
    T scale = T(1);
    T eps = T(1e-12);
    AdditiveVariant variant = AdditiveVariant::official;
    TokenMask key_padding;
    T* out = nullptr;        // (batch * n, d_out) row-major contiguous
    AdditiveState<T> state;  // optional (attnlab.vjp)
    HalfTokens half;         // tokens in half precision instead (float)
    // The weight matrices (w_q, w_k, w_proj, w_final) stored as half-precision bits
    // (half.format) instead, each set one in place of its float pointer, which is null (float,
    // not the bf16 forward); the vectors stay float, x's bits are half.x.
    AdditiveTensors<const std::uint16_t*> half_weights;
    // precision="bf16" (float, the forward): the four weight products on bf16 operands with
    // float32 sums, as the form above reads (x w_q, x w_k, (G * K) w_proj, H w_final with
    // H = (G * K) w_proj + b_proj + Q); the norms, scores and pooling in float32
    bool bf16 = false;
};

// Per batch element, x (n, d), [s | k | v] = x w_qkv + b_qkv with widths 1, d, d:
//   c = softmax of s over the real tokens; ctx = sum_n c_n k_n                (d)
//   out = (relu(v) diag(ctx)) w_o + b_o                                      (n, d_out)
// No real token: ctx = 0 (out = b_o). Biases may be null.
//
// Tensors named once, as in AdditiveTensors: inputs (P = const T*) or gradients (P = T*).
template <typename P>
struct SeparableTensors {
    P x = nullptr;                       // (batch * n, d)
    P w_qkv = nullptr, b_qkv = nullptr;  // (d, 1 + 2d), (1 + 2d)
    P w_o = nullptr, b_o = nullptr;      // (d, d_out), (d_out)
};

// What the separable forward keeps for the backward, as AdditiveState (all set or none).
template <typename T>
struct SeparableState {
    T* s = nullptr;        // (batch * n): the scores
    T* k = nullptr;        // (batch * n, d): the keys
    T* v = nullptr;        // (batch * n, d): relu(v)
    T* context = nullptr;  // (batch, d): ctx
    bool filled = false;
};

template <typename T>
struct SeparableProblem : SeparableTensors<const T*> {
    Index batch = 0, n = 0, d = 0, d_out = 0;
    TokenMask key_padding;
    T* out = nullptr;         // (batch * n, d_out)
    SeparableState<T> state;  // optional (attnlab.vjp)
    HalfTokens half;          // tokens in half precision instead (float)
    // The weight matrices (w_qkv, w_o) as half-precision bits instead, as
    // AdditiveProblem::half_weights.
    SeparableTensors<const std::uint16_t*> half_weights;
    // precision="bf16" (float, the forward): x w_qkv and (relu(v) * ctx) w_o on bf16 operands
    // with float32 sums; the softmax and ctx in float32
    bool bf16 = false;
};

// Gradients of the two forwards, written to caller-owned buffers shaped like the arguments
// (row-major contiguous; x's gradient is (batch * n, d_in)). A null bias gradient is skipped;
// every other pointer must be valid. Every reduction runs in a fixed order (per-block partial
// sums, then the blocks in order), so the result is bitwise the same for any thread count.
template <typename T>
using AdditiveGrads = AdditiveTensors<T*>;

template <typename T>
using SeparableGrads = SeparableTensors<T*>;

// The kernels, compiled once per instruction set (see common.hpp).
namespace ATTNLAB_ISA_NS {

template <typename T>
void additive_attention_forward(const AdditiveProblem<T>& p);

template <typename T>
void separable_attention_forward(const SeparableProblem<T>& p);

// p.out is not used; p.state, when filled, stands for the forward's pooling (else it is run
// again). Matches torch's autograd, including F.normalize below eps (v / eps, a constant scale)
// and relu at 0 (gradient 0).
template <typename T>
void additive_attention_backward(const AdditiveProblem<T>& p, const T* grad_out,
                                 const AdditiveGrads<T>& g);

template <typename T>
void separable_attention_backward(const SeparableProblem<T>& p, const T* grad_out,
                                  const SeparableGrads<T>& g);
}  // namespace ATTNLAB_ISA_NS

}  // namespace attnlab

#pragma once
// Bilinear-collapsed attention: per-head scores x_q W_i x_k^T + u_i . x_k with W_i (d_q x d_k)
// the folded W_q,i W_k,i^T, then softmax, values and output projection as in multi-head
// attention. Pure C++: no Python here.

#include "attnlab/attention.hpp"
#include "attnlab/common.hpp"

namespace attnlab {

// Which side of the score product absorbs W_i.
//   query: Q'_i = X_q W_i + u_i, scores Q'_i X_k^T (keys read unprojected by every head);
//   key:   K'_i = [X_k W_i^T | X_k u_i], scores [X_q | 1] K'_i^T (queries shared by every head).
// Per head, query costs n_q d_q d_k + n_q n_k d_k multiply-adds, key n_k d_k d_q + n_q n_k d_q.
enum class BilinearOrder : int { query = 0, key = 1 };

// What the forward keeps for the backward (attnlab.vjp), as MhaState: the values V = X_v w_v +
// b_v, the attention output before w_o and the log-sum-exp (KeptForward), and the projected
// queries X_q W_i + u_i of every head. A forward given them evaluates in the query order (the
// backward's).
template <typename T>
struct BilinearState : KeptForward<T> {
    T* proj = nullptr;  // (batch * n_q, heads * d_k)
};

template <typename T>
struct BilinearProblem : ProjectedAttention<T> {
    Index d_q = 0, d_k = 0;
    const T* w_qk = nullptr;  // (heads, d_q, d_k) contiguous
    const T* u_k = nullptr;   // optional (heads, d_k): the key-side term W_k,i b_q,i
    BilinearOrder order = BilinearOrder::query;
    BilinearState<T> state;  // optional: all four buffers or none
    // Half-precision weights (float only): w_qk's bits instead of w_qk (null), w_v and w_o's
    // in their Linear::w_half, all of format `half` (and so the inputs' *_half bits, if given)
    const std::uint16_t* w_qk_half = nullptr;
    HalfFormat half = HalfFormat::none;
};

// Gradients of bilinear_attention_forward; any pointer may be null (not computed).
template <typename T>
struct BilinearGrads : ProjectedGrads<T> {
    T* w_qk = nullptr;  // (heads, d_q, d_k)
    T* u_k = nullptr;   // (heads, d_k); only meaningful when p.u_k is set
};

// The kernels, compiled once per instruction set (see common.hpp).
namespace ATTNLAB_ISA_NS {

template <typename T>
void bilinear_attention_forward(const BilinearProblem<T>& p);

// Recomputes the forward in the query order whatever p.order says (the gradient is the same
// function; the query order keeps one projected tensor per query head and reads the keys raw),
// then back-propagates grad_out (batch * n_q, d_out). Deterministic for any thread count: the
// per-kv-head key gradients are summed in head order, never with atomics.
template <typename T>
void bilinear_attention_backward(const BilinearProblem<T>& p, const T* grad_out,
                                 const BilinearGrads<T>& g);
}  // namespace ATTNLAB_ISA_NS

}  // namespace attnlab

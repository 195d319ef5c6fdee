"""One runtime, one case, in a process of its own (``python -m attnlab._bench.peers_worker``).

``bench --peers`` starts one of these per runtime and case so that no runtime's threads (OpenMP,
ONNX Runtime's and OpenVINO's spinning pools, XLA's) slow another's. Every worker builds the
same float32 inputs and weights from the same seed, builds its runtime's version of the layer,
runs it once (the output is saved with ``--out`` for the parent's correctness check) and then
times it. A training case (``Case.train``) times a training step instead: the forward, then the
gradients of the input and of every weight and bias for one ``grad_out`` (attnlab's ``vjp`` +
pullback, torch autograd over F.linear + SDPA, JAX ``jit`` of ``jax.vjp``); its checked output is
the layer's output and every gradient (an ``.npz``), and attnlab's worker also times the forward
and the pullback alone: the parts of a worker, each a row of the table.

- one-shot (default): ``--repeat`` timed calls, one JSON line on stdout;
- ``--serve``: a JSON "ready" line (with ``parts``, each part's first timed call, when the
  worker has several), then one JSON line per ``time K [PART]`` command read from stdin (one
  untimed call, then K timed ones; the first part when none is named), until ``quit`` or end of
  input. The parent alternates its workers round by round without paying their start-up again.

``--no-time`` runs the case once, saves the output (``--out``) and exits: ``bench --accuracy``
measures the output's error against the float64 reference, on the inputs every worker builds
(``--n`` sets the case's number of keys, and of queries when the case has as many). The
runtimes of ``LOW_PRECISION_RUNTIMES`` (torch under bfloat16 autocast, OpenVINO at its default
inference precision) are for that comparison: ``bench --peers`` checks its runtimes against
attnlab's float32 output.

``python -m attnlab._bench.peers_worker sgemm N`` times NumPy's float32 matmul (OpenBLAS) on
N x N matrices instead: the check of the FMA peak.

The thread count is set by the parent through the environment (OMP_NUM_THREADS, XLA_FLAGS, ...)
and ``--threads``; below the CPUs available, the worker also restricts its CPU affinity to that
many CPUs, so that no runtime uses more cores than attnlab, whatever it reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

__all__ = ["CASES", "RUNTIMES", "LOW_PRECISION_RUNTIMES", "Case", "TRAIN_BUILDERS", "main"]

SEED = 1234


@dataclass(frozen=True)
class Case:
    """One benchmark case: an MHA layer (projections, attention, output projection) on
    ``x (B, n, d)``, or the attention core alone on ``q, k, v (B, h, n, d / h)``."""

    label: str
    B: int
    n: int
    d: int
    h: int
    causal: bool = False
    core_only: bool = False
    long: bool = False  # skipped by --quick
    train: bool = False  # a training step (forward + every gradient), not a forward
    n_q: int | None = None  # core only: queries when fewer than the n keys (decode)
    h_kv: int | None = None  # core only: kv heads when fewer than h (grouped-query)

    @property
    def queries(self) -> int:
        return self.n if self.n_q is None else self.n_q

    @property
    def kv_heads(self) -> int:
        return self.h if self.h_kv is None else self.h_kv

    def kv_bytes(self, runtime: str) -> int:
        """Bytes of keys and values a core call of ``runtime`` reads (float32, or bfloat16 for
        ``HALF_CACHE_RUNTIMES``): a decode call's traffic."""
        itemsize = 2 if runtime in HALF_CACHE_RUNTIMES else 4
        return 2 * itemsize * self.B * self.kv_heads * self.n * (self.d // self.h)

    @property
    def shape(self) -> str:
        if self.core_only:
            kv = f", kv heads {self.kv_heads}" if self.kv_heads != self.h else ""
            q = f", {self.queries} queries" if self.queries != self.n else ""
            return f"({self.B}, {self.h}, {self.n}, {self.d // self.h}){q}{kv}" + (
                " causal" if self.causal else ""
            )
        return f"B={self.B} n={self.n} d={self.d} h={self.h}" + (" causal" if self.causal else "")

    @property
    def flops(self) -> float:
        """Floating-point operations of one forward (2 per multiply-add; causal: the pairs under
        the diagonal only; a training step counts 3 of them, see ``backward.FORWARDS``)."""
        from .mha import mha_flops

        return mha_flops(
            self.B,
            self.queries,
            self.n,
            0 if self.core_only else self.d,
            self.h,
            self.d // self.h,
            self.causal,
        )


CASES: dict[str, Case] = {
    "bert": Case("BERT-base layer", 1, 128, 768, 12),
    "vit-s": Case("ViT-S layer", 8, 197, 384, 6),
    "vit-b": Case("ViT-B layer", 8, 197, 768, 12),
    "long": Case("long", 1, 8192, 512, 8, long=True),
    "long-causal": Case("long causal", 1, 8192, 512, 8, causal=True, long=True),
    "sdpa": Case("SDPA core", 1, 4096, 512, 8, core_only=True),
    # heads 512 wide (not in the default lists: `--case sdpa-wide`)
    "sdpa-wide": Case("SDPA, wide heads", 1, 2048, 4096, 8, core_only=True, long=True),
    # decoding one token against 8192 cached keys, 32 heads x 128: memory bound (issue 30)
    "decode": Case("decode", 1, 8192, 4096, 32, core_only=True, n_q=1),
    "decode-gqa": Case("decode GQA", 1, 8192, 4096, 32, core_only=True, n_q=1, h_kv=8),
    # training steps, the cases of issue 14 (`bench --peers --train`)
    "vit-s-train": Case("ViT-S train", 8, 197, 384, 6, train=True),
    "long-causal-train": Case("long causal train", 1, 4096, 512, 8, True, long=True, train=True),
    # not in the default lists: few-millisecond cases for the tests
    "tiny": Case("tiny (smoke)", 1, 16, 32, 2),
    "tiny-train": Case("tiny train", 1, 16, 32, 2, train=True),
}

# torch-sdpa: F.linear + F.scaled_dot_product_attention (the best torch path);
# torch-mha: nn.MultiheadAttention (what most models call).
# attnlab-packed: the layer's weights as attnlab.PackedWeight, packed once as ONNX Runtime's
# session packs its constant weights.
RUNTIMES = (
    "attnlab",
    "attnlab-packed",
    "torch-sdpa",
    "torch-mha",
    "onnxruntime",
    "openvino",
    "jax",
)
# what a user gets without asking for float32: torch-sdpa under torch.autocast(bfloat16), and
# OpenVINO at its default inference precision (bf16 on AMX and AVX512-BF16 CPUs); measured by
# bench --accuracy, not in bench --peers' float32 check. attnlab-bf16-packed: precision="bf16"
# with the layer's weights as attnlab.PackedWeight (their bf16 tiles packed once, as OpenVINO
# compiles its constant weights)
LOW_PRECISION_RUNTIMES = ("attnlab-bf16", "attnlab-bf16-packed", "torch-bf16", "openvino-default")
# the runtimes whose attention-core cases take bfloat16 q, k, v (a decode reads half the bytes)
HALF_CACHE_RUNTIMES = ("attnlab-bf16", "torch-bf16")


def inputs(case: Case) -> dict[str, np.ndarray]:
    """The case's float32 inputs and weights, the same in every worker: ``x`` and the
    ``(in, out)`` weights and biases of the layer, or ``q``, ``k``, ``v`` of the core; a
    training case also ``g``, the gradient of the output (``grad_out``)."""
    from .mha import _weights

    rng = np.random.default_rng(SEED)
    if case.core_only:
        dh = case.d // case.h
        q = rng.standard_normal((case.B, case.h, case.queries, dh), dtype=np.float32)
        kv = (case.B, case.kv_heads, case.n, dh)
        return {"q": q, **{k: rng.standard_normal(kv, dtype=np.float32) for k in ("k", "v")}}
    out = {"x": rng.standard_normal((case.B, case.n, case.d), dtype=np.float32)}
    out.update(_weights(rng, case.d, np.float32))
    if case.train:
        out["g"] = rng.standard_normal((case.B, case.n, case.d), dtype=np.float32)
    return out


def _layer_weights(a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in a.items() if k not in ("x", "g")}


class Skip(Exception):
    """The runtime is not installed, or cannot express this case: reported, not an error."""


# --- one builder per runtime: (call that runs the case to completion, its output as NumPy,
# version string); a training builder gives its parts, {name: call}, the first one checked, and
# its output as {"out": ..., "x": ..., "w_q": ...} (the gradients named as attnlab's arguments)
Built = tuple[Callable[[], Any], Callable[[Any], np.ndarray], str]
TrainBuilt = tuple[dict[str, Callable[[], Any]], Callable[[Any], dict[str, np.ndarray]], str]


def _import(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise Skip(f"{name} is not installed (pip install 'attnlab[bench]'): {e}") from None


def _attnlab(case: Case, a: dict[str, np.ndarray], threads: int) -> Built:
    import attnlab

    attnlab.set_num_threads(threads)
    if case.core_only:

        def f() -> Any:
            return attnlab.scaled_dot_product_attention(a["q"], a["k"], a["v"], causal=case.causal)
    else:
        w: dict[str, Any] = _layer_weights(a)

        def f() -> Any:
            return attnlab.multi_head_attention(a["x"], num_heads=case.h, causal=case.causal, **w)

    return f, np.asarray, f"attnlab {attnlab.__version__} isa={attnlab.build_info()['isa']}"


def _attnlab_packed(
    case: Case, a: dict[str, np.ndarray], threads: int, precision: str | None = None
) -> Built:
    """The layer with its weights as PackedWeight (panels, and with ``precision="bf16"`` the
    bf16 tiles, packed once)."""
    import attnlab

    if case.core_only:
        raise Skip("an attention-core case has no weights to pack")
    attnlab.set_num_threads(threads)
    w: dict[str, Any] = {
        n: attnlab.PackedWeight(v) if n.startswith("w_") else v
        for n, v in _layer_weights(a).items()
    }

    def f() -> Any:
        return attnlab.multi_head_attention(
            a["x"], num_heads=case.h, causal=case.causal, precision=precision, **w
        )

    bf16 = f" bf16={attnlab.build_info()['bf16_kernel']}" if precision else ""
    return f, np.asarray, f"attnlab {attnlab.__version__}{bf16} PackedWeight"


def _torch_fn(torch: Any, case: Case, a: dict[str, np.ndarray]) -> Callable[..., Any]:
    """The case as a torch function of its input tensors: F.linear + SDPA (also what OpenVINO
    converts)."""
    from .mha import _torch_sdpa_mha

    if case.core_only:
        gqa = case.kv_heads != case.h

        def core(q: Any, k: Any, v: Any) -> Any:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=case.causal, enable_gqa=gqa
            )

        return core
    return _torch_sdpa_mha(torch, _layer_weights(a), case.h, case.causal)  # type: ignore[no-any-return]


def _tensors(torch: Any, case: Case, a: dict[str, np.ndarray]) -> list[Any]:
    return [torch.from_numpy(a[k]) for k in (("q", "k", "v") if case.core_only else ("x",))]


def _torch_sdpa(case: Case, a: dict[str, np.ndarray], threads: int) -> Built:
    torch = _import("torch")
    torch.set_num_threads(threads)
    fn, args = _torch_fn(torch, case, a), _tensors(torch, case, a)

    def f() -> Any:
        with torch.inference_mode():
            return fn(*args)

    return f, lambda t: t.numpy(), f"torch {torch.__version__}"


def _attnlab_bf16(case: Case, a: dict[str, np.ndarray], threads: int) -> Built:
    """attnlab with bf16 products: ``precision="bf16"`` on the layer and the attention core;
    the decode cases read a bfloat16 cache (q, k, v stored in bfloat16, as torch-bf16's)."""
    import attnlab

    attnlab.set_num_threads(threads)
    if case.n_q is not None:
        bf16 = _import("ml_dtypes").bfloat16
        q, k, v = (a[n].astype(bf16) for n in ("q", "k", "v"))

        def f() -> Any:
            return attnlab.scaled_dot_product_attention(q, k, v, causal=case.causal)
    elif case.core_only:

        def f() -> Any:
            return attnlab.scaled_dot_product_attention(
                a["q"], a["k"], a["v"], causal=case.causal, precision="bf16"
            )
    else:
        w: dict[str, Any] = _layer_weights(a)

        def f() -> Any:
            return attnlab.multi_head_attention(
                a["x"], num_heads=case.h, causal=case.causal, precision="bf16", **w
            )

    kernel = attnlab.build_info()["bf16_kernel"]
    return f, lambda o: np.asarray(o, np.float32), f"attnlab {attnlab.__version__} bf16={kernel}"


def _torch_bf16(case: Case, a: dict[str, np.ndarray], threads: int) -> Built:
    """torch-sdpa under ``torch.autocast("cpu", dtype=torch.bfloat16)``: F.linear and SDPA take
    bfloat16 operands; the attention-core cases take bfloat16 tensors made once (a bfloat16
    cache when decoding), not converted in every call."""
    torch = _import("torch")
    torch.set_num_threads(threads)
    fn, args = _torch_fn(torch, case, a), _tensors(torch, case, a)
    if case.core_only:
        args = [t.bfloat16() for t in args]

    def f() -> Any:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(*args)

    return f, lambda t: t.float().numpy(), f"torch {torch.__version__} autocast bfloat16"


def _torch_mha(case: Case, a: dict[str, np.ndarray], threads: int) -> Built:
    if case.core_only:
        raise Skip("nn.MultiheadAttention has no attention-core-only form")
    torch = _import("torch")
    torch.set_num_threads(threads)
    from .mha import _torch_mha as build

    m = build(torch, _layer_weights(a), case.d, case.h)
    x = torch.from_numpy(a["x"])
    # nn.MultiheadAttention takes is_causal only as a hint next to the mask (True = masked)
    mask = torch.ones(case.n, case.n, dtype=torch.bool).triu(1) if case.causal else None

    def f() -> Any:
        with torch.inference_mode():
            return m(x, x, x, need_weights=False, attn_mask=mask, is_causal=case.causal)[0]

    return f, lambda t: t.numpy(), f"torch {torch.__version__} nn.MultiheadAttention"


def _onnx_layer(case: Case, a: dict[str, np.ndarray]) -> Any:
    """MatMul + Add projections around com.microsoft.MultiHeadAttention, weights as
    initializers."""
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(v, name=k) for k, v in _layer_weights(a).items()]
    nodes = []
    for p in ("q", "k", "v"):
        nodes += [
            helper.make_node("MatMul", ["x", f"w_{p}"], [f"{p}0"]),
            helper.make_node("Add", [f"{p}0", f"b_{p}"], [p]),
        ]
    nodes += [
        helper.make_node(
            "MultiHeadAttention",
            ["q", "k", "v"],
            ["ctx"],
            domain="com.microsoft",
            num_heads=case.h,
            unidirectional=int(case.causal),
        ),
        helper.make_node("MatMul", ["ctx", "w_o"], ["y0"]),
        helper.make_node("Add", ["y0", "b_o"], ["y"]),
    ]
    shape = [case.B, case.n, case.d]
    graph = helper.make_graph(
        nodes,
        "mha",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        initializer=inits,
    )
    return helper.make_model(
        graph,
        ir_version=8,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )


def _onnx_core(case: Case) -> Any:
    """The ONNX Attention operator (opset 23): q, k, v as (B, h, n, d_head), as given."""
    from onnx import TensorProto, helper

    dh = case.d // case.h
    q_shape = [case.B, case.h, case.queries, dh]
    kv_shape = [case.B, case.kv_heads, case.n, dh]
    vi = [
        helper.make_tensor_value_info(k, TensorProto.FLOAT, s)
        for k, s in (("q", q_shape), ("k", kv_shape), ("v", kv_shape))
    ]
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=int(case.causal))
    graph = helper.make_graph(
        [node], "sdpa", vi, [helper.make_tensor_value_info("y", TensorProto.FLOAT, q_shape)]
    )
    return helper.make_model(graph, ir_version=11, opset_imports=[helper.make_opsetid("", 23)])


def _onnxruntime(case: Case, a: dict[str, np.ndarray], threads: int) -> Built:
    ort = _import("onnxruntime")
    _import("onnx")  # builds the graph: a Skip when missing
    model = _onnx_core(case) if case.core_only else _onnx_layer(case, a)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feed = {k: a[k] for k in (("q", "k", "v") if case.core_only else ("x",))}

    def f() -> Any:
        return sess.run(None, feed)[0]

    return f, np.asarray, f"onnxruntime {ort.__version__}"


def _openvino(
    case: Case, a: dict[str, np.ndarray], threads: int, precision: str | None = "f32"
) -> Built:
    """The torch layer converted by OpenVINO, at inference precision ``precision`` (None: the
    CPU plugin's default, bf16 where the CPU has bf16 instructions)."""
    ov = _import("openvino")
    try:
        torch = _import("torch")
    except Skip:
        raise Skip(
            "openvino.convert_model converts the torch layer here: torch is not installed"
        ) from None
    fn, args = _torch_fn(torch, case, a), _tensors(torch, case, a)

    class Layer(torch.nn.Module):  # type: ignore[misc,name-defined]
        def forward(self, *xs: Any) -> Any:
            return fn(*xs)

    try:
        model = ov.convert_model(Layer().eval(), example_input=tuple(args))
    except Exception as e:  # noqa: BLE001 (any conversion failure: reported, not an error)
        raise Skip(f"openvino.convert_model cannot convert this case: {e}") from None
    config: dict[str, Any] = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
    if precision is not None:
        config["INFERENCE_PRECISION_HINT"] = precision
    compiled = ov.Core().compile_model(model, "CPU", config)
    req = compiled.create_infer_request()
    feed = [a[k] for k in (("q", "k", "v") if case.core_only else ("x",))]

    def f() -> Any:
        return req.infer(feed, share_inputs=True)[0]

    used = compiled.get_property("INFERENCE_PRECISION_HINT").to_string()  # e.g. "bf16"
    return f, np.asarray, f"openvino {ov.__version__}" + ("" if precision else f" {used}")


JAX_ARGS = ("x", "w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")


def _jax_layer(jax: Any, case: Case) -> Callable[..., Any]:
    """The MHA layer as a JAX function of ``JAX_ARGS``: projections, dot_product_attention, the
    output projection."""
    h, dh = case.h, case.d // case.h

    def layer(
        x: Any, w_q: Any, w_k: Any, w_v: Any, w_o: Any, b_q: Any, b_k: Any, b_v: Any, b_o: Any
    ) -> Any:
        B, n, d = x.shape
        q, k, v = (
            (x @ w + b).reshape(B, n, h, dh) for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v))
        )
        o = jax.nn.dot_product_attention(q, k, v, is_causal=case.causal)
        return o.reshape(B, n, d) @ w_o + b_o

    return layer


def _jax(case: Case, a: dict[str, np.ndarray], _threads: int) -> Built:
    jax = _import("jax")
    jnp = jax.numpy
    if case.core_only:

        def core(q: Any, k: Any, v: Any) -> Any:
            # jax.nn.dot_product_attention takes (B, T, N, H): the transposes are part of the call
            t = [jnp.swapaxes(z, 1, 2) for z in (q, k, v)]
            o = jax.nn.dot_product_attention(*t, is_causal=case.causal)
            return jnp.swapaxes(o, 1, 2)

        jf = jax.jit(core)
        names: tuple[str, ...] = ("q", "k", "v")
    else:
        jf = jax.jit(_jax_layer(jax, case))
        names = JAX_ARGS
    args = [jax.device_put(a[k]) for k in names]

    def f() -> Any:
        return jf(*args).block_until_ready()

    return f, np.asarray, f"jax {jax.__version__}"


BUILDERS: dict[str, Callable[[Case, dict[str, np.ndarray], int], Built]] = {
    "attnlab": _attnlab,
    "attnlab-packed": _attnlab_packed,
    "torch-sdpa": _torch_sdpa,
    "torch-mha": _torch_mha,
    "onnxruntime": _onnxruntime,
    "openvino": _openvino,
    "jax": _jax,
    "attnlab-bf16": _attnlab_bf16,
    "attnlab-bf16-packed": partial(_attnlab_packed, precision="bf16"),
    "torch-bf16": _torch_bf16,
    "openvino-default": partial(_openvino, precision=None),
}


# --- training steps


def _attnlab_train(case: Case, a: dict[str, np.ndarray], threads: int) -> TrainBuilt:
    """``vjp`` + pullback (the step, checked), the forward alone and the pullback alone."""
    import attnlab

    from .backward import _attnlab_fns, attnlab_grads

    attnlab.set_num_threads(threads)
    kw = dict(num_heads=case.h, causal=case.causal, **_layer_weights(a))
    fns = _attnlab_fns(a["x"], a["g"], kw)
    parts = {p: fns[f"attnlab {p}"] for p in ("step", "fwd", "pullback")}
    return parts, attnlab_grads, f"attnlab {attnlab.__version__} isa={attnlab.build_info()['isa']}"


def _torch_train(case: Case, a: dict[str, np.ndarray], threads: int) -> TrainBuilt:
    """torch autograd over the torch-sdpa layer: forward, then ``out.backward(g)``."""
    torch = _import("torch")
    torch.set_num_threads(threads)
    from .backward import _torch_step, torch_grads

    step = _torch_step(torch, _layer_weights(a), a["x"], a["g"], case.h, case.causal)
    return {"step": step}, torch_grads, f"torch {torch.__version__} autograd"


def _jax_train(case: Case, a: dict[str, np.ndarray], _threads: int) -> TrainBuilt:
    """``jax.jit`` of ``jax.vjp`` of the layer: the output and the gradients of every argument."""
    jax = _import("jax")
    layer = _jax_layer(jax, case)

    def vjp_step(g: Any, *args: Any) -> Any:
        out, pullback = jax.vjp(layer, *args)
        return out, pullback(g)

    jf = jax.jit(vjp_step)
    g, args = jax.device_put(a["g"]), [jax.device_put(a[k]) for k in JAX_ARGS]

    def step() -> Any:
        return jax.block_until_ready(jf(g, *args))

    def to_numpy(r: Any) -> dict[str, np.ndarray]:
        out, grads = r
        return {"out": np.asarray(out)} | {
            k: np.asarray(v) for k, v in zip(JAX_ARGS, grads, strict=True)
        }

    return {"step": step}, to_numpy, f"jax {jax.__version__} jit(vjp)"


def _no_training(runtime: str) -> Callable[[Case, dict[str, np.ndarray], int], TrainBuilt]:
    def build(_case: Case, _a: dict[str, np.ndarray], _threads: int) -> TrainBuilt:
        raise Skip(
            f"{runtime} has no training path here: training rows time attnlab, torch autograd "
            "(torch-sdpa) and JAX"
        )

    return build


TRAIN_BUILDERS: dict[str, Callable[[Case, dict[str, np.ndarray], int], TrainBuilt]] = {
    "attnlab": _attnlab_train,
    "attnlab-packed": _no_training("attnlab-packed (weights that change every step)"),
    "torch-sdpa": _torch_train,
    "torch-mha": _no_training("torch-mha (nn.MultiheadAttention)"),
    "onnxruntime": _no_training("onnxruntime"),
    "openvino": _no_training("openvino"),
    "jax": _jax_train,
    **{rt: _no_training(rt) for rt in LOW_PRECISION_RUNTIMES},
}


def _time(f: Callable[[], Any], k: int) -> list[float]:
    f()  # untimed: lets the threads of whatever ran before go quiet
    out = []
    for _ in range(k):
        t0 = time.perf_counter()
        f()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _save(path: str, out: np.ndarray | dict[str, np.ndarray]) -> None:
    """The checked output as float32: an array (``.npy``), or a training step's output and
    gradients by name (``.npz`` content, whatever the name: ``np.load`` tells them apart)."""
    if isinstance(out, dict):
        arrays: dict[str, Any] = {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    else:
        np.save(path, np.ascontiguousarray(out, dtype=np.float32))


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def sgemm(n: int, repeat: int) -> dict[str, Any]:
    """NumPy's float32 matmul (OpenBLAS) on n x n: the best GFLOP/s of ``repeat`` calls."""
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((n, n), dtype=np.float32)
    w = rng.standard_normal((n, n), dtype=np.float32)
    y = np.empty_like(x)
    ms = _time(lambda: np.matmul(x, w, out=y), repeat)
    return {
        "runtime": "sgemm",
        "n": n,
        "ms": ms,
        "gflops": 2.0 * n**3 / (min(ms) * 1e-3) / 1e9,
        "version": f"numpy {np.__version__}",
    }


def bandwidth(mib: int, repeat: int) -> dict[str, Any]:
    """Memory read bandwidth: NumPy's float32 matrix-vector product (OpenBLAS's sgemv, on its
    threads) over ``mib`` MiB, which reads the matrix once: the best GB/s of ``repeat`` calls."""
    rows = mib * (1 << 20) // (4 * 1024)
    a = np.ones((rows, 1024), dtype=np.float32)
    x = np.ones(1024, dtype=np.float32)
    y = np.empty(rows, dtype=np.float32)
    ms = _time(lambda: np.matmul(a, x, out=y), repeat)
    return {
        "runtime": "bandwidth",
        "mib": mib,
        "ms": ms,
        "gbs": a.nbytes / (min(ms) * 1e-3) / 1e9,
        "version": f"numpy {np.__version__}",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnlab._bench.peers_worker")
    p.add_argument("runtime", choices=RUNTIMES + LOW_PRECISION_RUNTIMES + ("sgemm", "bandwidth"))
    p.add_argument("case", help=f"one of {', '.join(CASES)} (for sgemm: the matrix size)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeat", type=int, default=5, help="timed calls (one-shot mode)")
    p.add_argument("--out", help="save the output here (.npy) for the correctness check")
    p.add_argument("--serve", action="store_true", help="take 'time K' commands on stdin")
    p.add_argument("--n", type=int, help="the case's keys (and queries, when as many) instead")
    p.add_argument("--no-time", action="store_true", help="run once, save --out, no timing")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads: expected a positive count, got {args.threads}")
    if hasattr(os, "sched_getaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        if args.threads < len(cpus):
            os.sched_setaffinity(0, cpus[: args.threads])
    if args.runtime == "sgemm":
        if not args.case.isdigit() or int(args.case) < 1:
            p.error(f"case: sgemm takes a matrix size, got {args.case!r}")
        _emit(sgemm(int(args.case), args.repeat))
        return 0
    if args.runtime == "bandwidth":
        if not args.case.isdigit() or int(args.case) < 1:
            p.error(f"case: bandwidth takes a size in MiB, got {args.case!r}")
        _emit(bandwidth(int(args.case), args.repeat))
        return 0
    if args.case not in CASES:
        p.error(f"case: expected one of {', '.join(CASES)}, got {args.case!r}")
    case = CASES[args.case]
    if args.n is not None:
        if args.n < 1:
            p.error(f"--n: expected a positive count, got {args.n}")
        case = replace(case, n=args.n)
    head: dict[str, Any] = {"runtime": args.runtime, "case": args.case}
    try:
        built = (TRAIN_BUILDERS if case.train else BUILDERS)[args.runtime](
            case, inputs(case), args.threads
        )
        parts = built[0] if isinstance(built[0], dict) else {"": built[0]}
        first, to_numpy, version = next(iter(parts)), built[1], built[2]
        t0 = time.perf_counter()
        out = to_numpy(
            parts[first]()
        )  # the first call: compiles, allocates; also the checked output
        head.update(version=version, first_ms=(time.perf_counter() - t0) * 1e3)
        if args.out:
            _save(args.out, out)
        if args.no_time:
            _emit(head)
            return 0
        call_ms = {p: min(_time(fp, 1)) for p, fp in parts.items()}
        head["call_ms"] = call_ms[first]
        if len(parts) > 1 or "" not in parts:
            head["parts"] = call_ms
    except Skip as e:
        _emit(head | {"skip": str(e)})
        return 0
    except Exception as e:  # noqa: BLE001 (any runtime failure on this case is reported, not fatal)
        _emit(head | {"error": f"{type(e).__name__}: {e}"[:500]})
        return 0
    if not args.serve:
        times = {p: _time(fp, args.repeat) for p, fp in parts.items()}
        _emit(head | {"ms": times[first]} | ({"parts_ms": times} if "parts" in head else {}))
        return 0
    _emit(head | {"ready": True})
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        part = cmd[2] if len(cmd) == 3 else first
        if cmd[0] == "time" and len(cmd) in (2, 3) and cmd[1].isdigit() and part in parts:
            _emit({"ms": _time(parts[part], max(1, int(cmd[1])))})
        else:
            _emit({"error": f"unknown command {line.strip()!r}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())

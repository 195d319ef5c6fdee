"""precision="bf16" against float32 with AMX off (ATTNLAB_AMX=0): the SDPA core (1, 8, 4096, 64)
and a ViT-B layer (B=8, n=197, d=768, 12 heads), timed in one process, interleaved, minimum of
the repeats. Which bf16 kernel runs is build_info()["bf16_kernel"]: "avx512_bf16" (VDPBF16PS:
by default on AMD; ATTNLAB_AVX512_BF16=1 forces it on an Intel CPU that has the instruction) or
"emulated" (ATTNLAB_AVX512_BF16=0).

    ATTNLAB_AMX=0 ATTNLAB_AVX512_BF16=1 python scripts/bench_bf16_avx512.py [--repeats 15]
    ATTNLAB_AMX=0 ATTNLAB_AVX512_BF16=0 python scripts/bench_bf16_avx512.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

import attnlab


def _cases() -> dict[str, dict[str, Callable[[], object]]]:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, 4096, 64)).astype(np.float32) for _ in range(3))
    x = rng.standard_normal((8, 197, 768)).astype(np.float32)
    w = {
        f"w_{n}": (rng.uniform(-1, 1, (768, 768)) / np.sqrt(768)).astype(np.float32) for n in "qkvo"
    }
    w.update({f"b_{n}": rng.uniform(-0.03, 0.03, 768).astype(np.float32) for n in "qkvo"})
    sdpa, mha = attnlab.scaled_dot_product_attention, attnlab.multi_head_attention
    return {
        "SDPA core (1, 8, 4096, 64)": {
            "float32": lambda: sdpa(q, k, v),
            "bf16": lambda: sdpa(q, k, v, precision="bf16"),
        },
        "ViT-B layer (8, 197, 768, 12 heads)": {
            "float32": lambda: mha(x, num_heads=12, **w),
            "bf16": lambda: mha(x, num_heads=12, **w, precision="bf16"),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    info = attnlab.build_info()
    print(f"bf16_kernel={info['bf16_kernel']} isa={info['isa']} threads={info['num_threads']}")
    for case, fns in _cases().items():
        best = dict.fromkeys(fns, float("inf"))
        for fn in fns.values():
            fn()  # warm up
        for _ in range(args.repeats):
            for name, fn in fns.items():
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
        ratio = best["float32"] / best["bf16"]
        cells = "  ".join(f"{n} {1e3 * s:7.2f} ms" for n, s in best.items())
        print(f"{case:38s} {cells}  bf16 speed-up {ratio:.2f}x")


if __name__ == "__main__":
    main()

"""Key-chunked attention on a local Dask cluster (2 worker processes, one kernel thread each)
against the one-process call: what splitting the keys across workers costs or gains. Skipped
without ``dask.distributed`` (``pip install "attnlab[dask]"``)."""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np

from .. import scaled_dot_product_attention
from .common import Row, interleaved
from .mha import mha_flops

__all__ = ["run"]


def run(quick: bool, threads: int) -> list[Row]:  # noqa: ARG001 (workers: 1 thread each)
    if importlib.util.find_spec("distributed") is None:
        return []
    import dask.array as da
    from distributed import Client, LocalCluster

    from .. import dask as adask

    B, h, n_q, n_k, d = 1, 8, 256, 16384 if quick else 65536, 64
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, h, n_q, d)).astype(np.float32)
    k = rng.standard_normal((B, h, n_k, d)).astype(np.float32)
    v = rng.standard_normal((B, h, n_k, d)).astype(np.float32)
    blocks = n_k // 4
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        with warnings.catch_warnings():  # the setup ships the arrays once: not what is timed
            warnings.filterwarnings("ignore", message="Sending large graph")
            kd = client.persist(da.from_array(k, chunks=(B, h, blocks, d)))
            vd = client.persist(da.from_array(v, chunks=(B, h, blocks, d)))
            qd = client.persist(da.from_array(q, chunks=q.shape))

        def on_cluster() -> np.ndarray:
            return adask.scaled_dot_product_attention(qd, kd, vd).compute()

        t = interleaved(
            {
                "one process": lambda: scaled_dot_product_attention(q, k, v),
                "dask 2 workers": on_cluster,
            },
            repeat=3 if quick else 5,
        )
        err = float(np.abs(on_cluster() - scaled_dot_product_attention(q, k, v)).max())
    flops = mha_flops(B, n_q, n_k, 0, h, d, False)
    shape = f"({B}, {h}, {n_q} queries, {n_k} keys, {d}) in {n_k // blocks} key blocks"
    return [
        Row(
            "dask",
            "key-chunked SDPA fp32",
            shape,
            impl,
            t[impl],
            flops,
            baseline=None if impl == "one process" else "one process",
            extra={"max_abs_diff": err} if impl != "one process" else {},
        )
        for impl in ("one process", "dask 2 workers")
    ]

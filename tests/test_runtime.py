"""The runtime around the kernels: fork, thread counts, resource limits, other threaded
libraries in the same process. Each scenario runs in a child interpreter with a timeout, so a
hang or an abort is a failure of this test, not of the session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import attnlab

# The child imports attnlab exactly as this process did (installed, or via PYTHONPATH).
_PKG_ROOT = str(Path(attnlab.__file__).resolve().parents[1])

_SETUP = """
import os, sys, json
import numpy as np
import attnlab
rng = np.random.default_rng(0)
x = rng.standard_normal((4, 300, 64))
w = {n: rng.standard_normal((64, 64)) / 8 for n in ("w_q", "w_k", "w_v", "w_o")}
def call():
    return attnlab.multi_head_attention(x, num_heads=4, causal=True, **w)
"""


def _child(code: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs _SETUP + code as a script file (spawned multiprocessing workers re-import it)."""
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_ROOT, full.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "child.py"
        script.write_text(_SETUP + textwrap.dedent(code))
        return subprocess.run(
            [sys.executable, str(script)],
            env=full,
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
        )


def _ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, f"status {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


# ----------------------------------------------------------------------------- fork


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_forked_children_compute_and_exit_normally():
    """Fork right after a call, ten times; every other child computes. Each child gets the
    same numbers and exits within 10 s (it used to hang in exit on a pool mutex or on worker
    threads that do not exist in the child), and the parent goes on computing."""
    out = _ok(
        _child(
            """
        import time
        attnlab.set_num_threads(2)
        ref = call()
        codes = []
        for i in range(10):
            call()
            pid = os.fork()
            if pid == 0:
                os._exit(3) if i % 2 and not np.array_equal(call(), ref) else sys.exit(0)
            t = time.time()
            while time.time() - t < 10:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes.append(os.waitstatus_to_exitcode(status))
                    break
                time.sleep(0.01)
            else:
                codes.append("hang")
                os.kill(pid, 9)
                os.waitpid(pid, 0)
        print(json.dumps([codes, bool(np.array_equal(call(), ref))]))
    """,
            timeout=150,
        )
    )
    codes, parent_ok = json.loads(out.strip().splitlines()[-1])
    assert codes == [0] * 10
    assert parent_ok


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_multiprocessing_pool_start_methods(method):
    if method not in __import__("multiprocessing").get_all_start_methods():
        pytest.skip(f"start method {method} not available")
    out = _ok(
        _child(
            f"""
        import multiprocessing as mp
        def work(seed):
            import numpy as np, attnlab
            rng = np.random.default_rng(0)
            x = rng.standard_normal((4, 300, 64))
            w = {{n: rng.standard_normal((64, 64)) / 8 for n in ("w_q", "w_k", "w_v", "w_o")}}
            return attnlab.multi_head_attention(x, num_heads=4, causal=True, **w)
        if __name__ == "__main__":
            attnlab.set_num_threads(2)
            ref = call()
            with mp.get_context("{method}").Pool(2) as pool:
                outs = pool.map(work, range(4))
            print(all(np.array_equal(o, ref) for o in outs))
    """,
            timeout=120,
        )
    )
    assert out.split() == ["True"]


# ----------------------------------------------------------------------------- thread counts


def test_default_threads_follow_cpu_affinity():
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no sched_setaffinity on this platform")
    cpu = min(os.sched_getaffinity(0))
    code = f"""
        import os
        os.sched_setaffinity(0, {{{cpu}}})
        import attnlab
        info = attnlab.build_info()
        print(json.dumps([attnlab.get_num_threads(), info["num_threads_source"]]))
    """
    # attnlab reads the affinity when first asked, so the mask set before the call counts
    env = {k: v for k, v in os.environ.items() if k != "ATTNLAB_NUM_THREADS"}
    r = subprocess.run(
        [sys.executable, "-c", "import json\n" + textwrap.dedent(code)],
        env=dict(env, PYTHONPATH=_PKG_ROOT),
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    n, source = json.loads(_ok(r).strip().splitlines()[-1])
    assert n == 1
    assert source in ("sched_getaffinity", "cgroup cpu quota")


def test_environment_variable_and_its_bounds():
    code = (
        "print(json.dumps([attnlab.get_num_threads(), attnlab.build_info()['num_threads_source']]))"
    )
    n, src = json.loads(_ok(_child(code, ATTNLAB_NUM_THREADS="3")).strip())
    assert (n, src) == (3, "ATTNLAB_NUM_THREADS")
    n, src = json.loads(_ok(_child(code, ATTNLAB_NUM_THREADS="5000")).strip())
    assert 1 <= n <= attnlab.MAX_THREADS
    assert "ATTNLAB_NUM_THREADS='5000' ignored: expected 1..1024" in src


def test_set_num_threads_has_a_documented_cap():
    old = attnlab.get_num_threads()
    try:
        with pytest.raises(
            ValueError, match=r"n: expected an integer between 1 and 1024, got 1025"
        ):
            attnlab.set_num_threads(attnlab.MAX_THREADS + 1)
        with pytest.raises(ValueError, match=r"n: expected an integer >= 1, got 0"):
            attnlab.set_num_threads(0)
        attnlab.set_num_threads(attnlab.MAX_THREADS)
        assert attnlab.get_num_threads() == attnlab.MAX_THREADS
        assert attnlab.build_info()["num_threads_source"] == "set_num_threads"
    finally:
        attnlab.set_num_threads(old)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS semantics: Linux")
def test_thread_creation_failure_falls_back_instead_of_aborting():
    """Under an address-space limit that leaves no room for another thread stack, asking for
    eight threads runs on those that could start (it used to std::terminate)."""
    out = _ok(
        _child("""
        import resource
        attnlab.set_num_threads(1)
        ref = call()
        vm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize")][0]
        resource.setrlimit(resource.RLIMIT_AS, (vm * 1024 + (6 << 20), resource.RLIM_INFINITY))
        attnlab.set_num_threads(8)
        same = np.array_equal(call(), ref)
        source = attnlab.build_info()["num_threads_source"]
        print(json.dumps([same, attnlab.get_num_threads(), source]))
    """)
    )
    same, n, source = json.loads(out.strip().splitlines()[-1])
    assert same
    assert 1 <= n < 8
    assert "reduced from 8: the system refused to start more threads" in source


# ----------------------------------------------------------------------------- cgroups


def _tree(root: Path, files: dict[str, str]) -> str:
    for rel, text in files.items():
        p = root / rel.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(root)


_MOUNT_V2 = "30 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw\n"
_MOUNT_V1 = (
    "35 25 0:30 / /sys/fs/cgroup/cpu,cpuacct rw shared:10 - cgroup cgroup "
    "rw,cpu,cpuacct\n36 25 0:31 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
)


@pytest.mark.parametrize(
    "files, expected",
    [
        (
            {
                "/proc/self/cgroup": "0::/app\n",
                "/proc/self/mountinfo": _MOUNT_V2,
                "/sys/fs/cgroup/app/cpu.max": "150000 100000\n",
            },
            2,
        ),  # 1.5 CPUs -> 2 threads
        (
            {
                "/proc/self/cgroup": "0::/app\n",
                "/proc/self/mountinfo": _MOUNT_V2,
                "/sys/fs/cgroup/app/cpu.max": "max 100000\n",
            },
            0,
        ),  # no quota
        (
            {
                "/proc/self/cgroup": "0::/a/b\n",
                "/proc/self/mountinfo": _MOUNT_V2,
                "/sys/fs/cgroup/a/cpu.max": "300000 100000\n",
                "/sys/fs/cgroup/a/b/cpu.max": "max 100000\n",
            },
            3,
        ),  # a parent's quota binds
        (
            {
                "/proc/self/cgroup": "4:memory:/x\n3:cpu,cpuacct:/x\n",
                "/proc/self/mountinfo": _MOUNT_V1,
                "/sys/fs/cgroup/cpu,cpuacct/x/cpu.cfs_quota_us": "400000\n",
                "/sys/fs/cgroup/cpu,cpuacct/x/cpu.cfs_period_us": "100000\n",
            },
            4,
        ),
        (
            {
                "/proc/self/cgroup": "3:cpu,cpuacct:/x\n",
                "/proc/self/mountinfo": _MOUNT_V1,
                "/sys/fs/cgroup/cpu,cpuacct/x/cpu.cfs_quota_us": "-1\n",
                "/sys/fs/cgroup/cpu,cpuacct/x/cpu.cfs_period_us": "100000\n",
            },
            0,
        ),
        ({"/proc/self/cgroup": "garbage\n", "/proc/self/mountinfo": "nonsense line\n"}, 0),
        ({}, 0),
    ],
)
def test_cgroup_cpu_quota_is_read(tmp_path, files, expected):
    from attnlab._loader import core

    assert core.cgroup_cpu_limit(_tree(tmp_path, files)) == expected


def test_default_is_never_above_the_real_quota_or_affinity():
    from attnlab._loader import core

    quota = core.cgroup_cpu_limit("")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    env = {k: v for k, v in os.environ.items() if k != "ATTNLAB_NUM_THREADS"}
    env["PYTHONPATH"] = _PKG_ROOT
    r = subprocess.run(
        [sys.executable, "-c", "import attnlab; print(attnlab.get_num_threads())"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    n = int(_ok(r).strip())
    assert n == (min(cpus, quota) if quota else cpus)


# ----------------------------------------------------------------------------- neighbours


def test_torch_numpy_and_attnlab_threads_busy_together():
    """attnlab's pool, torch's OpenMP pool and NumPy's BLAS threads all working at once, from
    several Python threads: attnlab's results stay bitwise those of a quiet process, and
    nothing deadlocks (the child has a timeout)."""
    pytest.importorskip("torch")
    out = _ok(
        _child(
            """
        import threading, torch
        attnlab.set_num_threads(2)
        torch.set_num_threads(2)
        ref = call()
        a = np.random.default_rng(1).standard_normal((400, 400))
        t = torch.randn(400, 400)
        results, stop = [], threading.Event()
        def blas():
            while not stop.is_set():
                a @ a
        def torch_mm():
            while not stop.is_set():
                t @ t
        def ours():
            for _ in range(10):
                results.append(np.array_equal(call(), ref))
        noise = [threading.Thread(target=blas), threading.Thread(target=torch_mm)]
        mine = [threading.Thread(target=ours) for _ in range(2)]
        for th in noise + mine:
            th.start()
        for th in mine:
            th.join()
        stop.set()
        for th in noise:
            th.join()
        print(len(results), all(results))
    """,
            timeout=300,
        )
    )
    assert out.split() == ["20", "True"]

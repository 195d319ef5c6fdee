"""The memory of the arrays the kernels read and write: 64-byte aligned, large blocks recycled
(:class:`_Blocks`), aligned copies, and the copies :func:`owned` makes for attnlab.vjp.
"""

from __future__ import annotations

import collections
import ctypes
import math
import mmap
import numbers
import os
import threading
import weakref
from typing import Any

import numpy as np

from ._loader import core

__all__: list[str] = []  # private module


def aligned(a: np.ndarray) -> np.ndarray:
    """``a`` itself, or an aligned copy when its data sits at an address that is not a multiple
    of its itemsize (possible with views of byte buffers); C++ may not read those in place."""
    return a if a.flags.aligned else copy(a)


_ALIGN = 64  # bytes: a cache line, and a whole number of AVX-512 vectors


class _Blocks:
    """The memory of large arrays, kept when the last array using it is dropped and handed to
    the next array of the same size (page-rounded), up to :attr:`LIMIT` bytes waiting.

    A loop of calls of one shape (a training step: the vjp state, the output, the gradients)
    then writes the same pages every time. Fresh pages are zeroed by the kernel as they are
    first touched: in perf that was 2.8% of a long causal training step (``clear_page_erms``;
    3.7% in the kernel in all). Private anonymous mappings: a forked child gets its
    own copy of every page, as with ``malloc``.
    """

    # Smaller arrays come from NumPy: glibc's malloc serves them from pages it keeps, but maps
    # (and unmaps) anything from 128 KiB until a freed large block raises that threshold, so
    # kept here from there on (a ViT-S pullback's 590 KB weight gradients faulted 544 pages a
    # call with a limit of 1 MiB).
    MIN = 128 << 10
    LIMIT = 256 << 20
    _HUGE = 4 << 20  # as NumPy: huge pages asked for from 4 MiB

    def __init__(self) -> None:
        self._free: dict[int, list[mmap.mmap]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        # blocks given back while the lock was taken: by another thread, or by this one when
        # the garbage collector ran a finalizer inside a locked section (waiting for the lock
        # there would deadlock); settled by the next call that takes the lock
        self._returned: collections.deque[tuple[mmap.mmap, int]] = collections.deque()
        # POSIX only; off with ATTNLAB_REUSE_MEMORY=0 (scripts/sanitize.sh: AddressSanitizer
        # puts its guard zones around malloc's blocks, not around these)
        self.usable = (
            hasattr(mmap, "MAP_PRIVATE") and os.environ.get("ATTNLAB_REUSE_MEMORY", "1") != "0"
        )

    def array(self, nbytes: int) -> np.ndarray:
        """``nbytes`` uint8, page-aligned, uninitialised (what the last user left)."""
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        with self._lock:
            self._settle()
            kept = self._free.get(size)
            block = kept.pop() if kept else None
            if block is not None:
                self._bytes -= size
        if block is None:
            try:
                block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
            except (OSError, OverflowError) as e:  # as NumPy would say it
                raise MemoryError(f"Unable to allocate {size} bytes: {e}") from None
            if size >= self._HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
                block.madvise(mmap.MADV_HUGEPAGE)
        # every view of `a` keeps `a` alive (NumPy stops collapsing bases at an array whose
        # base is not an array), so the block returns only when no array can reach it
        a = np.frombuffer(block, np.uint8, nbytes)
        weakref.finalize(a, self._give_back, block, size).atexit = False  # nothing to do then
        return a

    def _give_back(self, block: mmap.mmap, size: int) -> None:
        self._returned.append((block, size))
        if self._lock.acquire(blocking=False):
            try:
                self._settle()
            finally:
                self._lock.release()

    def _settle(self) -> None:
        """Keep the blocks given back, within the limit (the lock is held)."""
        while self._returned:
            block, size = self._returned.popleft()
            if self._bytes + size <= self.LIMIT:
                self._free.setdefault(size, []).append(block)
                self._bytes += size
            # else dropped: unmapped once the last reference goes

    def clear(self) -> None:
        """Let every waiting block go."""
        with self._lock:
            self._returned.clear()
            self._free.clear()
            self._bytes = 0

    @property
    def waiting(self) -> int:
        """Bytes kept for reuse."""
        with self._lock:
            self._settle()
            return self._bytes


_blocks = _Blocks()


def empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary.

    Every array the kernels write goes through here (from 128 KiB, memory that
    :class:`_Blocks` recycles). Eigen's vectorised loops peel scalar
    iterations up to the first vector-aligned element, and the peeled (scalar) and vector
    iterations can round differently, so where an output sits in memory could otherwise change
    the last bits of the result from one call to the next.
    """
    dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
    if isinstance(shape, tuple):
        shape = tuple(map(int, shape))
    else:
        shape = (int(shape),) if isinstance(shape, numbers.Integral) else tuple(map(int, shape))
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes >= _Blocks.MIN and _blocks.usable:
        return _blocks.array(nbytes).view(dt).reshape(shape)
    buf = np.empty(nbytes + _ALIGN, np.uint8)
    # the address through ctypes' buffer view: ndarray.ctypes builds several objects per read
    # (the ignore: NumPy's stubs do not declare the buffer protocol)
    start = (-ctypes.addressof(ctypes.c_char.from_buffer(buf))) % _ALIGN  # type: ignore[arg-type]
    return np.ndarray(shape, dt, buf, start)


def empty_group(specs: dict[Any, tuple[tuple[int, ...], Any]]) -> dict[Any, np.ndarray]:
    """:func:`empty` arrays, ``{key: (shape, dtype)}``, carved from one allocation.

    For what attnlab.vjp keeps (the forward's state, the copies of the arguments). As one
    allocation rather than one per array, the page-fault handling fell from 5.7% to 1.0% of a
    ViT-S vjp forward in perf (and the forward from 32.1 to 26.8 ms of CPU time); the block is
    recycled (:class:`_Blocks`), so a loop of steps faults almost no fresh pages once warm.
    """
    layout, total = {}, 0
    for k, (given, dtype) in specs.items():
        dt, shape = np.dtype(dtype), tuple(int(n) for n in given)
        nbytes = math.prod(shape) * dt.itemsize
        layout[k] = (total, nbytes, shape, dt)
        total += -(-nbytes // _ALIGN) * _ALIGN
    buf = empty((total,), np.uint8)
    return {
        k: buf[start : start + nbytes].view(dt).reshape(shape)
        for k, (start, nbytes, shape, dt) in layout.items()
    }


def zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """:func:`empty`, filled with zeros."""
    a = empty(shape, dtype)
    a.fill(0)
    return a


def copy(a: np.ndarray, dtype: Any = None) -> np.ndarray:
    """A C-contiguous, 64-byte-aligned copy of ``a`` (see :func:`empty`)."""
    out = empty(a.shape, a.dtype if dtype is None else dtype)
    out[...] = a
    return out


def contiguous(a: np.ndarray, dtype: Any = None) -> np.ndarray:
    """``a`` itself when it is C-contiguous, aligned and of ``dtype``; else :func:`copy`."""
    flags = a.flags
    if (
        (dtype is None or a.dtype == dtype)
        and flags.c_contiguous
        and flags.aligned
        and min(a.strides, default=0) >= 0
    ):
        return a
    return copy(a, dtype)


def kernel_ready(a: np.ndarray) -> np.ndarray:
    """A view the kernels can read: aligned, non-negative whole-element strides, unit last
    stride."""
    item = a.itemsize
    ok = a.flags.aligned and all(s >= 0 and s % item == 0 for s in a.strides)
    if a.ndim and a.shape[-1] > 1 and a.strides[-1] != item:
        ok = False
    return a if ok else copy(a)


def _zero_strides_to_one(a: np.ndarray) -> np.ndarray:
    """A view of ``a`` with every broadcast (stride-0) axis cut to length 1: the distinct data."""
    return a[
        tuple(
            slice(0, 1) if s == 0 and n > 1 else slice(None)
            for n, s in zip(a.shape, a.strides, strict=True)
        )
    ]


def owned(prepared: Any) -> Any:
    """A copy of a prepared call whose arrays are its own: attnlab.vjp keeps it for the
    pullback, which must see the values the forward saw even if the caller's arrays change in
    place. ``prepared`` is a NamedTuple or a dict, holding arrays directly or in nested dicts,
    NamedTuples and tuples; the structure is kept, and arrays shared between entries stay
    shared. One allocation for all the copies (see :func:`empty_group`); a broadcast view (a
    mask over batch and heads) is copied as its distinct data and broadcast again, never
    materialised at (B, h, n_q, n_k)."""
    found: dict[int, np.ndarray] = {}
    _find_arrays(prepared, found)
    data = {
        i: _zero_strides_to_one(a) if 0 in a.strides and a.size > 1 else a for i, a in found.items()
    }
    copies = empty_group({i: (d.shape, d.dtype) for i, d in data.items()})
    pooled = []  # contiguous ones on the kernels' threads (one thread alone made the others wait)
    for i, d in data.items():
        if d.flags.c_contiguous:
            pooled.append((copies[i], d))
        else:
            copies[i][...] = d
    core.copy_arrays(pooled)
    for i in data:
        if copies[i].shape != found[i].shape:
            copies[i] = np.broadcast_to(copies[i], found[i].shape)
    return _with_arrays(prepared, copies)


# owned()'s walks, at module level: as recursive closures they were reference cycles (a
# function's cell holding the function) that kept the copies, and the caller's arrays, alive
# until the garbage collector ran; the next step's vjp then took fresh memory.
def _find_arrays(x: Any, found: dict[int, np.ndarray]) -> None:
    if isinstance(x, np.ndarray):
        found.setdefault(id(x), x)
    elif isinstance(x, dict):
        for v in x.values():
            _find_arrays(v, found)
    elif isinstance(x, tuple):
        for f in x:
            _find_arrays(f, found)


def _with_arrays(x: Any, copies: dict[int, np.ndarray]) -> Any:
    if isinstance(x, np.ndarray):
        return copies[id(x)]
    if isinstance(x, dict):
        return {k: _with_arrays(v, copies) for k, v in x.items()}
    if isinstance(x, tuple):
        parts = (_with_arrays(f, copies) for f in x)
        return type(x)(*parts) if hasattr(x, "_fields") else tuple(parts)
    return x

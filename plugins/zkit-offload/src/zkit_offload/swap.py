"""NVMe swapper: flat CPU tensors to and from files, asynchronously, in aligned blocks.

Each swapped tensor (a *key*) has one file under a directory created for this run
(``<nvme_path>/zkit-swap-<pid>-<random>``), preallocated to its full size when the key is
registered, so a full disk is reported up front rather than half-way through a step. Reads and
writes are split into ``block_size`` chunks served by a pool of I/O threads (``os.pread`` /
``os.pwrite`` release the GIL, so ``io_threads`` requests are in flight at once: the queue depth).

**Direct I/O.** Where the filesystem accepts ``O_DIRECT`` (probed once per run directory) the page
cache is bypassed. Direct I/O needs the memory address, file offset and length aligned to the
device block; chunks of a tensor whose memory is aligned (:func:`aligned_empty`) go straight from
the tensor, others through a per-thread aligned staging buffer. Files are padded to the alignment.

**Why threads, not io_uring/libaio.** Neither is reachable from Python without a compiled
extension or an optional system library (libaio is not installed by default); threads issuing
positional reads/writes reach the device's sequential bandwidth at a queue depth of a few
requests (see ``contrib/bench/bench_nvme_swap.py``) and cannot fail to build.

**Failures.** Any I/O error (ENOSPC, EIO, a short read of a truncated file) raises
:class:`SwapError` naming the file. A key whose write failed is marked broken: reading it raises
instead of returning half-written data. The run directory is removed by :meth:`NVMeSwapper.close`
and, as a fallback, at interpreter exit (or at the exit of a multiprocessing child, which skips the
interpreter's exit handlers when it was forked). A process killed by a signal runs neither: each run
directory therefore carries an ``owner`` file (host name and pid), and a new swapper removes the
directories under the same ``nvme_path`` whose owner ran on this host and no longer exists.
"""
from __future__ import annotations

import concurrent.futures as cf
import errno
import mmap
import multiprocessing.util
import os
import shutil
import socket
import threading
import uuid
import weakref
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from zkit_offload.io_memory import ALIGN, aligned_empty  # noqa: F401 - the swapper's buffers


class SwapError(RuntimeError):
    """An NVMe swap read or write failed; the message names the file."""


#: the file in a run directory naming the process that owns it: ``"<host> <pid>"``
OWNER = "owner"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_runs(nvme_path: str | os.PathLike) -> list[str]:
    """Delete the run directories under ``nvme_path`` left by processes of this host that no
    longer exist (killed by a signal: no ``close()``, no exit handler); the paths removed.
    Directories of other hosts (a shared filesystem) and of live processes are left alone."""
    host, removed = socket.gethostname(), []
    for run in Path(nvme_path).glob("zkit-swap-*"):
        try:
            owner_host, pid = (run / OWNER).read_text().split()
            stale = owner_host == host and not _alive(int(pid))
        except (OSError, ValueError):
            continue  # not ours, or being created right now
        if stale:
            shutil.rmtree(run, ignore_errors=True)
            removed.append(str(run))
    return removed


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class SwapHandle:
    """The pending chunks of one swap-in or swap-out; :meth:`wait` raises the first failure."""

    def __init__(self, futures: list[cf.Future], on_done=None) -> None:
        self._futures = futures
        self._on_done = on_done
        self._done = False

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        if self._done:
            return
        error = None
        for f in self._futures:
            exc = f.exception()
            if exc is not None and error is None:
                error = exc
        self._done = True
        if self._on_done is not None:
            self._on_done(error)
        if error is not None:
            raise error


class _Key:
    __slots__ = ("path", "nbytes", "file_bytes", "fd", "broken")

    def __init__(self, path: Path, nbytes: int, file_bytes: int, fd: int) -> None:
        self.path, self.nbytes, self.file_bytes, self.fd = path, nbytes, file_bytes, fd
        self.broken: str | None = None


class NVMeSwapper:
    """Swap flat contiguous CPU tensors to files under ``nvme_path``.

    Args:
        nvme_path: directory on the fast disk; a per-run sub-directory is created in it.
        block_size: bytes per I/O request (rounded up to the alignment); DeepSpeed's ``aio.block_size``.
        io_threads: I/O requests in flight at once (``aio.queue_depth`` x ``aio.intra_op_parallelism``
            is the DeepSpeed analogue).
        direct: ``True`` requires O_DIRECT, ``False`` never uses it, ``None`` uses it where the
            filesystem supports it.
    """

    def __init__(self, nvme_path: str | os.PathLike, *, block_size: int = 1 << 20, io_threads: int = 4,
                 direct: bool | None = None) -> None:
        if block_size <= 0 or io_threads <= 0:
            raise ValueError(f"NVMeSwapper: block_size and io_threads must be positive, got {block_size}, {io_threads}")
        base = Path(nvme_path)
        if not base.is_dir():
            raise SwapError(f"nvme_path {str(base)!r} is not an existing directory")
        self.block_size = _round_up(block_size, ALIGN)
        #: run directories of dead processes removed when this swapper was created
        self.removed_stale = remove_stale_runs(base)
        self.dir = base / f"zkit-swap-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.dir.mkdir()
            (self.dir / OWNER).write_text(f"{socket.gethostname()} {os.getpid()}\n")
        except OSError as exc:
            raise SwapError(f"cannot create the swap directory {str(self.dir)!r}: {exc}") from exc
        # Runs when the swapper is collected or, still alive, at interpreter exit (weakref.finalize
        # registers its own exit hook). A forked multiprocessing child ends with os._exit, which
        # skips that hook; multiprocessing runs its own finalizers first.
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self._mp_finalizer = multiprocessing.util.Finalize(None, self._finalizer, exitpriority=0)
        self.direct = self._probe_direct() if direct is None else direct
        if self.direct and not self._probe_direct():
            raise SwapError(f"direct=True but the filesystem of {str(self.dir)!r} does not support O_DIRECT")
        self._keys: dict[str, _Key] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._pool = cf.ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="zkit-swap")
        self.bytes_written = 0
        self.bytes_read = 0

    # -- keys ------------------------------------------------------------------------------------
    def register(self, key: str, nbytes: int) -> Path:
        """Create (and preallocate) the file of ``key`` for ``nbytes`` bytes of tensor data."""
        if key in self._keys:
            raise ValueError(f"swap key {key!r} is already registered")
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)
        path = self.dir / f"{len(self._keys):05d}-{safe}.swp"
        file_bytes = _round_up(max(nbytes, 1), ALIGN)
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.direct else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise SwapError(f"cannot create swap file {str(path)!r}: {exc}") from exc
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, file_bytes)
            else:  # pragma: no cover - non-POSIX
                os.ftruncate(fd, file_bytes)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            hint = " (the disk is full)" if exc.errno == errno.ENOSPC else ""
            raise SwapError(f"cannot allocate {file_bytes} bytes for swap file {str(path)!r}{hint}: {exc}") from exc
        self._keys[key] = _Key(path, nbytes, file_bytes, fd)
        return path

    def path(self, key: str) -> Path:
        return self._get(key).path

    def keys(self) -> list[str]:
        return list(self._keys)

    def remove(self, key: str) -> None:
        k = self._keys.pop(key)
        os.close(k.fd)
        k.path.unlink(missing_ok=True)

    # -- I/O -------------------------------------------------------------------------------------
    def swap_out(self, key: str, tensor: torch.Tensor, offset: int | None = None) -> SwapHandle:
        """Start writing ``tensor`` (contiguous, CPU) to ``key``'s file (registered on first use).
        ``offset`` (bytes, a multiple of :data:`ALIGN`) writes it over part of a registered key."""
        buf = self._bytes_of(tensor, "swap_out")
        if key not in self._keys and offset is None:
            self.register(key, buf.size)
        k = self._check_size(key, buf.size, offset)
        base = offset or 0
        k.broken = "a write is in progress"

        def finish(error: BaseException | None) -> None:
            k.broken = f"its last write failed: {error}" if error is not None else None
            if error is None:
                self.bytes_written += buf.size

        return SwapHandle([self._pool.submit(self._write, k, buf, off, base) for off in self._chunks(buf.size)], finish)

    def swap_in(self, key: str, tensor: torch.Tensor, offset: int | None = None) -> SwapHandle:
        """Start reading ``key`` into ``tensor`` (contiguous, CPU, the size it was written with;
        with ``offset``, a part of the key starting there, as in :meth:`swap_out`)."""
        buf = self._bytes_of(tensor, "swap_in")
        k = self._check_size(key, buf.size, offset)
        base = offset or 0
        if k.broken is not None:
            raise SwapError(f"swap file {str(k.path)!r} of {key!r} cannot be read: {k.broken}")
        try:
            size = os.fstat(k.fd).st_size
        except OSError as exc:
            raise SwapError(f"swap file {str(k.path)!r} of {key!r} cannot be read: {exc}") from exc
        if size < k.file_bytes:
            raise SwapError(f"swap file {str(k.path)!r} of {key!r} is truncated: {size} bytes, expected {k.file_bytes}")

        def finish(error: BaseException | None) -> None:
            if error is None:
                self.bytes_read += buf.size

        return SwapHandle([self._pool.submit(self._read, k, buf, off, base) for off in self._chunks(buf.size)], finish)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Synchronous :meth:`swap_out`."""
        self.swap_out(key, tensor).wait()

    def read(self, key: str, tensor: torch.Tensor) -> None:
        """Synchronous :meth:`swap_in`."""
        self.swap_in(key, tensor).wait()

    def close(self) -> None:
        """Stop the I/O threads, close and delete every swap file and the run directory."""
        self._pool.shutdown(wait=True)
        for k in self._keys.values():
            try:
                os.close(k.fd)
            except OSError:
                pass
        self._keys.clear()
        self._finalizer()
        self._mp_finalizer.cancel()

    def __enter__(self) -> "NVMeSwapper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------
    def _get(self, key: str) -> _Key:
        try:
            return self._keys[key]
        except KeyError:
            raise KeyError(f"swap key {key!r} is not registered; known: {', '.join(self._keys) or '(none)'}") from None

    def _check_size(self, key: str, nbytes: int, offset: int | None = None) -> _Key:
        k = self._get(key)
        if offset is None:
            if nbytes != k.nbytes:
                raise ValueError(f"swap key {key!r} holds {k.nbytes} bytes; the tensor has {nbytes}")
        elif offset % ALIGN or offset < 0 or offset + nbytes > k.nbytes:
            raise ValueError(f"swap key {key!r} holds {k.nbytes} bytes; cannot access {nbytes} bytes at offset "
                             f"{offset} (offsets are multiples of {ALIGN} inside the key)")
        return k

    @staticmethod
    def _bytes_of(tensor: torch.Tensor, what: str) -> np.ndarray:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"{what} needs a contiguous CPU tensor, got one on {tensor.device} "
                             f"(contiguous={tensor.is_contiguous()})")
        return tensor.detach().reshape(-1).view(torch.uint8).numpy()

    def _chunks(self, nbytes: int) -> Iterable[int]:
        return range(0, nbytes, self.block_size) if nbytes else ()

    def _staging(self) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            # anonymous mmap is page-aligned: a valid O_DIRECT buffer
            self._local.mm = mmap.mmap(-1, self.block_size)
            buf = self._local.buf = np.frombuffer(self._local.mm, dtype=np.uint8)
        return buf

    def _aligned(self, view: np.ndarray) -> bool:
        return not self.direct or (view.ctypes.data % ALIGN == 0 and view.size % ALIGN == 0)

    def _write(self, k: _Key, buf: np.ndarray, off: int, base: int = 0) -> None:
        view = buf[off: off + self.block_size]
        if not self._aligned(view):
            stage = self._staging()
            padded = _round_up(view.size, ALIGN)
            stage[: view.size] = view
            stage[view.size: padded] = 0
            view = stage[:padded]
        self._io(os.pwrite, k, view, base + off, "write")

    def _read(self, k: _Key, buf: np.ndarray, off: int, base: int = 0) -> None:
        view = buf[off: off + self.block_size]
        if self._aligned(view):
            self._io(os.preadv, k, view, base + off, "read")
            return
        stage = self._staging()
        padded = _round_up(view.size, ALIGN)
        self._io(os.preadv, k, stage[:padded], base + off, "read")
        view[:] = stage[: view.size]

    @staticmethod
    def _io(op, k: _Key, view: np.ndarray, off: int, what: str) -> None:
        done = 0
        mv = memoryview(view)
        while done < view.size:
            try:
                n = op(k.fd, mv[done:], off + done) if op is os.pwrite else op(k.fd, [mv[done:]], off + done)
            except OSError as exc:
                hint = " (the disk is full)" if exc.errno == errno.ENOSPC else ""
                raise SwapError(f"{what} of swap file {str(k.path)!r} at offset {off + done} failed{hint}: {exc}") from exc
            if n == 0:
                raise SwapError(f"swap file {str(k.path)!r} is truncated: {what} at offset {off + done} hit end of file")
            done += n

    def _probe_direct(self) -> bool:
        if not hasattr(os, "O_DIRECT"):
            return False
        probe = self.dir / ".direct-probe"
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        except OSError:
            return False
        try:
            mm = mmap.mmap(-1, ALIGN)
            try:
                os.pwrite(fd, mm, 0)
                return True
            except OSError:
                return False
            finally:
                mm.close()
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)

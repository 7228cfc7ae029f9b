"""Where offloaded bytes live: a scratch file on a local disk ("nvme") or host memory ("cpu" on a GPU).

Both stores have the same two verbs; one worker thread runs the transfers in submission order (so a read
into a buffer submitted after a write from it never overtakes that write):

    future = store.submit("read", [(buf, offset), ...])   bytes [offset, offset + buf.numel()) of the store
                                                          into each uint8 tensor buf ("write": the reverse)
    store.wait(future, what)                              done, or OffloadError naming the file, the bytes
                                                          and the offset that failed

and `mapping()`: the whole store as one uint8 tensor (the file mapped shared, or the host tensor), from
which the optimizer's state entries are views between steps, so that anything reading them (checkpoints,
opt.state_dict(), the user) reads the real values. A shared mapping and pread/pwrite see the same page
cache, so the two paths agree. Pages of the mapping are faulted in only when read; the owner remaps after
such reads (offload.StateOffload.release: madvise(MADV_DONTNEED)) so that they stop counting as resident.

The scratch file: `<offload_dir>/meshc-offload-rank<R>-<random>/<what>.bin`, created and preallocated
(posix_fallocate: a full disk fails here, before the first step) when the optimizer is made, then unlinked
at once (file and folder) while this process keeps it open: its space is the kernel's to free when the
process ends, however it ends (a rank killed by a peer's failure or os._exit leaves nothing behind), and
nothing on disk can be mistaken for a checkpoint. The mapping reopens it through /proc/self/fd. Messages
name the path it was created at.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from meshc.compiler.ir.errors import MeshcError

PREFIX = "meshc-offload-"


class OffloadError(MeshcError, OSError):
    """An offload folder or file could not be used: the message names it and the failed operation."""


def check_folder(folder) -> str:
    """`folder` as an absolute path, after checking it exists and this process can create files in it."""
    path = os.path.abspath(os.fspath(folder))
    if not os.path.isdir(path):
        raise OffloadError(f"Plan.offload_dir: expected an existing folder, got {path!r} "
                           f"({'a file' if os.path.exists(path) else 'missing'}); create it on a fast local disk")
    try:
        fd, probe = tempfile.mkstemp(prefix=PREFIX + "probe-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise OffloadError(f"Plan.offload_dir: expected a folder this process can write, got {path!r}: "
                           f"{e.strerror or e}; choose a writable folder") from None
    return path


class FileStore:
    """A preallocated scratch file of `nbytes`, read and written by one worker thread."""

    kind = "nvme"

    def __init__(self, folder, rank: int, nbytes: int, what: str):
        folder = check_folder(folder)
        self.nbytes = nbytes
        self.dir = tempfile.mkdtemp(prefix=f"{PREFIX}rank{rank}-", dir=folder)
        self.path = os.path.join(self.dir, f"{what}.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshc-offload")
        self._closer = weakref.finalize(self, _close_file, self.fd, self.dir, self._pool)
        try:
            if nbytes:
                os.posix_fallocate(self.fd, 0, nbytes)
            os.unlink(self.path)
            os.rmdir(self.dir)
        except OSError as e:
            free = shutil.disk_usage(folder).free
            self.close()
            why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
            raise OffloadError(f"offload file {self.path}: expected room for {_mib(nbytes)} of offloaded states, "
                               f"got {why} ({_mib(free)} free in {folder}); free space, choose another "
                               "offload_dir, or offload less") from None

    def submit(self, what: str, parts: list) -> Future:
        """Transfer each (uint8 buffer, offset) of `parts`: "read" from the file into it, "write" it to the file."""
        return self._pool.submit(_transfer_all, what, self.fd, parts)

    def wait(self, future: Future, what: str) -> None:
        try:
            future.result()
        except _Failed as e:
            raise OffloadError(f"offload file {self.path}: {e.what} of {e.nbytes} bytes at offset {e.offset} failed "
                               f"({what}): {e.error.strerror or e.error}; check the disk (dmesg), or run without "
                               "offload") from None

    def mapping(self) -> torch.Tensor:
        if not self.nbytes:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=self.nbytes, dtype=torch.uint8)

    def close(self) -> None:
        self._closer()


class HostStore:
    """Host memory (pinned on CUDA) standing in for the file, for offload="cpu" on a GPU."""

    kind = "cpu"

    def __init__(self, nbytes: int, pin: bool):
        self.nbytes, self.path = nbytes, "host memory"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshc-offload")
        self._closer = weakref.finalize(self, self._pool.shutdown, wait=True)

    def submit(self, what: str, parts: list) -> Future:
        pairs = [(buf, self.host[o: o + buf.numel()]) if what == "read" else (self.host[o: o + buf.numel()], buf)
                 for buf, o in parts]
        return self._pool.submit(_copy_all, pairs)

    def wait(self, future: Future, what: str) -> None:
        future.result()

    def mapping(self) -> torch.Tensor:
        return self.host

    def close(self) -> None:
        self._closer()


def _copy_all(pairs: list) -> None:
    for dst, src in pairs:
        dst.copy_(src, non_blocking=True)
    if any(t.device.type == "cuda" for pair in pairs for t in pair):
        torch.cuda.current_stream().synchronize()


class _Failed(Exception):
    def __init__(self, what: str, nbytes: int, offset: int, error: OSError):
        super().__init__(what)
        self.what, self.nbytes, self.offset, self.error = what, nbytes, offset, error


def _transfer_all(what: str, fd: int, parts: list) -> None:
    """Each part through preadv/pwritev (the GIL is released inside the call), however short each pass."""
    call = os.preadv if what == "read" else os.pwritev
    for buf, offset in parts:
        view = memoryview(buf.numpy()).cast("B")
        done = 0
        try:
            while done < len(view):
                n = call(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, "end of file before the offloaded bytes")
                done += n
        except OSError as e:
            raise _Failed(what, len(view), offset, e) from None


def _close_file(fd: int, folder: str, pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True)
    try:
        os.close(fd)
    except OSError:
        pass
    shutil.rmtree(folder, ignore_errors=True)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"

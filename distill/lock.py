"""One writer per output: an OS-level lock on a run dir, a regeneration output or an offline teacher cache.

The lock is ``flock`` on a small file beside what is written (``.<name>.lock``): the kernel drops it when the
process ends, however it ends (kill -9, a node lost), so a killed job never leaves a stale lock behind and a requeued
job takes over at once. The file holds who took it (host, pid, start time) so that a second writer is refused naming the holder;
the file itself stays (deleting it while held would let a third process lock a new file of the same name).

On Linux NFS ``flock`` is carried by the server's byte-range locks and so holds across nodes; a filesystem with no
locking at all (e.g. Lustre mounted without ``flock``) gets a warning, and the run goes on unguarded.

It lives in ``distill`` (whose regeneration and cache writers use it) because every other writer (train, eval) sits
above it in the layer order.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

NAME_MAX = 255  # bytes in one path component: ext4, xfs, btrfs, tmpfs, NFS
_held: dict[Path, int] = {}  # lock file -> open descriptor, while this process holds it


class WriterLockedError(RuntimeError):
    """Another live process writes the same output."""


def lock_file_for(path: str | os.PathLike) -> Path:
    """Where the lock of ``path`` lives: beside it, ``.<name>.lock`` in the same parent (of the path with ``~``
    expanded and symlinks resolved, so two spellings of one output share one lock). Outside the output itself: taking
    the lock never changes a file of a run dir, and a copied run dir carries no lock. A parent this user may not write
    (a run dir made for them in a shared read-only tree) gets the lock in this user's lock dir instead
    (``$SPECDRAFT_CACHE/locks``, else ``~/.cache/specdraft/locks``), named by the path's digest: it then guards
    against this user's other jobs on machines that share that dir."""
    from distill.fingerprint import text_digest

    path = Path(path).expanduser().resolve()
    digest = text_digest(str(path))[:16]
    if _may_create_in(path.parent):
        return path.with_name(_within_name_max(".", path.name, ".lock", digest))
    from distill.toy.cache import default_cache_dir

    return default_cache_dir() / "locks" / _within_name_max("", path.name, f"-{digest}.lock", digest)


def _within_name_max(prefix: str, name: str, suffix: str, digest: str) -> str:
    """``prefix + name + suffix``, or, when that is longer than a file name may be (``NAME_MAX``, 255 bytes on
    every common filesystem), the name cut short and the path's digest in its place: a legal name near the limit
    (a 250-byte run dir) still gets its lock, and two such names never share one."""
    whole = f"{prefix}{name}{suffix}"
    if len(whole.encode()) <= NAME_MAX:
        return whole
    tail = suffix if digest in suffix else f"-{digest}{suffix}"
    room = NAME_MAX - len(prefix.encode()) - len(tail.encode())
    return f"{prefix}{name.encode()[:room].decode(errors='ignore')}{tail}"


def _may_create_in(directory: Path) -> bool:
    """Whether this user may create a file in ``directory``, or could make it (its nearest existing ancestor)."""
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return directory.is_dir() and os.access(directory, os.W_OK | os.X_OK)


@contextlib.contextmanager
def writer_lock(path: str | os.PathLike, what: str, wait: float = 0.0, advice: str | None = None) -> Iterator[Path]:
    """Hold the one-writer lock of ``path`` (a directory or a file, which need not exist yet) for the ``with`` block,
    or raise ``WriterLockedError`` naming the process that holds it. ``what`` names the output in messages (e.g.
    ``"hydra.run.dir"``). A lock this process already holds is held on (nested use: train, then evaluate).
    ``wait``: seconds to wait for the holder to finish first (saying so once), for a writer that would then reuse
    what the holder wrote; ``advice``: the fix the refusal ends with, in place of writing elsewhere."""
    lock = lock_file_for(path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    if lock in _held:
        yield lock
        return
    fd = _take(lock, path, what, wait, advice)
    if fd is not None:
        _held[lock] = fd
    try:
        yield lock
    finally:
        if fd is not None:
            del _held[lock]
            os.close(fd)  # closing the only descriptor drops the flock


def _take(lock: Path, path, what: str, wait: float = 0.0, advice: str | None = None) -> int | None:
    deadline, said = time.monotonic() + wait, False
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = read_holder(fd)
            os.close(fd)
        except OSError as e:
            return _unlockable(fd, e, path, what)
        named = f"{what} {path}" if " " in what else f"{what}={path}"  # a key, or words naming the file
        if time.monotonic() >= deadline:
            raise WriterLockedError(
                f"{named} is being written by another process ({holder}); " + (advice or (
                    f"two writers would interleave their files. Wait for it to finish (or stop it), or write to "
                    f"another {what}"))) from None
        if not said:
            log.warning("%s is being written by another process (%s); waiting up to %.0f s for it to finish",
                        named, holder, wait)
            said = True
        time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode(), 0)
    return fd


def _unlockable(fd: int, e: OSError, path, what: str) -> None:
    """A filesystem without file locks: a warning, and the write goes on unguarded (no descriptor is kept)."""
    os.close(fd)
    if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        raise e
    log.warning("%s=%s: this filesystem does not support file locks (%s); nothing stops a second job from "
                "writing the same output", what, path, e.strerror)
    return None


def read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"host {info['host']}, pid {info['pid']}, started {info['started']}"
    except (ValueError, KeyError, OSError):
        return "holder unknown"


_process_locks = contextlib.ExitStack()  # locks held until this process ends (closed with it)


def claim_run_dir(run_dir: Path, what: str = "hydra.run.dir") -> None:
    """Take the run dir's writer lock for the rest of the process, before Hydra writes ``.hydra/`` and its log there:
    a second job refused later would already have rewritten the first one's ``.hydra/config.yaml``. ``run_dir`` is
    the dir Hydra will use, resolved (``distill.environment.check_run_dir_override``)."""
    _process_locks.enter_context(writer_lock(run_dir, what))

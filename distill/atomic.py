"""Atomic writes: a reader (or a crash) never sees half a file or half a directory.

The one way this project writes anything another process may read (checkpoints, saved drafters, exports, teacher
caches, regenerated-data sidecars, the toy target, reports, benchmark results): write into a temporary sibling on
the same filesystem, then ``os.replace`` it into place. It lives in ``distill`` (whose caches it writes) because
every other writer (heads, train, eval, scripts) sits above it in the layer order and ``inference`` writes nothing.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def tmp_sibling(path: Path) -> Path:
    """The temporary name ``write_file_atomically`` uses for ``path``: hidden, per process, in the same directory
    (so the final rename never crosses filesystems). An interrupted write leaves ``.<name>.tmp-<pid>`` behind, which
    a writer that owns the directory may sweep (``distill.cache`` does)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_file_atomically(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` into a temporary sibling of ``path``, then rename it onto ``path``."""
    path = Path(path)
    tmp = tmp_sibling(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    return write_file_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_dir_atomically(path: str | os.PathLike, write: Callable[[Path], object], *,
                         replace: bool = True) -> Path:
    """Fill a temporary sibling directory with ``write(tmp)``, then swap it into place.

    A crash mid-write leaves the previous directory (or nothing) at ``path``, never a half-written one. The result
    gets the modes a plain mkdir / open would give (``usual_permissions``). ``replace=False``: an existing ``path``
    wins (two processes building the same cache entry: the first to finish is kept, the second's copy dropped).
    A ``path`` that is a symlink (``exports/latest -> v3``) is filled where it points, so the link stays and now names
    the new directory; returns ``path`` as given.
    """
    given = Path(path)
    path = given.resolve() if given.is_symlink() else given
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        write(tmp)
        usual_permissions(tmp)
        if not path.exists():
            try:
                os.replace(tmp, path)
            except OSError:
                if replace or not path.exists():
                    raise
                log.info("another process finished %s first; keeping theirs", path)
        elif replace:
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            log.info("another process finished %s first; keeping theirs", path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return given


def clear_unfinished(path: str | os.PathLike) -> None:
    """Remove what a killed ``write_dir_atomically(path)`` left beside ``path`` (its hidden ``.<name>.tmp-*`` copy
    being filled, or ``.<name>.old-*`` being swapped out). Only for a caller that is ``path``'s one writer (a run
    dir's lock holder): another process's save in progress has the same names."""
    path = Path(path)
    for left in path.parent.glob(f".{glob.escape(path.name)}.*-*"):
        kind = left.name[len(path.name) + 2:].partition("-")[0]
        if kind in ("tmp", "old") and left.is_dir() and not left.is_symlink():
            log.info("removing %s, left by an unfinished save of %s", left, path)
            shutil.rmtree(left, ignore_errors=True)


def usual_permissions(root: Path) -> None:
    """mkdtemp makes a private (0700) directory and safetensors writes 0600 files; what this project writes is meant
    to be read by other processes (a serving engine, another user of a shared cache), so give it the modes a plain
    mkdir / open would (umask applied)."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [root, *root.rglob("*")]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


# --------------------------------------------------------------------------- tensor files

# How the libraries report a failed write: torch's zip writer raises RuntimeError from its C++ stream ("unexpected
# pos", "file write failed"), safetensors a SafetensorError ("I/O error: ... (os error 28)"); neither is an OSError,
# so neither names the file nor reaches the one-line environment errors without this translation.
_TORCH_WRITE_FAILURES = ("inline_container", "PytorchStreamWriter", "file write failed", "unexpected pos")
_OS_ERROR = re.compile(r"os error (\d+)")


def save_tensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
                 metadata: Mapping[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, with a failed write (a full disk, a quota) raised as an ``OSError`` naming
    ``path`` and the space it needs."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(dict(tensors), str(path), metadata=dict(metadata) if metadata is not None else None)
    except SafetensorError as e:
        if "I/O error" not in str(e) and not _OS_ERROR.search(str(e)):
            raise
        raise write_failure(path, e, tensor_bytes(tensors)) from e


def save_torch(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)``, with a failed write raised as an ``OSError`` naming ``path`` and the space it
    needs (``save_tensors``)."""
    try:
        torch.save(obj, path)
    except RuntimeError as e:
        if not any(mark in str(e) for mark in _TORCH_WRITE_FAILURES):
            raise
        raise write_failure(path, e, tensor_bytes(obj)) from e


def tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in ``obj`` (nested dicts, lists and tuples): about what a file of them needs."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def write_failure(path: str | os.PathLike, error: Exception, needed: int) -> OSError:
    """An ``OSError`` for a library's failed write of ``path``: its errno when the library gave one, else "no space"
    when the filesystem has less free space than the file needs, else an I/O error."""
    found = _OS_ERROR.search(str(error))
    code = int(found.group(1)) if found else errno.ENOSPC if _free(path) < needed + (1 << 20) else errno.EIO
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    reason = os.strerror(code) if found or code == errno.ENOSPC else f"{os.strerror(code)}: {first_line}"
    return OSError(code, f"{reason}; {space_note(path, needed)}", str(path))


def space_note(path: str | os.PathLike, needed: int) -> str:
    """``the file needs about N MiB, M MiB free there``: what a failed write of ``path`` asks of its filesystem."""
    return f"the file needs about {needed / (1 << 20):.1f} MiB, {_free(path) / (1 << 20):.1f} MiB free there"


def _free(path: str | os.PathLike) -> int:
    parent = Path(path).parent
    existing = next((p for p in (parent, *parent.parents) if p.exists()), Path("/"))
    return shutil.disk_usage(existing).free

"""Atomic writes: a reader (or a crash) never sees half a file or half a directory.

The one way this project writes anything another process may read (checkpoints, saved drafters, exports, teacher
caches, regenerated-data sidecars, the toy target, reports, benchmark results): write into a temporary sibling on
the same filesystem, then ``os.replace`` it into place. It lives in ``distill`` (whose caches it writes) because
every other writer (heads, train, eval, scripts) sits above it in the layer order and ``inference`` writes nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

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
    """
    path = Path(path)
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
    return path


def usual_permissions(root: Path) -> None:
    """mkdtemp makes a private (0700) directory and safetensors writes 0600 files; what this project writes is meant
    to be read by other processes (a serving engine, another user of a shared cache), so give it the modes a plain
    mkdir / open would (umask applied)."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [root, *root.rglob("*")]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)

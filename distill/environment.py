"""Environment errors at the entry points: one line naming the file and the fix, never a raw traceback.

A full disk, a path that is a file where a directory belongs, a directory without write permission, an output another
job is writing: these are the user's environment, not a bug, and a traceback through torch or Hydra hides the one
thing to act on; so is a refusal of a setting, which names the key, the value and the fix. ``one_line_errors`` wraps
an entry point's task function: an ``OSError``, a ``WriterLockedError``, a ``ValueError`` (this project's refusals)
or a ``FloatingPointError`` (a diverged run) leaves as ``SystemExit`` with one line, exit status 1, and a Ctrl-C
outside the training steps as one line, exit status 130 (Hydra passes ``SystemExit`` through; its own error printing
handles only ``Exception``). ``check_run_dir_override`` catches the one such error Hydra meets before any of our code
runs: ``hydra.run.dir`` naming a file. ``SPECDRAFT_TRACEBACK=1`` keeps the traceback, for a bug report.

It lives in ``distill``, the lowest layer with entry points (``python -m distill.cache``, ``distill.regenerate``).
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from distill.lock import WriterLockedError, claim_run_dir

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NOT_A_DIR = (errno.ENOTDIR, errno.EEXIST)
_NO_PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)


def explain(e: OSError) -> str:
    """One line for an OS error: what happened to which file, and what to do."""
    where = e.filename if e.filename is not None else "?"
    if e.errno in _NO_SPACE:
        return (f"no space left writing {where} ({e.strerror}); free space (or raise the quota) on that filesystem, "
                f"then rerun the same command: a training run resumes from its last whole checkpoint, and the "
                f"unfinished one it leaves (checkpoints/.step_*.partial) is removed then")
    if e.errno in _NOT_A_DIR:
        return (f"{where} is in the way: a directory is needed there but a file holds the name ({e.strerror}); "
                f"move that file aside or choose another path")
    if e.errno in _NO_PERMISSION:
        return (f"cannot write {where} ({e.strerror}); choose a path this user may write (hydra.run.dir, "
                f"output_dir, cache.dir, regenerate.out, $SPECDRAFT_CACHE), or fix its permissions")
    if e.errno is None:  # raised by this project with its own message (which names the key and the fix)
        return str(e)
    return f"{e.strerror or e}: {where}"


def one_line_errors(task: Callable) -> Callable:
    """Wrap an entry point's task function (module docstring)."""

    @functools.wraps(task)
    def wrapped(*args, **kwargs):
        if os.environ.get("SPECDRAFT_TRACEBACK") == "1":
            return task(*args, **kwargs)
        try:
            return task(*args, **kwargs)
        except KeyboardInterrupt:  # Ctrl-C outside the training steps (which stop at a checkpoint, train.preemption)
            print("interrupted (Ctrl-C); rerun the same command to continue (a training run resumes from its last "
                  "checkpoint)", file=sys.stderr)
            raise SystemExit(128 + signal.SIGINT) from None
        except (WriterLockedError, ValueError, FloatingPointError) as e:  # this project's refusals: key, value, fix
            raise SystemExit(f"error: {e}") from None
        except OSError as e:
            raise SystemExit(f"error: {explain(e)}") from None

    return wrapped


def check_run_dir_override(argv: Sequence[str] | None = None) -> None:
    """Before Hydra starts: refuse ``hydra.run.dir=<path>`` whose path, or a parent of it, is a file (Hydra would fail
    creating it with a traceback before any of our code runs), then take the run dir's writer lock
    (``distill.lock.claim_run_dir``), refusing in one line a run dir another job is writing."""
    argv = sys.argv[1:] if argv is None else argv
    for token in argv:
        key, _, value = token.lstrip("+").partition("=")
        if key != "hydra.run.dir" or not value:
            continue
        path = Path(value).expanduser()
        for p in (path, *path.parents):
            if p.exists() and not p.is_dir():
                raise SystemExit(f"error: hydra.run.dir={value}: {p} is a file, not a directory; choose another "
                                 f"hydra.run.dir (or move that file aside)")
    try:
        claim_run_dir(argv)
    except WriterLockedError as e:
        raise SystemExit(f"error: {e}") from None

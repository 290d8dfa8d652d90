"""The running interpreter's standard-library source, as a training corpus.

The toy target (``distill.toy``) is pretrained on this text and the data
pipeline draws prompts from it, because it is the one sizeable body of real
code that every machine running this project already has: nothing has to be
downloaded, and it is the same text on every machine with the same Python.

A fixed set of top-level modules is held out of training so that evaluation
prompts are text the target has never been trained on.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import sysconfig
from collections.abc import Iterable

logger = logging.getLogger(__name__)

SPLITS = ("train", "heldout")

# Common, self-contained modules present in every Python from 3.10 to 3.13.
# A file belongs to a module by its first path component without ".py", so
# "json" covers json/*.py and "string" covers string.py (or a string/ package).
HELDOUT_MODULES: tuple[str, ...] = (
    "argparse",
    "bisect",
    "calendar",
    "csv",
    "dataclasses",
    "difflib",
    "fnmatch",
    "fractions",
    "glob",
    "graphlib",
    "heapq",
    "ipaddress",
    "json",
    "pprint",
    "shlex",
    "statistics",
    "string",
    "textwrap",
)

# Third-party packages are not stdlib; test suites are huge, repetitive and
# full of deliberately odd code; encodings/ is mostly generated codec tables.
_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
_EXCLUDED_TOP_LEVEL = frozenset({"encodings"})


STDLIB_ENV = "SPECDRAFT_STDLIB"


def stdlib_root() -> pathlib.Path:
    """Directory of the base interpreter's stdlib (also correct inside a venv), or ``$SPECDRAFT_STDLIB``: another
    Python's stdlib tree (e.g. a copy of the one a CPU benchmark used, so a GPU machine with another Python trains on
    the same text and finds the same cached toy target, whose key covers the corpus)."""
    override = os.environ.get(STDLIB_ENV)
    if override:
        root = pathlib.Path(override).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"${STDLIB_ENV}={override!r} is not a directory; point it at a Python stdlib "
                                    f"tree (e.g. /usr/lib/python3.11) or unset it to use this interpreter's")
        return root
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _module_of(relpath: pathlib.PurePath) -> str:
    first = relpath.parts[0]
    return first[: -len(".py")] if first.endswith(".py") else first


def _is_excluded(relpath: pathlib.PurePath) -> bool:
    if _module_of(relpath) in _EXCLUDED_TOP_LEVEL:
        return True
    return any(part in _EXCLUDED_DIRS for part in relpath.parts)


def _in_split(relpath: pathlib.PurePath, split: str) -> bool:
    heldout = _module_of(relpath) in HELDOUT_MODULES
    return heldout if split == "heldout" else not heldout


def _read_utf8(path: pathlib.Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as exc:
        # A few stdlib files are deliberately non-UTF-8 (encoding tests);
        # losing them costs nothing, so this is not worth a warning.
        logger.debug("skipping %s: %s", path, exc)
        return None


def _candidate_relpaths(root: pathlib.Path, split: str) -> list[pathlib.PurePosixPath]:
    relpaths = []
    for path in root.rglob("*.py"):
        if not path.is_file():
            continue
        # POSIX relpaths keep sorting and fingerprints identical across OSes.
        relpath = pathlib.PurePosixPath(path.relative_to(root).as_posix())
        if not _is_excluded(relpath) and _in_split(relpath, split):
            relpaths.append(relpath)
    return sorted(relpaths)


def stdlib_sources(split: str, max_bytes: int | None = None) -> list[tuple[str, str]]:
    """Sorted ``(relpath, text)`` pairs of the stdlib's ``.py`` files in ``split``.

    ``split`` is "train" (everything not in HELDOUT_MODULES) or "heldout".
    ``max_bytes`` keeps files in sorted order until their UTF-8 size reaches the
    budget (the file that crosses it is kept), so small smoke builds stay cheap
    while remaining deterministic.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not a corpus split; use one of {SPLITS}")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes={max_bytes!r} must be a positive int, or None for no limit")
    root = stdlib_root()
    sources: list[tuple[str, str]] = []
    total_bytes = 0
    for relpath in _candidate_relpaths(root, split):
        if max_bytes is not None and total_bytes >= max_bytes:
            break
        text = _read_utf8(root / relpath)
        if text is None:
            continue
        sources.append((str(relpath), text))
        total_bytes += len(text.encode("utf-8"))
    if not sources:
        raise RuntimeError(
            f"no readable .py files for split={split!r} under stdlib root {root}; "
            "check that this Python ships its stdlib as source (some minimal "
            "distributions ship only .pyc files)"
        )
    logger.debug("stdlib split=%s: %d files, %d bytes", split, len(sources), total_bytes)
    return sources


def corpus_fingerprint(sources: Iterable[tuple[str, str]]) -> str:
    """sha256 hex digest over relpaths and contents, in the given order."""
    digest = hashlib.sha256()
    for relpath, text in sources:
        data = text.encode("utf-8")
        # Length prefixes keep ("ab", "c") and ("a", "bc") from colliding.
        for chunk in (relpath.encode("utf-8"), data):
            digest.update(len(chunk).to_bytes(8, "little"))
            digest.update(chunk)
    return digest.hexdigest()

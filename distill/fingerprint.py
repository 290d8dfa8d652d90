"""Fingerprints: what a stored artefact (teacher cache, regenerated file, training rows, DeepSpeed shards) was made
from, as a sha256, and which of its recorded fields differ from now.

Lives in ``distill`` because the caches and sidecars that need it are distill's, and every layer that also needs it
(heads, train, eval, scripts) sits above; ``inference`` writes nothing. The toy target's cache key
(``distill.toy.cache.cache_key``) hashes its own fixed material and must not change, so it only shares ``text_digest``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_BLOCK = 1 << 20  # read files in 1 MiB blocks: shards and checkpoints can be gigabytes


def text_digest(text: str) -> str:
    """sha256 hex of ``text`` (UTF-8)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def json_digest(value: Any) -> str:
    """sha256 hex of ``value`` as JSON with sorted keys: equal for equal dicts, whatever their insertion order."""
    return text_digest(json.dumps(value, sort_keys=True))


def vocab_digest(tokenizer) -> str:
    """sha256 of the sorted vocabulary items: tells apart tokenizers that map ids to other tokens."""
    return text_digest(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False))


def update_with_file(h: "hashlib._Hash", path: Path) -> None:
    """Feed the bytes of ``path`` into the running hash ``h`` block by block (never the whole file in memory)."""
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)


def file_digest(path: str | Path) -> str:
    """sha256 hex of the file's bytes."""
    h = hashlib.sha256()
    update_with_file(h, Path(path))
    return h.hexdigest()


def tree_digests(root: Path) -> dict[str, str]:
    """``{posix relpath: sha256}`` of every file under ``root``, sorted by path."""
    return {p.relative_to(root).as_posix(): file_digest(p) for p in sorted(q for q in root.rglob("*") if q.is_file())}


@dataclass(frozen=True)
class Difference:
    """One recorded field that differs from now: ``name`` (top-level field), ``key`` (within a dict field, else
    None), the ``stored`` and the ``current`` value."""

    name: str
    key: str | None
    stored: Any
    current: Any


def differences(stored: Mapping, current: Mapping, names: Iterable[str]) -> list[Difference]:
    """The fields among ``names`` whose values differ, in ``names`` order; dict-valued fields are compared one level
    down (sorted keys), so a message can say ``data.max_length`` rather than dump both dicts."""
    out = []
    for name in names:
        a, b = stored.get(name), current.get(name)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += [Difference(name, k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        else:
            out.append(Difference(name, None, a, b))
    return out


def grouped(diffs: Sequence[Difference]) -> dict[str, list[Difference]]:
    """``differences`` by top-level field, first-seen order."""
    out: dict[str, list[Difference]] = {}
    for d in diffs:
        out.setdefault(d.name, []).append(d)
    return out


# --------------------------------------------------------------------------- digests beside tensor files

DIGEST_SUFFIX = ".sha256"
_unchecked_warned: list[bool] = []  # one warning per process for files written before digests were recorded


def digest_path(path: str | Path) -> Path:
    """``<file>.sha256``, beside the file: ``sha256sum -c`` reads it too."""
    path = Path(path)
    return path.with_name(path.name + DIGEST_SUFFIX)


def write_digest(path: str | Path) -> Path:
    """Record the sha256 of ``path`` (streamed) beside it, in ``sha256sum``'s format."""
    path = Path(path)
    out = digest_path(path)
    out.write_text(f"{file_digest(path)}  {path.name}\n", encoding="utf-8")
    return out


_HEX = re.compile(r"[0-9a-f]{64}")


def recorded_digest(recorded: Path) -> str:
    """The sha256 a ``<file>.sha256`` holds, read as ``sha256sum -c`` reads it (either case, an optional ``*``
    before the name); a sidecar that holds none (empty, cut short, overwritten) is refused as such: the tensor file
    beside it may be sound, but nothing can tell."""
    text = recorded.read_text(encoding="utf-8", errors="replace")
    digest = (text.split() or [""])[0].lower()
    if not _HEX.fullmatch(digest):
        what = "is empty" if not text.strip() else f"holds no sha256 digest ({text.strip()[:24]!r}...)"
        raise ValueError(f"{recorded} {what}: the digest sidecar is damaged, so {recorded.name[:-len(DIGEST_SUFFIX)]} "
                         f"cannot be checked; copy the directory again, or, if you trust that file, write its digest "
                         f"anew (`sha256sum {recorded.name[:-len(DIGEST_SUFFIX)]} > {recorded.name}` in its directory)")
    return digest


def check_digest(path: str | Path) -> None:
    """Refuse ``path`` when its bytes no longer match the digest written with it (a bit flip, a copy cut short that
    still parses); a file without a digest (written before digests were recorded) is loaded unchecked, with one
    warning per process."""
    path = Path(path)
    recorded = digest_path(path)
    if not recorded.is_file():
        if not _unchecked_warned:
            _unchecked_warned.append(True)
            log.warning(
                "%s has no %s beside it (written before digests were recorded): loaded without an integrity check; "
                "files saved from now on are checked", path, recorded.name)
        return
    expected = recorded_digest(recorded)
    actual = file_digest(path)
    if actual != expected:
        raise ValueError(f"{path} is damaged: its sha256 {actual[:16]}... differs from the one written with it "
                         f"({recorded.name}: {expected[:16] or 'empty'}...); copy it again, or use another checkpoint")

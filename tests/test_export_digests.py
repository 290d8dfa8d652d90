"""Exports are byte-stable: every file of every (kind, engine) export of the deterministic tiny drafters in
``tests/drafters.py`` hashes to the digests recorded in ``tests/data/export_digests.json``.

The digests were recorded from the export code before it moved into ``serve/``; a change to any exported byte
(a tensor name, a config key, a card line) fails here. Paths of the temporary directories are replaced by
``<tmp>`` before hashing. To record new digests after an intended change to an export layout:
``PYTHONPATH=. python tests/test_export_digests.py`` (and say why in the commit).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import drafters  # noqa: E402
from tests.drafters import EXPORTS  # noqa: E402
from serve.adapter import SIDECAR  # noqa: E402

DIGESTS = Path(__file__).resolve().parent / "data" / "export_digests.json"


def _digest(path: Path, root: Path) -> str:
    data = path.read_bytes()
    if path.name == SIDECAR:  # it holds the model card's sha256, which covers the card's temporary paths
        sidecar = json.loads(data)
        sidecar["written_sha256"] = {name: "<sha256>" for name in sidecar.get("written_sha256", {})}
        data = json.dumps(sidecar, indent=2).encode()
    for spelling in {str(root.resolve()), str(root)}:
        data = data.replace(spelling.encode(), b"<tmp>")
    return hashlib.sha256(data).hexdigest()


def _export(root: Path, kind: str) -> dict[str, dict[str, str]]:
    """{engine: {file: sha256}} of ``kind`` exported to each of its engines under ``root``."""
    export_drafter = _export_function()
    teacher = drafters.deep_teacher(root / "target")
    path = drafters.save(drafters.build(kind, teacher), root / kind, kind, teacher)
    out = {}
    for engine in EXPORTS[kind]:
        target = export_drafter(path, engine, root / "exports" / f"{kind}-{engine}")
        out[engine] = {str(f.relative_to(target)): _digest(f, root) for f in sorted(target.rglob("*")) if f.is_file()}
    return out


def _export_function():
    from serve.export import export_drafter

    return export_drafter


@pytest.mark.parametrize("kind", sorted(EXPORTS))
def test_export_bytes_unchanged(tmp_path, kind):
    want = json.loads(DIGESTS.read_text())[kind]
    got = _export(tmp_path, kind)
    assert got == want


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        digests = {kind: _export(Path(tmp) / kind, kind) for kind in sorted(EXPORTS)}
    DIGESTS.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    print(f"wrote {DIGESTS}")

"""The docs' links and the repository paths they name point at something: a moved file or a renamed heading fails."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "scripts" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages written by other changes that this branch links to; checked like any other once they exist.
PENDING = {"docs/reliability.md", "docs/gpu-decoding.md"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# `heads/eagle/model.py`, `distill/cache/`: a file with a suffix or a directory (`train/loss` is a metric key, not a path)
CODE_PATH = re.compile(r"`((?:conf|heads|inference|distill|train|eval|scripts|tests|docs)/[\w./-]*(?:\.\w+|/))`")


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", _prose(path.read_text()), re.M)}


def _links(doc: Path):
    for target in LINK.findall(_prose(doc.read_text())):
        if not re.match(r"[a-z]+:", target):
            yield target


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(doc):
    broken = []
    for target in _links(doc):
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        if not path.exists():
            if name not in PENDING:
                broken.append(f"{target}: no such file")
            continue
        if anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {name}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_repository_paths_exist(doc):
    missing = [p for p in CODE_PATH.findall(doc.read_text())
               if not (ROOT / p.rstrip("/")).exists() and p not in PENDING and "<" not in p and "*" not in p]
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_the_checks_can_fail(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("# A heading\n\n[ok](#a-heading) [bad](#no-such) [gone](missing.md)\n")
    assert slug("Training memory at a 128k vocabulary (one H100)") == "training-memory-at-a-128k-vocabulary-one-h100"
    assert anchors(doc) == {"a-heading"}
    assert list(_links(doc)) == ["#a-heading", "#no-such", "missing.md"]
    assert CODE_PATH.findall("`heads/eagle/model.py` `distill/cache/` `train/loss`") == ["heads/eagle/model.py", "distill/cache/"]


def test_family_table_lists_the_tested_families_and_existing_presets():
    """docs/families.md's table names exactly the families CI runs, each with presets that exist in conf/."""
    from distill.teacher import TESTED_FAMILIES

    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| `(\w+)` · `(\w+)` \|", (ROOT / "docs" / "families.md").read_text(), re.M)
    assert sorted(family for family, _, _ in rows) == sorted(TESTED_FAMILIES)
    for family, target, experiment in rows:
        assert (ROOT / "conf" / "target" / f"{target}.yaml").is_file(), (family, target)
        assert (ROOT / "conf" / "experiment" / f"{experiment}.yaml").is_file(), (family, experiment)

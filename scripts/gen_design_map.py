"""The file map in docs/design.md ("Where things are"), written from the tree so it cannot go stale.

Every package's modules, a line per folder: ``python scripts/gen_design_map.py`` rewrites the block between its
markers; ``--check`` exits 1 when the page differs from the tree (tests/test_design_map.py runs the same check).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "design.md"
PACKAGES = ("train", "heads", "serve", "distill", "inference", "eval")
BEGIN = "<!-- file map: written by scripts/gen_design_map.py from the tree -->"
END = "<!-- end of the file map -->"
WIDTH = 118


def _wrap(head: str, names: list[str]) -> list[str]:
    lines, line = [], head
    for name in names:
        if len(line) + 1 + len(name) > WIDTH and line.strip():
            lines.append(line.rstrip())
            line = " " * len(head)
        line += ("" if line.endswith(" ") else " ") + name
    lines.append(line.rstrip())
    return lines


def folders(package: str) -> list[tuple[str, list[str]]]:
    """(folder, its modules) for a package and every folder under it that holds Python modules, depth first."""
    out = []

    def visit(folder: Path) -> None:
        modules = sorted(p.name for p in folder.glob("*.py") if p.name != "__init__.py")
        if modules or (folder / "__init__.py").exists():
            out.append((folder.relative_to(ROOT).as_posix() + "/", modules))
        for sub in sorted(p for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
            visit(sub)

    visit(ROOT / package)
    return out


def render() -> str:
    rows = []
    for package in PACKAGES:
        for folder, modules in folders(package):
            rows += _wrap(f"{folder:<22}", modules or ["(package)"])
    return "\n".join([BEGIN, "```text", *rows, "```", END])


def updated(page: str) -> str:
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{PAGE} has no file-map markers ({BEGIN!r} ... {END!r})")
    head, rest = page.split(BEGIN, 1)
    return head + render() + rest.split(END, 1)[1]


def main(argv: list[str]) -> int:
    page = PAGE.read_text(encoding="utf-8")
    new = updated(page)
    if "--check" in argv:
        if new != page:
            print(f"{PAGE.relative_to(ROOT)}'s file map differs from the tree: run python scripts/gen_design_map.py")
            return 1
        return 0
    PAGE.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

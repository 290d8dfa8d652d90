"""Code, configs, docs and test names speak to users: no issue numbers, commit hashes or machine paths in the tree.

The development record belongs in git history. Benchmark JSON in scripts/results/ is exempt: it records where and on
which code a figure was measured.
"""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATTERNS = {
    "an issue number": re.compile(r"\bissues? #?\d+\b", re.I),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)(?:[0-9a-f]{7,12}|[0-9a-f]{40})\b"),
    "a machine path": re.compile(r"(?:/wor[k]/|/home/\w|/Users/\w|/tmp/(?:h\d|base\d|after\d))"),
}
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".sbatch", ".txt", ".cfg", ".ini", ""}


def tree_files() -> list[Path]:
    """Tracked and new (not ignored) files, benchmark JSON excluded."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    return [ROOT / name for name in listed
            if not name.startswith("scripts/results/") and Path(name).suffix in SUFFIXES and (ROOT / name).is_file()]


def hits(text: str) -> list[str]:
    return [f"{what}: {m.group(0)!r}" for what, pattern in PATTERNS.items() for m in pattern.finditer(text)]


def test_no_issue_numbers_hashes_or_machine_paths():
    found = []
    for path in tree_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{number}: {hit}" for hit in hits(line)]
    assert not found, "say what the code does and why; the history belongs in git:\n" + "\n".join(found)


def test_the_patterns_catch_what_they_should_and_pass_the_rest():
    for bad in ("see iss" "ue 21", "(Iss" "ue #7)", "the base commit 806e" "297", "measured at daf8" "f92",
                "/wo" "rk/shared/data", "/tm" "p/h21/regen.jsonl"):
        assert hits(bad), bad
    for good in ("sha256 62430a6665991ee9", "lr 1e-4 at 20000 steps", "deadbeef", "issues of the loss",
                 "/tmp/smoke", "scripts/results/bench_decode_gpu.json", "layer 12345678"):
        assert not hits(good), good

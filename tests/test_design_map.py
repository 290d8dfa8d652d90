"""docs/design.md's file map is the tree's: every package folder and module, written by scripts/gen_design_map.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_design_map", ROOT / "scripts" / "gen_design_map.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules["gen_design_map"] = gen
    spec.loader.exec_module(gen)
    return gen


def test_the_design_pages_file_map_is_the_tree():
    gen = _generator()
    page = gen.PAGE.read_text(encoding="utf-8")
    assert gen.updated(page) == page, "docs/design.md's file map differs from the tree: run python scripts/gen_design_map.py"


def test_the_map_names_every_module_and_a_new_one_would_show(tmp_path, monkeypatch):
    gen = _generator()
    rendered = gen.render()
    for package in gen.PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name != "__init__.py" and "__pycache__" not in path.parts:
                folder = path.parent.relative_to(ROOT).as_posix() + "/"
                line = next(i for i, l in enumerate(rendered.splitlines()) if l.startswith(folder + " "))
                block = "\n".join(rendered.splitlines()[line:line + 4])
                assert path.name in block, (folder, path.name)
    # a drafter folder added to a copy of heads/ appears in the map rendered from that copy
    fake = tmp_path / "heads" / "newkind"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "model.py").write_text("")
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    monkeypatch.setattr(gen, "PACKAGES", ("heads",))
    assert "heads/newkind/" in gen.render() and "model.py" in gen.render()


def test_every_drafter_kind_is_a_folder_and_no_module_of_heads_or_inference_is_over_500_lines():
    kinds = [p for p in (ROOT / "heads").iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert {p.name for p in kinds} >= {"eagle", "medusa", "draft_model", "dflash", "dspark", "peagle"}
    assert all((p / "model.py").exists() for p in kinds)
    flat = {p.stem for p in (ROOT / "heads").glob("*.py")}
    assert not flat & {"eagle", "medusa", "medusa2", "draft_model", "dflash", "dspark", "peagle"}
    long = {str(p.relative_to(ROOT)): n for package in ("heads", "inference") for p in (ROOT / package).rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500}
    assert not long, long


def test_one_decoder_decodes_every_batch_size():
    """Batch 1 is the decoder's one-row bucket: no second decoder, step module or cache of its own; a batch drafts
    through each kind's one static draft step, so no kind keeps eager batch rows (``rows.py``) or their ragged cache."""
    inference = {p.stem for p in (ROOT / "inference").glob("*.py")}
    assert not inference & {"step_decoder", "steps", "static_cache", "kv_cache"}
    assert not sorted(str(p.relative_to(ROOT)) for p in (ROOT / "heads").rglob("*rows.py"))
    code = "\n".join(p.read_text(encoding="utf-8") for package in ("inference", "heads", "eval")
                     for p in (ROOT / package).rglob("*.py"))
    for name in ("StepDecoder", "RaggedCache", "StaticKV", "EagleRows", "DFlashRows", "DraftModelRows"):
        assert name not in code, name

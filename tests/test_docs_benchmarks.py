"""docs/benchmarks.md is generated from scripts/results/*.json: the page must be what the generator writes now."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gen_benchmarks.py"


def _load():
    spec = importlib.util.spec_from_file_location("gen_benchmarks", SCRIPT)
    gen = importlib.util.module_from_spec(spec)
    sys.modules["gen_benchmarks"] = gen  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(gen)
    return gen


def test_benchmarks_page_is_current():
    """Fails when a JSON figure changed (or a JSON was added) without `python scripts/gen_benchmarks.py`."""
    gen = _load()
    assert gen.PAGE.read_text() == gen.render_page(), "docs/benchmarks.md is stale: python scripts/gen_benchmarks.py"
    readme = gen.README.read_text()
    assert gen.HEADLINE_BEGIN in readme, "the README's results table is generated: keep its markers"
    assert readme == gen.readme_with_headline(readme), "README.md's results table is stale: python scripts/gen_benchmarks.py"


def test_a_changed_json_figure_makes_the_page_stale(tmp_path):
    """The check above can fail: one τ changed in one JSON gives another page, with the new figure in it."""
    gen = _load()
    results = tmp_path / "results"
    shutil.copytree(gen.RESULTS, results)
    path = results / gen.HEADLINE[0][0]  # the README's first rows
    data = json.loads(path.read_text())
    data["runs"]["greedy"]["summary"]["eagle1"]["tau"] = 9.87
    row = next(r for r in data["runs"]["greedy"]["report"]["results"] if r["drafter"] == "eagle1")
    row["tau"] = 9.87  # the README's row for eagle1
    path.write_text(json.dumps(data))
    page = gen.render_page(results)
    assert page != gen.PAGE.read_text()
    assert "| eagle1 | 9.87 |" in page
    readme = gen.README.read_text()
    assert "| eagle1 | 9.87 |" in gen.readme_with_headline(readme, results) != readme


def test_every_rendered_table_names_its_command_machine_and_json():
    gen = _load()
    page = gen.render_page()
    for name, src in gen.SOURCES.items():
        if src.render and (gen.RESULTS / name).is_file():
            section = page.split(f"## {src.title}\n", 1)[1].split("\n## ", 1)[0]
            assert f"JSON: `scripts/results/{name}`" in section
            assert "Command: `python scripts/" in section and "Machine: " in section
            assert "Machine: not recorded" not in section

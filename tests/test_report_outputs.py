"""Tests for the report outputs (eval.plots, eval.markdown) and categorised eval prompts (distill.prompts).

All offline and CPU-only: the report is a small hand-written dict shaped like
``eval.run.evaluate``'s, and the tokenizer is a byte-level BPE without merges
(``distill.toy.train_tokenizer``), built in milliseconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from distill import prompts
from distill.toy import train_tokenizer
from eval.markdown import summary_markdown
from eval.plots import ACCEPTANCE_PNG, HISTOGRAM_PNG, SPEEDUP_PNG, speedup_entries, write_plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# The public prompt sets beside the checkout (../shared/data: spec_bench/, mt_bench/), or SPECDRAFT_PROMPT_DATA.
SHARED_DATA = Path(os.environ.get("SPECDRAFT_PROMPT_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def _report() -> dict:
    medusa = {
        "drafter": "medusa", "label": "Medusa-4", "lossless": True, "tau": 2.31, "alpha": 0.62,
        "alpha_per_position": [0.8, 0.55, None], "accept_counts": [10, 20, 15, 5], "tokens_per_s": 120.5,
        "speedup": 1.8, "identical_to_greedy": True, "identical_prompts": 4,
        "cost": {"predicted_speedup": 1.95, "overhead_ratio": 0.12},
        "categories": {
            "writing": {"num_prompts": 2, "tau": 2.1, "alpha": 0.58, "tokens_per_s": 110.0, "speedup": 1.6},
            "coding": {"num_prompts": 2, "tau": 2.6, "alpha": None, "tokens_per_s": 131.0, "speedup": 2.0},
        },
    }
    typical = {
        "drafter": "typical", "lossless": False, "tau": 2.9, "alpha": 0.7, "alpha_per_position": [0.9, 0.6, 0.4],
        "accept_counts": [5, 10, 20, 15], "tokens_per_s": 150.0, "speedup": 2.2, "identical_to_greedy": False,
        "identical_prompts": 1,
    }
    return {
        "target": {"name": "tiny-llama"}, "num_prompts": 4, "max_new_tokens": 32,
        "greedy": {"new_tokens": 128, "seconds": 1.9, "tokens_per_s": 67.0},
        "results": [medusa, typical],
        "baselines": {
            "hf_generate": {"tokens_per_s": 60.0, "speedup": 0.9},
            "hf_assisted": {"tokens_per_s": 80.0, "note": "no | speedup measured"},
        },
        "definitions": {"tau": "tokens per verification forward", "alpha": "accepted / judged draft tokens"},
        "plots": [ACCEPTANCE_PNG, HISTOGRAM_PNG, SPEEDUP_PNG],
    }


def _assert_pngs(paths: list[Path], out_dir: Path) -> None:
    assert [p.name for p in paths] == [ACCEPTANCE_PNG, HISTOGRAM_PNG, SPEEDUP_PNG]
    for path in paths:
        assert path.parent == out_dir and path.is_file()
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE), path
        assert len(data) > 2000, f"{path} is only {len(data)} bytes: an empty figure?"


# --------------------------------------------------------------------------- plots


def test_write_plots_writes_three_pngs(tmp_path):
    out = tmp_path / "run" / "plots"  # missing: write_plots creates it
    _assert_pngs(write_plots(_report(), out), out)


def test_write_plots_single_result_without_alphas_or_baselines(tmp_path):
    report = _report()
    del report["baselines"]
    report["results"] = [{**report["results"][0], "alpha_per_position": [], "accept_counts": []}]
    _assert_pngs(write_plots(report, tmp_path), tmp_path)


def test_speedup_entries_mark_lossy_and_skip_baselines_without_speedup():
    assert speedup_entries(_report()) == [
        ("Medusa-4", 1.8, False), ("typical (lossy)", 2.2, False), ("hf_generate", 0.9, True),
    ]


# --------------------------------------------------------------------------- markdown


def test_summary_markdown_tables():
    text = summary_markdown(_report())
    assert text.startswith("# Evaluation: tiny-llama\n")
    assert "4 prompts, up to 32 new tokens, sampling: greedy; plain decoding 67.0 tokens/s" in text
    assert (
        "| drafter | lossless | τ | α | α per position | tokens/s | speedup | identical to plain "
        "| predicted speedup | overhead ratio |"
    ) in text
    assert "| Medusa-4 | yes | 2.31 | 0.62 | 0.80 0.55 – | 120.5 | 1.80× | yes | 1.95× | 0.12 |" in text
    assert "| typical | no (lossy) | 2.90 | 0.70 | 0.90 0.60 0.40 | 150.0 | 2.20× | no (1/4) | – | – |" in text


def test_summary_markdown_baselines_categories_definitions_plots():
    text = summary_markdown(_report())
    assert "| hf_generate | 60.0 | 0.90× |  |" in text
    assert "| hf_assisted | 80.0 | – | no \\| speedup measured |" in text  # a "|" in a note is escaped
    assert "## Per category: Medusa-4" in text
    assert "| category | prompts | τ | α | tokens/s | speedup |" in text
    assert "| coding | 2 | 2.60 | – | 131.0 | 2.00× |" in text
    assert "Per category: typical" not in text  # no categories, no table
    assert "- **tau**: tokens per verification forward" in text
    assert f"- [{SPEEDUP_PNG}]({SPEEDUP_PNG})" in text


def test_summary_markdown_sampling_and_optional_sections():
    report = _report()
    report["sampling"] = {"temperature": 0.7, "top_p": 0.9, "top_k": None}
    for key in ("baselines", "plots", "definitions"):
        del report[key]
    text = summary_markdown(report)
    assert "sampling: temperature=0.7, top_p=0.9;" in text
    assert "## Baselines" not in text and "## Plots" not in text and "## Definitions" not in text


# --------------------------------------------------------------------------- prompts with categories


@pytest.fixture(scope="module")
def byte_tokenizer():
    # 256 bytes + 2 specials: no merges, so any text round-trips and no corpus is needed.
    return train_tokenizer(["abc"], vocab_size=258, max_seq_len=4096)


def _write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def test_prompt_records_pair_prompts_with_categories(tmp_path, byte_tokenizer):
    path = _write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 1, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
        {"question_id": 2, "turns": ["Add two numbers."]},
        {"prompt": "def add(a, b):", "category": "coding"},
    ])
    records = prompts.prompt_records_from_file(path, byte_tokenizer, num_prompts=None)
    assert [category for _, category in records] == ["writing", None, "coding"]
    assert [ids for ids, _ in records] == prompts.prompts_from_file(path, byte_tokenizer, num_prompts=None)
    assert byte_tokenizer.decode(records[2][0]) == "def add(a, b):"
    assert len(prompts.prompt_records_from_file(path, byte_tokenizer, num_prompts=2)) == 2


def test_prompt_record_category_must_be_a_string(tmp_path, byte_tokenizer):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"turns": ["Hi."], "category": 3}])
    with pytest.raises(ValueError, match=r"record 0 'category' must be a string, got 3"):
        prompts.prompt_records_from_file(path, byte_tokenizer, num_prompts=1)


@pytest.mark.parametrize("name, count, num_categories", [("spec_bench", 480, 13), ("mt_bench", 80, 8)])
def test_prompt_records_of_shared_question_files(byte_tokenizer, name, count, num_categories):
    path = SHARED_DATA / name / "question.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is absent: the shared benchmark data is not mounted on this machine")
    records = prompts.prompt_records_from_file(str(path), byte_tokenizer, num_prompts=None)
    assert len(records) == count
    assert all(ids for ids, _ in records)
    assert len({category for _, category in records}) == num_categories
    assert all(isinstance(category, str) for _, category in records)


@pytest.mark.parametrize("steps,expected", [
    (1, "eagle1: training-time top-1 accuracy of draft step 1: 0.70 (trained on one draft step, so no training-time "
        "tau estimate; measured tau 3.71)"),
    (4, "eagle1: training-time sim tau 1.70 (chain estimate over 4 steps) vs measured tau 3.71"),
])
def test_summary_labels_a_one_step_training_estimate(steps, expected):
    """A drafter trained on one draft step (EAGLE-1) has no multi-step training-time τ: its line says what the figure
    is instead of setting 1 + acc_1 against the measured τ as if they could agree."""
    from eval.report import summary_table

    report = _report()
    report["results"] = [{**report["results"][0], "drafter": "eagle1", "tau": 3.71, "sim_tau": 1.70,
                          "sim_tau_steps": steps}]
    lines = summary_table(report).splitlines()
    assert expected in lines
    assert not any("sim tau" in line for line in lines) or steps > 1

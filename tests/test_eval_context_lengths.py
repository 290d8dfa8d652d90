"""τ and speedup per context length (``eval.context_lengths``): the prompts of every bucket cut from the same held-out
passages, the per-length block in report.json, the summary, the markdown and the plot, and the settings refused with
the key, the value and the fix. A tiny random Llama with a byte-level tokenizer: no toy target to build."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from distill.prompts import context_length_prompts, context_prompt_tokens
from distill.teacher import Teacher
from distill.toy import train_tokenizer
from eval.plots import CONTEXT_PNG
from eval.report import write_report
from heads.base import build_drafter
from inference.decoder import DecoderConfig
from tests.conftest import make_tiny_llama
from tests.drafters import noisy_medusa
from tests.test_config import load
from train.config import EvalConfig, load_config

EVAL = EvalConfig(num_prompts=2, prompt_tokens=24, max_new_tokens=8, num_draft=3, warmup_prompts=1,
                  drafter_dtype="float32", hf_baselines=False, plots=True, context_lengths=[24, 48, 96])


@pytest.fixture
def byte_teacher():
    # 256 bytes + 2 specials: any text tokenises, no corpus needed; 128 positions
    tokenizer = train_tokenizer(["abc"], vocab_size=258, max_seq_len=4096)
    model = make_tiny_llama(vocab_size=258, max_position_embeddings=128, initializer_range=0.2)
    return Teacher(model, tokenizer=tokenizer, name="tiny-llama-bytes")


def test_every_bucket_continues_the_same_passages_from_the_same_point(byte_teacher):
    sizes = context_prompt_tokens([96, 32, 64], max_new_tokens=12, lookahead=4)
    assert sizes == {32: 16, 64: 48, 96: 80}  # sorted; length - new tokens - draft lookahead
    by_length = context_length_prompts(byte_teacher.tokenizer, 3, sizes)
    longest = by_length[96]
    for length, prompts in by_length.items():
        assert [len(p) for p in prompts] == [sizes[length]] * 3
        assert all(p == whole[-len(p):] for p, whole in zip(prompts, longest))  # the passage's last tokens
    assert len({tuple(p) for p in longest}) == 3  # distinct passages


@pytest.mark.parametrize("lengths,max_positions,message", [
    ([64, 64], 0, "distinct positive integers"),
    ([0, 64], 0, "distinct positive integers"),
    ([64, 512], 256, "has 512, longer than the target's 256 positions"),
    ([16, 64], 256, "has 16: its prompts would hold 16 - eval.max_new_tokens=12 - 4 draft tokens = 0 tokens.*at "
                    "least 17"),
])
def test_bad_context_lengths_name_the_value_and_the_fix(lengths, max_positions, message):
    with pytest.raises(ValueError, match=message):
        context_prompt_tokens(lengths, max_new_tokens=12, lookahead=4, max_positions=max_positions)


@pytest.mark.parametrize("overrides,message", [
    (["eval.context_lengths=[64,512]"], "eval.context_lengths has 512, longer than the target's 256 positions"),
    (["eval.context_lengths=[64]"], "eval.context_lengths has 64: .*eval.max_new_tokens=96"),
    (["eval.context_lengths=[200]", "eval.prompts=q.jsonl"], "set eval.prompts=null"),
])
def test_the_config_refuses_context_lengths_up_front(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(load(overrides))


def test_context_lengths_are_off_by_default():
    assert load_config(load()).eval.context_lengths is None
    assert load_config(load(["eval.context_lengths=[128,256]", "eval.max_new_tokens=32"])).eval.context_lengths == [
        128, 256]


def test_report_has_tau_and_speedup_per_context_length(byte_teacher, tmp_path):
    from eval.run import evaluate

    drafters = {"medusa": noisy_medusa(byte_teacher, scale=0.2),
                "lookup": build_drafter({"_target_": "heads.lookup.PromptLookup"}, byte_teacher)}
    report = evaluate(byte_teacher, drafters, [[1, 2, 3, 4]], EVAL, DecoderConfig())
    setup = report["context_lengths"]
    assert setup["lengths"] == [24, 48, 96] and setup["prompt_tokens"] == {"24": 13, "48": 37, "96": 85}
    assert set(setup["plain_tokens_per_s"]) == {"24", "48", "96"}
    for result in report["results"]:
        block = result["context_lengths"]
        assert list(block) == ["24", "48", "96"]
        for length, row in block.items():
            assert row["identical_to_greedy"] and row["num_prompts"] == 2 and row["tau"] >= 1.0 and row["speedup"] > 0
            # decoding ran between the prompt's end and the bucket's length
            assert row["prompt_tokens"] <= row["mean_context"] <= int(length)
        assert result["tau"] >= 1.0 and result["num_prompts"] == 1  # the main measurement as before
    write_report(report, tmp_path)
    assert CONTEXT_PNG in report["plots"] and (tmp_path / CONTEXT_PNG).stat().st_size > 0
    markdown = (tmp_path / "summary.md").read_text()
    assert "## By context length" in markdown and "| medusa | 96 | 85 |" in markdown
    assert "medusa: tau (speedup) by context length: 24: " in (tmp_path / "summary.txt").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["results"][0]["context_lengths"]["48"]["tau"] >= 1.0


def test_a_length_beyond_the_target_fails_before_decoding(byte_teacher):
    from eval.run import evaluate

    lookup = build_drafter({"_target_": "heads.lookup.PromptLookup"}, byte_teacher)
    with pytest.raises(ValueError, match="eval.context_lengths has 256, longer than the target's 128 positions"):
        evaluate(byte_teacher, {"lookup": lookup}, [[1, 2, 3]], replace(EVAL, context_lengths=[64, 256]))

"""The evaluation around the decoder: cost model and auto-tuning, report fields (baselines, categories, cost), and
clear errors for bad decoding input."""

from dataclasses import replace

import pytest
import torch

from heads.base import build_drafter
from heads.draft_model.model import DraftModel
from inference.cost import auto_tune, chain_tau, overhead_ratio, predict, tree_tau
from inference.decoder import Decoder, DecoderConfig
from tests.test_config import load
from tests.drafters import noisy_medusa
from tests.drafters import DIMS, truncated
from train.config import EvalConfig, load_config

EVAL = EvalConfig(max_new_tokens=16, num_draft=3, warmup_prompts=1, drafter_dtype="float32", hf_baselines=True)


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (4 + i % 9,), generator=g).tolist() for i in range(n)]


def test_cost_model_formulas():
    assert chain_tau([0.5, 0.5, None], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert chain_tau([0.5, None], 2) == pytest.approx(1.5)  # an unreached position contributes nothing
    assert tree_tau([0.6, 0.3, 0.2], 2) == pytest.approx(1.9)
    assert predict(tau=2.0, t_plain=1.0, t_draft=0.25, t_verify=1.25) == pytest.approx(4 / 3)
    # 10 forwards of 4 nodes at (0.1 + 0.3) s, plus 1 s of prefill: 5 s of isolated work.
    assert overhead_ratio(6.0, 1.0, {4: 10}, {4: 0.3}, 0.1) == pytest.approx(1.2)


def test_auto_tune_picks_the_best_prediction_and_applies_it(tiny_teacher):
    drafter = noisy_medusa(tiny_teacher, scale=0.2)
    drafter.set_tree("small")
    dec = Decoder(tiny_teacher)
    calib = [torch.tensor([p]) for p in prompts(3)]
    result = auto_tune(dec, drafter, calib, 16, 3, repeats=3)
    sizes = [c["size"] for c in result["candidates"]]
    assert sizes == list(range(1, len(sizes) + 1)) and len(sizes) == 6  # "small" has 6 nodes within depth 3
    best = max(result["candidates"], key=lambda c: c["predicted_speedup"])
    assert result["chosen"]["predicted_speedup"] == best["predicted_speedup"]
    assert len(drafter.tree.paths) == result["chosen"]["size"]
    taus = [c["predicted_tau"] for c in result["candidates"]]
    assert taus == sorted(taus) and taus[0] >= 1.0  # more nodes can only add expected accepted tokens


def test_evaluate_reports_baselines_cost_and_categories(teacher):
    from eval.run import evaluate

    medusa = noisy_medusa(teacher, scale=0.2)
    medusa.set_tree("small")
    draft = DraftModel(DIMS, model=truncated(teacher.model))
    draft.bind_target(teacher, initialize=False)
    cats = ["code", "math"] * 3
    report = evaluate(teacher, {"medusa": medusa, "draft_model": draft}, prompts(6), EVAL, DecoderConfig(), cats)
    by_name = {r["drafter"]: r for r in report["results"]}
    for r in by_name.values():
        assert r["identical_to_greedy"] and r["lossless"] and r["tau"] >= 1.0
        assert set(r["categories"]) == {"code", "math"} and sum(c["num_prompts"] for c in r["categories"].values()) == 6
        cost = r["cost"]
        assert cost["overhead_ratio"] > 0.5 and cost["predicted_speedup"] > 0 and cost["t_plain_s"] > 0
    assert by_name["medusa"]["tree_size"] == 6  # the "small" preset within 3 heads
    base = report["baselines"]
    assert base["hf_generate"]["identical_to_greedy"] and base["hf_assisted[draft_model]"]["identical_to_greedy"]
    assert base["hf_assisted[draft_model]"]["ours_over_hf"] > 0
    assert report["lossless"] and report["sampling"]["mode"] == "greedy"


def test_typical_acceptance_is_labelled_lossy(tiny_teacher):
    from eval.run import evaluate

    lookup = build_drafter({"_target_": "heads.lookup.PromptLookup"}, tiny_teacher)
    report = evaluate(tiny_teacher, {"lookup": lookup}, prompts(2), replace(EVAL, hf_baselines=False),
                      DecoderConfig(temperature=1.0, acceptance="typical"))
    row = report["results"][0]
    assert not report["lossless"] and not row["lossless"] and "LOSSY" in row["label"]
    assert row["identical_to_greedy"] is None  # sampling: identity is not the claim


def test_bad_decoding_input(tiny_teacher):
    dec = Decoder(tiny_teacher)
    other_vocab = build_drafter({"_target_": "heads.medusa.MedusaHeads", "num_heads": 2},
                                type("T", (), {"hidden_size": 32, "vocab_size": 64, "num_layers": 2})())
    with pytest.raises(ValueError, match="vocab_size=64.*tokenizer"):
        dec.speculative(other_vocab, torch.tensor([[1, 2, 3]]), 5, 2)
    with pytest.raises(ValueError, match="empty prompt"):
        dec.speculative(noisy_medusa(tiny_teacher), torch.zeros(1, 0, dtype=torch.long), 5, 2)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        dec.plain(torch.zeros(1, 300, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="decoder.acceptance"):
        Decoder(tiny_teacher, DecoderConfig(acceptance="speculative"))


@pytest.mark.parametrize("override,message", [
    ("decoder.top_p=0", "decoder.top_p must lie in \\(0, 1\\]"),
    ("decoder.top_p=1.5", "decoder.top_p"),
    ("decoder.temperature=-1", "decoder.temperature"),
    ("decoder.tree=bushy", "valid presets"),
    ("decoder.acceptance=fast", "decoder.acceptance"),
    ("decoder.cuda_graphs=yes", "decoder.cuda_graphs"),
    ("decoder.compile=sometimes", "decoder.compile"),
])
def test_bad_decoder_config_fails_validation(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(load([override]))

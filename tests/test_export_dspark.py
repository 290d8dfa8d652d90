"""DSpark exports to vLLM (``method: dspark``, ``Qwen3DSparkModel``) and the speculators format: DFlash's backbone
checked as DFlash's exports are, the Markov and confidence heads' tensors and fields against what those loaders
build, rebuilt from the engine's files alone to decode exactly as the checkpoint; SGLang and a drafter without a
Markov head refused with the reason."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.decoder import Decoder
from serve.export import check_export, export_drafter, load_export
from tests.drafters import deep_teacher, dspark, save


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return deep_teacher(tmp_path_factory.mktemp("target"))


def exported(target, tmp_path, engine, **node):
    drafter = dspark(target, layers=[1, 3], **node)
    path = save(drafter, tmp_path / "run", "dspark", target)
    return drafter, export_drafter(path, engine, tmp_path / engine)


@pytest.mark.parametrize("engine", ["vllm", "speculators"])
def test_export_conforms_and_decodes_like_the_checkpoint(target, tmp_path, engine):
    drafter, out = exported(target, tmp_path, engine, confidence_threshold=0.3)
    assert check_export(out, engine, "dspark", target.identity()) == []
    config = json.loads((out / "config.json").read_text())
    state = load_file(str(out / "model.safetensors"))
    assert set(state) == set(drafter.state_dict())  # backbone, markov_head.*, confidence_head.*; no lm_head
    assert state["markov_head.markov_w2.weight"].shape == (128, 8)
    assert state["confidence_head.proj.weight"].shape == (1, 32 + 8)
    assert config["markov_rank"] == 8 and config["markov_head_type"] == "vanilla"
    assert config["enable_confidence_head"] and config["confidence_head_with_markov"]
    assert config["sample_from_anchor"] is False and config["draft_vocab_size"] == 128
    card = (out / "README.md").read_text()
    assert '"method": "dspark"' in card
    if engine == "vllm":
        assert config["architectures"] == ["Qwen3DSparkModel"]
        assert config["dflash_config"]["target_layer_ids"] == [0, 2]
    else:
        assert config["architectures"] == ["DSparkSpeculator"] and config["speculators_model_type"] == "dspark"
        assert config["speculators_config"]["algorithm"] == "dspark"
        assert config["aux_hidden_state_layer_ids"] == [1, 3]
    reloaded = load_export(out, target)
    for name, p in drafter.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], p, atol=0, rtol=0, msg=name)
    prompt = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    decoder = Decoder(target)
    assert reloaded.confidence_threshold == 0.3  # specdraft's decode setting, from the export's sidecar
    want = decoder.speculative(drafter, prompt, 12, 5)
    got = decoder.speculative(reloaded, prompt, 12, 5)
    assert got.new_tokens == want.new_tokens and got.stats.tau == want.stats.tau


def test_vllm_transcription_has_teeth(target, tmp_path):
    _, out = exported(target, tmp_path, "vllm")
    good = json.loads((out / "config.json").read_text())

    def problems_with(**change):
        (out / "config.json").write_text(json.dumps({**good, **change}))
        return check_export(out, "vllm", "dspark", target.identity())

    assert any("sample_from_anchor=None must be false" in p for p in problems_with(sample_from_anchor=None))
    assert any("markov_rank=0" in p for p in problems_with(markov_rank=0))
    assert any("'gated'" in p for p in problems_with(markov_head_type="gated"))
    assert any("['DFlashDraftModel']" in p for p in problems_with(architectures=["DFlashDraftModel"]))
    assert any("reduced vocabulary" in p for p in problems_with(draft_vocab_size=64))
    # the width the loader builds the confidence head with follows confidence_head_with_markov
    assert problems_with(confidence_head_with_markov=False) == [
        "tensor 'confidence_head.proj.weight' has shape (1, 40), the loader builds (1, 32)"]
    assert problems_with(enable_confidence_head=False, confidence_head_with_markov=False) == [
        f"tensor {k!r} is not part of the DSpark heads the config describes"
        for k in ("confidence_head.proj.bias", "confidence_head.proj.weight")]
    (out / "config.json").write_text(json.dumps(good))
    state = load_file(str(out / "model.safetensors"))
    del state["markov_head.markov_w1.weight"]
    state["layers.0.self_attn.q_proj.weight"] = state["layers.0.self_attn.q_proj.weight"][:-1]
    save_file(state, str(out / "model.safetensors"))
    problems = check_export(out, "vllm", "dspark", target.identity())
    assert "tensor 'markov_head.markov_w1.weight' is missing" in problems
    assert any("'layers.0.self_attn.q_proj.weight' has shape (31, 32)" in p for p in problems)


def test_speculators_config_transcription_has_teeth(target, tmp_path):
    _, out = exported(target, tmp_path, "speculators")
    good = json.loads((out / "config.json").read_text())

    def problems_with(**change):
        (out / "config.json").write_text(json.dumps({**good, **change}))
        return check_export(out, "speculators", "dspark", target.identity())

    assert any("'dflash'" in p for p in problems_with(speculators_model_type="dflash"))
    assert any("reaches the target's last layer" in p for p in problems_with(aux_hidden_state_layer_ids=[1, 4]))
    assert any("verifier.name_or_path" in p for p in problems_with(speculators_config={
        **good["speculators_config"], "verifier": {}}))


def test_refusals_name_the_reason(target, tmp_path):
    drafter = dspark(target, layers=[1, 3])
    path = save(drafter, tmp_path / "run", "dspark", target)
    with pytest.raises(ValueError, match=r"slot k predicts anchor \+ k; SGLang's DSpark drafts in DeepSpec's"):
        export_drafter(path, "sglang", tmp_path / "x")
    with pytest.raises(ValueError, match="no Hugging Face reference model class"):
        export_drafter(path, "hf", tmp_path / "x")
    plain = dspark(target, layers=[1, 3], markov_rank=0, confidence_with_markov=False)
    path = save(plain, tmp_path / "plain", "dspark", target)
    with pytest.raises(ValueError, match=r"drafter.markov_rank=0: .* need the Markov head"):
        export_drafter(path, "vllm", tmp_path / "x")
    assert not (tmp_path / "x").exists()

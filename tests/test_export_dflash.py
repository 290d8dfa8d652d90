"""DFlash exports to SGLang (``DFLASH``) and the speculators format: each checked against a transcription of its
loader (SGLang's renames and packing, speculators' config fields), rebuilt from the engine's files alone to decode
exactly as the checkpoint, refusals named; and speculators' own loader on our export giving our block logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.decoder import Decoder
from serve.export import check_export, export_drafter, load_export
from tests.drafters import deep_teacher, dflash, save


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    return deep_teacher(path)


def exported(target, tmp_path, engine, **node):
    drafter = dflash(target, **node)
    path = save(drafter, tmp_path / "run", "dflash", target)
    return drafter, export_drafter(path, engine, tmp_path / engine)


@pytest.mark.parametrize("engine", ["sglang", "speculators"])
def test_export_conforms_and_decodes_like_the_checkpoint(target, tmp_path, engine):
    drafter, out = exported(target, tmp_path, engine)
    assert check_export(out, engine, "dflash", target.identity()) == []
    config = json.loads((out / "config.json").read_text())
    state = load_file(str(out / "model.safetensors"))
    assert set(state) == set(drafter.state_dict())  # the z-lab names; no embedding, no lm_head
    card = (out / "README.md").read_text()
    if engine == "sglang":
        assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 6
        assert config["dflash_config"]["target_layer_ids"] == [i - 1 for i in drafter.teacher_layers]
        assert "--speculative-algorithm DFLASH" in card and "--speculative-num-draft-tokens 6" in card
    else:
        assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashSpeculator"]
        assert config["aux_hidden_state_layer_ids"] == list(drafter.teacher_layers) == [1, 3]
        assert config["draft_vocab_size"] == config["transformer_layer_config"]["vocab_size"] == 128
        assert config["speculators_config"]["verifier"]["name_or_path"] == target.name
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
        assert '"method": "dflash"' in card and f"vllm serve {out}" in card
    reloaded = load_export(out, target)
    for name, p in drafter.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], p, atol=0, rtol=0, msg=name)
    prompt = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    decoder = Decoder(target)
    want = decoder.speculative(drafter, prompt, 12, 4)
    got = decoder.speculative(reloaded, prompt, 12, 4)
    assert got.new_tokens == want.new_tokens and got.stats.tau == want.stats.tau


def test_sglang_loader_transcription_has_teeth(target, tmp_path):
    _, out = exported(target, tmp_path, "sglang")
    state = load_file(str(out / "model.safetensors"))
    # SGLang packs q/k/v by the ``.q_proj.`` substring; a fused name of ours matches nothing and is skipped
    state["layers.0.self_attn.query.weight"] = state.pop("layers.0.self_attn.q_proj.weight")
    state["model.layers.1.mlp.down_proj.weight"] = state.pop("layers.1.mlp.down_proj.weight")  # accepted: model.
    save_file(state, str(out / "model.safetensors"))
    problems = check_export(out, "sglang", "dflash", target.identity())
    assert any("'layers.0.self_attn.query.weight'" in p and "skips it silently" in p for p in problems)
    assert any("layers.0.self_attn.qkv_proj.weight is packed from" in p and "['q']" in p for p in problems)
    assert not any("down_proj" in p for p in problems)
    state["layers.0.self_attn.q_proj.weight"] = state.pop("layers.0.self_attn.query.weight")[:-1]
    save_file(state, str(out / "model.safetensors"))
    assert check_export(out, "sglang", "dflash", target.identity()) == [
        "tensor for 'layers.0.self_attn.qkv_proj.weight' has shape (95, 32), SGLang builds (96, 32)"]
    config = json.loads((out / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8, hidden_act="gelu")
    (out / "config.json").write_text(json.dumps(config))
    problems = check_export(out, "sglang", "dflash", target.identity())
    assert any("causal decoder attention" in p for p in problems) and any("silu only" in p for p in problems)


def test_speculators_config_transcription_has_teeth(target, tmp_path):
    _, out = exported(target, tmp_path, "speculators")
    good = json.loads((out / "config.json").read_text())

    def problems_with(**change):
        (out / "config.json").write_text(json.dumps({**good, **change}))
        return check_export(out, "speculators", "dflash", target.identity())

    assert any("reaches the target's last layer" in p for p in problems_with(aux_hidden_state_layer_ids=[1, 4]))
    assert any("t2d / d2t" in p for p in problems_with(draft_vocab_size=64))
    assert any("verifier.name_or_path" in p for p in problems_with(speculators_config={
        **good["speculators_config"], "verifier": {}}))
    assert any("mask_token_id=128" in p for p in problems_with(mask_token_id=128))
    assert any("'eagle3'" in p for p in problems_with(speculators_model_type="eagle3"))
    (out / "config.json").write_text(json.dumps(good))
    state = load_file(str(out / "model.safetensors"))
    state["lm_head.weight"] = torch.zeros(128, 32)
    save_file(state, str(out / "model.safetensors"))
    assert check_export(out, "speculators", "dflash", target.identity()) == [
        "tensor 'lm_head.weight' is not part of speculators' DFlashDraftModel"]


def test_refusals_name_the_reason(target, tmp_path):
    drafter = dflash(target, sliding_window=8)
    path = save(drafter, tmp_path / "window", "dflash", target)
    with pytest.raises(ValueError, match=r"sliding_window=8: SGLang builds a sliding_attention .* causal"):
        export_drafter(path, "sglang", tmp_path / "x")
    with pytest.raises(ValueError, match=r"sliding_window=8: vLLM's conversion .* without causal: false"):
        export_drafter(path, "speculators", tmp_path / "x")
    export_drafter(path, "vllm", tmp_path / "vllm")  # vLLM reads dflash_config.causal
    last = save(dflash(target, layers=[1, 4]), tmp_path / "last", "dflash", target)
    for engine in ("sglang", "speculators"):
        with pytest.raises(ValueError, match=rf"drafter.layers=\[1, 4\]: {engine} captures .* final normed output"):
            export_drafter(last, engine, tmp_path / "x")
    with pytest.raises(ValueError, match="no Hugging Face reference model class"):
        export_drafter(last, "hf", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_speculators_loader_agrees_with_our_drafter(target, tmp_path):
    """The real loader: speculators' own from_pretrained reads our export; its anchored blocks give our logits."""
    pytest.importorskip(
        "speculators", reason="speculators is an optional extra (pip install --no-deps speculators==0.9.0 and its "
                              "import deps; make serve-check installs it)")
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    drafter, out = exported(target, tmp_path, "speculators")
    config = DFlashSpeculatorConfig.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a compiler on CPU
    theirs = DFlashDraftModel.from_pretrained(out, config=config).eval()
    theirs.load_verifier_weights()  # the embedding and lm_head from the verifier (our export names the target)
    assert theirs.target_layer_ids == [1, 3] and theirs.block_size == 6 and not theirs.use_draft_vocab
    torch.testing.assert_close(theirs.embed_tokens.weight, target.model.get_input_embeddings().weight)

    T, S = 20, drafter.block_size
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(3))
    hidden = target(ids, torch.ones_like(ids), layers=[1, 3, 4]).hidden
    feats = torch.cat([hidden[1], hidden[3]], -1)
    with torch.no_grad():  # every position but the last block anchors one (speculators draws all when it may)
        _, logits, _, _, blocks = theirs._backbone_forward(
            feats, ids, torch.ones_like(ids), hidden[4], torch.zeros_like(ids), max_anchors=T - S)
    anchors = blocks.view(-1, S)[:, 0].tolist()
    assert anchors == list(range(T - S))
    for n, a in enumerate(anchors[1:], start=1):
        drafter.reset()
        drafter.observe({i: hidden[i][:, :a] for i in drafter.teacher_layers})
        with torch.no_grad():
            ours = drafter._block_logits(ids[0, a], a)
        torch.testing.assert_close(logits[0, n * S: (n + 1) * S], ours, rtol=1e-4, atol=1e-4, msg=f"anchor {a}")

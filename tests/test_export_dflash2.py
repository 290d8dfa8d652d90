"""DFlash2 exports to vLLM (``method: dflash``, ``DFlash2DraftModel``) and the speculators format: DFlash's backbone
checked as DFlash's exports are, the convolutions' and the selector's tensors and fields against what those loaders
build, rebuilt from the engine's files alone to decode exactly as the checkpoint; a drafter trained without either
module exports it as its identity and still decodes the same; SGLang refused with the reason."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from inference.decoder import Decoder
from serve.export import check_export, export_drafter, load_export
from tests.drafters import deep_teacher, dflash2, save


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return deep_teacher(tmp_path_factory.mktemp("target"))


def exported(target, tmp_path, engine, **node):
    drafter = dflash2(target, layers=[1, 3], **node)
    path = save(drafter, tmp_path / "run", "dflash2", target)
    return drafter, export_drafter(path, engine, tmp_path / engine)


def decodes_alike(drafter, reloaded, target):
    prompt = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    decoder = Decoder(target)
    want = decoder.speculative(drafter, prompt, 12, 5)
    got = decoder.speculative(reloaded, prompt, 12, 5)
    assert got.new_tokens == want.new_tokens and got.stats.tau == want.stats.tau


@pytest.mark.parametrize("engine", ["vllm", "speculators"])
def test_export_conforms_and_decodes_like_the_checkpoint(target, tmp_path, engine):
    drafter, out = exported(target, tmp_path, engine)
    assert check_export(out, engine, "dflash2", target.identity()) == []
    config = json.loads((out / "config.json").read_text())
    state = load_file(str(out / "model.safetensors"))
    assert state["candidate_selector.predecessor_codebook"].shape == (128, 8)
    assert state["candidate_selector.hidden_projection.weight"].shape == (8, 32)
    assert state["layers.1.mlp_conv.base_kernel"].shape == (2, 2, 32)
    assert state["layers.0.attention_conv.kernel_projection.weight"].shape == (2 * 2 * 32 // 8, 32)
    assert not any(k.startswith(("embed", "lm_head")) for k in state)
    fields = config["dflash_config"] if engine == "vllm" else config
    assert {k: fields[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {
        "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 8}
    card = (out / "README.md").read_text()
    assert '"method": "dflash"' in card
    if engine == "vllm":
        assert config["architectures"] == ["DFlash2DraftModel"]
        assert config["dflash_config"]["target_layer_ids"] == [0, 2]
    else:
        assert config["speculators_model_type"] == "dflash2"
        assert config["aux_hidden_state_layer_ids"] == [1, 3]
    reloaded = load_export(out, target)
    for name, p in drafter.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], p, atol=0, rtol=0, msg=name)
    decodes_alike(drafter, reloaded, target)


@pytest.mark.parametrize("node", [{"conv": False}, {"selector": False}], ids=["no-conv", "no-selector"])
def test_a_drafter_without_a_module_exports_its_identity_and_decodes_the_same(target, tmp_path, node):
    drafter, out = exported(target, tmp_path, "vllm", **node)
    assert check_export(out, "vllm", "dflash2", target.identity()) == []
    state = load_file(str(out / "model.safetensors"))
    if "conv" in node:
        assert torch.equal(state["layers.0.attention_conv.base_kernel"][:, 0], torch.ones(2, 32))
        assert not state["layers.0.mlp_conv.kernel_projection.weight"].any()
    else:
        assert not state["candidate_selector.hidden_projection.weight"].any()
    decodes_alike(drafter, load_export(out, target), target)


def test_vllm_transcription_has_teeth(target, tmp_path):
    _, out = exported(target, tmp_path, "vllm")
    good = json.loads((out / "config.json").read_text())

    def problems_with(**change):
        (out / "config.json").write_text(json.dumps({**good, **change}))
        return check_export(out, "vllm", "dflash2", target.identity())

    assert any("['DFlash2DraftModel']" in p for p in problems_with(architectures=["DFlashDraftModel"]))
    assert any("selector_rank=None" in p for p in problems_with(
        dflash_config={k: v for k, v in good["dflash_config"].items() if k != "selector_rank"}))
    assert problems_with(dflash_config={**good["dflash_config"], "selector_rank": 4}) == [
        f"tensor 'candidate_selector.{k}' has shape {s}, the loader builds {w}"
        for k, s, w in (("hidden_projection.weight", (8, 32), (4, 32)), ("predecessor_codebook", (128, 8), (128, 4)),
                        ("successor_codebook", (128, 8), (128, 4)))]
    assert any("conv_group_size=5 does not divide" in p
               for p in problems_with(dflash_config={**good["dflash_config"], "conv_group_size": 5}))


def test_sglang_and_hf_are_refused_with_the_reason(target, tmp_path):
    drafter = dflash2(target, layers=[1, 3])
    path = save(drafter, tmp_path / "run", "dflash2", target)
    for engine, reason in (("sglang", "SGLang's DFlash2 loader"), ("hf", "no Hugging Face reference model")):
        with pytest.raises(ValueError, match=reason):
            export_drafter(path, engine, tmp_path / engine)
        assert not (tmp_path / engine).exists()


def test_speculators_loader_agrees_with_our_drafter(target, tmp_path):
    """The real loader: speculators' own DFlash2 class reads our export; its anchored blocks give our unary logits,
    and its selector scores our candidates as ours does."""
    pytest.importorskip(
        "speculators", reason="speculators is an optional extra (pip install --no-deps speculators==0.9.0 and its "
                              "import deps; make serve-check installs it)")
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

    drafter, out = exported(target, tmp_path, "speculators")
    config = DFlash2SpeculatorConfig.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a compiler on CPU
    theirs = DFlash2DraftModel.from_pretrained(out, config=config).eval()
    theirs.load_verifier_weights()
    assert theirs.candidate_selector.top_k == drafter.selector_top_k and theirs.block_size == 6
    T, S = 20, drafter.block_size
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(3))
    hidden = target(ids, torch.ones_like(ids), layers=[1, 3, 4]).hidden
    feats = torch.cat([hidden[1], hidden[3]], -1)
    with torch.no_grad():
        states, logits, _, _, blocks = theirs._backbone_forward(
            feats, ids, torch.ones_like(ids), hidden[4], torch.zeros_like(ids), max_anchors=T - S)
    anchors = blocks.view(-1, S)[:, 0].tolist()
    assert anchors == list(range(T - S))
    sel = drafter.candidate_selector
    for n, a in enumerate(anchors[1:], start=1):
        drafter.reset()
        drafter.observe({i: hidden[i][:, :a] for i in drafter.teacher_layers})
        with torch.no_grad():
            out_SD = drafter.block_states(ids[0, a], a)
            ours = drafter.draft_logits(out_SD)
            torch.testing.assert_close(logits[0, n * S: (n + 1) * S], ours, rtol=1e-4, atol=1e-4, msg=f"anchor {a}")
            cand = ours.topk(drafter.selector_top_k, -1).indices  # [S, K]
            prev = ids[0, a: a + S]  # any predecessors: both sides score the same edges
            want = sel.scores(prev, sel.hidden_projection(out_SD), cand, ours.gather(1, cand))
            got = theirs.candidate_selector.score_candidates(ours[None], out_SD[None], prev[None], cand[None])[0]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"anchor {a}")

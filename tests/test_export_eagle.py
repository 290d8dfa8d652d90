"""EAGLE-1 / EAGLE-3 exports: each engine's layout and config, its loader's name mapping applied to the file (no
tensor skipped, no parameter unset), d2t arithmetic and layer-id conventions per engine, round trip through our
decoder, refusals; and the speculators package's own loader on our speculators-format export."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from distill.teacher import Teacher
from heads.saved import save_drafter
from heads.eagle.model import EagleDrafter
from heads.layers import vocab_maps
from serve.export import check_export, export_drafter, load_export
from inference.decoder import Decoder

TRAINED = {"training": {"steps": 10, "loss": {"_target_": "distill.losses.forward_kl"}}}
EXPORTS = [("eagle1", "vllm"), ("eagle1", "sglang"), ("eagle1", "hf"),
           ("eagle3", "vllm"), ("eagle3", "sglang"), ("eagle3", "speculators")]


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory):
    """A 4-layer tiny Llama saved to a local dir (so an export can name a target the loaders resolve)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=256, tie_word_embeddings=False)).eval()
    path = tmp_path_factory.mktemp("target")
    model.save_pretrained(path)
    return Teacher(model, tokenizer=None, name=str(path))


def make_eagle(teacher, variant, **kw):
    dims = {"hidden_size": teacher.hidden_size, "vocab_size": teacher.vocab_size, "num_layers": teacher.num_layers}
    kw = {"layers": [1, 2, 3], "draft_vocab_size": 96, **kw} if variant == "eagle3" else kw
    drafter = EagleDrafter(dims, variant=variant, num_heads=2, top_k=3, total_tokens=10, **kw)
    drafter.bind_target(teacher, initialize=True)
    g = torch.Generator().manual_seed(1)
    if variant == "eagle3":
        d2t, t2d = vocab_maps(torch.randint(0, 100, (teacher.vocab_size,), generator=g), drafter.draft_vocab_size)
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
    with torch.no_grad():  # every tensor distinct from its init (norms too): a swapped name changes the output
        for p in drafter.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return drafter.eval()


def saved(teacher, tmp_path, variant, **kw):
    drafter = make_eagle(teacher, variant, **kw)
    cfg = drafter.saved_config({"_target_": "heads.eagle.EagleDrafter", "variant": variant, "num_heads": 2,
                                "tree": "dynamic", "top_k": 3, "total_tokens": 10, **kw,
                                **({"draft_vocab_size": drafter.draft_vocab_size} if variant == "eagle3" else {})})
    path = save_drafter(drafter, tmp_path / "run" / "drafter", cfg, {"source": "hf", "name": teacher.name},
                        teacher.identity(), TRAINED)
    return drafter, path


def decode_all(teacher, drafter, n=6):
    dec = Decoder(teacher)
    g = torch.Generator().manual_seed(0)
    outs, taus = [], []
    for i in range(n):
        prompt = torch.randint(0, 128, (1, 5 + i), generator=g)
        gen = dec.speculative(drafter, prompt, 16, 3)
        outs.append(gen.new_tokens)
        taus.append(round(gen.stats.tau, 6))
    return outs, taus


@pytest.mark.parametrize("variant,engine", EXPORTS)
def test_eagle_export_conforms_and_round_trips(deep_target, tmp_path, variant, engine):
    drafter, path = saved(deep_target, tmp_path, variant)
    out = export_drafter(path, engine, tmp_path / engine)
    assert check_export(out, engine, variant, deep_target.identity()) == []
    config = json.loads((out / "config.json").read_text())
    state = load_file(str(out / "model.safetensors"))
    card = (out / "README.md").read_text()
    assert deep_target.name in card  # a target the serve command can resolve (here: its local dir)
    if engine in ("vllm", "speculators"):
        assert '"method": "eagle3"' in card or '"method": "eagle"' in card  # never left for vLLM to guess
    if variant == "eagle3":
        # d2t as the offsets the engines add: target id = draft id + d2t[draft id]
        assert torch.equal(state["d2t"] + torch.arange(96), drafter.d2t)
        assert state["t2d"].dtype == torch.bool and torch.equal(state["t2d"], drafter.t2d >= 0)
        assert config["draft_vocab_size"] == 96 and config["norm_before_residual"] is False
        ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] if engine == "sglang" else \
            config["eagle_aux_hidden_state_layer_ids"]
        assert ids == ([0, 1, 2] if engine == "sglang" else [1, 2, 3])  # SGLang adds 1 before capturing
        prefix = "layers.0." if engine == "speculators" else "midlayer."
        assert {prefix + "hidden_norm.weight", prefix + "self_attn.q_proj.weight", "lm_head.weight"} <= set(state)
    else:
        assert "lm_head.weight" not in state and "layers.0.input_layernorm.weight" not in state
        assert ("fc.bias" in state) == (engine != "vllm")  # vLLM's EAGLE-1 fc has no bias; SGLang's and EAGLE's do
        if "fc.bias" in state:
            assert not state["fc.bias"].any()
    assert "embed_tokens.weight" not in state
    reloaded = load_export(out, deep_target)
    assert decode_all(deep_target, reloaded) == decode_all(deep_target, drafter)  # same outputs and the same τ


def test_exported_tensors_in_the_targets_dtype(deep_target, tmp_path):
    drafter = make_eagle(deep_target, "eagle3")
    cfg = drafter.saved_config({"_target_": "heads.eagle.EagleDrafter", "variant": "eagle3", "num_heads": 2,
                                "draft_vocab_size": 96})
    path = save_drafter(drafter, tmp_path / "d", cfg, {"source": "hf", "name": deep_target.name,
                                                        "dtype": "bfloat16"}, deep_target.identity(), TRAINED)
    out = export_drafter(path, "vllm", tmp_path / "bf16")
    state = load_file(str(out / "model.safetensors"))
    assert state["fc.weight"].dtype == torch.bfloat16 and state["d2t"].dtype == torch.int64
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_loader_transcription_has_teeth(deep_target, tmp_path):
    _, path = saved(deep_target, tmp_path, "eagle3")
    out = export_drafter(path, "sglang", tmp_path / "sg")
    state = load_file(str(out / "model.safetensors"))
    # SGLang names its layer midlayer.*; layers.0.* matches no parameter and its loader skips it without a word
    state["layers.0.hidden_norm.weight"] = state.pop("midlayer.hidden_norm.weight")
    save_file(state, str(out / "model.safetensors"))
    problems = check_export(out, "sglang", "eagle3")
    assert any("skip it silently" in p for p in problems)
    assert any("midlayer.hidden_norm.weight" in p and "never set" in p for p in problems)
    state["midlayer.hidden_norm.weight"] = state.pop("layers.0.hidden_norm.weight")
    state.pop("d2t")
    save_file(state, str(out / "model.safetensors"))
    assert any("d2t is missing" in p for p in check_export(out, "sglang", "eagle3"))


def test_refusals_name_the_reason(deep_target, tmp_path):
    _, path = saved(deep_target, tmp_path / "a", "eagle3", layers=[1, 2, 4])  # 4 = L: the final normed output
    with pytest.raises(ValueError, match=r"never the final normed output \(index 4\)"):
        export_drafter(path, "vllm", tmp_path / "x")
    _, dup = saved(deep_target, tmp_path / "b", "eagle3", layers=[1, 2, 2])
    with pytest.raises(ValueError, match="repeats a layer"):
        export_drafter(dup, "speculators", tmp_path / "x")
    _, zero = saved(deep_target, tmp_path / "c", "eagle3", layers=[0, 1, 2])
    export_drafter(zero, "vllm", tmp_path / "v0")  # vLLM captures layer 0's input (the embeddings)
    with pytest.raises(ValueError, match=r"sglang captures the inputs of decoder layers 1\.\.3"):
        export_drafter(zero, "sglang", tmp_path / "x")
    _, e3 = saved(deep_target, tmp_path / "d", "eagle3")
    with pytest.raises(ValueError, match="format=speculators"):
        export_drafter(e3, "hf", tmp_path / "x")
    _, e1 = saved(deep_target, tmp_path / "e", "eagle1")
    with pytest.raises(ValueError, match="no EAGLE-1 model class"):
        export_drafter(e1, "speculators", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_vllm_eagle3_target_whitelist(deep_target, tmp_path, monkeypatch):
    import serve.eagle as export

    _, path = saved(deep_target, tmp_path, "eagle3")
    monkeypatch.setattr(export, "target_facts", lambda config: {"model_type": "phi3"})
    with pytest.raises(ValueError, match="vLLM serves EAGLE-3 only for targets whose model_type.*'phi3'"):
        export_drafter(path, "vllm", tmp_path / "x")
    export_drafter(path, "sglang", tmp_path / "sg")  # SGLang keeps no such list


@pytest.mark.parametrize("kw", [{}, {"fc_norm": True, "norm_output": True, "sliding_window": 5},
                                {"norm_before_fc": True}], ids=["plain", "fc_norm+norm_output+window", "norm_before_fc"])
def test_speculators_loader_agrees_with_our_drafter(deep_target, tmp_path, kw):
    """The real loader: speculators' own from_pretrained reads our export; its forward gives our draft logits
    (EAGLE-3.1's norms and the attention window included)."""
    pytest.importorskip(
        "speculators", reason="speculators is an optional extra (pip install --no-deps speculators==0.9.0 and its "
                              "import deps; .ci/run installs it)")
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    drafter, path = saved(deep_target, tmp_path, "eagle3", **kw)
    out = export_drafter(path, "speculators", tmp_path / "spec")
    config = Eagle3SpeculatorConfig.from_pretrained(out)
    assert {k: getattr(config, k) for k in ("fc_norm", "norm_before_fc", "norm_output")} == \
        {k: bool(kw.get(k)) for k in ("fc_norm", "norm_before_fc", "norm_output")}
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a compiler on CPU
    theirs = Eagle3DraftModel.from_pretrained(out, config=config).eval()
    assert theirs.target_layer_ids == [1, 2, 3]
    assert theirs.sliding_window == kw.get("sliding_window") and theirs.uses_sliding_window_attn == ("sliding_window" in kw)
    # The export carries no embedding: speculators takes the verifier's (config verifier.name_or_path, here the
    # target's local dir). Its from_pretrained does so only where the embedding is still NaN, which transformers
    # 5.2x's meta-device init does not guarantee (uninitialised memory instead), so ask its loader explicitly.
    theirs._load_verifier_weights(overwrite_embed_tokens=True)
    torch.testing.assert_close(theirs.embed_tokens.weight, deep_target.embed_tokens.weight)
    torch.testing.assert_close(theirs.lm_head.weight, drafter.lm_head.weight)  # ours, not the verifier's rows

    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    hidden = deep_target(ids, torch.ones_like(ids), layers=[1, 2, 3]).hidden
    T = ids.shape[1] - 1
    for row in range(ids.shape[0]):  # speculators runs one packed sequence at a time
        feats = torch.cat([hidden[i][row: row + 1, :T] for i in (1, 2, 3)], -1)
        nxt = ids[row: row + 1, 1:]  # position t pairs the feature at t with token t+1
        captured = []
        hook = theirs.lm_head.register_forward_hook(lambda m, a, o: captured.append(o))
        with torch.no_grad():
            theirs(hidden_states=feats, input_ids=nxt, document_ids=torch.zeros_like(nxt),
                   position_ids=torch.arange(T)[None], ttt_steps=1)
        hook.remove()
        with torch.no_grad():
            hid = drafter._first_hidden(feats)
            x, residual = drafter._layer_input(drafter._embed(nxt, hid), hid)
            q, k, v = drafter.layer.qkv(x, torch.arange(T))
            pos = torch.arange(T)
            mask = pos[None, :] <= pos[:, None]
            window = drafter.window_mask(pos[:, None], pos[None, :])
            mask = mask if window is None else mask & window
            out_ = drafter._finish(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                                   residual)
            ours = drafter._logits(out_)
        torch.testing.assert_close(captured[0], ours, rtol=1e-4, atol=1e-4)
        assert torch.equal(captured[0].argmax(-1), ours.argmax(-1))


FLAGS = [{"fc_norm": True, "norm_output": True}, {"norm_before_fc": True, "sliding_window": 4}]


@pytest.mark.parametrize("engine", ["vllm", "speculators"])
@pytest.mark.parametrize("kw", FLAGS, ids=["fc_norm+norm_output", "norm_before_fc+window"])
def test_eagle31_exports_carry_the_flags_and_round_trip(deep_target, tmp_path, engine, kw):
    """The flags land where the engine reads them (top-level config keys, the Llama config's layer_types and
    sliding_window), the norms' tensors under the loader's names; the drafter rebuilt from the export alone decodes
    as the checkpoint does."""
    drafter, path = saved(deep_target, tmp_path, "eagle3", **kw)
    out = export_drafter(path, engine, tmp_path / engine)
    assert check_export(out, engine, "eagle3", deep_target.identity()) == []
    config = json.loads((out / "config.json").read_text())
    state = load_file(str(out / "model.safetensors"))
    assert {k: config[k] for k in ("fc_norm", "norm_before_fc", "norm_output")} == \
        {k: bool(kw.get(k)) for k in ("fc_norm", "norm_before_fc", "norm_output")}
    llama = config.get("transformer_layer_config", config)
    if "sliding_window" in kw:
        assert llama["layer_types"] == ["sliding_attention"] and llama["sliding_window"] == kw["sliding_window"]
    else:
        assert "layer_types" not in llama and "sliding_window" not in llama
    norms = {f"fc_norm.{i}.weight" for i in range(3)} if kw.get("fc_norm") else {"input_norm.weight"}
    assert norms <= set(state)
    reloaded = load_export(out, deep_target)
    assert (reloaded.fc_norm_on, reloaded.norm_before_fc, reloaded.norm_output, reloaded.sliding_window) == \
        (drafter.fc_norm_on, drafter.norm_before_fc, drafter.norm_output, drafter.sliding_window)
    assert decode_all(deep_target, reloaded) == decode_all(deep_target, drafter)
    del state[sorted(norms)[0]]  # a norm's tensor gone: the loader transcription names the unset parameter
    save_file(state, str(out / "model.safetensors"))
    assert any("never set" in p for p in check_export(out, engine, "eagle3", deep_target.identity()))


@pytest.mark.parametrize("kw", [{"fc_norm": True}, {"norm_before_fc": True}, {"norm_output": True},
                                {"sliding_window": 8}])
def test_sglang_refuses_what_it_cannot_build(deep_target, tmp_path, kw):
    _, path = saved(deep_target, tmp_path, "eagle3", **kw)
    key = next(iter(kw))
    with pytest.raises(ValueError, match=rf"drafter.{key}=.*sglang cannot carry it: .*format=vllm or "
                                         rf"format=speculators, or retrain without drafter.{key}"):
        export_drafter(path, "sglang", tmp_path / "sg")

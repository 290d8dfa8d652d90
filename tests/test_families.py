"""Every family of tests/families.py x every drafter kind: trains, decodes losslessly at batch 1 and batch 4 (chain
and tree), exports and reloads; the hidden-state capture convention and the embedding / logit read-outs are checked
against each family's own forward. docs/families.md's table is this file's summary: every Y there is a test here.

One session-scoped fixture per family: the tiny target, its greedy references, and each drafter kind trained a few
steps on the target's own greedy continuations of the test prompts (so the trained drafters are accepted often and
the decode tests exercise accepted chains and tree paths, not only rejections). Prompts run past the sliding window
of the sliding-window families (12 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from distill.losses import forward_kl
from distill.teacher import TESTED_FAMILIES, Teacher, check_family
from heads.base import build_drafter
from heads.saved import save_drafter
from serve.export import check_export, export_drafter, load_export
from inference.batch_decoder import BucketDecoder
from inference.decoder import Decoder
from tests.families import FAMILIES, VOCAB, WINDOW

NEW, GAMMA, STEPS, LR = 16, 3, 20, 1e-2
PROMPT_LENGTHS = (6, 14, 20, 27)  # the last two exceed WINDOW before the first new token


@dataclass(frozen=True)
class Kind:
    """One row of the family x kind matrix: the drafter node trained on every family, its decode modes
    (decoder.tree per mode; a mode a kind lacks is absent: docs/families.md gives the reason), and whether its vLLM
    export is round-tripped per family."""

    node: dict
    trees: dict
    exported: bool = False


# The one table every family x kind test is parametrized from. EAGLE-3 is not exported per family: it needs 3
# distinct target layers below L and the 2-layer tiny targets have none to give, so its export is tested on a
# 4-layer Llama in tests/test_export_eagle.py and per family as a decision below.
KINDS = {
    "medusa": Kind({"_target_": "heads.medusa.MedusaHeads", "num_heads": 3}, {"chain": None, "tree": "small"},
                   exported=True),
    "eagle1": Kind({"_target_": "heads.eagle.EagleDrafter", "variant": "eagle1", "top_k": 2, "total_tokens": 6},
                   {"chain": "chain", "tree": "dynamic"}, exported=True),
    "eagle3": Kind({"_target_": "heads.eagle.EagleDrafter", "variant": "eagle3", "ttt_steps": 3, "top_k": 2,
                    "total_tokens": 6, "draft_vocab_size": 192}, {"chain": "chain", "tree": "dynamic"}),
    "draft_model": Kind({"_target_": "heads.draft_model.DraftModel"}, {"chain": None}, exported=True),
    "dflash": Kind({"_target_": "heads.dflash.DFlashDrafter", "block_size": 4, "objective": "distill"}, {"chain": None},
                   exported=True),
    "peagle": Kind({"_target_": "heads.peagle.PEagleDrafter", "num_depths": 3, "draft_vocab_size": None},
                   {"chain": None}),
    "dspark": Kind({"_target_": "heads.dspark.DSparkDrafter", "block_size": 4, "objective": "distill",
                    "markov_rank": 16, "confidence_threshold": 0.05}, {"chain": None}, exported=True),
}
DRAFTERS = {kind: row.node for kind, row in KINDS.items()}
TREES = {kind: row.trees for kind, row in KINDS.items()}
EXPORT_KINDS = tuple(kind for kind, row in KINDS.items() if row.exported)
FAMILY_IDS = sorted(FAMILIES)


@dataclass
class FamilyRun:
    name: str
    teacher: Teacher
    prompts: list[torch.Tensor]
    references: list[list[int]]
    losses: dict[str, list[float]] = field(default_factory=dict)
    drafters: dict = field(default_factory=dict)


def training_batch(prompts, references) -> dict:
    rows = [torch.cat([p, torch.tensor(r)]) for p, r in zip(prompts, references)]
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": mask.clone()}


def train_drafter(kind: str, teacher: Teacher, batch: dict):
    torch.manual_seed(0)
    drafter = build_drafter(DRAFTERS[kind], teacher)
    drafter.bind_target(teacher, initialize=True)
    if kind == "eagle3":  # the draft vocabulary from the batch's tokens, as training data would give it
        drafter.prepare(SimpleNamespace(**batch))
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=LR)
    signals = teacher.signals(batch, drafter.teacher_layers)
    drafter.train()
    losses = []
    for _ in range(STEPS):
        total, n = drafter(batch, signals).loss(forward_kl)
        loss = total / n
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.grad is None for p in teacher.model.parameters())  # the frozen target never trains
    return drafter.eval(), losses


@pytest.fixture(scope="session", params=FAMILY_IDS)
def family(request) -> FamilyRun:
    torch.set_num_threads(1)
    name = request.param
    teacher = Teacher(FAMILIES[name].build(), tokenizer=None, name=f"tiny-{name}")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in PROMPT_LENGTHS]
    references = [Decoder(teacher).plain(p[None], NEW).new_tokens for p in prompts]
    run = FamilyRun(name, teacher, prompts, references)
    batch = training_batch(prompts, references)
    for kind in DRAFTERS:
        run.drafters[kind], run.losses[kind] = train_drafter(kind, teacher, batch)
    return run


def test_registry_is_the_tested_list():
    assert sorted(FAMILIES) == sorted(TESTED_FAMILIES)


def test_untested_or_unsupported_families_fail_at_start_up_with_the_list():
    from transformers import AutoConfig

    with pytest.raises(ValueError, match=r"model_type='starcoder2'.*\['gemma2', 'gemma3_text'.*allow_untested_family"):
        check_family(AutoConfig.for_model("starcoder2"))
    check_family(AutoConfig.for_model("starcoder2"), allow_untested=True)  # on trust: not refused
    with pytest.raises(ValueError, match="gemma3_text"):
        check_family(AutoConfig.for_model("gemma3"))
    chunked = AutoConfig.for_model("llama4_text", num_hidden_layers=4, attention_chunk_size=8)
    with pytest.raises(ValueError, match="chunked_attention"):
        check_family(chunked, allow_untested=True)


def test_load_teacher_checks_the_family_before_loading_weights(tmp_path):
    """`target.source=hf target.name=<local dir>`, as a user points at a checkpoint: a tested family loads (Gemma-2,
    through its own config class); an untested one is refused from its config.json alone (no weights in the dir)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoConfig, PreTrainedTokenizerFast

    from distill.teacher import TargetConfig, load_teacher

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)},
                                                                             unk_token="t0")), eos_token="t1")
    FAMILIES["gemma2"].build().save_pretrained(tmp_path / "gemma2")
    tokenizer.save_pretrained(tmp_path / "gemma2")
    teacher = load_teacher(TargetConfig(source="hf", name=str(tmp_path / "gemma2")))
    assert teacher.num_layers == 4 and teacher.output_logits.softcap == 30.0
    AutoConfig.for_model("starcoder2").save_pretrained(tmp_path / "starcoder2")
    with pytest.raises(ValueError, match=r"model_type='starcoder2' is not among the families tested"):
        load_teacher(TargetConfig(source="hf", name=str(tmp_path / "starcoder2")))


def test_chain_drafters_refuse_a_tree_with_the_reason(family):
    with pytest.raises(ValueError, match="drafts a chain; set decoder.tree=null"):
        family.drafters["draft_model"].set_tree("small")


def test_plain_decoding_is_the_models_own_greedy(family):
    """The batch-1 reference itself: equal to greedy by repeated full forwards without any cache (HF's own masks,
    sliding windows included), for the longest prompt."""
    model, p = family.teacher.model, family.prompts[-1]
    ids = p[None]
    with torch.no_grad():
        for _ in range(NEW):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], 1)
    assert ids[0, p.shape[0]:].tolist() == family.references[-1]
    distinct = {t for r in family.references for t in r}
    assert len(distinct) > NEW  # a target that writes varied text, so identity has teeth


def test_capture_convention_and_readouts(family):
    """hidden_states[0] = what decoder layer 0 receives; [i] = the output of layer i; [L] = what the lm_head reads.
    The teacher's read-outs reproduce the forward's embedding (Gemma: scaled by sqrt(D)) and logits (Gemma-2:
    soft-capped) on a probe large enough for a cap to show."""
    teacher, model = family.teacher, family.teacher.model
    layers = model.get_decoder().layers
    seen: dict[str, torch.Tensor] = {}

    def keep(key, value) -> None:  # hooks must return None to leave the forward alone
        seen.setdefault(key, value)

    hooks = [layers[0].register_forward_pre_hook(
        lambda m, args, kwargs: keep("in0", args[0] if args else kwargs["hidden_states"]), with_kwargs=True)]
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_hook(
            lambda m, a, out, i=i: keep(f"out{i + 1}", out[0] if isinstance(out, tuple) else out)))
    hooks.append(teacher.lm_head.register_forward_pre_hook(lambda m, args: keep("head", args[0])))
    ids = family.prompts[-1][None]
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    hs, L = out.hidden_states, teacher.num_layers
    assert len(hs) == L + 1
    torch.testing.assert_close(hs[0], seen["in0"])
    for i in range(1, L):
        torch.testing.assert_close(hs[i], seen[f"out{i}"])
    torch.testing.assert_close(hs[L], seen["head"])
    assert teacher.resolve_layer(-1) == L
    with torch.no_grad():
        torch.testing.assert_close(teacher.input_embedding(ids), hs[0])
        torch.testing.assert_close(teacher.output_logits(hs[L]), out.logits)
    teacher.readout  # the probe check passed (it raises otherwise)
    if teacher.output_logits.softcap:  # the cap is real on the probe: without it the logits differ
        probe = torch.randn(1, 3, teacher.hidden_size)
        with torch.no_grad():
            probe = probe * 100 / teacher.lm_head(probe).abs().max()  # raw logits up to 100, the cap is 30
            assert (teacher.output_logits(probe) - teacher.lm_head(probe)).abs().max() > 1.0


def test_final_norm_gain_is_read_through_the_norm(family):
    """EAGLE-3 starts its output norm at the target's final norm: its *effective* gain (Gemma: 1 + weight), which a
    weight copy would get wrong; LayerNorm (GPT-NeoX) is not an RMS norm and is left alone."""
    teacher = family.teacher
    norm = teacher.final_norm
    assert norm is not None
    saved = norm.weight.detach().clone()
    with torch.no_grad():
        norm.weight.add_(0.3)  # away from init, so 1 + w and w differ from any default
    try:
        teacher.__dict__.pop("final_norm_gain", None)
        gain = teacher.final_norm_gain
        if isinstance(norm, torch.nn.LayerNorm):
            assert gain is None
            return
        x = torch.randn(3, teacher.hidden_size)
        with torch.no_grad():
            want = norm(x)
        unit = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))
        torch.testing.assert_close(gain * unit, want, rtol=1e-4, atol=1e-4)
        drafter = build_drafter(DRAFTERS["eagle3"], teacher)
        drafter.bind_target(teacher, initialize=True)
        torch.testing.assert_close(drafter.norm.weight.detach(), gain)
    finally:
        with torch.no_grad():
            norm.weight.copy_(saved)  # the session's target, exactly as it was
        teacher.__dict__.pop("final_norm_gain", None)


def test_a_readout_the_teacher_does_not_reproduce_is_refused():
    """Teeth for the readout check: Gemma-2 told it has no soft-cap, while its forward caps, is refused."""
    model = FAMILIES["gemma2"].build()
    model.config.final_logit_softcapping = None
    original = type(model).forward

    def capped(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        out.logits = torch.tanh(out.logits / 30.0) * 30.0
        return out

    model.forward = capped.__get__(model)
    teacher = Teacher(model, tokenizer=None, name="tiny-gemma2-miscapped")
    with pytest.raises(ValueError, match="not lm_head.*eagle1"):
        teacher.readout


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_trains(family, kind):
    losses = family.losses[kind]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.7 * losses[0], f"{family.name} {kind}: loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def _modes():
    return [(k, m) for k, modes in TREES.items() for m in modes]


@pytest.mark.parametrize("kind,mode", _modes(), ids=[f"{k}-{m}" for k, m in _modes()])
def test_lossless_batch1(family, kind, mode):
    drafter = family.drafters[kind]
    drafter.set_tree(TREES[kind][mode])
    decoder = Decoder(family.teacher)
    gens = [decoder.speculative(drafter, p[None], NEW, GAMMA) for p in family.prompts]
    assert [g.new_tokens for g in gens] == family.references
    accepted = sum(a * c for g in gens for row in g.stats.counts.values() for a, c in row.items())
    assert accepted > 0, f"{family.name} {kind} {mode}: no draft token was ever accepted"


# The bucketed prefill over the family x kind matrix: every kind on llama and on the sliding-window families mistral
# (every layer) and gemma2 (alternating), EAGLE-1 on every family; the other cells repeat one of those (the family's
# masking of the pads, or the kind's read of a padded prefill's hidden states) and are slow (conftest.py).
PREFILL_EVERY_KIND = ("llama", "mistral", "gemma2")
SLOW_CASES = frozenset(f"test_the_bucketed_prefill_decodes_identically[{name}-{kind}]" for name in FAMILY_IDS
                       for kind in DRAFTERS if name not in PREFILL_EVERY_KIND and kind != "eagle1")


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_the_bucketed_prefill_decodes_identically(family, kind):
    """The prefill recorded on a GPU (the prompt padded to its capacity bucket, one step shape per bucket) gives the
    eager prefill's tokens, plain and speculative (the drafter reads its hidden states), on every family: the
    sliding-window ones mask the pads like any later column."""
    drafter = family.drafters[kind]
    drafter.set_tree(next(iter(TREES[kind].values())))
    decoder = Decoder(family.teacher)
    decoder.runner.static_prefill = True
    assert [decoder.plain(p[None], NEW).new_tokens for p in family.prompts] == family.references
    gens = [decoder.speculative(drafter, p[None], NEW, GAMMA) for p in family.prompts]
    assert [g.new_tokens for g in gens] == family.references
    assert any(k[1] == "prefill" for k in decoder.batch._fns)  # the bucketed step ran


@pytest.mark.parametrize("kind,mode", _modes(), ids=[f"{k}-{m}" for k, m in _modes()])
def test_lossless_batch4(family, kind, mode):
    drafter = family.drafters[kind]
    drafter.set_tree(TREES[kind][mode])
    result = BucketDecoder(family.teacher).speculative(drafter, family.prompts, NEW, GAMMA)
    assert [g.new_tokens for g in result.generations] == family.references
    assert result.stats.forwards < len(family.prompts) * NEW  # drafts were accepted


@pytest.mark.parametrize("kind", EXPORT_KINDS)
def test_export_reloads_and_decodes_identically(family, kind, tmp_path):
    """Save (safetensors + config.json), export in the vLLM layout, check it against the loader's spec, read it
    back as the engine would and decode: the same tokens as the trained drafter. (The draft model's save/load
    rebuilds its config through the config class: Qwen2/3 and Gemma's per-layer lists must be consistent.)"""
    teacher, drafter = family.teacher, family.drafters[kind]
    drafter.set_tree(None)
    cfg = drafter.saved_config(DRAFTERS[kind])
    identity = {**teacher.identity(), "model_type": teacher.model.config.model_type}  # as train/run.py saves it
    path = save_drafter(drafter, tmp_path / "drafter", cfg, {"source": "hf", "name": teacher.name}, identity,
                        {"training": {"steps": STEPS, "loss": {"_target_": "distill.losses.forward_kl"}}})
    if kind in ("eagle1", "dflash", "dspark") and family.name.startswith("gemma"):  # scaled embeddings: no engine feeds them
        with pytest.raises(ValueError, match="scales its embeddings by sqrt"):
            export_drafter(path, "vllm", tmp_path / "vllm")
        return
    out = export_drafter(path, "vllm", tmp_path / "vllm")
    assert check_export(out, "vllm", kind, teacher.identity()) == []
    reloaded = load_export(out, teacher)
    decoder = Decoder(teacher)
    for p in family.prompts[-2:]:
        want = decoder.speculative(drafter, p[None], NEW, GAMMA)
        got = decoder.speculative(reloaded, p[None], NEW, GAMMA)
        assert got.new_tokens == want.new_tokens
        assert got.stats.counts == want.stats.counts  # the same drafts accepted: the same drafter
    if kind == "draft_model":  # the check has teeth: a tensor under a name transformers does not load is caught
        from safetensors.torch import load_file, save_file

        weights = next(out.glob("*.safetensors"))
        state = load_file(str(weights))
        name = next(k for k in state if "layers.0." in k and "att" in k)  # attention: in every family
        state[name.replace("layers.0.", "layers.9.")] = state.pop(name)
        save_file(state, str(weights), metadata={"format": "pt"})
        problems = check_export(out, "vllm", kind, teacher.identity())
        assert any("is missing" in p for p in problems) and any("is not part of" in p for p in problems)


def test_window_is_exceeded_in_the_sliding_families():
    sliding = [n for n, f in FAMILIES.items() if getattr(f.config(), "sliding_window", None)]
    assert {"mistral", "gemma2", "gemma3_text"} <= set(sliding)
    assert max(PROMPT_LENGTHS) + NEW > 2 * WINDOW


VLLM_EAGLE3 = {"llama": True, "qwen2": True, "qwen3": True, "qwen3_moe": True, "mistral": False, "gemma2": False,
               "gemma3_text": False, "phi3": False, "mixtral": False, "olmo2": False, "gpt_neox": False}


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_eagle3_export_decision_per_family(name):
    """What an EAGLE-3 export does for each family's model_type: vLLM's whitelist (vllm/config/speculative.py),
    SGLang's none, Gemma's scaled embeddings refused everywhere (docs/families.md)."""
    from serve.eagle import check_target_family

    model_type = FAMILIES[name].build().config.model_type
    for engine in ("vllm", "speculators", "sglang"):
        allowed = not name.startswith("gemma") and (engine == "sglang" or VLLM_EAGLE3[name])
        if allowed:
            check_target_family(engine, "eagle3", model_type)
        else:
            with pytest.raises(ValueError, match="only for targets whose model_type|scales its embeddings"):
                check_target_family(engine, "eagle3", model_type)

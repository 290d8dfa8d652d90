"""Medusa-2: heads + a LoRA inside the target, trained in two stages, merged into the target for decoding."""

import copy
import functools
import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from distill.data import collate
from distill.losses import forward_kl
from distill.teacher import Teacher
from heads.base import TargetDims, build_drafter
from heads.saved import load_drafter, load_saved_drafter, save_drafter
from serve.export import ADAPTER_DIR, MERGED, SIDECAR, check_export, export_drafter, load_export
from heads.lora import lora_layers, save_peft_adapter
from heads.medusa.medusa2 import Medusa2
from inference.decoder import Decoder
from tests.conftest import make_tiny_llama
from tests.test_checkpoint import DyingEngine, Killed, make_cfg, make_dataset
from train.config import _check_keys
from train.engine import SingleEngine
from train.logger import MetricsLogger
from train.loop import train

CONF = Path(__file__).resolve().parents[1] / "conf"
CFG = {"_target_": "heads.medusa.Medusa2", "num_heads": 3, "num_layers": 1, "tree": "small",
       "lora": {"r": 4, "alpha": 8}, "heads_only_steps": 2}
TARGET_CFG = {"source": "toy", "name": "tiny-llama"}
KL = functools.partial(forward_kl, temperature=1.0)


def make_batch(T=16, B=2, seed=0):
    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones(B, T, dtype=torch.bool)}


def bound(teacher, cfg=CFG, noise=0.0, seed=0):
    """A medusa2 drafter attached to ``teacher`` for training; ``noise`` perturbs heads and LoRA (B starts at zero,
    so without it the adapted target equals the original)."""
    drafter = build_drafter(cfg, teacher)
    drafter.bind_target(teacher, initialize=True)
    if noise:
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in drafter.parameters():
                p.add_(noise * torch.randn_like(p))
    return drafter


def adapted_logits(teacher, ids):
    with torch.no_grad():  # the model itself, adapters on (the teacher's own call would switch them off)
        return teacher.model(input_ids=ids, use_cache=False).logits


def base_state(teacher):
    """The target's own weights, named as in the plain model (peft moves a wrapped layer's weight to base_layer)."""
    return {k.replace(".base_layer", ""): v.clone() for k, v in teacher.model.state_dict().items() if "lora_" not in k}


def tokenizer128():
    words = WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(words), eos_token="t2")


def test_yaml_keys_match_the_constructor():
    node = OmegaConf.load(CONF / "drafter" / "medusa2.yaml")
    _check_keys(node, "drafter", runtime=("dims",))
    drafter = build_drafter(OmegaConf.to_container(node), Teacher(make_tiny_llama(), None))
    assert isinstance(drafter, Medusa2) and drafter.num_heads == 4 and drafter.lora_spec["r"] == 8
    assert (drafter.heads_only_steps, drafter.lm_loss_weight, drafter.lora_lr_scale) == (200, 1.0, 0.1)
    assert len(drafter.lora) == 0  # no module is built before a target (or a saved config) names them


@pytest.mark.parametrize("key, value, match", [
    ("heads_only_steps", -1, r"drafter.heads_only_steps must be an integer >= 0 .*got -1"),
    ("heads_only_steps", 1.5, r"drafter.heads_only_steps .*got 1.5"),
    ("lm_loss_weight", -0.1, r"drafter.lm_loss_weight must be a number >= 0.*got -0.1"),
    ("lora_lr_scale", 0, r"drafter.lora_lr_scale must be a number > 0.*got 0"),
    ("lora", {"r": 0}, r"drafter.lora.r=0 must be an integer >= 1"),
    ("lora", {"rank": 4}, r"drafter.lora has unknown keys \['rank'\]"),
    ("lora_modules", {"model.layers.0.self_attn.q_proj": [32]}, r"drafter.lora_modules\['model.layers.0.self_attn"),
    ("num_heads", 0, r"drafter.num_heads must be >= 1, got 0"),
])
def test_bad_values_are_refused_naming_the_key(key, value, match):
    with pytest.raises(ValueError, match=match):
        Medusa2(TargetDims(32, 128, 2), **{key: value})


def test_lora_matching_nothing_or_the_lm_head_is_refused(tiny_teacher):
    with pytest.raises(ValueError, match=r"drafter.lora.target_modules=\['qkv'\] matches no layer"):
        bound(tiny_teacher, {**CFG, "lora": {"target_modules": ["qkv"]}})
    with pytest.raises(ValueError, match=r"names the output embedding \[.lm_head.\]"):
        bound(tiny_teacher, {**CFG, "lora": {"target_modules": ["q_proj", "lm_head"]}})
    assert lora_layers(tiny_teacher.model) == {}  # refused binds leave the target as it was


def test_lora_lives_in_the_target_and_the_drafter_owns_only_heads_and_lora(tiny_teacher):
    drafter = bound(tiny_teacher)
    assert len(drafter.lora) == 14 == len(lora_layers(tiny_teacher.model))  # 7 projections x 2 layers
    ours = {id(p) for p in drafter.parameters()}
    in_target = {id(p) for n, p in tiny_teacher.model.named_parameters() if "lora_" in n}
    assert in_target <= ours  # the very tensors the target's forward uses
    base = {id(p) for n, p in tiny_teacher.model.named_parameters() if "lora_" not in n}
    assert not ours & base and all(k.startswith(("heads.", "lora.")) for k in drafter.state_dict())
    groups = drafter.param_groups()
    assert [g["lr_scale"] for g in groups] == [1.0, 0.1]
    assert {id(p) for p in groups[1]["params"]} == in_target


def test_teacher_answers_as_the_original_with_adapters_injected(tiny_target):
    original = copy.deepcopy(tiny_target)
    teacher = Teacher(tiny_target, None)
    ids = make_batch()["input_ids"]
    drafter = bound(teacher, noise=0.3)
    flags = [p.requires_grad for p in drafter.lora.parameters()]
    out = teacher(ids, layers=(-1,))
    with torch.no_grad():
        want = original(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(out.logits_BTV, want.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.hidden[-1], want.hidden_states[-1], rtol=0, atol=1e-6)
    assert (adapted_logits(teacher, ids) - want.logits).abs().max() > 1e-2  # the adapters are live otherwise
    assert [p.requires_grad for p in drafter.lora.parameters()] == flags  # peft's toggle did not leak


def test_stage_one_trains_heads_only_and_stage_two_reaches_the_lora(tiny_teacher):
    drafter = bound(tiny_teacher, noise=0.1).train()
    batch = make_batch()
    for step, lora_grads in ((0, False), (2, True)):
        drafter.zero_grad(set_to_none=True)
        drafter.begin_step(step)
        out = drafter(batch, tiny_teacher.signals(batch, drafter.teacher_layers))
        assert (out.aux_loss_sum is not None) == lora_grads  # the adapted target's LM loss: joint stage only
        loss, n = out.loss(KL)
        (loss / n).backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.heads.parameters())
        if lora_grads:
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.lora.parameters())
        else:
            assert all(p.grad is None for p in drafter.lora.parameters())
        assert all(p.grad is None for n, p in tiny_teacher.model.named_parameters() if "lora_" not in n)


def test_joint_stage_lm_loss_is_the_adapted_targets_next_token_loss(tiny_teacher):
    drafter = bound(tiny_teacher, {**CFG, "heads_only_steps": 0, "lm_loss_weight": 0.5}, noise=0.1)
    batch = make_batch(T=12, B=1)
    batch["loss_mask"][:, :8] = False  # tokens 8..11 are learnable: predicted at positions 7..10
    out = drafter(batch, tiny_teacher.signals(batch, drafter.teacher_layers))
    logits = adapted_logits(tiny_teacher, batch["input_ids"])[0]
    ce = torch.nn.functional.cross_entropy(logits[7:11], batch["input_ids"][0, 8:12], reduction="sum")
    torch.testing.assert_close(out.aux_loss_sum, 0.5 * ce)
    # Heads read the adapted target's states but are distilled toward the original's logits.
    original = tiny_teacher(batch["input_ids"]).logits_BTV[0]
    head1 = out.terms[0]  # head 1 at t = 6..9 -> original at t + 1
    torch.testing.assert_close(head1.teacher_NV[head1.mask_N], original[7:11])
    assert head1.mask_N.nonzero().squeeze(1).tolist() == [6, 7, 8, 9]


def run_loop(teacher, run_dir, cfg, engine=None):
    torch.manual_seed(0)
    drafter = bound(teacher, cfg.drafter)
    logger = MetricsLogger(run_dir, cfg.logger, asdict(cfg), resumed=(run_dir / "metrics.jsonl").exists())
    try:
        train(cfg, teacher, drafter, make_dataset(), collate, KL, engine or SingleEngine(cfg.trainer), run_dir,
              logger)
    finally:
        logger.close()
    return drafter


def test_training_loop_never_changes_the_targets_weights_and_resumes_exactly(tiny_teacher, tmp_path):
    cfg = replace(make_cfg(steps=5, ckpt_every=3, grad_accum=1), drafter=CFG)
    before = base_state(tiny_teacher)
    reference = run_loop(tiny_teacher, tmp_path / "a", cfg)
    after = base_state(tiny_teacher)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert any(p.abs().sum() > 0 for k, p in reference.state_dict().items() if k.endswith("B.weight"))  # LoRA trained
    # Killed after step 3 (inside the joint stage) and resumed: the same heads and LoRA as uninterrupted.
    with pytest.raises(Killed):
        run_loop(tiny_teacher, tmp_path / "b", cfg, DyingEngine(cfg.trainer, die_at=4))
    resumed = run_loop(tiny_teacher, tmp_path / "b", cfg)
    assert reference.state_dict().keys() == resumed.state_dict().keys()
    for (name, a), b in zip(reference.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_save_load_round_trip_without_a_target(tiny_teacher, tmp_path):
    drafter = bound(tiny_teacher, noise=0.2)
    node = drafter.saved_config(CFG)
    assert drafter.saved_config(node) == node == json.loads(json.dumps(node))  # what a resumed run compares
    assert node["lora_modules"]["model.layers.1.mlp.down_proj"] == [64, 32]
    save_drafter(drafter, tmp_path / "d", CFG, TARGET_CFG, tiny_teacher.identity())
    loaded, config = load_saved_drafter(tmp_path / "d")  # no target: modules rebuilt from lora_modules
    assert loaded.state_dict().keys() == drafter.state_dict().keys()
    for (k, a), b in zip(drafter.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k
    assert config["drafter"]["lora_modules"] == node["lora_modules"]


def test_load_for_decoding_merges_the_lora_into_the_target(tiny_target, tmp_path):
    pristine = copy.deepcopy(tiny_target)
    teacher = Teacher(tiny_target, None, name="tiny-llama")
    drafter = bound(teacher, noise=0.2)
    ids = make_batch()["input_ids"]
    want = adapted_logits(teacher, ids)
    save_drafter(drafter, tmp_path / "d", CFG, TARGET_CFG, teacher.identity())
    # In the training process: the target still carries the run's wrappers, which are replaced, then merged.
    same = load_drafter(tmp_path / "d", teacher)
    # In a fresh process: a freshly loaded original target.
    fresh = Teacher(pristine, None, name="tiny-llama")
    other = load_drafter(tmp_path / "d", fresh)
    for t, d in ((teacher, same), (fresh, other)):
        assert lora_layers(t.model) == {} and "peft_config" not in vars(t.model)
        torch.testing.assert_close(t(ids).logits_BTV, want, rtol=0, atol=1e-5)
        assert t.name == t.merged_adapter == d.verifies_against
        assert d.verifies_against.startswith("merged: tiny-llama + LoRA r=4")
    with pytest.raises(ValueError, match="already has a LoRA merged"):  # merging twice would apply it twice
        load_drafter(tmp_path / "d", fresh)


def test_peft_adapter_dir_reproduces_the_adapted_target(tiny_target, tmp_path):
    from peft import PeftModel

    pristine = copy.deepcopy(tiny_target)
    teacher = Teacher(tiny_target, None)
    drafter = bound(teacher, noise=0.2)
    ids = make_batch()["input_ids"]
    save_peft_adapter(tmp_path / "adapter", drafter.lora_spec, "drafter.lora", drafter.lora_weights(), "tiny-llama")
    peft_model = PeftModel.from_pretrained(pristine, tmp_path / "adapter").eval()
    with torch.no_grad():
        got = peft_model(input_ids=ids).logits
    torch.testing.assert_close(got, adapted_logits(teacher, ids), rtol=0, atol=1e-5)


def test_speculative_decoding_with_the_merged_target_is_plain_greedy(tiny_target, tmp_path):
    teacher = Teacher(tiny_target, None, name="tiny-llama")
    drafter = bound(teacher, noise=0.2)
    save_drafter(drafter, tmp_path / "d", CFG, TARGET_CFG, teacher.identity())
    merged = load_drafter(tmp_path / "d", teacher)
    dec = Decoder(teacher)
    g = torch.Generator().manual_seed(1)
    accepted = 0
    for i in range(4):
        prompt = torch.randint(0, 128, (1, 5 + i), generator=g)
        spec = dec.speculative(merged, prompt, 20, 3)
        assert spec.new_tokens == dec.plain(prompt, 20).new_tokens
        accepted += sum(a * c for row in spec.stats.counts.values() for a, c in row.items())
    assert accepted > 0  # the heads did propose tokens the merged target took


def test_after_training_reports_original_and_adapted_heldout_loss(tiny_teacher, monkeypatch):
    drafter = bound(tiny_teacher, noise=0.2)
    assert drafter.after_training(tiny_teacher) == {}  # no tokenizer: nothing to encode held-out text with
    ids = torch.randint(0, 128, (5, 16), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr("heads.medusa.medusa2.heldout_prompts", lambda tok, n, tokens, seed=0: ids.tolist())
    tiny_teacher.tokenizer = tokenizer128()
    out = drafter.after_training(tiny_teacher)

    def loss(logits):
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item()

    assert out["heldout/original_loss"] == pytest.approx(loss(tiny_teacher(ids).logits_BTV), rel=1e-5)
    assert out["heldout/adapted_loss"] == pytest.approx(loss(adapted_logits(tiny_teacher, ids)), rel=1e-5)
    assert out["heldout/adapted_loss"] != pytest.approx(out["heldout/original_loss"], rel=1e-3)


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_export_writes_heads_adapter_and_a_merged_target_that_reloads(tiny_target, tmp_path, engine):
    tiny_target.save_pretrained(tmp_path / "target")
    tokenizer128().save_pretrained(tmp_path / "target")
    target_cfg = {"source": "hf", "name": str(tmp_path / "target"), "revision": None, "dtype": "float32"}
    teacher = Teacher(tiny_target, None, name=target_cfg["name"])
    drafter = bound(teacher, noise=0.2)
    ids = make_batch()["input_ids"]
    want = adapted_logits(teacher, ids)
    final = {"heldout/original_loss": 4.5, "heldout/adapted_loss": 4.25}
    path = save_drafter(drafter, tmp_path / "run" / "drafter", CFG, target_cfg, teacher.identity(),
                        {"training": {"steps": 10, "final": final}})
    out = export_drafter(path, engine, tmp_path / engine)
    assert check_export(out, engine, "medusa2", teacher.identity()) == []
    merged = AutoModelForCausalLM.from_pretrained(out / MERGED).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=0, atol=1e-5)
    assert (out / MERGED / "tokenizer.json").is_file() and (out / ADAPTER_DIR / "adapter_config.json").is_file()
    weights = (load_file(str(out / "model.safetensors")) if engine == "vllm"
               else torch.load(out / "medusa_lm_head.pt", weights_only=True))
    assert not any("lora" in k for k in weights)  # the heads file holds heads only
    card = (out / "README.md").read_text()
    assert "# medusa2 drafter" in card and "serve the merged target" in card and "4.2500" in card
    if engine == "vllm":
        assert f"vllm serve {out / MERGED}" in card
    else:
        assert json.loads((out / "config.json").read_text())["base_model_name_or_path"] == str((out / MERGED).resolve())
    assert json.loads((out / SIDECAR).read_text())["verifies_against"].startswith("merged: ")
    # The exported heads on the exported merged target decode exactly like the checkpoint on the merged target.
    served = Teacher(merged, None)
    heads = load_export(out, served)
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    dec = Decoder(served)
    assert dec.speculative(heads, prompt, 16, 3).new_tokens == dec.plain(prompt, 16).new_tokens
    (out / ADAPTER_DIR / "adapter_model.safetensors").unlink()
    assert any("adapter_model.safetensors" in p for p in check_export(out, engine, "medusa2"))


def test_sglang_export_is_refused(tiny_teacher, tmp_path):
    drafter = bound(tiny_teacher)
    path = save_drafter(drafter, tmp_path / "d", CFG, TARGET_CFG, tiny_teacher.identity(), {"training": {"steps": 1}})
    with pytest.raises(ValueError, match="SGLang has no Medusa.*format=vllm"):
        export_drafter(path, "sglang", tmp_path / "out")


def test_after_training_measures_the_selected_weights_that_drafter_gets(tmp_path, monkeypatch, tiny_toy_target):
    """trainer.select=best_tau writes an earlier step's weights to drafter/: the adapted target's held-out loss in
    the training summary is the one of the LoRA written there, not of the last step's."""
    import os

    import train.run
    from distill.teacher import load_teacher
    from heads.saved import WEIGHTS
    from tests.test_reliability_run import compose_cfg

    taus = {1: 1.0, 2: 2.0, 3: 1.5, 4: 1.2}  # the best after step 2 of 4

    class ScriptedTau:
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, step, *args):
            return taus[step]

    monkeypatch.setattr(train.run, "HeldoutTau", ScriptedTau)
    cfg = compose_cfg(os.environ["SPECDRAFT_CACHE"], "trainer.eval_every=1", "trainer.eval_rows=2", "trainer.lr=0.05",
                      drafter=("drafter=medusa2", "drafter.num_heads=2", "drafter.heads_only_steps=0",
                               "drafter.lora_lr_scale=1.0"))
    run_dir = tmp_path / "run"
    train.run.run_training(cfg, run_dir)
    final = json.loads((run_dir / "drafter" / "config.json").read_text())["training"]["final"]
    assert final["selected_step"] == 2

    def adapted_loss(weights_file):
        teacher = load_teacher(cfg.target)
        drafter = build_drafter(cfg.drafter, teacher)
        drafter.bind_target(teacher, initialize=True)
        return drafter.after_training(teacher, weights=load_file(str(weights_file)))["heldout/adapted_loss"]

    written = adapted_loss(run_dir / "drafter" / WEIGHTS)
    last = adapted_loss(run_dir / "checkpoints" / "step_0000004" / "drafter" / WEIGHTS)
    assert final["heldout/adapted_loss"] == pytest.approx(written, rel=1e-6)
    assert last != pytest.approx(written, rel=1e-4)  # the LoRA moved after step 2: the two figures differ

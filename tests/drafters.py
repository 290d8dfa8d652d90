"""Shared test helpers: the drafter config nodes (one spelling per kind), tiny targets, and deterministic tiny
drafters saved the way ``python -m train`` saves them.

A plain module, imported by the test files that need it (``from tests.drafters import ...``): test files do not
import from one another, and ``conftest.py`` keeps only fixtures. Every builder is seeded: equal arguments give
equal weights, so exports of these drafters are byte-reproducible.
"""

from __future__ import annotations

import contextlib

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from distill.teacher import Teacher
from heads.base import TargetDims, build_drafter
from heads.saved import save_drafter

# The drafter config nodes (``conf/drafter/*.yaml`` with test-sized values). A new kind adds one entry here.
MEDUSA_NODE = {"_target_": "heads.medusa.MedusaHeads", "num_heads": 3, "num_layers": 1, "tree": "small"}
EAGLE1_NODE = {"_target_": "heads.eagle.EagleDrafter", "variant": "eagle1", "num_heads": 2, "tree": "dynamic",
               "top_k": 3, "total_tokens": 10}
EAGLE3_NODE = {"_target_": "heads.eagle.EagleDrafter", "variant": "eagle3", "num_heads": 2, "tree": "dynamic",
               "top_k": 3, "total_tokens": 10, "layers": [1, 2, 3], "draft_vocab_size": 96}
DRAFT_MODEL_NODE = {"_target_": "heads.draft_model.DraftModel", "source": "hf", "name": "tiny-draft"}
DFLASH_NODE = {"_target_": "heads.dflash.DFlashDrafter", "block_size": 6, "num_layers": 2}
DSPARK_NODE = {"_target_": "heads.dspark.DSparkDrafter", "block_size": 6, "num_layers": 2, "markov_rank": 8}
DFLASH2_NODE = {"_target_": "heads.dflash2.DFlash2Drafter", "block_size": 6, "num_layers": 2, "conv_group_size": 8,
                "selector_top_k": 8, "selector_rank": 8}
PEAGLE_NODE = {"_target_": "heads.peagle.PEagleDrafter", "num_heads": 2, "layers": [1, 2, 3], "num_depths": 4,
               "draft_vocab_size": 96}
NODES = {"medusa": MEDUSA_NODE, "eagle1": EAGLE1_NODE, "eagle3": EAGLE3_NODE, "draft_model": DRAFT_MODEL_NODE,
         "dflash": DFLASH_NODE, "peagle": PEAGLE_NODE, "dspark": DSPARK_NODE, "dflash2": DFLASH2_NODE}

# Every engine each kind exports to (the refused pairs are tested in test_export*.py).
EXPORTS = {"medusa": ("vllm", "hf"), "eagle1": ("vllm", "sglang", "hf"), "eagle3": ("vllm", "sglang", "speculators"),
           "draft_model": ("vllm", "sglang", "hf"), "dflash": ("vllm", "sglang", "speculators"),
           "peagle": ("vllm", "speculators"), "dspark": ("vllm", "speculators"),
           "dflash2": ("vllm", "speculators")}
TRAINED = {"training": {"steps": 10, "loss": {"_target_": "distill.losses.forward_kl"}}}
DIMS = TargetDims(hidden_size=32, vocab_size=128, num_layers=2)


def tiny_llama(seed: int = 0, vocab_size: int = 128, **overrides) -> LlamaForCausalLM:
    """A tiny random Llama (any ``LlamaConfig`` field overridable), seeded: equal arguments, equal weights."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=vocab_size, max_position_embeddings=256, tie_word_embeddings=True), **overrides})
    return LlamaForCausalLM(config).eval()


def varied_teacher(name: str = "tiny-llama-varied") -> Teacher:
    """The 2-layer tiny target at init 0.2 (the ``teacher`` fixture): its greedy output varies."""
    return Teacher(tiny_llama(initializer_range=0.2), tokenizer=None, name=name)


def deep_teacher(path: Path) -> Teacher:
    """A 4-layer tiny Llama saved to ``path`` (so an export can name a target the loaders resolve)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=256, tie_word_embeddings=False)).eval()
    model.save_pretrained(path)
    return Teacher(model, tokenizer=None, name=str(path))


def perturbed(drafter, seed: int, scale: float):
    """``drafter`` with every parameter moved off its init (a swapped name then changes the output)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return drafter.eval()


def noisy_medusa(teacher: Teacher, seed: int = 0, scale: float = 0.5):
    """3 Medusa heads off their init (global RNG seeded with ``seed``): they disagree with the target some of the
    time, so both accepted and rejected drafts occur."""
    drafter = build_drafter({"_target_": "heads.medusa.MedusaHeads", "num_heads": 3}, teacher)
    drafter.bind_target(teacher, initialize=True)
    torch.manual_seed(seed)
    with torch.no_grad():  # perturb so heads disagree with the target some of the time
        for p in drafter.parameters():
            p.add_(scale * torch.randn_like(p))
    return drafter.eval()


def medusa(teacher: Teacher, seed: int = 0, **node):
    drafter = build_drafter({**MEDUSA_NODE, **node}, teacher)
    drafter.bind_target(teacher, initialize=True)
    return perturbed(drafter, seed, 0.2)


def eagle(teacher: Teacher, variant: str, seed: int = 1):
    """EAGLE-1, EAGLE-3 or P-EAGLE (``variant``: the kind) off its init; a random draft vocabulary for the last two."""
    from heads.layers import vocab_maps

    node = NODES[variant]
    if variant == "peagle":  # its mask_hidden starts random
        torch.manual_seed(seed)
    drafter = build_drafter(node, teacher)
    drafter.bind_target(teacher, initialize=True)
    if variant in ("eagle3", "peagle"):
        g = torch.Generator().manual_seed(seed)
        d2t, t2d = vocab_maps(torch.randint(0, 100, (teacher.vocab_size,), generator=g), drafter.draft_vocab_size)
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
    return perturbed(drafter, seed + 1, 0.3)


def truncated(target, **overrides) -> LlamaForCausalLM:
    """A 1-layer draft holding the target's embeddings, first layer and final norm."""
    model = tiny_llama(seed=1, initializer_range=0.2, num_hidden_layers=1, **overrides)
    state = target.state_dict()
    model.load_state_dict({k: state[k] for k in model.state_dict()})
    return model


def draft_model(teacher: Teacher):
    from heads.draft_model.model import DraftModel

    drafter = DraftModel(TargetDims(teacher.hidden_size, teacher.vocab_size, teacher.num_layers),
                         model=truncated(teacher.model))
    drafter.bind_target(teacher, initialize=False)
    return drafter


def dflash(teacher: Teacher, seed: int = 3, **node):
    """A 2-layer DFlash drafter (block 6) off its init."""
    torch.manual_seed(seed)
    drafter = build_drafter({**DFLASH_NODE, **node}, teacher)
    drafter.bind_target(teacher, initialize=True)
    return perturbed(drafter, seed + 1, 0.2)


def dspark(teacher: Teacher, seed: int = 3, **node):
    """A 2-layer DSpark drafter (block 6, Markov rank 8) off its init."""
    torch.manual_seed(seed)
    drafter = build_drafter({**DSPARK_NODE, **node}, teacher)
    drafter.bind_target(teacher, initialize=True)
    return perturbed(drafter, seed + 1, 0.2)


def dflash2(teacher: Teacher, seed: int = 3, **node):
    """A 2-layer DFlash2 drafter (block 6, 8 candidates, selector rank 8) off its init: convolutions and selector
    perturbed too, so neither is the identity it starts as."""
    torch.manual_seed(seed)
    drafter = build_drafter({**DFLASH2_NODE, **node}, teacher)
    drafter.bind_target(teacher, initialize=True)
    return perturbed(drafter, seed + 1, 0.2)


def build(kind: str, teacher: Teacher):
    """A deterministic tiny drafter of ``kind`` (a key of ``NODES``) bound to ``teacher``."""
    if kind == "medusa":
        return medusa(teacher)
    if kind == "draft_model":
        return draft_model(teacher)
    if kind == "dflash":
        return dflash(teacher)
    if kind == "dspark":
        return dspark(teacher)
    if kind == "dflash2":
        return dflash2(teacher)
    return eagle(teacher, kind)


def save(drafter, run_dir: Path, kind: str, teacher: Teacher, target_name: str | None = None) -> Path:
    """``drafter`` saved as ``<run_dir>/drafter`` with a training record (exportable), as training saves it."""
    cfg = drafter.saved_config(dict(NODES[kind]))
    target = {"source": "hf", "name": target_name or teacher.name}
    return save_drafter(drafter, run_dir / "drafter", cfg, target, teacher.identity(), TRAINED)


@contextlib.contextmanager
def eager_proposals(drafter):
    """Inside, ``drafter`` has no static draft: a decoder drafts through per-row copies of its eager ``propose``
    (``heads.base.ForkedRows``), the readable reference its static draft step is tested against."""
    if not hasattr(drafter, "static_draft"):
        yield drafter
        return
    drafter.static_draft = lambda *args, **kwargs: None
    try:
        yield drafter
    finally:
        del drafter.static_draft


def assert_batch_drafts_what_each_row_drafts_alone(teacher: Teacher, drafter, num_draft: int = 4) -> None:
    """Four ragged prompts decoded together through the drafter's static draft step at the bucket's rows
    (``inference.batch_draft``) commit, row for row, the tokens and accepted lengths each prompt gets alone (batch 1),
    and every row equals plain greedy decoding."""
    from inference.batch_decoder import BucketDecoder
    from inference.decoder import Decoder

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=g) for n in (4, 9, 15, 6)]
    decoder = Decoder(teacher)
    alone = [decoder.speculative(drafter, p[None], 16, num_draft) for p in prompts]
    assert [a.new_tokens for a in alone] == [decoder.plain(p[None], 16).new_tokens for p in prompts]
    batched = BucketDecoder(teacher)
    together = batched.speculative(drafter, prompts, 16, num_draft).generations
    assert batched._drafts  # drafted by the static draft step at the bucket's rows, not per-row copies
    assert [t.new_tokens for t in together] == [a.new_tokens for a in alone]
    assert [dict(t.stats.counts) for t in together] == [dict(a.stats.counts) for a in alone]


def assert_reloaded_alike(drafter, reloaded, teacher: Teacher) -> None:
    """An exported drafter rebuilt from its files: the same weights, exactly, and the same greedy decoding."""
    from inference.decoder import Decoder

    for name, p in drafter.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], p, atol=0, rtol=0)
    prompt = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    decoder = Decoder(teacher)
    want = decoder.speculative(drafter, prompt, 12, 4).new_tokens
    assert decoder.speculative(reloaded, prompt, 12, 4).new_tokens == want


def assert_sampling_keeps_the_target_distribution(node: dict, batch: int, samples: int = 3000) -> None:
    """Temperature-1 sampling through the decode loop (batch 1: ``Decoder``; batch > 1: ``BucketDecoder``, one
    prompt per row) with the drafter ``node`` builds, its weights random, draws each 3-token continuation of a 4-token
    vocabulary with the target's own probability (total variation within twice the expected sampling error), and
    the drafter's drafts are accepted often enough for the acceptance rule to be what is tested."""
    import itertools

    from inference.batch_decoder import BucketDecoder
    from inference.decoder import Decoder, DecoderConfig
    from inference.sampling import SamplingConfig

    torch.manual_seed(0)
    model = tiny_llama(seed=0, vocab_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_key_value_heads=1, initializer_range=0.5)
    teacher = Teacher(model, tokenizer=None, name="tiny-v4")
    torch.manual_seed(5)
    drafter = build_drafter(node, teacher)
    drafter.bind_target(teacher, initialize=False)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.5)
    drafter.eval()
    prompt, length = torch.tensor([[1, 2, 3]]), 3
    seqs = torch.tensor(list(itertools.product(range(4), repeat=length)))
    with torch.no_grad():
        logp = model(torch.cat([prompt.expand(len(seqs), -1), seqs], 1)).logits.log_softmax(-1)
    exact = logp[:, 2: 2 + length].gather(-1, seqs[..., None]).squeeze(-1).sum(-1).exp().view((4,) * length)
    counts, accepted = torch.zeros_like(exact), 0
    if batch == 1:
        decoder = Decoder(teacher, DecoderConfig(temperature=1.0, seed=0))
        for _ in range(samples):
            gen = decoder.speculative(drafter, prompt, length, num_draft=2)
            counts[tuple(gen.new_tokens)] += 1
            accepted += sum(a * c for row in gen.stats.counts.values() for a, c in row.items())
    else:
        batched = BucketDecoder(teacher, sampling=SamplingConfig(temperature=1.0), seed=0)
        for _ in range(samples // batch):
            result = batched.speculative(drafter, [prompt[0]] * batch, length, 2)
            for gen in result.generations:
                counts[tuple(gen.new_tokens)] += 1
            accepted += sum(a * c for row in result.stats.counts.values() for a, c in row.items())
        assert batched._drafts  # drafted by the static draft step at the bucket's rows (inference.batch_draft)
    assert accepted > samples // 10
    tol = 2 * 0.5 * float(torch.sqrt(2 * exact * (1 - exact) / (torch.pi * samples)).sum())
    distance = 0.5 * float((counts / samples - exact).abs().sum())
    assert distance < tol, f"TV {distance:.4f} exceeds {tol:.4f}"

"""DFlash: training blocks equal decoding blocks, training reduces the loss, greedy identity (batch 1 and B), batched
drafting equal to per-row drafting, the draft vocabulary, the sampled output distribution, save/load, anchor draws and
config errors."""

from __future__ import annotations

import types

import pytest
import torch

from distill.losses import forward_kl
from heads.base import build_drafter
from heads.dflash.model import DFlashDrafter, block_mask, default_feature_layers
from heads.saved import load_drafter
from inference.batch_decoder import BucketDecoder
from inference.decoder import Decoder
from serve.export import check_export, export_drafter, load_export
from tests.drafters import (DFLASH_NODE, DIMS, assert_reloaded_alike, assert_batch_drafts_what_each_row_drafts_alone,
                            assert_sampling_keeps_the_target_distribution, deep_teacher, dflash, save, varied_teacher)


def batch_of(ids):
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}


@pytest.fixture(scope="module")
def teacher():
    return varied_teacher()


@pytest.mark.parametrize("window", [None, 7])
def test_training_block_equals_the_decoding_block(teacher, window):
    """Slot k of the block anchored at a in training computes exactly what ``propose`` computes after a + 1
    tokens: pins the block mask (context strictly before the anchor, within the sliding window of each slot when one
    is set; the whole block non-causal) and the positions."""
    drafter = dflash(teacher, objective="distill", sliding_window=window)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = drafter(batch_of(ids), teacher.signals(batch_of(ids), drafter.teacher_layers))
    assert len(out.terms) == drafter.block_size - 1
    for a in (1, 6, 13):
        drafter.reset()
        drafter.observe(teacher(ids[:, :a], None, drafter.teacher_layers).hidden)
        with torch.no_grad():
            logits = drafter._block_logits(ids[0, a], a)
        for k in range(1, drafter.block_size):
            if a + k < 20:  # term k - 1's rows are the anchors 1, 2, ... in order
                torch.testing.assert_close(logits[k], out.terms[k - 1].student_NV[a - 1], atol=1e-5, rtol=1e-5)
        tree = drafter.propose(ids[:, : a + 1], 3)
        assert tree.tokens.tolist() == logits[1:4].argmax(-1).tolist()
    if window is not None:  # the window bites: the full-attention drafter drafts otherwise at a = 13
        full = dflash(teacher, objective="distill")
        full.observe(teacher(ids[:, :13], None, full.teacher_layers).hidden)
        with torch.no_grad():
            assert not torch.allclose(full._block_logits(ids[0, 13], 13), logits, atol=1e-4)


def test_block_mask_sees_the_context_before_the_anchor_and_its_own_block():
    anchors = torch.tensor([[1, 3]])
    attn = torch.tensor([[1, 1, 1, 1, 0]]).bool()
    m = block_mask(anchors, attn, 2)[0, 0]  # [4, 5 + 4]
    assert m[:2, :5].tolist() == [[True, False, False, False, False]] * 2
    assert m[2:, :5].tolist() == [[True, True, True, False, False]] * 2
    assert m[:, 5:].tolist() == [[True, True, False, False], [True, True, False, False],
                                 [False, False, True, True], [False, False, True, True]]


def _greedy_batch(teacher, n=4, new=24):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (m,), generator=g) for m in (5, 9, 12, 16)][:n]
    refs = [Decoder(teacher).plain(p[None], new).new_tokens for p in prompts]
    rows = [torch.cat([p, torch.tensor(r)]) for p, r in zip(prompts, refs)]
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    return prompts, refs, {"input_ids": ids, "attention_mask": mask, "loss_mask": mask.clone()}


@pytest.fixture(scope="module")
def trained(teacher):
    """A DFlash drafter trained on the target's own greedy continuations: (drafter, losses, prompts, references)."""
    prompts, refs, batch = _greedy_batch(teacher)
    torch.manual_seed(0)
    drafter = build_drafter(DFLASH_NODE, teacher)
    drafter.bind_target(teacher, initialize=True)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    signals = teacher.signals(batch, drafter.teacher_layers)
    drafter.train()
    losses = []
    for _ in range(30):
        assert drafter.count_valid(batch) == drafter(batch, signals).num_valid
        total, n = drafter(batch, signals).loss(forward_kl)
        loss = total / n
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.grad is None for p in teacher.model.parameters())  # the frozen target never trains
    return drafter.eval(), losses, prompts, refs


def test_training_reduces_the_loss(trained):
    _, losses, _, _ = trained
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def test_greedy_is_identical_to_plain_batch1_and_batched(teacher, trained):
    drafter, _, prompts, refs = trained
    decoder = Decoder(teacher)
    gens = [decoder.speculative(drafter, p[None], 24, 5) for p in prompts]
    assert [g.new_tokens for g in gens] == refs
    accepted = sum(a * c for g in gens for row in g.stats.counts.values() for a, c in row.items())
    assert accepted > 0  # trained drafts are accepted: the identity covers accepted chains, not only rejections
    result = BucketDecoder(teacher).speculative(drafter, prompts, 24, 5)
    assert [g.new_tokens for g in result.generations] == refs
    assert result.stats.forwards < len(prompts) * 24


@pytest.mark.parametrize("window,vocab", [(None, None), (7, 24)])
def test_a_batch_drafts_what_each_row_drafts_alone(teacher, window, vocab):
    drafter = dflash(teacher, sliding_window=window, draft_vocab_size=vocab).eval()
    assert_batch_drafts_what_each_row_drafts_alone(teacher, drafter, 5)


def test_save_load_round_trip(teacher, trained, tmp_path):
    drafter = trained[0]
    path = save(drafter, tmp_path, "dflash", teacher)
    loaded = load_drafter(path, teacher)
    assert isinstance(loaded, DFlashDrafter)
    assert loaded.teacher_layers == drafter.teacher_layers and loaded.mask_token_id == drafter.mask_token_id
    for name, p in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], p, atol=0, rtol=0)
    p = trained[2][1]
    assert Decoder(teacher).speculative(loaded, p[None], 16, 5).new_tokens == trained[3][1][:16]


def test_draft_vocabulary_keeps_frequent_ids_decodes_losslessly_and_round_trips(teacher, trained, tmp_path):
    """``draft_vocab_size``: ``prepare`` keeps the training data's most frequent ids, decoding drafts only those
    (greedy output still the target's own), and the ids survive save / load."""
    drafter, _, prompts, refs = trained
    small = build_drafter({**DFLASH_NODE, "draft_vocab_size": 16}, teacher)
    small.bind_target(teacher, initialize=False)
    small.load_state_dict({**drafter.state_dict(), "d2t": small.d2t})
    _, _, batch = _greedy_batch(teacher)
    small.prepare(types.SimpleNamespace(**batch))
    counts = torch.bincount(batch["input_ids"][batch["attention_mask"].bool()], minlength=128)
    assert counts[small.d2t].sum() == counts.sort(descending=True).values[:16].sum()
    small.eval()
    gens = [Decoder(teacher).speculative(small, p[None], 24, 5) for p in prompts]
    assert [g.new_tokens for g in gens] == refs
    small.reset()
    small.observe(teacher(prompts[0][None], None, small.teacher_layers).hidden)
    assert set(small.propose(prompts[0][None], 5).tokens.tolist()) <= set(small.d2t.tolist())
    loaded = load_drafter(save(small, tmp_path, "dflash", teacher), teacher)
    assert loaded.draft_vocab_size == 16 and torch.equal(loaded.d2t, small.d2t)
    with pytest.raises(ValueError, match="drafter.draft_vocab_size=0"):
        DFlashDrafter(DIMS, block_size=6, draft_vocab_size=0)


def test_anchor_draws_are_bounded_and_counted(teacher):
    drafter = dflash(teacher, num_anchors=3, objective="distill")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    batch = batch_of(ids)
    batch["attention_mask"][1, 10:] = 0  # a padded row
    batch["loss_mask"][1, 10:] = 0
    anchors, drawn = drafter._draw_anchors(drafter._candidates(batch))
    assert drawn.sum(1).tolist() == [3, 3] and bool((anchors[1] < 9).all())
    assert anchors[0].tolist() == sorted(anchors[0].tolist())
    out = drafter(batch, teacher.signals(batch, drafter.teacher_layers))
    assert int(out.num_valid) == int(drafter.count_valid(batch)) == 6 == int(out.terms[0].mask_N.sum())
    assert len(out.terms[0].student_ND) == 2 * 3  # static: every anchor slot of every row


# --- export ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [None, 8])
def test_vllm_export_round_trip(tmp_path, window):
    """Export in vLLM's layout, check it against the loader's transcription, rebuild the drafter from the engine's
    files only: the same weights and the same greedy decoding (a sliding window included)."""
    import json

    teacher = deep_teacher(tmp_path / "target")
    drafter = dflash(teacher, sliding_window=window)
    path = save(drafter, tmp_path / "run", "dflash", teacher, target_name=str(tmp_path / "target"))
    out = export_drafter(path, "vllm", tmp_path / "vllm")
    assert check_export(out, "vllm", "dflash", teacher.identity()) == []
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [i - 1 for i in drafter.teacher_layers]
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == drafter.block_size
    assert '"method": "dflash"' in (out / "README.md").read_text()
    if window:
        assert config["layer_types"] == ["sliding_attention"] * 2 and config["sliding_window"] == window
        assert config["dflash_config"]["causal"] is False
        assert reloaded_window(out, teacher) == window
    reloaded = load_export(out, teacher)
    assert_reloaded_alike(drafter, reloaded, teacher)


def reloaded_window(out, teacher):
    return load_export(out, teacher).sliding_window


def test_vllm_check_catches_a_departure(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    teacher = deep_teacher(tmp_path / "target")
    path = save(dflash(teacher), tmp_path / "run", "dflash", teacher)
    out = export_drafter(path, "vllm", tmp_path / "vllm")
    state = load_file(str(out / "model.safetensors"))
    state["layers.0.self_attn.qkv_proj.weight"] = state.pop("layers.0.self_attn.q_proj.weight")
    save_file(state, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = 10_000
    (out / "config.json").write_text(json.dumps(config))
    problems = check_export(out, "vllm", "dflash", teacher.identity())
    assert any("mask_token_id=10000" in p for p in problems)
    config["dflash_config"]["mask_token_id"] = 5
    (out / "config.json").write_text(json.dumps(config))
    problems = check_export(out, "vllm", "dflash", teacher.identity())
    assert "tensor 'layers.0.self_attn.q_proj.weight' is missing" in problems
    assert "tensor 'layers.0.self_attn.qkv_proj.weight' is not part of vLLM's DFlash draft" in problems


def test_export_refuses_what_no_engine_captures_and_unsupported_engines(tmp_path):
    teacher = deep_teacher(tmp_path / "target")
    path = save(dflash(teacher, layers=[1, 4]), tmp_path / "run", "dflash", teacher)
    with pytest.raises(ValueError, match=r"drafter.layers=\[1, 4\].*final normed output"):
        export_drafter(path, "vllm", tmp_path / "vllm")
    with pytest.raises(ValueError, match="no Hugging Face reference model class"):
        export_drafter(path, "hf", tmp_path / "hf")


# --- the sampled output distribution through the real decode loop ------------------------------------------------

# Batch 4 (slow) repeats tests/test_peagle.py's [4]: the same batched loop over the same eager sampled chain (warp,
# sample, DraftTree.chain with its probabilities in propose); batch 1 (the static step) stays here.
@pytest.mark.parametrize("batch", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_sampled_output_distribution_is_the_targets(batch):
    """Temperature-1 sampling through the decode loop (batch 1: the step decoder with the static step; batch 4: the
    batched loop, one prompt per row) draws each 3-token continuation with the target's own probability."""
    assert_sampling_keeps_the_target_distribution({**DFLASH_NODE, "block_size": 3}, batch)


# --- configuration ---------------------------------------------------------------------------------------------

def test_default_mask_token_is_a_dedicated_id():
    """The anchors' choice: the tokenizer's mask token, else the first id past the tokenizer's own (an embedding row
    no text produces: Qwen3's 151669), else the last id of a vocabulary the tokenizer fills."""
    from heads.dflash.model import default_mask_token_id

    class Tok:
        def __init__(self, n, mask=None):
            self.n, self.mask_token_id = n, mask

        def __len__(self):
            return self.n

    assert default_mask_token_id(Tok(151669), 151936) == 151669
    assert default_mask_token_id(Tok(100, mask=7), 128) == 7
    assert default_mask_token_id(Tok(128256), 128256) == 128255
    assert default_mask_token_id(None, 128) == 127
    drafter = DFlashDrafter(DIMS, block_size=6)
    drafter.bind_target(types.SimpleNamespace(tokenizer=Tok(100), resolve_layer=lambda i: i, input_embedding=None,
                                              output_logits=None, final_norm_gain=None), initialize=False)
    assert drafter.mask_token_id == 100 and drafter.saved_config({})["mask_token_id"] == 100
    pinned = DFlashDrafter(DIMS, block_size=6, mask_token_id=5)  # a configured id is kept
    pinned.bind_target(types.SimpleNamespace(tokenizer=Tok(100), resolve_layer=lambda i: i, input_embedding=None,
                                             output_logits=None, final_norm_gain=None), initialize=False)
    assert pinned.mask_token_id == 5


def test_default_layers_follow_the_anchors_spread():
    assert default_feature_layers(36, 5) == (2, 10, 18, 26, 34)  # 0-based target_layer_ids 1, 9, 17, 25, 33
    assert default_feature_layers(32, 1) == (17,)
    assert default_feature_layers(2, 2) == (1,)  # shallow: indices 1 .. L - 1, never the final normed output
    assert default_feature_layers(4, 3) == (1, 2, 3)


@pytest.mark.parametrize("key,value,match", [
    ("block_size", 1, "drafter.block_size=1"), ("layers", [5], "drafter.layers contains 5"),
    ("objective", "mse", "drafter.objective='mse'"), ("mask_token_id", 128, "drafter.mask_token_id=128"),
    ("depth", 9, "drafter.depth=9"), ("num_anchors", 0, "drafter.num_anchors=0")])
def test_bad_config_names_the_key(key, value, match):
    with pytest.raises(ValueError, match=match):
        DFlashDrafter(DIMS, **{"block_size": 6, key: value})


# --- the static (capture-safe) draft step ---------------------------------------------------------------------

@pytest.mark.parametrize("prompt_len,window,vocab", [(5, None, None), (11, None, None), (11, 8, None),
                                                      (11, None, 24)])
def test_static_draft_drafts_what_propose_drafts(teacher, prompt_len, window, vocab):
    """Played through the step decoder's stand-in with a varying accepted length per step: every static draft
    equals the eager ``propose`` on the same context (greedy), and the sampled step's distributions are the eager
    logits' (its draws lie in their support). With a draft vocabulary, both draft only its ids."""
    from inference.sampling import GREEDY, SamplingConfig, warp
    from tests.static_harness import Replay, committed_for, counts

    drafter = dflash(teacher, sliding_window=window, draft_vocab_size=vocab)
    if vocab:
        drafter.d2t.copy_(torch.randperm(128, generator=torch.Generator().manual_seed(5))[:vocab].sort().values)
    M = 4
    for sampling in (GREEDY, SamplingConfig(temperature=0.8, top_k=20)):
        committed = committed_for(drafter, M)
        static = drafter.static_draft(committed, 64, sampling, torch.Generator().manual_seed(0))
        assert static is drafter.static_draft(committed, 64, sampling, static.generator)  # reused, not rebuilt
        replay = Replay(teacher, tuple(drafter.teacher_layers), prompt_len, new_tokens=M * 8 + 2, seed=prompt_len)
        replay.prefill(static)
        drafter.reset()
        drafter.observe({i: h[None] for i, h in replay.hidden_at(0, prompt_len).items()})
        for step, count in enumerate(counts(8, M, seed=prompt_len)):
            if step:
                start = replay.position
                replay.commit(committed, count)
                drafter.observe({i: h[None] for i, h in replay.hidden_at(start, start + count).items()})
            static.draft()
            eager = drafter.propose(replay.context(), M - 1, GREEDY)
            if vocab:
                assert set(static.buffers.tokens_T.tolist()) <= set(drafter.d2t.tolist())
            if sampling.greedy:
                assert static.buffers.tokens_T.tolist() == eager.tokens.tolist(), (step, count)
                continue
            with torch.no_grad():
                n = replay.context().shape[1]
                want = warp(drafter._block_logits(replay.context()[0, -1], n - 1)[1:M], sampling)
            torch.testing.assert_close(static.buffers.probs_TV, want, atol=1e-5, rtol=1e-5)
            assert bool((want.gather(1, static.buffers.tokens_T[:, None]) > 0).all())


def test_static_draft_follows_a_recast_drafter(teacher):
    """Evaluation times a drafter in float32 and bfloat16 through the same step decoder: its static step, built in
    one dtype, drafts with the weights in the other."""
    from inference.sampling import GREEDY
    from tests.static_harness import Replay, committed_for

    drafter = dflash(teacher)
    committed = committed_for(drafter, 4)
    static = drafter.static_draft(committed, 64, GREEDY, None)
    drafter.to(torch.bfloat16)
    replay = Replay(teacher, tuple(drafter.teacher_layers), 6, new_tokens=10)
    replay.prefill(static)
    static.draft()
    drafter.reset()
    drafter.observe({i: h[None] for i, h in replay.hidden_at(0, 6).items()})
    assert static.buffers.tokens_T.tolist() == drafter.propose(replay.context(), 3).tokens.tolist()

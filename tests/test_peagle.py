"""P-EAGLE: the training chains equal the decoding chain, the parallel mask, nested depth sampling, training reduces
the loss, greedy identity (batch 1 and B), the sampled output distribution, save/load and config errors."""

from __future__ import annotations


import pytest
import torch

from distill.losses import forward_kl
from heads.base import build_drafter
from heads.peagle.model import PEagleDrafter
from heads.train_attention import parallel_chain_mask
from heads.saved import load_drafter
from inference.batch_decoder import BucketDecoder
from inference.decoder import Decoder
from inference.sampling import SamplingConfig
from heads.layers import vocab_maps
from serve.export import check_export, export_drafter, load_export
from tests.drafters import (DIMS, PEAGLE_NODE, assert_reloaded_alike, assert_batch_drafts_what_each_row_drafts_alone,
                            assert_sampling_keeps_the_target_distribution, deep_teacher, eagle, perturbed, save,
                            varied_teacher)

NODE = {**PEAGLE_NODE, "layers": [0, 1, 2]}  # the 2-layer tiny target's


def batch_of(ids):
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}


@pytest.fixture(scope="module")
def teacher():
    return varied_teacher()


@pytest.mark.parametrize("vocab,num_layers", [(None, 1), (96, 1), (None, 3)])
def test_training_chains_equal_the_decoding_chain(teacher, vocab, num_layers):
    """With every anchor sampled at every depth, depth d of the chain anchored at a in training computes exactly
    the logits ``propose`` computes for draft d + 1 after a + 2 tokens: pins the parallel mask, the placeholders and
    the positions (a reduced draft vocabulary and stacked layers included)."""
    torch.manual_seed(0)
    drafter = build_drafter({**NODE, "down_sample_ratio": 1.0, "down_sample_ratio_min": 1.0,
                             "draft_vocab_size": vocab, "num_layers": num_layers}, teacher)
    drafter.bind_target(teacher, initialize=True)
    drafter.eval()
    T = 20
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = drafter(batch_of(ids), teacher.signals(batch_of(ids), drafter.teacher_layers))
    assert len(out.terms) == drafter.num_depths
    for a in (0, 5, 12):
        drafter.reset()
        drafter.observe(teacher(ids[:, : a + 1], None, drafter.teacher_layers).hidden)
        with torch.no_grad():
            logits = drafter.chain_logits(ids[0, : a + 2], drafter.num_depths)[:, drafter.d2t]
        for d in range(drafter.num_depths):
            if a + 2 + d < T:  # term d's rows are the anchors 0, 1, ... in order
                torch.testing.assert_close(logits[d], out.terms[d].student_NV[a], atol=1e-5, rtol=1e-5)
        tree = drafter.propose(ids[:, : a + 2], 3)
        assert tree.tokens.tolist() == drafter.d2t[logits[:3].argmax(-1)].tolist()
    # the cached context cropped back to a shorter one (another continuation) drafts as if built afresh
    drafter.reset()
    drafter.observe(teacher(ids[:, :16], None, drafter.teacher_layers).hidden)
    with torch.no_grad():
        drafter.chain_logits(ids[0, :17], 2)
        cropped = drafter.chain_logits(ids[0, :9], drafter.num_depths)[:, drafter.d2t]
    for d in range(drafter.num_depths):
        torch.testing.assert_close(cropped[d], out.terms[d].student_NV[7], atol=1e-5, rtol=1e-5)


def parallel_mask(attn_BT: torch.Tensor, anchors_BN: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[B, 1, Q, Q] bool, ``heads.train_attention.parallel_chain_mask`` as a dense tensor, over the queries [depth 0
    at 0..T-1 | depth 1's n_1 chains | depth 2's n_2 | ...] (chain i of every depth is anchored at
    ``anchors_BN[:, i]``): depth 0 is causal over real tokens (a query always sees itself); a depth-d query of chain
    i sees the depth-0 keys <= its anchor that are real tokens and the depth 1..d keys of chain i."""
    return parallel_chain_mask(attn_BT, anchors_BN, counts, right_padded=False).dense(attn_BT.device)


def test_parallel_mask_sees_the_context_up_to_the_anchor_and_its_own_chain():
    attn = torch.tensor([[1, 1, 1, 1, 0]]).bool()
    anchors = torch.tensor([[2, 0]])
    m = parallel_mask(attn, anchors, [2, 1])[0, 0]  # queries: 5 depth-0, chains (2, 0) at depth 1, chain 2 at depth 2
    assert m.shape == (8, 8)
    assert m[4, :5].tolist() == [True, True, True, True, True]  # a padded query still sees itself
    assert not m[:5, 5:].any()  # depth 0 never sees a slot
    assert m[5].tolist() == [True, True, True, False, False, True, False, False]  # chain at 2, depth 1
    assert m[6].tolist() == [True, False, False, False, False, False, True, False]  # chain at 0, depth 1
    assert m[7].tolist() == [True, True, True, False, False, True, False, True]  # chain at 2, depth 2


def test_depths_sample_nested_shrinking_shares(teacher):
    drafter = PEagleDrafter(DIMS, layers=[1, 1, 2], num_depths=8)
    assert drafter.depth_counts(10) == [7, 5, 4, 3, 2, 2, 2]  # max(0.7^d, 0.2) of the anchors, rounded up
    drafter.bind_target(teacher, initialize=True)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    batch = batch_of(ids)
    batch["attention_mask"][1, 10:] = 0  # a padded row
    batch["loss_mask"][1, 10:] = 0
    anchors, taken, counts = drafter._rank_anchors(batch)
    # each row takes its own share: row 0 of anchors 0 .. 12 (depth 1 predicts a + 3 < 16), row 1 of 0 .. 6
    assert taken.tolist() == [drafter.depth_counts(13), drafter.depth_counts(7)] and counts == drafter.depth_counts(13)
    assert bool((anchors[1, : taken[1, 0]] < 7).all()) and len(set(anchors[0].tolist())) == counts[0]
    out = drafter(batch, teacher.signals(batch, drafter.teacher_layers))
    rows = [int(t.mask_N.sum()) for t in out.terms]  # the rows trained (a term's other rows weigh 0)
    assert rows[0] == int(out.num_valid) == 14 + 8 and rows == sorted(rows, reverse=True)
    assert [len(t.student_ND) for t in out.terms] == [2 * 14, *(2 * n for n in counts)]  # static: B x slots
    assert rows[1] == counts[0] + drafter.depth_counts(7)[0]  # every depth-1 chain drawn is trainable


def test_chains_are_a_function_of_the_row_seed(teacher):
    """A row draws its chains from its own seed (``distill.row_seeds``): the same in any batch, at any index in it,
    whatever the other rows are (so one process and N ranks draw the same); another seed draws others."""
    from distill.row_seeds import ROW_SEED

    drafter = PEagleDrafter(DIMS, layers=[1, 1, 2], num_depths=4)
    ids = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(5))

    def ranked(rows, seeds):
        batch = batch_of(ids[rows])
        batch[ROW_SEED] = torch.tensor(seeds)
        anchors, taken, _ = drafter._rank_anchors(batch)
        return [anchors[b, : taken[b, 0]].tolist() for b in range(len(rows))]

    together = ranked([0, 1, 2], [11, 12, 13])
    assert ranked([2], [13]) == together[2:] and ranked([1, 0], [12, 11]) == together[1::-1]
    assert ranked([0], [14]) != together[:1]
    torch.manual_seed(1)  # the global generator plays no part
    assert ranked([0, 1, 2], [11, 12, 13]) == together
    # a batch without seeds (a held-out evaluation) numbers its rows: the same draw every time
    assert drafter._rank_anchors(batch_of(ids))[0].equal(drafter._rank_anchors(batch_of(ids))[0])


def test_seeded_chains_keep_uniform_nested_shares():
    """Over many seeds every anchor is drawn at depth d with probability n_d / candidates (a uniform random ranking,
    as the per-process random draw it replaces); the shares are nested by construction."""
    from distill.row_seeds import ROW_SEED

    drafter = PEagleDrafter(DIMS, layers=[1, 1, 2], num_depths=4)
    n, T = 4000, 12  # anchors 0 .. 8 (depth 1 predicts a + 3 < 12)
    batch = batch_of(torch.zeros(n, T, dtype=torch.long))
    batch[ROW_SEED] = torch.arange(n) * 7919 + 3
    anchors, taken, counts = drafter._rank_anchors(batch)
    C = 9
    assert counts == drafter.depth_counts(C) == [7, 5, 4]
    for d, n_d in enumerate(counts):
        hits = torch.zeros(T)
        hits.index_add_(0, anchors[:, :n_d].flatten(), torch.ones(n * n_d))
        share = hits[:C] / n
        sd = (n_d / C * (1 - n_d / C) / n) ** 0.5
        assert float((share - n_d / C).abs().max()) < 5 * sd, (d, share)
        assert hits[C:].sum() == 0


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
    """A P-EAGLE drafter (full vocabulary) trained on the target's greedy continuations."""
    prompts, refs, batch = _greedy_batch(teacher)
    torch.manual_seed(0)
    drafter = build_drafter({**NODE, "draft_vocab_size": None}, teacher)
    drafter.bind_target(teacher, initialize=True)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    signals = teacher.signals(batch, drafter.teacher_layers)
    drafter.train()
    losses = []
    for _ in range(40):
        out = drafter(batch, signals)
        assert drafter.count_valid(batch) == out.num_valid
        total, n = out.loss(forward_kl)
        loss = total / n
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert drafter.mask_hidden.grad is not None  # the placeholder trains
    assert all(p.grad is None for p in teacher.model.parameters())  # the frozen target never trains
    return drafter.eval(), losses, prompts, refs


def test_training_reduces_the_loss(trained):
    _, losses, _, _ = trained
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def test_greedy_is_identical_to_plain_batch1_and_batched(teacher, trained):
    drafter, _, prompts, refs = trained
    decoder = Decoder(teacher)
    gens = [decoder.speculative(drafter, p[None], 24, 4) for p in prompts]
    assert [g.new_tokens for g in gens] == refs
    deep = sum(c for g in gens for row in g.stats.counts.values() for a, c in row.items() if a >= 2)
    assert deep > 0  # parallel slots' drafts are accepted too, not only depth 0's
    result = BucketDecoder(teacher).speculative(drafter, prompts, 24, 4)
    assert [g.new_tokens for g in result.generations] == refs
    assert result.stats.forwards < len(prompts) * 24


@pytest.mark.parametrize("vocab,num_layers", [(None, 1), (96, 3)])
def test_a_batch_drafts_what_each_row_drafts_alone(teacher, vocab, num_layers):
    torch.manual_seed(0)
    drafter = build_drafter({**NODE, "draft_vocab_size": vocab, "num_layers": num_layers}, teacher)
    drafter.bind_target(teacher, initialize=True)
    assert_batch_drafts_what_each_row_drafts_alone(teacher, perturbed(drafter, 3, 0.3).eval())


def test_reduced_vocabulary_decodes_identically(teacher):
    torch.manual_seed(0)
    drafter = build_drafter(NODE, teacher)
    drafter.bind_target(teacher, initialize=True)
    g = torch.Generator().manual_seed(1)
    d2t, t2d = vocab_maps(torch.randint(0, 100, (128,), generator=g), drafter.draft_vocab_size)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    drafter = perturbed(drafter, 2, 0.3)
    prompt = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(2))
    want = Decoder(teacher).plain(prompt, 16).new_tokens
    assert Decoder(teacher).speculative(drafter, prompt, 16, 4).new_tokens == want


def test_save_load_round_trip(teacher, trained, tmp_path):
    drafter = trained[0]
    path = save(drafter, tmp_path, "peagle", teacher)
    loaded = load_drafter(path, teacher)
    assert isinstance(loaded, PEagleDrafter)
    assert loaded.teacher_layers == drafter.teacher_layers and loaded.mask_token_id == drafter.mask_token_id
    for name, p in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], p, atol=0, rtol=0)
    p = trained[2][1]
    assert Decoder(teacher).speculative(loaded, p[None], 16, 4).new_tokens == trained[3][1][:16]


# --- export ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_layers", [1, 2])
def test_vllm_export_round_trip(tmp_path, num_layers):
    """Export in vLLM's layout (EAGLE-3's plus mask_hidden and pard_token; stacked layers as layers.1...), check it
    against the loader's transcription, rebuild the drafter from the engine's files only: the same weights and the
    same greedy decoding."""
    import json

    from safetensors.torch import load_file

    teacher = deep_teacher(tmp_path / "target")
    drafter = eagle(teacher, "peagle")
    if num_layers > 1:  # the same drafter with a stacked layer off its init
        torch.manual_seed(1)
        stacked = build_drafter({**PEAGLE_NODE, "num_layers": num_layers}, teacher)
        stacked.bind_target(teacher, initialize=True)
        stacked.load_state_dict({**stacked.state_dict(), **drafter.state_dict()})
        drafter = perturbed(stacked, 5, 0.2)
    path = save(drafter, tmp_path / "run", "peagle", teacher, target_name=str(tmp_path / "target"))
    out = export_drafter(path, "vllm", tmp_path / "vllm")
    assert check_export(out, "vllm", "peagle", teacher.identity()) == []
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["pard_token"] == drafter.mask_token_id
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and config["draft_vocab_size"] == 96
    weights = load_file(str(out / "model.safetensors"))
    assert weights["mask_hidden"].shape == (1, 3 * 32) and config["num_hidden_layers"] == num_layers
    assert ("layers.1.self_attn.q_proj.weight" in weights) == (num_layers > 1)
    assert '"parallel_drafting": true' in (out / "README.md").read_text()
    reloaded = load_export(out, teacher)
    assert isinstance(reloaded, PEagleDrafter) and reloaded.num_depths == drafter.num_depths
    assert_reloaded_alike(drafter, reloaded, teacher)
    if num_layers > 1:  # a stacked layer's shard gone: the check names it
        from safetensors.torch import save_file

        del weights["layers.1.mlp.up_proj.weight"]
        save_file(weights, str(out / "model.safetensors"))
        problems = check_export(out, "vllm", "peagle", teacher.identity())
        assert "layers.1.mlp.gate_up_proj: shards ['up_proj'] are missing, the packed parameter would be partly " \
               "unset" in problems


@pytest.mark.parametrize("num_layers", [1, 2])
def test_speculators_export_round_trip(tmp_path, num_layers):
    """Export in the speculators format (speculators' EAGLE-3 layout plus its P-EAGLE keys: mask_token_id,
    mask_hidden [1, 1, 3 x hidden], stacked plain layers as layers.1...), check it against the loader's
    transcription, rebuild the drafter from those files only: the same weights and the same greedy decoding."""
    import json

    from safetensors.torch import load_file

    teacher = deep_teacher(tmp_path / "target")
    drafter = _stacked(teacher, num_layers)
    path = save(drafter, tmp_path / "run", "peagle", teacher, target_name=str(tmp_path / "target"))
    out = export_drafter(path, "speculators", tmp_path / "spec")
    assert check_export(out, "speculators", "peagle", teacher.identity()) == []
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["PEagleSpeculator"] and config["speculators_model_type"] == "peagle"
    assert config["speculators_config"]["algorithm"] == "peagle" and config["mask_token_id"] == drafter.mask_token_id
    assert config["transformer_layer_config"]["num_hidden_layers"] == num_layers
    weights = load_file(str(out / "model.safetensors"))
    assert weights["mask_hidden"].shape == (1, 1, 3 * 32)
    assert ("layers.1.self_attn.q_proj.weight" in weights) == (num_layers > 1)
    assert "vllm serve" in (out / "README.md").read_text()
    reloaded = load_export(out, teacher)
    assert_reloaded_alike(drafter, reloaded, teacher)
    weights["mask_hidden"] = weights["mask_hidden"][0]  # vLLM's [1, 3D] shape: speculators' loader rejects it
    from safetensors.torch import save_file

    save_file(weights, str(out / "model.safetensors"))
    assert any("mask_hidden has shape (1, 96); speculators reads [1, 1, 96]" in p
               for p in check_export(out, "speculators", "peagle", teacher.identity()))


def test_speculators_loader_reads_our_export(tmp_path):
    """The real loader: speculators' own P-EAGLE class reads the export, every exported tensor landing on one of its
    parameters or buffers unchanged, and only what it takes from the verifier left out (stacked layer and
    mask_hidden included)."""
    pytest.importorskip("speculators", reason="speculators is an optional extra (pip install --no-deps "
                                              "speculators==0.9.0 and its import deps; .ci/run installs it)")
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    teacher = deep_teacher(tmp_path / "target")
    drafter = _stacked(teacher, 2)
    path = save(drafter, tmp_path / "run", "peagle", teacher, target_name=str(tmp_path / "target"))
    out = export_drafter(path, "speculators", tmp_path / "spec")
    config = PEagleSpeculatorConfig.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = PEagleDraftModel.from_pretrained(out, config=config)
    assert theirs.mask_token_id == drafter.mask_token_id and theirs.target_layer_ids == [1, 2, 3]
    from safetensors.torch import load_file

    exported, state = load_file(str(out / "model.safetensors")), theirs.state_dict()
    assert set(exported) <= set(state), set(exported) - set(state)  # nothing skipped
    for name, value in exported.items():
        assert torch.equal(state[name].to(value.dtype), value), name
    assert set(state) - set(exported) <= {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    ours = drafter.state_dict()
    pairs = {"mask_hidden": ours["mask_hidden"][None, None], "fc.weight": ours["fc.weight"],
             "lm_head.weight": ours["lm_head.weight"], "norm.weight": ours["norm.weight"],
             "layers.0.self_attn.q_proj.weight": ours["layer.q_proj.weight"],
             "layers.0.hidden_norm.weight": ours["hidden_norm.weight"],
             "layers.1.self_attn.q_proj.weight": ours["upper.0.layer.q_proj.weight"],
             "layers.1.input_layernorm.weight": ours["upper.0.input_layernorm.weight"],
             "layers.1.mlp.down_proj.weight": ours["upper.0.layer.down_proj.weight"]}
    for name, value in pairs.items():
        torch.testing.assert_close(state[name].float(), value, msg=name)
    assert len(theirs.layers) == 2


def _stacked(teacher, num_layers):
    """The export tests' drafter: EAGLE-3's layer off its init, and ``num_layers - 1`` stacked layers off theirs."""
    drafter = eagle(teacher, "peagle")
    if num_layers > 1:
        torch.manual_seed(1)
        stacked = build_drafter({**PEAGLE_NODE, "num_layers": num_layers}, teacher)
        stacked.bind_target(teacher, initialize=True)
        stacked.load_state_dict({**stacked.state_dict(), **drafter.state_dict()})
        drafter = perturbed(stacked, 5, 0.2)
    return drafter


def test_vllm_check_catches_a_departure(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    teacher = deep_teacher(tmp_path / "target")
    path = save(eagle(teacher, "peagle"), tmp_path / "run", "peagle", teacher)
    out = export_drafter(path, "vllm", tmp_path / "vllm")
    state = load_file(str(out / "model.safetensors"))
    del state["mask_hidden"]
    save_file(state, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["pard_token"] = 10_000
    (out / "config.json").write_text(json.dumps(config))
    problems = check_export(out, "vllm", "peagle", teacher.identity())
    assert "pard_token=10000 is not a token id of the vocabulary" in problems
    assert any("'mask_hidden' is missing" in p for p in problems)


def test_export_refuses_unsupported_engines_and_uncaptured_layers(tmp_path):
    teacher = deep_teacher(tmp_path / "target")
    path = save(eagle(teacher, "peagle"), tmp_path / "run", "peagle", teacher)
    with pytest.raises(ValueError, match="SGLang has no P-EAGLE .* format=speculators"):
        export_drafter(path, "sglang", tmp_path / "sglang")
    torch.manual_seed(0)
    top = build_drafter({**PEAGLE_NODE, "layers": [1, 2, 4]}, teacher)
    top.bind_target(teacher, initialize=True)
    path = save(top, tmp_path / "run4", "peagle", teacher)
    with pytest.raises(ValueError, match=r"drafter.layers=\[1, 2, 4\].*final normed output"):
        export_drafter(path, "vllm", tmp_path / "vllm4")


# --- the sampled output distribution through the real decode loop ------------------------------------------------

# Batch 1 (slow) repeats tests/test_dflash.py's [1]: the same Decoder verify step and the same sampled static chain
# (heads.draft_model.draft.draw_chain); P-EAGLE's own sampled-step distributions are checked against propose's in
# test_static_draft_drafts_what_propose_drafts, and its sampled chain decodes losslessly at batch 4 here.
@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.slow), 4])
def test_sampled_output_distribution_is_the_targets(batch):
    """Temperature-1 sampling through the decode loop (batch 1 and the batched loop, one prompt per row) draws each
    3-token continuation with the target's own probability."""
    node = {**NODE, "num_depths": 3, "draft_vocab_size": None, "layers": [1, 1, 2]}
    assert_sampling_keeps_the_target_distribution(node, batch)


# --- configuration ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value,match", [
    ("num_depths", 0, "drafter.num_depths=0"), ("layers", [1, 5, 2], "drafter.layers contains 5"),
    ("mask_token_id", 128, "drafter.mask_token_id=128"), ("depth", 9, "drafter.depth=9"),
    ("down_sample_ratio", 0.0, "drafter.down_sample_ratio=0.0"), ("num_layers", 0, "drafter.num_layers=0")])
def test_bad_config_names_the_key(key, value, match):
    with pytest.raises(ValueError, match=match):
        PEagleDrafter(DIMS, **{"layers": [1, 1, 2], key: value})


def test_trees_are_refused_with_the_fix():
    drafter = PEagleDrafter(DIMS, layers=[1, 1, 2])
    assert not drafter.dynamic_tree
    with pytest.raises(ValueError, match="decoder.tree='dynamic'.*set decoder.tree=null"):
        drafter.set_tree("dynamic")


# --- the static (capture-safe) draft step ---------------------------------------------------------------------

def _static_drafter(teacher, vocab=96, num_layers=1):
    torch.manual_seed(0)
    drafter = perturbed(build_drafter({**NODE, "draft_vocab_size": vocab, "num_layers": num_layers}, teacher), 3, 0.2)
    drafter.bind_target(teacher, initialize=False)
    return drafter


@pytest.mark.parametrize("prompt_len,vocab,num_layers", [(5, None, 1), (11, 96, 1), (11, 96, 2)])
def test_static_draft_drafts_what_propose_drafts(teacher, prompt_len, vocab, num_layers):
    """Played through the step decoder's stand-in with a varying accepted length per step: every static draft
    equals the eager ``propose`` on the same context (greedy), and the sampled step's distributions are the eager
    logits' (its draws lie in their support); a reduced draft vocabulary included."""
    from inference.sampling import GREEDY, warp
    from tests.static_harness import committed_for, play_steps

    drafter = _static_drafter(teacher, vocab, num_layers)
    M = 4
    for sampling in (GREEDY, SamplingConfig(temperature=0.8, top_k=20)):
        committed = committed_for(drafter, M)
        static = drafter.static_draft(committed, 64, sampling, torch.Generator().manual_seed(0))
        assert static is drafter.static_draft(committed, 64, sampling, static.generator)  # reused, not rebuilt

        def check(step, context):
            if sampling.greedy:
                eager = drafter.propose(context, M - 1, GREEDY)
                assert static.buffers.tokens_T.tolist() == eager.tokens.tolist(), step
                return
            with torch.no_grad():
                want = warp(drafter.chain_logits(context[0], M - 1), sampling)
            torch.testing.assert_close(static.buffers.probs_TV, want, atol=1e-5, rtol=1e-5)
            assert bool((want.gather(1, static.buffers.tokens_T[:, None]) > 0).all())

        play_steps(teacher, drafter, static, committed, prompt_len, 8, static.draft, check)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_compiled_static_draft_is_one_graph_in_place(teacher, num_layers):
    """The step compiles to one graph (fullgraph, no recompile over two prompts and varying accepted lengths),
    keeps its tensors at one address, shape and stride, and drafts what ``propose`` drafts."""
    from inference.sampling import GREEDY
    from tests.static_harness import committed_for, layout, one_graph_over_plays, tensors_of

    drafter = _static_drafter(teacher, num_layers=num_layers)
    committed = committed_for(drafter, 5)
    static = drafter.static_draft(committed, 128, GREEDY, None)
    before = layout(tensors_of(static))

    def check(i, context):
        assert static.buffers.tokens_T.tolist() == drafter.propose(context, 4, GREEDY).tokens.tolist(), i

    one_graph_over_plays(teacher, drafter, static, committed, (7, 12), 12, check)
    assert layout(tensors_of(static)) == before

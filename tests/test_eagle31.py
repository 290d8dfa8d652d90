"""EAGLE-3.1's flags (``fc_norm``, ``norm_before_fc``, ``norm_output``) and the draft attention window
(``sliding_window``) on EAGLE-3 and P-EAGLE: off they change nothing, on they train, training-time test equals
decoding, every decoding path (eager, batched rows, static step) drafts alike and decodes losslessly."""

from __future__ import annotations

import pytest
import torch

from distill.losses import forward_kl
from heads.base import build_drafter
from heads.eagle.model import EagleDrafter
from heads.peagle.model import PEagleDrafter
from inference.decoder import Decoder
from inference.sampling import GREEDY
from tests import test_eagle as plain
from tests.drafters import PEAGLE_NODE, eager_proposals, perturbed, varied_teacher
from tests.test_eagle import DIMS, batch_of, make

# Each flag alone, and a window with the norms (the window short enough to cut the toy prompts' context).
FLAGGED = [
    ("eagle3", {"draft_vocab_size": 96, "fc_norm": True}),
    ("eagle3", {"draft_vocab_size": 96, "norm_before_fc": True}),
    ("eagle3", {"draft_vocab_size": 96, "norm_output": True}),
    ("eagle3", {"draft_vocab_size": 96, "sliding_window": 5}),
    ("eagle3", {"fc_norm": True, "norm_output": True, "sliding_window": 4}),
]
IDS = ["fc_norm", "norm_before_fc", "norm_output", "window", "all"]
PEAGLE = [{"fc_norm": True}, {"norm_before_fc": True, "norm_output": True}, {"sliding_window": 4, "num_layers": 2},
          {"fc_norm": True, "norm_output": True, "sliding_window": 5, "draft_vocab_size": 96}]
PEAGLE_IDS = ["fc_norm", "norm_before_fc+norm_output", "window+layers", "all"]


@pytest.fixture(scope="module")
def teacher():
    return varied_teacher()


def test_flags_off_build_and_compute_the_plain_drafter(tiny_teacher):
    """Every flag written out as off is the drafter built without them: the same state_dict keys (no norm the
    engines would not load), the same training outputs and the same drafts, bit for bit."""
    base = make(tiny_teacher, "eagle3", ttt_steps=3, draft_vocab_size=96)
    off = make(tiny_teacher, "eagle3", ttt_steps=3, draft_vocab_size=96, fc_norm=False, norm_before_fc=False,
               norm_output=False, sliding_window=None)
    assert list(off.state_dict()) == list(base.state_dict())
    assert not any("fc_norm" in k or "input_norm" in k for k in base.state_dict())
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = base(batch_of(ids), tiny_teacher.signals(batch_of(ids), base.teacher_layers))
        b = off(batch_of(ids), tiny_teacher.signals(batch_of(ids), off.teacher_layers))
    for ta, tb in zip(a.terms, b.terms, strict=True):
        assert torch.equal(ta.student_NV, tb.student_NV)
    base.reset(), off.reset()
    for d in (base, off):
        d.observe(tiny_teacher(ids[:1, :11], None, d.teacher_layers).hidden)
    ta, tb = base.propose(ids[:1, :12], 3), off.propose(ids[:1, :12], 3)
    assert ta.tokens.tolist() == tb.tokens.tolist() and ta.parents.tolist() == tb.parents.tolist()


def test_flags_add_the_engines_norms():
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(EagleDrafter(DIMS, fc_norm=True).state_dict())
    assert EagleDrafter(DIMS, norm_before_fc=True).input_norm.weight.shape == (3 * DIMS.hidden_size,)
    assert set(EagleDrafter(DIMS, norm_output=True).state_dict()) == set(EagleDrafter(DIMS).state_dict())


@pytest.mark.parametrize("kw,match", [
    ({"fc_norm": True, "norm_before_fc": True}, r"drafter.fc_norm=true and drafter.norm_before_fc=true.*set one"),
    ({"variant": "eagle1", "norm_output": True}, r"drafter.norm_output is an EAGLE-3 setting.*variant='eagle1'"),
    ({"sliding_window": 0}, r"drafter.sliding_window=0 must be an integer >= 1"),
])
def test_bad_flags_name_the_key_and_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        EagleDrafter(DIMS, **kw)
    if kw.get("variant") is None:
        with pytest.raises(ValueError, match=match):
            PEagleDrafter(DIMS, **kw)


@pytest.mark.parametrize("variant,kw", FLAGGED, ids=IDS)
def test_flagged_training_time_test_equals_decoding(tiny_teacher, variant, kw):
    plain.test_training_time_test_equals_decoding(tiny_teacher, variant, kw)


@pytest.mark.parametrize("variant,kw", FLAGGED, ids=IDS)
def test_flagged_drafters_train(tiny_teacher, variant, kw):
    """A step's loss reaches the flags' norms, and a few steps on one batch lower it."""
    drafter = make(tiny_teacher, variant, ttt_steps=3, **kw).train()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    signals = tiny_teacher.signals(batch_of(ids), drafter.teacher_layers)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss, n = drafter(batch_of(ids), signals).loss(forward_kl)
        (loss / n).backward()
        grads = {k for k, p in drafter.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        opt.step(), opt.zero_grad()
        losses.append(float(loss.detach() / n))
    if kw.get("fc_norm"):
        assert {f"fc_norm.{i}.weight" for i in range(3)} <= grads
    if kw.get("norm_before_fc"):
        assert "input_norm.weight" in grads
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("variant,kw", FLAGGED, ids=IDS)
@pytest.mark.parametrize("tree", ["dynamic", "chain"])
def test_flagged_greedy_identity(tiny_teacher, variant, kw, tree):
    plain.test_greedy_identity(tiny_teacher, variant, kw, tree)


@pytest.mark.parametrize("variant,kw", FLAGGED[3:], ids=IDS[3:])
def test_flagged_batches_draft_what_each_row_drafts_alone(tiny_teacher, variant, kw):
    plain.test_a_batch_drafts_what_each_row_drafts_alone(tiny_teacher, variant, kw, "dynamic")


def test_window_cuts_the_context(tiny_teacher):
    """The window is not a no-op on the toy prompts: a context token outside it changes nothing, inside it does."""
    drafter = make(tiny_teacher, "eagle3", sliding_window=4, draft_vocab_size=96)
    ids = torch.randint(0, 128, (1, 14), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[0, 2] = (changed[0, 2] + 5) % 128  # pair 1 (token 2): 12 positions before the root, outside the window

    def root_logits(seq):
        drafter.reset()
        drafter.observe(tiny_teacher(ids[:, :13], None, drafter.teacher_layers).hidden)  # the same features
        with torch.no_grad():
            return drafter._logits(drafter._advance(seq[0])[None])

    assert torch.equal(root_logits(ids), root_logits(changed))
    changed[0, 11] = (changed[0, 11] + 5) % 128  # inside the window
    assert not torch.allclose(root_logits(ids), root_logits(changed))


def _peagle(teacher, **kw):
    torch.manual_seed(0)
    node = {**PEAGLE_NODE, "layers": [0, 1, 2], **kw}
    drafter = perturbed(build_drafter(node, teacher), 3, 0.2)
    drafter.bind_target(teacher, initialize=False)
    return drafter.eval()


@pytest.mark.parametrize("kw", PEAGLE, ids=PEAGLE_IDS)
def test_flagged_peagle_training_equals_decoding_and_decodes_losslessly(teacher, kw):
    """Depth d of the chain at anchor a in training computes what ``propose`` computes after a + 2 tokens (all
    anchors sampled at every depth); the eager, batched and static paths decode plain greedy decoding's tokens."""
    from inference.batch_decoder import BucketDecoder

    drafter = _peagle(teacher, down_sample_ratio=1.0, down_sample_ratio_min=1.0, **kw)
    T = 20
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = drafter(batch_of(ids), teacher.signals(batch_of(ids), drafter.teacher_layers))
    for a in (0, 5, 12):
        drafter.reset()
        drafter.observe(teacher(ids[:, : a + 1], None, drafter.teacher_layers).hidden)
        with torch.no_grad():
            logits = drafter.chain_logits(ids[0, : a + 2], drafter.num_depths)[:, drafter.d2t]
        for d in range(drafter.num_depths):
            if a + 2 + d < T:
                torch.testing.assert_close(logits[d], out.terms[d].student_NV[a], atol=1e-5, rtol=1e-5)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (1, n), generator=gen) for n in (3, 9, 14)]
    dec = Decoder(teacher)
    want = [dec.plain(p, 24).new_tokens for p in prompts]
    assert [dec.speculative(drafter, p, 24, 4).new_tokens for p in prompts] == want
    with eager_proposals(drafter):  # one row through the eager proposal
        assert [BucketDecoder(teacher).speculative(drafter, [p[0]], 24, 4).generations[0].new_tokens
                for p in prompts] == want
    batched = BucketDecoder(teacher).speculative(drafter, prompts, 24, 4)
    assert [g.new_tokens for g in batched.generations] == want


@pytest.mark.parametrize("kw", PEAGLE, ids=PEAGLE_IDS)
def test_flagged_peagle_static_draft_drafts_what_propose_drafts(teacher, kw):
    from tests.static_harness import committed_for, play_steps

    drafter = _peagle(teacher, **kw)
    M = 4
    committed = committed_for(drafter, M)
    static = drafter.static_draft(committed, 64, GREEDY, torch.Generator().manual_seed(0))

    def check(step, context):
        assert static.buffers.tokens_T.tolist() == drafter.propose(context, M - 1, GREEDY).tokens.tolist(), step

    play_steps(teacher, drafter, static, committed, 11, 8, static.draft, check)


@pytest.mark.parametrize("variant,kw", FLAGGED[2:], ids=IDS[2:])
@pytest.mark.parametrize("tree", ["dynamic", "chain"])
def test_flagged_static_draft_drafts_what_propose_drafts(teacher, variant, kw, tree):
    """EAGLE-3's static step (catch-up and every level in one capture-safe step) drafts the eager proposal's tree,
    step after step, past the window."""
    from tests.static_harness import committed_for
    from tests.test_static_draft import play

    drafter = make(teacher, variant, tree=tree, **kw)
    committed = committed_for(drafter, 4)
    static = drafter.static_draft(committed, 64, GREEDY, None)
    play(drafter, static, committed, teacher, 11, 8, static.draft)


@pytest.mark.parametrize("engine", ["vllm", "speculators"])
def test_flagged_peagle_exports_round_trip(tmp_path, engine):
    """P-EAGLE's exports carry the flags and the window (every stacked layer sliding) as EAGLE-3's do; rebuilt from
    the export alone, the drafter decodes as the checkpoint does; SGLang is refused for P-EAGLE at all."""
    import json

    from safetensors.torch import load_file

    from heads.layers import vocab_maps
    from heads.saved import save_drafter
    from serve.export import check_export, export_drafter, load_export
    from tests.drafters import TRAINED, assert_reloaded_alike, deep_teacher

    teacher = deep_teacher(tmp_path / "target")
    node = {**PEAGLE_NODE, "num_layers": 2, "fc_norm": True, "norm_output": True, "sliding_window": 6}
    torch.manual_seed(0)
    drafter = build_drafter(node, teacher)
    drafter.bind_target(teacher, initialize=True)
    d2t, t2d = vocab_maps(torch.randint(0, 100, (128,), generator=torch.Generator().manual_seed(1)), 96)
    drafter.d2t.copy_(d2t), drafter.t2d.copy_(t2d)
    drafter = perturbed(drafter, 5, 0.3)
    path = save_drafter(drafter, tmp_path / "run" / "drafter", drafter.saved_config(node),
                        {"source": "hf", "name": str(tmp_path / "target")}, teacher.identity(), TRAINED)
    out = export_drafter(path, engine, tmp_path / engine)
    assert check_export(out, engine, "peagle", teacher.identity()) == []
    config = json.loads((out / "config.json").read_text())
    llama = config.get("transformer_layer_config", config)
    assert config["fc_norm"] and config["norm_output"] and not config["norm_before_fc"]
    assert llama["layer_types"] == ["sliding_attention"] * 2 and llama["sliding_window"] == 6
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(load_file(str(out / "model.safetensors")))
    reloaded = load_export(out, teacher)
    assert reloaded.fc_norm_on and reloaded.norm_output and reloaded.sliding_window == 6
    assert_reloaded_alike(drafter, reloaded, teacher)


def test_flagged_static_draft_compiles_to_one_graph(monkeypatch):
    """The flags and the window keep EAGLE-3's static step one capture-safe graph (fullgraph, no recompile over two
    prompts and varying accepted lengths) drafting what ``propose`` drafts."""
    from tests import test_static_draft as static

    target = static.Teacher(static.make_tiny_llama(initializer_range=0.2), tokenizer=None, name="tiny-llama-varied")
    kw = {"draft_vocab_size": 96, "fc_norm": True, "norm_output": True, "sliding_window": 6}
    monkeypatch.setitem(static.KINDS, "eagle31", lambda t: static.eagle(t, "eagle3", "dynamic", **kw))
    static.test_compiled_draft_is_one_graph_and_drafts_what_propose_does(target, "eagle31")

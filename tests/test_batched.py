"""Batched decoding (inference.batch_decoder), the load-aware policy (inference.policy), the sweep (eval.batch_sweep).

Losslessness per sequence: greedy outputs at batch 8 are token-identical to each prompt decoded alone (56 prompts of
3..60 tokens, five drafter kinds incl. trees and hidden-state drafters, ragged acceptance, EOS, smaller buckets); sampled
outputs at batch 4 are distributed as the target (the decoder-level test of tests/test_lossless_sampling.py, per
row). The policy is tested on synthetic cost tables; speed numbers live in scripts/bench_batch.py's JSON, not here.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from distill.teacher import Teacher
from heads.base import TargetDims, build_drafter
from heads.draft_model.model import DraftModel
from heads.eagle.model import EagleDrafter
from heads.base import fork_drafter
from inference.batch_decoder import BucketDecoder
from inference.decoder import Decoder, DecoderConfig
from inference.policy import (
    CostTable,
    LoadAwarePolicy,
    calibrate,
    check_batch_sizes,
    make_policy,
    tau_by_gamma,
)
from inference.sampling import SamplingConfig
from tests.conftest import make_tiny_llama
from tests.drafters import noisy_medusa
from tests.test_lossless_sampling import (
    LENGTH,
    _decoder_setup,
    _exact_continuations,
    tv,
)

DIMS = TargetDims(hidden_size=32, vocab_size=128, num_layers=2)
NEW = 20
INIT = 0.2  # conftest's default init makes the tiny Llama repeat one token forever; this one writes varied text


def target_model():
    return make_tiny_llama(initializer_range=INIT)


def prompts_of_varied_lengths(n=56, seed=1):
    """Lengths 3..60; each repeats its first half so prompt lookup has matches (and misses)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 2 + (i * 11) % 39
        p = torch.randint(0, 128, (length,), generator=g)
        out.append(torch.cat([p, p[: length // 2]]))
    return out


def noisy_draft_model(scale=0.05, seed=3):
    """A second tiny Llama: the target's weights plus noise, so it agrees with the target often but not always."""
    model = target_model()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return DraftModel(DIMS, model=model)


def eagle(teacher, tree):
    torch.manual_seed(0)
    drafter = EagleDrafter(DIMS, variant="eagle1", tree=tree, top_k=2, total_tokens=6)
    drafter.bind_target(teacher, initialize=True)
    return drafter.eval()


def make_drafter(kind, teacher):
    if kind == "lookup":
        return build_drafter({"_target_": "heads.lookup.PromptLookup"}, teacher)
    if kind == "draft_model":
        return noisy_draft_model()
    if kind == "medusa_tree":  # hidden states + a static tree: ragged paths that are not prefixes
        drafter = noisy_medusa(teacher, scale=0.05)
        drafter.set_tree("default")
        return drafter
    return eagle(teacher, "chain" if kind == "eagle_chain" else "dynamic")


@pytest.fixture(scope="module")
def teacher():
    return Teacher(target_model(), tokenizer=None, name="tiny-llama")


@pytest.fixture(scope="module")
def prompts():
    return prompts_of_varied_lengths()


@pytest.fixture(scope="module")
def references(teacher, prompts):
    decoder = Decoder(teacher)
    return [decoder.plain(p[None], NEW).new_tokens for p in prompts]


def decode_in_batches(decode, prompts, batch):
    gens = []
    for i in range(0, len(prompts), batch):
        gens.append(decode(prompts[i: i + batch]))
    return gens


def test_plain_batch8_is_identical_to_batch1(teacher, prompts, references):
    gens = decode_in_batches(lambda chunk: BucketDecoder(teacher).plain(chunk, NEW), prompts, 8)
    assert [g.new_tokens for b in gens for g in b.generations] == references
    assert all(set(b.gamma_steps) == {0} for b in gens)


# Slow: tests/test_batch_decoder.py's batches of 1, 3 and 8 cover every drafter kind on fewer prompts
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lookup", "draft_model", "medusa_tree", "eagle_chain", "eagle_tree"])
def test_speculative_batch8_is_identical_to_batch1(teacher, prompts, references, kind):
    drafter = make_drafter(kind, teacher)
    decoder = BucketDecoder(teacher)
    gens = decode_in_batches(lambda chunk: decoder.speculative(drafter, chunk, NEW, num_draft=3), prompts, 8)
    outputs = [g.new_tokens for b in gens for g in b.generations]
    for i, (ours, ref) in enumerate(zip(outputs, references)):
        assert ours == ref, f"{kind}: prompt {i} (length {prompts[i].shape[0]}) differs from batch-1 greedy"
    counts = {}
    for b in gens:
        for k, row in b.stats.counts.items():
            for a, c in row.items():
                counts[(k, a)] = counts.get((k, a), 0) + c
    assert any(a > 0 for k, a in counts), f"{kind}: no draft was ever accepted; the test would mean little"
    assert any(k > a for k, a in counts), f"{kind}: no draft was ever rejected; ragged acceptance is untested"
    assert any(len(b.bucket_steps) > 1 for b in gens), f"{kind}: no batch moved to a smaller bucket"


def test_batch_of_one_matches_the_batch1_decoder(teacher, prompts, references):
    drafter = make_drafter("draft_model", teacher)
    ours = BucketDecoder(teacher).speculative(drafter, prompts[:1], NEW, 3)
    theirs = Decoder(teacher).speculative(drafter, prompts[0][None], NEW, 3)
    assert ours.generations[0].new_tokens == theirs.new_tokens == references[0]
    assert ours.stats.counts == theirs.stats.counts  # same proposals, same verdicts


def test_eos_finishes_rows_at_different_steps(teacher, prompts, references):
    # The token whose first occurrence falls at the most different places: rows then stop at different steps.
    firsts = {t: {r.index(t) for r in references[:16] if t in r[1:]} for r in references[:16] for t in r[1:]}
    eos = max(sorted(firsts), key=lambda t: len(firsts[t]))
    single = Decoder(teacher, eos_token_id=eos)
    refs = [single.plain(p[None], NEW).new_tokens for p in prompts[:16]]
    assert len({len(r) for r in refs}) > 1, "the test needs rows that stop at different lengths"
    decoder = BucketDecoder(teacher, eos_token_id=eos)
    drafter = make_drafter("draft_model", teacher)
    for gen in (decoder.plain(prompts[:16], NEW), decoder.speculative(drafter, prompts[:16], NEW, 3)):
        assert [g.new_tokens for g in gen.generations] == refs
        assert len(gen.live_steps) > 1  # finished rows left the batch


def test_forks_share_weights_not_state(teacher, prompts):
    drafter = noisy_draft_model()
    a, b = fork_drafter(drafter, 1), fork_drafter(drafter, 2)
    assert a.model is b.model is drafter.model
    a.propose(prompts[0][None], 3)
    assert a._cache is not None and b._cache is None and drafter._cache is None


def test_bad_inputs(teacher, prompts):
    decoder = BucketDecoder(teacher)
    with pytest.raises(ValueError, match="no prompts"):
        decoder.plain([], 5)
    with pytest.raises(ValueError, match="prompt 0 of the batch of 3: empty prompt"):
        decoder.plain([[], [], []], 5)
    too_long = "prompt 1 of the batch of 2: .*max_position_embeddings=256.*eval.max_new_tokens"
    with pytest.raises(ValueError, match=too_long):
        decoder.speculative(make_drafter("lookup", teacher), [prompts[0], torch.zeros(250, dtype=torch.long)], 10, 3)
    with pytest.raises(ValueError, match="vocab_size=64 but the target has 128"):
        decoder.speculative(DraftModel(TargetDims(32, 64, 2), model=make_tiny_llama(vocab_size=64)), prompts[:2], 5, 3)


def tiny_mistral(window=16):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, vocab_size=128, sliding_window=window, max_position_embeddings=256,
                           initializer_range=INIT)
    return Teacher(MistralForCausalLM(config).eval(), tokenizer=None, name="tiny-mistral")


def test_sliding_window_target_batch8_is_identical_to_batch1_past_the_window(prompts):
    """Prompts of 3..60 tokens + 20 new against a window of 16: batch-1 greedy equals the model's own full forward
    (no cache, HF's sliding mask), and batch 8 equals batch 1, plain and with a Medusa tree (holes and trees)."""
    teacher = tiny_mistral()
    model = teacher.model
    for p in prompts[:6]:  # the reference without any cache: greedy by repeated full forwards
        ids = p[None]
        for _ in range(NEW):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], 1)
        assert Decoder(teacher).plain(p[None], NEW).new_tokens == ids[0, p.shape[0]:].tolist()
    references = [Decoder(teacher).plain(p[None], NEW).new_tokens for p in prompts]
    drafter = noisy_medusa(teacher, scale=0.05)
    drafter.set_tree("default")
    for decode in (lambda c: BucketDecoder(teacher).plain(c, NEW),
                   lambda c: BucketDecoder(teacher).speculative(drafter, c, NEW, 4)):
        gens = decode_in_batches(decode, prompts, 8)
        assert [g.new_tokens for b in gens for g in b.generations] == references
    assert Decoder(teacher).speculative(drafter, prompts[-1][None], NEW, 4).new_tokens == references[-1]


def test_unsupported_attention_layer_types_are_refused_with_the_list():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama4_text", hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                                  num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  vocab_size=128, num_local_experts=2, attention_chunk_size=8)
    teacher = Teacher(AutoModelForCausalLM.from_config(config).eval(), tokenizer=None, name="tiny-llama4")
    for decoder in (Decoder, BucketDecoder):
        with pytest.raises(ValueError, match=r"chunked_attention.*supports \['full_attention', 'sliding_attention'\]"):
            decoder(teacher)


# --- sampling: the output distribution per row at batch > 1 ----------------------------------------------------------


@pytest.mark.parametrize("batches", [pytest.param(700, id="700"), pytest.param(5_000, id="5k", marks=pytest.mark.slow)])
# medusa_tree (slow): eagle_tree takes the same batched tree verify; Medusa's sampled tree is
# test_lossless_sampling.py::test_decoder_output_distribution[medusa_tree-exact-4k]
@pytest.mark.parametrize("kind", ["draft_model", pytest.param("medusa_tree", marks=pytest.mark.slow), "eagle_tree"])
def test_sampling_distribution_at_batch_4(batches, kind):
    """Rows of two prompts of different lengths (left padding, ragged acceptance) decoded 4 at a time with a sampled
    draft model (Leviathan/Chen), a top-k Medusa tree or an EAGLE dynamic tree drafted for all rows at once by their
    static draft steps (recursive rejection): each prompt's first 3 tokens must match the target's exact
    distribution."""
    teacher, drafter = _decoder_setup(kind)
    short, long = torch.tensor([[1, 2, 3]]), torch.tensor([[3, 0, 2, 1, 1, 0, 2]])
    decoder = BucketDecoder(teacher, sampling=SamplingConfig(temperature=1.0), seed=0)
    counts = {0: torch.zeros((4,) * LENGTH), 1: torch.zeros((4,) * LENGTH)}
    accepted = 0
    for _ in range(batches):
        gen = decoder.speculative(drafter, [short[0], long[0], long[0], short[0]], LENGTH, num_draft=2)
        for row, which in enumerate((0, 1, 1, 0)):
            counts[which][tuple(gen.generations[row].new_tokens)] += 1
        accepted += sum(a * c for row in gen.stats.counts.values() for a, c in row.items())
    assert accepted > batches // 5  # drafts are accepted often enough for the check to cover them
    assert decoder._drafts  # drafted by the static draft step at the bucket's rows (inference.batch_draft)
    for which, prompt in ((0, short), (1, long)):
        exact = _exact_continuations(teacher.model, prompt, LENGTH)
        n = 2 * batches
        tol = 2 * 0.5 * float(torch.sqrt(2 * exact * (1 - exact) / (torch.pi * n)).sum())  # see test_lossless_sampling
        distance = tv(counts[which] / n, exact)
        assert distance < tol, f"prompt {which}: TV {distance:.4f} exceeds {tol:.4f}"


# --- the load-aware policy --------------------------------------------------------------------------------------------


def table(verify_per_token: float, base: float = 1e-3, draft: float = 1e-5, compute_bound: float = 0.0):
    """A synthetic cost table: t_verify(B, n) = base + verify_per_token·n + compute_bound·B·n."""
    sizes = [1, 2, 4, 8, 16, 32]
    t_verify = {B: {n: base + verify_per_token * n + compute_bound * B * n for n in range(1, 6)} for B in sizes}
    return CostTable(t_verify, {g: draft * g for g in range(1, 5)}, {1: 1.7, 2: 2.2, 3: 2.5, 4: 2.7})


def test_policy_picks_gamma_from_costs():
    assert LoadAwarePolicy(table(verify_per_token=1e-2), 4)(1) == 0  # verification dear: never speculate
    assert LoadAwarePolicy(table(verify_per_token=1e-6), 4)(1) == 4  # verification free: draft all 4
    policy = LoadAwarePolicy(table(verify_per_token=1e-6, compute_bound=2e-4), 4)
    plan = policy.plan([1, 2, 4, 8, 16, 32])
    assert plan[1] > 0 and plan[32] == 0 and list(plan.values()) == sorted(plan.values(), reverse=True)
    assert policy(3) in range(plan[4], plan[2] + 1)  # an unmeasured live batch size interpolates
    assert LoadAwarePolicy(table(verify_per_token=1e-6), 2)(1) == 2  # never above the configured γ


def test_policy_drives_the_decoder(teacher, prompts, references):
    drafter = make_drafter("draft_model", teacher)
    decoder = BucketDecoder(teacher)
    for t, expected in ((table(verify_per_token=1e-2), {0}), (table(verify_per_token=1e-6), {3})):
        gen = decoder.speculative(drafter, prompts[:8], NEW, 3, policy=make_policy("auto", t, 3))
        assert set(gen.gamma_steps) - {0} <= expected and max(gen.gamma_steps) == max(expected)
        assert [g.new_tokens for g in gen.generations] == references[:8]
    with pytest.raises(ValueError, match=r"decoder.policy='sometimes'.*\['always', 'auto'\]"):
        make_policy("sometimes", None, 3)


def test_tau_by_gamma_and_calibration(teacher, prompts):
    from inference.stats import AcceptStats

    stats = AcceptStats()
    for accepted in (0, 1, 3, 3):
        stats.update(3, accepted)
    assert tau_by_gamma(stats, 3) == {0: 1.0, 1: 1.75, 2: 2.25, 3: 2.75}
    drafter = make_drafter("draft_model", teacher)
    t = calibrate(BucketDecoder(teacher), drafter, prompts, 3, [1, 2], tokens=6, repeats=1)
    assert set(t.t_verify) == {1, 2} and set(t.t_verify[1]) == {1, 2, 3, 4}
    assert set(t.t_draft) == {0, 1, 2, 3} and t.tau[0] == 1.0 and t.tau[3] >= t.tau[1] >= 1.0
    assert all(s > 0 for row in t.t_verify.values() for s in row.values())
    assert t.best_gamma(2) in range(4)


def test_check_batch_sizes():
    assert check_batch_sizes([8, 1, 2, 2]) == [1, 2, 8]
    for bad in ([], [0, 2], None, "4", [1.5]):
        with pytest.raises(ValueError, match="decoder.batch_sizes must be a non-empty list"):
            check_batch_sizes(bad)


def test_config_keys(tmp_path):
    from hydra import compose, initialize_config_dir

    from train.config import load_config, register_configs

    register_configs()
    conf = str(Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        load_config(compose(config_name="config", overrides=["decoder.batch_sizes=[1,2,4]", "decoder.policy=auto"]))
        for overrides, match in ((["decoder.policy=auto"], "set decoder.batch_sizes"),
                                 (["decoder.policy=never"], r"valid: \['always', 'auto'\]"),
                                 (["decoder.batch_sizes=[0]"], "decoder.batch_sizes must be"),
                                 (["decoder.batch_sizes=[2]", "decoder.acceptance=typical"], "exact")):
            with pytest.raises(ValueError, match=match):
                load_config(compose(config_name="config", overrides=overrides))


# --- the sweep, its report and the bench script ---------------------------------------------------------------------


def test_crossover():
    from eval.batch_sweep import crossover

    sizes = [1, 2, 4, 8]
    assert crossover(sizes, [3, 3, 3, 3], [1, 1, 1, 1])["crossover_batch_size"] is None
    assert crossover(sizes, [1, 1, 1, 1], [2, 2, 2, 2])["crossover_batch_size"] == 1
    mid = crossover(sizes, [2.0, 3.0, 4.4, 6.0], [1.0, 2.0, 4.0, 8.0])
    assert mid["crossover_batch_size"] == 8 and 4 < mid["crossover_interpolated"] < 8


def test_batch_sweep_report(teacher, prompts, tmp_path):
    from eval.batch_sweep import batch_sweep
    from eval.plots import SWEEP_PNG
    from eval.report import write_report
    from train.config import EvalConfig

    drafters = {"lookup": make_drafter("lookup", teacher), "draft_model": make_drafter("draft_model", teacher)}
    sweep = batch_sweep(teacher, drafters, [p.tolist() for p in prompts[:3]], EvalConfig(max_new_tokens=8, num_draft=2),
                        DecoderConfig(batch_sizes=[1, 2, 4], policy="auto"), repeats=1)
    assert sweep["batch_sizes"] == [1, 2, 4] and sweep["num_prompts"] == 4  # 3 prompts, repeated to fill B = 4
    for row in sweep["rows"]:
        for name in drafters:
            cell = row["drafters"][name]
            assert cell["always"]["identical_to_plain"] and cell["auto"]["identical_to_plain"]
            assert cell["always"]["tokens_per_s"] > 0 and cell["auto"]["vs_best"] > 0
    for entry in sweep["drafters"].values():
        keys = {"crossover_batch_size", "crossover_note", "policy_min_vs_best", "policy_plan", "cost_table"}
        assert keys <= set(entry)
    result = {"drafter": "lookup", "tau": 1.5, "alpha": 0.5, "alpha_per_position": [0.5], "accept_counts": [1, 1],
              "tokens_per_s": 1.0, "speedup": 1.0, "identical_to_greedy": True}
    report = {"target": {"name": "tiny"}, "num_prompts": 3, "max_new_tokens": 8, "results": [result],
              "greedy": {"new_tokens": 1, "seconds": 1.0, "tokens_per_s": 1.0}, "batch_sweep": sweep}
    write_report(json.loads(json.dumps(report)), tmp_path)  # from JSON, as a redraw would read it
    assert (tmp_path / SWEEP_PNG).read_bytes().startswith(b"\x89PNG")
    md = (tmp_path / "summary.md").read_text()
    assert "## Batch sweep" in md and "### draft_model" in md and "auto / best" in md
    assert "batch sweep (4 prompts" in (tmp_path / "summary.txt").read_text()


# Slow: a check of the bench script; the batched decoder it drives is covered by the tests above.
@pytest.mark.slow
def test_bench_batch_tiny_writes_every_figure(tmp_path, tiny_toy_target):
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_batch.py"
    spec = importlib.util.spec_from_file_location("bench_batch", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    bench.main(["--preset", "tiny", "--out", str(out), "--min-batches", "3", "decoder.batch_sizes=[1,2]",
                "eval.max_new_tokens=6"])
    data = json.loads(out.read_text())
    sweep = data["batch_sweep"]
    assert set(sweep["drafters"]) == {"draft_model", "lookup"} and sweep["batch_sizes"] == [1, 2]
    # 4 prompts: 4 batches of 1; 2 batches of 2, below --min-batches 3, so the pool is decoded twice (4 batches)
    assert sweep["min_batches"] == 3 and [r["batches"] for r in sweep["rows"]] == [4, 4]
    assert all(r["drafters"]["lookup"]["auto"]["identical_to_plain"] for r in sweep["rows"])
    assert data["machine"]["torch"] and data["target_params"] > data["draft_params"] > 0


def test_sweep_rounds_report_each_methods_median_round():
    from eval.batch_sweep import _Tally, batch_sweep, median_round
    from train.config import EvalConfig

    rounds = [_Tally(seconds=s, tokens=100, identical=i) for s, i in ((1.0, True), (4.0, True), (2.0, False))]
    pick = median_round(rounds)
    assert pick.seconds == 2.0 and pick.tokens_per_s == 50.0  # 100 / 25 / 50 tokens/s: the middle one
    assert pick.identical is False  # identical only if every round was
    assert median_round(rounds[:2]).seconds == 4.0  # even count: the lower middle (the slower round)
    with pytest.raises(ValueError, match="rounds=0 must be >= 1"):
        batch_sweep(None, {}, [], EvalConfig(), DecoderConfig(batch_sizes=[1]), rounds=0)
    with pytest.raises(ValueError, match="min_batches=0 must be >= 1"):
        batch_sweep(None, {}, [], EvalConfig(), DecoderConfig(batch_sizes=[1]), min_batches=0)

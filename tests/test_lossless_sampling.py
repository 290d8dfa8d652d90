"""Losslessness at temperature > 0, tested statistically.

A tiny-vocabulary Markov "target" (next-token table P[prev]) and a deliberately different "drafter" table Q[prev]
drive the real acceptance rules through whole speculative steps: draft a chain or tree, let the rule accept, commit,
repeat until 3 tokens are out. The empirical joint distribution of those 3 tokens over N = 20,000 runs must be within
total-variation distance TOL of the exact one (Π P). With V = 5 there are 125 outcomes; the expected TV of a perfect
sampler at this N is about 0.02 (measured below as the `null` reference), so TOL = 0.035 leaves room for noise and
still catches the lossy rule, which lands far outside (> 0.1). Seeds are fixed, so the test is deterministic.

The decoder-level test at the end runs the same check through ``Decoder.speculative`` on a real (tiny) HF model.
"""

import itertools

import pytest
import torch

from inference.acceptance import rejection_verdict, settle
from inference.sampling import SamplingConfig, sample, warp
from inference.tree import DraftTree
from tests.host_acceptance import chain_rejection_accept, tree_rejection_accept, typical_accept

V, LENGTH, N, TOL = 5, 3, 20_000, 0.035  # V: the Markov tables; LENGTH: tokens compared


def tables(seed=0):
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    Q = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)  # unrelated to P: many rejections
    return P, Q


def exact_joint(P, start=0):
    joint = torch.zeros((V,) * LENGTH)
    for seq in itertools.product(range(V), repeat=LENGTH):
        prob, prev = 1.0, start
        for t in seq:
            prob *= float(P[prev, t])
            prev = t
        joint[seq] = prob
    return joint


def draw_without_replacement(q, k, g):
    return torch.multinomial(q, k, replacement=False, generator=g).tolist()


def propose(kind, Q, prev, g):
    """A draft tree from the drafter table; sampled kinds carry probs, deterministic kinds do not."""
    if kind == "chain-sampled":
        toks, probs = [], []
        for _ in range(3):
            probs.append(Q[prev])
            toks.append(int(sample(Q[prev][None], g)))
            prev = toks[-1]
        return DraftTree.chain(torch.tensor(toks), torch.stack(probs))
    if kind == "chain-argmax":
        toks = []
        for _ in range(3):
            toks.append(int(Q[prev].argmax()))
            prev = toks[-1]
        return DraftTree.chain(torch.tensor(toks))
    # Trees: 2 root children, each with 2 children (drawn without replacement, or top-2), one more level under the first.
    tokens, parents, probs = [], [], []

    def add_children(parent_node, parent_tok, k):
        q = Q[parent_tok]
        picks = draw_without_replacement(q, k, g) if kind == "tree-sampled" else q.topk(k).indices.tolist()
        start = len(tokens)
        for t in picks:
            tokens.append(t)
            parents.append(parent_node)
            probs.append(q)
        return list(range(start, len(tokens)))

    if kind == "tree-dup":  # a sibling repeating an earlier one's token: the walk never accepts it
        top = Q[prev].topk(2).indices.tolist()
        tokens, parents = [top[0], top[0], top[1]], [-1, -1, -1]
        tokens += Q[top[0]].topk(2).indices.tolist()
        parents += [0, 0]
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))
    roots = add_children(-1, prev, 2)
    level2 = [c for r in roots for c in add_children(r, tokens[r], 2)]
    add_children(level2[0], tokens[level2[0]], 2)
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
    if kind == "tree-sampled":
        tree.probs_NV = torch.stack(probs)
    return tree


def run(rule, kind, P, Q, seed=0, start=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros((V,) * LENGTH)
    for _ in range(N):
        out, prev = [], start
        while len(out) < LENGTH:
            tree = propose(kind, Q, prev, g)
            p_rows = P[torch.cat([torch.tensor([prev]), tree.tokens])]
            if rule == "typical":
                _, new = typical_accept(tree, p_rows, generator=g)
            elif rule == "chain":
                _, new = chain_rejection_accept(tree.tokens, tree.probs_NV, p_rows, g)
            elif rule == "device":  # the decoder's: every node decided at once, read back once
                packed = settle(tree, *rejection_verdict(tree, p_rows, g), V)
                count = int(packed[0])
                new = packed[3 + tree.size: 4 + tree.size + count]
            else:
                _, new = tree_rejection_accept(tree, p_rows, g)
            out.extend(new.tolist())
            prev = out[-1]
        counts[tuple(out[:LENGTH])] += 1
    return counts / N


def tv(a, b):
    return 0.5 * float((a - b).abs().sum())


@pytest.fixture(scope="module")
def setup():
    P, Q = tables()
    exact = exact_joint(P)
    g = torch.Generator().manual_seed(123)
    direct = torch.multinomial(exact.flatten(), N, replacement=True, generator=g)
    null = tv(torch.bincount(direct, minlength=V**LENGTH).float().view_as(exact) / N, exact)
    assert null < TOL / 1.5  # a perfect sampler sits well inside the tolerance (about 0.02 here)
    return P, Q, exact


@pytest.mark.parametrize("rule,kind", [
    ("chain", "chain-sampled"),  # Leviathan/Chen with a real draft distribution
    ("chain", "chain-argmax"),  # deterministic drafts (Medusa top-1, n-gram): point-mass q
    ("tree", "tree-sampled"),  # recursive rejection, siblings drawn without replacement
    # Recursive rejection over top-k candidates (Medusa / EAGLE-2 trees). Slow: tree-sampled walks the same tree loop,
    # chain-argmax the same point-mass residual, and the decoder's own point-mass tree rule is
    # test_decoder_output_distribution[medusa_tree-exact-4k] in the fast suite.
    pytest.param("tree", "tree-topk", marks=pytest.mark.slow),
    pytest.param("tree", "tree-dup", marks=pytest.mark.slow),  # a repeated sibling token
    # rejection_verdict: the same rules decided for the whole tree at once (the decoder's; test_decoder_output_distribution
    # runs it through the decoder in the fast suite). Slow: one small device step per draw, 20k draws.
    pytest.param("device", "chain-sampled", marks=pytest.mark.slow),
    pytest.param("device", "tree-topk", marks=pytest.mark.slow),
    pytest.param("device", "tree-dup", marks=pytest.mark.slow),
])
def test_rejection_sampling_is_lossless(setup, rule, kind):
    P, Q, exact = setup
    assert tv(run(rule, kind, P, Q), exact) < TOL


def test_device_verdict_never_accepts_a_repeated_sibling():
    """p = {1: .5, 2: .5}, root children [1, 1, 2]: the first is accepted half the time; after its rejection the
    residual holds only token 2, so the repeat (probability 0) is skipped and the third child always accepted. A rule
    that renormalised the repeat's own probability would accept it (.5 / (1 - .5) = 1)."""
    tree = DraftTree(torch.tensor([1, 1, 2]), torch.tensor([-1, -1, -1]))
    p = torch.zeros(4, V)
    p[0, 1] = p[0, 2] = 0.5
    p[1:, 0] = 1.0
    g = torch.Generator().manual_seed(0)
    firsts = []
    for _ in range(200):
        packed = settle(tree, *rejection_verdict(tree, p, g), V)
        assert int(packed[0]) == 1  # one node accepted, then the bonus
        firsts.append(int(packed[3]))
    assert set(firsts) == {0, 2} and 70 < firsts.count(0) < 130


# The lossy rule caught once is the teeth: the chain case (slow) repeats the tree case's typical_accept walk.
@pytest.mark.parametrize("kind", ["tree-topk", pytest.param("chain-argmax", marks=pytest.mark.slow)])
def test_typical_acceptance_fails_the_same_test(setup, kind):
    P, Q, exact = setup
    assert tv(run("typical", kind, P, Q), exact) > 3 * TOL  # the test has teeth: the lossy rule is caught


def test_warp_is_shared_and_validated():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    top2 = warp(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert (top2[0, 2:] == 0).all() and abs(float(top2.sum()) - 1) < 1e-6
    nucleus = warp(logits, SamplingConfig(temperature=1.0, top_p=0.5))
    assert nucleus[0].tolist() == [1.0, 0.0, 0.0, 0.0]  # the top token alone already reaches 0.5
    assert warp(logits, SamplingConfig()).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    for bad in ({"top_p": 0.0}, {"top_p": 1.5}, {"temperature": -1.0}, {"top_k": -2}):
        with pytest.raises(ValueError, match="decoder\\."):
            SamplingConfig(**bad)


# --- the same check through the real decode loop -------------------------------------------------------------------

def _tiny(seed, vocab=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=vocab, max_position_embeddings=32, initializer_range=0.5)
    return LlamaForCausalLM(cfg).eval()


def _exact_continuations(model, prompt, length):
    """P(x_1..x_length | prompt) for every continuation, from one batched forward."""
    vocab = model.config.vocab_size
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=length)))
    with torch.no_grad():
        logp = model(torch.cat([prompt.expand(len(seqs), -1), seqs], 1)).logits.log_softmax(-1)
    n = prompt.shape[1]
    steps = logp[:, n - 1 : n - 1 + length].gather(-1, seqs[..., None]).squeeze(-1)
    return steps.sum(-1).exp().view((vocab,) * length)


def _decoder_setup(kind):
    from distill.teacher import Teacher
    from heads.base import TargetDims
    from heads.draft_model.model import DraftModel
    from heads.medusa.model import MedusaHeads

    teacher = Teacher(_tiny(0), tokenizer=None, name="tiny-v4")
    dims = TargetDims(teacher.hidden_size, teacher.vocab_size, teacher.num_layers)
    if kind == "draft_model":  # a chain sampled from a different LM: Leviathan/Chen through the loop
        return teacher, DraftModel(dims, model=_tiny(1))
    if kind == "eagle_tree":  # a top-k dynamic tree (point masses) from a feature drafter: recursive rejection
        from heads.eagle.model import EagleDrafter

        torch.manual_seed(3)
        eagle = EagleDrafter(dims, variant="eagle1", top_k=2, total_tokens=4)
        eagle.bind_target(teacher, initialize=False)
        with torch.no_grad():
            for p in eagle.parameters():
                p.normal_(0, 0.5)
        return teacher, eagle.eval()
    medusa = MedusaHeads(dims, num_heads=2, tree=[[0], [1], [0, 0], [1, 0], [0, 1]])
    torch.manual_seed(2)
    with torch.no_grad():
        for p in medusa.parameters():
            p.normal_(0, 0.5)
    return teacher, medusa.eval()


# draft_model (slow): a sampled chain through Decoder.speculative is tests/test_dflash.py's
# test_sampled_output_distribution_is_the_targets[1] (the same verify step and draw_chain), the draft model's sampled
# static draws are tests/test_static_draft.py::test_sampled_draft_model_chain_draws_from_its_warped_distributions and
# its sampled decode at batch 4 is tests/test_batched.py::test_sampling_distribution_at_batch_4[draft_model-700].
@pytest.mark.parametrize("samples", [pytest.param(4_000, id="4k"), pytest.param(20_000, id="20k", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind,acceptance", [pytest.param("draft_model", "exact", marks=pytest.mark.slow),
                                             ("medusa_tree", "exact"),
                                             # slow: shows the test can fail (a lossy rule), not that a path is lossless
                                             pytest.param("medusa_tree", "typical", marks=pytest.mark.slow)])
def test_decoder_output_distribution(kind, acceptance, samples):
    from inference.decoder import Decoder, DecoderConfig

    teacher, drafter = _decoder_setup(kind)
    prompt = torch.tensor([[1, 2, 3]])
    exact = _exact_continuations(teacher.model, prompt, LENGTH)
    decoder = Decoder(teacher, DecoderConfig(temperature=1.0, acceptance=acceptance, seed=0))
    counts = torch.zeros_like(exact)
    accepted = 0
    for _ in range(samples):
        gen = decoder.speculative(drafter, prompt, LENGTH, num_draft=2)
        counts[tuple(gen.new_tokens)] += 1
        accepted += sum(a * c for row in gen.stats.counts.values() for a, c in row.items())
    assert accepted > samples // 10  # drafts are accepted often enough for the check to cover them
    # Tolerance: twice the expected TV of a perfect sampler at this many samples, E|p̂ - p| ≈ sqrt(2p(1-p)/(πn)).
    tol = 2 * 0.5 * float(torch.sqrt(2 * exact * (1 - exact) / (torch.pi * samples)).sum())
    distance = tv(counts / samples, exact)
    if acceptance == "typical":
        assert distance > 2 * tol, f"typical acceptance (lossy) should be caught: TV {distance:.4f} vs tol {tol:.4f}"
    else:
        assert distance < tol, f"TV {distance:.4f} exceeds {tol:.4f}"

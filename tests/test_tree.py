"""Draft trees: their shape and geometry on tiny Llama, Qwen2 and Mistral targets; static Medusa trees; the EAGLE-2
dynamic-tree hook."""

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from distill.teacher import Teacher
from heads.base import Drafter, build_drafter
from inference.decoder import Decoder
from inference.tree import DraftTree, parse_tree, tree_geometry
from tests.drafters import noisy_medusa
from tests.eager_reference import expand_dynamic_tree

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def tiny_model(arch: str, attn: str = "sdpa", seed: int = 0):
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    cfg = config_cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    cfg._attn_implementation = attn
    return model_cls(cfg).eval()


# node:      0  1  2  3  4  5  6
# parent:   -1 -1  0  0  1  2  5      (two root children; a depth-4 branch 0 -> 2 -> 5 -> 6)
TREE = DraftTree(torch.tensor([5, 9, 6, 7, 11, 3, 8]), torch.tensor([-1, -1, 0, 0, 1, 2, 5]))


def path_to(tree: DraftTree, node: int) -> list[int]:
    """Node indices from the root's child down to ``node`` (empty for the pending token, node -1)."""
    path, parents = [], tree.parents.tolist()
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_tree_paths_and_geometry():
    assert path_to(TREE, 6) == [0, 2, 5, 6] and path_to(TREE, -1) == []
    assert TREE.depths() == [1, 1, 2, 2, 2, 3, 4] and not TREE.is_chain
    depth, ancestors = TREE.geometry
    assert depth.tolist() == TREE.depths()
    assert ancestors[6].nonzero().flatten().tolist() == path_to(TREE, 6) == [0, 2, 5, 6]
    # Too small a depth bound leaves deep ancestors out: the bound is what makes the rounds enough.
    assert tree_geometry(TREE.parents, 3)[1][6].nonzero().flatten().tolist() == [2, 5, 6]
    chain = DraftTree.chain(torch.tensor([4, 5, 6]))
    assert chain.geometry[1].tolist() == tree_geometry(chain.parents, 3)[1].tolist()


def test_parse_tree_presets_and_errors():
    assert parse_tree(None) is None and parse_tree("chain") is None
    tree = parse_tree([[1], [0], [0, 0]])
    assert tree.paths == ((0,), (1,), (0, 0)) and tree.parents == [-1, -1, 0]
    assert parse_tree("default").depth == 4
    with pytest.raises(ValueError, match="valid presets"):
        parse_tree("bushy")
    with pytest.raises(ValueError, match="parent path is missing"):
        parse_tree([[0], [1, 0]])
    with pytest.raises(ValueError, match="deep"):
        parse_tree([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], max_depth=3)
    assert parse_tree("default", max_depth=3).depth == 3  # presets are trimmed to the drafter's depth
    with pytest.raises(ValueError, match="top-k index paths"):
        parse_tree([["a"]])
    with pytest.raises(ValueError, match="twice"):
        parse_tree([[0], [0]])


def test_unknown_tree_is_rejected_by_drafters(tiny_teacher):
    with pytest.raises(ValueError, match="valid presets"):
        build_drafter({"_target_": "heads.medusa.MedusaHeads", "num_heads": 3, "tree": "nope"}, tiny_teacher)
    lookup = build_drafter({"_target_": "heads.lookup.PromptLookup"}, tiny_teacher)
    with pytest.raises(ValueError, match="drafts a chain"):
        lookup.set_tree("default")


def _prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (1, 3 + i % 17), generator=gen) for i in range(n)]


# One family shows the tree beating the chain; every family's Medusa tree decoding greedy-identically is
# tests/test_families.py::test_lossless_batch1 (medusa-tree), so the other families here are slow.
@pytest.mark.parametrize("arch", [a if a == "llama" else pytest.param(a, marks=pytest.mark.slow) for a in sorted(ARCHS)])
def test_medusa_tree_is_greedy_identical_and_beats_the_chain(arch):
    model = tiny_model(arch)
    teacher = Teacher(model, tokenizer=None, name=f"tiny-{arch}")
    dec = Decoder(teacher)
    chain = noisy_medusa(teacher, scale=0.2)
    tree = noisy_medusa(teacher, scale=0.2)
    tree.set_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0]])
    tau = {"chain": [], "tree": []}
    for prompt in _prompts(50):
        ref = dec.plain(prompt, 24).new_tokens
        for name, drafter in (("chain", chain), ("tree", tree)):
            gen = dec.speculative(drafter, prompt, 24, num_draft=3)
            assert gen.new_tokens == ref, f"{arch} {name} diverged from plain greedy"
            tau[name].append(gen.stats)
    chain_tau = sum(s.tau * s.forwards for s in tau["chain"]) / sum(s.forwards for s in tau["chain"])
    tree_tau = sum(s.tau * s.forwards for s in tau["tree"]) / sum(s.forwards for s in tau["tree"])
    assert tree_tau > chain_tau > 1.0


class DynamicTreeDrafter(Drafter):
    """The EAGLE-2 hook driven by a small causal LM that scores each frontier path from scratch (test scaffold)."""

    name = "dynamic"

    def __init__(self, teacher, model, top_k=3, depth=3, total_tokens=8):
        super().__init__({"hidden_size": teacher.hidden_size, "vocab_size": teacher.vocab_size, "num_layers": 2})
        self.lm, self.args = model, (top_k, depth, total_tokens)

    def propose(self, tokens, max_depth, sampling=None):
        paths: list[list[int]] = []  # the tokens from the root down to each scored node, by slot

        def score(level, parent_slot, toks):
            if level == 0:
                frontier = [[]]
            else:
                frontier = [(paths[s] if s >= 0 else []) + [t] for s, t in zip(parent_slot.tolist(), toks.tolist())]
                paths.extend(frontier)
            batch = torch.stack([torch.cat([tokens[0], torch.tensor(f, dtype=torch.long)]) for f in frontier])
            return self.lm(batch).logits[:, -1].log_softmax(-1)

        top_k, depth, total = self.args
        return expand_dynamic_tree(score, top_k, min(depth, max_depth), total)


def test_dynamic_tree_shape():
    torch.manual_seed(0)
    logits = torch.randn(64, 16)
    calls = []

    def score(level, parent_slot, toks):
        calls.append((level, None if parent_slot is None else parent_slot.tolist()))
        return logits[: 1 if level == 0 else len(toks)].log_softmax(-1)

    tree = expand_dynamic_tree(score, top_k=3, depth=4, total_tokens=10)
    # The root, then the top_k nodes of each depth; slots number scored nodes, so level 3's parents are slots 0-2.
    assert [c[0] for c in calls] == [0, 1, 2, 3] and calls[1][1] == [-1, -1, -1]
    assert all(0 <= s < 3 for s in calls[2][1]) and all(3 <= s < 6 for s in calls[3][1])
    assert tree.size == 10 and tree.depth <= 4
    assert all(p < i for i, p in enumerate(tree.parents.tolist()))  # topological, closed under ancestors
    with pytest.raises(ValueError, match="top_k"):
        expand_dynamic_tree(score, top_k=0, depth=2, total_tokens=4)


def test_dynamic_tree_keeps_the_most_valuable_nodes():
    """Against a walk over every candidate on the host: the kept nodes are the total_tokens best paths."""
    torch.manual_seed(1)
    table = torch.randn(5, 6).log_softmax(-1)  # a node's children scores depend on its depth only
    tree = expand_dynamic_tree(lambda level, s, t: table[level].expand(1 if level == 0 else len(t), 6),
                               top_k=2, depth=3, total_tokens=5)
    best = table.topk(2, -1)
    values = {(): 0.0}
    for d in range(3):  # every node of the full top-2 tree and its value (the expansion scores only the best 2)
        for path in [p for p in values if len(p) == d]:
            for r in range(2):
                values[path + (r,)] = values[path] + float(best.values[d, r])
    kept_values = sorted((v for p, v in values.items() if p), reverse=True)[:5]
    got = [sum(float(table[d, t]) for d, t in enumerate(tokens)) for tokens in _paths_tokens(tree)]
    assert sorted(got, reverse=True) == pytest.approx(kept_values, abs=1e-5)


def _paths_tokens(tree):
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for i in range(tree.size):
        path, node = [], i
        while node >= 0:
            path.append(toks[node])
            node = parents[node]
        out.append(path[::-1])
    return out


def test_dynamic_tree_drafter_is_greedy_identical(tiny_teacher):
    dec = Decoder(tiny_teacher)
    draft_lm = tiny_model("llama", seed=1)  # a different model: some candidates rejected, some accepted
    with torch.no_grad():  # pull it toward the target so that acceptance is not vanishing
        for p_d, p_t in zip(draft_lm.parameters(), tiny_teacher.model.parameters()):
            if p_d.shape == p_t.shape:
                p_d.mul_(0.3).add_(0.7 * p_t)
    drafter = DynamicTreeDrafter(tiny_teacher, draft_lm)
    accepted = 0
    for prompt in _prompts(50, seed=3):
        gen = dec.speculative(drafter, prompt, 16, num_draft=3)
        assert gen.new_tokens == dec.plain(prompt, 16).new_tokens
        accepted += sum(a * c for row in gen.stats.counts.values() for a, c in row.items())
    assert accepted > 0

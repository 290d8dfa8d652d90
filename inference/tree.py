"""Draft trees: the candidates a drafter proposes, their shape, and the static trees of top-k paths (Medusa).

A proposal is a tree of N candidate tokens rooted at the *pending* token (the last committed token, whose KV entry
is not cached yet). A chain is the tree whose node i has parent i - 1. Nodes are stored in topological order (a
parent's index is below its children's), siblings in the order the acceptance rule should try them.

The batched verify (``inference.batch_steps``) feeds [pending, node_0 .. node_{N-1}] at positions past_len + depth
(the pending token has depth 0, a root child depth 1, ...), every row seeing the whole cached past and, in the new
block, only itself and its ancestors (``DraftTree.geometry``). Row 0 of the output is the target's prediction after
the pending token; row 1 + i its prediction after node i.

Shapes: N nodes, V vocabulary. tokens [N], parents [N] (-1 = pending token), probs_NV [N, V].
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor


@dataclass
class DraftTree:
    """Candidate tokens proposed by a drafter for one verification forward."""

    tokens: Tensor  # [N] long
    parents: Tensor  # [N] long; -1 for children of the pending token, else the index of an earlier node
    # probs_NV[i]: the draft distribution node i was drawn from (siblings share one, drawn without replacement in
    # index order). None: the candidates were chosen deterministically (argmax, top-k, n-gram lookup); sampling
    # acceptance then treats each as a point mass, which keeps it lossless.
    probs_NV: Tensor | None = None
    # What the drafter knows about the shape on the host, so the decoder never reads ``parents`` back from the
    # device: whether it is a chain (None: find out, one transfer) and a bound on its depth (None: the size).
    chain_hint: bool | None = None
    depth_bound: int | None = None

    @classmethod
    def chain(cls, tokens: Tensor, probs_NV: Tensor | None = None) -> "DraftTree":
        tokens = tokens.reshape(-1).long()
        parents = torch.arange(-1, tokens.shape[0] - 1, device=tokens.device)
        return cls(tokens, parents, probs_NV, chain_hint=True, depth_bound=tokens.shape[0])

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> "DraftTree":
        return cls.chain(torch.empty(0, dtype=torch.long, device=device))

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    # Shape facts are read several times per decode step; tokens and parents never change after proposal.
    @cached_property
    def is_chain(self) -> bool:
        if self.chain_hint is not None:
            return self.chain_hint
        return self.parents.tolist() == list(range(-1, self.size - 1))

    @cached_property
    def geometry(self) -> tuple[Tensor, Tensor]:
        """(depth_N, ancestors_NN) on the tree's device, without reading anything back (``tree_geometry``)."""
        if self.is_chain:
            n, dev = self.size, self.parents.device
            return torch.arange(1, n + 1, device=dev), torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        return tree_geometry(self.parents, self.depth_bound or self.size)

    @cached_property
    def _depths(self) -> list[int]:
        depth: list[int] = []
        for p in self.parents.tolist():
            depth.append(1 if p < 0 else depth[p] + 1)
        return depth

    def depths(self) -> list[int]:
        return self._depths

    @property
    def depth(self) -> int:
        return max(self._depths, default=0)

    def children(self) -> list[list[int]]:
        """children[0] = root children (of the pending token); children[1 + i] = children of node i."""
        kids: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, p in enumerate(self.parents.tolist()):
            kids[p + 1].append(i)
        return kids

    def check_shape(self, vocab_size: int) -> None:
        """What can be checked without reading the proposal back (its values are checked with the step's verdict,
        ``inference.acceptance.settle``)."""
        if self.tokens.shape != self.parents.shape or self.tokens.dim() != 1:
            raise ValueError(f"draft tree tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} must be equal 1-D shapes")
        if self.probs_NV is not None and tuple(self.probs_NV.shape) != (self.size, vocab_size):
            raise ValueError(
                f"draft probabilities have shape {tuple(self.probs_NV.shape)}, expected ({self.size}, {vocab_size}): "
                f"the drafter's vocabulary differs from the target's"
            )

    def bad_parents(self) -> Tensor:
        """[] bool on the device: some parent does not precede its child (not in topological order)."""
        idx = torch.arange(self.size, device=self.parents.device)
        return ~((self.parents >= -1) & (self.parents < idx)).all()

    def check(self, vocab_size: int) -> None:
        """Reject malformed proposals before they reach the target (a wrong vocab would index out of range)."""
        self.check_shape(vocab_size)
        if self.size and bool(self.bad_parents()):
            raise_bad_parents(self.parents)
        if self.size and (int(self.tokens.min()) < 0 or int(self.tokens.max()) >= vocab_size):
            raise_bad_tokens(self.tokens, vocab_size)


def raise_bad_parents(parents: Tensor):
    raise ValueError(f"draft tree parents must precede their children (topological order), got {parents.tolist()}")


def raise_bad_tokens(tokens: Tensor, vocab_size: int):
    raise ValueError(
        f"drafter proposed token id {int(tokens.max())} outside the target's vocabulary of {vocab_size}; "
        f"the drafter was built for a different tokenizer — use one trained for this target"
    )


def tree_geometry(parents_N: Tensor, depth_bound: int) -> tuple[Tensor, Tensor]:
    """(depth_N, ancestors_NN) of a tree, on the parents' device with no transfer: depth of node i (a root child
    has depth 1) and ``ancestors[i, j]``: j is i or an ancestor of i. Round r adds the ancestors r levels up, so
    ``depth_bound - 1`` rounds of one gather each reach the root of any tree at most that deep. Parents that do not
    precede their child are clamped (``DraftTree.bad_parents`` reports them)."""
    n, dev = parents_N.shape[0], parents_N.device
    idx = torch.arange(n, device=dev)
    parents_N = torch.minimum(parents_N.clamp(min=-1), idx - 1)
    has_parent = parents_N >= 0
    up = parents_N.clamp(min=0)
    eye = torch.eye(n, dtype=torch.bool, device=dev)
    ancestors, depth = eye, torch.ones(n, dtype=torch.long, device=dev)
    for _ in range(max(0, depth_bound - 1)):
        ancestors = eye | (ancestors[up] & has_parent[:, None])
        depth = 1 + torch.where(has_parent, depth[up], 0)
    return depth, ancestors


# --- static trees (Medusa): a list of top-k index paths --------------------------------------------------------


@dataclass(frozen=True)
class StaticTree:
    """A tree of top-k index paths: (0,) = the top-1 token of draft position 1; (0, 2) = the top-3 token of
    position 2 below it. Parents, depths and each node's rank are fixed; only the tokens change per step."""

    paths: tuple[tuple[int, ...], ...]

    @property
    def parents(self) -> list[int]:
        index = {p: i for i, p in enumerate(self.paths)}
        return [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    def truncated(self, num_nodes: int) -> "StaticTree":
        """The first ``num_nodes`` paths (still a tree: paths are sorted so every prefix comes first)."""
        return StaticTree(self.paths[:num_nodes])

    def limited(self, max_depth: int) -> "StaticTree":
        return StaticTree(tuple(p for p in self.paths if len(p) <= max_depth))


# A 1-2-4-ish tree for 4 Medusa heads: wide near the root, where acceptance is high and candidates are cheap.
TREE_PRESETS: dict[str, list[list[int]]] = {
    "chain": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]],
    "small": [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0]],
    "default": [
        [0], [1], [2], [3],
        [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0],
        [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1], [0, 1, 0, 0],
    ],
    "wide": [
        [0], [1], [2], [3], [4], [5],
        [0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [1, 1], [1, 2], [2, 0], [2, 1], [3, 0],
        [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [1, 0, 0], [1, 0, 1], [2, 0, 0],
        [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0],
    ],
}


def parse_tree(spec, max_depth: int | None = None) -> StaticTree | None:
    """A tree spec from config: null / "chain" (top-1 chain), a preset name, or a list of top-k index paths."""
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec not in TREE_PRESETS:
            raise ValueError(f"tree={spec!r} is not a known tree; valid presets: {sorted(TREE_PRESETS)}, or a list of top-k index paths like [[0], [1], [0, 0]]")
        if spec == "chain":
            return None
        # A preset is a shape, not a promise about depth: trim it to what the drafter predicts.
        spec = [p for p in TREE_PRESETS[spec] if max_depth is None or len(p) <= max_depth]
    try:
        paths = [tuple(int(i) for i in p) for p in spec]
    except (TypeError, ValueError) as e:
        raise ValueError(f"tree={spec!r} must be a list of top-k index paths like [[0], [1], [0, 0]] ({e})") from None
    if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
        raise ValueError(f"tree={spec!r}: every path needs at least one index and indices are ranks >= 0")
    if len(set(paths)) != len(paths):
        raise ValueError(f"tree={spec!r} lists a path twice")
    missing = sorted({p[:-1] for p in paths if len(p) > 1} - set(paths))
    if missing:
        raise ValueError(f"tree={spec!r} has paths whose parent path is missing: add {[list(m) for m in missing]}")
    if max_depth is not None and max(len(p) for p in paths) > max_depth:
        raise ValueError(f"tree={spec!r} is {max(len(p) for p in paths)} deep, but the drafter predicts only {max_depth} positions")
    # Breadth-first, then by rank: parents precede children, and truncating keeps the most likely nodes.
    return StaticTree(tuple(sorted(paths, key=lambda p: (len(p), p))))

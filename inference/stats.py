"""Acceptance statistics and τ formulas: the result types the decoders produce, at the bottom layer so every layer
above (eval, train, the decoders themselves) reads one definition.

``AcceptStats`` derives every figure from one histogram so they share one definition.

``counts[k][a]`` = number of target verification forwards that were shown k draft tokens and accepted a of them
(0 <= a <= k). From it:

- τ (tau) = mean tokens committed per verification forward = Σ (a + 1) · counts / Σ counts. The +1 is the bonus
  token every forward commits (the target's own token after the accepted prefix). A plain decoder has τ = 1.
  The prefill forward that produces the first new token is not a verification and is not counted.
- α_i (alpha_per_position[i]) = P(draft token i accepted | tokens 0..i-1 accepted and token i was proposed);
  None where position i was never reached (no evidence either way, which 0.0 would misreport).
- α (alpha) = accepted draft tokens / draft tokens that were judged (a token is judged when all earlier tokens
  of its draft were accepted): the per-position rates pooled, weighted by how often each position was reached.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence


class AcceptStats:
    def __init__(self) -> None:
        self.counts: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))

    def update(self, proposed: int, accepted: int) -> None:
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted={accepted} must lie in [0, proposed={proposed}]")
        self.counts[proposed][accepted] += 1

    def merge(self, other: "AcceptStats") -> "AcceptStats":
        for k, row in other.counts.items():
            for a, c in row.items():
                self.counts[k][a] += c
        return self

    def _cells(self):
        return ((k, a, c) for k, row in self.counts.items() for a, c in row.items())

    @property
    def forwards(self) -> int:
        return sum(c for _, _, c in self._cells())

    @property
    def tau(self) -> float:
        n = self.forwards
        return sum((a + 1) * c for _, a, c in self._cells()) / n if n else 0.0

    def _reached_accepted(self) -> tuple[list[int], list[int]]:
        max_k = max(self.counts, default=0)
        reached, accepted = [0] * max_k, [0] * max_k
        for k, a, c in self._cells():
            # Positions 0..a-1 were accepted; position a (if proposed) was judged and rejected.
            for i in range(min(a + 1, k)):
                reached[i] += c
            for i in range(a):
                accepted[i] += c
        return reached, accepted

    @property
    def alpha_per_position(self) -> list[float | None]:
        reached, accepted = self._reached_accepted()
        return [acc / r if r else None for acc, r in zip(accepted, reached)]

    @property
    def alpha(self) -> float:
        reached, accepted = self._reached_accepted()
        return sum(accepted) / sum(reached) if sum(reached) else 0.0

    def accepted_length_histogram(self) -> list[int]:
        """hist[a] = forwards that accepted exactly a draft tokens."""
        hist: list[int] = []
        for _, a, c in self._cells():
            hist.extend([0] * (a + 1 - len(hist)))
            hist[a] += c
        return hist

    def to_dict(self) -> dict:
        return {
            "tau": self.tau,
            "alpha": self.alpha,
            "alpha_per_position": self.alpha_per_position,
            "target_forwards": self.forwards,
            "accept_counts": self.accepted_length_histogram(),
            "accept_counts_by_draft_len": {str(k): {str(a): c for a, c in sorted(row.items())} for k, row in sorted(self.counts.items())},
        }


def chain_tau(alpha_per_position: Sequence[float | None], gamma: int) -> float:
    """τ of a chain of ``gamma`` draft tokens accepted with the given per-position rates (None: never reached)."""
    tau, reach = 1.0, 1.0
    for a in list(alpha_per_position)[:gamma]:
        reach *= a or 0.0
        tau += reach
    return tau


def simulated_tau(accs: list[float], depth: int | None = None) -> float:
    """τ a chain drafter would reach if depth k were accepted independently with its training top-1 accuracy:
    1 + Σ_k Π_{j≤k} acc_j (the bonus token included, as in ``AcceptStats.tau``). For Medusa head k and EAGLE step k the
    accuracy is already conditioned on the right context, so this is an estimate, reported beside the measured τ.
    ``depth``: extend to that many draft tokens with the last accuracy (a draft LM's one next-token term).
    The decode-time formula (``chain_tau``, which ``inference.cost`` predicts with), so the two cannot drift."""
    if depth is not None and accs:
        accs = list(accs) + [accs[-1]] * (depth - len(accs))
    return chain_tau(accs, len(accs))

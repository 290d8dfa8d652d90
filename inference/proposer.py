"""What the decoders need from a drafter: the proposing interface, apart from training, saving and exporting.

``heads.base.Drafter`` implements it for every drafter kind; ``inference`` only ever types against this protocol,
so the decoder reads nothing drafter-specific (no EAGLE- or Medusa-only attribute) and sits below ``heads``.
One decode step calls, in order: ``propose`` (a chain or tree continuing the committed tokens), then after the
target's verification ``observe`` (its hidden states of the newly committed positions, the layers named by
``teacher_layers``) and ``accepted`` (which proposed nodes were kept, and the committed tokens as the host already
holds them, so a drafter that works on the host never reads the sequence back). ``reset`` starts a new sequence.

A batch of sequences (``inference.batch_decoder``) is drafted through the drafter's static draft run at every row
(``inference.batch_draft``) where it has one, else through ``rows(seeds)``: a ``ProposerRows`` holding every row's
state, whose ``propose`` drafts all rows in one call (``heads.base.ForkedRows``: per-row copies of the drafter, each
proposing in turn).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from inference.sampling import SamplingConfig
from inference.tree import DraftTree


@runtime_checkable
class ProposerRows(Protocol):
    """The decoding state of B sequences (row order = the batch's). The same calls as ``Proposer``'s, per row,
    except ``propose``, which drafts every row in one call; ``keep`` drops the rows that left the batch."""

    def observe(self, row: int, hidden: dict[int, Tensor]) -> None: ...

    def accepted(self, row: int, path: list[int], committed: list[int] | None = None) -> None: ...

    def propose(self, tokens: list[Tensor], depths: list[int], samplings: list[SamplingConfig]) -> list[DraftTree]: ...

    def keep(self, rows: list[int]) -> None: ...


@runtime_checkable
class Proposer(Protocol):
    name: str  # how reports label it
    teacher_layers: tuple[int, ...]  # hidden-state indices ``observe`` receives
    # Capabilities the cost model reads: an EAGLE-2 dynamic tree changes shape every step (not modelled); a static
    # ``tree`` (Medusa's top-k paths) can be pruned to its first n nodes with ``set_tree``.
    dynamic_tree: bool
    tree: DraftTree | None
    # A drafter that cuts its own chain short (DSpark's confidence cut): its chains are verified in the bucket of
    # their length (``inference.batch_steps.cut_width``), not the full depth's, so a cut saves verification work.
    variable_depth: bool

    @property
    def dims(self): ...  # the target sizes it was built for (``vocab_size`` must match the target's)

    def reset(self, seed: int = 0) -> None: ...

    def observe(self, hidden: dict[int, Tensor]) -> None: ...

    def accepted(self, path: list[int], committed: list[int] | None = None) -> None: ...

    def propose(self, tokens: Tensor, max_depth: int, sampling: SamplingConfig) -> DraftTree: ...

    def set_tree(self, spec) -> None: ...

    def rows(self, seeds: list[int]) -> ProposerRows: ...  # a batch of len(seeds) new sequences

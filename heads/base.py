"""The one interface the training loop and the speculative decoder use for every drafter kind.

Training:  ``drafter(batch, teacher_out, loss_fn) -> DraftOutput`` — per draft position k, the student's features
           and vocabulary projection, the teacher rows they are distilled toward, and a weight; the configured
           loss (no drafter hard-codes its divergence) is applied inside the call, chunk by chunk
           (``distill.chunked``), so no [tokens, V] logits exist whole. Without ``loss_fn`` the terms are
           evaluated by ``DraftOutput.loss`` later (tests, single-process use).
Decoding:  ``reset()`` for a new sequence, ``observe(hidden)`` with the target's hidden states of every newly
           committed position, ``propose(tokens, max_depth, sampling)`` -> ``inference.tree.DraftTree``: a chain or
           a tree of candidates continuing ``tokens``, at most ``max_depth`` deep, with the draft distributions
           they were drawn from (warped by ``inference.sampling.warp`` exactly as the target's) or None when they
           were chosen deterministically.
Saving:    ``saved_config`` (the node a save records); ``heads.saved`` writes and reads drafter directories.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch import Tensor, nn

from distill.chunked import TeacherRows, chunked_divergence
from inference.sampling import GREEDY, SamplingConfig
from inference.static_draft import weights_signature
from inference.tree import DraftTree

log = logging.getLogger(__name__)

STATIC_DRAFTS_KEPT = 4  # static drafts a drafter keeps for reuse (one per decoder state, capacity and sampling)

LossFn = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class TargetDims:
    """The target's sizes a drafter is built for (passed at instantiation; checked again at load time)."""

    hidden_size: int
    vocab_size: int
    num_layers: int


@dataclass
class DraftTerm:
    """One draft position's loss: the configured divergence between ``head(student_ND)`` (the drafter's logits)
    and the teacher's rows, computed in chunks (``distill.chunked``): the [N, V] logits never exist all at once.

    The rows are a static slice of the batch (every position a term could train), ``weight_N`` saying which count:
    selecting them instead (``x[mask]``) has a size only the device knows, and reading it back stalls a GPU."""

    student_ND: Tensor  # the drafter's features at the term's positions (what its vocabulary projection reads)
    head: Callable[[Tensor], Tensor]  # [n, D] -> [n, V'] logits (an nn.Module: its trainable weights get gradients)
    teacher: TeacherRows | None  # the teacher's rows for the same future tokens (None once released)
    weight: float = 1.0
    loss_sum: Tensor | None = None  # set by ``evaluate``
    pred_N: Tensor | None = None  # the drafter's argmax per row, set by ``evaluate``
    weight_N: Tensor | None = None  # float 0/1 per row: the rows trained (None: every row)

    def evaluate(self, loss_fn: LossFn) -> Tensor:
        """The divergence summed over the rows of weight 1 (once; later calls return it)."""
        if self.loss_sum is None:
            self.loss_sum, self.pred_N = chunked_divergence(self.student_ND, self.head, self.teacher, loss_fn,
                                                            weight_N=self.weight_N)
        return self.loss_sum

    @property
    def mask_N(self) -> Tensor | None:
        """[N] bool: the rows trained (None: every row), as the menu losses take a mask."""
        return None if self.weight_N is None else self.weight_N > 0

    def release_teacher(self) -> None:
        """Keep the agreement labels, drop the reference to the teacher's [B, T, V] logits (free before backward)."""
        if self.teacher is not None:
            self._labels = self.teacher.labels()
            self.teacher = None

    @property
    def student_NV(self) -> Tensor:
        """All rows' logits, materialised: for tests and inspection, never used by training."""
        return self.head(self.student_ND)

    @property
    def teacher_NV(self) -> Tensor:
        """All rows' teacher logits (over the student's vocabulary), materialised: for tests and inspection."""
        return self.teacher.raw()

    @property
    def label_N(self) -> Tensor:
        """The index the student's argmax must equal to count as agreeing (-1: never): the teacher's argmax over
        the whole vocabulary, mapped into a reduced student vocabulary when it has one."""
        labels = getattr(self, "_labels", None)
        return labels if labels is not None else self.teacher.labels()


@dataclass
class DraftOutput:
    terms: list[DraftTerm]  # one per draft position (Medusa head k, EAGLE step k, ...)
    num_valid: Tensor  # positions the loss is normalised by (the first term's count)
    aux_loss_sum: Tensor | None = None  # non-distillation loss already summed over valid positions

    def evaluate(self, loss_fn: LossFn | None) -> "DraftOutput":
        """Compute every term's loss now. Drafters call this at the end of ``forward`` when given ``loss_fn``, so
        the projection runs inside the module's call (where DDP / FSDP expect every parameter to be used)."""
        if loss_fn is not None:
            for term in self.terms:
                term.evaluate(loss_fn)
                term.release_teacher()
        return self

    def loss(self, loss_fn: LossFn) -> tuple[Tensor, Tensor]:
        """(loss_sum, num_valid): the weighted sum of every term's divergence plus the auxiliary loss."""
        total = self.aux_loss_sum if self.aux_loss_sum is not None else self.num_valid.new_zeros((), dtype=torch.float32)
        for term in self.terms:
            total = total + term.weight * term.evaluate(loss_fn)
        return total, self.num_valid

    @torch.no_grad()
    def top1_agreement(self) -> list[tuple[Tensor, Tensor]]:
        """Per term (correct, count) over its trained rows: how often the drafter's argmax equals the teacher's (after
        ``loss``); device tensors, read back by the caller when it logs."""
        out = []
        for t in self.terms:
            pred = t.pred_N if t.pred_N is not None else t.student_NV.argmax(-1)
            hit = pred == t.label_N
            if t.weight_N is None:
                out.append((hit.sum(), torch.full((), pred.shape[0], dtype=torch.long, device=pred.device)))
            else:
                out.append(((hit & t.mask_N).sum(), t.mask_N.sum()))
        return out


class TrainingHooks:
    """What the training loop and the engines may ask a drafter beyond ``forward``; each has a default."""

    # True when the drafter trains one next-token term yet drafts autoregressively to any depth (a draft LM): the
    # simulated τ then applies that term's accuracy at every depth instead of stopping after one.
    drafts_autoregressively: bool = False
    # Whether the loss is given the teacher's dense [B, T, V] logits (``Teacher.signals(dense=...)``): needed where
    # several terms read every full-vocabulary row (Medusa's heads). A drafter whose loss reads each teacher row once,
    # or a vocabulary slice of it, says False: its loss chunks project the teacher's rows themselves, at no more cost.
    dense_teacher_logits: bool = True

    @property
    def needs_training(self) -> bool:
        """Whether the drafter is useless untrained (heads are; a pretrained draft LM or n-gram lookup is not)."""
        return any(True for _ in self.parameters())

    def prepare(self, dataset) -> None:
        """Before training: fit whatever comes from training-data statistics (EAGLE-3's reduced vocabulary)."""

    def count_valid(self, batch: Mapping[str, Tensor]) -> Tensor:
        """The count ``forward(batch, ...)`` reports as ``DraftOutput.num_valid`` (what its loss is normalised by):
        term 0's rows. The loop sums it over a step's micro-batches and all ranks *before* any forward, so each
        micro-batch's backward already carries the global per-token normalisation (any engine, any split)."""
        return self.train_mask(batch, 0).sum()

    def train_flops(self, target, B: int, T: int):
        """FLOPs of one training micro-batch of [B, T] tokens (``distill.flops.StepFlops``: teacher and drafter parts)
        from sizes alone, never a forward or a read of the batch: for the TFLOP/s and MFU the loop logs. ``target``:
        ``distill.flops.TargetShape``. None: this kind is not counted (no ``perf/tflops``)."""
        return None

    @property
    def flops_stage(self) -> tuple:
        """What, besides [B, T], changes ``train_flops`` from one step to another (a schedule's stage): the loop's
        cached count is keyed by it."""
        return ()

    # Engines read these two: DDP must look for parameters a step leaves without gradient (Medusa-2's LoRA in its
    # heads-only stage); sharding engines must not shard modules that live inside the target.
    may_skip_parameters: bool = False
    shares_target_modules: bool = False

    def param_groups(self) -> list[dict]:
        """The optimizer's parameter groups; ``lr_scale`` multiplies the scheduled learning rate (Medusa-2 trains the
        target's LoRA slower than its heads)."""
        return [{"params": [p for p in self.parameters() if p.requires_grad], "lr_scale": 1.0}]

    def compile_regions(self) -> list[tuple[object, str]]:
        """(object, method name) pairs ``trainer.compile`` compiles for training (``train.compile``): the dense,
        static pieces of the forward, one region per repeated block. Default: the ``forward`` of every block of the
        drafter's ``nn.ModuleList``s (DFlash's layers; a draft model overrides it: its attention and MLP modules)."""
        return [(block, "forward") for m in self.modules() if isinstance(m, nn.ModuleList) for block in m]

    def begin_step(self, step: int) -> None:
        """Called by the training loop before optimizer step ``step`` (0-based; also after a resume): drafters with a
        schedule (Medusa-2: heads first, then joint) switch on it."""

    def after_training(self, teacher, weights: Mapping[str, Tensor] | None = None) -> dict:
        """Called once training ends, before saving: extra figures for the training summary (Medusa-2: the adapted
        target's held-out loss beside the original's). Most drafters: none. ``weights``: the state dict ``drafter/``
        gets when it is not the drafter's current one (``trainer.select=best_tau`` chose an earlier step): figures
        about the drafter must be measured on these."""
        return {}

    # on-policy data (distill.onpolicy) -------------------------------------------------------------------
    can_sample: bool = False  # whether ``sample_continuations`` is implemented

    def sample_continuations(self, prompt_ids_BP: Tensor, num_new: int, temperature: float,
                             generator: torch.Generator) -> Tensor:
        """[B, num_new] tokens drawn from the drafter's own distribution after each prompt row (no gradient)."""
        raise NotImplementedError(f"drafter {self.name!r} cannot sample continuations")


class DecodingHooks:
    """What the decoders may ask beyond ``reset`` / ``observe`` / ``propose``; each has a default."""

    dynamic_tree: bool = False  # EAGLE-2 dynamic trees (EAGLE overrides)
    tree: DraftTree | None = None  # a static tree the cost model may prune (Medusa)
    variable_depth: bool = False  # chains cut short by the drafter itself, verified at their own width (DSpark)

    # An HF causal LM that HF's assisted generation can draft with (eval's ``hf_assisted`` baseline): a standalone
    # draft model's own LM; None for drafters that read the target's hidden states or draft without a model.
    assistant_model = None

    def accepted(self, path: list[int], committed: list[int] | None = None) -> None:
        """After each verification (and ``observe``): the nodes of the last proposal the target accepted, root side
        first; the next ``propose`` gets the old context + those nodes' tokens + one token from the target
        (``committed``: those tokens, on the host, where the caller has them). A drafter with its own cache resyncs
        from this instead of comparing sequences on the device. Callers that do not call it (a proposal on an
        arbitrary context) stay correct: the drafter then compares."""

    def static_draft(self, committed, capacity: int, sampling: SamplingConfig, generator):
        """The whole draft step as one capture-safe function over preallocated buffers
        (``inference.static_draft.StaticDraft``), or None: this drafter decodes on the eager path only."""
        return None

    def reuse_static_draft(self, settings: tuple, committed, capacity: int, sampling: SamplingConfig, generator,
                           build: Callable[[], Any]):
        """The static draft ``build`` makes, made once per (buffers, capacity, sampling, generator, the weights'
        dtype, device and storage, the drafter's decode ``settings``): a decoder asking again for the same buffers
        gets the same object, so the step it recorded or compiled for it serves every later sequence (each starts
        with ``prefill``)."""
        key = (id(committed), capacity, sampling, id(generator), weights_signature(self), settings)
        made = self.__dict__.setdefault("_static_drafts", {})  # a plain dict, not a submodule or buffer
        if key not in made:
            if len(made) >= STATIC_DRAFTS_KEPT:  # the oldest goes (its buffers with it)
                made.pop(next(iter(made)))
            made[key] = build()
        return made[key]

    def rows(self, seeds: list[int]) -> "ForkedRows":
        """The decoding state of a batch of ``len(seeds)`` new sequences (``inference.proposer.ProposerRows``).
        Per-row copies, drafted row by row: what a batch runs where the drafter has no static draft the verify takes."""
        return ForkedRows(self, seeds)

    def set_tree(self, spec) -> None:
        """Decode with the static tree ``spec`` (``decoder.tree``); only drafters with top-k candidates have one."""
        if spec is not None and spec != "chain":
            raise ValueError(f"decoder.tree={spec!r}: drafter {self.name!r} drafts a chain; set decoder.tree=null")


class PersistenceHooks:
    """What saving and decode-time overrides read (``heads.saved``); defaults fit most kinds."""

    def saved_config(self, drafter_cfg: Mapping[str, Any]) -> dict:
        """The node ``save_drafter`` records and ``load_drafter`` rebuilds from; most drafters: as configured."""
        return dict(drafter_cfg)

    # Constructor arguments that only steer decoding (tree shape and size, draft depth): ``python -m eval
    # drafter_path=... drafter.<key>=...`` may change them on a trained drafter; every other key is refused there.
    decode_keys: tuple[str, ...] = ("tree", "top_k", "depth", "total_tokens")


class Drafter(TrainingHooks, DecodingHooks, PersistenceHooks, nn.Module):
    """What every drafter kind implements: ``name``, ``teacher_layers`` (hidden-state indices, see
    ``distill.teacher``), a constructor taking the target's ``dims``, ``bind_target``, ``forward`` (training),
    ``train_mask``, and the proposing calls ``reset`` / ``observe`` / ``propose``. Everything else has a default in
    ``TrainingHooks``, ``DecodingHooks`` and ``PersistenceHooks``: a kind overrides only the hooks it has."""

    name: str = "drafter"  # how reports label it
    teacher_layers: tuple[int, ...] = ()

    def __init__(self, dims: TargetDims | Mapping[str, int]):
        super().__init__()
        self.dims = dims if isinstance(dims, TargetDims) else TargetDims(**dims)

    def bind_target(self, teacher, initialize: bool) -> None:
        """Attach frozen pieces of the target; when ``initialize``, copy initial weights from it."""

    def forward(self, batch: Mapping[str, Tensor], teacher_out, loss_fn: LossFn | None = None) -> DraftOutput:
        """One training step's draft terms (see the module docstring)."""
        raise NotImplementedError(f"drafter {self.name!r} does not implement forward")

    def train_mask(self, batch: Mapping[str, Tensor], k: int) -> Tensor:
        """Bool mask over the positions draft term ``k`` (0-based: Medusa head k + 1, EAGLE step k) is trained at,
        from the batch alone; ``forward`` selects term k's rows with it, so the two cannot disagree."""
        raise NotImplementedError(f"drafter {self.name!r} does not implement train_mask")

    def reset(self, seed: int = 0) -> None:
        """Forget the previous sequence. ``seed``: for drafters that sample their drafts; the decoder passes a fresh
        one per sequence from its own generator, so drafts are independent draws (the premise of rejection
        sampling) yet a seeded evaluation is reproducible."""

    def observe(self, hidden: dict[int, Tensor]) -> None:
        """Target hidden states ([1, m, D] per requested layer) of the positions just committed."""

    def propose(self, tokens: Tensor, max_depth: int, sampling: SamplingConfig = GREEDY) -> DraftTree:
        """Candidates continuing ``tokens`` ([1, n]), at most ``max_depth`` deep (an empty tree is a plain step)."""
        raise NotImplementedError


def fork_drafter(drafter: Drafter, seed: int) -> Drafter:
    """A per-sequence drafter: a shallow copy (same modules and weights, own attributes), reset with ``seed``.

    Every drafter keeps its decoding state in plain attributes that ``reset`` (re)creates, so after the reset the
    copy's state is its own; weights live in the shared ``_modules`` / ``_parameters``."""
    fork = copy.copy(drafter)
    fork.reset(seed=seed)
    return fork


class ForkedRows:
    """``ProposerRows`` for drafters without a batched path: one ``fork_drafter`` copy per row, drafted in turn."""

    def __init__(self, drafter: Drafter, seeds: list[int]):
        self.forks = [fork_drafter(drafter, s) for s in seeds]

    def observe(self, row: int, hidden: dict[int, Tensor]) -> None:
        self.forks[row].observe(hidden)

    def accepted(self, row: int, path: list[int], committed: list[int] | None = None) -> None:
        self.forks[row].accepted(path, committed)

    def propose(self, tokens: list[Tensor], depths: list[int], samplings: list[SamplingConfig]) -> list[DraftTree]:
        return [f.propose(t, d, s) if d >= 1 else DraftTree.empty(t.device)
                for f, t, d, s in zip(self.forks, tokens, depths, samplings)]

    def keep(self, rows: list[int]) -> None:
        self.forks = [self.forks[r] for r in rows]


def build_drafter(drafter_cfg: Mapping[str, Any], teacher) -> Drafter:
    return instantiate_drafter(drafter_cfg, TargetDims(teacher.hidden_size, teacher.vocab_size, teacher.num_layers))


def instantiate_drafter(drafter_cfg: Mapping[str, Any], dims: TargetDims) -> Drafter:
    try:
        return instantiate(dict(drafter_cfg), dims=dims, _convert_="all")
    except InstantiationException as e:
        # A drafter's own config error (it names the key and the fix) reads better without Hydra's wrapper.
        if isinstance(e.__cause__, (ValueError, FileNotFoundError)):
            raise e.__cause__ from None
        raise

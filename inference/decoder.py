"""Decoding: plain (one target forward per token) and speculative, for every drafter and any Hugging Face causal LM,
of one prompt (``Decoder.plain`` / ``speculative``) or a batch (``Decoder.batch``).

Both run as recorded steps over a static cache (``inference.batch_decoder``, docs/gpu-decoding.md): per step the
drafter proposes a chain or tree of candidates continuing the committed sequence (or runs its own static step); the
target runs ONE forward over [pending token, candidates...] on top of its KV cache (tree attention through a 4D mask
and explicit position ids); the acceptance rule picks the accepted path and one target token on the device, read back
once; the drafter is handed the accepted path's hidden states; rejected entries leave the cache. A single prompt is
the one-row bucket of the same steps. On CUDA each step is a CUDA graph replay (``decoder.cuda_graphs``).
The reference the steps are tested against (the model's own forward over a ``DynamicCache``) is the tests'
(tests/eager_reference.py).

Shapes: a single sequence (batch 1): ``tokens`` [1, n]. The pending token is the last committed token, predicted by
the target but not yet fed to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
from torch import Tensor

from inference.acceptance import TYPICAL_ALPHA, TYPICAL_THRESHOLD
from inference.batch_decoder import BucketDecoder
from inference.session import Session
from inference.generation import ACCEPTANCE_RULES, Generation, check_prompt, check_vocab, finish
from inference.masks import AttentionLayout
from inference.proposer import Proposer
from inference.sampling import SamplingConfig
from inference.runner import StepRunner

log = logging.getLogger(__name__)


@dataclass
class DecoderConfig:
    """``decoder:`` in the Hydra config: how every drafter is decoded and verified in an evaluation."""

    temperature: float = 0.0  # 0: greedy (output token-identical to plain greedy decoding)
    top_p: float = 1.0
    top_k: int = 0
    acceptance: str = "exact"  # exact (lossless) | typical (Medusa's typical acceptance: LOSSY, labelled so)
    typical_threshold: float = TYPICAL_THRESHOLD  # ε in p(x) > min(ε, δ·exp(-H(p)))
    typical_alpha: float = TYPICAL_ALPHA  # δ
    tree: Any = None  # null: each drafter's own; "chain"; a preset (small, default, wide); or top-k index paths
    auto_tune: bool = False  # pick the draft length / tree size with the best predicted speedup (inference.cost)
    seed: int = 0
    # python -m eval: also decode in batches of these sizes (inference.batch_decoder) and report throughput, latency and
    # the crossover batch size where speculation stops paying (eval.batch_sweep); null: batch 1 only
    batch_sizes: Optional[List[int]] = None
    policy: str = "always"  # batched decoding: always (γ = eval.num_draft every step) | auto (inference.policy)
    # The largest batch bucket (a power of two): a batch of more prompts is decoded in consecutive groups of this many
    # rows, bounding the buffers and the steps compiled / recorded per bucket; null: the next power of two, uncapped.
    max_batch_rows: Optional[int] = None
    # Every batch decodes through recorded steps over a static cache (inference.batch_decoder, docs/gpu-decoding.md).
    # cuda_graphs: auto (on for a CUDA target) | on | off: record each step bucket as a CUDA graph and replay it.
    cuda_graphs: str = "auto"
    # compile: auto (on for a CUDA target) | on | off: torch.compile each step function (fullgraph=True; one graph per
    # step kind shared by its capacity buckets: inductor fuses the target's small kernels); with CUDA graphs on, it is
    # recorded like an eager step. The first use of each step kind pays its compilation (about 20 s on an H200 for a
    # 1B target; the report's decoder_steps.compile_seconds). off: graphs over eager steps.
    compile: str = "auto"

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_p, self.top_k)


class Decoder:
    """Decodes with a frozen target (a ``distill.teacher.Teacher``) and, optionally, a drafter, as ``config`` (the
    ``decoder:`` config; None: its defaults) says."""

    def __init__(self, teacher, config: DecoderConfig | None = None, eos_token_id: int | None = None):
        config = config or DecoderConfig()
        self.config = config
        sampling, seed = config.sampling(), config.seed
        self.teacher = teacher
        self.model = teacher.model
        self.eos_token_id = eos_token_id
        self.sampling = sampling
        self.acceptance = config.acceptance
        self.device = teacher.device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # Sliding-window layers see their window through the masks, over a cache that keeps every layer whole
        # (inference.masks), so a context longer than the window decodes like any other.
        self.layout = AttentionLayout.of(self.model)
        self.max_positions = teacher.max_positions
        if config.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"decoder.acceptance={config.acceptance!r}; valid: {list(ACCEPTANCE_RULES)} (typical is "
                             f"lossy)")
        # How the steps run (CUDA graphs, compile), drawing from this generator.
        self.runner = StepRunner(self.device, self.generator, cuda_graphs=config.cuda_graphs, compile=config.compile)
        # One prompt or a batch: the same steps, in batch buckets (a single prompt is the one-row bucket).
        typical = (config.typical_threshold, config.typical_alpha) if config.acceptance == "typical" else None
        self.batch = BucketDecoder(teacher, eos_token_id, sampling, runner=self.runner, typical=typical,
                                   max_rows=config.max_batch_rows)

    @property
    def typical(self) -> tuple[float, float] | None:
        """(threshold, alpha) of Medusa's typical acceptance when it is the rule (lossy), else None."""
        return self.batch.typical

    @property
    def lossless(self) -> bool:
        return self.acceptance == "exact"

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def finish(self, committed: list[int], max_new_tokens: int) -> list[int]:
        """``finish`` with this decoder's EOS."""
        return finish(committed, max_new_tokens, self.eos_token_id)

    @torch.no_grad()
    def plain(self, prompt_ids: Tensor, max_new_tokens: int) -> Generation:
        """Autoregressive decoding (greedy or sampling, per ``self.sampling``): one target forward per token."""
        check_prompt(prompt_ids, max_new_tokens, 0, self.max_positions)
        return self._one(self.batch.plain([prompt_ids[0]], max_new_tokens))

    @staticmethod
    def _one(out) -> Generation:
        """A batch of one's generation, with the decode's times."""
        gen = out.generations[0]
        gen.seconds, gen.prefill_seconds = out.seconds, out.prefill_seconds
        gen.draft_seconds, gen.verify_seconds = out.draft_seconds, out.verify_seconds
        gen.compile_seconds = out.compile_seconds
        return gen

    def session(self, drafter: Proposer | None, prompt_ids: Tensor, max_new_tokens: int, num_draft: int) -> Session:
        """A sequence prefilled and ready to step (``inference.session.Session``): room for ``max_new_tokens``
        committed tokens; a drafter (None: plain steps only) drafting at most ``num_draft`` deep. The caller pins the
        attention backend (``self.runner.pinned()``) around it."""
        return Session(self.batch, drafter, prompt_ids, max_new_tokens, num_draft)

    @torch.no_grad()
    def speculative(self, drafter: Proposer, prompt_ids: Tensor, max_new_tokens: int, num_draft: int) -> Generation:
        """Speculative decoding; with ``acceptance="exact"`` the output is distributed exactly as ``plain``'s (and is
        token-identical to it when greedy). ``num_draft`` bounds the depth of each proposal (0: ``plain``)."""
        check_vocab(drafter, self.teacher.vocab_size)
        check_prompt(prompt_ids, max_new_tokens, num_draft, self.max_positions)
        if num_draft < 1:
            return self.plain(prompt_ids, max_new_tokens)
        return self._one(self.batch.speculative(drafter, [prompt_ids[0]], max_new_tokens, num_draft))

"""On-policy distillation data (GKD / DistillSpec): the draft writes the continuations it is trained on.

``data.mode=on_policy``: every micro-batch keeps the first ``data.on_policy_prompt_tokens`` tokens of each row as a
prompt, the draft samples the rest of the row at ``data.on_policy_temperature`` (no gradient), the frozen teacher
scores the whole row in the loop as usual, and the loss covers the sampled tokens only. ``data.mode=mixed``: a
``data.on_policy_fraction`` share of micro-batches is on-policy, the rest is the base data as it is (fixed, or the
target's regenerated answers when ``data.regenerated`` is set).

Why: a draft trained only on the teacher's (or the dataset's) text never sees its own mistakes; at decode time every
rejected draft token is one it produced itself. Sampling from the draft puts those states into training.

Which micro-batches are on-policy and what the draft samples are pure functions of (``seed``, micro-batch number),
so a resumed run draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from distill.data import ON_POLICY_MODES, DataConfig


class OnPolicyBatches:
    """``batch_source`` for ``train.loop.train``: replaces a collated batch's continuations with the draft's own."""

    def __init__(self, drafter, data_cfg: DataConfig, seed: int):
        mode = data_cfg.mode
        if mode not in ON_POLICY_MODES:
            raise ValueError(f"OnPolicyBatches serves data.mode in {ON_POLICY_MODES}, got data.mode={mode!r}")
        if not drafter.can_sample:
            raise ValueError(
                f"data.mode={mode} needs a drafter that samples its own continuations, but drafter={drafter.name} "
                f"cannot (it proposes from the target's features or a lookup); use drafter=draft_model, or "
                f"data.mode=fixed / regenerated"
            )
        self.drafter = drafter
        self.fraction = 1.0 if mode == "on_policy" else data_cfg.on_policy_fraction
        self.prompt_tokens = data_cfg.on_policy_prompt_tokens
        self.temperature = data_cfg.on_policy_temperature
        self.seed = seed
        self.sampled = 0  # micro-batches drawn so far (logged by tests and the caller)

    def is_on_policy(self, number: int) -> bool:
        """Whether micro-batch ``number`` is drawn from the draft (seeded per micro-batch, so resume-exact)."""
        if self.fraction >= 1:
            return True
        if self.fraction <= 0:
            return False
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + number)
        return float(torch.rand((), generator=gen)) < self.fraction

    def __call__(self, batch: Mapping[str, Tensor], number: int) -> dict[str, Tensor]:
        if not self.is_on_policy(number):
            return dict(batch)
        ids_BT = batch["input_ids"]
        P, T = self.prompt_tokens, ids_BT.shape[1]
        if not bool(batch["attention_mask"][:, :P].all()):
            raise ValueError(f"data.on_policy_prompt_tokens={P}: a row has padding inside its prompt; on-policy "
                             f"data needs packed rows (data.packing=true)")
        device = ids_BT.device
        gen = torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + number)
        new_BN = self.drafter.sample_continuations(ids_BT[:, :P], T - P, self.temperature, gen)
        self.sampled += 1
        loss_BT = torch.zeros_like(batch["loss_mask"], dtype=torch.bool)
        loss_BT[:, P:] = True  # only the draft's own tokens are learnt from
        return {"input_ids": torch.cat([ids_BT[:, :P], new_BN.to(ids_BT.dtype)], dim=1),
                "attention_mask": torch.ones_like(batch["attention_mask"]), "loss_mask": loss_BT}

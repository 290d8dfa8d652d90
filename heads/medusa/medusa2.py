"""Medusa-2 (Cai et al. 2024): Medusa heads trained jointly with a LoRA adapter on the target itself.

Which token each output predicts (as Medusa-1, ``heads/medusa/model.py``): head k at position t predicts token t+k+1; the
adapted target's own lm_head at position t predicts token t+1.

Shape legend:  B batch, T sequence, D target hidden size, V vocabulary, K heads, r LoRA rank.
    stage 1 (step < heads_only_steps):  original target (adapters off, no grad) -> hidden_BTD -> heads -> logits_BTV
    stage 2 (joint):  adapted target (base + B·A, gradient through the LoRA only) -> hidden_BTD, logits_BTV
        loss = Σ_k decay^(k-1) · D(head k at t, ORIGINAL target at t+k)          (the configured loss, per term)
             + lm_loss_weight · CE(adapted logits at t, token t+1)               (``aux_loss_sum``: keeps the
                                                                                  adapted target a good LM)

Where the LoRA lives: inside the target's own model (peft wraps its Linear layers in place), so an 8B target is never
copied. The drafter registers each wrapper's A [r, in] and B [out, r] Linear modules as its own, under
``lora.<module path with '-' for '.'>.{A,B}``: ``parameters()``, the optimizer and the checkpoint see heads + LoRA and
never a base weight. The saved config records ``lora_modules`` (path -> [in, out]) so ``load_saved_drafter`` rebuilds
the same modules without a target; ``bind_target`` then puts them into freshly injected peft wrappers.

Decoding / serving: ``bind_target(teacher, initialize=False)`` (what ``load_drafter`` calls) merges the LoRA into the
target's weights in place and removes the wrappers, so the teacher *is* the merged target from then on: plain decoding
and verification both run it, and the speedup is measured against what one would serve. The teacher's ``name`` and
``merged_adapter`` (and the drafter's ``verifies_against``) say so; the original target is no longer in memory.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distill.causal import causal_attention
from distill.chunked import Finished, chunked_cross_entropy
from distill.prompts import heldout_prompts
from distill.teacher_output import TeacherOutput
from heads import flops
from heads.base import DraftOutput, TargetDims
from heads.lora import ADAPTER, check_lora_spec, inject_lora, remove_lora
from heads.medusa.model import MedusaHeads

log = logging.getLogger(__name__)

HELDOUT_PROMPTS, HELDOUT_TOKENS = 16, 128  # after_training: held-out excerpts the two targets' losses are taken on


def _key(path: str) -> str:
    return path.replace(".", "-")  # ModuleDict keys cannot hold '.'; HF module paths never hold '-'


def _path(key: str) -> str:
    return key.replace("-", ".")


def _lora_pair(in_features: int, out_features: int, r: int) -> nn.ModuleDict:
    """A fresh (A, B) pair; B starts at zero, so an unloaded pair leaves the target as it is."""
    pair = nn.ModuleDict({"A": nn.Linear(in_features, r, bias=False), "B": nn.Linear(r, out_features, bias=False)})
    nn.init.zeros_(pair["B"].weight)
    return pair


class Medusa2(MedusaHeads):
    name = "medusa2"
    may_skip_parameters = True  # stage 1 leaves the LoRA without gradient (DDP must not wait for it)
    shares_target_modules = True  # the LoRA lives in the target's own layers: FSDP / ZeRO-3 must not shard it

    def __init__(self, dims: TargetDims | Mapping[str, int], num_heads: int = 4, num_layers: int = 1,
                 loss_decay: float = 0.8, tree: str | list | None = None, lora: Mapping[str, Any] | None = None,
                 heads_only_steps: int = 200, lm_loss_weight: float = 1.0, lora_lr_scale: float = 0.1,
                 lora_modules: Mapping[str, list[int]] | None = None):
        super().__init__(dims, num_heads=num_heads, num_layers=num_layers, loss_decay=loss_decay, tree=tree)
        self.lora_spec = check_lora_spec(lora or {}, "drafter.lora")
        if isinstance(heads_only_steps, bool) or not isinstance(heads_only_steps, int) or heads_only_steps < 0:
            raise ValueError(f"drafter.heads_only_steps must be an integer >= 0 (optimizer steps that train the heads "
                             f"alone before the joint stage; 0: joint from the start), got {heads_only_steps!r}")
        if not isinstance(lm_loss_weight, (int, float)) or not lm_loss_weight >= 0:
            raise ValueError(f"drafter.lm_loss_weight must be a number >= 0 (weight of the adapted target's next-token "
                             f"loss), got {lm_loss_weight!r}")
        if not isinstance(lora_lr_scale, (int, float)) or not lora_lr_scale > 0:
            raise ValueError(f"drafter.lora_lr_scale must be a number > 0 (the LoRA's learning rate = trainer.lr "
                             f"schedule x this), got {lora_lr_scale!r}; for heads alone use drafter=medusa")
        self.heads_only_steps, self.lora_lr_scale = heads_only_steps, lora_lr_scale
        self.lm_loss_weight = float(lm_loss_weight)
        self.lora = nn.ModuleDict()
        for path, sizes in (lora_modules or {}).items():
            if (not isinstance(sizes, (list, tuple)) or len(sizes) != 2
                    or not all(isinstance(s, int) and s > 0 for s in sizes)):
                raise ValueError(f"drafter.lora_modules[{path!r}]={sizes!r} must be [in_features, out_features]; this "
                                 f"key is written by save_drafter, not by hand")
            self.lora[_key(path)] = _lora_pair(sizes[0], sizes[1], self.lora_spec["r"])
        self._frozen: dict[str, nn.Module] = {}  # the target's model: used, never owned or saved
        self._wrappers: dict[str, nn.Module] = {}  # module path -> peft wrapper holding our A / B, while attached
        self._joint = heads_only_steps == 0
        self.verifies_against: str | None = None  # set once the LoRA is merged into the target

    # --- binding to the target ----------------------------------------------------------------------------
    def bind_target(self, teacher, initialize: bool) -> None:
        """Training (``initialize``): LoRA wrappers in the target, heads from its lm_head. Decoding: the saved LoRA is
        merged into the target's weights, which is what plain decoding and verification then run."""
        super().bind_target(teacher, initialize)
        self.attach(teacher, initialize)
        if not initialize:
            self.merge_into_target(teacher)

    def attach(self, teacher, initialize: bool = False) -> None:
        """Wrap the target's ``lora.target_modules`` with this drafter's LoRA (not merged). Wrappers already in the
        target (an earlier bind in this process, e.g. the training run before its evaluation) are removed first.
        A drafter without LoRA modules yet takes peft's freshly initialised ones when ``initialize``."""
        if getattr(teacher, "merged_adapter", None):
            raise ValueError(f"the target already has a LoRA merged into its weights ({teacher.merged_adapter}); a "
                             f"medusa2 drafter needs the original target: load a fresh one "
                             f"(distill.teacher.load_teacher)")
        model = teacher.model
        if removed := remove_lora(model, merge=False):
            log.info("removed %d LoRA wrappers an earlier bind left in the target", removed)
        wrappers = inject_lora(model, self.lora_spec, "drafter.lora")
        try:
            self._adopt(wrappers, initialize)
        except ValueError:
            remove_lora(model, merge=False)
            raise
        self._frozen, self._wrappers = {"model": model}, wrappers
        self.train(self.training)  # LoRA dropout follows the drafter's mode

    def _adopt(self, wrappers: Mapping[str, nn.Module], initialize: bool) -> None:
        if not self.lora and initialize:  # a new run: register peft's own A and B (same objects, so they train)
            for path, w in wrappers.items():
                if "-" in path:
                    raise ValueError(f"target module path {path!r} contains '-', which medusa2 uses as its separator")
                self.lora[_key(path)] = nn.ModuleDict({"A": w.lora_A[ADAPTER], "B": w.lora_B[ADAPTER]})
            return
        ours = {_path(k) for k in self.lora}
        if ours != set(wrappers):
            raise ValueError(
                f"this medusa2 drafter's LoRA covers {len(ours)} modules, the target's drafter.lora.target_modules "
                f"match {len(wrappers)}: missing from the target {sorted(ours - set(wrappers))[:4]}, not in the "
                f"drafter {sorted(set(wrappers) - ours)[:4]}; use the target (and drafter.lora) it was trained with")
        for path, w in wrappers.items():
            pair, ref = self.lora[_key(path)], w.lora_A[ADAPTER].weight
            if (pair["A"].weight.shape, pair["B"].weight.shape) != (ref.shape, w.lora_B[ADAPTER].weight.shape):
                raise ValueError(f"LoRA for {path}: saved A {tuple(pair['A'].weight.shape)} / B "
                                 f"{tuple(pair['B'].weight.shape)} do not fit the target's layer "
                                 f"({w.in_features} -> {w.out_features}, r={self.lora_spec['r']})")
            pair.to(device=ref.device, dtype=ref.dtype)  # where and in what dtype peft keeps adapters for this target
            w.lora_A[ADAPTER], w.lora_B[ADAPTER] = pair["A"], pair["B"]

    def merge_into_target(self, teacher) -> str:
        """Add B·A·scale into the target's weights in place and drop the wrappers; the teacher becomes the merged
        target (its ``name`` says so). Returns that label."""
        n = remove_lora(teacher.model, merge=True)
        self._wrappers = {}
        spec = self.lora_spec
        label = f"merged: {teacher.name} + LoRA r={spec['r']} alpha={spec['alpha']} ({n} layers)"
        teacher.merged_adapter = teacher.name = self.verifies_against = label
        log.info("medusa2: verifying against the %s", label)
        return label

    def lora_weights(self) -> dict[str, tuple[Tensor, Tensor]]:
        """Module path -> (A [r, in], B [out, r]): what a PEFT adapter file holds."""
        return {_path(k): (pair["A"].weight, pair["B"].weight) for k, pair in self.lora.items()}

    def saved_config(self, drafter_cfg: Mapping[str, Any]) -> dict:
        node = dict(drafter_cfg)
        node["lora"] = dict(self.lora_spec)  # defaults resolved, so a load never re-derives them
        if len(self.lora):
            node["lora_modules"] = {_path(k): [pair["A"].in_features, pair["B"].out_features]
                                    for k, pair in self.lora.items()}
        return node

    # --- training -----------------------------------------------------------------------------------------
    def param_groups(self) -> list[dict]:
        # Medusa-2 moves the backbone slower than the heads; every LoRA tensor is listed whatever its requires_grad
        # (peft flips that flag when adapters are toggled).
        return [{"params": [p for p in self.heads.parameters() if p.requires_grad], "lr_scale": 1.0},
                {"params": list(self.lora.parameters()), "lr_scale": self.lora_lr_scale}]

    def train_flops(self, target, B: int, T: int):
        return flops.medusa2(self, target, B, T)

    @property
    def flops_stage(self) -> tuple:
        return (self._joint,)

    def begin_step(self, step: int) -> None:
        joint = step >= self.heads_only_steps
        if joint and not self._joint:
            log.info("medusa2: step %d, joint stage (heads + LoRA) begins", step)
        self._joint = joint

    def train(self, mode: bool = True):
        super().train(mode)
        for w in self._wrappers.values():  # the target stays in eval mode; only its LoRA dropout follows training
            w.lora_dropout.train(mode)
        return self

    def forward(self, batch: Mapping[str, Tensor], teacher_out: TeacherOutput, loss_fn=None) -> DraftOutput:
        if not self._joint:  # stage 1: Medusa-1 on the original target's states, nothing flows into the LoRA
            return super().forward(batch, teacher_out, loss_fn)
        if not self._wrappers:
            raise RuntimeError("medusa2's joint stage needs the LoRA attached: bind_target(teacher, initialize=True)")
        ids_BT, attention_BT = batch["input_ids"], batch["attention_mask"]
        model = self._frozen["model"]
        # logits_to_keep=1: the adapted target's [B, T, V] logits are never formed; its LM loss projects in chunks.
        # No mask: training rows are right-padded or packed (distill.data), exact at every real position, as the
        # teacher's forward (distill.teacher.Teacher.__call__'s right_padded).
        with causal_attention(model):  # no mask built, no host read-back (distill.causal)
            out = model(input_ids=ids_BT, output_hidden_states=True, use_cache=False, logits_to_keep=1)
        hidden_BTD = out.hidden_states[-1]
        # Heads read the adapted target's final normed state, but are still distilled toward the original's logits.
        draft = super().forward(batch, dataclasses.replace(teacher_out, hidden={-1: hidden_BTD}), loss_fn)
        if self.lm_loss_weight:
            # Position t predicts token t+1, trained where that token is loss-bearing (as the loader masks it).
            # Every position is a row, weighted by that mask: static shapes, no sync.
            weight_N = (batch["loss_mask"].bool() & attention_BT.bool())[:, 1:].reshape(-1).float()
            head = Finished(model.get_output_embeddings(), self._finish)  # the target's lm_head, then its soft-cap
            B, n = ids_BT.shape[0], ids_BT.shape[1] - 1
            ce = chunked_cross_entropy(hidden_BTD[:, :-1].reshape(B * n, -1), head, ids_BT[:, 1:].reshape(-1),
                                       self.dims.vocab_size, weight_N=weight_N)
            draft.aux_loss_sum = self.lm_loss_weight * ce
        return draft

    @torch.no_grad()
    def after_training(self, teacher, weights: Mapping[str, Tensor] | None = None) -> dict:
        """Mean next-token loss of the original and the adapted target on held-out stdlib excerpts: the adapted one
        is what gets served, so it should not be worse. {} without a tokenizer or attached LoRA. ``weights`` (the
        selected step's, which ``drafter/`` gets) are loaded first: the LoRA measured is the one written."""
        if weights is not None:
            self.load_state_dict(weights, strict=True)
        if teacher.tokenizer is None or not self._wrappers or self._frozen.get("model") is not teacher.model:
            return {}

        tokens = min(HELDOUT_TOKENS, teacher.max_positions or HELDOUT_TOKENS)
        prompts = heldout_prompts(teacher.tokenizer, HELDOUT_PROMPTS, tokens, seed=1)  # seed 0: eval's prompts
        ids_NT = torch.tensor(prompts, device=teacher.device)
        original = _next_token_loss(lambda x: teacher(x).logits_BTV, ids_NT)  # the teacher switches adapters off
        adapted = _next_token_loss(lambda x: teacher.model(input_ids=x, use_cache=False).logits, ids_NT)
        log.info("medusa2 held-out next-token loss (%d x %d tokens): original %.4f, adapted %.4f",
                 *ids_NT.shape, original, adapted)
        return {"heldout/original_loss": original, "heldout/adapted_loss": adapted}


def _next_token_loss(logits_fn, ids_NT: Tensor, rows: int = 4) -> float:
    total, count = 0.0, 0
    for ids_BT in ids_NT.split(rows):
        logits_BTV = logits_fn(ids_BT)
        total += F.cross_entropy(logits_BTV[:, :-1].flatten(0, 1).float(), ids_BT[:, 1:].flatten(),
                                 reduction="sum").item()
        count += ids_BT[:, 1:].numel()
    return total / count

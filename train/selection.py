"""Which weights become ``<run dir>/drafter/``: the last step's, or those with the best held-out simulated τ.

τ can peak and then fall while the training loss keeps dropping (a drafter trained for many epochs over-fits the
teacher's training rows), so the checkpoint to serve is the one with the best held-out τ, not the last.
``trainer.select=best_tau`` (the default) evaluates every ``trainer.eval_every`` steps, and at the last step, on
``trainer.eval_rows`` held-out rows of ``data.max_length`` tokens cut from the held-out stdlib split
(``distill.prompts.heldout_prompts``, with another seed than ``python -m eval``'s prompts): the teacher's signals,
the drafter's top-1 agreement per draft term, and ``inference.stats.simulated_tau`` over them, the same figure the
loop logs as ``train/sim_tau`` on training rows. A better τ (strictly: ties keep the earlier, cheaper-trained
weights) writes the weights to ``<run dir>/best_tau/`` (atomically, with the step and τ in its config.json).
``trainer.select=last`` still logs the evaluation, and writes the last weights.

Resumable: each checkpoint stores the selection so far (``state``) and a copy of ``best_tau/`` as it stood, and a
resume puts both back, so a run killed after a later (not yet checkpointed) best continues exactly as an
uninterrupted one. The copy goes back only when the resumed run first needs it (an evaluation, a checkpoint, the
final weights): a resume refused before its first step leaves ``best_tau/`` as it found it.

Every read of best weights (copied into a checkpoint, put back on resume, taken by ``drafter/``) is checked against
the sha256 written beside them: ``drafter/`` gets a fresh digest of what it is given, so damaged bytes passed on here
would leave the run as a "verified" drafter.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

from distill.atomic import tmp_sibling
from distill.fingerprint import check_digest
from distill.data import TokenBlockDataset, collate
from distill.prompts import heldout_prompts
from heads.saved import WEIGHTS, save_drafter
from inference.stats import simulated_tau

log = logging.getLogger(__name__)

SELECTIONS = ("last", "best_tau")
BEST_DIR = "best_tau"
HELDOUT_SEED = 1  # python -m eval cuts its prompts with seed 0: selecting on them would flatter the report


def heldout_rows(tokenizer, num_rows: int, max_length: int) -> TokenBlockDataset:
    """``num_rows`` held-out rows of ``max_length`` tokens, every token loss-bearing."""
    ids = torch.tensor(heldout_prompts(tokenizer, num_rows, max_length, seed=HELDOUT_SEED), dtype=torch.long)
    return TokenBlockDataset(ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))


class HeldoutTau:
    """Simulated τ of the drafter on fixed held-out rows; every rank evaluates the same rows (a sharded drafter or
    target needs every rank in each forward), so every rank gets the same figure with no reduction."""

    def __init__(self, teacher, rows, batch_size: int, depth: int | None):
        self.teacher, self.rows, self.batch_size, self.depth = teacher, rows, batch_size, depth

    @torch.no_grad()
    def __call__(self, step: int, model, drafter, loss_fn: Callable, engine) -> float:
        layers = tuple(drafter.teacher_layers)
        agree = None
        was_training = model.training
        model.eval()
        try:
            for first in range(0, len(self.rows), self.batch_size):
                items = [self.rows[i] for i in range(first, min(first + self.batch_size, len(self.rows)))]
                batch = {k: v.to(engine.device) for k, v in collate(items).items()}
                with engine.autocast():
                    teacher_out = self.teacher.signals(batch, layers, dense=drafter.dense_teacher_logits)
                    out = model(batch, teacher_out, loss_fn=loss_fn)
                    out.loss(loss_fn)  # sets each term's predictions and labels
                counts = torch.stack([torch.stack(c) for c in out.top1_agreement()])  # [K, 2]: correct, count
                agree = counts if agree is None else agree + counts
        finally:
            model.train(was_training)
        accs = (agree[:, 0].float() / agree[:, 1].clamp(min=1)).tolist()
        return simulated_tau(accs, self.depth)


class Selection:
    """The best held-out τ so far and its weights (``<run dir>/best_tau/``); the loop calls ``evaluate`` on
    evaluation steps, ``state`` / ``copy_into`` when checkpointing and ``restore`` when resuming. ``evaluate(step,
    model, drafter, loss_fn, engine) -> τ``: ``HeldoutTau``, or any stand-in."""

    def __init__(self, evaluate: Callable, select: str, run_dir, save_args: Mapping):
        if select not in SELECTIONS:
            raise ValueError(f"trainer.select={select!r}; valid: {list(SELECTIONS)}")
        self.evaluate_fn, self.select, self.run_dir = evaluate, select, Path(run_dir)
        self.save_args = dict(save_args)  # drafter_cfg, target_cfg, target_identity for save_drafter
        self.best_step: int | None = None
        self.best_tau: float | None = None
        self._restore_from: Path | None = None  # a checkpoint's best_tau/, put back when first needed
        self._restore_pending = False

    @property
    def best_dir(self) -> Path:
        return self.run_dir / BEST_DIR

    def evaluate(self, step: int, model, drafter, loss_fn: Callable, engine) -> dict:
        """Evaluate after ``step`` optimizer steps; keep the weights when they beat the best so far."""
        # Rank 0's figure on every rank: ranks computing it apart could round differently, and a rank that alone
        # saw a new best would enter the collective weight gather below alone.
        tau = float(engine.broadcast_object(float(self.evaluate_fn(step, model, drafter, loss_fn, engine))))
        better = self.best_tau is None or tau > self.best_tau
        if better and self.select == "best_tau":
            self._put_back()
            weights = engine.model_state_dict()  # collective under sharding engines
            if engine.is_main:
                save_drafter(engine.module, self.best_dir, self.save_args["drafter_cfg"], self.save_args["target_cfg"],
                             self.save_args["target_identity"], extra={"step": step, "heldout_sim_tau": tau},
                             state_dict=weights)
            engine.barrier()
        if better:
            self.best_step, self.best_tau = step, tau
        return {"eval/heldout_sim_tau": tau, "eval/best_heldout_sim_tau": self.best_tau,
                "eval/best_step": self.best_step}

    def state(self) -> dict:
        return {"select": self.select, "best_step": self.best_step, "best_tau": self.best_tau}

    def copy_into(self, checkpoint_dir: Path) -> None:
        """Main rank, while a checkpoint is written: the best weights as they stand at that step."""
        self._put_back()
        if self.select == "best_tau" and self.best_dir.is_dir():
            checked_weights(self.best_dir, load=False)
            shutil.copytree(self.best_dir, checkpoint_dir / BEST_DIR)

    def restore(self, state: Mapping | None, checkpoint_dir: Path, is_main: bool) -> None:
        """Put back the selection a checkpoint holds: its best step and τ, and ``best_tau/`` as it stood then (a
        newer one on disk came from steps the resumed run replays). The directory is put back when first needed
        (``_put_back``), after every refusal a resume can meet before its first step."""
        state = dict(state or {})
        if state.get("select", self.select) != self.select:  # a selection made under another rule is restarted
            state = {}
        self.best_step, self.best_tau = state.get("best_step"), state.get("best_tau")
        if not is_main or self.select != "best_tau":
            return
        saved = checkpoint_dir / BEST_DIR
        if self.best_step is not None and saved.is_dir():
            checked_weights(saved, load=False)  # refused now, before the run starts, rather than at its end
            self._restore_from = saved
        else:
            self._restore_from = None
            self.best_step = self.best_tau = None
        self._restore_pending = True

    def _put_back(self) -> None:
        """The ``best_tau/`` a resume restored, written into the run dir (once)."""
        if not self._restore_pending:
            return
        self._restore_pending = False
        if self._restore_from is not None:
            tmp = tmp_sibling(self.best_dir)
            shutil.copytree(self._restore_from, tmp)
            if self.best_dir.exists():
                shutil.rmtree(self.best_dir)
            tmp.replace(self.best_dir)
        elif self.best_dir.exists():
            shutil.rmtree(self.best_dir)

    def final_weights(self) -> dict | None:
        """The weights ``drafter/`` gets under ``select=best_tau`` (main rank), or None to keep the last ones."""
        self._put_back()
        if self.select != "best_tau" or self.best_step is None or not (self.best_dir / WEIGHTS).is_file():
            return None
        return checked_weights(self.best_dir)


def checked_weights(best_dir: Path, load: bool = True) -> dict | None:
    """The tensors of ``best_dir``'s weights (``load=False``: only checked), refused in one line naming the file when
    they are unreadable or differ from the sha256 written beside them."""
    weights = best_dir / WEIGHTS
    fix = (f"these are the best held-out step's weights: copy them again from a checkpoint's copy "
           f"(checkpoints/step_*/{BEST_DIR}), or rerun with trainer.select=last to take the last step's weights")
    try:
        check_digest(weights)
        return load_file(str(weights)) if load else None
    except ValueError as e:
        raise ValueError(f"{e}; {fix}") from None
    except Exception as e:  # safetensors raises its own error types for truncated or foreign files
        raise ValueError(f"{weights} is not a readable safetensors file ({type(e).__name__}: {e}); {fix}") from None

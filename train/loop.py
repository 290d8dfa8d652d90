"""The training loop: one readable function, free of per-drafter and per-engine branches.

Order (nanoGPT): build optimizer and data order, resume if asked; then per step: set lr, forward/backward over
``grad_accum`` micro-batches, turn the summed gradients into a per-token mean, clip and step, log, checkpoint.

Loss normalisation: every micro-batch backpropagates its *sum* over valid tokens; after accumulation the gradients
are divided once by the number of valid tokens of the whole step (summed over ranks by the engine), so each token
weighs the same however the tokens are spread over micro-batches and ranks.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping

import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from train import checkpoint

log = logging.getLogger(__name__)


def lr_at(step: int, trainer_cfg: Mapping) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` of the peak."""
    peak, warmup, total = trainer_cfg["lr"], trainer_cfg["warmup_steps"], trainer_cfg["steps"]
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = peak * trainer_cfg["min_lr_ratio"]
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


class BatchOrder:
    """Deterministic micro-batch order: a fresh seeded permutation per epoch, indexed by global micro-batch number.

    Being a pure function of (seed, micro-batch number) makes resume exact: no data is skipped or seen twice.
    """

    def __init__(self, num_examples: int, batch_size: int, seed: int):
        if num_examples < batch_size:
            raise ValueError(
                f"the dataset has {num_examples} examples, fewer than trainer.micro_batch_size={batch_size}; "
                f"add data or lower trainer.micro_batch_size"
            )
        self.n, self.batch_size, self.seed = num_examples, batch_size, seed
        self.per_epoch = num_examples // batch_size
        self._epoch, self._perm = -1, None

    def indices(self, micro_batch: int) -> list[int]:
        epoch, j = divmod(micro_batch, self.per_epoch)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=gen)
        return self._perm[j * self.batch_size : (j + 1) * self.batch_size].tolist()


def simulated_tau(accs: list[float], depth: int | None = None) -> float:
    """τ a chain drafter would reach if depth k were accepted independently with its training top-1 accuracy:
    1 + Σ_k Π_{j≤k} acc_j (the bonus token included, as in ``eval.metrics``). For Medusa head k and EAGLE step k the
    accuracy is already conditioned on the right context, so this is an estimate, reported beside the measured τ.
    ``depth``: extend to that many draft tokens with the last accuracy (a draft LM's one next-token term)."""
    # The decode-time formula (inference.cost), so the two cannot drift.
    from inference.cost import chain_tau

    if depth is not None and accs:
        accs = list(accs) + [accs[-1]] * (depth - len(accs))
    return chain_tau(accs, len(accs))


def train(cfg: Mapping, teacher, drafter, dataset: Dataset, collate: Callable, loss_fn: Callable, engine,
          run_dir, logger, batch_source: Callable | None = None) -> dict:
    """``batch_source(batch, micro_batch_number)``: what replaces a collated batch before the teacher sees it
    (``distill.onpolicy``: the draft writes the continuations); None keeps the data as it is."""
    t = cfg["trainer"]
    drafter = engine.wrap(drafter)
    groups = [g for g in drafter.param_groups() if g["params"]]
    params = [p for g in groups for p in g["params"]]
    optimizer = torch.optim.AdamW(groups, lr=t["lr"], betas=(0.9, 0.95), weight_decay=t["weight_decay"])
    identity = teacher.identity()
    start = 0
    if t["resume"] == "auto" and (ckpt := checkpoint.latest_checkpoint(run_dir)) is not None:
        start = checkpoint.load_checkpoint(ckpt, drafter, optimizer, cfg["drafter"], identity)
    order = BatchOrder(len(dataset), t["micro_batch_size"], cfg["seed"])
    layers = tuple(drafter.teacher_layers)
    sim_depth = cfg.get("eval", {}).get("num_draft") if drafter.drafts_autoregressively else None

    drafter.train()
    last: dict = {}
    t_start = time.perf_counter()
    bar = tqdm(range(start, t["steps"]), initial=start, total=t["steps"], desc="train", disable=not engine.is_main)
    for step in bar:
        lr = lr_at(step, t)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        drafter.begin_step(step)
        loss_sum = torch.zeros((), device=engine.device)
        num_valid = torch.zeros((), device=engine.device, dtype=torch.long)
        logging_step = step % t["log_every"] == 0 or step == t["steps"] - 1
        agree = None
        for micro in range(t["grad_accum"]):
            number = step * t["grad_accum"] + micro
            batch = {k: v.to(engine.device) for k, v in collate([dataset[i] for i in order.indices(number)]).items()}
            if batch_source is not None:
                batch = batch_source(batch, number)
            with engine.autocast():
                teacher_out = teacher.signals(batch, layers)
                out = drafter(batch, teacher_out)
                micro_loss, micro_valid = out.loss(loss_fn)
            engine.backward(micro_loss)
            loss_sum += micro_loss.detach()
            num_valid += micro_valid
            if logging_step:  # argmax over the vocabulary per term: only when it will be reported
                counts = torch.stack([torch.stack(c) for c in out.top1_agreement()])  # [K, 2]: correct, count
                agree = counts if agree is None else agree + counts
        total_valid = engine.all_reduce_sum(num_valid)
        # A tensor scale, not a Python number: no device sync outside logging steps.
        grad_norm = engine.step(optimizer, params, 1.0 / total_valid.clamp(min=1), t["grad_clip"])

        if logging_step:
            total_loss = engine.all_reduce_sum(loss_sum)
            agree = engine.all_reduce_sum(agree)
            last = {"train/loss": (total_loss / total_valid.clamp(min=1)).item(), "train/lr": lr,
                    "train/grad_norm": grad_norm.item(), "train/valid_tokens": int(total_valid),
                    "train/elapsed_s": time.perf_counter() - t_start}
            accs = (agree[:, 0].float() / agree[:, 1].clamp(min=1)).tolist()
            last.update({f"train/acc_head{k + 1}": a for k, a in enumerate(accs)})
            last["train/sim_tau"] = simulated_tau(accs, sim_depth)
            logger.log(last, step=step)
            bar.set_postfix(loss=f"{last['train/loss']:.3f}", acc1=f"{accs[0]:.2f}" if accs else "-")
        # The last step is checkpointed too, so rerunning a finished run dir resumes to "done", not to step N-k.
        if ((step + 1) % t["ckpt_every"] == 0 or step + 1 == t["steps"]) and engine.is_main:
            checkpoint.save_checkpoint(run_dir, step + 1, drafter, optimizer, cfg["drafter"], cfg["target"],
                                       identity, t["keep_last"])
    drafter.eval()
    return last

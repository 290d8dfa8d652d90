"""The training loop: one readable function, free of per-drafter and per-engine branches.

Order (nanoGPT): build optimizer and data order, resume if asked; then per step: set lr, collate this rank's
``grad_accum`` micro-batches and count their valid tokens over all ranks, forward/backward each, clip and step (the
engine), log, checkpoint (every rank takes part; the main rank writes). A step whose loss (before the update) or
weights (after it) are non-finite stops the run there (``train.nonfinite``): one scalar sync per step.

Loss normalisation: a step's micro-batches are collated first and their valid tokens counted
(``Drafter.count_valid``) and summed over ranks; each micro-batch then backpropagates its loss *sum* divided by
that global count, so each token weighs the same however the tokens are spread over micro-batches and ranks, and
the accumulated gradient is already the per-token mean when the engine clips and steps.

Data: the step's global batch is ``micro_batch_size x grad_accum x world size`` rows; rank r takes global
micro-batches ``[(step * world + r) * grad_accum, ... + grad_accum)`` of ``BatchOrder``, so one process with
``grad_accum = 2`` and two ranks with ``grad_accum = 1`` train on the same rows in the same steps.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
from torch import Tensor
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from distill.chunked import chunk_budget, default_chunk_elements
from distill.data import rows_fingerprint
from distill.row_seeds import ROW_SEED, row_seeds
from distill.fused_kernels import fused_kernel
from heads.train_attention import train_attention
from distill.schedule import warmup_cosine
from train import checkpoint, nonfinite
from train.compile import FirstStepTimer, compile_setting, compiled_regions, resolve_compile
from train.feed import StepFeed
from train.selection import Selection
from train.preemption import Preempted, StopFlag, stop_on_signals, stopped_line
from train.config import Config
from train.engine import TrainerConfig
from train.flops import FlopMeter, device_peak_tflops
from inference.stats import simulated_tau

log = logging.getLogger(__name__)


def lr_at(step: int, trainer_cfg: TrainerConfig) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` of the peak (``distill.schedule``, shared with the toy
    target's pretraining)."""
    warmup = trainer_cfg.warmup_steps
    return warmup_cosine(step, trainer_cfg.lr, warmup, trainer_cfg.steps - warmup, trainer_cfg.min_lr_ratio)


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


def train(cfg: Config, teacher, drafter, dataset: Dataset, collate: Callable, loss_fn: Callable, engine,
          run_dir, logger, batch_source: Callable | None = None, selection: Selection | None = None) -> dict:
    """``batch_source(batch, micro_batch_number)``: what replaces a collated batch before the teacher sees it
    (``distill.onpolicy``: the draft writes the continuations); None keeps the data as it is. ``selection``: the
    held-out evaluation every ``trainer.eval_every`` steps and the best weights so far (``train.selection``); None
    evaluates nothing. SIGTERM, SIGINT and SIGUSR1 stop the run after the step they arrive in, checkpointed
    (``train.preemption``). ``trainer.compile``: the drafter's regions and the loss core run compiled
    (``train.compile``) for the whole run, and are restored after it."""
    t = cfg.trainer
    model, optimizer = engine.setup(drafter, lambda groups: torch.optim.AdamW(
        groups, lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay))
    compiled = resolve_compile(t.compile, engine.device, engine.name, t.zero_stage)
    with contextlib.ExitStack() as stack, chunk_budget(t.loss_chunk_elements or default_chunk_elements(engine.device)), \
            fused_kernel(t.fused_kernel), train_attention(t.attention), stop_on_signals() as stop, \
            compiled_regions(drafter.compile_regions() if compiled else (), compiled, t.compile_backend,
                             strict=compile_setting(t.compile) == "on") as report:
        return _train(cfg, teacher, drafter, model, optimizer, dataset, collate, loss_fn, engine, run_dir, logger,
                      batch_source, stop, selection, report, stack)


def _train(cfg: Config, teacher, drafter, model, optimizer, dataset: Dataset, collate: Callable, loss_fn: Callable,
           engine, run_dir, logger, batch_source: Callable | None, stop: StopFlag, selection: Selection | None,
           report, stack: contextlib.ExitStack) -> dict:
    t = cfg.trainer
    identity = {**teacher.identity(), "weights_digest": teacher.weights_digest()}
    layout = {**data_layout(t, engine.world_size, len(dataset), cfg.seed), "rows_digest": rows_fingerprint(dataset)}
    recipe = checkpoint.training_recipe(cfg.loss, cfg.trainer)
    start, last = 0, {}
    if (ckpt := checkpoint.resume_point(run_dir, t.resume, t.steps)) is not None:
        start = checkpoint.load_checkpoint(ckpt, engine, optimizer, cfg.drafter, identity, layout, recipe)
        last = checkpoint.saved_metrics(ckpt)  # a finished run resumed to done keeps its final metrics
        if selection is not None:
            selection.restore(checkpoint.saved_selection(ckpt), ckpt, engine.is_main)
        if report is not None and start < t.steps and engine.is_main:
            # A resumed process compiles its kernels afresh (their fusions and autotuned choices are not part of a
            # checkpoint), so nothing promises the same floating-point order as the uninterrupted run's.
            log.warning("trainer.compile=%s: resuming from %s with compiled kernels is not bit-exact (the run after "
                        "it may differ from the uninterrupted one in the last bits); set trainer.compile=off for an "
                        "exact resume", t.compile, ckpt.name)
    order = BatchOrder(len(dataset), t.micro_batch_size, cfg.seed)
    layers = tuple(drafter.teacher_layers)
    sim_depth = cfg.eval.num_draft if drafter.drafts_autoregressively else None
    accum = t.grad_accum
    flops = FlopMeter(drafter, teacher, engine.world_size, device_peak_tflops(engine.device, t.peak_tflops))

    model.train()
    t_start = t_window = time.perf_counter()
    tokens_window = torch.zeros((), dtype=torch.long, device=engine.device)  # summed on device: no sync per step
    wait_window, steps_window, first_step = 0.0, 0, FirstStepTimer(report)
    # This rank's micro-batches: global numbers [first, first + accum). Ranks take disjoint, consecutive slices of
    # the step's global batch, so any world size sees the same rows per step and none twice. Collated one step
    # ahead on the feed's thread (``train.feed``).
    numbers = lambda s: range((s * engine.world_size + engine.rank) * accum,
                              (s * engine.world_size + engine.rank + 1) * accum)
    feed = stack.enter_context(StepFeed(dataset, collate, order.indices, numbers, engine.device, t.steps))
    bar = tqdm(range(start, t.steps), initial=start, total=t.steps, desc="train", disable=not engine.is_main)
    for step in bar:
        lr = lr_at(step, t)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        drafter.begin_step(step)
        # A held-out evaluation step (train.selection) is a logging step too: its figures share the step's row.
        eval_step = selection is not None and t.eval_every > 0 and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps)
        logging_step = step % t.log_every == 0 or step == t.steps - 1 or eval_step
        clock = PhaseClock(engine.device, enabled=logging_step)
        first = numbers(step)[0]
        batches, waited = feed.get(step)
        wait_window, steps_window = wait_window + waited, steps_window + 1
        for micro, batch in enumerate(batches):
            batch = batch_source(batch, first + micro) if batch_source is not None else batch
            # Per-row seeds (distill.row_seeds) from the row's index in the step's global batch: a drafter that
            # samples training positions draws the same for any world size and across a resume.
            index = (first + micro - step * engine.world_size * accum) * t.micro_batch_size
            batch[ROW_SEED] = feed.upload(row_seeds(cfg.seed, step, index, batch["input_ids"].shape[0]))
            batches[micro] = batch
        # The step's valid-token count over all micro-batches and ranks, known before any forward (torchtitan's
        # global token count): each backward then carries its final per-token weight.
        total_valid = engine.all_reduce_sum(sum(drafter.count_valid(b) for b in batches)).clamp(min=1)
        loss_sum = torch.zeros((), device=engine.device)
        agree = None
        for micro, batch in enumerate(batches):
            tokens_window += batch["attention_mask"].sum()
            flops.add(batch)  # from the batch's shape: no sync
            with engine.micro_step(sync=micro == accum - 1):
                with clock("teacher"):
                    teacher_out = teacher.signals(batch, layers, dense=drafter.dense_teacher_logits)
                with clock("drafter"):
                    out = model(batch, teacher_out, loss_fn=loss_fn)  # the loss is computed inside the call
                    micro_loss, _ = out.loss(loss_fn)
                    del teacher_out  # its logits are no longer needed; free them before backward
            with clock("drafter"):
                engine.backward(micro_loss / total_valid)
            loss_sum += micro_loss.detach()
            if logging_step:  # argmax over the vocabulary per term: only when it will be reported
                counts = torch.stack([torch.stack(c) for c in out.top1_agreement()])  # [K, 2]: correct, count
                agree = counts if agree is None else agree + counts
        # One scalar sync per step: a diverged step must stop the run before its update, never reach a checkpoint.
        if not bool(torch.isfinite(loss_sum)):
            where = nonfinite.locate(model, teacher, batches, layers, loss_fn, engine)
            raise nonfinite.loss_error(step, loss_sum, lr, where, run_dir)
        with clock("drafter"):
            grad_norm = engine.step(optimizer, t.grad_clip)
        if not bool(torch.isfinite(grad_norm)):
            nonfinite.check_update(step, grad_norm, drafter, lr, run_dir)
        first_step.done()

        if logging_step:
            total_loss = engine.all_reduce_sum(loss_sum)
            agree = engine.all_reduce_sum(agree)
            last = {"train/loss": (total_loss / total_valid).item(), "train/lr": lr,
                    "train/grad_norm": float(grad_norm), "train/valid_tokens": int(total_valid),
                    "train/elapsed_s": time.perf_counter() - t_start}
            accs = (agree[:, 0].float() / agree[:, 1].clamp(min=1)).tolist()
            last.update({f"train/acc_head{k + 1}": a for k, a in enumerate(accs)})
            last["train/sim_tau"] = simulated_tau(accs, sim_depth)
            last.update(throughput(engine, clock, tokens_window, time.perf_counter() - t_window, flops,
                                   last["train/elapsed_s"]))
            last["perf/data_wait_s"] = wait_window / max(steps_window, 1)
            if report is not None:
                last.update(report.summary())
            if eval_step:
                last.update(selection.evaluate(step + 1, model, drafter, loss_fn, engine))
            t_window, wait_window, steps_window = time.perf_counter(), 0.0, 0
            tokens_window.zero_()
            logger.log(last, step=step)
            bar.set_postfix(loss=f"{last['train/loss']:.3f}", acc1=f"{accs[0]:.2f}" if accs else "-")
        # A signal (pre-emption, Ctrl-C) stops the run after this step, checkpointed: no finished step is lost.
        signum = stop.agreed(engine) if step + 1 < t.steps else 0
        # The last step is checkpointed too, so rerunning a finished run dir resumes to "done", not to step N-k.
        if (step + 1) % t.ckpt_every == 0 or step + 1 == t.steps or signum:
            saved = checkpoint.save_checkpoint(run_dir, step + 1, engine, optimizer, cfg.drafter, asdict(cfg.target),
                                               identity, layout, t.keep_last, recipe=recipe, metrics=last,
                                               selection=selection)
        if signum:
            bar.close()
            if engine.is_main:
                log.warning(stopped_line(signum, step + 1, t.steps, saved))
            raise Preempted(signum, step + 1)
    model.eval()
    return last


def data_layout(trainer_cfg: TrainerConfig, world_size: int, num_examples: int, seed: int) -> dict:
    """What fixes the data order (``BatchOrder``, the per-step global batch): a resume must find the same."""
    return {"num_examples": num_examples, "seed": seed, "micro_batch_size": trainer_cfg.micro_batch_size,
            "global_batch": trainer_cfg.micro_batch_size * trainer_cfg.grad_accum * world_size}


class PhaseClock:
    """Wall time per phase of one step (teacher forward vs drafter forward/backward/step), on logging steps only:
    timing a GPU needs a synchronize, which would stall the others."""

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled, self.seconds = enabled, {"teacher": 0.0, "drafter": 0.0}
        self._sync = torch.cuda.synchronize if enabled and device.type == "cuda" else (lambda: None)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if not self.enabled:
            yield
            return
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[phase] += time.perf_counter() - t0


def throughput(engine, clock: PhaseClock, tokens: Tensor, seconds: float, flops: FlopMeter | None = None,
               run_seconds: float = 0.0) -> dict:
    """``perf/*``: all-ranks tokens/s (rows' real tokens) since the previous logging step, this rank's teacher vs
    drafter seconds within the logged step, and its peak memory; with ``flops``, the achieved model TFLOP/s and MFU
    over the same window and their means over the ``run_seconds`` so far (``train.flops``)."""
    total = int(engine.all_reduce_sum(tokens))
    if engine.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(engine.device) / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
    out = {"perf/tokens_per_s": total / max(seconds, 1e-9), "perf/teacher_s": clock.seconds["teacher"],
           "perf/drafter_s": clock.seconds["drafter"], "perf/peak_mem_gb": peak}
    if flops is not None:
        out.update(flops.metrics(seconds, run_seconds, engine.all_reduce_sum, engine.device))
    return out

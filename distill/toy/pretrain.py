"""The toy target's model and its pretraining: build, AdamW with the shared warmup-cosine schedule, evaluation."""

from __future__ import annotations

import contextlib
import logging
import statistics
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from distill.schedule import warmup_cosine
from distill.toy.config import ToyTargetConfig

logger = logging.getLogger(__name__)

_MAX_EVAL_BLOCKS = 64
_EVAL_BATCH = 16
LR_FLOOR = 0.1  # the cosine ends at 10% of the peak


def make_model(cfg: ToyTargetConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(cfg.seed)  # deterministic init for a given seed
    return LlamaForCausalLM(config)


def _make_optimizer(model: torch.nn.Module, cfg: ToyTargetConfig) -> torch.optim.AdamW:
    # Decay matrices only: decaying norms' gains and biases just fights them.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def lr_factor(step: int, cfg: ToyTargetConfig) -> float:
    """The multiplier of ``cfg.lr`` at ``step``: linear warmup to 1, then cosine down to 0.1 at the last step."""
    return warmup_cosine(step, 1.0, cfg.warmup_steps, cfg.steps - 1 - cfg.warmup_steps, LR_FLOOR)


def _autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def next_token_loss(logits_BTV: torch.Tensor, ids_BT: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats) of predicting ``ids[:, 1:]`` from ``logits[:, :-1]``."""
    logits_NV = logits_BTV[:, :-1].float().flatten(0, 1)
    return F.cross_entropy(logits_NV, ids_BT[:, 1:].flatten())


def train_step(model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, ids_BT: torch.Tensor,
               use_bf16: bool) -> float:
    """One optimizer step on ``ids_BT``; returns the loss before the update."""
    with _autocast(ids_BT.device, use_bf16):
        logits_BTV = model(input_ids=ids_BT).logits
    loss = next_token_loss(logits_BTV, ids_BT)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()


def pretrain(model: LlamaForCausalLM, blocks_NT: torch.Tensor, cfg: ToyTargetConfig) -> dict[str, float]:
    """Train for exactly ``cfg.steps`` steps on random blocks; returns timing/loss stats."""
    device = next(model.parameters()).device
    optimizer = _make_optimizer(model, cfg)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
    generator = torch.Generator().manual_seed(cfg.seed)
    log_every = max(1, cfg.steps // 10)
    step_seconds: list[float] = []
    losses: list[float] = []
    model.train()
    bar = tqdm(range(cfg.steps), desc="toy target pretrain", unit="step")
    for step in bar:
        start = time.perf_counter()
        rows_B = torch.randint(blocks_NT.shape[0], (cfg.batch_size,), generator=generator)
        loss = train_step(model, optimizer, blocks_NT[rows_B].to(device), cfg.autocast_bf16)
        schedule.step()
        step_seconds.append(time.perf_counter() - start)
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if (step + 1) % log_every == 0:
            logger.info("step %d/%d loss %.4f", step + 1, cfg.steps, loss)
    bar.close()
    model.eval()
    tail = losses[-min(50, len(losses)):]  # one step's loss is noisy; average the end
    return {
        "train_seconds": sum(step_seconds),
        "median_step_seconds": statistics.median(step_seconds),
        "final_train_loss": sum(tail) / len(tail),
    }


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, blocks_NT: torch.Tensor) -> tuple[float, float]:
    """Held-out (loss in nats/token, top-1 accuracy) on up to 64 evenly spaced blocks."""
    device = next(model.parameters()).device
    # Evenly spaced, so the sample spans all held-out modules, not just the first.
    num = min(_MAX_EVAL_BLOCKS, blocks_NT.shape[0])
    rows = torch.linspace(0, blocks_NT.shape[0] - 1, num).round().long()
    total_loss, total_correct, total_tokens = 0.0, 0, 0
    model.eval()
    for chunk in rows.split(_EVAL_BATCH):
        ids_BT = blocks_NT[chunk].to(device)
        # fp32, no autocast: these numbers describe the saved float32 model.
        logits_BTV = model(input_ids=ids_BT).logits.float()
        targets = ids_BT[:, 1:]
        count = targets.numel()
        total_loss += next_token_loss(logits_BTV, ids_BT).item() * count
        total_correct += (logits_BTV[:, :-1].argmax(-1) == targets).sum().item()
        total_tokens += count
    return total_loss / total_tokens, total_correct / total_tokens

"""τ and speedup per context length (``eval.context_lengths``): does a drafter trained on short windows hold up when
the context grows?

A bucket of length L decodes prompts of L - ``eval.max_new_tokens`` - γ tokens (γ: the deepest draft of the run), so
its decodes run from there up to position L. Every bucket's prompts are cut from the same held-out passages
(``distill.prompts.context_length_prompts``) and continue them from the same point, so buckets differ in how much
context precedes the continuation, not in what is continued. Within a bucket, plain decoding and every drafter run
side by side (``eval.side_by_side``); speedup is over plain decoding of the same bucket.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from distill.data import default_prefix_ids
from distill.prompts import context_length_prompts, context_prompt_tokens
from eval.side_by_side import Tally, decode_side_by_side, warm_up
from inference.decoder import Decoder
from train.config import EvalConfig

log = logging.getLogger(__name__)


def context_prompt_sizes(eval_cfg: EvalConfig, tokenizer, max_positions: int, lookahead: int) -> dict[int, int]:
    """Prompt tokens per context length, every length checked against the target (its positions, its BOS)."""
    if tokenizer is None:
        raise ValueError("eval.context_lengths builds its prompts from held-out text, which needs the target's "
                         "tokenizer; this target has none: set eval.context_lengths=null")
    return context_prompt_tokens(eval_cfg.context_lengths, eval_cfg.max_new_tokens, lookahead, max_positions,
                                 len(default_prefix_ids(tokenizer)) + 1)


def context_length_sweep(decoder: Decoder, drafters: Mapping, depth: Mapping[str, int], tokenizer,
                         eval_cfg: EvalConfig, seed: int) -> dict:
    """Decode each bucket's prompts plainly and with every drafter; return the run's settings per bucket and, per
    drafter, its figures per bucket (keyed by the length, as a string: the report is JSON)."""
    lookahead = max([eval_cfg.num_draft, *depth.values()])
    sizes = context_prompt_sizes(eval_cfg, tokenizer, decoder.max_positions, lookahead)
    prompts = context_length_prompts(tokenizer, eval_cfg.num_prompts, sizes)
    max_new, greedy = eval_cfg.max_new_tokens, decoder.sampling.greedy
    out = {"lengths": list(sizes), "prompt_tokens": {str(n): p for n, p in sizes.items()}, "max_new_tokens": max_new,
           "lookahead": lookahead, "num_prompts": eval_cfg.num_prompts, "plain_tokens_per_s": {},
           "drafters": {name: {} for name in drafters}}
    for length, bucket in prompts.items():
        as_tensor = [torch.tensor([p], dtype=torch.long) for p in bucket]
        warm_up(decoder, drafters, as_tensor[: eval_cfg.warmup_prompts], max_new, depth)
        run = decode_side_by_side(decoder, drafters, as_tensor, max_new, depth, seed)
        plain_tps = run.plain.tokens_per_s
        out["plain_tokens_per_s"][str(length)] = plain_tps
        for name, tally in run.drafters.items():
            row = bucket_row(tally, plain_tps, greedy, sizes[length])
            out["drafters"][name][str(length)] = row
            log.info("context length %d (prompts of %d tokens): %s tau %.2f, speedup %.2fx", length, sizes[length],
                     name, row["tau"], row["speedup"])
    return out


def bucket_row(t: Tally, plain_tps: float, greedy: bool, prompt_tokens: int) -> dict:
    """One drafter's figures in one bucket. ``mean_context``: the committed context at its verification forwards,
    averaged (where in the bucket's span the drafter actually drafted)."""
    forwards = t.total.stats.forwards
    return {
        "prompt_tokens": prompt_tokens,
        "num_prompts": t.prompts,
        "tau": t.total.stats.tau,
        "alpha": t.total.stats.alpha,
        "alpha_per_position": t.total.stats.alpha_per_position,
        "mean_context": t.total.context_tokens / forwards if forwards else None,
        "tokens_per_s": t.tokens_per_s,
        "greedy_tokens_per_s": plain_tps,
        "speedup": t.tokens_per_s / plain_tps if plain_tps else 0.0,
        "identical_to_greedy": (t.identical == t.prompts) if greedy else None,
        "identical_prompts": t.identical if greedy else None,
    }


def attach(report: dict, sweep: Mapping) -> None:
    """The sweep into the report: its settings at the top (``context_lengths``) and each drafter's per-length block
    under that drafter's result (``results[i].context_lengths``)."""
    for result in report["results"]:
        result["context_lengths"] = sweep["drafters"][result["drafter"]]
    report["context_lengths"] = {key: value for key, value in sweep.items() if key != "drafters"}

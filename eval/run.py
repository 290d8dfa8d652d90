"""Evaluate drafters against plain decoding of the same target: α, τ, speedup, identity, cost model, report.json.

Timings are taken side by side: for each prompt, plain decoding, every drafter and the HF baselines (``generate()``,
assisted generation with the same draft model) run back to back, so a machine that gets busier mid-run slows all of
them alike and the ratios stay honest. Under sampling every method on a prompt starts from the same seed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import torch
from omegaconf import DictConfig

from distill.lock import writer_lock
from distill.precision import native_bf16
from distill.prompts import cut_prompt, heldout_prompts, prompt_records_from_file
from distill.teacher import load_teacher, target_config
from eval import saved as saved_settings
from eval.baselines import hf_assisted, hf_generate, hf_generate_static
from eval.batch_sweep import batch_sweep
from eval.context_lengths import attach, context_length_sweep, context_prompt_sizes
from eval.mismatch import MAX_KEPT, against_reference, logit_gap
from eval import served as served_check
from eval.report import DEFINITIONS, check_report_dir, machine_info, summary_table, write_report
from eval.side_by_side import Tally, decode_side_by_side, warm_up
from heads.base import build_drafter
from heads.saved import decode_overrides, load_drafter, read_drafter_config, weights_digest
from inference.cost import auto_tune, measure, overhead_ratio, predict
from inference.decoder import Decoder, DecoderConfig, Generation
from inference.stats import simulated_tau
from train.config import Config, EvalConfig, load_config
from train.engine import resolve_device

log = logging.getLogger(__name__)


def eval_prompts(eval_cfg: EvalConfig, tokenizer) -> tuple[list[list[int]], list[str | None]]:
    """(prompt ids, category per prompt): a question.jsonl's records (Spec-Bench / MT-bench categories) or held-out
    stdlib excerpts (category None)."""
    if eval_cfg.prompts:
        records = prompt_records_from_file(eval_cfg.prompts, tokenizer, eval_cfg.num_prompts, "auto")
        return [cut_prompt(ids, eval_cfg.prompt_tokens, tokenizer) for ids, _ in records], [c for _, c in records]
    prompts = heldout_prompts(tokenizer, eval_cfg.num_prompts, eval_cfg.prompt_tokens)
    return prompts, [None] * len(prompts)


def proposal_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype drafters run in while proposing. Verification stays in the target's dtype, so the decoded output
    does not depend on this; only speed and acceptance do. bf16 halves the memory a draft step reads, which is
    what bounds it at batch 1 — but only where the hardware computes bf16 natively."""
    if name == "auto":
        return torch.bfloat16 if device.type in ("cuda", "cpu") and native_bf16(device) else torch.float32
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"eval.drafter_dtype={name!r}; valid: auto, float32, bfloat16")
    return getattr(torch, name)


def build_decoder(teacher, dcfg: DecoderConfig) -> Decoder:
    return Decoder(teacher, dcfg, eos_token_id=teacher.tokenizer.eos_token_id if teacher.tokenizer is not None else None)


def evaluate(teacher, drafters: Mapping[str, object], prompts: Sequence[Sequence[int]], eval_cfg: EvalConfig,
             decoder_cfg: DecoderConfig | None = None, categories: Sequence[str | None] | None = None,
             tree_override: Sequence[str] = (), num_draft: Mapping[str, int] | None = None) -> dict:
    """Decode every prompt plainly and with each drafter, back to back; return the report (a JSON-able dict).

    ``tree_override``: names of drafters that take ``decoder.tree`` (the ones under test, not the baselines);
    ``num_draft``: a draft length per drafter name instead of ``eval.num_draft`` (a block drafter's whole block)."""
    if not prompts:
        raise ValueError("no evaluation prompts; check eval.prompts / eval.num_prompts")
    dcfg = decoder_cfg or DecoderConfig()
    decoder = build_decoder(teacher, dcfg)
    if teacher.device.type == "cuda" and not decoder.runner.compile:
        log.info("decoder.compile=off: CUDA graphs over eager steps. Compiling (decoder.compile=auto, the default on "
                 "CUDA) fuses the target's small kernels first (on an H200, 1.14B target: plain decoding 1.5x faster, "
                 "EAGLE-1 1.84x plain instead of 1.55x; docs/gpu-decoding.md), at about 20 s per step shape")
    greedy = decoder.sampling.greedy
    max_new, k = eval_cfg.max_new_tokens, eval_cfg.num_draft
    if dcfg.tree is not None:
        for name in tree_override:
            drafters[name].set_tree(dcfg.tree)
    as_tensor = [torch.tensor([list(p)], dtype=torch.long) for p in prompts]
    policy = eval_cfg.drafter_dtype
    dtype = proposal_dtype(policy, teacher.device)
    depth = {name: (num_draft or {}).get(name, k) for name in drafters}
    bad = {name: d for name, d in depth.items() if d < 1}
    if bad:
        raise ValueError(f"num_draft must be >= 1 per drafter, got {bad}")
    if eval_cfg.context_lengths:  # refused before anything is decoded
        context_prompt_sizes(eval_cfg, teacher.tokenizer, decoder.max_positions, max([k, *depth.values()]))
    dtypes = {name: _cast(decoder, d, dtype, policy == "auto", as_tensor[0], depth[name])
              for name, d in drafters.items()}
    categories = list(categories) if categories is not None else [None] * len(prompts)
    tuning = {}
    if dcfg.auto_tune:
        calibration = as_tensor[: max(1, min(4, len(as_tensor)))]
        for name, drafter in drafters.items():
            tuning[name] = auto_tune(decoder, drafter, calibration, max_new, depth[name])
            depth[name] = tuning[name]["chosen"]["num_draft"]
            log.info("auto_tune %s: %s", name, tuning[name]["chosen"])
    hf = _hf_baselines(teacher, drafters, eval_cfg, decoder)
    warm_up(decoder, drafters, as_tensor[: eval_cfg.warmup_prompts], max_new, depth, hf)
    # Compiled steps: the first prompts' outputs of every method, checked against eager plain decoding after the run.
    keep = MAX_KEPT if greedy and decoder.runner.compile else 0
    run = decode_side_by_side(decoder, drafters, as_tensor, max_new, depth, dcfg.seed, categories, hf, keep=keep)
    plain, per, hf_tally, by_cat = run.plain, run.drafters, run.baselines, run.by_category
    first_text = torch.cat([as_tensor[0], torch.tensor([run.first_ref.new_tokens], dtype=torch.long)], dim=1)
    plain_tps = plain.tokens_per_s
    results = []
    for name, drafter in drafters.items():
        row = _result(name, per[name], plain_tps, greedy, decoder, len(prompts), depth[name])
        row["drafter_dtype"] = str(dtypes[name]).removeprefix("torch.")
        # Time the parts at the run's mean context length: the first prompt continued by its own plain decoding.
        mean_context = per[name].total.stats.forwards and per[name].total.context_tokens // per[name].total.stats.forwards
        cost_prompt = first_text[:, : max(as_tensor[0].shape[1], mean_context)]
        row["cost"] = _cost(decoder, drafter, cost_prompt, per[name], depth[name], tuning.get(name), row["tau"],
                            max_new)
        if any(c is not None for c in categories):
            row["categories"] = _categories(by_cat, name, categories)
        if per[name].mismatches:  # greedy only: where the output first differs, and the target's logit gap there
            row["mismatches"] = [logit_gap(decoder.model, as_tensor[m.prompt], m) for m in per[name].mismatches]
            gaps = [abs(m["logit_gap"]) for m in row["mismatches"] if "logit_gap" in m]
            row["max_abs_mismatch_logit_gap"] = max(gaps, default=None)
            log.warning("drafter %s: %d/%d prompts differ from plain greedy decoding; target logit gap at the first "
                        "difference, largest of the first %d: %s", name, len(prompts) - per[name].identical,
                        len(prompts), len(row["mismatches"]), row["max_abs_mismatch_logit_gap"])
        results.append(row)
    report = {
        "target": teacher.identity(),
        "num_prompts": len(prompts),
        "max_new_tokens": max_new,
        "num_draft": k,
        "sampling": {"mode": decoder.sampling.describe(), "temperature": dcfg.temperature, "top_p": dcfg.top_p,
                     "top_k": dcfg.top_k, "seed": dcfg.seed},
        "acceptance": dcfg.acceptance,
        "lossless": decoder.lossless,
        "drafter_dtype": policy,
        "greedy": {"new_tokens": plain.tokens, "seconds": plain.total.seconds, "tokens_per_s": plain_tps},
        "baselines": {name: _baseline(name, t, plain_tps, per, greedy, len(prompts)) for name, t in hf_tally.items()},
        "results": results,
        "decoder_steps": decoder.batch.describe(),
        "machine": machine_info(),
        "definitions": DEFINITIONS,
    }
    if eval_cfg.context_lengths:  # τ and speedup per context length, each drafter at its depth above
        attach(report, context_length_sweep(decoder, drafters, depth, teacher.tokenizer, eval_cfg, dcfg.seed))
    if keep:
        report["compiled_vs_eager"] = compiled_vs_eager(teacher, dcfg, as_tensor, max_new, run.outputs)
    return report


def compiled_vs_eager(teacher, dcfg: DecoderConfig, prompts: Sequence[torch.Tensor], max_new: int,
                      outputs: Mapping[str, list[list[int]]]) -> dict:
    """Every method's outputs through compiled steps against plain decoding through eager steps (no compile, no CUDA
    graphs) on the same first prompts, with the target's logit gap where they part (``eval.mismatch``)."""
    eager = build_decoder(teacher, dataclasses.replace(dcfg, compile="off", cuda_graphs="off"))
    n = len(outputs["plain"])
    reference = [eager.plain(p, max_new).new_tokens for p in prompts[:n]]
    check = against_reference(teacher.model, list(prompts[:n]), reference, dict(outputs))
    for name, row in check.items():
        log.info("compiled %s vs eager plain decoding: %d/%d prompts identical, largest logit gap at a first "
                 "difference %s", name, row["identical"], row["prompts"], row["max_abs_logit_gap"])
    return check


def _cast(decoder: Decoder, drafter, dtype: torch.dtype, auto: bool, prompt, depth: int) -> torch.dtype:
    """Cast the drafter for proposing. ``auto`` with native bf16: time both dtypes and keep the faster — bf16 wins
    for wide, memory-bound heads (Medusa's vocab projections), loses for a small LM whose step is overhead-bound."""
    if not (auto and dtype == torch.bfloat16 and any(True for _ in drafter.parameters())):
        drafter.to(dtype)
        return dtype
    times = {}
    for candidate in (torch.float32, torch.bfloat16):
        drafter.to(candidate)
        times[candidate] = measure(decoder, drafter, prompt, [depth], {}, repeats=7)["t_draft"][depth]
    best = min(times, key=times.get)
    drafter.to(best)
    return best


def _hf_baselines(teacher, drafters: Mapping, eval_cfg: EvalConfig, decoder: Decoder) -> dict:
    """Callables (prompt, seed) -> Generation for HF generate() and HF assisted generation with each draft model."""
    if not eval_cfg.hf_baselines:
        return {}
    max_new, k, eos = eval_cfg.max_new_tokens, eval_cfg.num_draft, decoder.eos_token_id

    def wrap(out: dict) -> Generation:
        return Generation(new_tokens=decoder.finish(out["new_tokens"], max_new), seconds=out["seconds"])

    runs = {"hf_generate": lambda p, seed: wrap(hf_generate(teacher, p, max_new, decoder.sampling, eos, seed=seed))}
    if teacher.device.type == "cuda":  # compiled with CUDA graphs by generate itself: a CUDA-only reference
        runs["hf_generate_static"] = lambda p, seed: wrap(
            hf_generate_static(teacher, p, max_new, decoder.sampling, eos, seed=seed))
    for name, drafter in drafters.items():
        if drafter.assistant_model is not None and decoder.lossless:
            runs[f"hf_assisted[{name}]"] = lambda p, seed, m=drafter.assistant_model: wrap(
                hf_assisted(teacher, m, p, max_new, k, decoder.sampling, eos, seed=seed))
    return runs


def _baseline(name: str, t: Tally, plain_tps: float, per: Mapping[str, Tally], greedy: bool, n: int) -> dict:
    out = {"tokens_per_s": t.tokens_per_s, "seconds": t.total.seconds, "new_tokens": t.tokens,
           "speedup": t.tokens_per_s / plain_tps if plain_tps else None,
           "identical_to_greedy": t.identical == n if greedy else None}
    if name.startswith("hf_assisted["):
        ours = per[name[len("hf_assisted["):-1]]
        out["ours_over_hf"] = ours.tokens_per_s / t.tokens_per_s if t.tokens_per_s else None
        out["note"] = f"same draft model, same γ; ours is {out['ours_over_hf']:.2f}x its tokens/s"
    return out


def _result(name: str, t: Tally, plain_tps: float, greedy: bool, decoder: Decoder, n: int, num_draft: int) -> dict:
    lossy = "" if decoder.lossless else " [typical, LOSSY]"
    return {
        "drafter": name,
        "label": name + lossy,
        "lossless": decoder.lossless,
        "num_draft": num_draft,
        "tree_size": max(t.total.nodes_per_forward, default=0),
        "num_prompts": n,
        "new_tokens": t.tokens,
        **t.total.stats.to_dict(),
        "tokens_per_s": t.tokens_per_s,
        "greedy_tokens_per_s": plain_tps,
        "speedup": t.tokens_per_s / plain_tps if plain_tps else 0.0,
        "prefill_seconds": t.total.prefill_seconds,
        "draft_seconds": t.total.draft_seconds,
        "verify_seconds": t.total.verify_seconds,
        # the verification forwards' widths (pending token + bucket, padding included) per committed token
        "verified_per_token": t.total.verified_positions / t.tokens if t.tokens else None,
        # Token identity is the greedy guarantee; under sampling losslessness is distributional (tests prove it).
        "identical_to_greedy": (t.identical == n) if greedy else None,
        "identical_prompts": t.identical if greedy else None,
        "first_mismatch_prompt": t.first_mismatch,
    }


def _cost(decoder: Decoder, drafter, prompt, t: Tally, num_draft: int, tuning: dict | None, tau: float,
          max_new: int) -> dict:
    """Isolated timings of the parts this run used; predicted speedup (from this run's τ, or from the auto-tune
    calibration when there was one) next to the measured one; the overhead ratio."""
    parts = measure(decoder, drafter, prompt, [num_draft], t.total.shapes, catch_up=max(1, round(tau)),
                    max_new_tokens=max_new, chain_nodes=num_draft)
    full = max(t.total.nodes_per_forward, key=lambda n: (t.total.nodes_per_forward[n], n), default=0)
    t_draft = parts["t_draft"][num_draft]
    out = {
        "t_prefill_s": parts["t_prefill"],
        "t_plain_s": parts["t_plain"],
        "t_draft_s": t_draft,
        "t_verify_s": {str(n): s for n, s in parts["t_verify"].items()},  # linear fit over n >= 1
        "t_verify_measured_s": {str(n): s for n, s in parts["t_verify_measured"].items()},
        "predicted_speedup_from_measured_tau": predict(tau, parts["t_plain"], t_draft, parts["t_verify"].get(full, 0.0),
                                                       t.tokens // max(t.prompts, 1), parts["t_prefill"]),
        "overhead_ratio": overhead_ratio(t.total.seconds, t.total.prefill_seconds, t.total.nodes_per_forward, parts["t_verify"], t_draft),
    }
    if tuning is not None:
        out.update(auto_tune=tuning["candidates"], chosen=tuning["chosen"], predicted_speedup=tuning["chosen"]["predicted_speedup"],
                   predicted_tau=tuning["chosen"]["predicted_tau"])
    else:
        out["predicted_speedup"] = out["predicted_speedup_from_measured_tau"]
    return out


def _categories(by_cat: Mapping, name: str, categories: Sequence[str | None]) -> dict:
    out = {}
    for cat in sorted({c for c in categories if c is not None}):
        t, ref = by_cat[(name, cat)], by_cat[(None, cat)]
        out[cat] = {"num_prompts": t.prompts, "tau": t.total.stats.tau, "alpha": t.total.stats.alpha, "tokens_per_s": t.tokens_per_s,
                    "speedup": t.tokens_per_s / ref.tokens_per_s if ref.tokens_per_s else None}
    return out


# Drafters every report shows beside the one under test (eval.baselines); untrained, built from their defaults.
BASELINES = {"lookup": {"_target_": "heads.lookup.PromptLookup"}}


def _with_baselines(drafters: dict, teacher, eval_cfg: EvalConfig) -> dict:
    for name in eval_cfg.baselines:
        if name not in BASELINES:
            raise ValueError(f"eval.baselines has unknown {name!r}; valid: {sorted(BASELINES)}")
        if name not in drafters:
            drafters[name] = build_drafter(BASELINES[name], teacher)
    return drafters


def _report(cfg: Config, teacher, drafters: dict, run_dir, training: Mapping[str, Mapping] | None = None,
            digests: Mapping[str, str | None] | None = None, drafter_path=None) -> dict:
    """``digests``: the weights digest of each saved drafter, recorded in its row (an export shows a report only for
    the weights it measured). ``drafter_path``: the saved drafter (its export is what ``eval.engine=vllm`` serves)."""
    prompts, categories = eval_prompts(cfg.eval, teacher.tokenizer)
    under_test = list(drafters)
    dcfg = cfg.decoder
    report = evaluate(teacher, _with_baselines(drafters, teacher, cfg.eval), prompts, cfg.eval, dcfg,
                      categories, tree_override=under_test)
    if dcfg.batch_sizes:  # throughput / latency vs batch size, crossover, load-aware policy (eval.batch_sweep)
        report["batch_sweep"] = batch_sweep(teacher, drafters, prompts, cfg.eval, dcfg)
    for result in report["results"]:
        if (digest := (digests or {}).get(result["drafter"])) is not None:
            result["weights_digest"] = digest
        if (final := (training or {}).get(result["drafter"])) is not None:
            autoregressive = getattr(drafters.get(result["drafter"]), "drafts_autoregressively", False)
            result.update(_simulated(final, result["num_draft"], autoregressive))
            result.update(_heldout(final))
            result.update(_training_perf(final))
        # Medusa-2 merged its LoRA into the target: every method in this report decoded with the merged target.
        if merged := getattr(drafters.get(result["drafter"]), "verifies_against", None):
            result["target"] = merged
    if cfg.eval.engine == "vllm":  # the drafter under test served in vLLM, beside this decoder, before anything is written
        report["served"] = {"vllm": _served(cfg, teacher, drafters[under_test[0]], drafter_path, prompts, report)}
    path = write_report(report, run_dir, plots=cfg.eval.plots)
    print(summary_table(report), flush=True)
    for line in _target_lines(report["results"]):
        print(line, flush=True)
    log.info("wrote %s", path)
    return report


def _served(cfg: Config, teacher, drafter, drafter_path, prompts, report: dict) -> dict:
    row = next(r for r in report["results"] if r["drafter"] == drafter.name)
    served = served_check.served_for_saved(teacher, drafter, drafter_path, cfg.eval.export, prompts,
                                           cfg.eval.max_new_tokens, row["num_draft"], cfg.decoder,
                                           dataclasses.asdict(cfg.target))
    served = {"drafter": drafter.name, "weights_digest": row.get("weights_digest"), **served}
    log.info("served in vLLM %s: tau %s at gamma %d (this decoder: tau %.3f); vLLM speculative identical to vLLM "
             "plain: %s", served["version"], served["tau"], served["num_draft"], served["specdraft_tau"],
             served["identical"])
    return served


def _simulated(final: Mapping, num_draft: int, autoregressive: bool = False) -> dict:
    """The training-time estimate beside the measured τ: ``inference.stats.simulated_tau`` over the last logged per-step
    top-1 accuracies (training data), cut to the γ decoded here."""
    accs = [final[f"train/acc_head{k}"] for k in range(1, num_draft + 1) if f"train/acc_head{k}" in final]
    if not accs:
        return {}
    return {"sim_tau": simulated_tau(accs, num_draft if autoregressive else None),
            "sim_tau_steps": num_draft if autoregressive else len(accs)}


def _heldout(final: Mapping) -> dict:
    """Medusa-2's training summary: held-out next-token loss of the original and of the adapted (served) target."""
    if "heldout/original_loss" not in final:
        return {}
    return {"heldout_loss": {"original": final["heldout/original_loss"], "adapted": final["heldout/adapted_loss"]}}


def _training_perf(final: Mapping) -> dict:
    """The training run's mean model TFLOP/s, MFU (where the device's peak was known) and the teacher's share of the
    FLOPs (``train.flops``), from its last logged row."""
    keys = {"tflops": "perf/tflops_mean", "mfu": "perf/mfu_mean", "teacher_flops_share": "perf/teacher_flops_share"}
    perf = {name: final[key] for name, key in keys.items() if key in final}
    return {"training_perf": perf} if perf else {}


def _target_lines(results: Sequence[Mapping]) -> list[str]:
    lines = []
    for r in results:
        if r.get("target"):
            lines.append(f"{r['drafter']}: verified against the {r['target']} (plain decoding too)")
        if r.get("heldout_loss"):
            lines.append(f"{r['drafter']}: held-out next-token loss original {r['heldout_loss']['original']:.4f}, "
                         f"adapted {r['heldout_loss']['adapted']:.4f}")
    return lines


def evaluate_saved(cfg: Config, teacher, drafter_path, run_dir, overrides: Mapping | None = None) -> dict:
    """Evaluate the drafter saved at ``drafter_path`` (reloaded from disk, as a user would) against ``teacher``.
    ``overrides``: decode-time ``drafter.<key>`` settings (``heads.saved.decode_overrides``)."""
    drafter = load_drafter(drafter_path, teacher, overrides,
                           allow_other_target=cfg.eval.allow_other_target)
    final = read_drafter_config(drafter_path).get("training", {}).get("final") or None
    return _report(cfg, teacher, {drafter.name: drafter}, run_dir, training={drafter.name: final} if final else None,
                   digests={drafter.name: weights_digest(drafter_path)}, drafter_path=drafter_path)


def run_eval(cfg: DictConfig, run_dir, use_saved_target: bool = True, overrides: Sequence[str] | None = None) -> dict:
    """``python -m eval``: a saved drafter (``drafter_path=``) or an untrained one (``drafter=lookup``).
    ``cfg``: the composed config, which a saved drafter's own settings are merged into (``eval.saved``) before it
    becomes the typed ``Config`` (``load_config``, once). ``overrides``: the command line's Hydra overrides, which
    decide what those settings give way to; without them, ``use_saved_target`` alone says whether the saved target
    is used. ``run_dir`` is written by this process alone (``distill.lock``), and only if it is fresh, the saved
    drafter's own run dir, or an earlier report of the same drafter (``eval.report.check_report_dir``)."""
    served_check.check_engine(cfg.eval.engine)  # vLLM asked for but missing: one line, before anything is loaded
    with writer_lock(run_dir, "hydra.run.dir"):
        check_report_dir(run_dir, {weights_digest(cfg.drafter_path) if cfg.drafter_path else None})
        return _run_eval(cfg, run_dir, use_saved_target, overrides)


def _run_eval(cfg: DictConfig, run_dir, use_saved_target: bool, overrides: Sequence[str] | None) -> dict:
    if cfg.drafter_path:
        cli = saved_settings.parse_overrides(overrides if overrides is not None else
                                             ([] if use_saved_target else ["target=given"]))
        saved = read_drafter_config(cfg.drafter_path)
        drafter_keys = saved_settings.drafter_overrides(cfg, cli, saved, cfg.drafter_path)
        target_cfg = saved_settings.target_config(cfg, cli, saved)
        cfg.drafter = decode_overrides(saved["drafter"], drafter_keys, cfg.drafter_path)  # validated as saved
        config = load_config(cfg)
        teacher = load_teacher(target_config(target_cfg), device=resolve_device(config.trainer.device))
        fitted = saved_settings.eval_settings(dataclasses.asdict(config.eval), saved, cli, teacher.max_positions)
        config.eval = dataclasses.replace(config.eval, **{key: fitted[key] for key in saved_settings.RUN_EVAL_KEYS})
        typed = {key: config.drafter[key] for key in drafter_keys}  # as load_config converted them
        return evaluate_saved(config, teacher, config.drafter_path, run_dir, overrides=typed)
    cfg = load_config(cfg)
    device = resolve_device(cfg.trainer.device)
    teacher = load_teacher(cfg.target, device=device)
    drafter = build_drafter(cfg.drafter, teacher)
    drafter.bind_target(teacher, initialize=True)
    if drafter.needs_training:
        raise ValueError(
            f"drafter={drafter.name} has weights to train; evaluate a trained one with drafter_path=<run dir>/drafter "
            f"(written by `python -m train`), or use drafter=lookup"
        )
    return _report(cfg, teacher, {drafter.name: drafter.to(device)}, run_dir)

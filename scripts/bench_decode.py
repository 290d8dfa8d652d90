"""Decoding benchmark: every drafter kind against plain decoding, HF generate() and HF assisted generation, one run.

    python scripts/bench_decode.py                      # CPU: the toy target (cached), writes bench_decode.json
    python scripts/bench_decode.py --preset gpu         # GPU: a 1.14B Llama-shaped target, built first (~5 min, H100)
    python scripts/bench_decode.py --preset tiny        # seconds: checks the script end to end (numbers meaningless)
    python scripts/bench_decode.py --methods eagle1,eagle3 --eagle1-dir RUN --eagle3-dir RUN   # EAGLE rows only
    python scripts/bench_decode.py --methods lookup,eagle1,dflash --eagle1-dir RUN --dflash-dir RUN

What it does, all in one process so every ratio is measured side by side:
1. builds (or loads from cache) the target and a small draft LM pretrained on this interpreter's stdlib source,
2. trains Medusa heads briefly on the frozen target (``--medusa-steps``), and EAGLE-1 / EAGLE-3 drafters with
   ``python -m train``'s defaults for the preset (EAGLE-1: the README demo's drafter, 600 steps), DFlash with its toy
   recipe (``experiment=dflash_toy``), or reuses the drafters in ``--medusa-dir`` / ``--eagle1-dir`` /
   ``--eagle3-dir`` / ``--dflash-dir`` (run dirs of ``python -m train``),
3. evaluates, on held-out stdlib prompts, the selected ``--methods`` (default all: Medusa as a top-1 chain and with
   a static tree, the draft model (chain), prompt lookup, EAGLE-1 and EAGLE-3 with their dynamic trees, DFlash
   drafting its whole block: ``drafter.depth``, else ``block_size - 1`` tokens) next to
   plain decoding, HF ``generate()`` and HF assisted generation with the same draft model and γ; then the draft
   model and the Medusa tree again with ``decoder.auto_tune`` (predicted vs measured speedup),
4. on CUDA repeats with eager steps (``greedy_no_cuda_graphs``: no graphs, no compile), optionally at temperature 1
   (``--sample``) and with compiled steps (``--compile``: ``decoder.compile=on``, where the run's own setting does
   not compile already; ``decoder.compile=auto``, the default, compiles on CUDA),
5. writes JSON: machine, dtype, and per method τ, α, tokens/s, speedup, speedup over the faster of plain decoding
   and HF generate(), predicted speedup, overhead ratio, transfers per step; plus the full evaluation reports.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from heads.draft_model.config import toy_draft_node
from train.config import load_config, register_configs, to_container

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench_decode")

# Target / draft sizes per preset. Vocabulary, context and corpus settings are shared by target and draft so their
# BPE tokenizers are identical (DraftModel.bind_target checks it).
PRESETS = {
    "tiny": {
        "target": "tiny",
        "draft_toy": {"hidden_size": 32, "intermediate_size": 88, "num_layers": 1, "num_heads": 2, "steps": 60,
                      "warmup_steps": 10},
        "overrides": ["eval.num_prompts=4", "eval.prompt_tokens=48", "eval.max_new_tokens=32", "data.max_length=128",
                      "data.corpus_max_bytes=400000", "trainer.micro_batch_size=4"],
        "medusa_steps": 20,
        "eagle_steps": 20,
        # the toy recipe's feature layers do not exist on the 2-layer tiny target: its default spread instead
        "dflash": {"overrides": ["drafter.layers=null", "regenerate.num_prompts=32"], "steps": 20},
        "peagle": {"overrides": ["regenerate.num_prompts=32"], "steps": 20},
    },
    "toy": {
        "target": "toy",
        "draft_toy": {},  # conf/drafter/draft_model.yaml as is
        "overrides": ["eval.num_prompts=20"],
        "medusa_steps": 600,
        "eagle_steps": None,  # python -m train's default (conf/trainer/single.yaml: 600)
    },
    # The GPU figure: a Llama-shaped target of 1.14B parameters (TinyLlama's width and depth: hidden 2048, MLP
    # 5632, 22 layers, 16 heads; the toy's 4,096-token stdlib tokenizer), pretrained briefly on the stdlib (300 steps
    # x 32 x 256 tokens: enough for a target whose greedy text a drafter can learn, not a good model), bf16; EAGLE-1
    # and EAGLE-3 trained on it for 400 steps. The README setting: 20 held-out prompts, 96 new tokens, greedy.
    "gpu": {
        "target": "toy",
        "target_toy": {"hidden_size": 2048, "intermediate_size": 5632, "num_layers": 22, "num_heads": 16,
                       "steps": 300, "batch_size": 32, "lr": 1e-3, "warmup_steps": 30},
        "draft_toy": {"hidden_size": 256, "intermediate_size": 704, "num_layers": 2, "num_heads": 4,
                      "steps": 3000, "batch_size": 32},
        "overrides": ["eval.num_prompts=20", "target.dtype=bfloat16"],
        "methods": "lookup,eagle1,eagle3",
        "medusa_steps": 400,
        "eagle_steps": 400,
        # The parallel drafters read the default spread of the 22 layers (not the toy recipes' 1-3) and regenerate
        # with this project's batched decoder (HF's compiled generate recompiles per batch shape); as many steps as
        # EAGLE. Their recipes regenerate the target's answers: pass data.mode=regenerate to train EAGLE on the same.
        "dflash": {"overrides": ["drafter.layers=null", "regenerate.engine=batched"], "steps": 400},
        "peagle": {"overrides": ["regenerate.engine=batched"], "steps": 400},
    },
}
METHODS = ("medusa-chain", "medusa-tree", "draft_model", "lookup", "eagle1", "eagle3", "dflash", "peagle", "dspark",
           "dspark_nomarkov")
DFLASH_RECIPE = "dflash_toy"  # conf/experiment/: the recipe the dflash method trains with (its steps included)
PEAGLE_RECIPE = "peagle_toy"  # likewise for peagle
DSPARK_RECIPE = "dspark_toy"  # likewise for dspark; dspark_nomarkov: the same without the Markov head
NO_MARKOV = ["drafter.markov_rank=0", "drafter.confidence_with_markov=false"]


def compose_cfg(preset: dict, extra: list[str], drafter: str, steps: int | None):
    """The typed config ``python -m train drafter=<drafter>`` would run for this preset (``steps``: None keeps the
    trainer's default)."""
    register_configs()
    overrides = [f"target={preset['target']}", f"drafter={drafter}", "trainer.ckpt_every=100000",
                 "eval.enabled=false", *preset["overrides"], *extra]
    if steps is not None:
        overrides.append(f"trainer.steps={steps}")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    for key, value in preset.get("target_toy", {}).items():
        cfg.target.toy[key] = value
    return load_config(cfg)


def load_cfg(preset: dict, extra: list[str], medusa_steps: int):
    cfg = compose_cfg(preset, extra, "medusa", medusa_steps)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        draft = compose(config_name="config", overrides=["drafter=draft_model"]).drafter
    toy = dataclasses.asdict(cfg.target.toy) if dataclasses.is_dataclass(cfg.target.toy) else cfg.target.toy
    draft = toy_draft_node(to_container(draft), toy, **preset["draft_toy"])
    return cfg, draft


def train_drafter(cfg, run_dir: Path, teacher, kind: str = "medusa"):
    """Train into ``run_dir`` (or reuse the drafter a previous run left there: same target, same config)."""
    from heads.saved import load_drafter
    from train.run import run_training

    t0 = time.perf_counter()
    if (run_dir / "drafter" / "config.json").is_file():
        log.info("%s: reusing %s", kind, run_dir / "drafter")
        return load_drafter(run_dir / "drafter", teacher), 0.0
    run_training(cfg, run_dir)
    log.info("%s: %d steps in %.0fs", kind, cfg.trainer.steps, time.perf_counter() - t0)
    return load_drafter(run_dir / "drafter", teacher), time.perf_counter() - t0


def trained(cfg, run_dir: str | None, teacher, kind: str):
    if run_dir:
        return train_drafter(cfg, Path(run_dir), teacher, kind)
    with tempfile.TemporaryDirectory() as tmp:
        return train_drafter(cfg, Path(tmp) / kind, teacher, kind)


def summarize(report: dict) -> dict:
    rows = {}
    for r in report["results"]:
        cost = r.get("cost") or {}
        rows[r["label"]] = {
            "tau": r["tau"], "alpha": r["alpha"], "alpha_per_position": r["alpha_per_position"],
            "tokens_per_s": r["tokens_per_s"], "speedup": r["speedup"], "tree_size": r["tree_size"],
            "num_draft": r["num_draft"], "verified_per_token": r.get("verified_per_token"),
            "predicted_speedup": cost.get("predicted_speedup"),
            "overhead_ratio": cost.get("overhead_ratio"), "identical_to_greedy": r["identical_to_greedy"],
        }
    for name, b in report.get("baselines", {}).items():
        rows[name] = {k: b.get(k) for k in ("tokens_per_s", "speedup", "ours_over_hf", "identical_to_greedy")}
    rows["plain"] = {"tokens_per_s": report["greedy"]["tokens_per_s"]}
    # The yardstick: tokens/s over the fastest of our plain decoding, HF generate() and (CUDA) HF generate with its
    # compiled static cache, same prompts, same run.
    best = max(rows["plain"]["tokens_per_s"], *((rows.get(b) or {}).get("tokens_per_s") or 0.0
                                                for b in ("hf_generate", "hf_generate_static")))
    if "hf_generate_static" in rows:
        static = rows["hf_generate_static"].get("tokens_per_s")
        rows["plain"]["over_hf_generate_static"] = rows["plain"]["tokens_per_s"] / static if static else None
    for r in report["results"]:
        rows[r["label"]]["over_best_baseline"] = r["tokens_per_s"] / best if best else None
        # τ is the speedup a free drafter and a verify forward as cheap as a plain step would give: the fraction of
        # it reached says how much drafting, the wider verify forward and the loop's own work take away
        rows[r["label"]]["tau_limit_fraction"] = r["speedup"] / r["tau"] if r["tau"] else None
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="toy")
    ap.add_argument("--out", default="bench_decode.json")
    ap.add_argument("--medusa-steps", type=int, default=None)
    ap.add_argument("--tree", default="default", help="Medusa tree preset or paths (inference.tree)")
    ap.add_argument("--sample", action="store_true", help="also evaluate at temperature 1")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--medusa-dir", default=None, help="train Medusa into this run dir, or reuse the drafter there")
    ap.add_argument("--eagle1-dir", default=None, help="train EAGLE-1 into this run dir, or reuse the drafter there")
    ap.add_argument("--eagle3-dir", default=None, help="train EAGLE-3 into this run dir, or reuse the drafter there")
    ap.add_argument("--eagle-steps", type=int, default=None, help="EAGLE training steps (default: the preset's)")
    ap.add_argument("--dflash-dir", default=None, help="train DFlash into this run dir, or reuse the drafter there")
    ap.add_argument("--dflash-steps", type=int, default=None, help=f"DFlash training steps (default: "
                    f"experiment={DFLASH_RECIPE}'s)")
    ap.add_argument("--dspark-dir", default=None, help="train DSpark into this run dir, or reuse the drafter there")
    ap.add_argument("--dspark-nomarkov-dir", default=None, help="likewise for DSpark without its Markov head")
    ap.add_argument("--dspark-steps", type=int, default=None, help=f"DSpark training steps (default: "
                    f"experiment={DSPARK_RECIPE}'s)")
    ap.add_argument("--dspark-thresholds", default="0.3,0.5", help="DSpark is also evaluated with each of these "
                    "drafter.confidence_threshold values (comma-separated; empty: the fixed block only)")
    ap.add_argument("--dspark-eager", action="store_true", help="also evaluate the dspark rows through its eager "
                    "proposal (a cut block verifies fewer positions; a block cut to nothing is a plain step) "
                    "instead of its static step (the cut slots stay in the verify bucket)")
    ap.add_argument("--peagle-dir", default=None, help="train P-EAGLE into this run dir, or reuse the drafter there")
    ap.add_argument("--peagle-steps", type=int, default=None, help=f"P-EAGLE training steps (default: the preset's, "
                    f"else experiment={PEAGLE_RECIPE}'s)")
    ap.add_argument("--target-steps", type=int, default=None, help="pretraining steps of a built toy target "
                    "(default: the preset's; another value is another cached target)")
    ap.add_argument("--no-eager-steps", action="store_true", help="on CUDA, skip the second evaluation with "
                    "decoder.cuda_graphs=off decoder.compile=off")
    ap.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(METHODS)} (default: all; "
                    "the gpu preset's: lookup,eagle1,eagle3)")
    ap.add_argument("--prepare", action="store_true", help="build the target and train the drafters (into the "
                    "--*-dir run dirs), then stop: a GPU lease can do this apart from the timed part")
    ap.add_argument("--compile", action="store_true", help="also evaluate with decoder.compile=on (torch.compile), "
                    "where the run's own decoder.compile does not compile")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. eval.num_prompts=10")
    args = ap.parse_args(argv)
    args.methods = args.methods or PRESETS[args.preset].get("methods") or ",".join(METHODS)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        ap.error(f"--methods={args.methods!r}: unknown {unknown}; valid: {','.join(METHODS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    if args.target_steps is not None:
        preset = {**preset, "target_toy": {**preset.get("target_toy", {}), "steps": args.target_steps}}
    cfg, draft_cfg = load_cfg(preset, args.overrides, args.medusa_steps or preset["medusa_steps"])

    from distill.teacher import load_teacher
    from eval.run import eval_prompts, evaluate
    from heads.base import build_drafter
    from train.engine import resolve_device

    device = resolve_device(cfg.trainer.device)
    t0 = time.perf_counter()
    teacher = load_teacher(cfg.target, device=device)
    setup = {"target": time.perf_counter() - t0}
    drafters = {}
    if "medusa-chain" in methods or "medusa-tree" in methods:
        medusa, setup["medusa_training"] = trained(cfg, args.medusa_dir, teacher, "medusa")
        medusa.set_tree("chain")
        if "medusa-chain" in methods:
            drafters["medusa-chain"] = medusa
        if "medusa-tree" in methods:
            drafters[f"medusa-tree[{args.tree}]"] = copy.deepcopy(medusa)
            drafters[f"medusa-tree[{args.tree}]"].set_tree(args.tree)
    if "draft_model" in methods:
        t0 = time.perf_counter()
        draft = build_drafter(draft_cfg, teacher)
        draft.bind_target(teacher, initialize=False)
        drafters["draft_model"] = draft.to(device)
        setup["draft_model"] = time.perf_counter() - t0
    if "lookup" in methods:
        drafters["lookup"] = build_drafter({"_target_": "heads.lookup.PromptLookup"}, teacher)
    steps = args.eagle_steps or preset["eagle_steps"]
    for kind, run_dir in (("eagle1", args.eagle1_dir), ("eagle3", args.eagle3_dir)):
        if kind in methods:
            kind_cfg = compose_cfg(preset, args.overrides, kind, steps)
            drafters[kind], setup[f"{kind}_training"] = trained(kind_cfg, run_dir, teacher, kind)
    for kind, recipe, run_dir, kind_steps, extra in (
            ("dflash", DFLASH_RECIPE, args.dflash_dir, args.dflash_steps, []),
            ("peagle", PEAGLE_RECIPE, args.peagle_dir, args.peagle_steps, []),
            ("dspark", DSPARK_RECIPE, args.dspark_dir, args.dspark_steps, []),
            ("dspark_nomarkov", DSPARK_RECIPE, args.dspark_nomarkov_dir, args.dspark_steps, NO_MARKOV)):
        if kind in methods:
            own = preset.get(kind, preset.get("dflash", {}) if kind.startswith("dspark") else {})
            kind_cfg = compose_cfg(preset, [f"experiment={recipe}", *own.get("overrides", []), *extra,
                                            *args.overrides], kind.split("_")[0], kind_steps or own.get("steps"))
            drafters[kind], setup[f"{kind}_training"] = trained(kind_cfg, run_dir, teacher, kind)
    drafters.update(dspark_views(drafters, args.dspark_thresholds, args.dspark_eager))
    # a parallel drafter drafts its whole block / every trained depth in one forward (or its configured depth); the
    # others eval.num_draft
    num_draft = {}
    for name, d in drafters.items():
        if name.startswith(("dflash", "dspark")):
            num_draft[name] = d.depth or d.block_size - 1
    if "peagle" in drafters:
        num_draft["peagle"] = drafters["peagle"].depth or drafters["peagle"].num_depths

    if args.prepare:
        log.info("prepared: target %s, drafters %s; setup seconds %s", teacher.identity(), sorted(drafters), setup)
        return
    prompts, categories = eval_prompts(cfg.eval, teacher.tokenizer)
    dcfg = cfg.decoder
    out = {
        "preset": args.preset,
        "methods": methods,
        "target": teacher.identity(),
        "target_params": sum(p.numel() for p in teacher.model.parameters()),
        "drafter_params": {name: sum(p.numel() for p in d.parameters()) for name, d in drafters.items()},
        "dtype": cfg.target.dtype,
        "setup_seconds": setup,
        "runs": {},
    }
    if "draft_model" in drafters:
        out["draft_params"] = out["drafter_params"]["draft_model"]
    path = Path(args.out)

    def save() -> None:  # after every phase: a run cut short (a GPU lease's time limit) keeps what it measured
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=2, default=str))
        os.replace(tmp, path)

    report = evaluate(teacher, drafters, prompts, cfg.eval, dcfg, categories, num_draft=num_draft)
    out["runs"]["greedy"] = {"summary": summarize(report), "report": report}
    out["machine"] = report["machine"]
    save()
    tune = {f"{name}[auto_tune]": copy.deepcopy(d) for name, d in drafters.items()
            if name == "draft_model" or name.startswith("medusa-tree")}
    if tune:
        tuned = evaluate(teacher, tune, prompts, dataclasses.replace(cfg.eval, hf_baselines=False),
                         dcfg.__class__(**{**vars(dcfg), "auto_tune": True}))
        out["runs"]["greedy_auto_tune"] = {"summary": summarize(tuned), "report": tuned}
        save()
    out["offered_per_token"] = offered_per_token(report)
    save()
    out["transfers_per_step"] = transfers_per_step(teacher, drafters, prompts[0], cfg.eval, dcfg, num_draft)
    save()
    if device.type == "cuda" and dcfg.cuda_graphs != "off" and not args.no_eager_steps:  # graphs vs eager steps
        try:
            eager = evaluate(teacher, drafters, prompts, dataclasses.replace(cfg.eval, hf_baselines=False),
                             dcfg.__class__(**{**vars(dcfg), "cuda_graphs": "off", "compile": "off"}), categories,
                             num_draft=num_draft)
            out["runs"]["greedy_no_cuda_graphs"] = {"summary": summarize(eager), "report": eager}
        except Exception as exc:  # keep the graphed figures; the failure is part of the result
            log.exception("evaluation without CUDA graphs failed")
            out["runs"]["greedy_no_cuda_graphs"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        save()
    if args.compile and report["decoder_steps"]["compile"]:
        log.info("--compile: the main run compiled its steps already (decoder.compile=%s)", dcfg.compile)
    elif args.compile:
        try:
            compiled = evaluate(teacher, drafters, prompts, cfg.eval,
                                dcfg.__class__(**{**vars(dcfg), "compile": "on"}), categories, num_draft=num_draft)
            out["runs"]["greedy_compiled"] = {"summary": summarize(compiled), "report": compiled}
        except Exception as exc:  # keep the eager figures; the failure is part of the result
            log.exception("compiled evaluation failed")
            out["runs"]["greedy_compiled"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        save()
    if args.sample:
        sampled = evaluate(teacher, drafters, prompts, cfg.eval, dcfg.__class__(**{**vars(dcfg), "temperature": 1.0}),
                           categories, num_draft=num_draft)
        out["runs"]["temperature_1"] = {"summary": summarize(sampled), "report": sampled}
    save()
    for run, body in out["runs"].items():
        print(f"== {run}: steps {body.get('report', {}).get('decoder_steps')}")
        for name, row in body.get("summary", {"error": body}).items():
            print(f"  {name:<36}" + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in row.items() if k != "alpha_per_position"))
    print(f"wrote {path}")


def dspark_views(drafters: dict, thresholds: str, eager: bool) -> dict:
    """The trained DSpark drafter again (same weights) with each confidence threshold, and, with ``eager``, each of
    those rows through its eager proposal (a copy whose ``static_draft`` offers none). The eager proposal is the
    tests' readable reference (tests/eager_reference.py), put on the drafter classes here."""
    views = {}
    for name in ("dspark", "dspark_nomarkov"):  # with and without the Markov head: the confidence cut on both
        if name in drafters:
            for t in [float(x) for x in thresholds.split(",") if x.strip()]:
                views[f"{name}[conf={t:g}]"] = drafters[name].with_threshold(t)
    if eager:  # the full method only (its Markov head and its cut)
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.eager_reference import install

        install()
        for name, d in [(k, v) for k, v in {**drafters, **views}.items() if k.split("[")[0] == "dspark"]:
            view = d.with_threshold(d.confidence_threshold)
            view.static_draft = lambda *args, **kwargs: None
            views[f"{name}[eager]"] = view
    return views


def offered_per_token(report: dict) -> dict:
    """Draft positions offered for verification per committed token, from the report's histogram of draft lengths
    (a cut chain counts its own length)."""
    out = {}
    for r in report["results"]:
        lengths = r.get("accept_counts_by_draft_len") or {}
        offered = sum(int(n) * sum(row.values()) for n, row in lengths.items())
        out[r["drafter"]] = offered / max(1, r["new_tokens"])
    return out


def transfers_per_step(teacher, drafters: dict, prompt, eval_cfg, dcfg, num_draft: dict | None = None) -> dict:
    """Host<->device transfers and syncs per verification forward (``inference.transfers``), prefill included, on
    one prompt: the budget the decode loop keeps (<= 4), which on a GPU is the pipeline stalls per step."""
    from eval.run import build_decoder
    from inference.transfers import TransferCounter

    decoder = build_decoder(teacher, dcfg)
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    out = {}
    for name, drafter in drafters.items():
        with TransferCounter() as counter:
            gen = decoder.speculative(drafter, ids, eval_cfg.max_new_tokens,
                                      (num_draft or {}).get(name, eval_cfg.num_draft))
        out[name] = counter.total / max(1, sum(gen.nodes_per_forward.values()))
    return out


if __name__ == "__main__":
    main()

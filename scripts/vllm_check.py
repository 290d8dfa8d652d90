"""Every drafter kind vLLM serves, trained on a toy target, exported with format=vllm, served by a real vLLM engine,
and its acceptance compared with this project's decoder on the same prompts (what `make vllm-check` runs).

    .venv-vllm/bin/python scripts/vllm_check.py                       # CI: the 8-layer tiny toy, smoke budgets
    .venv-vllm/bin/python scripts/vllm_check.py --rows eagle3 dflash  # some rows
    .venv-vllm/bin/python scripts/vllm_check.py --preset toy --out scripts/results/served_vllm_toy_cpu.json
    .venv-vllm/bin/python scripts/vllm_check.py --table               # print the table from the JSON

Each row trains with ``python -m train`` (the row's overrides; ``eval.enabled=false``: the comparison below is the
evaluation) into ``--work/<row>`` (a rerun resumes or skips finished runs), exports the drafter with
``serve.export.export_drafter(..., "vllm", ...)``, and starts vLLM with the ``vllm serve`` line of the export's
model card (``eval.served``), at γ = ``--num-draft``. Lookup has no export: vLLM's ``ngram`` method with the same
n-gram sizes. Every engine runs in this process, one after another (``inference.vllm_engine``), and vLLM's plain
decoding of the prompts runs once per target.

A row passes when vLLM loads the export, its speculative output equals vLLM's plain output on every prompt, vLLM's
plain output equals this project's on at least 9 in 10 prompts, and vLLM's τ lies within 3% of this decoder's
(delivered tokens per verification step on both sides: ``eval.served.committed_tau``; lookup against this decoder
under vLLM's own n-gram rule, ``drafter.match=earliest``, beside its default); or when vLLM refuses it with a reason
this file records (``REFUSED``: vLLM's own message, pinned by
tests/test_served_vllm.py). The JSON is written after every row; the exit status is 1 when a row fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distill.atomic import write_text_atomically  # noqa: E402
from eval.served import like_for_like, served_table  # noqa: E402

# Rows: name -> (drafter kind, python -m train overrides, steps on the tiny preset). Budgets are smoke budgets that
# give acceptance well above zero on the tiny toy target (its 8-layer form: EAGLE-3 captures three distinct layers);
# the heads that read one feature (Medusa) and the block drafters need more steps than the EAGLEs for that.
E3 = ["drafter=eagle3", "drafter.draft_vocab_size=256"]
BLOCK = ["drafter.block_size=8", "drafter.num_anchors=32"]
ROWS = {
    "eagle1": ("eagle1", ["drafter=eagle1"], 200),
    "eagle3": ("eagle3", E3, 200),
    "eagle3_fc_norm_norm_output": ("eagle3", [*E3, "drafter.fc_norm=true", "drafter.norm_output=true"], 200),
    "eagle3_sliding_window": ("eagle3", [*E3, "drafter.sliding_window=32"], 200),
    "medusa": ("medusa", ["drafter=medusa"], 600),
    "medusa2": ("medusa2", ["drafter=medusa2", "drafter.heads_only_steps=300"], 600),
    "draft_model": ("draft_model", ["drafter=draft_model"], 200),
    "dflash": ("dflash", ["drafter=dflash", *BLOCK], 600),
    "peagle": ("peagle", ["drafter=peagle", "drafter.draft_vocab_size=256"], 400),
    "dspark": ("dspark", ["drafter=dspark", *BLOCK], 600),
    "dflash2": ("dflash2", ["drafter=dflash2", *BLOCK, "drafter.selector_rank=32"], 600),
    "lookup": ("lookup", [], 0),
}
# Targets: the 8-layer tiny toy (builds in about a minute; CI) and the default 4M toy (built once, ~11 minutes), each
# with a multiplier of the rows' steps.
PRESETS = {
    "tiny": (["experiment=smoke", "target.toy.num_layers=8"], 1),
    "toy": ([], 1),
}
# Per preset and kind: overrides the target needs. The default EAGLE-3 layers of a 4-layer target are [1, 2, 4], and
# vLLM never captures index L (the final normed output), so the export refuses them: train on [1, 2, 3].
KIND_OVERRIDES = {("toy", "eagle3"): ["drafter.layers=[1,2,3]"]}
# Rows vLLM itself cannot serve here: row -> the start of vLLM's own message (the test pins it).
REFUSED = {"dspark": "Model Runner V1 does not support: dspark speculative decoding",
           "dflash2": "Model Runner V1 does not support: DFlash candidate-head drafts"}
TOLERANCE = 0.03  # vLLM's τ against this decoder's, relative


def train(row: str, preset: str, work: Path, extra: list[str]) -> Path:
    kind, overrides, steps = ROWS[row]
    run_dir = work / row
    if (run_dir / "drafter" / "model.safetensors").is_file():
        return run_dir / "drafter"
    target, factor = PRESETS[preset]
    steps *= factor
    cmd = [sys.executable, "-m", "train", *target, *overrides, *KIND_OVERRIDES.get((preset, kind), []),
           f"trainer.steps={steps}",
           f"trainer.ckpt_every={max(steps // 2, 1)}", "eval.enabled=false", "logger=none",
           f"hydra.run.dir={run_dir}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"training {row} failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    return run_dir / "drafter"


def target_overrides(preset: str, extra: list[str]) -> list[str]:
    return [o for o in [*PRESETS[preset][0], *extra] if o.startswith(("target", "experiment", "eval."))]


def load_setup(preset: str, extra: list[str], num_prompts: int, prompt_tokens: int):
    from hydra import compose, initialize_config_dir

    from distill.teacher import load_teacher
    from eval.run import eval_prompts
    from train.config import load_config, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=[
            *target_overrides(preset, extra), f"eval.num_prompts={num_prompts}",
            f"eval.prompt_tokens={prompt_tokens}"]))
    prompts, _ = eval_prompts(cfg.eval, load_teacher(cfg.target).tokenizer)
    return cfg, prompts


def measure_row(row: str, drafter_path: Path | None, cfg, prompts, args, plain_runs: dict, work: Path) -> dict:
    from dataclasses import asdict

    from distill.teacher import load_teacher
    from eval import served
    from heads.lookup import PromptLookup
    from heads.saved import load_drafter
    from inference.decoder import Decoder
    from serve.adapter import serve_name

    kind = ROWS[row][0]
    teacher = load_teacher(cfg.target)  # fresh per row: Medusa-2 merges its LoRA into the target it is bound to
    if drafter_path is None:
        drafter = PromptLookup({"hidden_size": teacher.hidden_size, "vocab_size": teacher.vocab_size,
                                "num_layers": teacher.num_layers})
        drafter.bind_target(teacher, initialize=True)
        spec = served.for_lookup(drafter, serve_name({"target_config": asdict(cfg.target)}), args.num_draft)
    else:
        drafter = load_drafter(drafter_path, teacher).float()
        try:
            export_dir = served.export_for_vllm(drafter_path, work / "exports" / row) \
                if not (work / "exports" / row / "README.md").is_file() else work / "exports" / row
        except ValueError as e:  # the export itself refuses (e.g. layers vLLM cannot capture): a failing row
            return {"row": row, "kind": kind, "num_draft": args.num_draft, "loads": False,
                    "message": f"format=vllm export refused: {e}"}
        spec = served.from_export(export_dir, args.num_draft)
    eos = teacher.tokenizer.eos_token_id
    if spec.target not in plain_runs:
        plain_runs[spec.target] = served.plain_run(spec.target, prompts, args.max_new, cfg.decoder,
                                                   teacher.max_positions, eos)
    out = {"row": row, "kind": kind, "num_draft": args.num_draft}
    try:
        result = served.measure(teacher, drafter, spec, prompts, args.max_new, args.num_draft, cfg.decoder,
                                teacher.max_positions, plain=plain_runs[spec.target])
    except ValueError as e:
        return {**out, "loads": False, "message": str(e)}
    if kind == "lookup":  # vLLM's ngram follows the earliest occurrence: this decoder with that rule, beside it
        same_rule = PromptLookup(drafter.dims, drafter.max_ngram, drafter.min_ngram, match="earliest")
        same_rule.bind_target(teacher, initialize=True)
        run = served.ours_run(Decoder(teacher, cfg.decoder, eos_token_id=eos), same_rule, prompts, args.max_new,
                              args.num_draft, cfg.decoder.seed)
        total = run.speculative_total
        result["vllm_rule"] = {
            "source": "vllm/v1/spec_decode/ngram_proposer.py: _find_longest_matched_ngram_and_propose_tokens (the "
                      "earliest occurrence of the longest matching suffix n-gram)",
            "drafter": "lookup with drafter.match=earliest",
            "specdraft_tau": total.stats.tau,
            "specdraft_tau_committed": served.committed_tau([g.new_tokens for g in run.speculative],
                                                            total.stats.forwards)}
    return {**out, "loads": True, **result}


def portable(text: str, work: Path) -> str:
    """The results without this machine's paths: the work dir as ``<work>``, the home dir as ``~``."""
    for path, name in ((work.resolve(), "<work>"), (work, "<work>"), (Path.home(), "~")):
        text = text.replace(str(path), name)
    return text


def verdict(r: dict) -> str | None:
    """Why a row fails, or None."""
    if not r["loads"]:
        expected = REFUSED.get(r["row"])
        return None if expected and expected in r["message"] else f"vLLM refused it: {r['message']}"
    ident = r["identity"]
    if ident["vllm_speculative_vs_vllm_plain"]["identical"] != r["num_prompts"]:
        return "vLLM speculative output differs from vLLM plain output"
    if ident["vllm_plain_vs_specdraft_plain"]["identical"] < 0.9 * r["num_prompts"]:
        return "vLLM plain output differs from this project's plain output on more than 1 in 10 prompts"
    ratio = like_for_like(r)  # lookup: against this decoder under vLLM's own ngram rule
    if ratio is None or abs(ratio - 1) > TOLERANCE:
        return f"vLLM τ {r['tau_committed']} over this decoder's (delivered tokens per step): {ratio}, outside ±{TOLERANCE:.0%}"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--preset", default="tiny", choices=list(PRESETS))
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "vllm-check")
    p.add_argument("--out", type=Path, default=None, help="default: scripts/results/served_vllm_<preset>_cpu.json")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--prompt-tokens", type=int, default=None, help="default: 48 (tiny), 128 (toy)")
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--num-draft", type=int, default=4)
    p.add_argument("--table", action="store_true", help="print the table of --out and exit")
    p.add_argument("overrides", nargs="*", help="extra python -m train overrides for every row")
    args = p.parse_args(argv)
    out = args.out or ROOT / "scripts" / "results" / f"served_vllm_{args.preset}_cpu.json"
    if args.table:
        print(served_table(json.loads(out.read_text())["rows"]))
        return 0
    from eval.report import machine_info
    from inference.vllm_engine import import_vllm, vllm_version

    import_vllm()
    prompt_tokens = args.prompt_tokens or (48 if args.preset == "tiny" else 128)
    results = {"preset": args.preset, "vllm": vllm_version(), "num_prompts": args.num_prompts,
               "prompt_tokens": prompt_tokens, "max_new_tokens": args.max_new, "num_draft": args.num_draft,
               "machine": {**machine_info(), "python": platform.python_version()}, "rows": []}
    started = time.time()
    paths = {}
    for row in args.rows:  # training first: every engine then starts in one stretch
        paths[row] = None if ROWS[row][0] == "lookup" else train(row, args.preset, args.work, args.overrides)
        print(f"trained {row} ({time.time() - started:.0f} s)", flush=True)
    cfg, prompts = load_setup(args.preset, args.overrides, args.num_prompts, prompt_tokens)
    plain_runs: dict = {}
    # vLLM 0.32.0 in one process: an engine started after an ngram engine fails at its worker's start (the kernel
    # override scan meets numba's wrappers, which the ngram proposer imports), so lookup's row runs last.
    for row in sorted(args.rows, key=lambda name: ROWS[name][0] == "lookup"):
        r = measure_row(row, paths[row], cfg, prompts, args, plain_runs, args.work)
        r["verdict"] = verdict(r)
        results["rows"].append(r)
        results["seconds"] = time.time() - started
        write_text_atomically(out, portable(json.dumps(results, indent=2, default=str), args.work) + "\n")
        print(f"{row}: {r.get('verdict') or 'pass'} ({time.time() - started:.0f} s)", flush=True)
    print(served_table(results["rows"]))
    print(f"wrote {out}")
    return 1 if any(r["verdict"] for r in results["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())

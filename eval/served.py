"""A drafter served by a real engine: its export loaded in vLLM, the evaluation prompts decoded there, and vLLM's
acceptance reported beside this project's decoder on the same prompts (``python -m eval ... eval.engine=vllm``).

What each side decodes, per prompt, one request at a time (batch 1, as this project's decoder is timed):
- vLLM plain: the target alone; vLLM speculative: the target with the export, at the same γ
  (``num_speculative_tokens``), with the speculative config the export's model card prints;
- this project's plain and speculative decoding of the same drafter, back to back.

Reported (``report.json`` ``served.vllm``): vLLM's mean acceptance length ``tau`` = 1 + accepted / drafts (vLLM's
own counters, as its logs and /metrics give it) beside this decoder's ``specdraft_tau``; the like-for-like figure of
both, ``tau_committed`` / ``specdraft_tau_committed`` (delivered tokens per decode step: ``committed_tau`` says why
the counters alone differ) and their ratio ``tau_ratio``; the per-position acceptance of both (vLLM counts position
i unconditionally; it is divided by position i - 1's count here, which is this project's α_i); greedy identity three
ways (vLLM
speculative vs vLLM plain, vLLM plain vs this project's plain, each difference with the target's logit gap at the
first differing token, ``eval.mismatch``), and tokens/s of all four. Under sampling every side decodes each prompt
from the seed ``decoder.seed + prompt index`` (the two engines' random streams differ, so outputs are compared as
distributions: the acceptance rates with their standard errors over prompts).
"""

from __future__ import annotations

import json
import logging
import math
import shlex
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eval.mismatch import logit_gap, mismatch
from inference.decoder import Decoder, DecoderConfig
from inference.generation import Generation
from inference.vllm_engine import Counters, Engine, import_vllm, supported_architecture, vllm_version
from serve.adapter import SIDECAR, serve_name
from serve.export import export_drafter

log = logging.getLogger(__name__)


def check_engine(name: str) -> None:
    """``eval.engine``: vLLM importable where it is asked for (else one line naming make vllm-check), checked before
    anything is loaded or decoded."""
    if name == "vllm":
        try:
            import_vllm()
        except ImportError as e:
            raise ValueError(f"eval.engine=vllm: {e}") from None


@dataclass
class ServedDrafter:
    """What vLLM is started with: the target (a directory or hub id) and the speculative config, as the model card's
    ``vllm serve`` line names them."""

    target: str
    speculative_config: dict
    export_dir: str | None = None


def serve_line(export_dir: Path) -> str:
    """The ``vllm serve ...`` line of an export's model card (README.md): what a user copies."""
    card = (export_dir / "README.md").read_text(encoding="utf-8").splitlines()
    lines = [line for line in card if line.startswith("vllm serve ")]
    if not lines:
        raise ValueError(f"{export_dir / 'README.md'} has no `vllm serve` line: is {export_dir} a format=vllm export?")
    return lines[0]


def parse_serve_line(line: str) -> ServedDrafter:
    """``vllm serve <target> --speculative-config '<json>'`` as (target, speculative config)."""
    args = shlex.split(line)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    return ServedDrafter(target=args[2], speculative_config=spec, export_dir=spec.get("model"))


def from_export(export_dir: Path, num_draft: int) -> ServedDrafter:
    """An export's serve command, at this evaluation's γ, on the export where it lies now."""
    sidecar = json.loads((export_dir / SIDECAR).read_text(encoding="utf-8"))
    if sidecar.get("engine") != "vllm":
        raise ValueError(f"eval.export={str(export_dir)!r} is a format={sidecar.get('engine')} export; eval.engine=vllm "
                         f"serves a format=vllm export (python scripts/export.py ... format=vllm)")
    served = parse_serve_line(serve_line(export_dir))
    # the card names the directory the export was written to; it may have been copied or moved since (Medusa-2's
    # target, merged_target/, lies inside it too)
    written, here = Path(served.speculative_config["model"]), export_dir.resolve()
    if Path(served.target).is_relative_to(written):
        served.target = str(here / Path(served.target).relative_to(written))
    served.speculative_config.update(model=str(here), num_speculative_tokens=num_draft)
    served.export_dir = str(export_dir)
    return served


def for_lookup(drafter, target: str, num_draft: int) -> ServedDrafter:
    """Prompt lookup has no export: vLLM drafts n-grams itself (``method: ngram``), with the drafter's n-gram sizes."""
    return ServedDrafter(target, {"method": "ngram", "num_speculative_tokens": num_draft,
                                  "prompt_lookup_max": drafter.max_ngram, "prompt_lookup_min": drafter.min_ngram})


def export_for_vllm(drafter_path: Path, out: Path) -> Path:
    """The drafter exported with format=vllm into ``out`` (a temporary directory of the caller's)."""
    report_file = drafter_path.parent / "report.json"
    report = json.loads(report_file.read_text()) if report_file.is_file() else None
    return export_drafter(drafter_path, "vllm", out, report=report)


def check_target(target: str, teacher) -> None:
    """Refuse, before any decoding, a target vLLM has no model class for (its config's ``architectures``)."""
    architectures = getattr(teacher.model.config, "architectures", None) or [type(teacher.model).__name__]
    if not supported_architecture(architectures[0]):
        raise ValueError(f"vLLM {vllm_version()} has no model class for the target's architecture "
                         f"{architectures[0]} ({target}); it cannot serve this target, so eval.engine=vllm cannot "
                         f"measure it: evaluate with eval.engine=specdraft")


def start(served: ServedDrafter | None, target: str, max_model_len: int, kind: str, seed: int,
          eos: int | None) -> Engine:
    """A vLLM engine on ``target``, speculative with ``served``; vLLM's refusal as one line naming the kind."""
    spec = served.speculative_config if served else None
    try:
        return Engine(target, max_model_len, speculative_config=spec, seed=seed, eos_token_id=eos)
    except Exception as e:  # vLLM raises what its config validation or loader raises; all of it is a refusal here
        what = f"the {kind} export {served.export_dir}" if served and served.export_dir else (
            f"the {kind} speculative config {spec}" if spec else f"the target {target}")
        raise ValueError(f"vLLM {vllm_version()} refused {what}: {_one_line(refusal_reason(e))}") from e


def refusal_reason(e: Exception) -> str:
    """vLLM's own words, in one line: a config validation error's messages (pydantic), else the exception's last
    line."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            return "; ".join(" ".join(str(err.get("msg", "")).split()) for err in errors())
        except (TypeError, AttributeError):
            pass
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__


def _one_line(reason: str, limit: int = 400) -> str:
    """A refusal's reason cut to one readable line (vLLM lists every architecture it supports in some of them)."""
    return reason if len(reason) <= limit else reason[:limit] + " ..."


@dataclass
class VLLMRun:
    outputs: list[list[int]]
    seconds: float
    counters: Counters
    per_prompt: list[Counters]


def decode(engine: Engine, prompts: Sequence[Sequence[int]], max_new: int, dcfg: DecoderConfig) -> VLLMRun:
    outputs, seconds, per_prompt = [], 0.0, []
    for i, prompt in enumerate(prompts):
        params = engine.params(max_new, dcfg.temperature, dcfg.top_p, dcfg.top_k,
                               seed=None if dcfg.temperature == 0 else dcfg.seed + i)
        out = engine.generate_one(prompt, params)
        outputs.append(out.new_tokens)
        seconds += out.seconds
        per_prompt.append(out.counters)
    total = sum(per_prompt, Counters())
    return VLLMRun(outputs, seconds, total, per_prompt)


@dataclass
class OursRun:
    plain: list[Generation]
    speculative: list[Generation]

    @property
    def speculative_total(self) -> Generation:
        total = Generation(new_tokens=[], seconds=0.0)
        for g in self.speculative:
            total.merge(g)
        return total

    @staticmethod
    def tokens_per_s(gens: Sequence[Generation]) -> float | None:
        return _tps(sum(len(g.new_tokens) for g in gens), sum(g.seconds for g in gens))


def ours_run(decoder: Decoder, drafter, prompts, max_new: int, num_draft: int, seed: int) -> OursRun:
    """This project's plain and speculative decoding of each prompt, back to back, each from ``seed + index``."""
    as_tensor = [torch.tensor([list(p)], dtype=torch.long) for p in prompts]
    decoder.plain(as_tensor[0], max_new)  # warm-up: first calls allocate
    decoder.speculative(drafter, as_tensor[0], max_new, num_draft)
    run = OursRun([], [])
    for i, p in enumerate(as_tensor):
        decoder.reseed(seed + i)
        run.plain.append(decoder.plain(p, max_new))
        decoder.reseed(seed + i)
        run.speculative.append(decoder.speculative(drafter, p, max_new, num_draft))
    return run


def plain_run(target: str, prompts, max_new: int, dcfg: DecoderConfig, max_model_len: int, eos: int | None) -> VLLMRun:
    """vLLM's plain decoding of ``prompts`` (once per target: every kind's check compares against it)."""
    with start(None, target, max_model_len, "plain", dcfg.seed, eos) as engine:
        decode(engine, prompts[:1], max_new, dcfg)  # warm-up: first calls allocate
        return decode(engine, prompts, max_new, dcfg)


def _identity(teacher, prompts, reference: list[list[int]], outputs: list[list[int]]) -> dict:
    found = [m for i, (ref, got) in enumerate(zip(reference, outputs)) if (m := mismatch(i, ref, got)) is not None]
    gaps = [logit_gap(teacher.model, torch.tensor([list(prompts[m.prompt])]), m) for m in found]
    return {"identical": len(outputs) - len(found), "prompts": len(outputs), "mismatches": gaps,
            "max_abs_logit_gap": max((abs(g["logit_gap"]) for g in gaps if "logit_gap" in g), default=None)}


def _spread(values: Sequence[float | None]) -> dict:
    """Mean and standard error over prompts (prompts with no draft step are left out)."""
    xs = [v for v in values if v is not None]
    if not xs:
        return {"mean": None, "stderr": None, "prompts": 0}
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0
    return {"mean": mean, "stderr": math.sqrt(var / len(xs)), "prompts": len(xs)}


def committed_tau(outputs: Sequence[Sequence[int]], steps: int) -> float | None:
    """New tokens delivered per decode step (drafted or not): every prompt's tokens after the first (which the
    prefill gives), over the steps. The like-for-like figure of the two engines: vLLM's counters count only the
    steps that carried a draft (not those where, e.g., no n-gram matched), and also count drafts accepted past
    ``max_tokens`` or an EOS, which the request then drops; this decoder counts every verification forward and
    drafts no further than what is left to decode."""
    return sum(max(len(o) - 1, 0) for o in outputs) / steps if steps else None


def _tps(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds else None


def measure(teacher, drafter, served: ServedDrafter, prompts: Sequence[Sequence[int]], max_new: int,
            num_draft: int, dcfg: DecoderConfig, max_model_len: int, plain: VLLMRun | None = None) -> dict:
    """vLLM's served acceptance of ``drafter`` (as ``served``) beside this project's decoder on ``prompts``: the
    ``served.vllm`` block of report.json. ``plain``: vLLM's plain run of these prompts, when the caller already
    has it (a check over many kinds starts the plain engine once)."""
    eos = teacher.tokenizer.eos_token_id if teacher.tokenizer is not None else None
    greedy = dcfg.temperature == 0
    if "speculative_token_tree" not in served.speculative_config:
        drafter.set_tree("chain")  # vLLM verifies a chain of num_speculative_tokens: this decoder does the same
    ours = ours_run(Decoder(teacher, dcfg, eos_token_id=eos), drafter, prompts, max_new, num_draft, dcfg.seed)
    plain = plain or plain_run(served.target, prompts, max_new, dcfg, max_model_len, eos)
    with start(served, served.target, max_model_len, drafter.name, dcfg.seed, eos) as engine:
        decode(engine, prompts[:1], max_new, dcfg)
        spec = decode(engine, prompts, max_new, dcfg)
    ours_total = ours.speculative_total
    ours_tau = ours_total.stats.tau
    out = {
        "version": vllm_version(),
        "method": served.speculative_config.get("method"),
        "speculative_config": served.speculative_config,
        "target": served.target,
        "num_draft": num_draft,
        "max_new_tokens": max_new,
        "num_prompts": len(prompts),
        "sampling": "greedy" if greedy else f"temperature={dcfg.temperature:g}, top_p={dcfg.top_p:g}, "
                                            f"top_k={dcfg.top_k}, seed={dcfg.seed} + prompt index",
        **{k: v for k, v in spec.counters.to_dict().items() if k != "tau"},
        "tau": spec.counters.tau,
        # a request alone takes one engine step for its prefill, then one per decode step
        "tau_committed": (vllm_committed := committed_tau(spec.outputs, spec.counters.steps - len(prompts))),
        "specdraft_tau": ours_tau,
        "specdraft_tau_committed": (ours_committed := committed_tau([g.new_tokens for g in ours.speculative],
                                                                    ours_total.stats.forwards)),
        # like for like: delivered tokens per verification step on both sides (``committed_tau``)
        "tau_ratio": vllm_committed / ours_committed if vllm_committed and ours_committed else None,
        "specdraft_alpha": ours_total.stats.alpha,
        "specdraft_alpha_per_position": ours_total.stats.alpha_per_position,
        "tokens_per_s": {"vllm_speculative": _tps(sum(map(len, spec.outputs)), spec.seconds),
                         "vllm_plain": _tps(sum(map(len, plain.outputs)), plain.seconds),
                         "specdraft_speculative": ours.tokens_per_s(ours.speculative),
                         "specdraft_plain": ours.tokens_per_s(ours.plain)},
    }
    if greedy:
        ours_plain = [g.new_tokens for g in ours.plain]
        vs_plain = _identity(teacher, prompts, plain.outputs, spec.outputs)
        out["identical"] = vs_plain["identical"] == len(prompts)
        out["identity"] = {"vllm_speculative_vs_vllm_plain": vs_plain,
                           "vllm_plain_vs_specdraft_plain": _identity(teacher, prompts, ours_plain, plain.outputs),
                           "specdraft_speculative_vs_specdraft_plain": _identity(teacher, prompts, ours_plain,
                                                                                 [g.new_tokens for g in ours.speculative])}
    else:  # distributions, not tokens: the acceptance each side measured, with its spread over prompts
        out["identical"] = None
        # per prompt, each side: accepted / drafted tokens (vLLM's acceptance rate: a position after a rejection
        # counts as drafted) and delivered tokens per decode step
        out["acceptance"] = {
            "vllm_acceptance_rate": _spread([c.accepted / c.draft_tokens if c.draft_tokens else None
                                             for c in spec.per_prompt]),
            "specdraft_acceptance_rate": _spread([drafted_acceptance(g.stats) for g in ours.speculative]),
            "vllm_tau_committed": _spread([committed_tau([o], c.steps - 1) for o, c in
                                           zip(spec.outputs, spec.per_prompt)]),
            "specdraft_tau_committed": _spread([committed_tau([g.new_tokens], g.stats.forwards)
                                                for g in ours.speculative]),
        }
    return out


def drafted_acceptance(stats) -> float | None:
    """Accepted over drafted tokens (vLLM's acceptance rate), from this decoder's accept histogram."""
    drafted = sum(k * c for k, row in stats.counts.items() for c in row.values())
    accepted = sum(a * c for row in stats.counts.values() for a, c in row.items())
    return accepted / drafted if drafted else None


def served_for_saved(teacher, drafter, drafter_path: Path | None, export: str | None, prompts, max_new: int,
                     num_draft: int, dcfg: DecoderConfig, target_cfg: Mapping) -> dict:
    """``served.vllm`` for ``python -m eval``: the drafter's export (``eval.export``, or one written to a temporary
    directory here) served at the run's γ."""
    max_model_len = teacher.max_positions
    if drafter.name == "lookup":
        target = serve_name({"target_config": dict(target_cfg)})
        check_target(target, teacher)
        return measure(teacher, drafter, for_lookup(drafter, target, num_draft), prompts, max_new, num_draft, dcfg,
                       max_model_len)
    with tempfile.TemporaryDirectory(prefix="specdraft-vllm-") as tmp:
        export_dir = Path(export) if export else export_for_vllm(Path(drafter_path), Path(tmp) / "export")
        served = from_export(export_dir, num_draft)
        check_target(served.target, teacher)
        return measure(teacher, drafter, served, prompts, max_new, num_draft, dcfg, max_model_len)


def like_for_like(row: Mapping) -> float | None:
    """vLLM's delivered-token τ over this decoder's (``committed_tau``); for a row that records this decoder under
    vLLM's own drafting rule (``vllm_rule``: lookup's n-gram match), against that."""
    if not row.get("vllm_rule"):
        return row.get("tau_ratio")
    ours = row["vllm_rule"]["specdraft_tau_committed"]
    return row["tau_committed"] / ours if ours and row.get("tau_committed") else None


def served_table(rows: Sequence[Mapping]) -> str:
    """The served table (scripts/vllm_check.py's rows) as markdown: per row and γ, whether vLLM loads it (else its
    message), greedy identity, vLLM's τ (its counters, and delivered tokens per step) against this decoder's."""
    lines = ["| row | kind | γ | vLLM loads it | vLLM spec = vLLM plain | vLLM plain = ours | vLLM τ (counters) | "
             "vLLM τ (delivered) | our τ | ratio | verdict |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | "
             "--- | --- |"]
    for r in rows:
        if not r["loads"]:
            lines.append(f"| {r['row']} | {r['kind']} | {r['num_draft']} | no: {r['message']} | | | | | | | "
                         f"{r.get('verdict') or 'refused on a CPU, as recorded'} |")
            continue
        ident, n = r["identity"], r["num_prompts"]
        ours = f"{r['specdraft_tau_committed']:.3f}"
        if r.get("vllm_rule"):
            ours += f" ({r['vllm_rule']['specdraft_tau_committed']:.3f} with vLLM's rule)"
        lines.append(f"| {r['row']} | {r['kind']} | {r['num_draft']} | yes | "
                     f"{ident['vllm_speculative_vs_vllm_plain']['identical']}/{n} | "
                     f"{ident['vllm_plain_vs_specdraft_plain']['identical']}/{n} | {r['tau']:.3f} | "
                     f"{r['tau_committed']:.3f} | {ours} | {like_for_like(r):.3f} | {r.get('verdict') or 'pass'} |")
    return "\n".join(lines)

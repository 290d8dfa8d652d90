"""A human-readable summary of an evaluation report, as markdown.

``report.json`` is for machines; this is what a reader opens first (or pastes
into a pull request): the setup in one line, one row per drafter, the
baselines, per-category figures when the prompts had categories, the metric
definitions and links to the figures. Every figure is read from the report
dict, never recomputed, so the two cannot disagree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from eval.batch_sweep import POLICY_GOAL
from eval.plots import result_label

MISSING = "–"  # an en dash: a value the report does not have (never reached, not measured)

RESULT_COLUMNS = [
    "drafter", "lossless", "τ", "α", "α per position", "tokens/s", "speedup",
    "identical to plain", "predicted speedup", "overhead ratio",
]


def summary_markdown(report: Mapping) -> str:
    """The whole summary document for ``report`` (the dict written to ``report.json``)."""
    results = report["results"]
    sections = [
        _header(report),
        "## Drafters\n\n" + _table(RESULT_COLUMNS, [_result_row(r, report.get("num_prompts")) for r in results]),
        _baselines_section(report.get("baselines")),
        *(_category_section(r) for r in results),
        _context_length_section(report.get("context_lengths"), results),
        _batch_sweep_section(report.get("batch_sweep")),
        _steps_section(report.get("decoder_steps"), report.get("compiled_vs_eager")),
        _definitions_section(report.get("definitions")),
        _plots_section(report.get("plots")),
    ]
    return "\n\n".join(s for s in sections if s) + "\n"


def fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    """``value`` formatted with ``spec``, or the missing mark for None."""
    return MISSING if value is None else f"{value:{spec}}{suffix}"


def sampling_text(sampling: Mapping | None) -> str:
    """``temperature=0.7, top_p=0.9`` from the sampling settings; "greedy" when there are none."""
    if not sampling:
        return "greedy"
    return ", ".join(f"{k}={v}" for k, v in sampling.items() if v is not None) or "greedy"


def _header(report: Mapping) -> str:
    greedy = report.get("greedy") or {}
    return (
        f"# Evaluation: {report['target']['name']}\n\n"
        f"{report.get('num_prompts', MISSING)} prompts, up to {report.get('max_new_tokens', MISSING)} new tokens, "
        f"sampling: {sampling_text(report.get('sampling'))}; "
        f"plain decoding {fmt(greedy.get('tokens_per_s'), '.1f')} tokens/s"
    )


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [_row(columns), _row(["---"] * len(columns))]
    return "\n".join(lines + [_row(r) for r in rows])


def _row(cells: Sequence[str]) -> str:
    # A "|" inside a cell (a label, a note) would split it into two columns.
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def _yes_no(flag) -> str:
    return MISSING if flag is None else ("yes" if flag else "no")


def _lossless_cell(result: Mapping) -> str:
    flag = result.get("lossless")
    return "no (lossy)" if flag is False else _yes_no(flag)


def _identical_cell(result: Mapping, num_prompts) -> str:
    """yes / no, with how many prompts matched plain decoding when some did not."""
    flag = result.get("identical_to_plain", result.get("identical_to_greedy"))
    matched = result.get("identical_prompts")
    if flag is False and matched is not None and num_prompts is not None:
        return f"no ({matched}/{num_prompts})"
    return _yes_no(flag)


def _result_row(result: Mapping, num_prompts) -> list[str]:
    cost = result.get("cost") or {}
    per_position = " ".join(fmt(a) for a in result.get("alpha_per_position") or []) or MISSING
    return [
        result_label(result), _lossless_cell(result), fmt(result.get("tau")), fmt(result.get("alpha")), per_position,
        fmt(result.get("tokens_per_s"), ".1f"), fmt(result.get("speedup"), ".2f", "×"),
        _identical_cell(result, num_prompts), fmt(cost.get("predicted_speedup"), ".2f", "×"),
        fmt(cost.get("overhead_ratio")),
    ]


def _baselines_section(baselines: Mapping | None) -> str:
    if not baselines:
        return ""
    rows = [
        [name, fmt(b.get("tokens_per_s"), ".1f"), fmt(b.get("speedup"), ".2f", "×"), b.get("note") or ""]
        for name, b in baselines.items()
    ]
    return "## Baselines\n\n" + _table(["baseline", "tokens/s", "speedup", "note"], rows)


def _category_section(result: Mapping) -> str:
    """Per-category figures of one drafter; empty when its prompts had no categories."""
    categories = result.get("categories")
    if not categories:
        return ""
    rows = [
        [name, fmt(c.get("num_prompts"), ""), fmt(c.get("tau")), fmt(c.get("alpha")),
         fmt(c.get("tokens_per_s"), ".1f"), fmt(c.get("speedup"), ".2f", "×")]
        for name, c in categories.items()
    ]
    columns = ["category", "prompts", "τ", "α", "tokens/s", "speedup"]
    return f"## Per category: {result_label(result)}\n\n" + _table(columns, rows)


def _context_length_section(setup: Mapping | None, results: Sequence[Mapping]) -> str:
    """τ and speedup per context length (``eval.context_lengths``): one row per drafter and length; empty when off."""
    if not setup:
        return ""
    intro = (
        f"The same {setup['num_prompts']} held-out passages cut to each length: prompts of length − "
        f"{setup['max_new_tokens']} new tokens − {setup['lookahead']} draft tokens, decoded up to that position; "
        f"speedup over plain decoding of the same prompts."
    )
    rows = []
    for r in results:
        for length, c in (r.get("context_lengths") or {}).items():
            rows.append([result_label(r), length, fmt(c.get("prompt_tokens"), ""), fmt(c.get("tau")),
                         fmt(c.get("alpha")), fmt(c.get("tokens_per_s"), ".1f"), fmt(c.get("speedup"), ".2f", "×"),
                         _yes_no(c.get("identical_to_greedy"))])
    columns = ["drafter", "context length", "prompt tokens", "τ", "α", "tokens/s", "speedup", "identical to plain"]
    return "## By context length\n\n" + intro + "\n\n" + _table(columns, rows)


def _batch_sweep_section(sweep: Mapping | None) -> str:
    """The batch sweep (``eval.batch_sweep``): one table per drafter; empty without a sweep."""
    if not sweep:
        return ""
    intro = (
        f"{sweep['num_prompts']} prompts decoded in batches of each size, up to {sweep['max_new_tokens']} new tokens, "
        f"γ = {sweep['num_draft']}, policy = {sweep['policy']}. Tokens/s over all sequences; latency = time until a "
        f"sequence leaves its batch / its new tokens (mean, ms per token). `auto / best`: the load-aware policy over "
        f"the better of always-on and plain (goal ≥ {POLICY_GOAL})."
    )
    parts = ["## Batch sweep\n\n" + intro]
    columns = ["batch", "plain tok/s", "spec tok/s", "speedup", "τ", "auto tok/s", "auto mean γ", "auto / best",
               "plain ms/tok", "spec ms/tok", "auto ms/tok", "identical"]
    for name, entry in sweep["drafters"].items():
        body = []
        for r in sweep["rows"]:
            d, p = r["drafters"][name], r["plain"]
            on, auto = d["always"], d.get("auto") or {}
            same = [x.get("identical_to_plain") for x in (on, auto) if x]
            body.append([r["batch_size"], fmt(p["tokens_per_s"], ".1f"), fmt(on["tokens_per_s"], ".1f"),
                         fmt(on.get("speedup"), ".2f", "×"), fmt(on["tau"]), fmt(auto.get("tokens_per_s"), ".1f"),
                         fmt(auto.get("mean_gamma")), fmt(auto.get("vs_best")), fmt(p["latency_ms_per_token"], ".2f"),
                         fmt(on["latency_ms_per_token"], ".2f"), fmt(auto.get("latency_ms_per_token"), ".2f"),
                         "–" if None in same else ("yes" if all(same) else "no")])
        note = entry["crossover_note"]
        if "policy_min_vs_best" in entry:
            note += (f"; policy=auto reaches at least {entry['policy_min_vs_best']:.2f} of the better of always-on / "
                     f"plain at every batch size (goal {entry['policy_goal']}: "
                     f"{'met' if entry['policy_goal_met'] else 'NOT met'})")
        parts.append(f"### {name}\n\n{note}.\n\n" + _table(columns, body))
    return "\n\n".join(parts)


def steps_text(steps: Mapping | None) -> str:
    """How the decode steps ran, one line: compiled / CUDA graphs, and the compilation time (left out of tokens/s)."""
    if not steps:
        return ""
    how = " and ".join(w for w, on in (("compiled", steps.get("compile")), ("CUDA graphs", steps.get("cuda_graphs")))
                       if on) or "eager"
    text = f"decode steps: {how}, {steps.get('step_functions', 0)} step functions"
    if steps.get("compile"):
        text += (f", {steps.get('compiled_steps', 0)} compiled in {fmt(steps.get('compile_seconds'), '.1f')} s "
                 f"(left out of tokens/s)")
    if steps.get("fallback_reason"):
        text += f"; fell back: {steps['fallback_reason'][:200]}"
    return text


def check_rows(check: Mapping) -> list[list[str]]:
    """Per method of ``compiled_vs_eager``: identical prompts, then the first difference's prompt, position and
    logit gaps (the largest of the kept ones first)."""
    rows = []
    for name, c in check.items():
        first = max(c["mismatches"], key=lambda m: abs(m.get("logit_gap", 0.0)), default={})
        rows.append([name, f"{c['identical']}/{c['prompts']}",
                     MISSING if not first else f"prompt {first['prompt']}, token {first['position']}",
                     fmt(c.get("max_abs_logit_gap"), ".4f"), fmt(first.get("top2_gap"), ".4f")])
    return rows


def _steps_section(steps: Mapping | None, check: Mapping | None) -> str:
    """How the steps ran and, where they were compiled, every method against eager plain decoding."""
    if not steps:
        return ""
    text = "## Decode steps\n\n" + steps_text(steps) + "."
    if check:
        text += ("\n\nCompiled against eager plain decoding (no compile, no CUDA graphs), the first prompts; where "
                 "they part, the target's logit gap there (eager's token minus the compiled one; top-1 minus top-2):"
                 "\n\n" + _table(["method", "identical", "largest gap at", "logit gap", "top-1 − top-2"],
                                 check_rows(check)))
    return text


def _definitions_section(definitions: Mapping | None) -> str:
    if not definitions:
        return ""
    return "## Definitions\n\n" + "\n".join(f"- **{name}**: {text}" for name, text in definitions.items())


def _plots_section(plots: Sequence[str] | None) -> str:
    if not plots:
        return ""
    # Relative links: the plots sit beside the summary in the run dir.
    return "## Plots\n\n" + "\n".join(f"- [{name}]({name})" for name in plots)

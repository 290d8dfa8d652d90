"""Figures of an evaluation report: acceptance per draft position, accepted lengths, speedup (and, when measured, the
batch sweep and τ / speedup by context length).

Everything is drawn from the report dict alone (the content of ``report.json``),
so a finished run's figures can be redrawn, or several reports compared,
without decoding again. matplotlib is imported inside ``write_plots``: it is
only needed when figures are written, and importing it at module level would
slow every ``import eval`` and pick a display backend on headless machines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

ACCEPTANCE_PNG = "acceptance_per_position.png"
HISTOGRAM_PNG = "accepted_length_histogram.png"
SPEEDUP_PNG = "speedup.png"
SWEEP_PNG = "batch_sweep.png"
CONTEXT_PNG = "context_length.png"


def write_plots(report: Mapping, out_dir) -> list[Path]:
    """Write the three report figures as PNGs under ``out_dir`` (created if missing), and the batch sweep's and the
    context lengths' when the report has them; return their paths."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training / eval machines
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    drawers = {ACCEPTANCE_PNG: _draw_acceptance, HISTOGRAM_PNG: _draw_histogram, SPEEDUP_PNG: _draw_speedup}
    paths = []
    for name, draw in drawers.items():
        # A bare Figure instead of pyplot: no global figure registry to leak or close.
        fig = Figure(figsize=(7, 4), layout="constrained")
        draw(fig.subplots(), report)
        fig.savefig(out / name, dpi=100)
        paths.append(out / name)
    if report.get("batch_sweep"):  # throughput and latency vs batch size (eval.batch_sweep)
        fig = Figure(figsize=(11, 4), layout="constrained")
        draw_sweep(fig, report["batch_sweep"])
        fig.savefig(out / SWEEP_PNG, dpi=100)
        paths.append(out / SWEEP_PNG)
    if report.get("context_lengths"):  # τ and speedup per context length (eval.context_lengths)
        fig = Figure(figsize=(11, 4), layout="constrained")
        draw_context_lengths(fig, report["results"])
        fig.savefig(out / CONTEXT_PNG, dpi=100)
        paths.append(out / CONTEXT_PNG)
    return paths


def result_label(result: Mapping) -> str:
    """The name a result is shown under: its ``label``, else its ``drafter`` key."""
    return str(result.get("label") or result["drafter"])


def _draw_acceptance(ax, report: Mapping) -> None:
    for result in report["results"]:
        # None marks a position never reached: no evidence, so no point rather than a misleading 0.
        points = [(i, a) for i, a in enumerate(result.get("alpha_per_position") or [], 1) if a is not None]
        ax.plot([i for i, _ in points], [a for _, a in points], marker="o", label=result_label(result))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate α_i")
    ax.set_ylim(0.0, 1.05)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title("Acceptance per draft position")
    ax.legend()


def accept_fractions(counts: Sequence[int]) -> list[float]:
    """``counts`` normalised to sum to 1 (all zeros when nothing was counted), so runs of any length compare."""
    total = sum(counts)
    return [c / total if total else 0.0 for c in counts]


def _draw_histogram(ax, report: Mapping) -> None:
    results = report["results"]
    longest = max((len(r.get("accept_counts") or []) for r in results), default=0)
    width = 0.8 / max(len(results), 1)
    for j, result in enumerate(results):
        fractions = accept_fractions(result.get("accept_counts") or [])
        xs = [a - 0.4 + width * (j + 0.5) for a in range(len(fractions))]
        ax.bar(xs, fractions, width=width, label=result_label(result))
    ax.set_xticks(range(longest))
    ax.set_xlabel("draft tokens accepted per verification forward")
    ax.set_ylabel("fraction of forwards")
    ax.set_title("Accepted length")
    ax.legend()


def speedup_entries(report: Mapping) -> list[tuple[str, float, bool]]:
    """``(label, speedup, is_baseline)`` for each result and each baseline that has a speedup.

    Lossy results (``"lossless": false``) are marked in the label: their speedup
    buys a different output, so it must not read as a like-for-like figure.
    """
    entries = []
    for result in report["results"]:
        if result.get("speedup") is not None:
            lossy = " (lossy)" if result.get("lossless") is False else ""
            entries.append((result_label(result) + lossy, float(result["speedup"]), False))
    for name, baseline in (report.get("baselines") or {}).items():
        if baseline.get("speedup") is not None:
            entries.append((str(name), float(baseline["speedup"]), True))
    return entries


def _draw_speedup(ax, report: Mapping) -> None:
    entries = speedup_entries(report)
    ys = range(len(entries))
    colors = ["tab:gray" if is_baseline else "tab:blue" for _, _, is_baseline in entries]
    ax.barh(ys, [s for _, s, _ in entries], color=colors)
    ax.set_yticks(ys, [label for label, _, _ in entries])
    ax.invert_yaxis()  # first result on top, in report order
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1)  # plain decoding
    ax.set_xlabel("speedup over plain decoding (×)")
    ax.set_title("Speedup")


def context_series(result: Mapping, key: str) -> tuple[list[int], list[float]]:
    """(lengths, values of ``key``) of one result's per-context-length block, by increasing length."""
    block = result.get("context_lengths") or {}
    lengths = sorted(block, key=int)
    return [int(n) for n in lengths], [block[n][key] for n in lengths]


def draw_context_lengths(fig, results: Sequence[Mapping]) -> None:
    """τ and speedup vs context length (log2 axis), one line per drafter."""
    ax_tau, ax_speed = fig.subplots(1, 2)
    for ax, key in ((ax_tau, "tau"), (ax_speed, "speedup")):
        for result in results:
            xs, ys = context_series(result, key)
            ax.plot(xs, ys, marker="o", label=result_label(result))
        lengths = sorted({x for r in results for x in context_series(r, key)[0]})
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("context length (tokens)")
    ax_speed.axhline(1.0, color="black", linestyle="--", linewidth=1)  # plain decoding
    ax_tau.set_ylabel("τ (tokens per verification)")
    ax_tau.set_title("τ by context length")
    ax_speed.set_ylabel("speedup over plain decoding (×)")
    ax_speed.set_title("Speedup by context length")
    ax_tau.legend(fontsize="small")


def draw_sweep(fig, sweep: Mapping) -> None:
    """Throughput and latency vs batch size (log2 axis): plain, and each drafter always-on (solid) / auto (dashed)."""
    ax_tps, ax_lat = fig.subplots(1, 2)
    sizes = [r["batch_size"] for r in sweep["rows"]]
    for ax, key in ((ax_tps, "tokens_per_s"), (ax_lat, "latency_ms_per_token")):
        ax.plot(sizes, [r["plain"][key] for r in sweep["rows"]], marker="o", color="black", label="plain")
        for name in sweep["drafters"]:
            line = ax.plot(sizes, [r["drafters"][name]["always"][key] for r in sweep["rows"]], marker="o",
                           label=f"{name} γ={sweep['num_draft']}")[0]
            if all("auto" in r["drafters"][name] for r in sweep["rows"]):
                ax.plot(sizes, [r["drafters"][name]["auto"][key] for r in sweep["rows"]], marker="s", linestyle="--",
                        color=line.get_color(), label=f"{name} auto")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("batch size")
    ax_tps.set_ylabel("tokens/s (all sequences)")
    ax_tps.set_title("Throughput")
    ax_lat.set_ylabel("ms per token (per sequence)")
    ax_lat.set_title("Latency")
    ax_tps.legend(fontsize="small")

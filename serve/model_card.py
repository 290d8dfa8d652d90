"""The README.md model card written into every export: what the drafter is for, how it was made, what it measured,
and the command that serves it (written by the drafter family's adapter)."""

from __future__ import annotations

import json


def _measured(report: dict | None, kind: str) -> str:
    row = next((r for r in (report or {}).get("results", []) if r.get("drafter") == kind), None)
    if row is None:
        return ("Not measured with this checkpoint. Run `python -m eval drafter_path=<the trained drafter dir>` and "
                "export again to include τ, α and speedup here.")
    per_pos = ", ".join("–" if a is None else f"{a:.2f}" for a in row["alpha_per_position"])
    machine = report.get("machine", {})
    return (f"On {report.get('num_prompts')} prompts, up to {report.get('max_new_tokens')} new tokens, "
            f"{report.get('sampling', {}).get('mode', 'greedy')}, γ = {row.get('num_draft')}:\n\n"
            f"| τ | α | α per position | tokens/s | speedup | identical to greedy |\n| --- | --- | --- | --- | --- | --- |\n"
            f"| {row['tau']:.2f} | {row['alpha']:.2f} | {per_pos} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}× "
            f"| {row['identical_to_greedy']} |\n\nMachine: {machine.get('cuda') or machine.get('processor')}, "
            f"torch {machine.get('torch')}. Speedup is against plain decoding of the same target in the same run."
            + _served(report, kind))


def _served(report: dict, kind: str) -> str:
    """The acceptance vLLM measured serving this drafter (``python -m eval ... eval.engine=vllm``), when the report
    holds it: what a user will see in serving, beside this decoder's figure."""
    served = (report.get("served") or {}).get("vllm")
    if not served or served.get("drafter") != kind or served.get("tau") is None:
        return ""
    return (f"\n\nServed in vLLM {served['version']}: τ {served['tau']:.2f} at γ {served['num_draft']} "
            f"(`{served['method']}`, {served['num_prompts']} prompts, {served['sampling']}); this decoder on the same "
            f"prompts: τ {served['specdraft_tau']:.2f}.")


def model_card(engine: str, kind: str, config: dict, report: dict | None, serve_line: str,
               notes: list[str]) -> str:
    """The card of any export: ``serve_line`` and ``notes`` (paragraphs, each followed by a blank line) come from
    the drafter family's adapter."""
    target = config.get("target", {})
    training = config.get("training") or {}
    drafter = config.get("drafter", {})
    lines = [
        "---",
        "license: other  # the target model's license governs this derivative; set it before publishing",
        f"base_model: {target.get('name')}",
        f"tags: [speculative-decoding, {kind}, specdraft, {engine}]",
        "---",
        f"# {kind} drafter for {target.get('name')} ({engine} layout)",
        "",
        "Trained with specdraft by distilling the frozen target; a drafter only proposes tokens, the target verifies "
        "them, so served output is the target's own.",
        "",
        "## Target",
        f"name `{target.get('name')}`, revision `{target.get('revision')}`, vocab {target.get('vocab_size')}, "
        f"hidden size {target.get('hidden_size')}, {target.get('num_layers')} layers.",
        "",
        "## Training",
        f"steps: {training.get('steps', config.get('step', 'unknown'))}; loss: `{training.get('loss', {}).get('_target_', 'unknown')}`; "
        f"data: `{json.dumps(training.get('data')) if training.get('data') else 'not recorded'}`; "
        f"drafter config: `{json.dumps({k: v for k, v in drafter.items() if k != 'model_config'})}`.",
        "",
        "## Measured",
        _measured(report, kind),
        "",
        "## Serve",
        "```bash",
        serve_line,
        "```",
        "",
        *notes,
        "Files: the engine's config.json and safetensors; `specdraft_export.json` records the target identity and "
        "where this export came from.",
    ]
    return "\n".join(lines) + "\n"


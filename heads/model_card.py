"""The README.md model card written into every export: what the drafter is for, how it was made, what it measured,
and the command that serves it."""

from __future__ import annotations

import json
from pathlib import Path


EAGLE_METHOD = {"eagle1": ("eagle", "EAGLE"), "eagle3": ("eagle3", "EAGLE3")}  # (vLLM method, SGLang algorithm)


def serve_command(engine: str, kind: str, target: str, export_dir: str, num_tokens: int, tree: dict | None = None) -> str:
    tree = tree or {}
    if kind in EAGLE_METHOD:
        method, algorithm = EAGLE_METHOD[kind]
        if engine == "speculators":  # vLLM reads the verifier and the method from the speculators config itself
            return f"vllm serve {export_dir}   # or, explicitly:\n" + serve_command("vllm", kind, target, export_dir,
                                                                                    num_tokens, tree)
        if engine == "vllm":  # an explicit method: vLLM otherwise guesses it from the path string
            spec = {"method": method, "model": export_dir, "num_speculative_tokens": num_tokens}
            return f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"
        if engine == "sglang":
            return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
                    f"--speculative-draft-model-path {export_dir} --speculative-num-steps {num_tokens} "
                    f"--speculative-eagle-topk {tree.get('top_k', 4)} "
                    f"--speculative-num-draft-tokens {tree.get('total_tokens', 16)}")
        return (f"EaModel.from_pretrained(use_eagle3=False, base_model_path='{target}', ea_model_path='{export_dir}', "
                f"total_token={tree.get('total_tokens', 16)}, depth={num_tokens}, top_k={tree.get('top_k', 4)})"
                f"   # SafeAILab/EAGLE")
    if engine == "vllm" and kind == "medusa":
        spec = {"method": "medusa", "model": export_dir, "num_speculative_tokens": num_tokens}
        return f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"
    if engine == "vllm":
        spec = {"method": "draft_model", "model": export_dir, "num_speculative_tokens": num_tokens}
        return f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"
    if engine == "sglang":
        return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm STANDALONE "
                f"--speculative-draft-model-path {export_dir} --speculative-num-steps {num_tokens} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {num_tokens + 1}")
    if kind == "medusa":  # FasterDecoding/Medusa reads base_model_name_or_path from this config
        return f"python -m medusa.inference.cli --model {export_dir}"
    return (f"AutoModelForCausalLM.from_pretrained('{target}').generate(ids, "
            f"assistant_model=AutoModelForCausalLM.from_pretrained('{export_dir}'))")


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
            f"torch {machine.get('torch')}. Speedup is against plain decoding of the same target in the same run.")


def model_card(engine: str, kind: str, config: dict, export_dir: Path, report: dict | None,
               serve_target: str | None = None) -> str:
    target = config.get("target", {})
    training = config.get("training") or {}
    drafter = config.get("drafter", {})
    num_tokens = drafter.get("num_heads", 4) if kind == "medusa" else (drafter.get("depth") or 4)
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
        serve_command(engine, kind, serve_target or str(target.get("name")), str(export_dir), num_tokens, drafter),
        "```",
        "",
        *(["vLLM drafts Medusa as a top-1 chain of `num_speculative_tokens` heads (it needs at least that many); the "
           "figures above were measured with specdraft's decoder and the drafter's own decoding setting (tree: "
           f"`{drafter.get('tree')}`), so expect the chain's τ, not a tree's.", ""] if (engine, kind) == ("vllm", "medusa") else []),
        *(["FasterDecoding/Medusa's loader reads only `medusa_lm_head.pt` and always builds 5 heads (it overrides "
           "medusa_num_heads): with fewer trained heads the rest start untrained, so pass `medusa_choices` no deeper "
           f"than {drafter.get('num_heads')} heads. It shares one ResBlock across a head's layers, so only "
           "`num_layers: 1` heads export to it. Its `medusa_generate` uses typical acceptance (not lossless).", ""]
          if (engine, kind) == ("hf", "medusa") else []),
        *(_eagle_notes(engine, kind, drafter) if kind in EAGLE_METHOD else []),
        "Files: the engine's config.json and safetensors; `specdraft_export.json` records the target identity and "
        "where this export came from.",
    ]
    return "\n".join(lines) + "\n"


def _eagle_notes(engine: str, kind: str, drafter: dict) -> list[str]:
    notes = ["The target's embeddings"
             + (" and lm_head are" if kind == "eagle1" else " are")
             + " not in this export: the engine shares the target's own (the drafter was trained on them)."]
    if kind == "eagle3":
        notes.append(f"Target layers (specdraft hidden-state indices, HF `hidden_states[i]`): {drafter.get('layers')}; "
                     "config.json writes them in this engine's own `eagle_aux_hidden_state_layer_ids` convention "
                     "(SGLang: index - 1, nested in `eagle_config`).")
    return [" ".join(notes), ""]


def medusa2_card(engine: str, config: dict, output_dir: Path, report: dict | None, serve_target: str, merged_dir: str,
                 adapter_dir: str) -> str:
    """The Medusa card, serving the merged target in place of the original, plus what Medusa-2 changes."""
    row = next((r for r in (report or {}).get("results", []) if r.get("drafter") == "medusa2"), None)
    as_medusa = {**report, "results": [{**row, "drafter": "medusa"}]} if row else None  # the card finds rows by kind
    drafter = {k: v for k, v in config.get("drafter", {}).items() if k != "lora_modules"}  # hundreds of paths on an 8B
    card = model_card(engine, "medusa", {**config, "drafter": drafter}, output_dir, as_medusa, serve_target)
    num_tokens = drafter.get("num_heads", 4)
    original, merged = serve_target, str(output_dir / merged_dir)
    card = card.replace(serve_command(engine, "medusa", original, str(output_dir), num_tokens),
                        serve_command(engine, "medusa", merged, str(output_dir), num_tokens))
    card = card.replace("# medusa drafter", "# medusa2 drafter").replace(", medusa, specdraft", ", medusa2, specdraft")
    lora = drafter.get("lora", {})
    final = (config.get("training") or {}).get("final") or {}
    losses = (f" Held-out next-token loss: original {final['heldout/original_loss']:.4f}, adapted "
              f"{final['heldout/adapted_loss']:.4f}." if "heldout/original_loss" in final else "")
    return card + (
        f"\n## Medusa-2: serve the merged target, not the original\n"
        f"The heads were trained jointly with a LoRA (r={lora.get('r')}, alpha={lora.get('alpha')}) on the target, and "
        f"they read the ADAPTED target's hidden states: `{merged_dir}/` is `{original}` with that LoRA merged into its "
        f"weights (a plain Hugging Face directory with the target's tokenizer). Serve it as the model (specdraft's "
        f"evaluation verifies against it too): served output is the merged target's, and on the original target the "
        f"heads would read states they were not trained on. `{adapter_dir}/` holds the LoRA alone "
        f"(`PeftModel.from_pretrained(base, '{adapter_dir}')`).{losses}\n")

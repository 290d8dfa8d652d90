"""Exports: conformance with each engine's spec, round trip through the decoder (same outputs, same τ), refusals."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from heads.saved import save_drafter, weights_digest
from heads.draft_model.model import DraftModel
from serve.export import SIDECAR, check_export, export_drafter, load_export
from inference.decoder import Decoder
from tests.drafters import DIMS, DRAFT_MODEL_NODE, MEDUSA_NODE, TRAINED, noisy_medusa, truncated

TARGET_CFG = {"source": "hf", "name": "tiny-llama"}


def saved_medusa(teacher, tmp_path, extra=TRAINED, num_layers=1):  # noqa: F811
    drafter = noisy_medusa(teacher, scale=0.2) if num_layers == 1 else None
    cfg = dict(MEDUSA_NODE, num_layers=num_layers)
    if drafter is None:
        from heads.base import build_drafter
        drafter = build_drafter(cfg, teacher)
    drafter.set_tree("small")
    return drafter, save_drafter(drafter, tmp_path / "run" / "drafter", cfg, TARGET_CFG, teacher.identity(), extra)


def saved_draft_model(teacher, tmp_path):  # noqa: F811
    drafter = DraftModel(DIMS, model=truncated(teacher.model))
    drafter.bind_target(teacher, initialize=False)
    cfg = drafter.saved_config(dict(DRAFT_MODEL_NODE))
    return drafter, save_drafter(drafter, tmp_path / "run" / "drafter", cfg, TARGET_CFG, teacher.identity(), TRAINED)


def decode_all(teacher, drafter, n=12):  # noqa: F811
    dec = Decoder(teacher)
    g = torch.Generator().manual_seed(0)
    outs, forwards, tokens = [], 0, 0
    for i in range(n):
        prompt = torch.randint(0, 128, (1, 4 + i % 7), generator=g)
        gen = dec.speculative(drafter, prompt, 16, 3)
        outs.append(gen.new_tokens)
        forwards += gen.stats.forwards
        tokens += sum((a + 1) * c for row in gen.stats.counts.values() for a, c in row.items())
    return outs, tokens / forwards


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_medusa_export_conforms_and_round_trips(teacher, tmp_path, engine):  # noqa: F811
    drafter, path = saved_medusa(teacher, tmp_path)
    out = export_drafter(path, engine, tmp_path / engine)
    assert check_export(out, engine, "medusa", teacher.identity()) == []
    config = json.loads((out / "config.json").read_text())
    if engine == "vllm":
        assert config["model_type"] == "medusa" and config["medusa_fc_bias"] is True and config["num_heads"] == 3
        names = set(load_file(str(out / "model.safetensors")))
        assert {"blocks.0.layers.0.weight", "blocks.2.layers.0.bias", "lm_heads.1.weight"} <= names
    else:
        assert config["medusa_num_heads"] == 3 and config["base_model_name_or_path"] == TARGET_CFG["name"]
        # FasterDecoding opens medusa_lm_head.pt (torch.load) and no other name; with a model_type its AutoConfig
        # attempt would succeed and try to load a whole LLM from this directory
        heads = torch.load(out / "medusa_lm_head.pt", weights_only=True)
        assert "0.1.weight" in heads and "0.0.linear.bias" in heads and "model_type" not in config
        assert "always builds 5 heads" in (out / "README.md").read_text()
    card = (out / "README.md").read_text()
    assert "license:" in card and "Serve" in card and TARGET_CFG["name"] in card
    if engine == "vllm":
        assert '"method": "medusa"' in card
    reloaded = load_export(out, teacher)
    assert decode_all(teacher, reloaded) == decode_all(teacher, drafter)  # same outputs and the same τ


@pytest.mark.parametrize("engine", ["vllm", "sglang", "hf"])
def test_draft_model_export_is_a_plain_hf_dir_and_round_trips(teacher, tmp_path, engine):  # noqa: F811
    drafter, path = saved_draft_model(teacher, tmp_path)
    out = export_drafter(path, engine, tmp_path / engine)
    assert check_export(out, engine, "draft_model", teacher.identity()) == []
    assert (out / "model.safetensors").is_file() and json.loads((out / SIDECAR).read_text())["kind"] == "draft_model"
    assert decode_all(teacher, load_export(out, teacher)) == decode_all(teacher, drafter)
    if engine == "sglang":
        assert "--speculative-algorithm STANDALONE" in (out / "README.md").read_text()


def test_conformance_check_has_teeth(teacher, tmp_path):  # noqa: F811
    _, path = saved_medusa(teacher, tmp_path)
    out = export_drafter(path, "vllm", tmp_path / "vllm")
    state = load_file(str(out / "model.safetensors"))
    state["medusa_head.0.0.linear.weight"] = state.pop("blocks.0.layers.0.weight")  # a name vLLM would skip
    save_file(state, str(out / "model.safetensors"))
    problems = check_export(out, "vllm", "medusa")
    assert any("would be skipped" in p for p in problems) and any("expected 3" in p for p in problems)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "medusa_fc_bias": False}))
    assert any("medusa_fc_bias" in p for p in check_export(out, "vllm", "medusa"))


def test_refusals_are_clear_and_write_nothing(teacher, tmp_path):  # noqa: F811
    _, path = saved_medusa(teacher, tmp_path)
    with pytest.raises(ValueError, match="SGLang has no Medusa"):
        export_drafter(path, "sglang", tmp_path / "sg")
    with pytest.raises(ValueError, match="valid: \\['vllm', 'sglang', 'speculators', 'hf'\\]"):
        export_drafter(path, "tensorrt", tmp_path / "trt")
    assert not (tmp_path / "sg").exists() and not (tmp_path / "trt").exists()
    _, untrained = saved_medusa(teacher, tmp_path / "u", extra=None)
    with pytest.raises(ValueError, match="untrained"):
        export_drafter(untrained, "vllm", tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        export_drafter(tmp_path, "vllm", tmp_path / "x")
    _, deep = saved_medusa(teacher, tmp_path / "deep", num_layers=2)
    with pytest.raises(ValueError, match="shares one ResBlock"):
        export_drafter(deep, "hf", tmp_path / "x")
    with pytest.raises(ValueError, match="speculators format holds EAGLE-3 drafters only"):
        export_drafter(path, "speculators", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_partial_checkpoint_is_refused(teacher, tmp_path):  # noqa: F811
    _, path = saved_medusa(teacher, tmp_path)
    state = load_file(str(path / "model.safetensors"))
    state.pop(next(iter(state)))
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        export_drafter(path, "vllm", tmp_path / "x")


def test_existing_output_needs_overwrite(teacher, tmp_path):  # noqa: F811
    _, path = saved_medusa(teacher, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for overwrite in (False, True):  # not an earlier export: never replaced, overwrite or not
        with pytest.raises(FileExistsError, match="not an earlier export"):
            export_drafter(path, "vllm", out, overwrite=overwrite)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    export_drafter(path, "vllm", out)  # empty: fine
    with pytest.raises(FileExistsError, match="overwrite=true"):
        export_drafter(path, "vllm", out)
    export_drafter(path, "vllm", out, overwrite=True)  # an earlier export: replaced
    assert check_export(out, "vllm", "medusa") == []
    import os
    umask = os.umask(0)
    os.umask(umask)
    # A serving process (often another user) must be able to read it: not mkdtemp's private 0700 / 0600.
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_cli(teacher, tmp_path):  # noqa: F811
    import importlib.util
    from pathlib import Path

    _, path = saved_medusa(teacher, tmp_path)
    (path.parent / "report.json").write_text(json.dumps({
        "num_prompts": 2, "max_new_tokens": 8, "machine": {"processor": "cpu", "torch": "x"},
        "results": [{"drafter": "medusa", "tau": 1.7, "alpha": 0.4, "alpha_per_position": [0.5, None],
                     "tokens_per_s": 10.0, "speedup": 0.9, "identical_to_greedy": True, "num_draft": 3,
                     "weights_digest": weights_digest(path)}]}))
    spec = importlib.util.spec_from_file_location("export_cli", Path(__file__).resolve().parents[1] / "scripts" / "export.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = cli.main([f"drafter_path={path}", "format=vllm", f"output_dir={tmp_path / 'cli'}"])
    card = (out / "README.md").read_text()
    assert "| 1.70 | 0.40 | 0.50, – |" in card  # the run's measured figures reach the model card
    report = json.loads((path.parent / "report.json").read_text())
    report["results"][0]["weights_digest"] = "0" * 64  # measured other weights (the run was extended since)
    (path.parent / "report.json").write_text(json.dumps(report))
    out = cli.main([f"drafter_path={path}", "format=vllm", f"output_dir={tmp_path / 'cli'}", "overwrite=true"])
    assert "1.70" not in (out / "README.md").read_text() and "Not measured" in (out / "README.md").read_text()
    with pytest.raises(SystemExit, match="unknown argument"):
        cli.main(["drafter=x"])
    with pytest.raises(SystemExit, match="missing output_dir"):
        cli.main([f"drafter_path={path}", "format=vllm"])


def test_every_adapter_supports_or_refuses_every_engine():
    """Adding an engine is one row per adapter: each (kind, engine) pair is either a row (the adapter writes it) or
    a refusal with its reason, never both and never neither, and the supported pairs are the ones whose exports
    tests/test_export_digests.py pins."""
    from serve.adapter import ENGINES, refusal
    from serve.export import ADAPTERS
    from tests.drafters import EXPORTS

    for kind, adapter in ADAPTERS.items():
        for engine in ENGINES:
            refused = refusal(adapter, engine, kind) is not None
            assert adapter.supports(engine, kind) != refused, (kind, engine)
    supported = {kind: tuple(e for e in ENGINES if ADAPTERS[kind].supports(e, kind)) for kind in EXPORTS}
    assert {k: sorted(v) for k, v in supported.items()} == {k: sorted(v) for k, v in EXPORTS.items()}
    assert ADAPTERS["medusa2"].supports("vllm", "medusa2") and not ADAPTERS["lookup"].supports("vllm", "lookup")

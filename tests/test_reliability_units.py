"""Nothing silent, no raw tracebacks: unit-level, one test per case (the run-dir cases are in
test_reliability_run.py)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from distill.data import DataConfig, TokenBlockDataset, load_records, rows_fingerprint
from distill.teacher import Teacher
from heads.base import build_drafter
from heads.saved import WEIGHTS, decode_overrides, load_drafter, load_saved_drafter, read_drafter_config, save_drafter
from tests.conftest import make_tiny_llama
from tests.test_checkpoint import MEDUSA, DyingEngine, Killed, make_cfg, make_dataset, run
from train import checkpoint
from train.config import load_config, register_configs

CONF = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()
EAGLE1 = {"_target_": "heads.eagle.EagleDrafter", "variant": "eagle1", "layers": [-1], "ttt_steps": 1}


def load(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def saved_medusa(teacher, path, target_cfg=None, drafter_cfg=MEDUSA):
    drafter = build_drafter(drafter_cfg, teacher)
    identity = {**teacher.identity(), "weights_digest": teacher.weights_digest()}
    return save_drafter(drafter, path, drafter_cfg, target_cfg or {"source": "toy", "name": "tiny-llama"}, identity)


# --- schedule values -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, match", [
    ("trainer.lr=0", "trainer.lr=0.0 must be > 0"),
    ("trainer.lr=-1e-3", "trainer.lr=-0.001 must be > 0"),
    ("trainer.lr=nan", "trainer.lr=nan is not a finite number"),
    ("trainer.min_lr_ratio=-0.1", r"min_lr_ratio=-0.1 must lie in \[0, 1\]"),
    ("trainer.min_lr_ratio=1.5", r"min_lr_ratio=1.5 must lie in \[0, 1\]"),
    ("trainer.warmup_steps=-1", "warmup_steps=-1 must be >= 0"),
    ("trainer.grad_clip=-1", "grad_clip=-1.0 must be >= 0"),
    ("trainer.keep_last=0", "keep_last=0 must be >= 1"),
    ("trainer.loss_chunk_elements=0", "loss_chunk_elements=0 must be >= 1"),
])
def test_out_of_range_schedule_values_are_refused_at_start_up(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(load(override))


# --- non-finite training ----------------------------------------------------------------------------------------


def test_non_finite_loss_names_the_step_and_term_and_saves_nothing(tiny_teacher, tmp_path):
    cfg = make_cfg(lr=1e30, warmup_steps=0, ckpt_every=1)
    with pytest.raises(FloatingPointError, match=r"step 1: train/loss is nan .*loss term 1") as err:
        run(tiny_teacher, tmp_path, cfg)
    assert "step_0000001, is untouched" in str(err.value)
    for ckpt in checkpoint.complete_checkpoints(tmp_path):  # the one checkpoint is of the last finite step
        weights = load_saved_drafter(ckpt / "drafter")[0].state_dict().values()
        assert all(torch.isfinite(w).all() for w in weights)


def test_saving_non_finite_weights_is_refused(tiny_teacher, tmp_path):
    drafter = build_drafter(MEDUSA, tiny_teacher)
    with torch.no_grad():
        next(drafter.parameters()).fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="hold NaN or inf"):
        save_drafter(drafter, tmp_path / "d", MEDUSA, {}, tiny_teacher.identity())
    assert not (tmp_path / "d").exists()


# --- identity checks ----------------------------------------------------------------------------------------------


def test_drafter_evaluated_against_another_target_of_the_same_sizes_is_refused(tiny_teacher, tmp_path):
    saved_medusa(tiny_teacher, tmp_path / "d")
    other = Teacher(make_tiny_llama(seed=1), tokenizer=None, name="tiny-llama")  # same name and sizes
    with pytest.raises(ValueError, match="digest .* eval.allow_other_target=true"):
        load_drafter(tmp_path / "d", other)
    assert load_drafter(tmp_path / "d", other, allow_other_target=True) is not None
    assert load_drafter(tmp_path / "d", tiny_teacher) is not None


def test_rows_fingerprint_is_a_function_of_content():
    rows = TokenBlockDataset(torch.arange(32).view(4, 8), torch.ones(4, 8, dtype=torch.long), torch.ones(4, 8).bool())
    same = TokenBlockDataset(rows.input_ids.clone(), rows.attention_mask.clone(), rows.loss_mask.clone())
    edited = TokenBlockDataset(rows.input_ids.clone(), rows.attention_mask, rows.loss_mask)
    edited.input_ids[3, 7] += 1
    assert rows_fingerprint(rows) == rows_fingerprint(same) == rows_fingerprint([rows[i] for i in range(4)])
    assert rows_fingerprint(edited) != rows_fingerprint(rows)


def _killed(teacher, run_dir, cfg, dataset=None):
    import functools

    from distill.data import collate
    from distill.losses import forward_kl
    from train.engine import SingleEngine
    from train.logger import MetricsLogger
    from train.loop import train

    torch.manual_seed(0)
    drafter = build_drafter(cfg.drafter, teacher)
    drafter.bind_target(teacher, initialize=True)
    logger = MetricsLogger(run_dir, cfg.logger, asdict(cfg))
    engine = DyingEngine(cfg.trainer, die_at=4) if dataset is None else SingleEngine(cfg.trainer)
    try:
        train(cfg, teacher, drafter, dataset or make_dataset(), collate, functools.partial(forward_kl), engine,
              run_dir, logger)
    finally:
        logger.close()


@pytest.mark.parametrize("change, match", [
    ("data", "rows_digest=.*training rows differ by content"),
    ("lr", r"trainer.lr=0.01, this run asks for 0.02"),
    ("loss", r"loss=\{'_target_': 'distill.losses.forward_kl'\}"),
])
def test_resume_with_other_data_loss_or_lr_is_refused(tiny_teacher, tmp_path, change, match):
    cfg = replace(make_cfg(), loss={"_target_": "distill.losses.forward_kl"})
    with pytest.raises(Killed):
        _killed(tiny_teacher, tmp_path, cfg)
    data = make_dataset()
    if change == "data":  # same path, same row count, one token edited
        data[5]["input_ids"][3] = (data[5]["input_ids"][3] + 1) % 128
    elif change == "lr":
        cfg.trainer = replace(cfg.trainer, lr=2e-2)
    else:
        cfg.loss = {"_target_": "distill.losses.reverse_kl"}
    with pytest.raises(ValueError, match=match):
        _killed(tiny_teacher, tmp_path, cfg, dataset=data)


def test_teacher_cache_refuses_an_edited_data_file_and_a_shard_damaged_in_place(tiny_teacher, tmp_path):
    from distill.cache import CachedDataset, OfflineTeacher, shard_name, write_cache
    from tests.test_cache import make_rows

    source = tmp_path / "rows.txt"
    source.write_text("the rows were tokenised from this text")
    data_cfg = DataConfig(source="file", path=str(source), max_length=16)
    write_cache(tmp_path / "c", tiny_teacher, make_rows(), data_cfg, (-1,), topk=4, dtype="float32", shard_rows=4)
    OfflineTeacher(tmp_path / "c", tiny_teacher, data_cfg)  # as written: fine
    source.write_text("the rows were tokenised from this text, edited")  # same path, same config
    with pytest.raises(ValueError, match="data_content"):
        OfflineTeacher(tmp_path / "c", tiny_teacher, data_cfg)
    shard = tmp_path / "c" / shard_name(1)
    raw = bytearray(shard.read_bytes())
    raw[-8:] = b"\xff" * 8  # inside the tensor data: same size, same header
    shard.write_bytes(bytes(raw))
    dataset = CachedDataset(tmp_path / "c")
    dataset[0]  # shard 0 is intact
    with pytest.raises(ValueError, match=f"{shard_name(1)} is truncated or corrupt .*sha256"):
        dataset[5]


# --- python -m eval drafter_path=... overrides -----------------------------------------------------------------


def test_decode_time_drafter_keys_apply_and_weight_keys_are_refused(tiny_teacher, tmp_path):
    saved_medusa(tiny_teacher, tmp_path / "e", drafter_cfg=EAGLE1)
    drafter, _ = load_saved_drafter(tmp_path / "e", {"total_tokens": 59, "top_k": 10, "depth": 6})
    assert (drafter.total_tokens, drafter.top_k, drafter.depth) == (59, 10, 6)
    with pytest.raises(ValueError, match=r"drafter.num_heads=4 cannot apply .*retraining.*'total_tokens', 'tree'"):
        decode_overrides(EAGLE1, {"num_heads": 4}, "x")
    with pytest.raises(ValueError, match="drafter.num_layers is not a setting of the saved drafter"):
        decode_overrides(EAGLE1, {"num_layers": 2}, "x")
    assert decode_overrides(MEDUSA, {"tree": "small"}, "x")["tree"] == "small"  # Medusa's decode key
    with pytest.raises(ValueError, match="loss_decay=0.5 cannot apply"):
        decode_overrides(MEDUSA, {"loss_decay": 0.5}, "x")


def test_eval_refuses_a_drafter_preset_with_drafter_path(tiny_teacher, tmp_path):
    from eval.saved import drafter_overrides, parse_overrides

    path = saved_medusa(tiny_teacher, tmp_path / "d")
    cfg = load("drafter=eagle3", "drafter.total_tokens=20")
    cli = parse_overrides(["drafter=eagle3", "drafter.total_tokens=20"])
    with pytest.raises(ValueError, match="drafter=eagle3 builds a new drafter, but drafter_path=.*MedusaHeads"):
        drafter_overrides(cfg, cli, read_drafter_config(path), path)
    cli = parse_overrides(["drafter.total_tokens=20", "eval.num_prompts=3"])
    assert drafter_overrides(cfg, cli, read_drafter_config(path), path) == {"total_tokens": 20}


def test_remote_code_is_never_enabled_by_a_saved_file(tiny_teacher, tmp_path):
    from eval.saved import parse_overrides, target_config

    target = {"source": "hf", "name": str(tmp_path / "evil"), "trust_remote_code": True}
    path = saved_medusa(tiny_teacher, tmp_path / "d", target_cfg=target)
    assert json.loads((path / "config.json").read_text())["target_config"]["trust_remote_code"] is True
    saved = read_drafter_config(path)
    assert saved["target_config"]["trust_remote_code"] is False
    assert target_config(load(), parse_overrides([f"drafter_path={path}"]), saved)["trust_remote_code"] is False
    asked = ["target.trust_remote_code=true", f"drafter_path={path}"]
    chosen = target_config(load("target.trust_remote_code=true"), parse_overrides(asked), saved)
    assert chosen["trust_remote_code"] is True and chosen["name"] == str(tmp_path / "evil")


def test_deepspeed_state_loads_only_when_signed_by_this_user(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "key"))
    ckpt = tmp_path / "step_0000002"
    (ckpt / "deepspeed" / "deepspeed").mkdir(parents=True)
    shard = ckpt / "deepspeed" / "deepspeed" / "mp_rank_00_model_states.pt"
    shard.write_bytes(b"pickled optimizer state")
    state = {"shards": checkpoint.sign_shards(ckpt / "deepspeed")}
    assert checkpoint.shard_problem(ckpt, state) is None
    assert "no signature" in checkpoint.shard_problem(ckpt, {})
    forged = {"shards": {**state["shards"], "hmac": "0" * 64}}
    assert "not signed with this user's key" in checkpoint.shard_problem(ckpt, forged)
    shard.write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")  # swapped after signing
    assert "mp_rank_00_model_states.pt" in checkpoint.shard_problem(ckpt, state)
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "another-user"))
    shard.write_bytes(b"pickled optimizer state")
    assert "not signed with this user's key" in checkpoint.shard_problem(ckpt, state)


def test_eval_settings_reuse_the_run_and_fit_the_target():
    from eval.saved import eval_settings, fit_to_context, parse_overrides

    defaults = {"prompts": None, "num_prompts": 20, "prompt_tokens": 128, "max_new_tokens": 96, "num_draft": 4}
    run = {"training": {"eval": {**defaults, "num_prompts": 3, "prompt_tokens": 48, "max_new_tokens": 32}}}
    assert eval_settings(defaults, run, parse_overrides([]), 128)["prompt_tokens"] == 48
    given = eval_settings({**defaults, "max_new_tokens": 40}, run, parse_overrides(["eval.max_new_tokens=40"]), 128)
    assert (given["prompt_tokens"], given["max_new_tokens"]) == (48, 40)  # the command line wins
    fitted = fit_to_context(defaults, 128)
    assert fitted["prompt_tokens"] + fitted["max_new_tokens"] + 4 == 128 and fitted["max_new_tokens"] >= 40
    assert fit_to_context(defaults, 128, {"prompt_tokens", "max_new_tokens"}) == defaults  # the user's choice
    assert fit_to_context(defaults, 128, {"max_new_tokens"})["prompt_tokens"] == 28


def test_eval_prompts_from_a_file_are_cut_to_prompt_tokens():
    from eval.run import cut_prompt

    class Tok:
        bos_token_id = 1

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [1, 9] if add_special_tokens else [9]}

    assert cut_prompt([1, *range(10, 30)], 8, Tok()) == [1, 23, 24, 25, 26, 27, 28, 29]
    assert cut_prompt([5, 6, 7], 8, Tok()) == [5, 6, 7]
    assert cut_prompt(list(range(10, 30)), 4, None) == [26, 27, 28, 29]


# --- one clear line instead of a raw traceback ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.txt", "dir"])
def test_non_utf8_data_names_the_file_and_the_fix(tmp_path, name):
    path = tmp_path / name
    target = path / "a.txt" if name == "dir" else path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes('{"text": "café"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=f"data.path: {target} is not UTF-8 text .*iconv"):
        load_records(DataConfig(source="file", path=str(path)))


def test_a_turn_that_is_a_string_is_named():
    from distill.chat import normalize_messages

    with pytest.raises(ValueError, match="record 3 turn 0 is a str .*expected an object"):
        normalize_messages({"conversations": ["hello", "hi"]}, 3)


@pytest.mark.parametrize("damage", ["truncated", "random"])
def test_damaged_drafter_weights_are_one_clear_error(tiny_teacher, tmp_path, damage):
    path = saved_medusa(tiny_teacher, tmp_path / "d")
    weights = path / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:200] if damage == "truncated" else bytes(range(256)) * 8)
    with pytest.raises(ValueError, match=f"{WEIGHTS} is not a readable safetensors file .*damaged"):
        load_saved_drafter(path)


def test_damaged_checkpoint_files_are_one_clear_error(tiny_teacher, tmp_path):
    cfg = make_cfg()
    with pytest.raises(Killed):
        run(tiny_teacher, tmp_path, cfg, DyingEngine(cfg.trainer, die_at=4))
    weights = tmp_path / "checkpoints" / "step_0000003" / "drafter" / WEIGHTS
    intact = weights.read_bytes()
    weights.write_bytes(intact[:300])
    with pytest.raises(RuntimeError, match=f"step_0000003 is unreadable .*delete that step_"):
        run(tiny_teacher, tmp_path, cfg)
    weights.write_bytes(intact)
    config = tmp_path / "checkpoints" / "step_0000003" / "drafter" / "config.json"
    config.write_text('{"format": "specdraft-drafter", "drafter": ')
    with pytest.raises(ValueError, match="config.json is damaged"):
        run(tiny_teacher, tmp_path, cfg)
    config.unlink()
    (tmp_path / "checkpoints" / "latest").write_bytes(b"\x00\xffnot a step")
    with pytest.raises(ValueError, match="latest holds .*not a checkpoint name"):
        run(tiny_teacher, tmp_path, cfg)


def _flip_last_byte(path: Path) -> bytes:
    """Damage ``path`` in place, same size, still parseable (the last byte of tensor data); returns the original."""
    intact = path.read_bytes()
    path.write_bytes(intact[:-1] + bytes([intact[-1] ^ 1]))
    return intact


def test_tensor_files_are_checked_against_the_digest_written_beside_them(tiny_teacher, tmp_path, monkeypatch, caplog):
    import distill.fingerprint
    from distill.fingerprint import file_digest

    path = saved_medusa(tiny_teacher, tmp_path / "d")
    recorded = path / f"{WEIGHTS}.sha256"
    assert recorded.read_text() == f"{file_digest(path / WEIGHTS)}  {WEIGHTS}\n"  # sha256sum -c reads it too
    intact = _flip_last_byte(path / WEIGHTS)
    with pytest.raises(ValueError, match=rf"^\S+/{WEIGHTS} is damaged: its sha256 .*copy it again[^\n]*$"):
        load_saved_drafter(path)
    (path / WEIGHTS).write_bytes(intact)
    load_saved_drafter(path)
    recorded.unlink()  # a drafter saved before digests were recorded: loaded, one warning per process
    monkeypatch.setattr(distill.fingerprint, "_unchecked_warned", [])
    load_saved_drafter(path)
    load_saved_drafter(path)
    assert sum("no model.safetensors.sha256" in r.getMessage() for r in caplog.records) == 1


def test_damaged_checkpoint_files_are_refused_by_their_digests(tiny_teacher, tmp_path):
    cfg = make_cfg()
    with pytest.raises(Killed):
        run(tiny_teacher, tmp_path, cfg, DyingEngine(cfg.trainer, die_at=4))
    step = tmp_path / "checkpoints" / "step_0000003"
    for name in ("trainer_state.pt", "optimizer.pt", f"drafter/{WEIGHTS}"):
        assert (step / f"{name}.sha256").is_file(), name
    _flip_last_byte(step / "optimizer.pt")  # the zip's end record: torch still reads it
    with pytest.raises(ValueError, match=r"optimizer.pt is damaged: its sha256 "):
        run(tiny_teacher, tmp_path, cfg)


def test_non_finite_drafter_weights_are_refused_at_eval_and_export(tiny_teacher, tmp_path):
    from distill.atomic import save_tensors
    from distill.fingerprint import write_digest

    path = saved_medusa(tiny_teacher, tmp_path / "d")
    state = load_file_as_dict(path / WEIGHTS)
    name = next(iter(state))
    state[name][0] = float("nan")  # as a copy from a diverged run's file would hold
    save_tensors(state, path / WEIGHTS, metadata={"format": "specdraft-drafter"})
    write_digest(path / WEIGHTS)
    with pytest.raises(ValueError, match=rf"{WEIGHTS} holds NaN or inf in 1 tensor\(s\) \(first: {name}\)"):
        load_drafter(path, tiny_teacher)  # what python -m eval loads
    from serve.export import export_drafter

    with pytest.raises(ValueError, match="holds NaN or inf"):
        export_drafter(path, "vllm", tmp_path / "export")
    assert not (tmp_path / "export").exists()


def load_file_as_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return dict(load_file(str(path)))


def _end_a_blocked_read(fifo: Path) -> None:
    """Give a reader stuck on ``fifo`` an end of file within seconds, so a read that should never start fails the
    test instead of hanging it."""
    import os
    import threading

    def writer():
        for _ in range(300):
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # succeeds once a reader has it open
                return
            except OSError:
                time.sleep(0.01)

    threading.Thread(target=writer, daemon=True).start()


def test_data_paths_that_never_end_are_refused_naming_the_key(tmp_path):
    import os

    from distill.data import load_records
    from distill.prompts import prompts_from_file
    from distill.regenerate import load_regenerated

    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    for value in (fifo, "/dev/zero"):
        _end_a_blocked_read(fifo)
        with pytest.raises(ValueError, match=rf"^data.path={value}: \S+ is a (named pipe|character device).* "
                                             rf"point data.path at a regular file"):
            load_records(DataConfig(source="file", path=str(value)))
    with pytest.raises(ValueError, match=rf"^data.regenerated={fifo}: .* named pipe"):
        load_regenerated(fifo, None, DataConfig())
    with pytest.raises(ValueError, match=r"^eval.prompts=/dev/zero: .* character device"):
        prompts_from_file("/dev/zero", None, 1)


def test_tilde_paths_are_expanded_once_for_every_path_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=[
            "data.path='~/d.jsonl'", "regenerate.out='~/r.jsonl'", "cache.dir='~/c'", "eval.prompts='~/q.jsonl'",
            "drafter_path='~/run/drafter'", "data.mode=regenerated", "data.regenerated='~/r.jsonl'",
            "target.cache_dir='~/toy'"]))  # quoted:
    # Hydra's grammar takes no bare ~
    assert cfg.data.path == f"{tmp_path}/d.jsonl" and cfg.regenerate.out == f"{tmp_path}/r.jsonl"
    assert cfg.cache.dir == f"{tmp_path}/c" and cfg.eval.prompts == f"{tmp_path}/q.jsonl"
    assert cfg.drafter_path == f"{tmp_path}/run/drafter" and cfg.target.cache_dir == f"{tmp_path}/toy"
    from scripts.export import parse

    args = parse(["drafter_path='~/run/drafter'", "format=vllm", "output_dir='~/exports/a'"])
    assert (args.drafter_path, args.output_dir) == (f"{tmp_path}/run/drafter", f"{tmp_path}/exports/a")


def _chat_file(path: Path, turns) -> str:
    path.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in t]}) + "\n" for t in turns))
    return str(path)


def test_chat_data_on_a_tokenizer_without_a_chat_template_warns_once(tmp_path, monkeypatch, caplog):
    import distill.chat
    from distill.data import build_train_dataset
    from tests.test_regenerate import make_tokenizer

    monkeypatch.setattr(distill.chat, "_warned_plain", [])
    chat = _chat_file(tmp_path / "chat.jsonl", [[("user", "w1 w2"), ("assistant", "w3 w4 w5")]] * 4)
    cfg = DataConfig(source="file", path=chat, max_length=16, packing=False)
    for _ in range(2):
        build_train_dataset(cfg, make_tokenizer())
    warned = [r.getMessage() for r in caplog.records if "has no chat template" in r.getMessage()]
    assert len(warned) == 1 and "data.chat_template=none" in warned[0]
    caplog.clear()
    monkeypatch.setattr(distill.chat, "_warned_plain", [])
    build_train_dataset(replace(cfg, chat_template="none"), make_tokenizer())  # chosen: nothing to warn about
    assert not [r for r in caplog.records if "has no chat template" in r.getMessage()]


def test_chat_data_without_an_assistant_turn_says_so(tmp_path):
    from distill.data import build_train_dataset
    from tests.test_regenerate import make_tokenizer

    chat = _chat_file(tmp_path / "chat.jsonl", [[("user", "w1 w2 w3")], [("system", "w4"), ("user", "w5")]])
    with pytest.raises(ValueError, match="the data has no assistant turn") as err:
        build_train_dataset(DataConfig(source="file", path=chat, max_length=16, packing=False), make_tokenizer())
    assert "raise data.max_length" not in str(err.value)


def test_context_overflow_advice_includes_num_draft():
    from inference.generation import check_prompt

    with pytest.raises(ValueError, match="eval.num_draft"):
        check_prompt(torch.ones(1, 10, dtype=torch.long), 10, 200, 128)

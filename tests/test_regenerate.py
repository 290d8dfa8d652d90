"""Regenerated data (distill.regenerate): prompts are cut from the training rows, greedy answers are the target's own
continuation, interrupted runs resume to the same bytes, a changed config is refused, and the jsonl loads back into
rows whose loss covers the answers."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from distill.regenerate import load_regenerated, meta_path, prompts_from_data
from distill.regenerate.__main__ import regenerate
from distill.teacher import Teacher
from distill.regenerate.engines import BatchedEngine, HFGenerateEngine

ROOT = Path(__file__).resolve().parents[1]
USER, ASSISTANT = 3, 4  # ids of "user:" and "assistant:", the plain chat rendering's role markers
WORDS = ["<unk>", "<eos>", "<pad>", "user:", "assistant:", "system:"] + [f"w{i}" for i in range(122)]  # 128 ids
MAX_LENGTH, PROMPT_TOKENS = 24, 8


def make_tokenizer(words=WORDS) -> PreTrainedTokenizerFast:
    """Whitespace-separated words, one id each (no hub download); no chat template, like the toy target."""
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def make_teacher(tokenizer, seed: int = 0) -> Teacher:
    # Untied embeddings: the tied tiny Llama greedily repeats its last token, too weak a check of the decode.
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=False)
    return Teacher(LlamaForCausalLM(config), tokenizer, name="tiny-untied")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(122)}" for _ in range(n))


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(_words(random.Random(0), 300))  # packed into 12 rows of 24
    return path


@pytest.fixture
def chat_file(tmp_path) -> Path:
    rng = random.Random(1)
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": _words(rng, rng.randrange(2, 9))},
                          {"role": "assistant", "content": _words(rng, rng.randrange(3, 9))}]} for _ in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def text_data(path: Path) -> list[str]:
    return ["data.source=file", f"data.path={path}", f"data.max_length={MAX_LENGTH}"]


def chat_data(path: Path) -> list[str]:
    return [*text_data(path), "data.packing=false"]


def compose(data: list[str], out: Path | None, **settings):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from train.config import load_config, register_configs

    register_configs()
    overrides = ["target=tiny", "trainer.device=cpu", *data, f"regenerate.prompt_tokens={PROMPT_TOKENS}",
                 "regenerate.batch_size=3", "regenerate.num_prompts=7"]
    overrides += [f"regenerate.out={out}"] if out is not None else []
    overrides += [f"regenerate.{k}={v}" for k, v in settings.items()]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return load_config(hydra_compose(config_name="config", overrides=overrides))


@pytest.fixture
def teacher(monkeypatch) -> Teacher:
    """The target every ``regenerate(cfg)`` of the test loads."""
    teacher = make_teacher(make_tokenizer())
    monkeypatch.setattr("distill.regenerate.__main__.load_teacher",
                        lambda target_cfg, device="cpu", placement="none": teacher)
    return teacher


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class Interrupted(Exception):
    """A stand-in for a crash or Ctrl-C in the middle of a run."""


def count_decodes(monkeypatch, fail_on: int | None = None) -> list[int]:
    """Record each batch decode's prompt count, whichever engine answers it; with ``fail_on``, raise once, at that
    decode (1-based)."""
    calls, failed = [], []
    for engine in (BatchedEngine, HFGenerateEngine):
        def wrapped(self, prompts, max_new_tokens, seed, generate=engine.generate):
            calls.append(len(prompts))
            if len(calls) == fail_on and not failed:
                failed.append(True)
                raise Interrupted(f"decode {fail_on}")
            return generate(self, prompts, max_new_tokens, seed)

        monkeypatch.setattr(engine, "generate", wrapped)
    return calls


def test_prompts_are_the_user_turn_of_chat_rows_and_the_first_tokens_of_text_rows(text_file, chat_file):
    tokenizer = make_tokenizer()
    cfg = compose(chat_data(chat_file), None)
    chat = prompts_from_data(cfg.data, tokenizer, PROMPT_TOKENS)
    assert len(chat) == 6
    for p in chat:  # "user: ... assistant:" with no loss: the answer starts right after it
        assert p.ids[0] == USER and p.ids[-1] == ASSISTANT and ASSISTANT not in p.ids[:-1]
        assert not any(p.loss_mask) and len(p.loss_mask) == len(p.ids)
    cfg = compose(text_data(text_file), None)
    text = prompts_from_data(cfg.data, tokenizer, PROMPT_TOKENS, num_prompts=5)
    first_words = tokenizer(text_file.read_text(), add_special_tokens=False)["input_ids"]
    assert len(text) == 5 and text[0].ids == first_words[:PROMPT_TOKENS]
    assert text[1].ids == first_words[MAX_LENGTH : MAX_LENGTH + PROMPT_TOKENS]  # row 1 of the packed rows
    assert all(len(p.ids) == PROMPT_TOKENS and all(p.loss_mask) for p in text)
    with pytest.raises(ValueError, match=r"none of the 12 training rows leaves room .* lower regenerate.prompt_tokens"):
        prompts_from_data(cfg.data, tokenizer, MAX_LENGTH)
    short = text_file.with_name("short.jsonl")  # padded rows: one document is all prompt, nothing to answer
    short.write_text("".join(json.dumps({"text": _words(random.Random(n), n)}) + "\n" for n in (12, 5, 9)))
    padded = prompts_from_data(compose(chat_data(short), None).data, tokenizer, PROMPT_TOKENS)
    assert [len(p.ids) for p in padded] == [PROMPT_TOKENS, PROMPT_TOKENS]  # 5 words + EOS skipped; 9 + EOS kept


def greedy_continuation(model, ids: list[int], max_new: int, eos: int | None) -> list[int]:
    """The reference: one full forward per token, argmax, no cache, no batching."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(max_new):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
            if out[-1] == eos:
                break
    return out[len(ids):]


def test_greedy_answers_are_the_targets_own_continuation(chat_file, teacher, tmp_path):
    cfg = compose(chat_data(chat_file), tmp_path / "regen.jsonl", batch_size=2)
    prompts = prompts_from_data(cfg.data, teacher.tokenizer, PROMPT_TOKENS)
    # Each batch answers within data.max_length - its longest prompt: left padding is exercised.
    budgets = [MAX_LENGTH - max(len(p.ids) for p in prompts[i : i + 2]) for i in range(0, len(prompts), 2)]
    # An EOS the target actually emits (its third greedy token for prompt 0), so answers end both ways.
    eos = greedy_continuation(teacher.model, prompts[0].ids, 3, None)[-1]
    teacher.tokenizer.eos_token = teacher.tokenizer.convert_ids_to_tokens(eos)
    assert prompts_from_data(cfg.data, teacher.tokenizer, PROMPT_TOKENS) == prompts  # the EOS only ends rows
    records = read(regenerate(cfg))
    assert [r["id"] for r in records] == list(range(len(prompts)))
    for i, (r, p) in enumerate(zip(records, prompts)):
        expected = greedy_continuation(teacher.model, p.ids, budgets[i // 2], eos)
        assert r["prompt_ids"] == p.ids and r["prompt_loss_mask"] == p.loss_mask
        assert r["completion_ids"] == expected, f"prompt {i}"
        assert r["finish"] == ("eos" if expected[-1] == eos else "length")
        assert len(p.ids) + len(expected) <= MAX_LENGTH
        assert r["prompt"] == teacher.tokenizer.decode(p.ids) and r["completion"] == teacher.tokenizer.decode(expected)
    assert records[0]["finish"] == "eos" and len(records[0]["completion_ids"]) <= 3
    meta = json.loads(meta_path(tmp_path / "regen.jsonl").read_text())
    assert meta["target"] == teacher.identity() and meta["target_weights"] == teacher.weights_digest()
    assert meta["tokenizer_vocab_size"] == 128 and meta["data"]["packing"] is False
    assert meta["regenerate"]["batch_size"] == 2 and "out" not in meta["regenerate"]


def test_auto_engine_resolves_per_device_and_the_sidecar_records_the_engine_that_ran(text_file, teacher, tmp_path,
                                                                                     monkeypatch):
    from distill.regenerate import engines

    assert engines.resolve_engine("auto", "cpu") == engines.FASTEST["cpu"] == "batched"
    assert engines.resolve_engine("batched", "cuda") == "batched"
    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda name: None)  # no vLLM installed
    assert engines.resolve_engine("auto", "cuda") == "hf"
    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda name: object())  # vLLM installed
    assert engines.resolve_engine("auto", "cuda") == "vllm"
    assert engines.resolve_engine("auto", "cuda", shard="tensor") == "hf"  # vLLM places the model itself
    assert engines.resolve_engine("auto", "cuda", named=False) == "hf"  # a toy target: nothing vLLM could load
    assert engines.resolve_engine("auto", "cpu") == "batched"
    with pytest.raises(ValueError, match=r"regenerate.engine='fast'; valid: \['auto', 'batched', 'hf', 'vllm'\]"):
        engines.resolve_engine("fast", "cpu")
    out = regenerate(compose(text_data(text_file), tmp_path / "auto.jsonl", num_prompts=3))
    assert json.loads(meta_path(out).read_text())["regenerate"]["engine"] == "batched"
    same = regenerate(compose(text_data(text_file), tmp_path / "batched.jsonl", num_prompts=3, engine="batched"))
    assert out.read_bytes() == same.read_bytes() and meta_path(out).read_bytes() == meta_path(same).read_bytes()


def test_answer_budget_fills_max_length_within_the_targets_context(text_file, teacher, tmp_path):
    def lengths(out, **settings):
        return {len(r["completion_ids"]) for r in read(regenerate(compose(text_data(text_file), out, **settings)))}

    assert lengths(tmp_path / "a.jsonl") == {MAX_LENGTH - PROMPT_TOKENS}  # EOS is never emitted by this target
    assert lengths(tmp_path / "b.jsonl", max_new_tokens=5) == {5}
    teacher.max_positions = 20
    assert lengths(tmp_path / "c.jsonl") == {20 - PROMPT_TOKENS}


def test_interrupted_sampling_run_resumes_to_identical_bytes(text_file, teacher, tmp_path, monkeypatch):
    full = regenerate(compose(text_data(text_file), tmp_path / "full.jsonl", temperature=1.0))
    out = tmp_path / "resumed.jsonl"
    calls = count_decodes(monkeypatch, fail_on=2)
    with pytest.raises(Interrupted):
        regenerate(compose(text_data(text_file), out, temperature=1.0))
    assert len(read(out)) == 3 and meta_path(out).is_file()  # the first batch, fsynced
    calls.clear()
    regenerate(compose(text_data(text_file), out, temperature=1.0))
    assert calls == [3, 1]  # batches 1 and 2 only
    assert out.read_bytes() == full.read_bytes()
    assert meta_path(out).read_bytes() == meta_path(full).read_bytes()
    calls.clear()
    regenerate(compose(text_data(text_file), out, temperature=1.0))  # complete: nothing to do
    assert calls == [] and out.read_bytes() == full.read_bytes()


def test_cut_off_last_line_is_dropped_with_its_batch_on_resume(text_file, teacher, tmp_path, monkeypatch):
    out = regenerate(compose(text_data(text_file), tmp_path / "regen.jsonl", temperature=1.0))
    full = out.read_bytes()
    lines = full.splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:4]) + lines[4][:10])  # batch 1 (ids 3..5) cut off inside id 4
    calls = count_decodes(monkeypatch)
    regenerate(compose(text_data(text_file), out, temperature=1.0))
    assert calls == [3, 1] and out.read_bytes() == full  # id 3 decoded again with its batch's seed
    out.write_bytes(b"".join(lines[:2]) + b"not json\n" + b"".join(lines[3:]))
    with pytest.raises(ValueError, match=r"line 3 is not the record with id 2 .* delete the file"):
        regenerate(compose(text_data(text_file), out, temperature=1.0))


def test_another_config_is_refused_naming_what_differs(text_file, teacher, tmp_path, monkeypatch):
    out = tmp_path / "regen.jsonl"
    regenerate(compose(text_data(text_file), out, num_prompts=3))
    with pytest.raises(ValueError, match=r"differs: regenerate.temperature \(file 0.0, now 0.5\)\); delete"):
        regenerate(compose(text_data(text_file), out, num_prompts=3, temperature=0.5))
    with pytest.raises(ValueError, match=r"differs: data.max_length \(file 24, now 20\)"):
        regenerate(compose([*text_data(text_file), "data.max_length=20"], out, num_prompts=3))
    other = make_teacher(teacher.tokenizer, seed=1)
    monkeypatch.setattr("distill.regenerate.__main__.load_teacher",
                        lambda target_cfg, device="cpu", placement="none": other)
    with pytest.raises(ValueError, match=r"differs: target_weights \(file '[0-9a-f]+', now '[0-9a-f]+'\)"):
        regenerate(compose(text_data(text_file), out, num_prompts=3))
    meta_path(out).unlink()
    with pytest.raises(ValueError, match=r"exists without its regen.jsonl.meta.json"):
        regenerate(compose(text_data(text_file), out, num_prompts=3))


def test_resuming_after_the_data_file_changed_is_refused_naming_it(text_file, teacher, tmp_path, monkeypatch):
    out = tmp_path / "regen.jsonl"
    calls = count_decodes(monkeypatch, fail_on=2)
    with pytest.raises(Interrupted):
        regenerate(compose(text_data(text_file), out))
    written = out.read_bytes()
    text_file.write_text(_words(random.Random(5), 300))  # edited in place: same path, same size class
    with pytest.raises(ValueError, match=rf"answers other prompts than data.path={text_file} .*regenerate.out=<new"):
        regenerate(compose(text_data(text_file), out))
    assert out.read_bytes() == written and len(calls) == 2  # nothing decoded, nothing appended


def test_data_mode_regenerate_answers_an_edited_data_file_anew(text_file, teacher, tmp_path):
    """``data.mode=regenerate`` keeps its answers under a key of the prompts' content: the same data reuses them, a
    data file edited at the same path gets answers of its own, never the stale ones."""
    from train.run import regenerate_first

    def regenerated() -> tuple[Path, list[list[int]]]:
        cfg = compose([*text_data(text_file), "data.mode=regenerate", f"target.cache_dir={tmp_path / 'c'}"], None)
        path = regenerate_first(cfg, teacher)
        expected = [p.ids for p in prompts_from_data(cfg.data, teacher.tokenizer, PROMPT_TOKENS, 7)]
        assert [r["prompt_ids"] for r in read(path)] == expected  # answers to this data's prompts
        return path, path.stat().st_mtime_ns

    first, written = regenerated()
    assert regenerated() == (first, written)  # reused, not rewritten
    text_file.write_text(_words(random.Random(5), 300))
    edited, _ = regenerated()
    assert edited != first and first.stat().st_mtime_ns == written


def test_sampled_answers_are_reproducible_from_the_seed(text_file, teacher, tmp_path):
    def run(name, seed):
        return regenerate(compose(text_data(text_file), tmp_path / name, temperature=1.0, top_p=0.9, seed=seed))

    a, b, c = run("a.jsonl", 3), run("b.jsonl", 3), run("c.jsonl", 4)
    assert a.read_bytes() == b.read_bytes()
    assert [r["completion_ids"] for r in read(a)] != [r["completion_ids"] for r in read(c)]
    greedy = read(regenerate(compose(text_data(text_file), tmp_path / "greedy.jsonl")))
    assert [r["completion_ids"] for r in read(a)] != [r["completion_ids"] for r in greedy]


def test_out_is_required(text_file, teacher):
    with pytest.raises(ValueError, match=r"regenerate.out is required: python -m distill.regenerate "
                                         r"regenerate.out=<file.jsonl>"):
        regenerate(compose(text_data(text_file), None))


def test_loaded_rows_train_on_the_answers_not_the_chat_prompts(chat_file, teacher, tmp_path):
    cfg = compose(chat_data(chat_file), tmp_path / "regen.jsonl")
    records = read(regenerate(cfg))
    rows = load_regenerated(cfg.regenerate.out, teacher.tokenizer, cfg.data, teacher=teacher)
    assert len(rows) == len(records) == 6
    for row, r in enumerate(records):
        p, c = len(r["prompt_ids"]), len(r["completion_ids"])
        assert rows.input_ids[row, : p + c].tolist() == r["prompt_ids"] + r["completion_ids"]
        assert not rows.loss_mask[row, :p].any() and rows.loss_mask[row, p : p + c].all()
        assert not rows.loss_mask[row, p + c :].any() and rows.attention_mask[row].sum() == p + c
        assert (rows.input_ids[row, p + c :] == teacher.tokenizer.pad_token_id).all()


def test_packed_text_rows_separate_answers_with_an_eos_that_carries_no_loss(text_file, teacher, tmp_path):
    cfg = compose(text_data(text_file), tmp_path / "regen.jsonl")
    records = read(regenerate(cfg))
    assert {r["finish"] for r in records} == {"length"}
    rows = load_regenerated(cfg.regenerate.out, teacher.tokenizer, cfg.data)
    eos = teacher.tokenizer.eos_token_id
    stream = [t for r in records for t in (*r["prompt_ids"], *r["completion_ids"], eos)]
    masks = [m for r in records for m in (*r["prompt_loss_mask"], *[True] * len(r["completion_ids"]), False)]
    assert len(rows) == len(stream) // MAX_LENGTH == 7  # each record is exactly one row + its separator
    assert rows.input_ids.reshape(-1).tolist() == stream[: len(rows) * MAX_LENGTH]
    assert rows.loss_mask.reshape(-1).tolist() == masks[: len(rows) * MAX_LENGTH]
    assert bool(rows.attention_mask.all())


def test_load_errors_name_the_file_line_and_fix(text_file, teacher, tmp_path):
    tokenizer = teacher.tokenizer
    cfg = compose(text_data(text_file), tmp_path / "regen.jsonl", num_prompts=3)
    with pytest.raises(FileNotFoundError, match=r"data.regenerated=.*regen.jsonl does not exist; write it with "
                                                 r"`python -m distill.regenerate regenerate.out="):
        load_regenerated(cfg.regenerate.out, tokenizer, cfg.data)
    out = regenerate(cfg)
    good = out.read_text().splitlines(keepends=True)
    out.write_text(good[0] + '{"id": 1, "prompt_ids": [5\n' + good[2])
    with pytest.raises(ValueError, match=r"regen.jsonl line 2 is not valid JSON"):
        load_regenerated(out, tokenizer, cfg.data)
    record = json.loads(good[1])
    del record["completion_ids"], record["finish"]
    out.write_text(good[0] + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=r"line 2 lacks \['completion_ids', 'finish'\]"):
        load_regenerated(out, tokenizer, cfg.data)
    out.write_text("".join(good))
    assert len(load_regenerated(out, tokenizer, cfg.data, teacher=teacher)) > 0
    shuffled = make_tokenizer(WORDS[:6] + WORDS[6:][::-1])  # same size, other ids
    with pytest.raises(ValueError, match=r"generated with a different tokenizer_sha256 \(differs\); regenerate it"):
        load_regenerated(out, shuffled, cfg.data)
    with pytest.raises(ValueError, match=r"different target_weights \(file '[0-9a-f]+'"):
        load_regenerated(out, tokenizer, cfg.data, teacher=make_teacher(tokenizer, seed=1))


def test_cli_writes_answers_of_the_configured_target(tmp_path, tiny_toy_target):
    """``python -m distill.regenerate`` end to end on the tiny toy target (the session's, in its SPECDRAFT_CACHE)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = tmp_path / "regen.jsonl"
    command = [sys.executable, "-m", "distill.regenerate", "target=tiny", "trainer.device=cpu", "data.max_length=32",
               "data.corpus_max_bytes=20000", "regenerate.prompt_tokens=12", "regenerate.num_prompts=4",
               f"regenerate.out={out}", f"hydra.run.dir={tmp_path / 'hydra'}"]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = read(out)
    assert [r["id"] for r in records] == [0, 1, 2, 3]
    assert all(len(r["prompt_ids"]) == 12 and len(r["prompt_ids"]) + len(r["completion_ids"]) <= 32 for r in records)
    meta = json.loads(meta_path(out).read_text())
    assert meta["target"]["name"] == "specdraft/tiny-stdlib" and meta["data"]["source"] == "stdlib"

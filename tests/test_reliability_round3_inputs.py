"""Inputs a user may give that once met a raw traceback, a silent skip or an unbounded read: a directory of jsonl
shards as ``data.path``, records and batch sizes without bounds, path names near the file-name limit, command lines
Hydra's grammar cannot read and a run dir naming an unset environment variable. One test per case of
docs/reliability.md, unit-level (seconds each)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict

import pytest

from distill.data import DataConfig, load_records, source_fingerprint
from distill.environment import check_run_dir_override
from distill.lock import lock_file_for, writer_lock
from tests.test_reliability_cluster import ROOT, holder  # noqa: F401 (fixture)


def _export_script():
    spec = importlib.util.spec_from_file_location("export_script", ROOT / "scripts" / "export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- names near the limit, arguments Hydra cannot read, unset variables ------------------------------------------


def test_a_run_dir_name_near_the_file_name_limit_is_locked_and_a_longer_one_is_one_line(tmp_path, holder):
    legal = tmp_path / ("r" * 250)  # 250 bytes: a legal name, whose ".<name>.lock" would be 256
    check_run_dir_override([f"hydra.run.dir={legal}"])
    lock = lock_file_for(legal)
    assert lock.is_file() and lock.parent == tmp_path and len(lock.name.encode()) <= 255
    assert lock_file_for(tmp_path / ("r" * 249 + "s")) != lock  # two long names never share one lock
    other = tmp_path / ("q" * 250)
    held = holder(other)  # and a shortened lock still keeps a second writer out
    with pytest.raises(RuntimeError, match=f"pid {held.pid}"):
        with writer_lock(other, "hydra.run.dir"):
            pass
    too_long = tmp_path / ("x" * 300)
    with pytest.raises(SystemExit, match=r"^error: hydra.run.dir=.*: the name x+\.\.\. is 300 bytes, longer than the "
                                         r"255 a file name may have; choose a shorter hydra.run.dir$"):
        check_run_dir_override([f"hydra.run.dir={too_long}"])


def test_a_run_dir_naming_an_unset_environment_variable_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDRAFT_TEST_UNSET", raising=False)
    with pytest.raises(SystemExit, match=r"^error: hydra.run.dir=.*task_\$\{oc.env:SPECDRAFT_TEST_UNSET\} reads the "
                                         r"environment variable SPECDRAFT_TEST_UNSET, which is not set; set it"):
        check_run_dir_override([f"hydra.run.dir={tmp_path}/task_${{oc.env:SPECDRAFT_TEST_UNSET}}"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, match", [
    (["drafter_path=d", "format=vllm", "output_dir=/tmp/my", "dir"],
     r"^error: argument 'dir' after 'output_dir=/tmp/my' is not key=value; a value holding a space must be quoted"),
    (["drafter_path=d", "format=vllm", "output_dir=o", "--overwite"],
     r"^error: unknown flag '--overwite' \(did you mean --overwrite\?\)"),
    (["drafter_path=d", "format=vllm", "output_dir=o", "overwrit=true"],
     r"^unknown argument in .*Key 'overwrit' not in 'ExportConfig'"),
])
def test_export_arguments_hydra_cannot_read_are_one_line_naming_them(argv, match):
    with pytest.raises(SystemExit, match=match) as refused:
        _export_script().parse(argv)
    assert "\n" not in str(refused.value)


# --- a directory of jsonl shards ----------------------------------------------------------------------------------


def _chat(i: int) -> dict:
    return {"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}]}


def test_a_directory_of_jsonl_shards_is_read_in_sorted_order_and_digested(tmp_path):
    shards = tmp_path / "chats"
    shards.mkdir()
    for part, ids in ((1, range(3, 6)), (0, range(3))):  # written out of order: read in sorted order
        (shards / f"part-{part:05d}.jsonl").write_text("".join(json.dumps(_chat(i)) + "\n" for i in ids))
    (shards / "README.md").write_text("# my chats\n")  # neither records nor text: not read
    cfg = DataConfig(source="file", path=str(shards), format="sharegpt")
    assert load_records(cfg) == [_chat(i) for i in range(6)]
    digest = source_fingerprint(cfg)
    (shards / "part-00001.jsonl").write_text(json.dumps(_chat(9)) + "\n")  # one shard edited: another digest
    assert source_fingerprint(cfg) != digest
    (shards / "README.txt").write_text("about these chats")  # a text file among the shards: never trained on
    with pytest.raises(ValueError, match=rf"^data.path={shards} holds both record files \(part-00000.jsonl, "
                                         r"part-00001.jsonl\) and text files \(README.txt\); a directory is read as "
                                         r"one kind"):
        load_records(cfg)


# --- records and batches without bounds ---------------------------------------------------------------------------


class SeenTokenizer:
    """A tokenizer that records the longest text it is handed in one call (the rest is the real one's)."""

    def __init__(self, tokenizer):
        self._tokenizer, self.longest = tokenizer, 0

    def __call__(self, text, *args, **kwargs):
        texts = [text] if isinstance(text, str) else text
        self.longest = max([self.longest, *map(len, texts)])
        return self._tokenizer(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.mark.parametrize("packing", [False, True])
def test_a_record_of_megabytes_is_cut_or_sliced_before_it_is_tokenised(tmp_path, packing):
    from distill.data import build_train_dataset
    from tests.test_regenerate import make_tokenizer

    words = " ".join(f"w{i % 100}" for i in range(1_200_000))  # one 4.6 MB line
    data = tmp_path / "huge.jsonl"
    data.write_text(json.dumps({"text": words}) + "\n" + json.dumps(_chat(0)) + "\n")
    tokenizer = SeenTokenizer(make_tokenizer())
    cfg = DataConfig(source="file", path=str(data), max_length=32, packing=packing, chat_template="none")
    rows = build_train_dataset(cfg, tokenizer)
    whole = make_tokenizer()(words[:2000], add_special_tokens=False)["input_ids"]
    if packing:  # every token is kept, tokenised a bounded slice at a time
        assert tokenizer.longest <= 1 << 20 and len(rows) == 1_200_000 // 32  # a slice: at most a MiB of text
        assert rows.input_ids[0].tolist() == whole[:32]
    else:  # one row of data.max_length tokens: the text past a few times that is never tokenised
        assert tokenizer.longest <= 16 * 32 * 8
        assert rows.input_ids[0].tolist() == whole[:32]


def test_batch_sizes_the_device_cannot_hold_are_refused_naming_the_key(tmp_path, monkeypatch, tiny_teacher):
    from distill.regenerate import Prompt, write_regenerated
    from eval.batch_sweep import batch_sweep
    from inference import batch_memory
    from train.config import RegenerateConfig
    from inference.decoder import DecoderConfig
    from train.config import EvalConfig

    monkeypatch.setattr(batch_memory, "free_bytes", lambda device: 4 << 20)  # a device with 4 MiB free
    eval_cfg = EvalConfig(prompt_tokens=16, max_new_tokens=8, num_draft=2)
    with pytest.raises(ValueError, match=r"^decoder.batch_sizes=\[1, 100000\]: a batch of 100000 rows needs at least "
                                         r".* GiB on cpu .*more than the 4.0 MiB free; use batches of at most \d+ "
                                         r"rows"):
        batch_sweep(tiny_teacher, {}, [[1, 2, 3]], eval_cfg, DecoderConfig(batch_sizes=[1, 100000]))
    batch_memory.check_batch_sizes_fit(tiny_teacher, [1, 8], None, 16, 8, 2)  # a batch that fits
    out, prompts = tmp_path / "regen.jsonl", [Prompt(ids=[1, 2, 3], loss_mask=[True] * 3)] * 40
    settings = asdict(RegenerateConfig(out=str(out), batch_size=100000, max_new_tokens=8))
    monkeypatch.setattr(batch_memory, "free_bytes", lambda device: 64 << 10)
    with pytest.raises(ValueError, match=r"^regenerate.batch_size=100000: a batch of 40 rows needs at least .* MiB "
                                         r"on cpu .*use batches of at most \d+ rows"):
        write_regenerated(out, tiny_teacher, prompts, DataConfig(max_length=32), settings)
    assert list(tmp_path.iterdir()) == []  # refused before anything is written

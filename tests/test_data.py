"""Tests for distill.data, distill.chat and distill.prompts: loading, chat masks, packing, eval prompts.

Everything runs offline on a byte-level BPE tokenizer trained here in a fraction
of a second; the stdlib corpus and the hub are replaced by small fakes.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from distill import chat, data, prompts

EOS, PAD, BOS = "<|endoftext|>", "<|pad|>", "<|begin_of_text|>"
HEADER_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Written for these tests: the shape of a Llama-3 template (BOS, role headers,
# an end-of-turn token after every message, a header-only generation prompt).
LLAMA3_LIKE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

TRAINING_TEXT = (
    "def add(a, b):\n    return a + b\n\n"
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, item):\n        self.items.append(item)\n\n"
    "The quick brown fox jumps over the lazy dog. Hello there, how are you today?\n"
    "user: assistant: system: I am fine, thank you for asking.\n"
) * 30

CONVERSATION = [
    ("system", "You are terse."),
    ("user", "What is two plus two?"),
    ("assistant", "It is four."),
    ("user", "And three plus three?"),
    ("assistant", "Six, of course."),
]


def _train_tokenizer(extra_special: list[str], chat_template: str | None = None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS, PAD, *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TRAINING_TEXT], trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)
    if chat_template is not None:
        wrapped.bos_token = BOS
        wrapped.chat_template = chat_template
    return wrapped


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """No chat template, like the toy target: chat data uses the plain rendering."""
    return _train_tokenizer([])


@pytest.fixture(scope="module")
def chat_tokenizer() -> PreTrainedTokenizerFast:
    return _train_tokenizer([BOS, *HEADER_TOKENS], chat_template=LLAMA3_LIKE_TEMPLATE)


def _write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _cfg(**overrides) -> data.DataConfig:
    return data.DataConfig(**{"source": "file", **overrides})


def _tokens(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _openai(conversation) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in conversation]}


def _sharegpt(conversation) -> dict:
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[r], "value": c} for r, c in conversation]}


def _masked_text(tok, row: dict) -> str:
    return tok.decode(row["input_ids"][row["loss_mask"]].tolist(), skip_special_tokens=False)


# --------------------------------------------------------------------------- text data


def test_text_jsonl_packing_is_the_concatenation_plus_eos(tmp_path, tokenizer):
    texts = ["def add(a, b):\n    return a + b\n", "The quick brown fox.", "class Stack:\n    pass\n"] * 5
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    ds = data.build_train_dataset(_cfg(path=path, max_length=16), tokenizer)

    stream = [t for text in texts for t in _tokens(tokenizer, text) + [tokenizer.eos_token_id]]
    assert len(ds) == len(stream) // 16  # tail remainder dropped
    batch = data.collate([ds[i] for i in range(len(ds))])
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask"}
    assert batch["input_ids"].shape == (len(ds), 16) and batch["input_ids"].dtype == torch.long
    assert batch["attention_mask"].dtype == torch.long and bool(batch["attention_mask"].all())
    assert batch["loss_mask"].dtype == torch.bool and bool(batch["loss_mask"].all())
    assert batch["input_ids"].flatten().tolist() == stream[: len(ds) * 16]


def test_padding_mode_truncates_and_masks_padding(tmp_path, tokenizer):
    texts = ["Hello there.", "The quick brown fox jumps over the lazy dog. " * 5]
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    ds = data.build_train_dataset(_cfg(path=path, max_length=24, packing=False), tokenizer)
    assert len(ds) == 2

    short = _tokens(tokenizer, texts[0]) + [tokenizer.eos_token_id]
    row = ds[0]
    n = len(short)
    assert row["input_ids"][:n].tolist() == short
    assert bool((row["input_ids"][n:] == tokenizer.pad_token_id).all())
    assert row["attention_mask"].tolist() == [1] * n + [0] * (24 - n)
    assert row["loss_mask"].tolist() == [True] * n + [False] * (24 - n)

    long = ds[1]
    assert long["input_ids"].tolist() == _tokens(tokenizer, texts[1])[:24]
    assert bool(long["attention_mask"].all()) and bool(long["loss_mask"].all())


def test_json_txt_and_directory_sources(tmp_path):
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": [{"text": "a"}, {"text": "b"}]}))
    (tmp_path / "list.json").write_text(json.dumps([{"text": "c"}]))
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.txt").write_text("second")
    (corpus / "a.py").write_text("first")
    (corpus / "sub" / "c.txt").write_text("third")
    (corpus / "skip.md").write_text("not read")

    assert data.load_records(_cfg(path=str(tmp_path / "wrapped.json"))) == [{"text": "a"}, {"text": "b"}]
    assert data.load_records(_cfg(path=str(tmp_path / "list.json"))) == [{"text": "c"}]
    assert data.load_records(_cfg(path=str(corpus / "b.txt"))) == [{"text": "second"}]
    assert data.load_records(_cfg(path=str(corpus))) == [{"text": "first"}, {"text": "second"}, {"text": "third"}]
    assert data.load_records(_cfg(path=str(corpus), max_examples=2)) == [{"text": "first"}, {"text": "second"}]


def test_stdlib_source_uses_corpus_and_omegaconf_config(monkeypatch, tokenizer):
    calls = []

    def fake_sources(split, max_bytes=None):
        calls.append((split, max_bytes))
        return [("a.py", "def add(a, b):\n    return a + b\n" * 20), ("b.py", "class Stack:\n    pass\n" * 20)]

    monkeypatch.setattr(data, "stdlib_sources", fake_sources)
    cfg = data.DataConfig(source="stdlib", max_length=32, corpus_max_bytes=1234)
    assert data.load_records(cfg)[1] == {"text": "class Stack:\n    pass\n" * 20}
    ds = data.build_train_dataset(cfg, tokenizer)
    assert len(ds) > 0 and calls[0] == ("train", 1234)


def test_hub_source_calls_load_dataset(monkeypatch):
    seen = {}

    def load_dataset(name, split):
        seen.update(name=name, split=split)
        return [{"text": "from the hub"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    records = data.load_records(data.DataConfig(source="hub", hub_name="org/set", hub_split="validation"))
    assert records == [{"text": "from the hub"}] and seen == {"name": "org/set", "split": "validation"}


# --------------------------------------------------------------------------- chat data


def test_sharegpt_and_openai_messages_normalise_alike():
    expected = [{"role": r, "content": c} for r, c in CONVERSATION]
    assert chat.normalize_messages(_sharegpt(CONVERSATION), 0) == expected
    assert chat.normalize_messages(_openai(CONVERSATION), 0) == expected


def test_unknown_role_names_role_and_record():
    record = {"conversations": [{"from": "narrator", "value": "Once upon a time"}]}
    with pytest.raises(ValueError, match=r"record 7 .*'narrator'"):
        chat.normalize_messages(record, 7)


@pytest.mark.parametrize("make_record", [_sharegpt, _openai])
def test_plain_template_masks_exactly_the_assistant_replies(tmp_path, tokenizer, make_record):
    path = _write_jsonl(tmp_path / "chat.jsonl", [make_record(CONVERSATION)])
    cfg = _cfg(path=path, max_length=128, packing=False, chat_template="none")
    row = data.build_train_dataset(cfg, tokenizer)[0]

    # The reply span starts after "assistant:", so each reply's leading space and
    # its newline end-of-turn are learnt, and nothing of the user turns is.
    replies = [c for r, c in CONVERSATION if r == "assistant"]
    assert _masked_text(tokenizer, row) == "".join(f" {c}\n" for c in replies)
    real = row["input_ids"][row["attention_mask"].bool()].tolist()
    rendered = "".join(f"{r}: {c}\n" for r, c in CONVERSATION)
    assert tokenizer.decode(real, skip_special_tokens=False) == rendered + EOS


def test_jinja_template_masks_replies_and_end_of_turn(tmp_path, chat_tokenizer):
    path = _write_jsonl(tmp_path / "chat.jsonl", [_openai(CONVERSATION)])
    cfg = _cfg(path=path, max_length=128, packing=False)
    row = data.build_train_dataset(cfg, chat_tokenizer)[0]

    replies = [c for r, c in CONVERSATION if r == "assistant"]
    assert _masked_text(chat_tokenizer, row) == "".join(f"{c}<|eot_id|>" for c in replies)
    real = row["input_ids"][row["attention_mask"].bool()].tolist()
    messages = [{"role": r, "content": c} for r, c in CONVERSATION]
    rendered = chat_tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered.startswith(BOS)  # the template's BOS, not a second one from the tokenizer
    assert chat_tokenizer.decode(real, skip_special_tokens=False) == rendered + EOS


def test_assistant_only_loss_off_trains_every_real_token(tmp_path, chat_tokenizer):
    path = _write_jsonl(tmp_path / "chat.jsonl", [_sharegpt(CONVERSATION)])
    cfg = _cfg(path=path, max_length=128, packing=False, assistant_only_loss=False)
    row = data.build_train_dataset(cfg, chat_tokenizer)[0]
    assert row["loss_mask"].tolist() == row["attention_mask"].bool().tolist()


def test_packed_chat_keeps_masks_aligned(tmp_path, tokenizer):
    records = [_openai(CONVERSATION), {"text": "The quick brown fox."}, _sharegpt(CONVERSATION)] * 4
    path = _write_jsonl(tmp_path / "mixed.jsonl", records)
    ds = data.build_train_dataset(_cfg(path=path, max_length=32, chat_template="none"), tokenizer)
    batch = data.collate([ds[i] for i in range(len(ds))])
    masked = tokenizer.decode(batch["input_ids"][batch["loss_mask"]].tolist(), skip_special_tokens=False)
    # Fox texts (with their EOS) and replies are learnt; user and system turns never are.
    assert "fox." + EOS in masked and " It is four.\n" in masked
    assert "two plus two" not in masked and "terse" not in masked


# --------------------------------------------------------------------------- errors


def test_malformed_jsonl_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl line 3"):
        data.load_records(_cfg(path=str(path)))


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ValueError, match=r"data\.path: file .*nope\.jsonl does not exist"):
        data.load_records(_cfg(path=str(missing)))


def test_empty_dataset_errors(tmp_path, tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl yielded zero records"):
        data.build_train_dataset(_cfg(path=str(empty)), tokenizer)
    blank = _write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(ValueError, match=r"blank\.jsonl tokenised to zero tokens"):
        data.build_train_dataset(_cfg(path=blank), tokenizer)


def test_record_without_text_or_conversation_lists_its_keys(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, {"question": "?", "answer": "!"}])
    with pytest.raises(ValueError, match=r"record 1 .*\['answer', 'question'\]"):
        data.build_train_dataset(_cfg(path=path), tokenizer)


def test_unknown_source_lists_valid_ones():
    with pytest.raises(ValueError, match=r"'s3'.*\('stdlib', 'file', 'hub'\)"):
        data.load_records(data.DataConfig(source="s3"))


# --------------------------------------------------------------------------- prompts


def _fake_heldout(split, max_bytes=None):
    assert split == "heldout"
    files = []
    for name in ("alpha", "beta", "gamma"):
        body = "".join(
            f"def {name}_{i}(value, other):\n    '''Return the {name} number {i}.'''\n"
            f"    return value + other * {i}\n\n\nclass {name.title()}{i}:\n    size = {i}\n\n"
            for i in range(6)
        )
        files.append((f"{name}.py", "import os\n\n" + body))
    return files


def test_heldout_prompts_deterministic_full_length_distinct_and_spread(monkeypatch, tokenizer):
    monkeypatch.setattr(prompts, "stdlib_sources", _fake_heldout)
    found = prompts.heldout_prompts(tokenizer, num_prompts=6, prompt_tokens=20, seed=3)
    assert found == prompts.heldout_prompts(tokenizer, num_prompts=6, prompt_tokens=20, seed=3)
    assert found != prompts.heldout_prompts(tokenizer, num_prompts=6, prompt_tokens=20, seed=4)
    assert all(len(p) == 20 for p in found)
    assert len({tuple(p) for p in found}) == 6

    texts = [tokenizer.decode(p) for p in found]
    assert all(t.startswith(("def ", "class ")) for t in texts), texts
    # Round-robin over files: six prompts from three files means two from each.
    for name in ("alpha", "beta", "gamma"):
        assert sum(name in t.lower() for t in texts) == 2, texts


def test_heldout_prompts_too_many_asked(monkeypatch, tokenizer):
    monkeypatch.setattr(prompts, "stdlib_sources", _fake_heldout)
    with pytest.raises(ValueError, match=r"num_prompts=1000"):
        prompts.heldout_prompts(tokenizer, num_prompts=1000, prompt_tokens=20)


def test_prompts_from_question_jsonl(tmp_path, tokenizer, chat_tokenizer):
    questions = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        {"question_id": 82, "category": "coding", "turns": ["Add two numbers."]},
        {"question_id": 83, "category": "math", "turns": ["What is two plus two?"]},
    ]
    path = _write_jsonl(tmp_path / "question.jsonl", questions)

    templated = prompts.prompts_from_file(path, chat_tokenizer, num_prompts=2, chat_template="auto")
    assert len(templated) == 2
    expected = chat_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a poem."}], tokenize=False, add_generation_prompt=True
    )
    assert chat_tokenizer.decode(templated[0], skip_special_tokens=False) == expected

    plain = prompts.prompts_from_file(path, tokenizer, num_prompts=None, chat_template="auto")
    assert len(plain) == 3
    assert tokenizer.decode(plain[1]) == "user: Add two numbers.\nassistant:"


def test_prompts_from_prompt_and_text_records(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "def add(a, b):"}, {"text": "class Stack:"}])
    found = prompts.prompts_from_file(path, tokenizer, num_prompts=5)
    assert [tokenizer.decode(p) for p in found] == ["def add(a, b):", "class Stack:"]
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "?"}])
    with pytest.raises(ValueError, match=r"record 0 has none of 'turns'"):
        prompts.prompts_from_file(bad, tokenizer, num_prompts=1)

import pytest
import torch

from distill.teacher import TargetConfig, Teacher, load_teacher
from distill.toy import train_tokenizer


def test_hf_source_loads_by_name_or_path(tiny_target, tmp_path):
    # A local directory stands in for a hub name: the same AutoModel/AutoTokenizer path, no network.
    tiny_target.save_pretrained(tmp_path)
    train_tokenizer(["def f(x):\n    return x\n" * 20], vocab_size=300, max_seq_len=64).save_pretrained(tmp_path)
    teacher = load_teacher(TargetConfig(source="hf", name=str(tmp_path), revision=None, dtype="bfloat16"))
    assert teacher.vocab_size == 128 and teacher.hidden_size == 32 and teacher.num_layers == 2
    assert next(teacher.model.parameters()).dtype == torch.bfloat16
    assert not any(p.requires_grad for p in teacher.model.parameters())
    assert teacher.tokenizer.eos_token == "<|endoftext|>"


def test_outputs_and_hidden_state_convention(tiny_teacher):
    ids = torch.randint(0, 128, (2, 7))
    out = tiny_teacher(ids, layers=(0, 1, -1))
    assert out.logits_BTV.shape == (2, 7, 128)
    # -1 is the final, normed state the lm_head reads; 0 is the embedding output.
    torch.testing.assert_close(tiny_teacher.lm_head(out.hidden[-1]), out.logits_BTV)
    torch.testing.assert_close(out.hidden[0], tiny_teacher.embed_tokens(ids))
    with pytest.raises(ValueError, match="hidden-state index 3 is out of range.*0..2"):
        tiny_teacher(ids, layers=(3,))


def test_bad_target_config():
    with pytest.raises(ValueError, match="target.source='hub'.*'toy'.*'hf'"):
        load_teacher(TargetConfig(source="hub", name="x"))
    with pytest.raises(ValueError, match="target.dtype='fp8'"):
        load_teacher(TargetConfig(source="toy", name="x", dtype="fp8"))


def test_frozen_even_if_given_a_trainable_model(tiny_target):
    tiny_target.train()
    teacher = Teacher(tiny_target, None)
    assert not teacher.model.training
    assert all(not p.requires_grad for p in teacher.model.parameters())

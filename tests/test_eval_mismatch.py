"""eval.mismatch: where a greedy output first differs from plain greedy decoding, and the target's logit gap there
(a bf16 near-tie vs a decoder bug), and evaluate() reporting it."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eval.mismatch import Mismatch, first_divergence, logit_gap, mismatch


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=128)).eval()


def test_first_divergence_and_prefixes():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # the drafter's output stopped first
    assert first_divergence([1, 2], [1, 2, 9]) == 2
    m = mismatch(7, [4, 5, 6], [4, 5, 8])
    assert (m.prompt, m.position, m.prefix, m.expected, m.got) == (7, 2, [4, 5], 6, 8)
    short = mismatch(0, [4, 5, 6], [4])
    assert (short.position, short.expected, short.got) == (1, 5, None)
    assert mismatch(0, [1], [1]) is None


def test_logit_gap_is_the_targets_margin_between_the_two_tokens():
    model = tiny_llama()
    prompt = torch.tensor([[3, 9, 27, 17, 51]])
    prefix = [11, 12]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[3, 9, 27, 17, 51, 11, 12]])).logits[0, -1]
    order = logits.argsort(descending=True).tolist()
    # committing the runner-up where plain greedy takes the top token: the gap is their logit difference, > 0
    near = logit_gap(model, prompt, Mismatch(prompt=0, position=2, prefix=prefix, expected=order[0], got=order[1]))
    torch.testing.assert_close(near["logit_gap"], float(logits[order[0]] - logits[order[1]]))
    torch.testing.assert_close(near["top2_gap"], near["logit_gap"])
    # committing the least likely token: a far wider gap, the signature of a decoder bug rather than a near-tie
    far = logit_gap(model, prompt, Mismatch(prompt=0, position=2, prefix=prefix, expected=order[0], got=order[-1]))
    assert far["logit_gap"] > near["logit_gap"] > 0
    assert 0 < far["relative_gap"] and far["position"] == 2 and "prefix" not in far
    # one side stopped first: only the target's own top-2 margin is reported
    ended = logit_gap(model, prompt, Mismatch(prompt=0, position=2, prefix=prefix, expected=order[0], got=None))
    assert "logit_gap" not in ended and ended["top2_gap"] > 0


def test_evaluate_reports_the_gap_of_a_diverging_drafter(monkeypatch):
    """A decoder that commits a wrong token is caught: identical_to_greedy false, and the mismatch entry names the
    prompt, the position and a positive gap (plain greedy's token is the target's argmax there)."""
    from distill.teacher import Teacher
    from eval.run import evaluate
    from heads.base import build_drafter
    from inference.decoder import Decoder
    from train.config import EvalConfig

    teacher = Teacher(tiny_llama(1), tokenizer=None, name="tiny")
    real = Decoder.speculative

    def corrupt(self, drafter, prompt, max_new, depth):
        gen = real(self, drafter, prompt, max_new, depth)
        gen.new_tokens = gen.new_tokens[:3] + [(gen.new_tokens[3] + 1) % 64] + gen.new_tokens[4:]
        return gen

    monkeypatch.setattr(Decoder, "speculative", corrupt)
    prompts = [[3, 9, 27, 17, 51, 3, 9, 27], [5, 6, 7, 8, 5, 6, 7, 8]]
    cfg = EvalConfig(num_prompts=2, max_new_tokens=8, num_draft=3, warmup_prompts=0, hf_baselines=False,
                     drafter_dtype="float32")
    lookup = build_drafter({"_target_": "heads.lookup.PromptLookup"}, teacher)
    report = evaluate(teacher, {"lookup": lookup}, prompts, cfg)
    row = report["results"][0]
    assert row["identical_to_greedy"] is False and row["identical_prompts"] == 0
    assert [(m["prompt"], m["position"]) for m in row["mismatches"]] == [(0, 3), (1, 3)]
    assert all(m["logit_gap"] > 0 for m in row["mismatches"])
    assert row["max_abs_mismatch_logit_gap"] == max(m["logit_gap"] for m in row["mismatches"])


def test_evaluate_checks_compiled_steps_against_eager_plain_decoding(monkeypatch):
    """With compiled steps, every method's outputs on the first prompts are compared with plain decoding through
    eager steps: a compiled plain decode that commits a wrong token is reported (prompt, position, a positive logit
    gap), a drafter whose output equals eager decoding is not; the summaries show the check and the compile time."""
    from distill.teacher import Teacher
    from eval.markdown import summary_markdown
    from eval.report import summary_table
    from eval.run import evaluate
    from heads.base import build_drafter
    from inference.decoder import DecoderConfig
    from inference.batch_decoder import BucketDecoder
    from inference.runner import StepRunner, _own_code
    from train.config import EvalConfig

    teacher = Teacher(tiny_llama(1), tokenizer=None, name="tiny")
    monkeypatch.setattr(StepRunner, "_compile", lambda self, fn, shared: _own_code(fn))  # no compiler: fast
    real = BucketDecoder.plain

    def corrupt(self, prompts, max_new, sampling=None):
        out = real(self, prompts, max_new, sampling)
        if self.runner.compile:  # the compiled decoder's plain decoding parts from eager decoding at token 3
            for gen in out.generations:
                gen.new_tokens = gen.new_tokens[:3] + [(gen.new_tokens[3] + 1) % 64] + gen.new_tokens[4:]
        return out

    monkeypatch.setattr(BucketDecoder, "plain", corrupt)
    prompts = [[3, 9, 27, 17, 51, 3, 9, 27], [5, 6, 7, 8, 5, 6, 7, 8]]
    cfg = EvalConfig(num_prompts=2, max_new_tokens=8, num_draft=3, warmup_prompts=0, hf_baselines=False,
                     drafter_dtype="float32")
    lookup = build_drafter({"_target_": "heads.lookup.PromptLookup"}, teacher)
    report = evaluate(teacher, {"lookup": lookup}, prompts, cfg, DecoderConfig(compile="on"))
    check = report["compiled_vs_eager"]
    assert check["lookup"]["identical"] == 2 and not check["lookup"]["mismatches"]
    plain = check["plain"]
    assert plain["identical"] == 0 and [(m["prompt"], m["position"]) for m in plain["mismatches"]] == [(0, 3), (1, 3)]
    assert all(m["logit_gap"] > 0 for m in plain["mismatches"])
    assert plain["max_abs_logit_gap"] == max(m["logit_gap"] for m in plain["mismatches"])
    text, markdown = summary_table(report), summary_markdown(report)
    assert "decode steps: compiled" in text and "compiled plain vs eager plain: 0/2 identical; largest" in text
    assert "## Decode steps" in markdown and "| lookup | 2/2 |" in markdown
    assert "compiled_vs_eager" not in evaluate(teacher, {"lookup": lookup}, prompts, cfg)  # eager steps: no check

"""DraftModelRows (heads.draft_model.rows): a batch of sequences drafted by one draft model, one forward per draft step.

Its proposals equal the per-row copies' (``heads.base.ForkedRows``, each its own batch-1 DraftModel) token for token
over many steps with ragged contexts, ragged acceptance, per-row depths (0 included), plain steps, rows leaving the
batch and proposals the drafter is not told about; sampled rows draw the same drafts from the same seeds. Decoding
through it stays token-identical to plain greedy decoding at batch 1 and batch B, with one draft-model forward per
draft step for the whole batch. Draft models with sliding-window layers keep the per-row copies."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from heads.base import ForkedRows, TargetDims
from heads.draft_model.model import DraftModel
from heads.draft_model.rows import DraftModelRows
from inference.batch_decoder import BucketDecoder
from inference.decoder import Decoder
from inference.sampling import GREEDY, SamplingConfig
from tests.conftest import make_tiny_llama

DIMS = TargetDims(hidden_size=32, vocab_size=128, num_layers=2)
HOT = SamplingConfig(temperature=0.8, top_k=20)


def truncated_draft(target) -> DraftModel:
    """A 1-layer draft holding the target's embeddings, first layer and final norm: it agrees with the target often
    enough that acceptance varies from row to row."""
    model = make_tiny_llama(seed=1, initializer_range=0.2, num_hidden_layers=1)
    state = target.state_dict()
    model.load_state_dict({k: state[k] for k in model.state_dict()})
    return DraftModel(DIMS, model=model).eval()


def drive(drafter: DraftModel, lengths: list[int], samplings, steps: int = 12, seed: int = 0):
    """Propose with the batched rows and with per-row copies on the same contexts, step after step; yield both
    proposals per step. Rows accept a random prefix of their drafts plus one random 'target' token; some steps are
    plain (every depth 0), some give rows different depths (0 included), some skip ``accepted`` (the rows must then
    compare ids), and one row leaves the batch half way."""
    gen = torch.Generator().manual_seed(seed)
    seeds = [11 * (b + 1) for b in range(len(lengths))]
    ours, theirs = drafter.rows(seeds), ForkedRows(drafter, seeds)
    assert isinstance(ours, DraftModelRows)
    tokens = [torch.randint(0, 128, (1, n), generator=gen) for n in lengths]
    samplings = list(samplings)
    for step in range(steps):
        if step == steps // 2 and len(tokens) > 1:  # row 1 finishes
            rows = [b for b in range(len(tokens)) if b != 1]
            for state in (ours, theirs):
                state.keep(rows)
            tokens, samplings = [tokens[b] for b in rows], [samplings[b] for b in rows]
        B = len(tokens)
        if step % 5 == 4:
            depths = [0] * B  # a plain step: no proposal, the context still grows
        else:
            depths = [int(torch.randint(0 if step % 3 == 2 else 1, 5, (1,), generator=gen)) for _ in range(B)]
        a = ours.propose(tokens, depths, samplings)
        b = theirs.propose(tokens, depths, samplings)
        yield a, b, depths
        tell = step % 4 != 3
        for r in range(B):
            drafts = a[r].tokens
            accept = int(torch.randint(0, drafts.shape[0] + 1, (1,), generator=gen))
            if tell:
                ours.accepted(r, list(range(accept)))
                theirs.accepted(r, list(range(accept)))
            extra = torch.randint(0, 128, (1, 1), generator=gen)
            tokens[r] = torch.cat([tokens[r], drafts[:accept].view(1, -1), extra], 1)


@pytest.mark.parametrize("lengths", [[3, 17, 9, 30, 1], [12, 12, 12], [20]], ids=["ragged", "aligned", "batch1"])
def test_batched_greedy_proposals_equal_the_per_row_copies(teacher, lengths):
    drafter = truncated_draft(teacher.model)
    drafted = 0
    for ours, theirs, depths in drive(drafter, lengths, [GREEDY] * len(lengths)):
        for r, (a, b, d) in enumerate(zip(ours, theirs, depths)):
            assert a.size == b.size == d and a.probs_NV is None
            assert a.tokens.tolist() == b.tokens.tolist(), f"row {r}"
            drafted += d
    assert drafted > 5 * len(lengths)


@pytest.mark.parametrize("lengths", [[3, 17, 9, 30, 1], [20]], ids=["ragged", "batch1"])
def test_batched_sampled_drafts_equal_the_per_row_copies_from_the_same_seeds(teacher, lengths):
    """Each row draws with its own generator, seeded as its copy's, and only for its own depth: the same tokens; the
    draft distributions agree to float tolerance (the batched forward sums in another order)."""
    drafter = truncated_draft(teacher.model)
    mixed = [HOT if b % 2 == 0 else GREEDY for b in range(len(lengths))]
    for samplings in ([HOT] * len(lengths), mixed):
        distinct = set()
        for ours, theirs, depths in drive(drafter, lengths, samplings, seed=1):
            for a, b in zip(ours, theirs):
                assert a.tokens.tolist() == b.tokens.tolist()
                assert (a.probs_NV is None) == (b.probs_NV is None)
                if a.probs_NV is not None:
                    torch.testing.assert_close(a.probs_NV, b.probs_NV, atol=1e-5, rtol=1e-5)
                    distinct.update(a.tokens.tolist())
        assert len(distinct) > 5  # really sampled, not a point mass


def test_ragged_rows_use_the_scatter_path_and_aligned_rows_append(teacher):
    drafter = truncated_draft(teacher.model)
    for lengths, scattered in (([5, 9], True), ([7, 7], False)):
        rows = drafter.rows([0] * len(lengths))
        rows.propose([torch.randint(0, 128, (1, n)) for n in lengths], [3] * len(lengths), [GREEDY] * len(lengths))
        assert (rows.cache.columns is not None) == scattered
        assert rows.lengths == [n + 2 for n in lengths]  # context + every draft but the last


@pytest.mark.parametrize("batch", [1, 4])
def test_decoding_is_identical_to_plain_greedy_with_one_draft_forward_per_step(teacher, batch, monkeypatch):
    """Ragged prompts, rows finishing at different steps (EOS): every row equals its plain greedy decode, through the
    batched rows and through per-row copies alike; the batched rows run the draft model once per draft step for the
    whole batch (as often as the copies at batch 1, far less often at batch 4)."""
    drafter = truncated_draft(teacher.model)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in (4, 19, 11, 27, 8, 15, 2, 33)]
    refs_free = [Decoder(teacher).plain(p[None], 24).new_tokens for p in prompts]
    # An EOS that the references hit at different places, so rows leave the batch at different steps.
    firsts = {t: {r.index(t) for r in refs_free if t in r[2:]} for r in refs_free for t in r[2:]}
    eos = max(sorted(firsts), key=lambda t: len(firsts[t]))
    refs = [Decoder(teacher, eos_token_id=eos).plain(p[None], 24).new_tokens for p in prompts]
    assert len({len(r) for r in refs}) > 1
    calls = []
    drafter.model.register_forward_hook(lambda *_: calls.append(1))
    monkeypatch.setattr(DraftModel, "static_draft", lambda *args, **kwargs: None)  # the rows, not the static step
    decoder = BucketDecoder(teacher, eos_token_id=eos)

    def decode():
        calls.clear()
        outputs = []
        for i in range(0, len(prompts), batch):
            out = decoder.speculative(drafter, prompts[i: i + batch], 24, num_draft=3)
            outputs += [g.new_tokens for g in out.generations]
        return outputs, len(calls)

    ours, ours_calls = decode()
    monkeypatch.setattr(DraftModel, "rows", lambda self, seeds: ForkedRows(self, seeds))
    forks, forks_calls = decode()
    assert ours == forks == refs
    if batch == 1:
        assert ours_calls == forks_calls
    else:
        assert 2 * ours_calls < forks_calls, (ours_calls, forks_calls)


def test_sliding_window_draft_models_keep_per_row_copies(teacher):
    def mistral(window):
        torch.manual_seed(0)
        config = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, sliding_window=window)
        return DraftModel(DIMS, model=MistralForCausalLM(config).eval())

    assert isinstance(mistral(8).rows([0, 1]), ForkedRows)
    assert isinstance(mistral(None).rows([0, 1]), DraftModelRows)
    drafter = mistral(8)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in (5, 21, 13)]
    refs = [Decoder(teacher).plain(p[None], 16).new_tokens for p in prompts]  # past the window
    out = BucketDecoder(teacher).speculative(drafter, prompts, 16, num_draft=3)
    assert [g.new_tokens for g in out.generations] == refs


def test_context_beyond_the_draft_models_positions_is_refused():
    drafter = DraftModel(DIMS, model=make_tiny_llama(num_hidden_layers=1, max_position_embeddings=16)).eval()
    rows = drafter.rows([0, 1])
    rows.propose([torch.zeros(1, 13, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long)], [4, 2], [GREEDY] * 2)
    with pytest.raises(ValueError, match="max_position_embeddings=16"):  # 14 + 3 fed positions
        rows.propose([torch.zeros(1, 14, dtype=torch.long), torch.zeros(1, 6, dtype=torch.long)], [4, 4], [GREEDY] * 2)

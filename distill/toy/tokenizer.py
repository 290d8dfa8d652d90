"""The toy target's tokenizer: byte-level BPE trained on the corpus, and the corpus cut into training blocks."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def train_tokenizer(
    texts: Sequence[str], vocab_size: int, max_seq_len: int
) -> PreTrainedTokenizerFast:
    """Byte-level BPE over ``texts``: every string round-trips, no unknown tokens."""
    tok = Tokenizer(models.BPE())
    # No prefix space: code must decode back byte for byte.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        # All 256 bytes up front, so bytes absent from the corpus still encode.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.get_vocab_size() < vocab_size:
        logger.warning(
            "tokenizer has %d tokens, fewer than target.toy.vocab_size=%d: the corpus "
            "ran out of merges; the model keeps %d embedding rows",
            tok.get_vocab_size(), vocab_size, vocab_size,
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=max_seq_len,
        # The default clean-up would turn "x ." into "x." and break code.
        clean_up_tokenization_spaces=False,
    )


def tokenize_blocks(
    tokenizer: PreTrainedTokenizerFast, texts: Sequence[str], seq_len: int
) -> torch.Tensor:
    """Concatenate ``text + <|endoftext|>`` for every text; cut into ``[N, seq_len]``."""
    encodings = tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)
    eos_id = tokenizer.eos_token_id
    ids: list[int] = []
    for encoding in encodings:
        ids.extend(encoding.ids)
        ids.append(eos_id)
    num_blocks = len(ids) // seq_len
    if num_blocks == 0:
        raise ValueError(
            f"corpus has {len(ids)} tokens, fewer than one block of target.toy.max_seq_len="
            f"{seq_len}; raise target.toy.corpus_max_bytes or lower max_seq_len"
        )
    # The tail shorter than one block is dropped; it is < seq_len tokens.
    return torch.tensor(ids[: num_blocks * seq_len], dtype=torch.long).view(num_blocks, seq_len)

"""A byte-level BPE tokenizer trained on the corpus (``tokenizers``), saved for transformers.

Byte-level: every byte has a token, so any text encodes (no unknown token), and decoding
gives the text back. One special token, ``<|endoftext|>``, separates files. Saved as a
``PreTrainedTokenizerFast`` so ``AutoTokenizer.from_pretrained(model_dir)`` loads it like
any Hugging Face model's tokenizer.
"""

from __future__ import annotations

from typing import Iterable

END_OF_TEXT = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A ``tokenizers.Tokenizer`` (byte-level BPE, ``vocab_size`` tokens) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 300 <= vocab_size <= 65535:
        raise ValueError(f"vocab_size must be an int in [300, 65535] (256 bytes + merges; ids fit uint16), "
                         f"got {vocab_size!r}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def as_transformers(tok):
    """The trained tokenizer wrapped for transformers (eos = pad = ``<|endoftext|>``)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT)


def encode_files(tok, texts: Iterable[str]):
    """All texts as one uint16 token array, each file followed by ``<|endoftext|>``."""
    import numpy as np

    eot = tok.token_to_id(END_OF_TEXT)
    batch, pieces = [], []

    def flush():
        for enc in tok.encode_batch(batch):
            pieces.append(np.asarray(enc.ids + [eot], dtype=np.uint16))
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == 64:
            flush()
    flush()
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)

"""A character-level tokenizer for synthetic tasks, saved in HF ``tokenizer.json`` format.

Every printable ASCII character and newline is one token; four special tokens come first.
Loads with ``transformers.AutoTokenizer`` like any other checkpoint's tokenizer.
"""

from __future__ import annotations

import os
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
CHARS = "\n" + "".join(c for c in string.printable if c.isprintable())  # 95 printable ASCII + newline


def build_tokenizer() -> Tokenizer:
    """The char tokenizer as a ``tokenizers.Tokenizer`` (vocab: specials, then CHARS)."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)} | {c: len(SPECIALS) + i for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char, newline too
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def vocab_size() -> int:
    return len(SPECIALS) + len(CHARS)


def save_tokenizer(out_dir: str | os.PathLike, model_max_length: int = 2048) -> None:
    """Write tokenizer.json + tokenizer_config.json that ``AutoTokenizer.from_pretrained`` reads."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)

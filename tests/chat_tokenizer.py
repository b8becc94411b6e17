"""A tokenizer with a real subword vocabulary and a chat template, for the chat-template tests: byte-level BPE trained
with ``tokenizers`` on a small text, ChatML turns (``<|im_start|>``, ``<|im_end|>``), ``<think>`` reasoning blocks.

The template is written here in the manner of the reasoning-model templates: ``date_string`` opens the conversation
with a dated system message; the reasoning of an answer before the last user message is dropped;
``enable_thinking=False`` opens the model's turn with an empty reasoning block. The tokenizer's end of sequence is
``<|endoftext|>`` (as a base model's is), so only the template says that ``<|im_end|>`` ends a turn.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK = ["<think>", "</think>"]  # added, not special: decoded text keeps them, as the rewards need
VOCAB = 512

TEMPLATE = (
    "{%- if date_string is defined %}"
    "{{- '<|im_start|>system\\nToday is ' + date_string + '.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}"
    "{%- if loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

CORPUS = [
    "You are a careful assistant. Answer with the number only.",
    "What is the sum of twelve and seven? The answer is nineteen.",
    "Think step by step, then give the final answer.",
    "The tool replied with a value; use it to answer the question.",
    "Calculate 12 + 7. Calculate 40 - 18. Calculate 6 * 9.",
    "Spell this word backward: ammonia. How many legs do three spiders have?",
] * 20 + [f"{a} + {b} = {a + b}\n{a} - {b} = {a - b}\n" for a in range(30) for b in range(30)]


def build_chat_tokenizer(out_dir: str | Path | None = None):
    """The tokenizer as a ``transformers`` fast tokenizer (saved to ``out_dir`` where given, beside a checkpoint)."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - len(THINK),
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    fast.add_tokens(THINK)
    if out_dir is not None:
        fast.save_pretrained(out_dir)
    return fast


def chat_model(out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny random Qwen3-MoE checkpoint at ``out_dir`` whose tokenizer is this one (its vocabulary sized for it)."""
    from moerl.presets import init_model

    tok = build_chat_tokenizer()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    init_model("qwen3_moe", "tiny", out_dir, seed=seed, overrides={"vocab_size": VOCAB, "eos_token_id": eos})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (Path(out_dir) / name).unlink(missing_ok=True)
    tok.save_pretrained(out_dir)
    return Path(out_dir)

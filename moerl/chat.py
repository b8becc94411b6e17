"""A tokenizer's own chat template: conversations rendered token for token as transformers' ``apply_chat_template``
renders them, the tokens that end the model's turn, and the tokens of a turn added after the model's.

A multi-turn episode grows by appending: the model's own tokens are never re-rendered (they are what it was trained
on), so a turn the environment adds is rendered on its own, as the template renders a message that follows a user
turn, after the end of the model's turn as the template writes it. For a template that writes every turn the same
wherever it stands, an episode equals ``apply_chat_template`` of its whole conversation; a template that rewrites
earlier turns (one that drops the reasoning of earlier answers) differs from it only in those rewrites.
"""

from __future__ import annotations

from moerl.errors import ConfigError

# arguments of apply_chat_template that moerl sets itself (or that change what it returns)
OWN = (
    "conversation",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "chat_template",
)
_USER, _ANSWER = "MOERL_PROBE_USER", "MOERL_PROBE_ANSWER"


def template_variables(template: str) -> set[str]:
    """The names a Jinja template reads from its context (what ``apply_chat_template`` kwargs it can take)."""
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return set(meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(template)))


class ChatTemplate:
    """The chat template of ``tokenizer`` (named ``where`` in errors), with ``system`` put first in a conversation
    that has no system message and the template's own ``kwargs`` (e.g. ``{"enable_thinking": False}``) passed to
    every rendering; ``kwarg`` names a kwarg in errors (a format string). ConfigError where the tokenizer has no
    chat template, a kwarg is one the template never reads or one moerl sets, or the template ends an assistant turn
    with no special token."""

    def __init__(
        self,
        tokenizer,
        system: str | None = None,
        kwargs: dict | None = None,
        where: str = "the model",
        kwarg: str = "config key 'env.chat.kwargs.{}'",
    ):
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ConfigError(
                f"config key 'env.chat.template'=true: the tokenizer of {where} has no chat template (its "
                "tokenizer_config.json or chat_template.jinja); use text prompts (env.chat.template: false)"
            )
        self.tok, self.system, self.kwargs, self.where = tokenizer, system, dict(kwargs or {}), where
        reads = template_variables(template) if isinstance(template, str) else None
        for k in self.kwargs:
            if k in OWN:
                raise ConfigError(f"{kwarg.format(k)}: moerl sets it (or it changes what comes back)")
            if reads is not None and k not in reads:
                raise ConfigError(
                    f"{kwarg.format(k)}: the chat template of {where} does not read it (it reads: "
                    f"{', '.join(sorted(reads - {'messages'}))})"
                )
        self.end_of_turn, self._close, self._closed = self._turn_end()

    def messages(self, prompt: str | list[dict]) -> list[dict]:
        """The conversation of a prompt: text as one user message; ``system`` first where none is there."""
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.system is not None and (not msgs or msgs[0].get("role") != "system"):
            msgs.insert(0, {"role": "system", "content": self.system})
        return msgs

    def text(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as the template writes it, with the configured kwargs."""
        try:
            return self.tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.kwargs
            )
        except Exception as e:  # the template's own raise_exception(...), a message it cannot take
            raise ConfigError(f"the chat template of {self.where} cannot render {messages!r:.200}: {e}") from None

    def ids(self, text: str) -> list[int]:
        """``text`` (a rendering) as token ids, as apply_chat_template tokenizes it (no special tokens added)."""
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, prompt: str | list[dict]) -> list[int]:
        """The tokens of a prompt's conversation and the generation prompt: what the model continues."""
        return self.ids(self.text(self.messages(prompt)))

    def _turn_end(self) -> tuple[list[int], str, str]:
        """The end-of-turn token ids, and the text the template writes after an assistant message's content when
        the model did not end it (``close``) and when it did (``closed``, what follows its end-of-turn token)."""
        text = self.text([{"role": "user", "content": _USER}, {"role": "assistant", "content": _ANSWER}], False)
        at = text.rfind(_ANSWER)
        if at < 0:
            raise ConfigError(f"the chat template of {self.where} does not write an assistant message's content")
        close = text[at + len(_ANSWER) :]
        special = set(self.tok.all_special_ids) | {i for i, t in self.tok.added_tokens_decoder.items() if t.special}
        ends = [i for i in self.ids(close) if i in special][:1]
        if not ends:
            raise ConfigError(
                f"the chat template of {self.where} ends an assistant turn with {close!r}: no special token there "
                "tells where the model's turn ends"
            )
        token = self.tok.convert_ids_to_tokens(ends[0])
        return ends, close, close[close.index(token) + len(token) :] if token in close else ""

    def next_turn(self, content: str, ended: bool, role: str = "user") -> list[int]:
        """The tokens after the model's turn for a message ``content`` of ``role`` and the generation prompt:
        the end of the model's turn as the template writes it (``ended``: the model wrote its end-of-turn token
        itself), the message, the header of the model's next turn."""
        for base in ([{"role": "user", "content": _USER}],
                     [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ANSWER}]):  # fmt: skip
            base = self.messages(base)
            head, full = self.text(base, False), self.text([*base, {"role": role, "content": content}])
            if full.startswith(head):
                return self.ids((self._closed if ended else self._close) + full[len(head) :])
        raise ConfigError(
            f"the chat template of {self.where} writes a {role} message by rewriting the conversation before it: "
            "moerl cannot add the turn to an episode"
        )

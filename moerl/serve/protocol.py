"""The OpenAI API's request bodies as moerl's server reads them, and the error it answers with.

Fields the engine implements map onto SamplingParams; the vLLM extensions a training harness relies on
(``return_token_ids``, ``top_k``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ``chat_template_kwargs``) are
read as vLLM reads them. A field the server does not implement is refused by name when it asks for something
(``top_logprobs: 3``, ``tools``, ``logprobs`` with ``stream: true``), never ignored; one that changes nothing here
(``user``, ``metadata``, ``store``) is accepted. Unknown fields are refused by name.

Logprobs are those of the sampled token under the distribution it was sampled from (after temperature): the numbers
the trainer recomputes. (vLLM's default is the model's distribution before temperature; at temperature 1 they agree.)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIError(Exception):
    """An error the server answers with: HTTP ``status`` and OpenAI's ``{"error": {...}}`` body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def refused(param: str, why: str) -> OpenAIError:
    """A 400 naming a request field the server does not implement as asked."""
    return OpenAIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


class _Sampling(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted: changes nothing here
    # vLLM's extensions
    top_k: int = 0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False

    def refuse_unimplemented(self) -> None:
        """OpenAIError naming the first field that asks for what this server does not do."""
        if self.stream and (self.return_token_ids or self.return_tokens_as_token_ids):
            name = "return_token_ids" if self.return_token_ids else "return_tokens_as_token_ids"
            raise refused(name, "token ids come with whole responses only (stream: false)")
        if not self.stream and self.stream_options:
            raise refused("stream_options", "only with stream: true")
        if self.presence_penalty or self.frequency_penalty:
            name = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise refused(name, "penalties are not implemented (they would change the sampled distribution)")
        if self.logit_bias:
            raise refused("logit_bias", "not implemented (it would change the sampled distribution)")
        if not self.skip_special_tokens:
            raise refused("skip_special_tokens", "the text leaves special tokens out (token_ids hold every token)")

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    """A chat message: text content (or text parts) for a role the chat template renders."""

    model_config = ConfigDict(extra="forbid")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def plain(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out = {"role": self.role, "content": content or ""}
        return out | ({"name": self.name} if self.name else {})


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict | None = None
    metadata: dict | None = None  # accepted: changes nothing here
    store: bool | None = None  # accepted: changes nothing here
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def refuse_unimplemented(self) -> None:
        super().refuse_unimplemented()
        if self.stream and self.logprobs:
            raise refused("logprobs", "logprobs come with whole responses only (stream: false)")
        if self.top_logprobs:
            raise refused("top_logprobs", "this server returns the sampled token's logprob only (top_logprobs: 0)")
        if self.tools or self.tool_choice not in (None, "none"):
            name = "tools" if self.tools else "tool_choice"
            raise refused(name, "tool calls are not parsed by this server; describe tools in the messages")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise refused("response_format", "only {type: text} is implemented (no constrained decoding)")
        if not self.add_generation_prompt:
            raise refused("add_generation_prompt", "the model's turn is always opened (true)")

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a text prompt, token ids, or a list of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unimplemented(self) -> None:
        super().refuse_unimplemented()
        if self.logprobs:
            raise refused("logprobs", "this server returns the sampled token's logprob only (logprobs: 0)")
        if self.stream and self.logprobs is not None:
            raise refused("logprobs", "logprobs come with whole responses only (stream: false)")
        if self.echo:
            raise refused("echo", "not implemented (the prompt's logprobs are not computed)")
        if self.suffix:
            raise refused("suffix", "not implemented (no fill-in-the-middle)")
        if self.best_of not in (None, self.n):
            raise refused("best_of", "not implemented (n samples come back, all of them)")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one text or token-id list, or each of a list of them."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

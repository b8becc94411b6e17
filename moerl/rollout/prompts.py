"""What the generator sends the engine for a problem, and the tokens of an environment's turn in an episode: text
tokenized as it is (the engine's tokenizer), or a conversation rendered by the tokenizer's chat template."""

from __future__ import annotations

from moerl.chat import ChatTemplate
from moerl.envs.base import Problem
from moerl.errors import ConfigError


class Prompts:
    """Prompts for ``tokenizer``: through ``chat`` (a ChatTemplate) where given, else the prompt text as it is."""

    def __init__(self, tokenizer, chat: ChatTemplate | None = None) -> None:
        self.tokenizer, self.chat = tokenizer, chat

    @property
    def stop_token_ids(self) -> list[int]:
        """The tokens the engine stops on besides the end of sequence: the template's end of turn."""
        return list(self.chat.end_of_turn) if self.chat is not None else []

    def request(self, problem: Problem) -> str | list[int]:
        """The engine's prompt: the text (the engine tokenizes it) or the rendered conversation's token ids."""
        if self.chat is not None:
            return self.chat.prompt_ids(problem.prompt)
        if not isinstance(problem.prompt, str):
            raise ConfigError(
                f"{problem.name()}: its prompt is a list of chat messages; set env.chat.template: true to render it "
                "with the tokenizer's chat template"
            )
        return problem.prompt

    def ids(self, problem: Problem) -> list[int]:
        """The prompt's token ids, as the engine gets them."""
        prompt = self.request(problem)
        return prompt if isinstance(prompt, list) else self.tokenizer(prompt)["input_ids"]

    def turn(self, message: str, completion_ids: list[int]) -> list[int]:
        """The tokens an environment's ``message`` adds after the model's turn ``completion_ids``: as it is, or as
        the template writes a user turn (closing the model's turn where the model did not, opening its next)."""
        if self.chat is None:
            return self.tokenizer(message, add_special_tokens=False)["input_ids"]
        ended = bool(completion_ids) and completion_ids[-1] in self.chat.end_of_turn
        return self.chat.next_turn(message, ended)

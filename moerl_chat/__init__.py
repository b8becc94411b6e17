"""``moerl_chat``: a verifiers harness that plays a task as a plain chat, in the process (harness id ``moerl_chat``).

verifiers finds a harness by id as an installed top-level module exporting one ``Harness`` subclass, hence this
module beside the ``moerl`` package. Its built-in harnesses run a program set up by ``uv`` in a runtime (a network
fetch, a process per rollout); this one makes each segment's one model call from the rollout's own event loop,
through the rollout's interception endpoint as every harness must, so verifiers records and scores it as any other.
A turn the environment adds (``Interaction.turn``) is a resumed segment: the conversation so far, one more call.
It gives the model no tools.
"""

from __future__ import annotations

import openai
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult


class ChatHarnessConfig(vf.HarnessConfig):
    """No knobs: the sampling is the agent's (``AgentConfig.sampling``), imposed by the interception server."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True  # the task's system prompt as a system message
    SUPPORTS_RESUME = True  # a later segment relaunches on the conversation so far
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in prompt or []]
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        except openai.APIError as e:  # the rollout's error, as a program's failed exit would be
            return ProgramResult(exit_code=1, stdout="", stderr=f"{type(e).__name__}: {e}")
        finally:
            await client.close()
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["ChatHarness"]

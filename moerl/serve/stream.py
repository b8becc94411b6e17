"""A completion as server-sent events while the engine samples it: each sample's text in pieces as its tokens come
(a piece held back while it may still be a partial UTF-8 character or the start of a stop string), the finish
reason with the last piece, usage where asked, then ``data: [DONE]``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from moerl.engine import Request, RequestOutput


def event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


class TextPieces:
    """The text of one sample as its tokens arrive: ``add`` returns what may be sent now, ``last`` the rest of the
    final text (the engine's, cut at a stop string)."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer, self.stops, self.ids, self.sent = tokenizer, stops, [], ""
        self.hold = max((len(s) for s in stops), default=1) - 1

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        text = text[:cut] if cut >= 0 else text[: max(0, len(text) - self.hold)]
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent) :], text
        return piece

    def last(self, final: str) -> str:
        return final[len(self.sent) :] if final.startswith(self.sent) else ""


async def started(batcher, request: Request) -> tuple[asyncio.Queue, object, tuple | None]:
    """Submit ``request`` with its tokens to a queue; wait for its first token or its end (so a request refused
    before it runs is answered with an error status, not an empty stream). Returns (queue, future, first item)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    future = batcher.submit(request, lambda j, token, _: loop.call_soon_threadsafe(queue.put_nowait, (j, token)))
    future.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))  # after every token
    return queue, future, await queue.get()


async def events(
    queue: asyncio.Queue,
    future,
    first: tuple | None,
    pieces: list[TextPieces],
    chunk: Callable[[int, str, str | None], dict],
    finished: Callable[[RequestOutput], list[dict]],
    error: Callable[[BaseException], dict],
) -> AsyncIterator[str]:
    """The events: ``chunk(sample, piece, None)`` per piece as tokens come, then ``finished(output)`` (each sample's
    last piece with its finish reason, usage where asked), or ``error(e)`` where the request failed."""
    item = first
    while item is not None:
        j, token = item
        piece = pieces[j].add(token)
        if piece:
            yield event(chunk(j, piece, None))
        item = await queue.get()
    try:
        bodies = finished(future.result())
    except Exception as e:  # the status line is sent: the error goes in the stream, as OpenAI's does
        bodies = [error(e)]
    for body in bodies:
        yield event(body)
    yield "data: [DONE]\n\n"

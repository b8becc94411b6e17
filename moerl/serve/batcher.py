"""One thread drives the engine for a server: requests that arrive while it generates go into its next call together,
so concurrent clients share the engine's batches; a weight sync holds the engine between calls (``paused``)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager

from moerl.engine import Request, RequestError, RequestOutput

OnToken = Callable[[int, int, str | None], None]  # (sample index, token id, finish reason or None)


class Batcher:
    """Runs ``engine.generate`` on a thread of its own for requests ``submit`` queues, up to ``max_batch`` requests a
    call. ``on_output(request, output)`` sees every finished request (a run's record of what the engine made)."""

    def __init__(
        self,
        engine,
        max_batch: int = 256,
        on_output: Callable[[Request, RequestOutput], None] | None = None,
    ) -> None:
        self.engine, self.max_batch, self.on_output = engine, max_batch, on_output
        self.calls = 0  # engine.generate calls made: fewer than requests where concurrent ones were batched
        self._queue: queue.Queue[tuple[Request, Future, OnToken | None] | None] = queue.Queue()
        self._engine_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="moerl-serve-batcher", daemon=True)
        self._thread.start()

    def submit(self, request: Request, on_token: OnToken | None = None) -> Future:
        """The future of ``request``'s RequestOutput (or of the RequestError that names what is wrong with it);
        ``on_token(sample, token, finish_reason)`` is called from the engine's thread as each token is sampled."""
        future: Future = Future()
        self._queue.put((request, future, on_token))
        return future

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No engine call runs inside: a weight sync made here is seen whole by every request, none half."""
        with self._engine_lock:
            yield

    def close(self) -> None:
        """Stop the thread once the requests queued so far are answered."""
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (first := self._queue.get()) is not None:
            batch, stop = [first], False
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            with self._engine_lock:
                self._run(batch)
            if stop:
                return

    def _generate(self, batch: list[tuple[Request, Future, OnToken | None]]) -> list[RequestOutput]:
        self.calls += 1
        streams = [cb for *_, cb in batch]
        hook = None
        if any(streams):

            def hook(i: int, j: int, token: int, reason: str | None) -> None:
                if streams[i] is not None:
                    streams[i](j, token, reason)

        requests = [r for r, *_ in batch]
        return self.engine.generate(requests) if hook is None else self.engine.generate(requests, on_token=hook)

    def _run(self, batch: list[tuple[Request, Future, OnToken | None]]) -> None:
        """Answer every request of ``batch``: a bad one (RequestError) fails alone, the others run without it."""
        live = [item for item in batch if item[1].set_running_or_notify_cancel()]
        if not live:
            return
        try:
            outs = self._generate(live)
        except RequestError as e:
            if len(live) == 1:
                live[0][1].set_exception(e)
                return
            for one in live:  # which one is bad: each alone, so the others are answered
                self._retry(one)
            return
        except BaseException as e:  # the engine failed: every request of the call hears why, the server stays up
            for _, f, _ in live:
                f.set_exception(e)
            return
        for (r, f, _), out in zip(live, outs, strict=True):
            self._answer(r, f, out)

    def _retry(self, item: tuple[Request, Future, OnToken | None]) -> None:
        request, future, _ = item
        try:
            out = self._generate([item])[0]
        except BaseException as e:
            future.set_exception(e)
            return
        self._answer(request, future, out)

    def _answer(self, request: Request, future: Future, out: RequestOutput) -> None:
        if self.on_output is not None and out.error is None:
            try:
                self.on_output(request, out)
            except BaseException as e:  # the request hears it rather than waiting for ever
                future.set_exception(e)
                return
        future.set_result(out)

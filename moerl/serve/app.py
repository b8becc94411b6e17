"""An OpenAI-compatible HTTP server over a moerl engine: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models`` (FastAPI). Token in, token out: a text prompt is tokenized and a conversation rendered by the
tokenizer's chat template once, here, and what comes back carries the exact token ids the engine produced and their
logprobs (``return_token_ids``, as vLLM's server), which a run trains on without re-tokenizing any text."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from moerl.chat import ChatTemplate
from moerl.engine import Request as EngineRequest
from moerl.engine import RequestError, RequestOutput, SamplingParams
from moerl.errors import ConfigError
from moerl.serve.batcher import Batcher
from moerl.serve.protocol import ChatRequest, CompletionRequest, OpenAIError, refused
from moerl.serve.stream import TextPieces, event, events, started

FINISH = {"stop": "stop", "length": "length", "context": "length"}


SESSION = "x-session-id"  # the header an agent harness names its rollout with (verifiers sends it)

Record = Callable[[str | None, RequestOutput], None]


class OpenAIServer:
    """The API for ``engine`` (its tokenizer renders and decodes) serving model ``name``; requests use LoRA adapter
    ``adapter`` where given. ``batcher``: the engine's one driver (``Batcher``); ``app``: the FastAPI application.
    ``record(session, output)`` sees what the engine made for every answered request, with the request's
    ``X-Session-ID`` header (None without one): a run joins an agent's requests to its episode by it."""

    def __init__(
        self,
        engine,
        name: str,
        adapter: str | None = None,
        batcher: Batcher | None = None,
        record: Record | None = None,
    ) -> None:
        if engine.tokenizer is None:
            raise ConfigError("the OpenAI server needs the checkpoint's tokenizer (it renders and decodes text)")
        self.engine, self.name, self.adapter, self.record = engine, name, adapter, record
        self.tokenizer = engine.tokenizer
        self.batcher = batcher or Batcher(engine)
        self._chats: dict[str, ChatTemplate] = {}
        self.created = int(time.time())
        self.app = self._app()

    # -- requests to the engine --------------------------------------------------------------------------------
    def _check_model(self, model: str) -> None:
        if model != self.name:
            raise OpenAIError(
                404,
                f"The model {model!r} does not exist: this server serves {self.name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def _params(self, req, max_tokens: int | None, stop_ids: list[int]) -> SamplingParams:
        limit = getattr(self.engine.config, "max_model_len", None) if max_tokens is None else max_tokens
        try:
            return SamplingParams(
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                max_tokens=limit if limit is not None else 16,  # the engine cuts it at the context window
                min_tokens=req.min_tokens,
                stop_token_ids=[*stop_ids, *(req.stop_token_ids or [])],
                stop=req.stops(),
                ignore_eos=req.ignore_eos,
                seed=req.seed,
                n=req.n,
            )
        except ConfigError as e:  # "SamplingParams.top_p=2.0: ..." -> the request's field
            field = str(e).split("=", 1)[0].removeprefix("SamplingParams.")
            raise OpenAIError(400, f"{field}: {str(e).split(': ', 1)[-1]}", param=field) from None

    def _chat(self, kwargs: dict | None) -> ChatTemplate:
        key = repr(sorted((kwargs or {}).items()))
        if key not in self._chats:
            if not getattr(self.tokenizer, "chat_template", None):
                raise OpenAIError(
                    400,
                    f"the tokenizer of {self.name!r} has no chat template: send text prompts to /v1/completions",
                    param="messages",
                )
            try:
                self._chats[key] = ChatTemplate(self.tokenizer, None, kwargs, self.name, "chat_template_kwargs.{}")
            except ConfigError as e:
                raise OpenAIError(400, str(e), param="chat_template_kwargs") from None
        return self._chats[key]

    @staticmethod
    def _check(out: RequestOutput) -> RequestOutput:
        """``out``, or the OpenAIError of its failure: 400 for a request that cannot run, 500 for one that failed."""
        if out.error is not None:
            status = 400 if out.error_kind == "rejected" else 500
            raise OpenAIError(status, out.error, kind="invalid_request_error" if status == 400 else "server_error")
        return out

    async def _run(self, requests: list[EngineRequest], session: str | None) -> list[RequestOutput]:
        outs = await asyncio.gather(*(asyncio.wrap_future(self.batcher.submit(r)) for r in requests))
        return [self._recorded(self._check(out), session) for out in outs]

    def _recorded(self, out: RequestOutput, session: str | None) -> RequestOutput:
        if self.record is not None:
            self.record(session, out)
        return out

    async def _stream(self, request: EngineRequest, chat: bool, usage: bool, session: str | None) -> StreamingResponse:
        """``request`` answered as server-sent events (``stream: true``)."""
        queue, future, first = await started(self.batcher, request)
        if first is None:  # over before its first token: a refused request is answered with its error status
            self._check(await asyncio.wrap_future(future))
        p = request.params
        head = {"id": request.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.name}  # fmt: skip
        pieces = [TextPieces(self.tokenizer, p.stop) for _ in range(p.n)]

        def chunk(j: int, piece: str, reason: str | None, delta: dict | None = None) -> dict:
            choice = {"index": j, "delta": delta or {"content": piece}} if chat else {"index": j, "text": piece}
            return head | {"choices": [choice | {"logprobs": None, "finish_reason": reason}]}

        def finished(out: RequestOutput) -> list[dict]:
            self._recorded(self._check(out), session)
            ends = [chunk(c.index, pieces[c.index].last(c.text), FINISH[c.finish_reason]) for c in out.outputs]
            return ends + ([head | {"choices": [], "usage": self._usage([out])}] if usage else [])

        def error(e: BaseException) -> dict:
            failed = OpenAIError(500, f"{type(e).__name__}: {e}", kind="server_error")
            return (e if isinstance(e, OpenAIError) else failed).body()

        async def body():
            if chat:  # the role first, as OpenAI's streams open
                for j in range(p.n):
                    yield event(chunk(j, "", None, {"role": "assistant", "content": ""}))
            async for e in events(queue, future, first, pieces, chunk, finished, error):
                yield e

        return StreamingResponse(body(), media_type="text/event-stream")

    # -- responses ---------------------------------------------------------------------------------------------
    def _piece(self, token: int, as_ids: bool) -> str:
        return f"token_id:{token}" if as_ids else self.tokenizer.decode([token])

    def _usage(self, outs: list[RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def chat(self, req: ChatRequest, http: Request) -> dict | StreamingResponse:
        self._check_model(req.model)
        req.refuse_unimplemented()
        chat = self._chat(req.chat_template_kwargs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            prompt = chat.ids(chat.text([m.plain() for m in req.messages]))
        except ConfigError as e:
            raise OpenAIError(400, str(e), param="messages") from None
        params = self._params(req, req.limit(), list(chat.end_of_turn))
        request = EngineRequest(prompt, params, adapter=self.adapter, request_id=rid)
        if req.stream:
            usage = bool((req.stream_options or {}).get("include_usage"))
            return await self._stream(request, True, usage, http.headers.get(SESSION))
        (out,) = await self._run([request], http.headers.get(SESSION))
        choices = []
        for c in out.outputs:
            choice = {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None,
                "finish_reason": FINISH[c.finish_reason],
            }
            if req.logprobs:
                pieces = [self._piece(t, req.return_tokens_as_token_ids) for t in c.token_ids]
                choice["logprobs"] = {
                    "content": [
                        {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                        for p, lp in zip(pieces, c.logprobs.tolist(), strict=True)
                    ]
                }
            if req.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        body = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.name,
                "choices": choices, "usage": self._usage([out])}  # fmt: skip
        if req.return_token_ids:
            body["prompt_token_ids"] = list(out.prompt_token_ids)
        return body

    async def completions(self, req: CompletionRequest, http: Request) -> dict | StreamingResponse:
        self._check_model(req.model)
        req.refuse_unimplemented()
        rid = f"cmpl-{uuid.uuid4().hex}"
        params = self._params(req, req.max_tokens, [])
        reqs = [EngineRequest(p, params, adapter=self.adapter, request_id=f"{rid}-{i}")
                for i, p in enumerate(req.prompts())]  # fmt: skip
        if req.stream:
            if len(reqs) > 1:
                raise refused("prompt", "a list of prompts streams one prompt a request only (stream: true)")
            usage = bool((req.stream_options or {}).get("include_usage"))
            return await self._stream(reqs[0], False, usage, http.headers.get(SESSION))
        outs = await self._run(reqs, http.headers.get(SESSION))
        choices = []
        for out in outs:
            for c in out.outputs:
                choice = {"index": len(choices), "text": c.text, "logprobs": None,
                          "finish_reason": FINISH[c.finish_reason]}  # fmt: skip
                if req.logprobs is not None:
                    tokens = [self._piece(t, req.return_tokens_as_token_ids) for t in c.token_ids]
                    offsets, at = [], 0
                    for t in tokens:
                        offsets.append(at)
                        at += len(t)
                    choice["logprobs"] = {"tokens": tokens, "token_logprobs": c.logprobs.tolist(),
                                          "top_logprobs": [{} for _ in tokens], "text_offset": offsets}  # fmt: skip
                if req.return_token_ids:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.name,
                "choices": choices, "usage": self._usage(outs)}  # fmt: skip

    def models(self) -> dict:
        card = {"id": self.name, "object": "model", "created": self.created, "owned_by": "moerl"}
        limit = getattr(self.engine.config, "max_model_len", None)
        return {"object": "list", "data": [card | ({"max_model_len": limit} if limit else {})]}

    # -- the application ---------------------------------------------------------------------------------------
    def _app(self) -> FastAPI:
        app = FastAPI(title=f"moerl: {self.name}")
        app.post("/v1/chat/completions", response_model=None)(self.chat)
        app.post("/v1/completions", response_model=None)(self.completions)
        app.get("/v1/models")(self.models)
        app.get("/health")(lambda: {"status": "ok"})

        @app.exception_handler(OpenAIError)
        async def _openai(_: Request, e: OpenAIError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
            message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
            return JSONResponse(OpenAIError(400, message, param=param).body(), status_code=400)

        @app.exception_handler(RequestError)
        async def _request(_: Request, e: RequestError) -> JSONResponse:
            return JSONResponse(OpenAIError(400, str(e)).body(), status_code=400)

        @app.exception_handler(Exception)
        async def _failed(_: Request, e: Exception) -> JSONResponse:
            body = OpenAIError(500, f"{type(e).__name__}: {e}", kind="server_error").body()
            return JSONResponse(body, status_code=500)

        return app

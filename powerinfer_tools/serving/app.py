"""The HTTP side of ``pitools serve``: OpenAI's routes on Starlette, with authentication, bounded bodies
and OpenAI-style JSON errors for everything a client can get wrong (never a traceback). The HTTP/1.1
server under it, with its read timeouts, is ``uvicorn_server.py``."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Optional

import pydantic
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from powerinfer_tools.runtime.generation import PromptTooLong, SettingError
from powerinfer_tools.runtime.batching import DEFAULT_PARALLEL
from powerinfer_tools.runtime.llm import LLM
from powerinfer_tools.serving.chat_template import ChatTemplate, ChatTemplateError, RendererClosed
from powerinfer_tools.serving.json_body import read_json_object
from powerinfer_tools.serving.metrics import ServerMetrics
from powerinfer_tools.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    Reply,
    error_body,
    usage,
)
from powerinfer_tools.serving.scheduler import Job, QueueFull, Scheduler, ShuttingDown, Ticket

log = logging.getLogger("pitools.serve")
PUBLIC_ROUTES = ("/health",)  # answered without the API key: a load balancer's probe carries none
# A prompt's text averages 3-5 characters a token; one longer than this many characters per token of the
# context window cannot fit it in practice, and is refused before it is tokenized (a megabyte of text takes
# seconds to tokenize) or, from a chat template, as soon as the template has written that much.
CHARS_PER_TOKEN = 32
DEFAULT_PROMPT_CACHE_BYTES = 256 << 20  # --prompt-cache: some 5,000 positions of SmolLM2's or TinyLlama's KV cache


@dataclass(frozen=True)
class ServeSettings:
    model_id: str  # the name clients give as "model"
    api_key: Optional[str] = None
    max_queue: int = 64  # requests admitted beyond those running: preparing their prompt, or queued
    parallel: int = DEFAULT_PARALLEL  # generations decoded together, one forward pass per step
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES  # finished sequences' KV caches kept for reuse; 0: none
    max_body_bytes: int = 1 << 20
    template_seconds: float = 2.0  # a chat template's render of one request's messages
    header_timeout: float = 10.0  # for a request's line and headers to arrive (uvicorn_server.py)
    body_timeout: float = 30.0  # for its body to arrive, once its headers have


class _BodyTooLarge(Exception):
    pass


class _Guard:
    """ASGI middleware in front of every route: the API key (Bearer, compared in constant time),
    the body size bound, and the count of responses by route and status."""

    def __init__(self, app, settings: ServeSettings, metrics: ServerMetrics, routes: set[str]):
        self.app, self.settings, self.metrics, self.routes = app, settings, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"
        status = 499  # the client closed the connection before a response started

        async def counted_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                return await refusal(scope, receive, counted_send)
            await self.app(scope, self._bounded(receive), counted_send)
        finally:
            self.metrics.record_response(route, status)

    def _refusal(self, scope) -> Optional[Response]:
        headers = dict(scope["headers"])  # raw bytes, names in lower case
        key = self.settings.api_key
        if key is not None and scope["path"] not in PUBLIC_ROUTES:
            # Compared as the bytes sent: a key with non-ASCII characters is sent as UTF-8 by the clients
            # that can send it at all (HTTP gives header bytes no encoding; a text decoding would not match).
            given = headers.get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, key.encode("utf-8")):
                return _error(401, "missing or wrong API key: send it as 'Authorization: Bearer KEY'",
                              "invalid_request_error", "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.settings.max_body_bytes:
            return _too_large(self.settings.max_body_bytes)
        return None

    def _bounded(self, receive):
        """``receive``, raising _BodyTooLarge once a body sent without a length passes the bound."""
        received = 0

        async def bounded():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.settings.max_body_bytes:
                    raise _BodyTooLarge()
            return message

        return bounded


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
           param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code, param), status_code=status, headers=headers)


def _too_large(limit: int) -> JSONResponse:
    return _error(413, f"request body over the server's {limit} bytes (--max-body)", code="request_too_large")


def _validated(model: type[pydantic.BaseModel], data: dict):
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise ProtocolError(422, f"{where}: {first['msg']}", code="invalid_value", param=where) from None


class Server:
    """The routes, over one loaded model."""

    def __init__(self, llm: LLM, settings: ServeSettings):
        self.llm, self.settings = llm, settings
        self.max_prompt_chars = CHARS_PER_TOKEN * llm.context_size
        self.chat_template = ChatTemplate(llm.tokenizer, settings.template_seconds, self.max_prompt_chars)
        self.metrics = ServerMetrics(ram_budget=getattr(llm.engine, "ram", None) is not None)
        self.scheduler: Optional[Scheduler] = None  # made on the event loop, at startup
        self.created = int(time.time())

    # -- requests into jobs --------------------------------------------------

    def _check(self, request: CompletionRequest | ChatCompletionRequest) -> None:
        if request.model != self.settings.model_id:
            raise ProtocolError(404, f"model {request.model!r} does not exist; this server has "
                                f"{self.settings.model_id!r}", code="model_not_found", param="model")
        unsupported = [name for name, used in request.unsupported().items() if used]
        if unsupported:
            raise ProtocolError(400, f"{unsupported[0]}: not supported by this server (leave it out)",
                                code="unsupported_parameter", param=unsupported[0])

    async def _job(self, prompt: str | list[int], max_tokens: Optional[int], request) -> Job:
        """The generation to queue, its prompt checked now (a refusal is a 400, not a queued failure)."""
        try:
            prompt_ids = await asyncio.to_thread(self.llm.prompt_ids, prompt)
        except PromptTooLong as exc:
            raise ProtocolError(400, str(exc), code="context_length_exceeded", param="prompt") from None
        except SettingError as exc:
            raise ProtocolError(400, str(exc), param="prompt") from None
        room = self.llm.context_size - len(prompt_ids)  # generation stops at the window's end: "length"
        return Job(prompt_ids, room if max_tokens is None else min(max_tokens, room), request.sampling(),
                   request.stop_strings())

    async def _completion_job(self, request: CompletionRequest) -> Job:
        prompt = request.prompt[0] if isinstance(request.prompt, list) and isinstance(request.prompt[0], str) \
            else request.prompt
        if isinstance(prompt, str) and len(prompt) > self.max_prompt_chars:
            raise ProtocolError(400, f"the prompt is longer than {self.max_prompt_chars:,} characters: more than the "
                                f"model's context window of {self.llm.context_size} tokens can hold",
                                code="context_length_exceeded", param="prompt")
        return await self._job(prompt, request.max_tokens, request)

    async def _chat_job(self, request: ChatCompletionRequest) -> Job:
        messages = [m.for_template() for m in request.messages]
        try:
            ids = await asyncio.to_thread(self.chat_template.prompt_ids, messages)
        except ChatTemplateError as exc:
            raise ProtocolError(400, str(exc), code=exc.code, param="messages") from None
        except RendererClosed:
            raise ShuttingDown() from None
        limit = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        return await self._job(ids, limit, request)

    # -- routes ----------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = _validated(CompletionRequest, read_json_object(await request.body()))
        self._check(body)
        return await self._respond(request, body, self._completion_job, Reply(False, self.settings.model_id))

    async def chat_completions(self, request: Request) -> Response:
        body = _validated(ChatCompletionRequest, read_json_object(await request.body()))
        self._check(body)
        return await self._respond(request, body, self._chat_job, Reply(True, self.settings.model_id))

    async def _respond(self, request: Request, body, make_job: Callable[..., Awaitable[Job]], reply: Reply) -> Response:
        # QueueFull (503) now: before the prompt is rendered and tokenized, so that --max-queue bounds that
        # work too, and before any response has started.
        ticket = self.scheduler.admit()
        try:
            job = await make_job(body)
        except BaseException:
            ticket.leave()
            raise
        if body.stream:
            return _EventStream(self._events(job, ticket, reply, body.include_usage()), on_close=ticket.leave)
        try:
            text = await _unless_disconnected(request, self._text(job, ticket))
        finally:
            ticket.leave()
        if text is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        return JSONResponse(reply.body(text, job.finish_reason, self._usage(job)))

    async def _text(self, job: Job, ticket: Ticket) -> str:
        return "".join([piece async for piece in self.scheduler.run(job, ticket)])

    def _usage(self, job: Job) -> dict:
        return usage(len(job.prompt_ids), job.stats.generated_tokens)

    async def _events(self, job: Job, ticket: Ticket, reply: Reply, with_usage: bool) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's chunk format, ending with ``[DONE]``; an error after the stream
        has started is an ``error`` event, as OpenAI's clients expect."""
        opening = reply.first_chunk(with_usage)  # sent once the model is working on this request
        try:
            async for piece in self.scheduler.run(job, ticket):
                if opening is not None:
                    yield _sse(opening)
                    opening = None
                yield _sse(reply.chunk(piece, with_usage=with_usage))
            if opening is not None:
                yield _sse(opening)
            yield _sse(reply.chunk("", job.finish_reason, with_usage=with_usage))
            if with_usage:
                yield _sse(reply.usage_chunk(self._usage(job)))
        except ShuttingDown as exc:
            yield _sse(error_body(str(exc), "server_error", "server_shutting_down"))
        except Exception as exc:
            log.exception("generation failed")
            yield _sse(error_body(f"generation failed: {type(exc).__name__}", "server_error"))
        yield "data: [DONE]\n\n"

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model"] != self.settings.model_id:
            raise ProtocolError(404, f"model {request.path_params['model']!r} does not exist",
                                code="model_not_found")
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.settings.model_id, "object": "model", "created": self.created, "owned_by": "pitools",
                "context_window": self.llm.context_size, "description": self.llm.description}

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request: Request) -> Response:
        s = self.scheduler
        return PlainTextResponse(self.metrics.exposition(s.waiting, s.running, s.parallel, s.decoder),
                                 media_type="text/plain; version=0.0.4")

    # -- stopping ----------------------------------------------------------------

    def shut_down(self) -> None:
        """The server has begun to stop (uvicorn_server.py calls this first): streams end with an error
        event and ``[DONE]``, requests still waiting or being rendered get a 503."""
        self.scheduler.shut_down()
        self.chat_template.close()

    def close(self) -> None:
        self.scheduler.close()
        self.chat_template.close()


class _EventStream(StreamingResponse):
    """A stream whose place in the queue is given back however it ends, even if it never started
    (its client gone before the first byte)."""

    def __init__(self, events: AsyncIterator[str], on_close):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events, self._on_close = events, on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # runs the generator's cleanup now: the job is cancelled at once
            self._on_close()


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _unless_disconnected(request: Request, work) -> Optional[str]:
    """``work``'s result, or None (and ``work`` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return None
    return task.result()


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(llm: LLM, settings: ServeSettings) -> Starlette:
    server = Server(llm, settings)
    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_text, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.model, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
    ]
    handlers = {
        ProtocolError: lambda _, exc: _error(exc.status, exc.message, exc.kind, exc.code, exc.param, exc.headers),
        QueueFull: lambda _, exc: _error(503, str(exc), "server_error", "queue_full",
                                         headers={"Retry-After": str(exc.retry_after)}),
        ShuttingDown: lambda _, exc: _error(503, str(exc), "server_error", "server_shutting_down"),
        ClientDisconnect: lambda _, exc: Response(status_code=499),  # gone while sending its body: nobody to answer
        _BodyTooLarge: lambda _, exc: _too_large(settings.max_body_bytes),
        HTTPException: lambda _, exc: _error(exc.status_code, _HTTP_MESSAGES.get(exc.status_code, exc.detail),
                                             code="not_found" if exc.status_code == 404 else None),
        Exception: _internal_error,
    }

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.scheduler = Scheduler(llm, settings.max_queue, server.metrics, settings.parallel,
                                     settings.prompt_cache_bytes)
        try:
            yield
        finally:
            server.close()

    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan,
                    middleware=[Middleware(_Guard, settings=settings, metrics=server.metrics,
                                           routes={r.path for r in routes if "{" not in r.path})])
    app.state.server = server
    return app


_HTTP_MESSAGES = {404: "no such route (the API is under /v1: /v1/completions, /v1/chat/completions, /v1/models)",
                  405: "method not allowed on this route"}


def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("internal error on %s", request.url.path, exc_info=exc)
    return _error(500, f"internal server error ({type(exc).__name__}); the server's log has the details",
                  "server_error")

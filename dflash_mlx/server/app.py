"""The OpenAI-compatible routes (FastAPI), over one ``Engine``.

``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions`` and
``POST /v1/completions``, streamed as server-sent events (sse-starlette,
ending with ``data: [DONE]``) or not; Anthropic's ``POST /v1/messages`` is
registered from ``anthropic``, OpenAI's ``POST /v1/responses`` from ``responses``. A chat reply comes split into
``content``, ``reasoning_content`` and ``tool_calls`` (``parts``). Every
request is checked before it is queued, so bad input gets a 4xx with an
OpenAI-shaped error and never reaches the worker. Prompts are tokenized on a thread of their own, so a long one never
holds up the event loop. A client that goes away cancels its request; when the
server shuts down, every request in flight ends with a 503 error (streamed as
a last event before ``[DONE]``).
"""

import asyncio
import hmac
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from dataclasses import dataclass
from typing import Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from .. import structured, validate
from ..errors import DFlashError
from ..loop import SamplingParams
from ..precision import dtype_name
from . import anthropic, images, responses
from . import engine as eng
from .errors import APIError
from .logprobs import Logprobs, Picked
from .parts import ReplySplitter, initial_state
from .prefix_checkpoints import last_turn_start
from .prompts import chat_ids, completion_ids, unicode_text
from .schemas import ChatRequest, CompletionRequest, Sampling


@dataclass
class Settings:
    model_name: str  # the id /v1/models lists and responses carry
    max_tokens_limit: int = 4096
    api_key: Optional[str] = None
    enable_thinking: Optional[bool] = None  # the chat template's default for this target


class BearerAuth:
    """ASGI middleware: every route needs ``Authorization: Bearer <key>`` or
    (as Anthropic's clients send it) ``x-api-key: <key>``."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
            if not bearer and not hmac.compare_digest(headers.get(b"x-api-key", b""), self.key):
                error = APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' "
                                      "or 'x-api-key: <key>'", code="invalid_api_key")
                return await _error_response(scope["path"], error)(scope, receive, send)
        await self.app(scope, receive, send)


def _error_response(path: str, error: APIError) -> JSONResponse:
    """The error in the shape of the API ``path`` belongs to: Anthropic's on its Messages routes."""
    return anthropic.error_response(error) if anthropic.speaks_anthropic(path) else error.response()


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        return APIError(400, "the body must be a JSON object")
    param = ".".join(loc) or None
    where = f"{param}: " if param else "the body: "
    return APIError(400, where + first["msg"], param)


def _sampling(body: Sampling, vocab_size: int) -> dict:
    """stream_generate's sampling arguments, checked here so errors come before streaming."""
    bias = None
    if body.logit_bias:
        try:
            bias = {int(k): float(v) for k, v in body.logit_bias.items()}
            validate.logit_bias(bias, vocab_size)
        except (ValueError, DFlashError) as e:
            message = str(e) if isinstance(e, DFlashError) else "logit_bias keys must be token ids"
            raise APIError(400, message, "logit_bias") from None
        if any(not -100 <= v <= 100 for v in bias.values()):
            raise APIError(400, "logit_bias values must be in [-100, 100]", "logit_bias")
    sampling = dict(
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        seed=body.seed, repetition_penalty=body.repetition_penalty,
        repetition_context_size=body.repetition_context_size,
        presence_penalty=body.presence_penalty or None,
        frequency_penalty=body.frequency_penalty or None, logit_bias=bias,
    )
    try:
        SamplingParams(**sampling).validate()
    except DFlashError as e:
        raise APIError(400, str(e)) from None
    return {**sampling, "response_format": body.response_format}


def _check_format(response_format: Optional[dict], tokenizer, vocab_size: int) -> None:
    """A 400 naming ``response_format`` when it does not compile for this tokenizer."""
    try:
        structured.constraint_for(response_format, tokenizer, vocab_size)
    except DFlashError as e:
        raise APIError(400, str(e), "response_format") from None


def _max_tokens(body: Sampling, prompt_tokens: int, settings: Settings, context: Optional[int]) -> int:
    asked = body.requested_max_tokens()
    if asked is not None and asked > settings.max_tokens_limit:
        raise APIError(400, f"max_tokens {asked} is above this server's limit of "
                            f"{settings.max_tokens_limit} (--max-tokens-limit)", "max_tokens")
    if context is not None and prompt_tokens + (asked or 1) > context:
        raise APIError(
            400, f"the prompt is {prompt_tokens} tokens and {asked or 1} more were asked for, "
                 f"over this model's context of {context} tokens",
            "messages" if isinstance(body, ChatRequest) else "prompt", "context_length_exceeded",
        )
    limit = settings.max_tokens_limit if context is None else min(settings.max_tokens_limit, context - prompt_tokens)
    return asked or limit


def create_app(engine: eng.Engine, settings: Settings) -> FastAPI:
    """The ASGI app serving ``engine`` (already started)."""
    app = FastAPI(title="dflash-mlx", docs_url=None, redoc_url=None, openapi_url=None)
    version = metadata.version("dflash-mlx")
    pair = {"target": engine.model_id, "draft": engine.draft_id, "block_size": engine.block_size,
            "draft_vocab": engine.draft_vocab, "draft_dtype": dtype_name(engine.draft), "dflash_mlx": version}
    fingerprint = f"dflash-mlx-{version} target={engine.model_id} draft={engine.draft_id}"
    # one at a time: a tokenizer is not meant to encode on two threads at once
    tokenizing = ThreadPoolExecutor(1, thread_name_prefix="dflash-mlx-tokenize")
    if settings.api_key is not None:
        app.add_middleware(BearerAuth, key=settings.api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return _error_response(request.url.path, _validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        error = APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")
        return _error_response(request.url.path, error)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception):
        return _error_response(request.url.path, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.get("/health")
    async def health():
        # active: requests admitted and not done; rows of them decoding now, waiting for a row
        return {"status": "ok", "model": settings.model_name, "pair": pair, "active": engine.active,
                "rows": engine.rows, "waiting": engine.waiting, "max_concurrency": engine.width,
                "max_queue": engine.max_queue, **engine.stats}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": settings.model_name, "object": "model", "created": engine.started, "owned_by": "dflash-mlx",
             "pair": pair}
        ]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        job, splitter = await _chat(body)
        return await _complete(body, job, request, splitter)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        ids = await _tokenized(completion_ids, engine.tokenizer, _checked(body), engine.vocab_size)
        return await _complete(body, await _queued(body, ids, None), request, None)

    async def _chat(body: ChatRequest, sources: Optional[list[images.Source]] = None) -> tuple[eng.Job, ReplySplitter]:
        """A chat request checked, through its template, its images read (``sources``:
        its own image parts unless given) and queued, with the splitter of its reply."""
        ids = await _tokenized(chat_ids, engine.tokenizer, _checked(body), settings.enable_thinking)
        pictures = await images.read(body.image_sources() if sources is None else sources, engine.image_refusal)
        splitter = ReplySplitter(engine.tokenizer, ids, body.called_tools())
        return await _queued(body, ids, splitter, pictures, await _turn_marks(body, ids)), splitter

    async def _turn_marks(body: ChatRequest, ids: list[int]) -> list[int]:
        """Where the prefix cache checkpoints a chat's prompt ``ids`` on a hybrid target: where its last turn starts."""
        if not engine.prefix_cache.checkpointing:
            return []
        turn = await _tokenized(last_turn_start, engine.tokenizer, body, ids, settings.enable_thinking)
        return [turn] if turn else []

    async def _tokenized(prompt_ids, *args) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(tokenizing, prompt_ids, *args)

    def _checked(body: Union[ChatRequest, CompletionRequest]):
        problem = body.unsupported()
        if problem:
            raise APIError(400, problem[1], problem[0], "unsupported_value")
        return body

    async def _queued(body: Sampling, ids: list[int], splitter: Optional[ReplySplitter], pictures=(),
                      marks=()) -> eng.Job:
        """The request's job, once its ``response_format`` compiles (for a chat, after any thinking block)."""
        if body.response_format is not None:  # compiled off the event loop, like prompts
            if splitter is not None and initial_state(engine.tokenizer, ids) == "reasoning":
                # the prompt leaves a thinking block open: the grammar holds the answer after it
                body.response_format = {"after": engine.tokenizer.think_end, **body.response_format}
            await _tokenized(_check_format, body.response_format, engine.tokenizer, engine.vocab_size)
        return _submit(body, ids, pictures, marks)

    async def _complete(body: Sampling, job: eng.Job, request: Request, splitter: Optional[ReplySplitter]):
        """Run the request's job; a chat one (with a ``splitter``) replies in parts."""
        logprobs = None if body.top_logprobs_asked() is None else Logprobs(engine.tokenizer)
        reply = Reply(settings.model_name, splitter, fingerprint, logprobs)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            # on shutdown the stream gets a moment to send its error event and [DONE]
            return EventSourceResponse(_stream(job, reply, include_usage), sep="\n", shutdown_grace_period=3)
        return await _collect(job, reply, request)

    def _submit(body: Sampling, ids: list[int], pictures=(), marks=()) -> eng.Job:
        """Queue the request's job, with its images and the prompt positions
        the prefix cache checkpoints at (429 when the queue is full, 503 when shutting down)."""
        job_request = eng.Request(
            prompt=ids,
            max_tokens=_max_tokens(body, len(ids), settings, engine.context_length),
            sampling=_sampling(body, engine.vocab_size),
            stop=[unicode_text(s, "stop") for s in body.stop_strings()],
            logprobs=body.top_logprobs_asked(),
            images=list(pictures),
            marks=list(marks),
        )
        try:
            job = engine.submit(job_request, asyncio.get_running_loop())
        except eng.QueueFull as e:
            raise APIError(429, str(e), code="queue_full") from None
        except eng.ShuttingDown as e:
            raise APIError(503, str(e), code="server_shutting_down") from None
        return job

    async def _stream(job: eng.Job, reply: "Reply", include_usage: bool):
        try:
            if reply.chat:
                yield reply.chunk({"role": "assistant", "content": ""})
            async for event in job.stream():
                if isinstance(event, eng.Delta):
                    reply.picked += event.logprobs
                    if not reply.chat:
                        yield reply.chunk(event.text)
                    elif parts := reply.splitter.feed(event.text):
                        yield reply.chunk(parts.delta())
                elif isinstance(event, eng.Failed):
                    yield {"data": json.dumps(APIError(event.status, event.message, code=event.code).body())}
                else:
                    if reply.chat and (parts := reply.splitter.finish()):
                        yield reply.chunk(parts.delta())
                    yield reply.chunk({} if reply.chat else "", event)
                    if include_usage:
                        yield reply.usage_chunk(event.usage)
            yield {"data": "[DONE]"}
        finally:  # also when the client disconnects: the slot is freed at once
            engine.cancel(job)

    async def _collect(job: eng.Job, reply: "Reply", request: Request):
        watcher = asyncio.create_task(_cancel_on_disconnect(job, request))
        try:
            text = []
            async for event in job.stream():
                if isinstance(event, eng.Delta):
                    text.append(event.text)
                    reply.picked += event.logprobs
                elif isinstance(event, eng.Failed):
                    raise APIError(event.status, event.message, code=event.code)
                else:
                    return reply.whole("".join(text), event)
        finally:
            watcher.cancel()
            engine.cancel(job)

    async def _cancel_on_disconnect(job: eng.Job, request: Request):
        while not await request.is_disconnected():
            await asyncio.sleep(0.2)
        engine.cancel(job)
        job.events.put_nowait(eng.Finished("cancelled", eng.Usage(len(job.request.prompt))))

    anthropic.add_routes(app, engine, settings.model_name, settings.enable_thinking,
                         tokenized=_tokenized, submit=_submit, marks=_turn_marks, watch=_cancel_on_disconnect)
    responses.add_routes(app, engine, settings.model_name, chat=_chat, watch=_cancel_on_disconnect)
    return app


class Reply:
    """Response and chunk bodies of one chat (with the splitter of its text)
    or text completion; with ``logprobs``, each body carries the log-probabilities
    of the tokens ``picked`` since the last one."""

    def __init__(self, model: str, splitter: Optional[ReplySplitter], fingerprint: Optional[str] = None,
                 logprobs: Optional[Logprobs] = None):
        self.model, self.splitter, self.chat = model, splitter, splitter is not None
        self.fingerprint, self.logprobs = fingerprint, logprobs
        self.picked: list[Picked] = []
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def ending(self, done: Optional[eng.Finished]) -> dict:
        """A choice's ``finish_reason`` (``tool_calls`` for a chat that ended
        by itself after calling a tool; None before the end) and, for a reply
        that left its grammar ("error"), the ``error`` saying why."""
        if done is None:
            return {"finish_reason": None}
        reason = done.finish_reason
        ending = {"finish_reason": "tool_calls" if reason == "stop" and self.chat and self.splitter.calls else reason}
        if done.error:
            ending["error"] = APIError(400, done.error, "response_format").body()["error"]
        return ending

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def _logprobs(self) -> Optional[dict]:
        """The picked tokens' log-probabilities in this kind of reply's shape (then forgotten)."""
        picked, self.picked = self.picked, []
        if self.logprobs is None or not picked:
            return None
        return self.logprobs.chat(picked) if self.chat else self.logprobs.completion(picked)

    def chunk(self, content: Union[dict, str], done: Optional[eng.Finished] = None) -> dict:
        """A streamed chunk; the last one (``done``) says how the reply ended."""
        choice = {"index": 0, "delta" if self.chat else "text": content, "logprobs": self._logprobs(),
                  **self.ending(done)}
        body = self._base("chat.completion.chunk" if self.chat else "text_completion") | {"choices": [choice]}
        return {"data": json.dumps(body)}

    def usage_chunk(self, usage: eng.Usage) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"data": json.dumps(self._base(obj) | {"choices": [], "usage": usage.to_dict()})}

    def whole(self, text: str, done: eng.Finished) -> dict:
        usage = done.usage
        if self.chat:
            parts = self.splitter.feed(text) + self.splitter.finish()
            message = {"role": "assistant", "content": parts.content or (None if parts.tool_calls else "")}
            if parts.reasoning:
                message["reasoning_content"] = parts.reasoning
            if parts.tool_calls:
                message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in parts.tool_calls]
            choice = {"index": 0, "message": message, "logprobs": self._logprobs(), **self.ending(done)}
            return self._base("chat.completion") | {"choices": [choice], "usage": usage.to_dict()}
        choice = {"index": 0, "text": text, "logprobs": self._logprobs(), **self.ending(done)}
        return self._base("text_completion") | {"choices": [choice], "usage": usage.to_dict()}

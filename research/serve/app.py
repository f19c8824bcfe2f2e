"""An OpenAI-compatible HTTP server over the engine: completions, chat, models, health, metrics.

One ``EngineLoop`` (``engine_loop.py``) owns the engine. Its background thread is the only caller: it
runs the commands HTTP handlers post on a thread-safe queue (add a request, abort one) between
steps, steps while there is work, and hands every ``RequestOutput`` to the asyncio queue of its
request with ``call_soon_threadsafe``. A new request therefore joins the running batch at the
next step, and a blocking JAX step never stalls the event loop.

Nothing heavy runs on the event loop: the body is refused with 413 past ``max_body_bytes``
(from ``Content-Length`` before it is read), a text prompt longer in bytes than any prompt of
``max_model_len`` tokens is refused before tokenization, and tokenization and chat templating
run in worker threads. So no request can keep ``/health`` waiting.

Streaming responses are server-sent events in OpenAI's chunk format, one chunk per generated token
(its text may be empty while a multi-byte character is incomplete or a stop string may be
starting), a final chunk with the finish reason, an optional usage chunk, then ``data: [DONE]``.
With vLLM's ``"return_token_ids": true`` each choice (or chunk) also carries its token ids.

Errors are OpenAI-style JSON (``{"error": {"message", "type", "param", "code"}}``) for every
status: 400 for bad input (the engine's and SamplingParams' ValueError messages), 401 for a
wrong API key (every ``/v1/`` path needs it when one is set), 404, 405, 413, 415 for a body
that is not JSON, 422, 429 with ``Retry-After`` when the waiting queue is full, 500 for a
request the engine failed (only that request: the engine isolates it). A client that
disconnects, streaming or not, aborts its request at once, so its KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from research.engine.engine import Engine
from research.engine.request import RequestOutput
from research.serve import protocol
from research.serve.engine_loop import EngineLoop
from research.serve.errors import APIError
from research.serve.metrics import prometheus_text

DEFAULT_MAX_BODY_BYTES = 8 << 20


class _RequireAPIKey:
    """ASGI middleware: every ``/v1/`` path (unknown ones too) needs ``Authorization: Bearer
    KEY``; the scheme is case-insensitive (RFC 7235) and the key compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.strip().partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)):
                error = APIError(401, "invalid or missing API key", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _EventStream(StreamingResponse):
    """A StreamingResponse that treats the client leaving as the normal end it is (no
    traceback) and always closes its generator, whose ``finally`` aborts the request."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):
            pass
        finally:
            await self.body_iterator.aclose()


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body: 415 if it is declared as something other than JSON, 413 past
    ``max_bytes`` (from ``Content-Length`` before reading, else while reading)."""
    content_type = request.headers.get("content-type")
    if content_type is not None:
        media = content_type.split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise APIError(415, f"the body must be application/json, got {media!r}")
    too_large = APIError(413, f"the request body is larger than {max_bytes} bytes")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _until_disconnected(request: Request) -> None:
    """Returns when the client has gone (the body must have been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(
    llm_or_engine: Any,
    *,
    served_model_name: str,
    max_waiting: int = 256,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The ASGI app serving ``llm_or_engine`` (an ``LLM`` or an ``Engine``) as
    ``served_model_name``; its ``EngineLoop`` starts and stops with the app's lifespan and is
    ``app.state.engine_loop``."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    engine: Engine = getattr(llm_or_engine, "engine", llm_or_engine)
    engine_loop = EngineLoop(engine, max_waiting)
    prompt_byte_limit = protocol.max_prompt_bytes(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        try:
            yield
        finally:
            engine_loop.stop()

    app = FastAPI(title="research OpenAI-compatible server", lifespan=lifespan)
    app.state.engine_loop = engine_loop
    if api_key is not None:
        app.add_middleware(_RequireAPIKey, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return APIError(error.status_code, str(error.detail), headers=error.headers).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return APIError(422, f"the request is malformed: {error.errors()}").response()

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, error: ClientDisconnect) -> Response:
        return Response(status_code=400)  # nobody reads it: the client is gone

    async def served_body(request: Request) -> dict:
        """The JSON body of a request to this server's model (400 naming the model otherwise)."""
        body = protocol.parse_json_body(await _read_body(request, max_body_bytes))
        model = body.get("model", served_model_name)
        if model != served_model_name:
            raise APIError(
                400,
                f"the model {protocol.short(model)} does not exist; this server serves "
                f"{served_model_name!r}",
                code="model_not_found",
            )
        return body

    async def parse(request: Request, chat: bool) -> dict:
        """The checked JSON body of a generation request: every field but the prompt is
        checked here, before any tokenization is paid for."""
        body = await served_body(request)
        protocol.sampling_params(body, default_max_tokens=1, chat=chat)
        for name, kind in (("stream", bool), ("stream_options", dict), ("return_token_ids", bool)):
            protocol.field(body, name, kind)
        return body

    async def tokenize(text: str) -> list[int]:
        try:
            return await asyncio.to_thread(engine.tokenizer.encode, text)
        except Exception as error:  # text the tokenizer cannot take is the client's error
            raise APIError(400, f"the prompt could not be tokenized: {error}") from None

    async def render_chat(messages: list[dict]) -> list[int]:
        try:
            return await asyncio.to_thread(engine.tokenizer.apply_chat_template, messages, True)
        except Exception as error:  # e.g. roles the template refuses
            raise APIError(400, f"the chat template could not render: {error}") from None

    async def generate(
        request: Request, body: dict, prompt_ids: list[int], prompt: str | None, chat: bool
    ) -> Response:
        default_max = 16 if not chat else max(1, engine.max_model_len - len(prompt_ids))
        params = protocol.sampling_params(body, default_max, chat=chat)
        stream = protocol.field(body, "stream", bool, False)
        options = protocol.field(body, "stream_options", dict) or {}
        include_usage = bool(options.get("include_usage"))
        return_token_ids = protocol.field(body, "return_token_ids", bool, False)  # as vLLM
        request_id, outputs = await engine_loop.add(prompt_ids, params, prompt)
        kind = "chatcmpl" if chat else "cmpl"
        header = {
            "id": f"{kind}-{request_id}",
            "created": int(time.time()),
            "model": served_model_name,
        }
        detok = protocol.Detokenizer(engine, params)

        def logprobs_json(out: RequestOutput, start: int, offset: int = 0) -> dict | None:
            """The choice's ``logprobs`` for tokens ``start:`` of ``out`` (None if not asked)."""
            if params.logprobs is None or out.logprobs is None:
                return None
            ids, entries = out.token_ids[start:], out.logprobs[start:]
            if chat:
                return protocol.chat_logprobs(ids, entries, params.logprobs)
            return protocol.completion_logprobs(ids, entries, offset)

        def usage(out: RequestOutput) -> dict:
            n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
            return {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out,
            }

        async def next_output() -> RequestOutput:
            out = await outputs.get()
            if isinstance(out, Exception):
                raise APIError(500, f"the engine failed: {out}")
            if out.finish_reason == "error":
                raise APIError(500, f"the engine failed this request: {out.error}")
            return out

        async def final_output() -> RequestOutput:
            while not (out := await next_output()).finished:
                pass
            return out

        if not stream:
            result = asyncio.ensure_future(final_output())
            left = asyncio.ensure_future(_until_disconnected(request))
            try:
                await asyncio.wait({result, left}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                left.cancel()
                if not result.done():  # the client left (or this handler was cancelled)
                    result.cancel()
                    engine_loop.abort(request_id)
            if not result.done() or result.cancelled():
                return Response(status_code=499)  # nobody reads it: the client is gone
            out = result.result()
            if chat:
                choice = {"message": {"role": "assistant", "content": out.text}}
                obj = "chat.completion"
            else:
                choice, obj = {"text": out.text}, "text_completion"
            choice = {
                "index": 0,
                **choice,
                "logprobs": logprobs_json(out, 0),
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            }
            if params.prompt_logprobs is not None:
                choice["prompt_logprobs"] = protocol.prompt_logprobs_json(out.prompt_logprobs)
            if return_token_ids:
                choice |= {"prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids}
            return JSONResponse({**header, "object": obj, "choices": [choice], "usage": usage(out)})

        obj = "chat.completion.chunk" if chat else "text_completion"

        sent_ids = 0  # tokens whose ids and logprobs went out
        sent_chars = 0  # text_offset of the next token's logprobs

        def chunk(
            text: str, finish_reason: str | None, first: bool = False, out: Any = None
        ) -> dict:
            nonlocal sent_ids, sent_chars
            if chat:
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                choice = {"delta": delta}
            else:
                choice = {"text": text}
            lp = None if out is None else logprobs_json(out, sent_ids, sent_chars)
            choice = {"index": 0, **choice, "logprobs": lp, "finish_reason": finish_reason}
            if finish_reason is not None:
                choice["stop_reason"] = out.stop_reason
                if params.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = protocol.prompt_logprobs_json(out.prompt_logprobs)
            if lp is not None and not chat:
                sent_chars += sum(len(t) for t in lp["tokens"])
            if return_token_ids and out is not None:
                choice["token_ids"] = out.token_ids[sent_ids:]
            if out is not None:
                sent_ids = len(out.token_ids)
            return {**header, "object": obj, "choices": [choice]}

        async def events() -> AsyncIterator[str]:
            finished = False
            try:
                if chat:
                    yield _sse(chunk("", None, first=True))
                while True:
                    try:
                        out = await next_output()
                    except APIError as error:
                        finished = True  # the engine already dropped it
                        yield _sse(error.body())
                        break
                    yield _sse(chunk(detok.delta(out), out.finish_reason, out=out))
                    if out.finished:
                        finished = True
                        if include_usage:
                            yield _sse(
                                {**header, "object": obj, "choices": [], "usage": usage(out)}
                            )
                        break
                yield _sse("[DONE]")
            finally:  # the client went away (generator closed or cancelled): free the request
                if not finished:
                    engine_loop.abort(request_id)

        return _EventStream(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse(request, chat=False)
        prompt = protocol.completion_prompt(body, engine, prompt_byte_limit)
        if isinstance(prompt, str):
            return await generate(request, body, await tokenize(prompt), prompt, chat=False)
        return await generate(request, body, prompt, None, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse(request, chat=True)
        messages = protocol.chat_messages(body, engine, prompt_byte_limit)
        return await generate(request, body, await render_chat(messages), None, chat=True)

    async def tokenizer_body(request: Request) -> dict:
        body = await served_body(request)
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return body

    @app.post("/tokenize")
    async def tokenize_endpoint(request: Request) -> dict:
        """vLLM's /tokenize: a ``prompt`` string, or chat ``messages`` rendered by the
        template -> ``{"count", "max_model_len", "tokens"}``."""
        body = await tokenizer_body(request)
        if "messages" in body:
            ids = await render_chat(protocol.chat_messages(body, engine, prompt_byte_limit))
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise APIError(400, "'prompt' must be a string (or send 'messages')")
            protocol.check_prompt_bytes(engine, len(prompt.encode("utf-8")), prompt_byte_limit)
            ids = await tokenize(prompt)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize_endpoint(request: Request) -> dict:
        """vLLM's /detokenize: ``tokens`` (ids in the vocabulary) -> ``{"prompt": text}``."""
        body = await tokenizer_body(request)
        tokens = body.get("tokens")
        vocab = engine.model_config.vocab_size
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        ):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})")
        if len(tokens) > 4 * engine.max_model_len:
            raise APIError(
                400, f"'tokens' has {len(tokens)} ids; at most {4 * engine.max_model_len}"
            )
        text = await asyncio.to_thread(engine.tokenizer.decode, tokens, False)
        return {"prompt": text}

    @app.get("/v1/models")
    async def models() -> dict:
        entry = {
            "id": served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "research",
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.model_config.vocab_size,
        }
        return {"object": "list", "data": [entry]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            # This handler runs on the event loop's thread: its CPU clock is the server's.
            prometheus_text(engine_loop, served_model_name, time.thread_time()),
            media_type="text/plain; version=0.0.4",
        )

    return app


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"

"""An OpenAI-compatible HTTP server over the engine: completions, chat, models, health, metrics.

One ``EngineLoop`` (``engine_loop.py``) owns the engine. Its background thread is the only caller: it
runs the commands HTTP handlers post on a thread-safe queue (add a request, abort one) between
steps, steps while there is work, and hands every ``RequestOutput`` to the asyncio queue of its
request with ``call_soon_threadsafe``. A new request therefore joins the running batch at the
next step, and a blocking JAX step never stalls the event loop.

Streaming responses are server-sent events in OpenAI's chunk format, one chunk per generated token
(its text may be empty while a multi-byte character is incomplete), a final chunk with the
finish reason, an optional usage chunk, then ``data: [DONE]``. Text is detokenized incrementally:
the whole token list is decoded each time and the new suffix is sent.

Errors are OpenAI-style JSON (``{"error": {"message", "type", "param", "code"}}``): 400 for bad
input (the engine's and SamplingParams' ValueError messages), 401 for a wrong API key, 429 with
``Retry-After`` when the waiting queue is full. A client that disconnects mid-stream aborts its
request, so its KV blocks return to the pool. Nothing a client sends stops the engine.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from research.engine.engine import Engine
from research.engine.request import RequestOutput, SamplingParams
from research.serve.engine_loop import APIError, EngineLoop


def _field(body: dict, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """``body[name]`` checked against ``kind`` (a bool is no number); ``default`` if absent."""
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise APIError(400, f"'{name}' has the wrong type: {value!r}")
    return value


def _sampling_params(body: dict, default_max_tokens: int) -> SamplingParams:
    if _field(body, "n", int, 1) != 1:
        raise APIError(400, "only n=1 is supported")
    stop = _field(body, "stop", (str, list)) or ()
    max_tokens = _field(body, "max_completion_tokens", int) or _field(body, "max_tokens", int)
    try:
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=float(_field(body, "temperature", (int, float), 1.0)),
            top_p=float(_field(body, "top_p", (int, float), 1.0)),
            top_k=_field(body, "top_k", int, 0),
            seed=_field(body, "seed", int),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(_field(body, "stop_token_ids", list) or ()),
            ignore_eos=_field(body, "ignore_eos", bool, False),
            skip_special_tokens=_field(body, "skip_special_tokens", bool, True),
        )
    except (ValueError, TypeError) as error:
        raise APIError(400, str(error)) from None


def _completion_prompt(body: dict, engine: Engine) -> tuple[list[int], str | None]:
    """``prompt``: a string, a list of token ids, or a one-element list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids")
        if not prompt:
            raise APIError(400, "prompt is empty")
        return engine.tokenizer.encode(prompt), prompt
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return prompt, None
    raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt per request)")


def _chat_prompt(body: dict, engine: Engine) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"each message needs a 'role' and a 'content', got {m!r}")
        if not isinstance(m.get("content"), str):
            raise APIError(400, "message 'content' must be a string")
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so chat is unavailable")
    try:
        return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as error:
        raise APIError(400, str(error)) from None


# ---------------------------------------------------------------------------- the app


class _Detokenizer:
    """Incremental text: decode all tokens so far and return the part not yet sent. A trailing
    incomplete character (U+FFFD) and, with stop strings, a possible stop-string prefix are held
    back until more tokens (or the end) settle them."""

    def __init__(self, engine: Engine, params: SamplingParams):
        self.tokenizer = engine.tokenizer
        self.params = params
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.sent = ""

    def delta(self, out: RequestOutput) -> str:
        if self.tokenizer is None:
            return ""
        if out.finished:
            text = out.text
        else:
            text = self.tokenizer.decode(out.token_ids, self.params.skip_special_tokens)
            text = text[: len(text) - self.hold].rstrip("\ufffd")
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def create_app(
    llm_or_engine: Any,
    *,
    served_model_name: str,
    max_waiting: int = 256,
    api_key: str | None = None,
) -> FastAPI:
    """The ASGI app serving ``llm_or_engine`` (an ``LLM`` or an ``Engine``) as
    ``served_model_name``; its ``EngineLoop`` starts and stops with the app's lifespan and is
    ``app.state.engine_loop``."""
    engine: Engine = getattr(llm_or_engine, "engine", llm_or_engine)
    engine_loop = EngineLoop(engine, max_waiting)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        try:
            yield
        finally:
            engine_loop.stop()

    app = FastAPI(title="research OpenAI-compatible server", lifespan=lifespan)
    app.state.engine_loop = engine_loop

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    def check_api_key(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")

    async def parse(request: Request) -> dict:
        """The checked JSON body of a generation request."""
        check_api_key(request)
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise APIError(400, f"the request body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model", served_model_name)
        if model != served_model_name:
            raise APIError(
                400,
                f"the model {model!r} does not exist; this server serves {served_model_name!r}",
                code="model_not_found",
            )
        return body

    async def generate(
        body: dict, prompt_ids: list[int], prompt: str | None, chat: bool
    ) -> Response:
        default_max = 16 if not chat else max(1, engine.max_model_len - len(prompt_ids))
        params = _sampling_params(body, default_max)
        stream = _field(body, "stream", bool, False)
        include_usage = bool((_field(body, "stream_options", dict) or {}).get("include_usage"))
        request_id, outputs = await engine_loop.add(prompt_ids, params, prompt)
        kind = "chatcmpl" if chat else "cmpl"
        header = {
            "id": f"{kind}-{request_id}",
            "created": int(time.time()),
            "model": served_model_name,
        }
        detok = _Detokenizer(engine, params)

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
                raise APIError(500, f"the engine failed: {out}", type="server_error")
            return out

        if not stream:
            finished = False
            try:
                while not (out := await next_output()).finished:
                    pass
                finished = True
            finally:
                if not finished:
                    engine_loop.abort(request_id)
            if chat:
                choice = {"message": {"role": "assistant", "content": out.text}}
                obj = "chat.completion"
            else:
                choice, obj = {"text": out.text}, "text_completion"
            choice = {"index": 0, **choice, "logprobs": None, "finish_reason": out.finish_reason}
            return JSONResponse({**header, "object": obj, "choices": [choice], "usage": usage(out)})

        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str, finish_reason: str | None, first: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                choice = {"delta": delta}
            else:
                choice = {"text": text}
            choice = {"index": 0, **choice, "logprobs": None, "finish_reason": finish_reason}
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
                        yield _sse(json.loads(error.response().body))
                        break
                    yield _sse(chunk(detok.delta(out), out.finish_reason))
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

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse(request)
        prompt_ids, prompt = _completion_prompt(body, engine)
        return await generate(body, prompt_ids, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse(request)
        return await generate(body, _chat_prompt(body, engine), None, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        check_api_key(request)
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
            prometheus_text(engine_loop, served_model_name),
            media_type="text/plain; version=0.0.4",
        )

    return app


def prometheus_text(engine_loop: EngineLoop, model_name: str) -> str:
    """The server's gauges and counters in Prometheus' text format, ``research:`` prefixed."""
    s, c = engine_loop.stats, engine_loop.counters
    label = f'{{model_name="{model_name}"}}'
    gauges = [
        ("num_requests_running", "Requests in the running batch.", s["num_running"]),
        ("num_requests_waiting", "Requests waiting to be scheduled.", s["num_waiting"]),
        ("kv_blocks_total", "KV-cache blocks in the pool.", s["kv_blocks_total"]),
        ("kv_blocks_free", "KV-cache blocks free (incl. evictable cached).", s["kv_blocks_free"]),
        (
            "kv_blocks_used",
            "KV-cache blocks held by requests.",
            s["kv_blocks_total"] - s["kv_blocks_free"],
        ),
        (
            "prefix_cache_hit_rate",
            "Prefix-cache hits per block queried.",
            s["prefix_cache_hit_rate"],
        ),
        ("num_steps", "Engine steps run.", s["num_steps"]),
    ]
    counters = [
        ("requests_total", "Requests admitted into the engine.", c.requests),
        ("requests_rejected_total", "Requests refused because the queue was full.", c.rejected),
        ("prompt_tokens_total", "Prompt tokens of admitted requests.", c.prompt_tokens),
        ("generation_tokens_total", "Tokens generated.", c.generation_tokens),
    ]
    lines = []
    for kind, rows in (("gauge", gauges), ("counter", counters)):
        for name, help_text, value in rows:
            lines += [f"# HELP research:{name} {help_text}", f"# TYPE research:{name} {kind}"]
            lines.append(f"research:{name}{label} {value}")
    name = "research:request_finished_total"
    lines += [f"# HELP {name} Finished requests by reason.", f"# TYPE {name} counter"]
    for reason, count in sorted(c.finished.items()):
        lines.append(f'{name}{{model_name="{model_name}",finished_reason="{reason}"}} {count}')
    return "\n".join(lines) + "\n"

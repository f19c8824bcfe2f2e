"""Request parsing for the HTTP server: the body, its fields, the prompt, the SamplingParams.

Everything here is cheap and bounded by the byte length of the input, so it runs on the event
loop; tokenization (the one costly part) is left to the caller, which runs it off the loop and
only after the prompt's byte length (``max_prompt_bytes``) has refused text too long to fit the model. Every refusal is an
``APIError`` (400 unless said otherwise) with a reason the client can act on.
"""

from __future__ import annotations

import json
from typing import Any

from research.engine.engine import Engine
from research.engine.request import Logprob, RequestOutput, SamplingParams
from research.serve.errors import APIError


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object; 400 for anything else (bad UTF-8, NaN/Infinity,
    nesting deeper than the parser allows, integers longer than Python converts, strings with
    lone surrogates)."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, int digit limit, NaN
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_strings(body)
    return body


def _check_strings(value: Any) -> None:
    """400 if any string (key or value) in the parsed body is not valid Unicode text."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                raise APIError(400, f"a string in the request is not valid text: {error}") from None


def field(body: dict, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """``body[name]`` checked against ``kind`` (a bool is no number); ``default`` if absent."""
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise APIError(400, f"'{name}' has the wrong type: {short(value)}")
    return value


def short(value: Any, limit: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# OpenAI fields this server does not implement, with the values that ask for nothing (clients
# send some of them by default). Any other value is refused with a 400 naming the field, rather
# than accepted and ignored.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "suffix": (None, ""),
}


def refuse_unsupported(body: dict) -> None:
    """400 naming the first field the request sets that this server would otherwise ignore."""
    for name, neutral in UNSUPPORTED_FIELDS.items():
        if name in body and not any(
            body[name] == v and type(body[name]) is type(v) for v in neutral
        ):
            raise APIError(
                400, f"'{name}' is not supported by this server (got {short(body[name])})"
            )


def requested_logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token the request asks for (None: no logprobs). Completions
    take ``logprobs: n``; chat takes ``logprobs: true`` with ``top_logprobs: n`` (OpenAI's)."""
    if not chat:
        return field(body, "logprobs", int)
    top = field(body, "top_logprobs", int)
    if not field(body, "logprobs", bool, False):
        if top:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true")
        return None
    return top or 0


def sampling_params(body: dict, default_max_tokens: int, chat: bool = False) -> SamplingParams:
    """The request's SamplingParams; SamplingParams itself checks each value's type and range."""
    refuse_unsupported(body)
    if chat and body.get("prompt_logprobs") is not None:
        raise APIError(400, "'prompt_logprobs' is a completions field")
    if field(body, "n", int, 1) != 1:
        raise APIError(400, "only n=1 is supported")
    stop = field(body, "stop", (str, list)) or ()
    max_tokens = field(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = field(body, "max_tokens", int)
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"'{name}' must be at least 1, got {max_tokens}")
    try:
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=field(body, "temperature", (int, float), 1.0),
            top_p=field(body, "top_p", (int, float), 1.0),
            top_k=field(body, "top_k", int, 0),
            seed=field(body, "seed", int),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(field(body, "stop_token_ids", list) or ()),
            ignore_eos=field(body, "ignore_eos", bool, False),
            skip_special_tokens=field(body, "skip_special_tokens", bool, True),
            logprobs=requested_logprobs(body, chat),
            prompt_logprobs=field(body, "prompt_logprobs", int),
        )
    except (ValueError, TypeError) as error:
        raise APIError(400, str(error)) from None


def max_prompt_bytes(engine: Engine) -> int:
    """An upper bound on the UTF-8 bytes of a text prompt that can fit in ``max_model_len``
    tokens: every token covers at most the longest vocabulary entry, and a vocabulary character
    is at most 4 bytes. Text longer than this is refused before it is tokenized."""
    vocab = engine.tokenizer.hf.get_vocab() if engine.tokenizer is not None else {}
    return engine.max_model_len * 4 * max((len(token) for token in vocab), default=1)


def check_prompt_bytes(engine: Engine, num_bytes: int, limit: int) -> None:
    if num_bytes > limit:
        raise APIError(
            400,
            f"the prompt is {num_bytes} bytes: more than any prompt of max_model_len="
            f"{engine.max_model_len} tokens can be ({limit} bytes for this tokenizer)",
        )


def completion_prompt(body: dict, engine: Engine, byte_limit: int) -> list[int] | str:
    """``prompt``: a string, a list of token ids, or a one-element list of either. A string is
    returned as is (to be tokenized off the loop), after its byte-length check."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids")
        if not prompt:
            raise APIError(400, "prompt is empty")
        check_prompt_bytes(engine, len(prompt.encode("utf-8")), byte_limit)
        return prompt
    if isinstance(prompt, list):
        if len(prompt) >= engine.max_model_len:
            raise APIError(
                400, f"prompt has {len(prompt)} tokens; max_model_len is {engine.max_model_len}"
            )
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
    raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt per request)")


def chat_messages(body: dict, engine: Engine, byte_limit: int) -> list[dict]:
    """The checked ``messages`` (their text bytes bounded like a prompt's)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list")
    num_bytes = 0
    checked = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"each message needs a 'role' and a 'content', got {short(m)}")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise APIError(400, f"only text content parts are supported, got {short(part)}")
                if not isinstance(part.get("text"), str):
                    raise APIError(400, "a text content part needs a string 'text'")
                texts.append(part["text"])
            m = {**m, "content": "".join(texts)}
        if not isinstance(m.get("content"), str):
            raise APIError(400, "message 'content' must be a string or a list of text parts")
        checked.append(m)
        num_bytes += len(m["role"].encode("utf-8")) + len(m["content"].encode("utf-8"))
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so chat is unavailable")
    check_prompt_bytes(engine, num_bytes, byte_limit)
    return checked


class Detokenizer:
    """Incremental text: decode all tokens so far and return the part not yet sent.

    While a request runs, the last ``hold`` characters (one less than the longest stop string)
    are held back, since they may begin a stop string that the engine will cut; a trailing
    incomplete character (U+FFFD) is held back too. The final output's text (already cut at a
    stop string by the engine) settles the rest, so the streamed text equals the
    non-streamed one."""

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
            text = text[: max(0, len(text) - self.hold)].rstrip("\ufffd")
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new


def _bytes(text: str | None) -> list[int]:
    return list((text or "").encode("utf-8"))


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], offset: int = 0
) -> dict[str, list]:
    """OpenAI's completions ``logprobs`` object for these tokens; ``offset`` is where their
    text starts in the completion (``text_offset`` counts characters from there)."""
    tokens, token_logprobs, top, text_offset = [], [], [], []
    for token, entry in zip(token_ids, entries, strict=True):
        chosen = entry[token]
        tokens.append(chosen.decoded_token or "")
        token_logprobs.append(chosen.logprob)
        top.append({(lp.decoded_token or ""): lp.logprob for lp in entry.values()})
        text_offset.append(offset)
        offset += len(chosen.decoded_token or "")
    return {
        "text_offset": text_offset,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top,
    }


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], n: int) -> dict:
    """OpenAI's chat ``logprobs`` object: per token its text, log-probability and bytes, with
    the ``n`` most likely alternatives."""
    content = []
    for token, entry in zip(token_ids, entries, strict=True):
        chosen = entry[token]
        alternatives = sorted((lp for lp in entry.values() if lp.rank <= n), key=lambda x: x.rank)
        content.append(
            {
                "token": chosen.decoded_token or "",
                "logprob": chosen.logprob,
                "bytes": _bytes(chosen.decoded_token),
                "top_logprobs": [
                    {
                        "token": lp.decoded_token or "",
                        "logprob": lp.logprob,
                        "bytes": _bytes(lp.decoded_token),
                    }
                    for lp in alternatives[:n]
                ],
            }
        )
    return {"content": content}


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's completions ``prompt_logprobs``: per prompt token None (the first) or
    {token id: {"logprob", "rank", "decoded_token"}}."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in entries
    ]

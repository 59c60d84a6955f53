"""OpenAI-compatible HTTP server: FastAPI app over a background :class:`~openk3.infer.engine.Engine`.

Endpoints: ``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /v1/models``, ``POST /tokenize`` and
``POST /detokenize`` (vLLM's), ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream`` as server-sent events ending in ``data: [DONE]``, and usage
counts). Errors are JSON ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for bad requests;
the server keeps serving after any of them. A client that disconnects (streaming or not) has its request aborted
(pages and slot freed at the next engine step).

Extra request fields beyond OpenAI's (as vLLM accepts them): ``top_k``, ``min_p``, ``min_tokens``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, ``include_stop_str_in_output``,
``allowed_token_ids``, ``bad_words``, ``truncate_prompt_tokens``, ``truncation_side``; structured output
(``response_format``, vLLM's ``guided_*`` and ``structured_outputs``). Fields whose effect the server does not
implement (OpenAI's deprecated ``functions`` / ``function_call``, beam search, vLLM's chat-template options other
than ``chat_template_kwargs``, tools on the completions route, ...: ``_UNSUPPORTED``, ``_UNSUPPORTED_CHAT``, ``_UNSUPPORTED_COMPLETIONS``) are refused with
a 400 unless they ask for nothing; other unknown fields are ignored.

Tool calling (chat, in Kimi's format: :mod:`openk3.infer.tools`), as vLLM serves it with ``--tool-call-parser
kimi_k2 --enable-auto-tool-choice``: ``tools`` are declared in the prompt by the chat template, and assistant
``tool_calls`` and ``tool`` results in the messages are rendered in Kimi's layout. ``tool_choice`` ``auto`` (the
default with tools) reads the reply's calls into ``message.tool_calls`` (streamed as ``delta.tool_calls``) with
``finish_reason`` ``"tool_calls"``; ``required`` or a named function constrains the reply to a call section whose
arguments match the functions' ``parameters`` schemas (llguidance; ``parallel_tool_calls: false``: one call);
``none`` declares the tools but parses nothing, and bans the section's first token where it is a special token.

Reasoning (``create_app(reasoning_parser="kimi_k2")``, vLLM's ``--reasoning-parser kimi_k2``): a chat reply's
``<think>`` part is ``message.reasoning_content`` (:mod:`openk3.infer.reasoning`), read before the tool calls;
``chat_template_kwargs`` (the chat template's variables) with ``thinking: false`` turns it off for the request.
A grammar (structured output, a forced call) then applies from the token after ``</think>`` (a special token).

Log-probabilities (of the model's distribution: ``log_softmax`` of the logits before penalty, temperature and
filters): completions take ``logprobs`` k (0-20: each token's logprob and the k most likely tokens, plus the chosen
one) and ``echo`` (the prompt's text before the completion; with ``logprobs``, the prompt tokens' logprobs too, the
first one ``null``: scoring a text as evaluation harnesses do); chat takes ``logprobs: true`` and ``top_logprobs``
(0-20). A token's text is the tokenizer's decoding of that token alone (``token_id:N`` without a tokenizer), and
``text_offset`` adds up those texts' lengths.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import dataclasses
import hmac
import json
import threading
import time
import uuid
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from openk3.infer.engine import ContextLengthError, Engine, PromptError, RequestOutput
from openk3.infer.guided import GUIDED_KINDS
from openk3.infer.reasoning import ReasoningSplitter, reasoning_params, split_reasoning
from openk3.infer.sampling import MAX_LOGPROBS, SEED_MIN, SamplingParamError, SamplingParams
from openk3.infer.tools import (
    ToolCallParser,
    ToolError,
    ToolRequest,
    parse_tool_calls,
    tool_params,
    tool_request,
)
from openk3.train.tokenizer import TOOL_SECTION_BEGIN

__all__ = ["create_app", "serve", "ApiError", "check_api_key", "REASONING_PARSERS"]

MAX_N = 16
REASONING_PARSERS = ("kimi_k2",)  # (vLLM's name for Kimi's <think> layout)
MAX_REQUEST_BYTES = 16 * 2**20  # the default limit on a request body
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, *, type_: str = "invalid_request_error", param=None, code=None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _output_error(out: RequestOutput) -> ApiError | None:
    """The error a request output stands for: the engine's failure (500), or an abort while the client still
    waited (the server shutting down: 503, not a finish reason outside OpenAI's set); None otherwise."""
    if out.error:
        return ApiError(500, out.error, type_="server_error")
    if out.finished and out.finish_reason == "abort":
        return ApiError(
            503,
            "the request was cancelled: the server is shutting down",
            type_="server_error",
            code="server_shutdown",
        )
    return None


class _TextOffsets:
    """Character offsets of tokens in a choice's text, fed each token's bytes: a token's offset is the number of
    whole characters before its first byte, so the tokens of one multi-byte character share that character's
    offset."""

    def __init__(self):
        self.chars = 0
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, piece: bytes) -> int:
        at = self.chars
        self.chars += len(self._dec.decode(piece))
        return at


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


# ------------------------------------------------------------------------------------------------ request parsing
def _get(body: dict, name: str, types, default=None, *, allow_none=True):
    v = body.get(name, default)
    if v is None:
        if not allow_none:
            raise ApiError(400, f"'{name}' must not be null", param=name)
        return default
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ApiError(400, f"'{name}' has the wrong type ({type(v).__name__})", param=name)
    if not isinstance(v, types):
        raise ApiError(400, f"'{name}' has the wrong type ({type(v).__name__})", param=name)
    return v


# Fields of OpenAI's API (and vLLM's extras) whose effect this server does not implement, each with a test for the
# values that ask for nothing: any other value is refused, since answering as if it had been honoured (plain text
# for a JSON schema, no tool call, no grammar) would be a wrong answer that looks right.
_UNSUPPORTED = {
    "suffix": lambda v: not v,
    "functions": lambda v: v is None or v == [],  # (OpenAI's deprecated form of tools)
    "function_call": lambda v: v in (None, "none", "auto"),
    "use_beam_search": lambda v: v is None or v is False,
    "spaces_between_special_tokens": lambda v: v is None or v is True,
    "length_penalty": lambda v: v is None or (type(v) in (int, float) and v == 1),
    "prompt_logprobs": lambda v: v is None,  # (vLLM's own output field; completions score a prompt with echo)
    "logprob_token_ids": lambda v: v is None or v == [],
    "watermarking": lambda v: v is None or v is False,
    # OpenAI's: an answer in other modalities or with web search results cannot be given
    "modalities": lambda v: v is None or v == ["text"],
    "audio": lambda v: v is None,
    "web_search_options": lambda v: v is None,
}
# ... those of completions requests (tools are the chat route's)
_UNSUPPORTED_COMPLETIONS = {
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v in (None, "none", "auto"),
}
# ... and those of vLLM's chat requests (completions' `echo` is served)
_UNSUPPORTED_CHAT = {
    "echo": lambda v: v is None or v is False,
    "continue_final_message": lambda v: v is None or v is False,
    "add_generation_prompt": lambda v: v is None or v is True,
    "chat_template": lambda v: v is None,
    "documents": lambda v: v is None or v == [],
}


def _structured_outputs(so) -> dict:
    """SamplingParams.guided of vLLM's ``structured_outputs`` object: one of :data:`GUIDED_KINDS`, with its
    ``disable_any_whitespace`` switch (a JSON schema's own ``x-guidance`` option here)."""
    bad = ApiError(
        400, "'structured_outputs' must be an object with one of json, json_object, regex, choice, grammar (and "
        "optionally disable_any_whitespace: true)", param="structured_outputs",
    )  # fmt: skip
    if not isinstance(so, dict):
        raise bad
    given = {k: v for k, v in so.items() if v is not None and v is not False}
    compact = given.pop("disable_any_whitespace", False)
    if not isinstance(compact, bool) or len(given) != 1 or next(iter(given)) not in GUIDED_KINDS:
        raise bad
    ((kind, value),) = given.items()
    if not compact or kind not in ("json", "json_object"):
        return {kind: value}
    schema = {"type": "object"} if kind == "json_object" else value
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise ApiError(400, "'structured_outputs.json' is not JSON", param="structured_outputs") from None
    if not isinstance(schema, dict):
        raise ApiError(400, "'structured_outputs.json' must be a schema object", param="structured_outputs")
    own = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
    return {"json": {**schema, "x-guidance": {"whitespace_flexible": False, **own}}}


def _guided(body: dict) -> tuple[dict | None, str | None]:
    """SamplingParams.guided from a request: OpenAI's ``response_format`` (``json_object``, ``json_schema``;
    ``text`` is none), vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` or its
    ``structured_outputs`` object; at most one of them. Returns (the spec, the field that asked for it)."""
    found = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise ApiError(
                400, "'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                param="response_format",
            )  # fmt: skip
        if rf["type"] == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise ApiError(
                    400,
                    "'response_format.json_schema' must be an object with a 'schema'",
                    param="response_format",
                )
            found.append(("response_format", {"json": js["schema"]}))
    for name, kind in (
        ("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar"),
    ):  # fmt: skip
        if body.get(name) is not None:
            found.append((name, {kind: body[name]}))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    if len(found) > 1:
        names = ", ".join(f"'{n}'" for n, _ in found)
        raise ApiError(400, f"at most one structured output may be asked for, got {names}", param=found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


def _message_tool_calls(calls, k: int) -> list[dict]:
    """An assistant message's ``tool_calls`` checked (OpenAI's shape) for the chat template: each one's arguments as
    JSON text, a missing id as Kimi writes it (``functions.NAME:J``)."""
    if not isinstance(calls, list):
        raise ApiError(400, f"messages[{k}].tool_calls must be a list", param="messages")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or c.get("type", "function") != "function"
        ):
            raise ApiError(
                400,
                f'messages[{k}].tool_calls[{j}] must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                '"arguments": ...}}}}',
                param="messages",
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        if not isinstance(args, str):
            raise ApiError(
                400,
                f"messages[{k}].tool_calls[{j}].function.arguments must be a JSON string",
                param="messages",
            )
        cid = c.get("id")
        if cid is not None and not isinstance(cid, str):
            raise ApiError(400, f"messages[{k}].tool_calls[{j}].id must be a string", param="messages")
        fid = cid or f"functions.{fn['name']}:{j}"
        out.append({"id": fid, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _tool_call_deltas(calls) -> list[dict]:
    """A stream chunk's ``delta.tool_calls`` of a :class:`~openk3.infer.tools.ToolDelta`'s calls: a call's first
    one with its id, type and name, later ones with their arguments' next text."""
    out = []
    for k, call, args in calls:
        if call is not None:
            fn = {"name": call.name, "arguments": args}
            out.append({"index": k, "id": call.id, "type": "function", "function": fn})
        else:
            out.append({"index": k, "function": {"arguments": args}})
    return out


def _refuse_unsupported(body: dict, *, chat: bool) -> None:
    for name, no_op in (
        *_UNSUPPORTED.items(),
        *(_UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETIONS).items(),
    ):
        if name in body and not no_op(body[name]):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)


def _sampling_params(body: dict, *, chat: bool) -> tuple[SamplingParams, int, str | None]:
    """(SamplingParams, n, the field that asked for structured output) of a request."""
    _refuse_unsupported(body, chat=chat)
    logprobs, prompt_logprobs = _logprob_params(body, chat=chat)
    logit_bias = _logit_bias(body)
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"'n' must lie in [1, {MAX_N}], got {n}", param="n")
    best_of = _get(body, "best_of", int, None)
    if best_of not in (None, n):
        raise ApiError(400, "'best_of' other than n is not supported", param="best_of")
    mt_name = "max_tokens"
    if chat:
        max_tokens = _get(body, "max_completion_tokens", int, None)
        if max_tokens is None:
            max_tokens = _get(body, "max_tokens", int, None)
        else:
            mt_name = "max_completion_tokens"
    else:
        max_tokens = _get(body, "max_tokens", int, 16)
    # 0 (completions only): score the prompt without generating, as the legacy API and vLLM allow with echo
    low = 1 if chat else 0
    if max_tokens is not None and max_tokens < low:
        raise ApiError(400, f"'{mt_name}' must be >= {low}, got {max_tokens}", param=mt_name)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    if len(stop) > 16:
        raise ApiError(400, "at most 16 stop strings are allowed", param="stop")
    stop_ids = _get(body, "stop_token_ids", list, [])
    bad_words = _get(body, "bad_words", list, [])
    top_k = _get(body, "top_k", int, 0)
    guided, guided_field = _guided(body)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_get(body, "temperature", (int, float), 1.0),
        top_p=_get(body, "top_p", (int, float), 1.0),
        top_k=top_k,
        min_p=_get(body, "min_p", (int, float), 0.0),
        min_tokens=_get(body, "min_tokens", int, 0),
        repetition_penalty=_get(body, "repetition_penalty", (int, float), 1.0),
        frequency_penalty=_get(body, "frequency_penalty", (int, float), 0.0),
        presence_penalty=_get(body, "presence_penalty", (int, float), 0.0),
        seed=_get(body, "seed", int, None),
        stop=list(stop),
        stop_token_ids=list(stop_ids),
        ignore_eos=bool(_get(body, "ignore_eos", bool, False)),
        skip_special_tokens=bool(_get(body, "skip_special_tokens", bool, True)),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=logit_bias,
        include_stop_str_in_output=_get(body, "include_stop_str_in_output", bool, False),
        allowed_token_ids=_get(body, "allowed_token_ids", list, None),
        bad_words=list(bad_words),
        truncate_prompt_tokens=_get(body, "truncate_prompt_tokens", int, None),
        truncation_side=_get(body, "truncation_side", str, "left"),
        guided=guided,
    )
    try:
        params.validate()
    except SamplingParamError as e:
        raise ApiError(400, str(e), param=guided_field if e.param == "guided" else e.param) from None
    return params, n, guided_field


def _logit_bias(body: dict) -> dict[int, float] | None:
    """SamplingParams.logit_bias from the OpenAI field: an object of token ids (as strings, or integers) to biases
    in [-100, 100]."""
    lb = _get(body, "logit_bias", dict, None)
    if not lb:
        return None
    out = {}
    for k, v in lb.items():  # (the biases are checked by SamplingParams.validate)
        key = k.strip() if isinstance(k, str) else k
        if isinstance(key, str) and key.isascii() and key.isdigit():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise ApiError(400, f"'logit_bias' keys must be token ids, got {k!r}", param="logit_bias")
        out[key] = v
    return out


def _logprob_params(body: dict, *, chat: bool) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs) of SamplingParams from a request's OpenAI fields."""

    def k_of(name: str) -> int | None:
        k = _get(body, name, int, None)
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise ApiError(400, f"'{name}' must lie in [0, {MAX_LOGPROBS}], got {k}", param=name)
        return k

    if chat:
        on = _get(body, "logprobs", bool, False)
        top = k_of("top_logprobs")
        if top is not None and top > 0 and not on:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return ((top or 0) if on else None), None
    k = k_of("logprobs")
    echo = _get(body, "echo", bool, False)
    return k, (k if echo else None)


def _with_seed(params: SamplingParams, i: int) -> SamplingParams:
    if i == 0:
        return params
    p = SamplingParams(**{k: getattr(params, k) for k in params.__dataclass_fields__})
    if p.seed is not None:  # (wrapped into the 64-bit range SamplingParams takes)
        p.seed = (p.seed + i - SEED_MIN) % 2**64 + SEED_MIN
    return p


def _stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage) of a request; checked before its engine requests are submitted."""
    stream = _get(body, "stream", bool, False)
    so = body.get("stream_options")
    if so is None:
        return stream, False
    if not isinstance(so, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    if not stream:  # (as OpenAI and vLLM answer: the options of a stream that is not asked for)
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    include_usage = so.get("include_usage")
    if include_usage is None:
        include_usage = False
    if not isinstance(include_usage, bool):
        raise ApiError(400, "'stream_options.include_usage' must be a boolean", param="stream_options")
    return stream, stream and include_usage


# ------------------------------------------------------------------------------------------------ engine bridge
class _LoopBridge:
    """Hands items from the engine's thread to queues of one event loop, waking the loop once per batch of items
    instead of once per item: ``call_soon_threadsafe`` writes to the loop's self-pipe on every call, and with many
    streams that was one write (and one loop wake-up) per token of every stream. Items keep their order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque = deque()
        self.lock = threading.Lock()
        self.pending = False  # a drain is scheduled on the loop and has not taken the items yet

    def put(self, queue: asyncio.Queue, item) -> None:
        if self.loop.is_closed():  # nothing will drain: dropped (as call_soon_threadsafe refuses then)
            return
        with self.lock:
            self.items.append((queue, item))
            if self.pending:
                return
            self.pending = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop closed meanwhile
            with self.lock:
                self.items.clear()

    def _drain(self) -> None:
        with self.lock:
            items, self.items = self.items, deque()
            self.pending = False
        for queue, item in items:
            queue.put_nowait(item)


_BRIDGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its _LoopBridge


def _bridge(loop: asyncio.AbstractEventLoop) -> _LoopBridge:
    b = _BRIDGES.get(loop)
    if b is None:
        b = _BRIDGES[loop] = _LoopBridge(loop)
    return b


class _Group:
    """Several engine requests of one HTTP request, delivering (index, output) events into an asyncio queue."""

    def __init__(
        self, engine: Engine, n: int = 1, prompt_param: str = "prompt", guided_param: str | None = None
    ):
        self.engine, self.n = engine, n  # n: choices per prompt (submitted one after the other)
        self.prompt_param = prompt_param  # the field an error about the prompt names
        self.guided_param = (
            guided_param  # ... and one about its structured output (a schema the engine refused)
        )
        self.bridge = _bridge(asyncio.get_running_loop())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.reqs = []
        self.done: set[int] = set()

    def _put(self, i: int, out: RequestOutput) -> None:
        self.bridge.put(self.queue, (i, out))

    async def submit_all(self, prompts: list, params: SamplingParams) -> None:
        """Submit ``n`` choices of each prompt. Text prompts are tokenized once each, together, in a worker thread:
        the tokenizers' batch encode runs without the GIL, so a long prompt does not hold up the event loop (the
        other requests' streams) while it is encoded; requests with structured output are submitted there too (their
        grammar is compiled on submission). (The routes refuse text prompts without a tokenizer.)"""
        texts = [p for p in prompts if isinstance(p, str)]
        if texts:
            encoded = iter(await asyncio.to_thread(self.engine.tokenizer.encode_batch, texts, True))
            prompts = [next(encoded) if isinstance(p, str) else p for p in prompts]
        for p in prompts:
            for j in range(self.n):
                if params.guided is None:
                    self.submit(p, _with_seed(params, j))
                else:  # (compiling a grammar can take up to a second: off the event loop too)
                    await asyncio.to_thread(self.submit, p, _with_seed(params, j))

    def submit(self, prompt, params: SamplingParams) -> None:
        i = len(self.reqs)
        try:
            req = self.engine.submit(prompt, params, on_output=lambda out, i=i: self._put(i, out))
        except PromptError as e:  # (a prompt too long: coded as OpenAI codes it)
            self.abort()
            code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None
            raise ApiError(400, str(e), param=self.prompt_param, code=code) from None
        except ValueError as e:
            self.abort()
            param = getattr(e, "param", None)
            raise ApiError(400, str(e), param=self.guided_param if param == "guided" else param) from None
        self.reqs.append(req)

    async def events(self, request=None):
        """Yield lists of (index, output), each list all that arrived since the last, until every request finished;
        with ``request`` (non-streaming), poll for a client disconnect while waiting."""
        next_check = time.monotonic() + 1.0
        while len(self.done) < len(self.reqs):
            if request is None:
                item = await self.queue.get()
            else:
                # once a second, whether outputs keep coming or not (they do while the request generates)
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + 1.0
                    if await request.is_disconnected():
                        self.abort()
                        return
                try:
                    item = await asyncio.wait_for(self.queue.get(), timeout=1.0)
                except TimeoutError:
                    continue
            batch = [item]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            for i, out in batch:
                if out.finished:
                    self.done.add(i)
            yield batch

    def abort(self) -> None:
        for i, r in enumerate(self.reqs):
            if i not in self.done:
                self.engine.abort(r.id)
                self.done.add(i)

    async def outputs(self):
        """(index, output) pairs until every request finished, each choice's outputs that arrived together merged
        into one (:func:`_coalesce`): what a stream sends."""
        async for batch in self.events():
            for pair in _coalesce(batch):
                yield pair

    @property
    def prompt_tokens(self) -> int:
        """Usage's prompt tokens: each prompt once, however many choices it has (as OpenAI counts them)."""
        return sum(r.num_prompt for r in self.reqs[:: self.n])


def _coalesce(batch: list) -> list:
    """(index, output) pairs with each choice's consecutive outputs merged into one (their tokens, text and
    logprobs joined; the last one's finish). When the event loop falls behind the engine (many streams), a stream
    then gets one chunk for the tokens of several steps instead of one chunk per token. An output with an error stays
    on its own."""
    merged: dict[int, list] = {}
    out_pairs: list = []
    for i, out in batch:
        run = merged.get(i)
        if run is not None and not out.error and not run[-1].error:
            run.append(out)
            continue
        merged[i] = run = [out]
        out_pairs.append((i, run))
    result = []
    for i, run in out_pairs:
        if len(run) == 1:
            result.append((i, run[0]))
            continue
        last = run[-1]
        lps = [e for o in run for e in (o.new_logprobs or [])]
        result.append(
            (
                i,
                dataclasses.replace(
                    last,
                    new_token_ids=[t for o in run for t in o.new_token_ids],
                    new_text="".join(o.new_text for o in run),
                    new_logprobs=lps if any(o.new_logprobs is not None for o in run) else None,
                    prompt_logprobs=next(
                        (o.prompt_logprobs for o in run if o.prompt_logprobs is not None), None
                    ),
                ),
            )
        )
    return result


# ------------------------------------------------------------------------------------------------ app
class _AsgiMiddleware:
    """ASGI middleware calling ``func(scope, receive, send, inner_app)``."""

    def __init__(self, app, func):
        self.app, self.func = app, func

    async def __call__(self, scope, receive, send):
        await self.func(scope, receive, send, self.app)


def check_api_key(api_key: str | None) -> None:
    """A ``ValueError`` for a key that an Authorization header cannot carry as it is (non-ASCII, spaces): it would
    lock every client out."""
    if api_key and not (api_key.isascii() and api_key.isprintable() and " " not in api_key):
        raise ValueError("the API key must be printable ASCII without spaces")


def create_app(
    engine: Engine,
    model_name: str = "openk3",
    *,
    api_key: str | None = None,
    start_engine: bool = True,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    loop_required: bool | None = None,
    reasoning_parser: str | None = None,
):
    """The FastAPI application. ``start_engine``: start the engine's background loop with the app (and stop it at
    shutdown). ``max_request_bytes``: a larger request body gets a 413 error before it is read to its end.
    ``loop_required`` (default: ``start_engine``): /health answers 503 while the engine's loop is not running.
    ``reasoning_parser`` (one of :data:`REASONING_PARSERS`, vLLM's ``--reasoning-parser``): chat replies give a
    thinking model's reasoning as ``message.reasoning_content`` (``delta.reasoning_content`` when streamed) apart
    from its answer (:mod:`openk3.infer.reasoning`); a request's ``chat_template_kwargs: {"thinking": false}`` turns
    it off for that request."""
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} or None, got {reasoning_parser!r}"
        )
    if loop_required is None:
        loop_required = start_engine
    if not isinstance(max_request_bytes, int) or isinstance(max_request_bytes, bool) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
    check_api_key(api_key)
    created = int(time.time())
    http_errors: dict[int, int] = {}
    tok = engine.tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if start_engine:
            engine.start()
        try:
            yield
        finally:
            if start_engine:
                engine.shutdown()

    app = FastAPI(title="openk3", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def err_response(e: ApiError, headers=None) -> JSONResponse:
        http_errors[e.status] = http_errors.get(e.status, 0) + 1
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return err_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        code = "not_found" if exc.status_code == 404 else None
        # (a 405 keeps its Allow header)
        return err_response(
            ApiError(exc.status_code, str(exc.detail), code=code), getattr(exc, "headers", None)
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        return err_response(ApiError(400, f"invalid request: {exc.errors()}"))

    @app.exception_handler(Exception)
    async def _internal_error(request, exc):
        return err_response(
            ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error")
        )

    async def _auth(scope, receive, send, inner) -> None:
        """The API key check of /v1 paths, as a plain ASGI middleware: ``request.is_disconnected()`` (how a
        non-streaming request notices its client has gone) never reports a disconnect through Starlette's
        ``@app.middleware("http")``."""
        if scope["type"] == "http" and api_key:
            request = Request(scope)
            if request.url.path.startswith("/v1"):
                scheme, _, got = request.headers.get("authorization", "").partition(" ")
                ok = scheme.lower() == "bearer" and hmac.compare_digest(
                    got.strip().encode(), api_key.encode()
                )
                if not ok:
                    e = ApiError(
                        401,
                        "missing or wrong API key (Authorization: Bearer KEY)",
                        type_="authentication_error",
                        code="invalid_api_key",
                    )
                    await err_response(e)(scope, receive, send)
                    return
        await inner(scope, receive, send)

    app.add_middleware(_AsgiMiddleware, func=_auth)

    def too_large() -> ApiError:
        return ApiError(
            413,
            f"the request body is larger than this server's limit of {max_request_bytes} bytes "
            "(openk3 serve --max-request-mb)",
            code="request_too_large",
        )

    async def body_of(request: Request) -> dict:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_request_bytes:
            raise too_large()
        parts, size = [], 0
        async for part in request.stream():  # also bounds a chunked body, which declares no length
            size += len(part)
            if size > max_request_bytes:
                raise too_large()
            parts.append(part)
        raw = b"".join(parts)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:  # also: nesting too deep, an integer of > 4300 digits
            raise ApiError(400, f"the request body is not valid JSON ({type(e).__name__})") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:  # "\ud800" escapes decode to lone surrogates: no text can hold them (tokenizer, response)
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(
                400, "the request body has a string with a lone surrogate (invalid Unicode)"
            ) from None
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, f"'model' has the wrong type ({type(model).__name__})", param="model")
        if model is not None and model != model_name:
            raise ApiError(
                404,
                f"the model '{model}' does not exist; this server serves '{model_name}'",
                param="model",
                code="model_not_found",
            )
        return body

    def usage(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def tok_text(i: int) -> str:
        return tok.decode([i]) if tok is not None else f"token_id:{i}"

    def tok_bytes(i: int) -> bytes:
        return tok.token_bytes(i) if tok is not None else tok_text(i).encode("utf-8")

    def completion_logprobs(pairs, offsets: _TextOffsets) -> dict:
        """The completions API's logprobs object for (token id, TokenLogprob or None) pairs; ``offsets`` follows
        the choice's text (each token's ``text_offset`` is where its first byte's character starts in it)."""
        d: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, e in pairs:
            t = tok_text(tid)
            top = None
            if e is not None:
                top = {tok_text(i): v for i, v in e.top}
                top.setdefault(t, e.logprob)  # the chosen token is always listed
            d["tokens"].append(t)
            d["token_logprobs"].append(None if e is None else e.logprob)
            d["top_logprobs"].append(top)
            d["text_offset"].append(offsets.push(tok_bytes(tid)))
        return d

    def chat_logprobs(entries) -> dict:
        """The chat API's logprobs object ({"content": [...]}) for TokenLogprobs; ``bytes`` are the token's own
        (a part of a character for some byte-level tokens, whose text alone is U+FFFD)."""

        def item(i: int, v: float) -> dict:
            return {"token": tok_text(i), "logprob": v, "bytes": list(tok_bytes(i))}

        return {
            "content": [
                dict(item(e.id, e.logprob), top_logprobs=[item(i, v) for i, v in e.top]) for e in entries
            ]
        }

    # -------------------------------------------------------------------------------------------- plain routes
    @app.get("/health")
    async def health():
        if loop_required and not engine.is_running():
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    def model_card() -> dict:
        return {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "openk3",
            "max_model_len": engine.max_model_len,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise ApiError(404, f"model {model_id!r} not found", param="model", code="model_not_found")
        return model_card()

    @app.get("/metrics")
    async def metrics():
        s = engine.stats()
        counters = engine.counter_names()
        lines = ["# TYPE openk3_requests_finished_total counter"]
        for k, v in s.items():
            if k.startswith("requests_finished_"):
                lines.append(
                    f'openk3_requests_finished_total{{reason="{k[len("requests_finished_") :]}"}} {v}'
                )
        for k, v in s.items():
            if k.startswith("requests_finished_"):
                continue
            if k in counters:
                name, kind = (k if k.endswith("_total") else k + "_total"), "counter"
            else:
                name, kind = (k[: -len("_total")] + "_capacity" if k.endswith("_total") else k), "gauge"
            lines += [f"# TYPE openk3_{name} {kind}", f"openk3_{name} {v}"]
        lines.append("# TYPE openk3_http_errors_total counter")
        for code, v in sorted(http_errors.items()):
            lines.append(f'openk3_http_errors_total{{code="{code}"}} {v}')
        for name, h in engine.latency.items():
            bounds, cumulative, total, count = h.snapshot()
            lines.append(f"# TYPE openk3_{name} histogram")
            lines += [f'openk3_{name}_bucket{{le="{b!r}"}} {c}' for b, c in zip(bounds, cumulative)]
            lines.append(f'openk3_{name}_bucket{{le="+Inf"}} {count}')
            lines += [f"openk3_{name}_sum {total!r}", f"openk3_{name}_count {count}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    # -------------------------------------------------------------------------------------------- completions
    def parse_prompts(body: dict) -> list:
        p = body.get("prompt")
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p:
            if all(isinstance(x, str) for x in p):
                return list(p)
            if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
                return [p]
            if all(
                isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
                for x in p
            ):
                return list(p)
        raise ApiError(400, "'prompt' must be a string, a list of strings, or token ids", param="prompt")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        prompts = parse_prompts(body)
        params, n, guided_field = _sampling_params(body, chat=False)
        stream, include_usage = _stream_flags(body)
        echo = bool(_get(body, "echo", bool, False))
        if any(isinstance(p, str) for p in prompts) and tok is None:
            raise ApiError(400, "this server has no tokenizer: send token ids")
        if len(prompts) * n > MAX_N * 4:
            raise ApiError(400, f"too many choices ({len(prompts) * n}); at most {MAX_N * 4} per request")
        group = _Group(engine, n, guided_param=guided_field)
        await group.submit_all(prompts, params)
        cid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        want_lp = params.logprobs is not None

        def echo_text(i: int) -> str:  # choice i's prompt as text (as the model saw it, when truncated)
            p = prompts[i // n]
            if isinstance(p, str) and params.truncate_prompt_tokens is None:
                return p
            return tok.decode(group.reqs[i].prompt_ids) if tok is not None else ""

        def prompt_pairs(i: int, plps) -> list:  # choice i's prompt tokens with their logprobs (first: None)
            ids = group.reqs[i].prompt_ids
            return list(zip(ids, plps if plps is not None else [None] * len(ids)))

        def chunk(choices, usage_=None):
            d = {
                "id": cid,
                "object": "text_completion",
                "created": now,
                "model": model_name,
                "choices": choices,
            }
            if usage_ is not None or include_usage:  # (a stream with usage: null in every chunk but the last)
                d["usage"] = usage_
            return d

        if stream:

            async def gen():
                completion = 0
                started: set[int] = set()
                offsets = [_TextOffsets() for _ in group.reqs]
                try:
                    async for i, out in group.outputs():
                        err = _output_error(out)
                        if err is not None:
                            yield _sse(err.body())
                            continue
                        completion += len(out.new_token_ids)
                        text, pairs = out.new_text, []
                        if i not in started:  # the choice's first output: the echoed prompt goes first
                            started.add(i)
                            if echo:
                                text = echo_text(i) + text
                                if want_lp:
                                    pairs = prompt_pairs(i, out.prompt_logprobs)
                        lp = None
                        if want_lp:
                            pairs += [(e.id, e) for e in out.new_logprobs or []]
                            lp = completion_logprobs(pairs, offsets[i])
                        if text or out.finished or pairs:
                            c = {
                                "index": i,
                                "text": text,
                                "logprobs": lp,
                                "finish_reason": out.finish_reason if out.finished else None,
                            }
                            yield _sse(chunk([c]))
                    if include_usage:
                        yield _sse(chunk([], usage(group.prompt_tokens, completion)))
                    yield "data: [DONE]\n\n"
                finally:
                    group.abort()

            return StreamingResponse(
                gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )

        got = await _collect(group, request)
        choices = []
        for i in range(len(got.texts)):
            lp = None
            if want_lp:
                pairs = prompt_pairs(i, got.prompt_logprobs[i]) if echo else []
                lp = completion_logprobs(pairs + [(e.id, e) for e in got.logprobs[i]], _TextOffsets())
            text = (echo_text(i) if echo else "") + got.texts[i]
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": got.reasons[i]})
        return chunk(choices, usage(group.prompt_tokens, got.completion))

    # -------------------------------------------------------------------------------------------- chat
    def tools_of(body: dict) -> ToolRequest:
        try:
            return tool_request(body)
        except ToolError as e:
            raise ApiError(400, str(e), param=e.param) from None

    def template_kwargs(body: dict) -> dict:
        kw = _get(body, "chat_template_kwargs", dict, None)
        if kw is None:
            return {}
        if "thinking" in kw and not isinstance(kw["thinking"], bool):
            raise ApiError(
                400, "chat_template_kwargs.thinking must be true or false", param="chat_template_kwargs"
            )
        try:
            return tok.check_template_kwargs(kw)
        except ValueError as e:
            raise ApiError(400, f"chat_template_kwargs: {e}", param="chat_template_kwargs") from None

    def chat_prompt(body: dict, treq: ToolRequest) -> tuple[str, dict]:
        """The prompt of a chat request's messages and declared tools (Kimi's layout for tools, assistant tool calls
        and tool results: :meth:`~openk3.train.tokenizer.Tokenizer.apply_chat_template`), and the template's
        ``chat_template_kwargs`` (checked)."""
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
        clean = []
        for k, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{k}] must be an object with a 'role'", param="messages")
            if m["role"] not in CHAT_ROLES:  # a role is rendered into the prompt as it is
                raise ApiError(
                    400,
                    f"messages[{k}].role {m['role']!r} is not one of {', '.join(CHAT_ROLES)}",
                    param="messages",
                )
            if m.get("function_call"):
                raise ApiError(
                    400, f"messages[{k}]: function_call is not supported; send tool_calls", param="messages"
                )
            c = m.get("content")
            if c is None:
                c = ""
            if isinstance(c, list):
                parts = []
                for part in c:
                    if not (
                        isinstance(part, dict)
                        and part.get("type") == "text"
                        and isinstance(part.get("text"), str)
                    ):
                        raise ApiError(
                            400, f"messages[{k}]: only text content parts are supported", param="messages"
                        )
                    parts.append(part["text"])
                c = "".join(parts)
            if not isinstance(c, str):
                raise ApiError(400, f"messages[{k}].content must be a string or text parts", param="messages")
            one = {"role": m["role"], "content": c}
            if isinstance(m.get("name"), str):
                one["name"] = m["name"]
            if m.get("tool_calls"):
                if m["role"] != "assistant":
                    raise ApiError(
                        400, f"messages[{k}]: only assistant messages have tool_calls", param="messages"
                    )
                one["tool_calls"] = _message_tool_calls(m["tool_calls"], k)
            if m["role"] == "tool":
                if not isinstance(m.get("tool_call_id"), str):
                    raise ApiError(
                        400,
                        f"messages[{k}].tool_call_id must be a string: the id of the call whose result it is",
                        param="messages",
                    )
                one["tool_call_id"] = m["tool_call_id"]
            clean.append(one)
        kw = template_kwargs(body)
        try:
            prompt = tok.apply_chat_template(
                clean, add_generation_prompt=True, tools=treq.tools or None, template_kwargs=kw
            )
        except Exception as e:
            raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None
        return prompt, kw

    im_end = tok.token_to_id("<|im_end|>") if tok is not None else None

    # ---------------------------------------------------------------------------------------- tokenizer routes
    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: the token ids of a ``prompt`` (a string) or of chat ``messages`` as the chat route renders them
        (``return_token_strs``: each id's text too), with their count and the context length."""
        body = await body_of(request)
        if tok is None:
            raise ApiError(400, "this server has no tokenizer")
        if ("prompt" in body) == ("messages" in body):
            raise ApiError(400, "give either 'prompt' (a string) or 'messages'", param="prompt")
        if "messages" in body:
            text, _ = chat_prompt(body, tools_of(body))
        else:
            text = _get(body, "prompt", str, None, allow_none=False)
        strs = _get(body, "return_token_strs", bool, False)
        ids = await asyncio.to_thread(tok.encode, text, True)
        return {
            "count": len(ids),
            "max_model_len": engine.max_model_len,
            "tokens": ids,
            "token_strs": [tok_text(i) for i in ids] if strs else None,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's: the text of a list of token ids of the vocabulary."""
        body = await body_of(request)
        if tok is None:
            raise ApiError(400, "this server has no tokenizer")
        ids = _get(body, "tokens", list, None, allow_none=False)
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < engine.tok_vocab for i in ids):
            raise ApiError(400, f"'tokens' must be token ids in [0, {engine.tok_vocab})", param="tokens")
        return {"prompt": tok.decode(ids)}

    def special(marker: str) -> int | None:
        return tok.special_tokens.get(marker)

    def use_tools(treq: ToolRequest, params: SamplingParams, guided_field: str | None) -> str | None:
        """Set a chat request's params for its tools; returns the field an error of its grammar names."""
        if not treq.tools:
            return guided_field
        if not treq.parse:  # tool_choice "none": declared, but the section of calls never starts
            sb = special(TOOL_SECTION_BEGIN)
            if sb is not None:  # (OpenAI's ban: a bias of -100)
                params.logit_bias = {**(params.logit_bias or {}), sb: -100.0}
            return guided_field
        if guided_field is not None:
            raise ApiError(
                400,
                f"'{guided_field}' cannot be combined with tool calls (tool_choice {treq.choice!r}); send "
                f"tool_choice \"none\" or leave out '{guided_field}'",
                param=guided_field,
            )
        tool_params(treq, params, special, engine.cfg.guided_compact_json)
        return "tools" if treq.forced else None

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request)
        if tok is None:
            raise ApiError(400, "this server has no tokenizer, so it cannot render chat messages")
        treq = tools_of(body)
        prompt, kw = chat_prompt(body, treq)
        params, n, guided_field = _sampling_params(body, chat=True)
        stream, include_usage = _stream_flags(body)
        if im_end is not None and im_end not in params.stop_token_ids:
            params.stop_token_ids.append(im_end)
        guided_field = use_tools(treq, params, guided_field)
        thinking = reasoning_parser is not None and kw.get("thinking", True)
        if thinking:
            reasoning_params(params, special)
        group = _Group(engine, n, prompt_param="messages", guided_param=guided_field)
        await group.submit_all([prompt], params)
        cid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(choices, usage_=None, obj="chat.completion.chunk"):
            d = {"id": cid, "object": obj, "created": now, "model": model_name, "choices": choices}
            if usage_ is not None or include_usage:  # (a stream with usage: null in every chunk but the last)
                d["usage"] = usage_
            return d

        if stream:

            async def gen():
                completion = 0
                parsers = [ToolCallParser() for _ in range(n)] if treq.parse else None
                splitters = [ReasoningSplitter() for _ in range(n)] if thinking else None
                try:
                    for j in range(n):
                        c = {
                            "index": j,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        yield _sse(chunk([c]))
                    async for i, out in group.outputs():
                        err = _output_error(out)
                        if err is not None:
                            yield _sse(err.body())
                            continue
                        completion += len(out.new_token_ids)
                        lp = chat_logprobs(out.new_logprobs) if out.new_logprobs else None
                        text, reasoning = out.new_text, ""
                        if splitters is not None:
                            reasoning, text = splitters[i].feed(text, final=out.finished)
                        delta = {"reasoning_content": reasoning} if reasoning else {}
                        if parsers is not None:
                            td = parsers[i].feed(text, final=out.finished)
                            if td.content:
                                delta["content"] = td.content
                            if td.calls:
                                delta["tool_calls"] = _tool_call_deltas(td.calls)
                        elif text:
                            delta["content"] = text
                        if delta or lp is not None:
                            c = {
                                "index": i,
                                "delta": delta or {"content": ""},
                                "logprobs": lp,
                                "finish_reason": None,
                            }
                            yield _sse(chunk([c]))
                        if out.finished:
                            reason = out.finish_reason
                            if parsers is not None and parsers[i].calls and reason == "stop":
                                reason = "tool_calls"
                            c = {"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}
                            yield _sse(chunk([c]))
                    if include_usage:
                        yield _sse(chunk([], usage(group.prompt_tokens, completion)))
                    yield "data: [DONE]\n\n"
                finally:
                    group.abort()

            return StreamingResponse(
                gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )

        got = await _collect(group, request)
        choices = []
        for i in range(n):
            text, reasoning = got.texts[i], None
            if thinking:
                reasoning, text = split_reasoning(text)
            message, reason = {"role": "assistant", "content": text}, got.reasons[i]
            if treq.parse:
                content, calls = parse_tool_calls(text)
                message["content"] = content
                if calls:
                    message = {"role": "assistant", "content": content or None}
                    message["tool_calls"] = [c.openai() for c in calls]
                    reason = "tool_calls" if reason == "stop" else reason
            if thinking:  # (a reply that is reasoning only has no content: null, as vLLM gives it)
                message["content"] = message["content"] or None
                message["reasoning_content"] = reasoning or None
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": chat_logprobs(got.logprobs[i]) if params.logprobs is not None else None,
                    "finish_reason": reason,
                }
            )
        return chunk(choices, usage(group.prompt_tokens, got.completion), obj="chat.completion")

    return app


def serve(
    engine: Engine,
    *,
    model_name: str = "openk3",
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    log_level: str = "info",
    max_request_bytes: int = MAX_REQUEST_BYTES,
    reasoning_parser: str | None = None,
) -> None:
    """Run the server until interrupted (Ctrl+C, SIGTERM). The HTTP side (uvicorn) runs in a thread and the
    engine's loop in the calling thread: on CPU that is the thread that built the model, whose torch thread pool
    is then the only one (see :meth:`Engine.run_loop`)."""
    import signal

    import uvicorn

    app = create_app(
        engine,
        model_name,
        api_key=api_key,
        max_request_bytes=max_request_bytes,
        reasoning_parser=reasoning_parser,
        start_engine=False,  # (the loop runs below, in this thread)
        loop_required=True,
    )
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False))
    http = threading.Thread(target=server.run, name="openk3-http", daemon=True)
    on_main = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, lambda *_: engine.request_stop()) if on_main else None
    http.start()
    try:
        engine.run_loop(until=lambda: not http.is_alive())
    except KeyboardInterrupt:
        pass
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, old_term)
        engine.shutdown()  # first: running requests end (aborted), so their streams close and uvicorn can stop
        server.should_exit = True
        http.join(30)
    if not server.started:
        raise RuntimeError(f"the HTTP server could not start on {host}:{port} (see the log above)")


@dataclass
class _Collected:
    texts: list[str]
    reasons: list[str | None]
    completion: int  # completion tokens of all choices
    logprobs: list[list]  # TokenLogprobs per choice (SamplingParams.logprobs)
    prompt_logprobs: list  # per choice: None, or the prompt's logprobs (first None)


async def _collect(group, request) -> _Collected:
    """Drain a non-streaming request group."""
    k = len(group.reqs)
    got = _Collected([""] * k, [None] * k, 0, [[] for _ in range(k)], [None] * k)
    try:
        async for batch in group.events(request):
            for i, out in batch:
                err = _output_error(out)
                if err is not None:
                    raise err
                got.texts[i] += out.new_text
                got.completion += len(out.new_token_ids)
                got.logprobs[i] += out.new_logprobs or []
                if out.prompt_logprobs is not None:
                    got.prompt_logprobs[i] = out.prompt_logprobs
                if out.finished:
                    got.reasons[i] = out.finish_reason
    finally:
        group.abort()
    return got

"""Tool calling in Kimi's format: the request's tools and tool choice checked, the grammar that forces a call, and
the parser that reads calls out of a reply (whole, or as it streams).

A Kimi model writes its calls after any text of its reply, in one section::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON arguments}<|tool_call_end|>
    ... (more calls)
    <|tool_calls_section_end|>

(without the line breaks). The markers are special tokens of Kimi's tokenizer; with a tokenizer that lacks them
the same text is plain text, which the parser reads just as well. ``functions.NAME:IDX`` is the call's id, which
the client hands back in the ``tool`` message of the call's result (``## Return of {id}`` in the prompt).

The parser never fails: a call's arguments are returned as written (OpenAI's ``arguments`` is a string the client
must check; a reply cut short by ``max_tokens`` has its last call's arguments cut short too), a call of a function
that was not declared is returned as it is, and anything else in the section that does not follow the layout (a
call header without its argument marker or with an id that is not ``[functions.]NAME[:IDX]``, text between calls)
ends the section's parsing: from the end of the call before it (from the section's start when there is none) the
reply's text, markers included, is content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from openk3.infer.sampling import SamplingParamError
from openk3.train.tokenizer import (
    TOOL_ARGUMENT_BEGIN,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_MARKERS,
    TOOL_SECTION_BEGIN,
    TOOL_SECTION_END,
)

__all__ = [
    "tool_params",
    "ToolError",
    "ToolRequest",
    "ToolCall",
    "ToolCallParser",
    "parse_tool_calls",
    "tool_request",
    "tool_grammar",
]

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CALL_ID = re.compile(r"(?:functions\.)?([^\s:]+)(?::\d+)?")
_CHOICE_HELP = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
# a function without ``parameters`` takes none (OpenAI): its arguments are {}
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolError(SamplingParamError):
    """A request's tools or tool choice that cannot be served; ``param`` names the field."""


@dataclass
class ToolRequest:
    """A chat request's ``tools`` (checked), ``tool_choice`` ("none", "auto", "required" or "function" for a named
    one, ``name``) and ``parallel_tool_calls``."""

    tools: list[dict]
    choice: str
    name: str | None = None
    parallel: bool = True

    @property
    def parse(self) -> bool:
        """The reply is read for tool calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """The reply is constrained to a tool-call section (required, or a named function)."""
        return self.choice in ("required", "function")


def tool_request(body: dict) -> ToolRequest:
    """The :class:`ToolRequest` of a chat request's OpenAI fields; :class:`ToolError` for invalid ones."""
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ToolError(
            "tools", 'tools must be a list of {"type": "function", "function": {"name": ...}} objects'
        )
    names = set()
    for k, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ToolError(
                "tools", f'tools[{k}] must be {{"type": "function", "function": {{"name": ...}}}}'
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolError(
                "tools", f"tools[{k}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}"
            )
        if name in names:
            raise ToolError("tools", f"tools[{k}]: the function name {name!r} is declared twice")
        names.add(name)
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolError("tools", f"tools[{k}].function.parameters must be a JSON schema object")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolError("tools", f"tools[{k}].function.description must be a string")
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", "parallel_tool_calls must be true or false")
    tc = body.get("tool_choice")
    if tc is None:
        return ToolRequest(tools, "auto" if tools else "none", parallel=parallel)
    if isinstance(tc, str):
        if tc not in ("none", "auto", "required"):
            raise ToolError("tool_choice", f"tool_choice must be {_CHOICE_HELP}, got {tc!r}")
        if tc == "required" and not tools:
            raise ToolError("tool_choice", 'tool_choice "required" needs tools: declare them in "tools"')
        return ToolRequest(tools, tc, parallel=parallel)
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(tc, dict) or tc.get("type") != "function" or not isinstance(fn, dict):
        raise ToolError("tool_choice", f"tool_choice must be {_CHOICE_HELP}")
    name = fn.get("name")
    if not isinstance(name, str) or name not in names:
        raise ToolError(
            "tool_choice", f"tool_choice names the function {name!r}, which is not declared in tools"
        )
    return ToolRequest(tools, "function", name=name, parallel=parallel)


def tool_grammar(
    req: ToolRequest, special_id: Callable[[str], int | None], compact_json: bool = False
) -> str:
    """The Lark grammar (llguidance's) of a forced tool-call section: one call of the named function, or one or more
    calls (exactly one without ``parallel_tool_calls``) of the declared functions, each one's arguments JSON that
    its ``parameters`` schema accepts. ``special_id(marker)``: the marker's special token id (the grammar then asks
    for that token), or None (its text). ``compact_json``: no whitespace in the arguments (a schema's own
    ``x-guidance`` options win)."""

    def mark(m: str) -> str:
        i = special_id(m)
        return f"<[{i}]>" if i is not None else json.dumps(m)

    tools = [t for t in req.tools if req.choice != "function" or t["function"]["name"] == req.name]
    lines = [
        f"start: {mark(TOOL_SECTION_BEGIN)} call{'+' if req.parallel else ''} {mark(TOOL_SECTION_END)}",
        "call: " + " | ".join(f"call_{k}" for k in range(len(tools))),
        "IDX: /[0-9]{1,6}/",
    ]
    for k, t in enumerate(tools):
        fn = t["function"]
        schema = dict(fn.get("parameters") or _NO_PARAMETERS)
        own = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
        schema["x-guidance"] = {"whitespace_flexible": not compact_json, **own}
        lines += [
            f"call_{k}: {mark(TOOL_CALL_BEGIN)} {json.dumps('functions.' + fn['name'] + ':')} IDX "
            f"{mark(TOOL_ARGUMENT_BEGIN)} args_{k} {mark(TOOL_CALL_END)}",
            f"args_{k}: %json {json.dumps(schema)}",
        ]
    return "\n".join(lines) + "\n"


def tool_params(
    req: ToolRequest, params, special_id: Callable[[str], int | None], compact_json: bool = False
) -> None:
    """Set a chat request's :class:`~openk3.infer.sampling.SamplingParams` for its tools when the reply is parsed:
    the markers that are special tokens stay in its text, where the parser reads them (vLLM turns
    ``skip_special_tokens`` off for its parser), and a forced call gets :func:`tool_grammar`."""
    params.keep_special_token_ids = [i for i in map(special_id, TOOL_MARKERS) if i is not None]
    if req.forced:
        params.guided = {"grammar": tool_grammar(req, special_id, compact_json)}


# ------------------------------------------------------------------------------------------------ parsing
@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ToolDelta:
    """What a piece of a streamed reply adds: ``content`` text, and per call ``(index, call or None, arguments)``:
    the call (id and name) on its first delta, then None; ``arguments`` the text added to its arguments."""

    content: str = ""
    calls: list[tuple[int, ToolCall | None, str]] = field(default_factory=list)


def held_prefix(text: str, markers) -> int:
    """The length of the longest end of ``text`` that is the start of one of ``markers`` (but not all of it): text
    held back while a marker may be arriving (here and in :mod:`openk3.infer.reasoning`)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def _first_marker(text: str, start: int) -> int:
    found = [i for i in (text.find(m, start) for m in TOOL_MARKERS) if i >= 0]
    return min(found) if found else -1


def _parse(text: str, final: bool) -> tuple[str, list[ToolCall]]:
    """(content, calls) of ``text``. Unless ``final``, what may still change as the text grows is left out (a
    marker's start at the end, a call header without its argument marker yet), so that each result extends the
    last: content only grows at its end, calls only grow in number and arguments."""
    content: list[str] = []
    calls: list[ToolCall] = []
    pos, n = 0, len(text)
    while True:
        i = text.find(TOOL_SECTION_BEGIN, pos)
        if i < 0:
            tail = text[pos:]
            content.append(tail if final else tail[: len(tail) - held_prefix(tail, (TOOL_SECTION_BEGIN,))])
            return "".join(content), calls
        content.append(text[pos:i])
        pos, ncalls = i + len(TOOL_SECTION_BEGIN), len(calls)
        while True:  # inside the section
            # (where the layout breaks, the text from the last call's end is content; all of it, the section's
            # start included, when no call came before)
            raw = text[pos if len(calls) > ncalls else i :]
            j = pos
            while j < n and text[j].isspace():
                j += 1
            if j == n:
                return "".join(content), calls
            if text.startswith(TOOL_SECTION_END, j):
                pos = j + len(TOOL_SECTION_END)
                break
            rest = text[j:]
            if not final and any(m.startswith(rest) for m in (TOOL_CALL_BEGIN, TOOL_SECTION_END)):
                return "".join(content), calls  # a marker arriving
            if not text.startswith(TOOL_CALL_BEGIN, j):
                content.append(raw)
                return "".join(content), calls
            head = j + len(TOOL_CALL_BEGIN)
            m = _first_marker(text, head)
            if m < 0 or not text.startswith(TOOL_ARGUMENT_BEGIN, m):
                if m < 0 and not final:
                    return "".join(content), calls  # the header is still arriving
                content.append(raw)
                return "".join(content), calls
            call_id = text[head:m].strip()
            got = _CALL_ID.fullmatch(call_id)
            if got is None:
                content.append(raw)
                return "".join(content), calls
            a = m + len(TOOL_ARGUMENT_BEGIN)
            e = _first_marker(text, a)
            if e < 0:
                args = text[a:]
                calls.append(
                    ToolCall(
                        call_id,
                        got.group(1),
                        args if final else args[: len(args) - held_prefix(args, TOOL_MARKERS)],
                    )
                )
                return "".join(content), calls
            calls.append(ToolCall(call_id, got.group(1), text[a:e]))
            # (another marker than the call's end ends its arguments too, and is read next)
            pos = e + len(TOOL_CALL_END) if text.startswith(TOOL_CALL_END, e) else e


class ToolCallParser:
    """Reads a reply's tool calls as its text streams in: :meth:`feed` each piece of text, then :meth:`finish`; each
    returns a :class:`ToolDelta`. Fed a reply in any pieces, the deltas add up to :func:`parse_tool_calls` of the
    whole text."""

    def __init__(self):
        self.text = ""
        self.content = ""  # content given out so far
        self.calls: list[ToolCall] = []  # calls given out so far (their arguments as far as given out)
        self._scan = 0  # where to look for the section's start (none before)

    def feed(self, piece: str, final: bool = False) -> ToolDelta:
        self.text += piece
        if not final and TOOL_SECTION_BEGIN not in self.text[self._scan :]:
            # no section yet: plain text (a marker's start held back), without parsing the whole reply again
            self._scan = max(0, len(self.text) - len(TOOL_SECTION_BEGIN) + 1)
            upto = len(self.text) - held_prefix(self.text, (TOOL_SECTION_BEGIN,))
            delta = ToolDelta(self.text[len(self.content) : upto])
            self.content = self.text[:upto]
            return delta
        content, calls = _parse(self.text, final)
        delta = ToolDelta(content[len(self.content) :])
        self.content = content
        for k, call in enumerate(calls):
            if k == len(self.calls):
                self.calls.append(ToolCall(call.id, call.name, ""))
                delta.calls.append((k, ToolCall(call.id, call.name, call.arguments), call.arguments))
            elif len(call.arguments) > len(self.calls[k].arguments):
                delta.calls.append((k, None, call.arguments[len(self.calls[k].arguments) :]))
            else:
                continue
            self.calls[k].arguments = call.arguments
        return delta

    def finish(self) -> ToolDelta:
        return self.feed("", final=True)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole reply (see the module's docstring)."""
    return _parse(text, final=True)

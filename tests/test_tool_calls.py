"""Tool calling in Kimi's format: the parser (whole and streamed), the chat template's tools / tool calls / tool
results, the forced-call grammar, and the server's tools, tool_choice and parallel_tool_calls through the official
``openai`` client, with a tokenizer that has Kimi's tool-call special tokens and with one that has not."""

import json
import random
import re
import types

import pytest
import torch

from openk3.infer.tools import ToolCallParser, ToolError, parse_tool_calls, tool_grammar, tool_request
from openk3.train.data import default_corpus
from openk3.train.tokenizer import Tokenizer
from serving import running

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MARKERS = (SB, SE, CB, AB, CE)
THINK = ("<think>", "</think>")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "boolean"}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: its arguments are {}
TOOLS = [WEATHER, ADD, NOW]


def _call(name, idx, args):
    return f"{CB}functions.{name}:{idx}{AB}{args}{CE}"


def _streamed(text, cuts):
    """(content, [(id, name, arguments)]) of ``text`` fed to a ToolCallParser in the pieces ``cuts`` make."""
    p, content, calls = ToolCallParser(), "", []
    bounds = [0, *sorted(cuts), len(text)]
    deltas = [p.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [p.finish()]
    for d in deltas:
        content += d.content
        for k, call, args in d.calls:
            if call is not None:
                assert k == len(calls)
                calls.append([call.id, call.name, args])
            else:
                calls[k][2] += args
    return content, [tuple(c) for c in calls]


def _whole(text):
    content, calls = parse_tool_calls(text)
    return content, [(c.id, c.name, c.arguments) for c in calls]


# ------------------------------------------------------------------------------------------------ parser
def test_parse_well_formed_replies():
    assert _whole("just text") == ("just text", [])
    one = SB + _call("get_weather", 0, '{"city": "Paris"}') + SE
    assert _whole(one) == ("", [("functions.get_weather:0", "get_weather", '{"city": "Paris"}')])
    two = f"Let me look.{SB}{_call('get_weather', 3, '{}')}\n" + _call("add", 4, '{"a":true}') + SE
    assert _whole(two) == (
        "Let me look.",
        [("functions.get_weather:3", "get_weather", "{}"), ("functions.add:4", "add", '{"a":true}')],
    )
    # an id without the functions. prefix or the index is read too (the id stays as written)
    assert _whole(f"{SB}{CB} now {AB}{{}}{CE}{SE}") == ("", [("now", "now", "{}")])
    # text after the section is content as well
    assert _whole(f"a{SB}{_call('now', 0, '{}')}{SE}b") == ("ab", [("functions.now:0", "now", "{}")])


def test_parse_malformed_replies_never_fail():
    # cut short (max_tokens): the last call's arguments as far as they got
    assert _whole(f'x{SB}{_call("add", 0, "{}")}{CB}functions.add:1{AB}{{"a":') == (
        "x",
        [("functions.add:0", "add", "{}"), ("functions.add:1", "add", '{"a":')],
    )
    # a section that never closes, or holds no call: no calls
    assert _whole(f"x{SB}") == ("x", [])
    # arguments that are not JSON, a function that was not declared: returned as written
    assert _whole(f"{SB}{_call('nope', 0, 'not json')}{SE}") == (
        "",
        [("functions.nope:0", "nope", "not json")],
    )
    # a header that is not an id, or without its argument marker: the section's text is content, markers and all
    bad = f"{SB}{CB}two words{AB}{{}}{CE}{SE}"
    assert _whole(bad) == (bad, [])
    cut = f"hi{SB}{CB}functions.add:0"
    assert _whole(cut) == (cut, [])
    # text between calls ends the parsing there: the rest is content
    junk = f" junk {_call('add', 1, '{}')}{SE}"
    assert _whole(f"{SB}{_call('now', 0, '{}')}{junk}") == (junk, [("functions.now:0", "now", "{}")])


@pytest.mark.parametrize(
    "text",
    [
        "plain <|tool_calls text that only looks like a marker's start <",
        f"Let me look.{SB}"
        + _call("get_weather", 3, '{"city": "Oslo", "days": 2}')
        + _call("add", 4, "{}")
        + SE,
        f'x{SB}{_call("add", 0, "{}")} {CB}functions.add:1{AB}{{"a": <|',
        f"{SB}{CB}two words{AB}{{}}{CE}{SE}tail",
        f"{SB}{_call('now', 0, '{}')} junk {_call('add', 1, '{}')}{SE}",
        f"a{SB}{_call('now', 0, '{}')}{SE}b{SB}{_call('add', 1, '{}')}",
        f"hi{SB}{CB}functions.add:0",
    ],
)
def test_streamed_parse_equals_whole_parse(text):
    """Fed in any pieces (character by character, at random cuts, whole), the deltas add up to the whole parse, and
    no marker reaches the content of a well-formed reply."""
    want = _whole(text)
    assert _streamed(text, range(1, len(text))) == want
    rng = random.Random(0)
    for _ in range(20):
        assert _streamed(text, rng.sample(range(1, len(text)), k=min(5, len(text) - 1))) == want
    assert _streamed(text, []) == want


def test_streamed_content_holds_back_a_marker_start_only_while_it_may_be_one():
    p = ToolCallParser()
    assert p.feed("Hello <|tool_calls").content == "Hello "
    d = p.feed("_section_begin|>")
    assert d.content == "" and d.calls == []
    d = p.feed(f'{CB}functions.add:0{AB}{{"a"')
    assert [(k, c.id, c.name, a) for k, c, a in d.calls] == [(0, "functions.add:0", "add", '{"a"')]
    d = p.feed(f": true}}{CE}{SE}")
    assert [(k, c, a) for k, c, a in d.calls] == [(0, None, ": true}")]
    assert p.finish().content == ""
    q = ToolCallParser()
    assert q.feed("a <|tool").content == "a "
    assert q.feed("box|> b").content == "<|toolbox|> b"


# ------------------------------------------------------------------------------------------------ request checks
def test_tool_request_checks():
    r = tool_request({"tools": TOOLS})
    assert (r.choice, r.parse, r.forced, r.parallel) == ("auto", True, False, True)
    r = tool_request({"tools": TOOLS, "tool_choice": "none"})
    assert (r.choice, r.parse) == ("none", False)
    assert tool_request({}).choice == "none" and not tool_request({"tools": []}).parse
    r = tool_request({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert (r.choice, r.name, r.forced) == ("function", "add", True)
    assert (
        tool_request({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}).parallel
        is False
    )
    fn = WEATHER["function"]
    bad = [
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [fn]}, "tools"),  # the function without its {"type": "function"} wrapper
        ({"tools": [{"type": "function", "function": dict(fn, name="a b")}]}, "tools"),
        ({"tools": [{"type": "function", "function": dict(fn, name="x" * 65)}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": dict(fn, parameters=[1])}]}, "tools"),
        ({"tools": [{"type": "function", "function": dict(fn, description=3)}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ]
    for body, param in bad:
        with pytest.raises(ToolError) as e:
            tool_request(body)
        assert e.value.param == param, body


# ------------------------------------------------------------------------------------------------ chat template
def _tiktoken_kimi(tmp_path, with_markers=True):
    """A tiktoken-backed tokenizer (Kimi's kind: the bytes and a few merges), with the tool-call and think markers as
    special tokens after them or without."""
    import base64

    pytest.importorskip("tiktoken")
    ranks = [bytes([b]) for b in range(256)] + [b"ti", b"on", b"fu", b"nc", b"Os", b"lo"]
    path = tmp_path / "tiktoken.model"
    path.write_bytes(
        b"".join(base64.b64encode(t) + b" " + str(i).encode() + b"\n" for i, t in enumerate(ranks))
    )
    names = ["<|eos|>", *((*MARKERS, *THINK) if with_markers else ())]
    return Tokenizer.from_file(path, special_tokens={m: len(ranks) + k for k, m in enumerate(names)})


def _kimi_tokenizer(tmp_path, with_markers=True):
    """A small BPE tokenizer, with Kimi's tool-call markers as special tokens (as Kimi's tokenizer has them) or
    without."""
    tok = Tokenizer.train_bpe(default_corpus(max_bytes=300_000), vocab_size=1024, cache_dir=tmp_path)
    if with_markers:
        tok._hf.add_special_tokens([*MARKERS, *THINK])
        tok.special_tokens.update({m: tok._hf.token_to_id(m) for m in (*MARKERS, *THINK)})
    return tok


CALL = {
    "id": "functions.get_weather:0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {
        "role": "tool",
        "tool_call_id": "functions.get_weather:0",
        "content": [{"type": "text", "text": "sunny"}],
    },
]


def test_builtin_chat_template_renders_tools_in_kimi_layout(tmp_path):
    tok = _kimi_tokenizer(tmp_path)
    prompt = tok.apply_chat_template(CONVERSATION, tools=[WEATHER])
    want = (
        f"<|im_start|>tool_declare\n{json.dumps([WEATHER])}<|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        f'<|im_start|>assistant\n{SB}{CB}functions.get_weather:0{AB}{{"city": "Oslo"}}{CE}{SE}<|im_end|>\n'
        "<|im_start|>tool\n## Return of functions.get_weather:0\nsunny<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert prompt == want
    ids = tok.encode(prompt)
    for m in MARKERS:  # each marker one special token
        assert ids.count(tok.token_to_id(m)) == 1
    # content before the calls, arguments given as an object, an id left out (Kimi's functions.NAME:J)
    msg = {
        "role": "assistant",
        "content": "On it.",
        "tool_calls": [{"function": {"name": "now", "arguments": {"a": 1}}}],
    }
    assert tok.apply_chat_template([msg], add_generation_prompt=False) == (
        f'<|im_start|>assistant\nOn it.{SB}{CB}functions.now:0{AB}{{"a": 1}}{CE}{SE}<|im_end|>\n'
    )
    # without tools nothing is declared; a tokenizer without the markers encodes the same text as plain text
    assert "tool_declare" not in tok.apply_chat_template(CONVERSATION)
    plain = _kimi_tokenizer(tmp_path, with_markers=False)
    assert plain.apply_chat_template(CONVERSATION, tools=[WEATHER]) == want
    assert plain.token_to_id(SB) is None and plain.decode(plain.encode(want)) == want


def test_jinja_chat_template_gets_tools(tmp_path):
    pytest.importorskip("jinja2")
    tok = _kimi_tokenizer(tmp_path)
    tok.chat_template = (
        "{% if tools %}[tools]{{ tools | tojson }}{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}<{{ c.id }}>{% endfor %}{% endfor %}"
    )
    out = tok.apply_chat_template(CONVERSATION[:2], tools=[NOW])
    # (transformers' tojson: plain JSON, not jinja's HTML-escaped one)
    assert out == f"[tools]{json.dumps([NOW])}[user]Weather in Oslo?[assistant]<functions.get_weather:0>"
    assert tok.apply_chat_template([{"role": "user", "content": "<b>"}]) == "[user]<b>"


def test_chat_template_kwargs(tmp_path):
    """vLLM's chat_template_kwargs: a jinja template's own variables; the built-in template takes ``thinking``
    (its prompt is the same either way) and refuses other names; the request's own variables cannot be set."""
    pytest.importorskip("jinja2")
    tok = _kimi_tokenizer(tmp_path)
    hi = [{"role": "user", "content": "hi"}]
    plain = tok.apply_chat_template(hi)
    assert tok.apply_chat_template(hi, template_kwargs={"thinking": False}) == plain
    with pytest.raises(ValueError, match="only the 'thinking' option"):
        tok.apply_chat_template(hi, template_kwargs={"enable_thinking": True})
    tok.chat_template = "{% if thinking %}<think>{% endif %}{{ messages[0].content }}{{ style or '' }}"
    assert tok.apply_chat_template(hi, template_kwargs={"thinking": True, "style": "!"}) == "<think>hi!"
    assert tok.apply_chat_template(hi, template_kwargs={"thinking": False}) == "hi"
    for name in ("messages", "tools", "add_generation_prompt", "eos_token"):
        with pytest.raises(ValueError, match="set by the chat request"):
            tok.apply_chat_template(hi, template_kwargs={name: 1})


# ------------------------------------------------------------------------------------------------ grammar
@pytest.mark.parametrize("with_markers", [True, False], ids=["special", "plain"])
@pytest.mark.parametrize("backend", ["hf", "tiktoken"])
def test_tool_grammar_accepts_calls_of_the_schemas_only(tmp_path, with_markers, backend):
    pytest.importorskip("llguidance")
    from openk3.infer.guided import GuidedCompiler

    tok = (
        _kimi_tokenizer(tmp_path, with_markers) if backend == "hf" else _tiktoken_kimi(tmp_path, with_markers)
    )
    compiler = GuidedCompiler(tok, [tok.eos_id])

    def accepts(req, text):
        m = compiler.matcher({"grammar": tool_grammar(req, tok.special_tokens.get, compact_json=True)})
        return all(m.consume_token(t) for t in tok.encode(text)) and m.is_accepting()

    required = tool_request({"tools": TOOLS, "tool_choice": "required"})
    w = _call("get_weather", 0, '{"city":"Oslo","days":3}')
    assert accepts(required, f"{SB}{w}{SE}")
    assert accepts(required, SB + w + _call("now", 1, "{}") + _call("add", 2, '{"a":false}') + SE)
    assert not accepts(required, SB + _call("get_weather", 0, '{"city":"Rome","days":3}') + SE)
    assert not accepts(required, SB + _call("get_weather", 0, '{"city":"Oslo"}') + SE)
    assert not accepts(required, SB + _call("now", 0, '{"x":1}') + SE)
    assert not accepts(required, f"{SB}{_call('other', 0, '{}')}{SE}")
    assert not accepts(required, f"Sure.{SB}{w}{SE}")
    assert not accepts(required, f"{SB}{SE}")
    single = tool_request({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert accepts(single, f"{SB}{w}{SE}") and not accepts(single, f"{SB}{w}{w}{SE}")
    named = tool_request({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert accepts(named, SB + _call("add", 5, '{"a":true}') + SE) and not accepts(named, f"{SB}{w}{SE}")
    if with_markers:  # the markers' text is not the markers
        assert not tok.encode(f"{SB}{w}{SE}", allow_special=False) == tok.encode(f"{SB}{w}{SE}")
        m = compiler.matcher({"grammar": tool_grammar(required, tok.special_tokens.get, compact_json=True)})
        assert not m.consume_token(tok.encode(SB, allow_special=False)[0])


# ------------------------------------------------------------------------------------------------ server
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

MODEL = "tiny-tools"


class _ScriptedEngine:
    """The engine, except that while ``script`` is set, a request without structured output gets that grammar: a
    random model then writes a chosen reply, as a trained one would (the server parses it as a model's own)."""

    def __init__(self, engine):
        self._engine = engine
        self.script = None

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def submit(self, prompt, params=None, **kw):
        if self.script is not None and params.guided is None:
            params.guided = {"grammar": self.script}
        return self._engine.submit(prompt, params, **kw)


@pytest.fixture(scope="module", params=[True, False], ids=["special", "plain"])
def served(tmp_path_factory, request):
    from openk3.config import get_preset
    from openk3.infer.engine import Engine
    from openk3.infer.server import create_app
    from openk3.model import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("tiny")).eval()
    tok = _kimi_tokenizer(tmp_path_factory.mktemp("tok"), request.param)
    engine = _ScriptedEngine(
        Engine(
            model, tok, page_size=16, max_seqs=8, max_tokens=4096, max_model_len=768, guided_compact_json=True
        )
    )
    with running(create_app(engine, MODEL)) as url:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60), engine


ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _validate(args: str, tool: dict) -> dict:
    """The arguments' JSON, checked against the tool's schema (the test schemas' keywords)."""
    value = json.loads(args)
    schema = tool["function"].get("parameters") or {"properties": {}, "additionalProperties": False}
    assert isinstance(value, dict) and set(schema.get("required", [])) <= set(value)
    assert set(value) <= set(schema["properties"])
    for k, v in value.items():
        p = schema["properties"][k]
        if "enum" in p:
            assert v in p["enum"]
        if p["type"] == "integer":
            assert isinstance(v, int) and p["minimum"] <= v <= p["maximum"]
        if p["type"] == "boolean":
            assert isinstance(v, bool)
    return value


def _stream(client, **kw):
    """(content, {index: [id, name, arguments]}, finish_reason) of a streamed chat reply."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name, d
                calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
            else:
                assert d.id is None and d.function.name is None, d
                calls[d.index][2] += d.function.arguments or ""
        reason = ch.finish_reason or reason
    return content, calls, reason


def test_required_and_named_tool_choice_give_calls_of_the_schemas(served):
    _, client, _ = served
    by_name = {t["function"]["name"]: t for t in TOOLS}
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, temperature=1.0)
    for seed in (1, 2):
        r = client.chat.completions.create(tool_choice="required", seed=seed, **kw)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
        assert ch.message.tool_calls
        for c in ch.message.tool_calls:
            assert c.type == "function" and c.id.startswith(f"functions.{c.function.name}:")
            _validate(c.function.arguments, by_name[c.function.name])
        # the same reply streamed: content none, the calls' deltas adding up to the same calls
        content, calls, reason = _stream(
            client, tool_choice="required", seed=seed, **{k: v for k, v in kw.items() if k != "model"}
        )
        assert content == "" and reason == "tool_calls"
        assert [calls[k] for k in sorted(calls)] == [
            [c.id, c.function.name, c.function.arguments] for c in ch.message.tool_calls
        ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(tool_choice=named, parallel_tool_calls=False, seed=3, **kw)
    (c,) = r.choices[0].message.tool_calls
    assert c.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    assert _validate(c.function.arguments, WEATHER)["city"] in ("Paris", "Oslo")
    content, calls, reason = _stream(
        client,
        tool_choice=named,
        parallel_tool_calls=False,
        seed=4,
        **{k: v for k, v in kw.items() if k != "model"},
    )
    assert reason == "tool_calls" and list(calls) == [0] and calls[0][1] == "get_weather"
    _validate(calls[0][2], WEATHER)
    # a function without parameters is called with {}
    r = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "now"}}, **kw)
    assert [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls] == [{}] * len(
        r.choices[0].message.tool_calls
    )


def _script(engine, text):
    """A grammar that makes the model write ``text`` (the markers as the tokenizer has them)."""
    parts = []
    for piece in re.split("(" + "|".join(re.escape(m) for m in (*MARKERS, *THINK)) + ")", text):
        if not piece:
            continue
        i = engine.tokenizer.special_tokens.get(piece)
        parts.append(f"<[{i}]>" if i is not None else json.dumps(piece))
    return "start: " + " ".join(parts) + "\n"


def test_auto_parses_the_calls_a_model_writes(served):
    url, client, engine = served
    reply = (
        "Checking."
        + SB
        + _call("get_weather", 0, '{"city": "Oslo", "days": 2}')
        + _call("add", 1, '{"a": true}')
        + SE
    )
    engine.script = _script(engine, reply)
    try:
        kw = dict(messages=ASK, tools=TOOLS, max_tokens=200)
        r = client.chat.completions.create(model=MODEL, **kw)  # (tool_choice: auto by default)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and m.content == "Checking."
        got = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]
        assert got == [
            ("functions.get_weather:0", "get_weather", '{"city": "Oslo", "days": 2}'),
            ("functions.add:1", "add", '{"a": true}'),
        ]
        content, calls, reason = _stream(client, **kw)
        assert (content, reason) == ("Checking.", "tool_calls")
        assert [tuple(calls[k]) for k in sorted(calls)] == got
        # tool_choice none: nothing is parsed (and with the markers as special tokens, none is written)
        r = client.chat.completions.create(model=MODEL, tool_choice="none", **kw)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
        if engine.tokenizer.special_tokens.get(SB) is None:
            assert r.choices[0].message.content == reply
        # without tools, the reply is text as before (special tokens left out of it)
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200)
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content.startswith(
            "Checking."
        )
        # a malformed reply: arguments that are not JSON, an undeclared function, a broken second header
        bad = f"{SB}{_call('nope', 0, 'not json')}{CB}oops{CE}{SE}"
        engine.script = _script(engine, bad)
        r = client.chat.completions.create(model=MODEL, **kw)
        m = r.choices[0].message
        assert [(c.function.name, c.function.arguments) for c in m.tool_calls] == [("nope", "not json")]
        assert m.content == f"{CB}oops{CE}{SE}" and r.choices[0].finish_reason == "tool_calls"
        content, calls, reason = _stream(client, **kw)
        assert content == m.content and [c[1:] for c in calls.values()] == [["nope", "not json"]]
        # a reply cut short by max_tokens keeps finish_reason "length"
        n_full = r.usage.completion_tokens
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=n_full - 3)
        assert r.choices[0].finish_reason == "length"
    finally:
        engine.script = None


def test_multi_turn_with_tool_results_is_rendered(served):
    url, client, engine = served
    messages = [
        *CONVERSATION[:2],
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=3, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the prompt the server rendered (vLLM's /tokenize) is the template's, with the markers as the tokenizer has them
    body = {"model": MODEL, "messages": messages, "tools": [WEATHER]}
    got = httpx.post(url + "/tokenize", json=body, timeout=30).json()
    want = engine.tokenizer.apply_chat_template(messages, tools=[WEATHER])
    assert got["tokens"] == engine.tokenizer.encode(want)
    assert r.usage.prompt_tokens == got["count"]
    # a reply's message object sent back as it is (as OpenAI's examples do), with the call's result
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[NOW],
        tool_choice="required",
        max_tokens=120,
        parallel_tool_calls=False,
    )
    (call,) = r.choices[0].message.tool_calls
    follow = [*ASK, r.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    again = client.chat.completions.create(model=MODEL, messages=follow, tools=[NOW], max_tokens=2)
    want = engine.tokenizer.apply_chat_template(
        [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}, follow[-1]],
        tools=[NOW],
    )
    assert again.usage.prompt_tokens == len(engine.tokenizer.encode(want))
    assert f"{CB}{call.id}{AB}{{}}{CE}" in want and f"## Return of {call.id}\n12:00" in want


def test_bad_tool_requests_get_400s(served):
    url, client, engine = served

    def err(body, route="/v1/chat/completions"):
        r = httpx.post(
            url + route, json={"model": MODEL, "messages": ASK, "max_tokens": 2, **body}, timeout=30
        )
        assert r.status_code == 400, r.text
        return r.json()["error"]

    assert err({"tools": [{"function": {"name": "x"}}]})["param"] == "tools"
    assert err({"tools": [WEATHER, WEATHER]})["param"] == "tools"
    assert err({"tools": TOOLS, "tool_choice": "sometimes"})["param"] == "tool_choice"
    assert (
        err({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}})["param"]
        == "tool_choice"
    )
    assert err({"tool_choice": "required"})["param"] == "tool_choice"
    # a schema llguidance cannot read: the tools field is named
    broken = {
        "type": "function",
        "function": {
            "name": "b",
            "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
        },
    }
    assert err({"tools": [broken], "tool_choice": "required"})["param"] == "tools"
    # structured output and tool calls at once
    e = err({"tools": TOOLS, "response_format": {"type": "json_object"}})
    assert e["param"] == "response_format" and "tool" in e["message"]
    # messages: a tool result without the id of its call, tool calls on a user message, a legacy function_call
    e = err({"messages": [*ASK, {"role": "tool", "content": "x"}]})
    assert e["param"] == "messages" and "tool_call_id" in e["message"]
    call = CONVERSATION[1]["tool_calls"]
    assert err({"messages": [{"role": "user", "content": "x", "tool_calls": call}]})["param"] == "messages"
    assert (
        err({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}]})[
            "param"
        ]
        == "messages"
    )
    assert (
        err({"messages": [{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}]})["param"]
        == "messages"
    )
    # tools are the chat route's
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "tools": TOOLS}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    # ... and with no conflict, structured output and declared tools go together under tool_choice none
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=40,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    assert r.choices[0].message.content in ("yes", "no")
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_tool_choice_none_keeps_the_section_from_starting(served):
    """With the markers as special tokens, tool_choice none bans the section's first token (a -100 bias over the
    client's own), which auto leaves alone."""
    url, client, engine = served
    sb = engine.tokenizer.special_tokens.get(SB)
    if sb is None:
        pytest.skip("the tokenizer has no tool-call special tokens")
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4, logprobs=True, logit_bias={str(sb): 100})
    r = client.chat.completions.create(tool_choice="auto", **kw)
    toks = [t.token for t in r.choices[0].logprobs.content]
    assert toks[0] == SB
    r = client.chat.completions.create(tool_choice="none", **kw)
    assert SB not in [t.token for t in r.choices[0].logprobs.content]


def test_cli_chat_with_tools(tmp_path, monkeypatch, capsys):
    """openk3 chat --tools FILE: a forced call is printed with its id, /tool ID RESULT answers it; bad tool flags
    are refused before the model loads."""
    import io

    from openk3.cli import main

    monkeypatch.chdir(tmp_path)  # no runs/default here: the embedded tiny model is used
    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))
    (tmp_path / "tools.json").write_text(json.dumps([WEATHER, NOW]))
    common = [
        "--tools",
        "tools.json",
        "-n",
        "120",
        "--seed",
        "1",
        "--max-total-tokens",
        "1024",
        "--guided-compact-json",
    ]
    monkeypatch.setattr(
        "sys.stdin", io.StringIO("weather in Oslo?\n/tool\n/tool functions.get_weather:0 sunny\n/exit\n")
    )
    import openk3.infer.cli as cli

    rendered, render = [], cli._render
    monkeypatch.setattr(
        cli,
        "_render",
        lambda tok, msgs, tools=None: (
            rendered.append(tok.apply_chat_template(msgs, tools=tools)) or render(tok, msgs, tools)
        ),
    )
    assert main(["chat", "--tool-choice", "get_weather", *common]) == 0
    out = capsys.readouterr()
    # the second turn's prompt holds the first turn's call and its result
    assert len(rendered) == 2 and rendered[1].startswith(rendered[0]) and "tool_declare" in rendered[0]
    assert "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:" in rendered[1]
    assert rendered[1].endswith(
        "<|im_start|>tool\n## Return of functions.get_weather:0\nsunny<|im_end|>\n<|im_start|>assistant\n"
    )
    calls = [line for line in out.out.splitlines() if line.startswith("[tool call ")]
    assert len(calls) >= 2, out.out  # one per turn: the question's and the tool result's
    for line in calls:
        head, _, rest = line.partition("] ")
        assert head.startswith("[tool call functions.get_weather:") and rest.startswith("get_weather(")
        _validate(rest[len("get_weather(") : -1], WEATHER)
    assert "/tool ID RESULT" in out.err
    assert main(["chat", "--tool-choice", "missing", *common]) == 2
    assert "not declared" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{")
    assert main(["chat", "--tools", "bad.json"]) == 2
    assert "bad.json" in capsys.readouterr().err
    assert main(["chat", "--choice", "a", *common]) == 2
    assert "structured-output" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ reasoning
def _stream_thinking(client, **kw):
    """(reasoning, content, {index: [id, name, arguments]}, finish_reason) of a streamed chat reply."""
    reasoning, content, calls, reason = "", "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            calls.setdefault(d.index, [d.id, d.function.name, ""])[2] += d.function.arguments or ""
        reason = ch.finish_reason or reason
    return reasoning, content, calls, reason


def test_reasoning_parser_separates_thinking_from_the_answer_and_its_calls(served):
    """With ``reasoning_parser="kimi_k2"`` a reply's ``<think>`` part is ``reasoning_content``, the rest content
    and tool calls (a call section ends the reasoning too); streamed the same; ``thinking: false`` turns it off."""
    from openk3.infer.server import create_app

    _, _, engine = served
    special = engine.tokenizer.special_tokens.get(THINK[0]) is not None
    with running(create_app(engine, MODEL, start_engine=False, reasoning_parser="kimi_k2")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        cases = [
            # (reply, tools?, reasoning, content, calls)
            ("<think>Look it up first.</think>Checking." + SB + _call("get_weather", 0, '{"city": "Oslo"}') + SE,
             True, "Look it up first.", "Checking.", [("functions.get_weather:0", "get_weather", '{"city": "Oslo"}')]),
            ("<think>plan" + SB + _call("now", 0, "{}") + SE, True, "plan", None, [("functions.now:0", "now", "{}")]),
            ("Short answer.</think>It is sunny.", False, "Short answer.", "It is sunny.", []),
            ("<think>still thinking", False, "still thinking", None, []),
            ("<think>cut at </th", False, "cut at </th", None, []),  # (a held-back tail, flushed at the end)
        ]  # fmt: skip
        try:
            for reply, with_tools, want_r, want_c, want_calls in cases:
                engine.script = _script(engine, reply)
                kw = dict(messages=ASK, max_tokens=200, **({"tools": TOOLS} if with_tools else {}))
                r = client.chat.completions.create(model=MODEL, **kw)
                m = r.choices[0].message
                assert (m.model_extra.get("reasoning_content"), m.content) == (want_r, want_c), reply
                got = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
                assert got == want_calls, reply
                assert r.choices[0].finish_reason == ("tool_calls" if want_calls else "stop")
                sr, sc, scalls, sreason = _stream_thinking(client, **kw)
                assert (sr, sc or None) == (want_r, want_c), reply
                assert [tuple(scalls[k]) for k in sorted(scalls)] == want_calls
                assert sreason == r.choices[0].finish_reason
            # thinking off for one request: the whole reply is content (markers that are special tokens skipped)
            engine.script = _script(engine, "<think>hmm</think>Hello")
            r = client.chat.completions.create(
                model=MODEL,
                messages=ASK,
                max_tokens=50,
                extra_body={"chat_template_kwargs": {"thinking": False}},
            )
            m = r.choices[0].message
            assert m.model_extra.get("reasoning_content") is None
            assert m.content == ("hmmHello" if special else "<think>hmm</think>Hello")
            # the server without the parser leaves the reply as it is
            r = served[1].chat.completions.create(model=MODEL, messages=ASK, max_tokens=50)
            assert "reasoning_content" not in r.choices[0].message.model_extra
            assert r.choices[0].message.content == ("hmmHello" if special else "<think>hmm</think>Hello")
        finally:
            engine.script = None
    with pytest.raises(ValueError, match="reasoning_parser"):
        create_app(engine, MODEL, start_engine=False, reasoning_parser="deepseek")


def test_serve_cli_reasoning_parser(monkeypatch):
    """``openk3 serve --reasoning-parser kimi_k2`` reaches the server; ``none`` (the default) is no parser."""
    import openk3.infer.cli as icli
    import openk3.infer.server as srv
    from openk3.cli import build_parser

    got = []
    monkeypatch.setattr(icli, "_load", lambda args: (types.SimpleNamespace(graphs_enabled=False), "m", "src"))
    monkeypatch.setattr(icli, "_describe", lambda *a: None)
    monkeypatch.setattr(srv, "serve", lambda engine, **kw: got.append(kw["reasoning_parser"]))
    for argv, want in ((["serve"], None), (["serve", "--reasoning-parser", "kimi_k2"], "kimi_k2")):
        assert icli.cmd_serve(build_parser().parse_args(argv)) == 0
        assert got.pop() == want
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1"])
    assert srv.REASONING_PARSERS == ("kimi_k2",)  # (the CLI's choices, written out there)


def test_several_choices_stream_their_own_calls(served):
    """``n`` = 3 with a forced call, streamed: each choice's deltas (by choice index) add up to calls of the schemas,
    and the same seed non-streamed gives the same calls per choice."""
    _, client, _ = served
    by_name = {t["function"]["name"]: t for t in TOOLS}
    kw = dict(
        messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=1.0, n=3, seed=11
    )
    per = {}
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        for ch in chunk.choices:
            got = per.setdefault(ch.index, {"calls": {}, "reason": None})
            for d in ch.delta.tool_calls or []:
                if d.index not in got["calls"]:
                    got["calls"][d.index] = [d.id, d.function.name, d.function.arguments or ""]
                else:
                    got["calls"][d.index][2] += d.function.arguments or ""
            got["reason"] = ch.finish_reason or got["reason"]
    assert sorted(per) == [0, 1, 2]
    r = client.chat.completions.create(model=MODEL, **kw)
    for ch in r.choices:
        got = per[ch.index]
        assert got["reason"] == ch.finish_reason == "tool_calls"
        calls = [got["calls"][k] for k in sorted(got["calls"])]
        assert calls == [[c.id, c.function.name, c.function.arguments] for c in ch.message.tool_calls]
        for _, name, args in calls:
            _validate(args, by_name[name])


def test_reasoning_parser_defers_a_grammar_to_the_answer(served):
    """Under the reasoning parser a forced call or structured output applies after ``</think>`` (when it is a
    special token), as vLLM starts structured output after the reasoning: a model pushed to end its reasoning
    first writes ``</think>``, then the grammar's call or JSON. Where ``</think>`` is plain text (no token to wait
    for) the grammar applies from the first token: the reply is the call, with no reasoning."""
    from openk3.infer.server import create_app

    _, _, engine = served
    end = engine.tokenizer.special_tokens.get(THINK[1])
    by_name = {t["function"]["name"]: t for t in TOOLS}
    with running(create_app(engine, MODEL, start_engine=False, reasoning_parser="kimi_k2")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        if end is None:
            r = client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=200, seed=3, tools=TOOLS, tool_choice="required"
            )
            ch = r.choices[0]
            assert (
                ch.finish_reason == "tool_calls" and ch.message.model_extra.get("reasoning_content") is None
            )
            assert ch.message.tool_calls
            for c in ch.message.tool_calls:
                _validate(c.function.arguments, by_name[c.function.name])
            return
        kw = dict(
            model=MODEL, messages=ASK, max_tokens=200, seed=3, logit_bias={str(end): 100}, logprobs=True
        )
        r = client.chat.completions.create(tools=TOOLS, tool_choice="required", **kw)
        ch = r.choices[0]
        assert ch.logprobs.content[0].token == THINK[1]  # the reasoning ended first (empty), then the call
        assert ch.finish_reason == "tool_calls" and ch.message.model_extra.get("reasoning_content") is None
        for c in ch.message.tool_calls:
            _validate(c.function.arguments, by_name[c.function.name])
        r = client.chat.completions.create(
            response_format={"type": "json_object"}, **{**kw, "max_tokens": 60}, temperature=0
        )
        ch = r.choices[0]
        assert ch.logprobs.content[0].token == THINK[1]
        assert ch.message.content.lstrip().startswith("{"), ch.message.content


def test_cli_chat_reasoning_parser(tmp_path, monkeypatch, capsys):
    """openk3 chat --reasoning-parser kimi_k2: the reasoning goes to stderr, the answer to stdout, and only the
    answer stays in the conversation (a grammar makes the embedded random model write a thinking reply)."""
    import io

    import openk3.infer.cli as cli
    from openk3.cli import main

    monkeypatch.chdir(tmp_path)  # no runs/default here: the embedded tiny model is used
    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nagain\n/exit\n"))
    rendered, render = [], cli._render
    monkeypatch.setattr(
        cli, "_render", lambda tok, msgs, tools=None: rendered.append(msgs[-2:]) or render(tok, msgs, tools)
    )
    argv = [
        "chat",
        "--regex",
        "<think>plan ahead</think>The answer!",
        "-n",
        "80",
        "--max-total-tokens",
        "1024",
    ]
    assert main([*argv, "--reasoning-parser", "kimi_k2"]) == 0
    out = capsys.readouterr()
    assert out.out.count("The answer!") == 2 and "plan ahead" not in out.out and "think>" not in out.out
    assert out.err.count("plan ahead") == 2
    assert rendered[1][0] == {"role": "assistant", "content": "The answer!"}
    rendered.clear()
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nagain\n/exit\n"))
    assert main(argv) == 0  # without the parser the reply is kept whole
    assert "<think>plan ahead</think>The answer!" in capsys.readouterr().out
    assert rendered[1][0]["content"] == "<think>plan ahead</think>The answer!"

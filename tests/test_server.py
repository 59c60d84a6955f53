"""OpenAI-compatible server on 127.0.0.1, driven by the official ``openai`` client (and raw httpx for edge cases)."""

import asyncio
import copy
import json
import random
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from engine_chaos import pin_routing  # noqa: E402
from openk3.config import get_preset  # noqa: E402
from openk3.infer.engine import Engine  # noqa: E402
from openk3.infer.server import create_app  # noqa: E402
from openk3.model import K3ForCausalLM  # noqa: E402
from openk3.train.data import default_corpus  # noqa: E402
from openk3.train.tokenizer import Tokenizer  # noqa: E402
from serving import running  # noqa: E402

MODEL = "tiny-test"
CTX = 384
# the served engine's settings (both servers of this module)
ENGINE_KW = dict(page_size=16, max_seqs=40, max_tokens=16384, max_model_len=CTX, prefix_interval=32)


@pytest.fixture(scope="module", params=[False, True], ids=["sequential", "overlap"])
def engine(tmp_path_factory, request):
    """The served engine, once as is and once with EngineConfig.overlap (decode steps one ahead)."""
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("tiny")).eval()
    tok = Tokenizer.train_bpe(
        default_corpus(max_bytes=300_000), vocab_size=1024, cache_dir=tmp_path_factory.mktemp("tok")
    )
    yield Engine(model, tok, overlap=request.param, **ENGINE_KW)


@pytest.fixture(scope="module")
def server(engine):
    with running(create_app(engine, MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def _healthy(server):
    r = httpx.get(server + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def _wait_idle(engine, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["requests_running"] + s["requests_prefilling"] + s["requests_waiting"] == 0:
            return s
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: {engine.stats()}")


# ------------------------------------------------------------------------------------------------ basics
def test_models_health_metrics(server, client, engine):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    _healthy(server)
    text = httpx.get(server + "/metrics", timeout=10).text
    assert "openk3_requests_total" in text and "openk3_bytes_per_token 480" in text
    assert f"openk3_max_model_len {CTX}" in text
    assert 'openk3_requests_finished_total{reason="length"}' in text
    assert (
        "# TYPE openk3_pages_capacity gauge" in text
        and "# TYPE openk3_prompt_tokens_computed_total counter" in text
    )


def test_completion_and_usage(client, engine):
    prompt = "def fibonacci(n):"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    again = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert again.choices[0].text == r.choices[0].text
    # several prompts and n > 1 in one request; token-id prompts too
    r = client.completions.create(model=MODEL, prompt=["a = 1", "import os"], max_tokens=3, n=2, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    r = client.completions.create(model=MODEL, prompt=[10, 11, 12], max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == 3
    # OpenAI's frequency / presence penalties (a strongly negative one makes the greedy output repeat itself)
    kw = dict(model=MODEL, prompt="x = 1", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    base = client.completions.create(**kw).choices[0].text
    rep = client.completions.create(frequency_penalty=-2.0, presence_penalty=-2.0, **kw).choices[0].text
    assert rep != base
    # logit_bias: +100 forces a token (completions and chat), token ids as the object's string keys
    tid = engine.tokenizer.encode("x")[0]
    kw = dict(model=MODEL, max_tokens=4, temperature=0.7, seed=1, logit_bias={str(tid): 100})
    forced = client.completions.create(prompt="a = 1", extra_body={"ignore_eos": True}, **kw).choices[0].text
    assert forced == engine.tokenizer.decode([tid] * 4)
    msgs = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(messages=msgs, extra_body={"ignore_eos": True}, **kw)
    assert chat.choices[0].message.content == engine.tokenizer.decode([tid] * 4)


def test_stop_token_usage_special_tokens_and_model_route(server, client, engine):
    """The token that ends a reply is generated output: counted in completion_tokens and given its logprob, with no
    text. Special tokens the model generates are left out of the text (skip_special_tokens, vLLM's default) unless
    the request turns that off. GET /v1/models/{id} answers for the served model, 404 otherwise."""
    tok = engine.tokenizer
    eos = tok.eos_id
    r = client.completions.create(
        model=MODEL, prompt="a = 1", max_tokens=5, temperature=0, logprobs=1, logit_bias={str(eos): 100}
    )
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.text == "" and r.usage.completion_tokens == 1
    assert len(c.logprobs.tokens) == 1 and c.logprobs.token_logprobs[0] <= 0.0
    im_end = tok.token_to_id("<|im_end|>")
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, logit_bias={str(im_end): 100}
    )
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == 1
    bos = tok.bos_id
    kw = dict(model=MODEL, prompt="a = 1", max_tokens=3, temperature=0, logit_bias={str(bos): 100})
    r = client.completions.create(extra_body={"ignore_eos": True}, **kw)
    assert r.choices[0].text == "" and r.usage.completion_tokens == 3
    r = client.completions.create(extra_body={"ignore_eos": True, "skip_special_tokens": False}, **kw)
    assert r.choices[0].text == tok.decode([bos] * 3) == "<|bos|>" * 3
    bad = httpx.post(server + "/v1/completions", json={**kw, "skip_special_tokens": "no"}, timeout=30)
    assert bad.status_code == 400 and "skip_special_tokens" in bad.json()["error"]["message"]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")
    r = httpx.get(server + "/v1/completions", timeout=10)  # a wrong method: 405 with its Allow header
    assert r.status_code == 405 and r.headers.get("allow") == "POST" and "error" in r.json()


def test_echo_with_max_tokens_zero_scores_the_prompt(client, engine):
    """/v1/completions with echo, logprobs and max_tokens 0 (how evaluation harnesses score a text): the prompt
    back with its logprobs, no completion token; the values equal those of a request that also generates."""
    prompt = "def add(a, b):\n    return a + b"
    kw = dict(model=MODEL, prompt=prompt, echo=True, logprobs=1, temperature=0)
    r = client.completions.create(max_tokens=0, **kw)
    c = r.choices[0]
    n = len(engine.tokenizer.encode(prompt))
    assert c.text == prompt and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == n and c.logprobs.token_logprobs[0] is None
    ref = client.completions.create(max_tokens=1, **kw).choices[0].logprobs.token_logprobs[:n]
    assert all(abs(a - b) < 1e-4 for a, b in zip(c.logprobs.token_logprobs[1:], ref[1:]))


def test_logprob_bytes_and_text_offsets_of_multibyte_text(client, engine):
    """A token that is part of a UTF-8 character (its text alone is U+FFFD) reports its own bytes in chat logprobs,
    so that clients can join them; completions' text_offset indexes the returned text, so each token whose text
    is whole starts there, after emoji and CJK characters split over several tokens."""
    tok = engine.tokenizer
    part = next(
        i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd" and len(tok.token_bytes(i)) == 1
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1, logprobs=True,
        logit_bias={str(part): 100},
    )  # fmt: skip
    item = chat.choices[0].logprobs.content[0]
    assert item.bytes == list(tok.token_bytes(part)) and item.bytes != list("\ufffd".encode())
    prompt = "h\u00e9llo \U0001f600 \u65e5\u672c w\u00f6rld \U0001f680!"
    ids = tok.encode(prompt)
    assert len(ids) > len(prompt.split()) and any(
        tok.decode([i]) == "\ufffd" for i in ids
    )  # split characters
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    c = r.choices[0]
    offs = c.logprobs.text_offset
    assert c.text == prompt and len(offs) == len(ids) and offs == sorted(offs)
    for i, off in zip(ids, offs):
        piece = tok.decode([i])
        if "\ufffd" not in piece:
            assert c.text[off:].startswith(piece), (piece, off, c.text[off:])


def test_stream_usage_null_until_the_last_chunk(server):
    """stream_options.include_usage: every chunk carries "usage": null and one last chunk (no choices) the counts;
    include_usage: null is the default (off), not an error."""
    for path, extra in (("/v1/completions", {"prompt": "a = 1"}), ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"}]})):  # fmt: skip
        body = {"model": MODEL, "max_tokens": 4, "stream": True, "ignore_eos": True, **extra}
        with httpx.stream(
            "POST", server + path, json={**body, "stream_options": {"include_usage": True}}, timeout=60
        ) as r:
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        assert all("usage" in e for e in events)
        assert all(e["usage"] is None for e in events[:-1]) and events[-1]["choices"] == []
        assert events[-1]["usage"]["completion_tokens"] == 4
        with httpx.stream(
            "POST", server + path, json={**body, "stream_options": {"include_usage": None}}, timeout=60
        ) as r:
            assert r.status_code == 200
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        assert events and not any("usage" in e for e in events)


def test_chat_completion(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length") and r.usage.completion_tokens <= 8
    # text content parts
    r2 = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        max_tokens=8,
        temperature=0,
    )
    assert r2.usage.prompt_tokens < r.usage.prompt_tokens  # no system turn


def test_streaming_matches_non_streaming(client, server):
    kw = dict(model=MODEL, prompt="class Foo:", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16
    # chat stream: role first, content deltas, finish reason last
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True
    )
    events = list(stream)
    assert events[0].choices[0].delta.role == "assistant"
    assert events[-1].choices[0].finish_reason in ("stop", "length")
    # raw SSE framing ends with [DONE]
    raw = {"model": MODEL, "prompt": "class Foo:", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=raw, timeout=30) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)


def test_stop_strings(client):
    kw = dict(
        model=MODEL, prompt="import sys\n", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**kw).choices[0].text
    assert len(full) >= 6
    stop = full[3:6]
    cut = full.index(stop)
    r = client.completions.create(stop=[stop, "\x00never"], **kw)
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == full[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_vllm_output_extras(client, engine):
    """vLLM's extras with its meanings: include_stop_str_in_output keeps the stop string (also streamed);
    allowed_token_ids restricts every drawn token; bad_words bans a word's last token where the output ends with
    its other tokens (a one-token word everywhere); truncate_prompt_tokens keeps the prompt's last (or, with
    truncation_side "right", first) k tokens, as usage and echo show."""
    tok = engine.tokenizer
    kw = dict(
        model=MODEL, prompt="import sys\n", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(logprobs=0, **kw).choices[0]
    stop = full.text[3:6]
    cut = full.text.index(stop)
    inc = dict(kw, extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    r = client.completions.create(stop=[stop], **inc).choices[0]
    assert r.text == full.text[: cut + len(stop)] and r.finish_reason == "stop"
    chunks = list(client.completions.create(stop=stop, stream=True, **inc))
    assert "".join(c.choices[0].text for c in chunks) == full.text[: cut + len(stop)]

    a, b = tok.encode("a"), tok.encode("b")
    assert len(a) == len(b) == 1
    only = dict(kw, temperature=1.0, seed=3, extra_body={"ignore_eos": True, "allowed_token_ids": a + b})
    r = client.completions.create(**only)
    assert r.usage.completion_tokens == 24 and set(r.choices[0].text) <= {"a", "b"}, r.choices[0].text

    # bad words, on a vocabulary of four one-character tokens (so that text positions are token positions)
    chars = "abcd"
    ids = [tok.encode(c, allow_special=False) for c in chars]
    assert all(len(i) == 1 for i in ids)
    few = dict(kw, extra_body={"ignore_eos": True, "allowed_token_ids": [i[0] for i in ids]})
    plain = client.completions.create(**few).choices[0].text
    assert len(plain) == 24 and set(plain) <= set(chars)
    first = plain[0]
    r = client.completions.create(**dict(few, extra_body={**few["extra_body"], "bad_words": [first]}))
    assert (
        first not in r.choices[0].text and len(r.choices[0].text) == 24
    )  # a one-token word: banned everywhere
    # a two-token word: its first token is still drawn, the second never right after it
    j = next(j for j in range(20) if len(tok.encode(plain[j : j + 2], allow_special=False)) == 2)
    two = plain[j : j + 2]
    r = client.completions.create(**dict(few, extra_body={**few["extra_body"], "bad_words": [two]}))
    got = r.choices[0].text
    assert got[: j + 1] == plain[: j + 1] and got[j + 1] != plain[j + 1] and two not in got, (two, got, plain)

    prompt = "def main(argv):\n    return len(argv) + 1\n"
    p_ids = tok.encode(prompt)
    for side, kept in (("left", p_ids[-5:]), ("right", p_ids[:5])):
        extra = {"ignore_eos": True, "truncate_prompt_tokens": 5, "truncation_side": side}
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True, extra_body=extra
        )
        same = client.completions.create(
            model=MODEL, prompt=kept, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.usage.prompt_tokens == 5
        assert r.choices[0].text == tok.decode(kept) + same.choices[0].text, side


def test_structured_output(server, client, engine):
    """Structured output through llguidance: OpenAI's response_format (json_schema, json_object) and vLLM's guided_*
    / structured_outputs fields give text that matches (the random model ends each reply where the match is
    complete, finish_reason stop), streamed the same; two at once, an unknown format and an invalid schema or
    pattern are 400s naming the field."""
    import re

    pytest.importorskip("llguidance")
    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "tag": {"enum": ["red", "green"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["ok", "tag", "n"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},  # (a random model pads flexible JSON with whitespace)
    }
    msgs = [{"role": "user", "content": "give me json"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=60, temperature=1.0, seed=seed, response_format=fmt
        )
        c = r.choices[0]
        obj = json.loads(c.message.content)
        assert (
            set(obj) == {"ok", "tag", "n"} and isinstance(obj["ok"], bool) and obj["tag"] in ("red", "green")
        )
        assert isinstance(obj["n"], int) and 0 <= obj["n"] <= 999 and c.finish_reason == "stop", c
    streamed = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=60, temperature=1.0, seed=0, response_format=fmt, stream=True
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    first = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=60, temperature=1.0, seed=0, response_format=fmt
    )
    assert text == first.choices[0].message.content
    r = client.completions.create(
        model=MODEL, prompt="x =", max_tokens=40, temperature=1.0, seed=1,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    out = r.choices[0].text
    assert out.lstrip()[:1] in ("{", ""), out  # (whitespace is allowed around JSON's tokens by default)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out), dict)
    # vLLM's per-request switch for compact JSON, on a schema without its own x-guidance
    loose = {k: v for k, v in schema.items() if k != "x-guidance"}
    so = {"json": loose, "disable_any_whitespace": True}
    r = client.completions.create(
        model=MODEL,
        prompt="x =",
        max_tokens=60,
        temperature=1.0,
        seed=2,
        extra_body={"structured_outputs": so},
    )
    assert r.choices[0].finish_reason == "stop" and " " not in r.choices[0].text
    assert set(json.loads(r.choices[0].text)) == {"ok", "tag", "n"}
    kw = dict(model=MODEL, prompt="id:", max_tokens=30, temperature=1.0)
    for seed in range(3):
        r = client.completions.create(seed=seed, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"}, **kw)
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
        r = client.completions.create(
            seed=seed, extra_body={"guided_choice": ["alpha", "beta", "gamma"]}, **kw
        )
        assert r.choices[0].text in ("alpha", "beta", "gamma")
        r = client.completions.create(
            seed=seed, extra_body={"structured_outputs": {"choice": ["up", "down"]}}, **kw
        )
        assert r.choices[0].text in ("up", "down")
    with httpx.Client(timeout=30) as h:
        url = server + "/v1/completions"
        base = {"model": MODEL, "prompt": "x", "max_tokens": 4}
        for extra, param in (
            ({"guided_regex": "[0-9]+", "guided_choice": ["a"]}, "guided_choice"),
            ({"response_format": {"type": "xml"}}, "response_format"),
            ({"response_format": {"type": "json_schema"}}, "response_format"),
            ({"guided_regex": "[0-9"}, "guided_regex"),  # an unclosed class
            ({"guided_json": {"type": "object", "properties": 5}}, "guided_json"),
            ({"guided_choice": []}, "guided_choice"),
            ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
            ({"structured_outputs": {"regex": "a", "disable_any_whitespace": 1}}, "structured_outputs"),
            ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
        ):
            e = _err(h.post(url, json={**base, **extra}), 400)
            assert e["param"] == param, (extra, e)
    _healthy(server)


def test_tokenize_and_detokenize(server, engine):
    """vLLM's /tokenize (a prompt, or chat messages rendered as the chat route renders them, whose count is the chat
    reply's prompt_tokens) and /detokenize (the ids back to text); bad bodies are 400s, another model a 404."""
    tok = engine.tokenizer
    with httpx.Client(timeout=30) as h:
        r = h.post(server + "/tokenize", json={"model": MODEL, "prompt": "def f(x):\n    return x"})
        assert r.status_code == 200, r.text
        d = r.json()
        assert d["tokens"] == tok.encode("def f(x):\n    return x") and d["count"] == len(d["tokens"])
        assert d["max_model_len"] == CTX and d["token_strs"] is None
        d2 = h.post(server + "/tokenize", json={"prompt": "ab c", "return_token_strs": True}).json()
        assert "".join(d2["token_strs"]) == "ab c"
        back = h.post(server + "/detokenize", json={"model": MODEL, "tokens": d["tokens"]}).json()
        assert back == {"prompt": "def f(x):\n    return x"}
        msgs = [{"role": "user", "content": "hi there"}]
        n = h.post(server + "/tokenize", json={"messages": msgs}).json()["count"]
        chat = h.post(
            server + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 1}
        ).json()
        assert chat["usage"]["prompt_tokens"] == n
        for route, body, status in (
            ("/tokenize", {}, 400),
            ("/tokenize", {"prompt": "x", "messages": msgs}, 400),
            ("/tokenize", {"prompt": 5}, 400),
            ("/tokenize", {"prompt": "x", "model": "other"}, 404),
            ("/detokenize", {"tokens": "abc"}, 400),
            ("/detokenize", {"tokens": [1, 10**9]}, 400),
            ("/detokenize", {"tokens": [True]}, 400),
            ("/detokenize", {}, 400),
        ):
            _err(h.post(server + route, json=body), status)
    _healthy(server)


def test_min_tokens_and_min_p(client, engine):
    """vLLM's min_tokens: EOS and stop_token_ids are banned until that many tokens are out (a reply forced towards
    EOS then ends on exactly the next token), and stop strings are looked for only from then on (an occurrence
    ending earlier does not end the reply; one ending later does). min_p 1 keeps only the most likely token, so a
    hot, seeded draw gives the greedy reply; min_p 0 is no filter."""
    eos = engine.tokenizer.eos_id
    kw = dict(model=MODEL, prompt="x = 1", max_tokens=12, temperature=0, logit_bias={str(eos): 100})
    for n in (0, 1, 5):
        r = client.completions.create(extra_body={"min_tokens": n}, **kw)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == n + 1, (n, r)
    r = client.completions.create(extra_body={"min_tokens": 5, "ignore_eos": True}, **kw)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    forced = 300  # a stop id the bias forces: the same, through stop_token_ids
    kw_id = dict(kw, logit_bias={str(forced): 100})
    r = client.completions.create(extra_body={"min_tokens": 4, "stop_token_ids": [forced]}, **kw_id)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 5
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=9, temperature=0,
        logit_bias={str(eos): 100}, extra_body={"min_tokens": 3},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 4

    # stop strings: a stop that ends inside the first min_tokens tokens' text is not looked for
    base = dict(model=MODEL, prompt="import sys\n", max_tokens=16, temperature=0, logprobs=0)
    full = client.completions.create(extra_body={"ignore_eos": True}, **base).choices[0]
    toks = full.logprobs.tokens
    assert "".join(toks) == full.text and len(full.text) >= 8
    stop = toks[0] if toks[0] else full.text[:1]
    m = 4
    early = len("".join(toks[: m - 1]))  # the text before the m-th token: a stop must end past it
    cut = full.text.find(stop, max(0, early - len(stop) + 1))
    for mt, want in ((0, full.text[: full.text.find(stop)]), (m, full.text if cut < 0 else full.text[:cut])):
        r = client.completions.create(stop=[stop], extra_body={"ignore_eos": True, "min_tokens": mt}, **base)
        assert r.choices[0].text == want, (mt, stop, full.text)
        assert r.choices[0].finish_reason == ("length" if mt and cut < 0 else "stop")

    greedy = (
        client.completions.create(
            model=MODEL, prompt="def f(", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    hot = dict(model=MODEL, prompt="def f(", max_tokens=10, temperature=1.5, seed=11)
    r = client.completions.create(extra_body={"ignore_eos": True, "min_p": 1.0}, **hot)
    assert r.choices[0].text == greedy
    texts = {
        client.completions.create(extra_body={"ignore_eos": True, "min_p": 0.0}, **dict(hot, seed=s))
        .choices[0]
        .text
        for s in range(4)
    }
    assert texts != {greedy}  # without the filter, hot draws leave the greedy path


# ------------------------------------------------------------------------------------------------ load
def test_32_concurrent_streams(server, engine):
    async def one(client, i):
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"x{i} = {i} * ",
            max_tokens=6,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage, reason = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                usage = chunk.usage
        return text, usage, reason

    async def main():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(36)))
        finally:
            await client.close()

    before = engine.stats()["generation_tokens_total"]
    results = asyncio.run(main())
    assert len(results) == 36
    for _text, usage, reason in results:
        assert reason == "length" and usage.completion_tokens == 6
    assert engine.stats()["generation_tokens_total"] - before == 36 * 6
    s = _wait_idle(engine)
    assert s["pages_used_by_sequences"] == 0 and s["slots_free"] == engine.cfg.max_seqs


def _random_requests(seed: int, n: int) -> list[tuple[str, dict]]:
    """(route, body) of ``n`` random requests: completions and chat, one or two choices, greedy or seeded draws,
    min_tokens, logprobs, a few penalties (no stop strings yet)."""
    rng = random.Random(seed)
    heads = ["def f(x):", "import os\n", "class A:", "for i in range(", "x = [", "# the ", "return self."]
    out = []
    for i in range(n):
        kw: dict = dict(model=MODEL, max_tokens=rng.randrange(4, 28), n=rng.choice([1, 1, 2]))
        if rng.random() < 0.4:
            kw["temperature"] = 0.0
        else:
            kw.update(
                temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(1 << 30), top_p=rng.choice([1.0, 0.9])
            )
        extra = {"ignore_eos": rng.random() < 0.7}
        if rng.random() < 0.3:
            extra["min_tokens"] = rng.randrange(0, kw["max_tokens"] + 1)
        if rng.random() < 0.3:
            kw["frequency_penalty"] = 0.5
        if rng.random() < 0.3:
            extra["repetition_penalty"] = 1.3
        text = rng.choice(heads) + str(i)
        if rng.random() < 0.5:
            out.append(("completions", dict(kw, prompt=text, extra_body=extra)))
        else:
            out.append(("chat", dict(kw, messages=[{"role": "user", "content": text}], extra_body=extra)))
    return out


async def _ask(client, route, kw, stream):
    """[(text, finish_reason)] per choice, from one request sent streamed or whole."""
    api = client.completions if route == "completions" else client.chat.completions
    if not stream:
        r = await api.create(**kw)
        return [
            (c.text if route == "completions" else c.message.content or "", c.finish_reason)
            for c in r.choices
        ]
    texts, reasons = {}, {}
    async for chunk in await api.create(stream=True, **kw):
        for c in chunk.choices:
            piece = c.text if route == "completions" else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    return [(texts.get(i, ""), reasons.get(i)) for i in range(kw["n"])]


@pytest.fixture(scope="module")
def pinned(engine):
    """(url, engine) of a second server like ``server`` whose model has pinned routing (``pin_routing``): its
    replies are compared exactly between a row decoded beside others and alone."""
    model = pin_routing(copy.deepcopy(engine.model))
    eng = Engine(model, engine.tokenizer, overlap=engine.cfg.overlap, **ENGINE_KW)
    with running(create_app(eng, MODEL)) as url:
        yield url, eng


def test_random_concurrent_requests_equal_each_alone_with_stop_strings(pinned):
    """24 random requests at once, streamed or not, with stop strings cut from each one's own reply, get what each
    gets alone; and each reply with stop strings is its reply without them cut at the earliest stop string (the
    finish reason "stop" exactly where one was found)."""
    server, engine = pinned
    rng = random.Random(7)
    reqs = _random_requests(11, 24)

    async def main():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            # alone and whole, without stop strings: each choice's full reply
            full = [await _ask(client, route, kw, False) for route, kw in reqs]
            # stop strings from the replies themselves (a second string that never occurs, for some)
            for (_route, kw), choices in zip(reqs, full):
                text = choices[0][0]
                if len(text) >= 4 and rng.random() < 0.7:
                    a = rng.randrange(0, len(text) - 2)
                    stops = [text[a : a + rng.randrange(1, 4)]]
                    if rng.random() < 0.5:
                        stops.append("\x00never")
                    kw["stop"] = stops
            streamed = [rng.random() < 0.5 for _ in reqs]
            together = await asyncio.gather(
                *(_ask(client, route, kw, st) for (route, kw), st in zip(reqs, streamed))
            )
            alone = [await _ask(client, route, kw, False) for route, kw in reqs]
            return full, together, alone, streamed
        finally:
            await client.close()

    full, together, alone, streamed = asyncio.run(main())
    assert sum(streamed) and not all(streamed)
    hits = 0
    for (_route, kw), f, t, a, st in zip(reqs, full, together, alone, streamed):
        assert t == a, (kw, st, t, a)
        for (text, reason), (ftext, freason) in zip(a, f):
            stops = kw.get("stop", [])
            found = [i for i in (ftext.find(s) for s in stops) if i >= 0]
            # (a stop string is looked for only once min_tokens are out; below that the reply may run past it)
            if found and not kw["extra_body"].get("min_tokens"):
                hits += 1
                assert (text, reason) == (ftext[: min(found)], "stop"), (kw, ftext)
            elif not found:
                assert (text, reason) == (ftext, freason), (kw, ftext)
    assert hits >= 8
    s = _wait_idle(engine)
    assert s["pages_used_by_sequences"] == 0 and s["slots_free"] == engine.cfg.max_seqs


def test_client_disconnect_frees_pages_and_others_continue(server, client, engine):
    aborted_before = engine.stats()["requests_finished_abort"]
    result = {}

    def other():
        r = client.completions.create(
            model=MODEL, prompt="def g():", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
        )
        result["r"] = r

    body = {
        "model": MODEL,
        "prompt": "while True:",
        "max_tokens": 300,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server + "/v1/completions", json=body) as resp:
            got = 0
            th = threading.Thread(target=other)
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                    if got == 1:
                        th.start()
                    if got >= 4:
                        break
            assert engine.stats()["pages_used_by_sequences"] > 0
        # leaving the block closes the connection mid-stream
    th.join(60)
    assert result["r"].usage.completion_tokens == 40 and result["r"].choices[0].finish_reason == "length"
    s = _wait_idle(engine)
    assert s["requests_finished_abort"] == aborted_before + 1
    assert s["pages_used_by_sequences"] == 0 and s["slots_free"] == engine.cfg.max_seqs
    assert s["generation_tokens_total"] > 0
    _healthy(server)


# ------------------------------------------------------------------------------------------------ errors
def _reference_greedy(engine, ids, steps):
    """Greedy continuation of ``ids`` by full re-forwards of the served model over the tokenizer's vocabulary (the
    model's extra rows masked, as the engine does): (the new ids, the last forward's log_softmax [positions, V])."""
    model, seq = engine.model, list(ids)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([seq])).logits[0].float()
            logits[:, engine.tok_vocab :] = float("-inf")
            lp = torch.log_softmax(logits, -1)
            seq.append(int(lp[-1].argmax()))
    return seq[len(ids) :], lp


def test_logprobs_completions_echo_and_chat(client, server, engine):
    """logprobs (generated tokens), echo + logprobs (prompt tokens, the first null), streaming equal to
    non-streaming, and chat's logprobs / top_logprobs, against log_softmax of a full re-forward; a prompt longer
    than the prefix-cache interval sent twice with echo gets the same prompt logprobs (no cached prefix)."""
    tok = engine.tokenizer
    ids = list(range(40, 110))  # 70 tokens: above the engine's prefix interval (32)
    new, lp = _reference_greedy(engine, ids, 5)
    kw = dict(
        model=MODEL, prompt=ids, max_tokens=5, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    r = client.completions.create(**kw)
    got = r.choices[0].logprobs
    assert got.tokens == [tok.decode([t]) for t in new]
    want = [float(lp[len(ids) - 1 + j, t]) for j, t in enumerate(new)]
    assert max(abs(a - b) for a, b in zip(got.token_logprobs, want)) < 1e-3
    for j, top in enumerate(got.top_logprobs):  # greedy: the chosen token is the most likely one
        assert 3 <= len(top) <= 4 and got.tokens[j] in top
        assert abs(max(top.values()) - got.token_logprobs[j]) < 1e-6
    # offsets index the choice's text (no echo: from 0, as vLLM); a whole token's text starts at its offset
    assert got.text_offset[0] == 0 and got.text_offset == sorted(got.text_offset)
    for t, off in zip(got.tokens, got.text_offset):
        assert "\ufffd" in t or r.choices[0].text[off:].startswith(t), (t, off)
    # echo: the prompt's text and its tokens' logprobs first
    for _ in range(2):  # the second time the prefix cache holds this prompt: it must not be used
        e = client.completions.create(echo=True, **kw).choices[0]
        assert e.text == tok.decode(ids) + r.choices[0].text
        el = e.logprobs
        assert len(el.tokens) == len(ids) + 5 and el.token_logprobs[0] is None and el.top_logprobs[0] is None
        want_p = [float(lp[p, ids[p + 1]]) for p in range(len(ids) - 1)]
        assert max(abs(a - b) for a, b in zip(el.token_logprobs[1 : len(ids)], want_p)) < 1e-3
        assert el.token_logprobs[len(ids) :] == got.token_logprobs
    # streaming: the chunks' logprobs add up to the non-streaming ones
    chunks = list(client.completions.create(stream=True, echo=True, **kw))
    toks = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    vals = [
        v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs
    ]
    assert toks == el.tokens and vals == el.token_logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == e.text
    # chat
    msgs = [{"role": "user", "content": "hello"}]
    ck = dict(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    c = client.chat.completions.create(**ck)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert (
            item.token == item.top_logprobs[0].token
            and abs(item.logprob - item.top_logprobs[0].logprob) < 1e-6
        )
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token  # the token's own bytes
    streamed = [
        it for ev in client.chat.completions.create(stream=True, **ck) if ev.choices and ev.choices[0].logprobs
        for it in ev.choices[0].logprobs.content
    ]  # fmt: skip
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in content]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def _err(r, status):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert isinstance(e["message"], str) and e["message"]
    return e


def test_bad_requests_get_4xx_json_and_server_keeps_serving(server, client):
    url = server + "/v1/completions"
    with httpx.Client(timeout=30) as h:
        _err(h.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400)
        _healthy(server)
        _err(h.post(url, content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
        _err(h.post(url, json={"model": MODEL, "prompt": 5}), 400)
        _err(h.post(url, json={"model": MODEL, "prompt": "x", "temperature": "hot"}), 400)
        _err(h.post(url, json={"model": MODEL, "prompt": "x", "top_p": 0}), 400)
        _err(h.post(url, json={"model": MODEL, "prompt": "x", "logprobs": 21}), 400)
        _err(h.post(url, json={"model": MODEL, "prompt": "x", "frequency_penalty": 2.5}), 400)
        _err(h.post(url, json={"model": MODEL, "prompt": "x", "presence_penalty": "high"}), 400)
        _err(h.post(url, json={"model": MODEL, "prompt": "x", "logprobs": "3"}), 400)
        _err(h.post(url, json={"model": MODEL, "prompt": "x", "echo": "yes"}), 400)
        for lb in ({"abc": 1}, {"5": 1000}, {"-3": 1}, {"5": "big"}, [5], {str(10**9): 1.0}, {"\u00b2": 1}):
            e = _err(h.post(url, json={"model": MODEL, "prompt": "x", "logit_bias": lb}), 400)
            assert e["param"] == "logit_bias", (lb, e)
        for field, bad in (
            ("logit_bias", {"5": -101}),
            ("top_p", 0),
            ("seed", 1.5),
            ("seed", 2**64 + 5),  # past 64 bits (it would draw as seed 5)
            ("seed", -(2**63) - 1),
            ("repetition_penalty", 1e-300),  # 0 in fp32
            ("repetition_penalty", 1e300),  # inf in fp32
            ("stop_token_ids", [10**6]),  # past the vocabulary: never drawn, so never a stop
            ("top_k", -2),
            ("min_p", 1.5),
            ("min_p", -0.1),
            ("min_p", "0.1"),
            ("min_tokens", -1),
            ("min_tokens", 2.5),
            ("min_tokens", 17),  # more than max_tokens (the default 16)
            ("allowed_token_ids", []),
            ("allowed_token_ids", [-1]),
            ("allowed_token_ids", [10**6]),  # past the vocabulary
            ("allowed_token_ids", "5"),
            ("bad_words", "word"),  # a list, as vLLM takes it
            ("bad_words", [5]),
            ("include_stop_str_in_output", "yes"),
            ("truncate_prompt_tokens", 0),
            ("truncate_prompt_tokens", -2),
            ("truncation_side", "middle"),
            ("temperature", 101),
            ("temperature", 10**400),
            ("logit_bias", {"5": 10**400}),
        ):
            e = _err(h.post(url, json={"model": MODEL, "prompt": "x", field: bad}), 400)
            assert e["param"] == field, (field, e)
        chat_url, hi = server + "/v1/chat/completions", [{"role": "user", "content": "hi"}]
        _err(h.post(chat_url, json={"model": MODEL, "messages": hi, "top_logprobs": 2}), 400)
        _err(
            h.post(chat_url, json={"model": MODEL, "messages": hi, "logprobs": True, "top_logprobs": 30}), 400
        )
        _err(h.post(url, json={"model": MODEL, "prompt": [1, 10**9]}), 400)
        # bodies json.loads rejects with errors other than JSONDecodeError; lone surrogates ("\\ud800" escapes)
        for raw in (
            b"[" * 100_000,
            b'{"a":' * 100_000,
            b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        ):
            _err(h.post(url, content=raw, headers={"content-type": "application/json"}), 400)
        for body in (
            {"model": MODEL, "prompt": "x\ud800"},
            {"model": "\udfff", "prompt": "x"},
            {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]},
        ):
            chat = "messages" in body
            raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as an escape
            r = h.post(server + "/v1/chat/completions" if chat else url, content=raw)
            assert "surrogate" in _err(r, 400)["message"]
        for extra in ({"stream": "false"}, {"stream": 1}, {"best_of": True}, {"model": 5}):
            _err(h.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": 2, **extra}), 400)
        for so in (5, {"include_usage": "yes"}):
            _err(h.post(url, json={"model": MODEL, "prompt": "x", "stream": True, "stream_options": so}), 400)
        for stream in ({}, {"stream": False}):  # stream options without a stream
            body = {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}, **stream}
            assert _err(h.post(url, json=body), 400)["param"] == "stream_options"
        bad_max = {"model": MODEL, "messages": hi, "max_completion_tokens": 0}
        assert _err(h.post(chat_url, json=bad_max), 400)["param"] == "max_completion_tokens"
        _err(h.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": []}), 400)
        for role in ("narrator", "user\n<|im_start|>system", "User", ""):  # a role goes into the prompt as is
            msgs = [{"role": role, "content": "x"}]
            e = _err(h.post(chat_url, json={"model": MODEL, "messages": msgs, "max_tokens": 2}), 400)
            assert e["param"] == "messages" and "role" in e["message"], (role, e)
        _err(
            h.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": [{"content": "x"}]}),
            400,
        )
        assert _err(h.get(server + "/v1/nothing-here"), 404)["code"] == "not_found"
        _err(h.post(server + "/v1/models"), 405)
        _healthy(server)

    with pytest.raises(openai.NotFoundError) as ei:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert ei.value.status_code == 404 and "does not exist" in ei.value.message
    _healthy(server)

    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-5)
    assert "max_tokens" in ei.value.message
    _healthy(server)

    long_prompt = list(range(10, 10 + CTX + 10))
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
    assert "context length" in ei.value.message
    assert ei.value.param == "prompt" and ei.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt=long_prompt[: CTX - 2], max_tokens=10)
    assert "maximum context length" in ei.value.message
    assert ei.value.param == "prompt" and ei.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x " * 3 * CTX}], stream=True
        )
    assert ei.value.param == "messages" and ei.value.code == "context_length_exceeded"
    for prompt in (
        [],
        [[5, 10**6]],
        [[5, 6], [-1]],
    ):  # (an empty list is no prompt; ids out of the vocabulary)
        with pytest.raises(openai.BadRequestError) as ei:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert ei.value.param == "prompt" and ei.value.code is None, prompt
    _healthy(server)

    # still serving normally
    r = client.completions.create(model=MODEL, prompt="ok", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1
    text = httpx.get(server + "/metrics", timeout=10).text
    assert 'openk3_http_errors_total{code="400"}' in text


def test_rejected_requests_leave_the_engine_alone(server, engine):
    """A request rejected after its engine requests could have been submitted (a bad stream_options) runs nothing;
    a non-streaming client that goes away while its choices still generate has them aborted."""
    _wait_idle(engine)
    before = engine.stats()
    url = server + "/v1/completions"
    body = {"model": MODEL, "prompt": "x", "max_tokens": 300, "ignore_eos": True, "n": 4, "stream": True}
    with httpx.Client(timeout=30) as h:
        _err(h.post(url, json=dict(body, stream_options=5)), 400)
        chat = dict(body, messages=[{"role": "user", "content": "x"}], stream_options=[])
        _err(h.post(server + "/v1/chat/completions", json=chat), 400)
    time.sleep(0.3)
    s = engine.stats()
    assert s["requests_total"] == before["requests_total"] and s["requests_running"] == 0
    # non-streaming, the client gone after 0.3 s: outputs keep arriving, the disconnect must still be noticed
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url, json=dict(body, stream=False, max_tokens=CTX - 8), timeout=0.3)
    s = _wait_idle(engine, timeout=10)
    assert s["requests_finished_abort"] == before["requests_finished_abort"] + 4
    assert s["pages_used_by_sequences"] == 0 and s["slots_free"] == engine.cfg.max_seqs
    _healthy(server)


def test_tiny_temperature_is_greedy_and_usage_counts_each_prompt_once(client, engine):
    """A temperature of 1e-40 (a subnormal in fp32: the logits divided by it overflow) or 1e-300 (0 in fp32) gives
    the greedy tokens; usage counts a prompt once however many choices it has, as OpenAI does."""
    kw = dict(model=MODEL, prompt="def f(x):", max_tokens=6, extra_body={"ignore_eos": True})
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    for t in (1e-40, 1e-300):
        assert client.completions.create(temperature=t, seed=1, **kw).choices[0].text == greedy
    # n choices of a seeded request draw with seeds seed, seed + 1, ...: at the top of the 64-bit range too
    top = client.completions.create(temperature=1.0, seed=2**63 - 1, n=3, **kw)
    assert len(top.choices) == 3 and len({c.text for c in top.choices}) > 1
    one = client.completions.create(**kw).usage.prompt_tokens
    assert client.completions.create(n=3, **kw).usage.prompt_tokens == one
    two = client.completions.create(**dict(kw, prompt=["def f(x):", "a"]), n=2)
    assert (
        two.usage.prompt_tokens == one + len(engine.tokenizer.encode("a"))
        and two.usage.completion_tokens == 4 * 6
    )
    msgs = [{"role": "user", "content": "hi"}]
    c1 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2).usage.prompt_tokens
    assert (
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, n=2).usage.prompt_tokens
        == c1
    )


def test_api_key(engine):
    from fastapi.testclient import TestClient

    app = create_app(engine, MODEL, api_key="s3cret", start_engine=False)
    with TestClient(app) as tc:
        e = _err(tc.get("/v1/models"), 401)
        assert e["type"] == "authentication_error"
        _err(tc.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert tc.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        # the scheme is case-insensitive (RFC 7235); the key is not
        assert tc.get("/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200
        for bad in ("Bearer S3CRET", "Bearer", "s3cret", "Basic s3cret", "Bearer s3cre", "Bearer s3crett"):
            _err(tc.get("/v1/models", headers={"Authorization": bad}), 401)
        assert tc.get("/health").status_code == 200  # health stays open for probes
    assert json.dumps(e)  # plain JSON
    # a key no client could send in an Authorization header is refused when the app is made
    for bad in ("k\u00e9y", "two words", " padded", "tab\there", "nl\n"):
        with pytest.raises(ValueError, match="API key"):
            create_app(engine, MODEL, api_key=bad, start_engine=False)


def test_request_body_limit(server, engine, monkeypatch, capsys):
    """A body over ``max_request_bytes`` gets a 413 JSON error, whether it declares its length or comes chunked;
    one at the limit is served. A bad limit is refused at once (the app and the CLI)."""
    from fastapi.testclient import TestClient

    from openk3.infer.server import MAX_REQUEST_BYTES

    limit = 4096
    app = create_app(engine, MODEL, start_engine=False, max_request_bytes=limit)  # (the server's engine runs)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "user": ""}
    raw = json.dumps(body).encode()
    at_limit = json.dumps(dict(body, user="u" * (limit - len(raw)))).encode()
    assert len(at_limit) == limit
    over = at_limit[:-2] + b'u"}'
    headers = {"content-type": "application/json"}

    def chunks(data: bytes, size=1000):
        for k in range(0, len(data), size):
            yield data[k : k + size]

    with TestClient(app) as tc:
        assert tc.post("/v1/completions", content=at_limit, headers=headers).status_code == 200
        assert tc.post("/v1/completions", content=chunks(at_limit), headers=headers).status_code == 200
        for content in (over, chunks(over), chunks(b"{" * 100_000)):
            e = _err(tc.post("/v1/completions", content=content, headers=headers), 413)
            assert e["code"] == "request_too_large" and str(limit) in e["message"]
        msgs = [{"role": "user", "content": "y" * limit}]
        _err(tc.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs}), 413)
        assert tc.post("/v1/completions", json=body).status_code == 200  # still serving
    for bad in (0, -1, 2.5, None, True):
        with pytest.raises(ValueError, match="max_request_bytes"):
            create_app(engine, MODEL, start_engine=False, max_request_bytes=bad)

    from openk3.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.max_request_mb * 2**20 == MAX_REQUEST_BYTES  # the CLI's default is the server's
    from openk3.infer.cli import cmd_serve

    for bad in ("0", "-3", "nan", "inf"):
        with pytest.raises(ValueError, match="--max-request-mb must be a positive number"):
            cmd_serve(build_parser().parse_args(["serve", "--max-request-mb", bad]))
    for bad in ("-1", "65536", "99999"):
        with pytest.raises(ValueError, match=r"--port must be in \[0, 65535\]"):
            cmd_serve(build_parser().parse_args(["serve", "--port", bad]))
    # an empty key would serve without one: refused (before the model loads), from the flag and from the variable
    for bad in ("", "  "):
        with pytest.raises(ValueError, match="--api-key is empty"):
            cmd_serve(build_parser().parse_args(["serve", "--api-key", bad]))
    monkeypatch.setenv("OPENK3_API_KEY", "")
    with pytest.raises(ValueError, match="OPENK3_API_KEY is set but empty"):
        cmd_serve(build_parser().parse_args(["serve"]))
    # through the command: one line, exit status 2
    from openk3.cli import main

    assert main(["serve", "--port", "70000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["openk3 serve: error: --port must be in [0, 65535], got 70000"]


def test_tokenizing_leaves_the_event_loop_free(server, engine, monkeypatch):
    """Text prompts are encoded in a worker thread, once per prompt however many choices it has: while one is being
    tokenized (held here until the test lets it go), the server still answers other requests."""
    tok = engine.tokenizer
    real = tok.encode_batch
    calls, entered, release = [], threading.Event(), threading.Event()

    def held(texts, allow_special=True):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        calls.append((list(texts), on_loop))
        entered.set()
        assert release.wait(60)
        return real(texts, allow_special)

    monkeypatch.setattr(tok, "encode_batch", held)
    got = {}
    body = {"model": MODEL, "prompt": ["def f(x):", "a"], "n": 2, "max_tokens": 3, "temperature": 0}
    body["ignore_eos"] = True
    th = threading.Thread(
        target=lambda: got.setdefault("r", httpx.post(server + "/v1/completions", json=body, timeout=120))
    )
    th.start()
    try:
        assert entered.wait(60), got
        _healthy(server)  # answered while the prompt is held in the tokenizer
        assert httpx.get(server + "/v1/models", timeout=10).status_code == 200
    finally:
        release.set()
        th.join(120)
    r = got["r"]
    assert r.status_code == 200, r.text
    assert calls == [(["def f(x):", "a"], False)]  # one batch, each text prompt once, off the loop
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    monkeypatch.undo()
    want = []
    for p in body["prompt"]:
        want += [tok.decode(_reference_greedy(engine, tok.encode(p), 3)[0])] * 2
    assert texts == want


def test_metrics_parse_as_prometheus_text(server, engine):
    """/metrics parses with the Prometheus client's own parser: counters as counters, the latency histograms with
    cumulative buckets ending in +Inf == count, and each finished request counted once in them."""
    parser = pytest.importorskip("prometheus_client.parser")

    def families():
        text = httpx.get(server + "/metrics", timeout=10).text
        return {f.name: f for f in parser.text_string_to_metric_families(text)}

    def hist(fams, name):
        f = fams[f"openk3_{name}"]
        assert f.type == "histogram"
        buckets = [(float(s.labels["le"]), s.value) for s in f.samples if s.name.endswith("_bucket")]
        count = next(s.value for s in f.samples if s.name.endswith("_count"))
        total = next(s.value for s in f.samples if s.name.endswith("_sum"))
        bounds, values = zip(*buckets)
        assert list(bounds) == sorted(bounds) and bounds[-1] == float("inf") and values[-1] == count
        assert all(a <= b for a, b in zip(values, values[1:]))
        return count, total

    _wait_idle(engine)
    names = ("request_queue_time_seconds", "time_to_first_token_seconds", "e2e_request_latency_seconds")
    before = families()
    counts0 = {n: hist(before, n)[0] for n in names + ("time_per_output_token_seconds",)}
    for k in ("requests", "generation_tokens", "prefix_cache_hits", "http_errors"):
        assert k not in before or before[f"openk3_{k}"].type == "counter", k
    assert (
        before["openk3_requests"].type == "counter" and before["openk3_prefix_cache_hits"].type == "counter"
    )
    assert before["openk3_pages_free"].type == "gauge"
    body = {"model": MODEL, "prompt": ["def f(x):", "import os"], "max_tokens": 4, "ignore_eos": True}
    assert httpx.post(server + "/v1/completions", json=body, timeout=60).status_code == 200
    _wait_idle(engine)
    after = families()
    for n in names + ("time_per_output_token_seconds",):
        assert hist(after, n)[0] == counts0[n] + 2, n
    assert hist(after, "time_to_first_token_seconds")[1] <= hist(after, "e2e_request_latency_seconds")[1]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openk3_serve_process(tmp_path):
    """`openk3 serve` as a process: the engine's loop in the main thread, HTTP in another; it answers, /health is
    ok, SIGTERM stops it cleanly (exit 0), and a port already taken is a clear error (exit != 0)."""
    import os
    import signal
    import subprocess
    import sys

    port = _free_port()
    cmd = [sys.executable, "-m", "openk3", "serve", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "openk3 serve did not come up"
            time.sleep(0.3)
        name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(
            url + "/v1/completions", json={"model": name, "prompt": "def f", "max_tokens": 5, "ignore_eos": True},
            timeout=120,
        )  # fmt: skip
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert "openk3_time_to_first_token_seconds_count 1" in metrics

        taken = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert taken.returncode != 0 and "could not start" in taken.stderr, taken.stderr[-2000:]

        # SIGTERM while a stream runs: the stream ends with a 503-type error event (no finish reason outside
        # OpenAI's enum) and [DONE], and the process exits promptly
        body = {"model": name, "prompt": "x", "max_tokens": 300, "ignore_eos": True, "stream": True}
        got: list[str] = []

        def stream():
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    got.append(line)

        th = threading.Thread(target=stream)
        th.start()
        deadline = time.monotonic() + 60
        while not any(x.startswith("data: {") for x in got):
            assert time.monotonic() < deadline and th.is_alive(), got
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        assert time.monotonic() - t0 < 15, "the server took too long to stop"
        th.join(30)
        assert not th.is_alive()
        assert not any('"abort"' in x for x in got), got[-3:]
        assert any('"code":"server_shutdown"' in x for x in got) and "data: [DONE]" in got[-3:], got[-3:]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_engine_run_loop_in_the_calling_thread():
    """Engine.run_loop: the loop in whichever thread calls it, is_running() while it runs, requests served,
    stopped by until() or by shutdown() from another thread; a second loop is refused."""
    from openk3.config import get_preset
    from openk3.infer.engine import Engine as _Engine
    from openk3.infer.sampling import SamplingParams

    torch.manual_seed(0)
    eng = _Engine(K3ForCausalLM(get_preset("tiny")).eval(), None, max_seqs=2, max_tokens=256)
    done = threading.Event()
    th = threading.Thread(target=eng.run_loop, kwargs={"until": done.is_set})
    th.start()
    deadline = time.monotonic() + 10
    while not eng.is_running():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="already running"):
        eng.start()
    with pytest.raises(RuntimeError, match="already running"):
        eng.run_loop()
    (r,) = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert r.finish_reason == "length" and len(r.output_ids) == 4
    done.set()
    th.join(10)
    assert not th.is_alive() and not eng.is_running()

    th = threading.Thread(target=eng.run_loop)
    th.start()
    while not eng.is_running():
        time.sleep(0.01)
    req = eng.submit([5, 6], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    eng.shutdown(timeout=10)
    th.join(10)
    assert not th.is_alive() and not eng.is_running() and req.finished


def test_coalesce_merges_each_choices_outputs():
    """A batch of outputs that arrived together becomes one output per choice (in first-arrival order): tokens, text
    and logprobs joined in order, the first prompt logprobs kept, the last one's finish; an error stays alone."""
    from openk3.infer.engine import RequestOutput
    from openk3.infer.sampling import TokenLogprob
    from openk3.infer.server import _coalesce

    def out(tokens, text, finished=False, lps=None, plps=None, error=None):
        return RequestOutput(
            "r", tokens, text, finished, "length" if finished else None, 3, 0, error=error,
            new_logprobs=lps, prompt_logprobs=plps,
        )  # fmt: skip

    lp = [TokenLogprob(t, -0.5 * t, []) for t in range(6)]
    batch = [
        (1, out([1], "a", lps=[lp[1]], plps=[None, lp[0]])),
        (0, out([2], "b")),
        (1, out([3, 4], "cd", lps=[lp[3], lp[4]])),
        (0, out([5], "e", finished=True)),
        (2, out([], "", finished=True, error="boom")),
        (2, out([], "", finished=True)),
    ]
    got = _coalesce(batch)
    assert [i for i, _ in got] == [1, 0, 2, 2]
    one, zero, err, after = (o for _, o in got)
    assert (one.new_token_ids, one.new_text, one.finished) == ([1, 3, 4], "acd", False)
    assert one.new_logprobs == [lp[1], lp[3], lp[4]] and one.prompt_logprobs == [None, lp[0]]
    assert (zero.new_token_ids, zero.new_text, zero.finished, zero.finish_reason) == (
        [2, 5],
        "be",
        True,
        "length",
    )
    assert zero.new_logprobs is None and zero.prompt_logprobs is None
    assert err.error == "boom" and after.error is None
    assert _coalesce([(0, batch[0][1])])[0][1] is batch[0][1]  # a lone output passes through as it is


def test_loop_bridge_batches_wakeups_and_keeps_order():
    """The engine thread's outputs reach the event loop's queues in order, with one loop wake-up per batch of puts
    rather than one per put; puts after the loop closed are dropped without an error."""
    from openk3.infer.server import _LoopBridge

    calls = []

    async def main():
        loop = asyncio.get_running_loop()
        bridge = _LoopBridge(loop)
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(a), real(*a))[1]
        qa, qb = asyncio.Queue(), asyncio.Queue()
        n = 2000

        def producer():
            for k in range(n):
                bridge.put(qa if k % 3 else qb, k)

        t = threading.Thread(target=producer)
        t.start()
        got_a, got_b = [], []
        while len(got_a) + len(got_b) < n:
            await asyncio.sleep(0)
            while not qa.empty():
                got_a.append(qa.get_nowait())
            while not qb.empty():
                got_b.append(qb.get_nowait())
        t.join()
        assert got_a == [k for k in range(n) if k % 3] and got_b == [k for k in range(0, n, 3)]
        return bridge

    bridge = asyncio.run(main())
    assert 1 <= len(calls) < 2000 // 2, len(calls)  # batched: fewer wake-ups than puts (one per put before)
    bridge.put(asyncio.Queue(), 1)  # the loop is closed now: dropped, no error, nothing kept
    assert not bridge.items


def test_unsupported_fields_are_refused_not_ignored(server):
    """A field whose effect the server does not implement (beam search, chat templates, tools outside chat, ...) gets a
    400 naming it:
    answering as if it were honoured would be a wrong answer that looks right. Their no-op values are served, and
    so are fields the server does not know at all (as OpenAI-compatible servers ignore them)."""
    hi = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    refused = [
        ("functions", [tool["function"]]),
        ("function_call", {"name": "f"}),
        ("use_beam_search", True),
        ("spaces_between_special_tokens", False),
        ("length_penalty", 2.0),
        ("prompt_logprobs", 1),
        ("logprob_token_ids", [5]),
        ("watermarking", True),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("web_search_options", {}),
        ("suffix", "end"),
    ]
    served = [
        ("response_format", {"type": "text"}),
        ("tools", []),
        ("tool_choice", "none"),
        ("min_p", 0),
        ("min_p", 0.1),
        ("min_tokens", 0),
        ("min_tokens", 1),
        ("spaces_between_special_tokens", True),
        ("length_penalty", 1),
        ("prompt_logprobs", None),
        ("modalities", ["text"]),
        ("use_beam_search", False),
        ("guided_json", None),
        ("some_future_field", {"x": 1}),
    ]
    with httpx.Client(timeout=30) as h:
        for route, base in (
            ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}),
            ("/v1/chat/completions", {"model": MODEL, "messages": hi, "max_tokens": 1}),
        ):
            for field, value in refused:
                e = _err(h.post(server + route, json=dict(base, **{field: value})), 400)
                assert e["param"] == field and field in e["message"], (route, field, e)
        # tools are the chat route's (tests/test_tool_calls.py)
        for field, value in (
            ("tools", [tool]),
            ("tool_choice", "required"),
            ("tool_choice", {"type": "function", "function": {"name": "f"}}),
        ):
            body = {"model": MODEL, "prompt": "x", "max_tokens": 1, field: value}
            e = _err(h.post(server + "/v1/completions", json=body), 400)
            assert e["param"] == field and field in e["message"], (field, e)
            for field, value in served:
                r = h.post(server + route, json=dict(base, **{field: value}))
                assert r.status_code == 200, (route, field, r.text)
        # vLLM's chat-template options (completions' echo is a field it serves)
        chat_base = {"model": MODEL, "messages": hi, "max_tokens": 1}
        for field, value in (
            ("echo", True),
            ("continue_final_message", True),
            ("add_generation_prompt", False),
            ("chat_template", "{{ messages }}"),
            ("chat_template_kwargs", {"enable_thinking": True}),  # (built-in template: "thinking" only)
            ("chat_template_kwargs", {"thinking": "yes"}),
            ("chat_template_kwargs", {"messages": []}),
            ("chat_template_kwargs", ["thinking"]),
            ("documents", [{"text": "x"}]),
        ):
            e = _err(h.post(server + "/v1/chat/completions", json=dict(chat_base, **{field: value})), 400)
            assert e["param"] == field, (field, e)
        for field, value in (
            ("echo", False),
            ("add_generation_prompt", True),
            ("chat_template_kwargs", {}),
            ("chat_template_kwargs", {"thinking": False}),
        ):
            r = h.post(server + "/v1/chat/completions", json=dict(chat_base, **{field: value}))
            assert r.status_code == 200, (field, r.text)
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        msgs = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ]
        body = {"model": MODEL, "messages": msgs, "max_tokens": 1}
        r = h.post(server + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        body["messages"][1] = {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}
        e = _err(h.post(server + "/v1/chat/completions", json=body), 400)
        assert e["param"] == "messages" and "function_call" in e["message"]
    _healthy(server)

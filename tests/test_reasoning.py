"""The reasoning / content split of thinking replies (``openk3.infer.reasoning``)."""

from __future__ import annotations

import random

import pytest

from openk3.infer.reasoning import (
    THINK_END,
    THINK_START,
    TOOL_SECTION_BEGIN,
    ReasoningSplitter,
    split_reasoning,
)

SEC = TOOL_SECTION_BEGIN


@pytest.mark.parametrize(
    "text, reasoning, content",
    [
        (f"{THINK_START}plan it{THINK_END}the answer", "plan it", "the answer"),
        (f"plan it{THINK_END}the answer", "plan it", "the answer"),  # start marker left out
        (f"{THINK_START}plan it", "plan it", ""),  # still thinking when the reply ended
        ("", "", ""),
        (f"{THINK_START}{THINK_END}", "", ""),
        (f"{THINK_START}look up{SEC}<|tool_call_begin|>x", "look up", f"{SEC}<|tool_call_begin|>x"),
        (f"a{SEC}b{THINK_END}c", "a", f"{SEC}b{THINK_END}c"),  # the earliest end wins
        (f"a{THINK_END}b{SEC}c", "a", f"b{SEC}c"),
        (f" {THINK_START}a{THINK_END}b", f" {THINK_START}a", "b"),  # the start marker only at the very start
        (f"a{THINK_END}b{THINK_END}c", "a", f"b{THINK_END}c"),
        ("<thin", "<thin", ""),  # an unfinished marker at the end is text
        (f"x</thi{THINK_END}y", "x</thi", "y"),
    ],
)
def test_split_rules(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)


def _reference(text: str) -> tuple[str, str]:
    """The rules written out independently: drop a leading start marker, cut at the earliest end."""
    body = text[len(THINK_START) :] if text.startswith(THINK_START) else text
    ends = [(body.find(m), m) for m in (THINK_END, SEC) if body.find(m) >= 0]
    if not ends:
        return body, ""
    at, m = min(ends)
    return body[:at], body[at + len(m) :] if m == THINK_END else body[at:]


def test_any_chunking_equals_the_whole_text():
    rng = random.Random(0)
    alphabet = ["a", "b", "<", ">", "/", "think", "|", "\n", THINK_START, THINK_END, SEC, "</thi", "<|tool"]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        expect = _reference(text)
        assert split_reasoning(text) == expect, text
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        s, r, c = ReasoningSplitter(), [], []
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            pr, pc = s.push(text[a:b])
            r.append(pr)
            c.append(pc)
        pr, pc = s.finish()
        assert ("".join(r) + pr, "".join(c) + pc) == expect, (text, cuts)


def test_one_character_at_a_time_holds_back_only_marker_prefixes():
    s = ReasoningSplitter()
    seen = []
    for ch in f"{THINK_START}ab</th{THINK_END}cd":
        seen.append(s.push(ch))
    # "ab" is released as it comes; "</th" is held while it could be the end marker, then released as reasoning
    assert "".join(r for r, _ in seen) == "ab</th"
    assert "".join(c for _, c in seen) == "cd"
    assert not s.in_reasoning
    assert s.finish() == ("", "")


def test_custom_markers_and_bad_markers():
    assert split_reasoning("[r]x[/r]y", start="[r]", end="[/r]", implicit_ends=()) == ("x", "y")
    with pytest.raises(ValueError, match="non-empty"):
        ReasoningSplitter(end="")

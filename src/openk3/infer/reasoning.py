"""Separating a thinking model's reasoning from its answer (Kimi's ``<think>`` ... ``</think>`` layout).

Kimi's thinking models write their reasoning first and the answer after it::

    <think>reasoning ...</think>answer ...

The start marker may be missing (a chat template can end the generation prompt with it, or the model starts
reasoning without it), and the model may end its reasoning without the end marker by opening a tool-call section
(``<|tool_calls_section_begin|>``): that marker and what follows are the answer, where the tool-call parser reads
them. An output with no end is reasoning only. These are the rules of vLLM's ``kimi_k2`` reasoning parser.

:class:`ReasoningSplitter` applies them to a stream of text pieces, holding back a tail that could be the start of a
marker until the next piece settles it, so that a marker split over two pieces (a tokenizer without them as special
tokens) is still found, and :func:`split_reasoning` applies them to a whole text; any chunking of a text gives the
same two parts as the whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from openk3.infer.tools import held_prefix
from openk3.train.tokenizer import TOOL_SECTION_BEGIN

__all__ = [
    "THINK_START",
    "THINK_END",
    "TOOL_SECTION_BEGIN",
    "ReasoningSplitter",
    "split_reasoning",
    "reasoning_params",
]

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningSplitter:
    """Incremental reasoning / content split of one reply.

    ``push(piece)`` returns the ``(reasoning, content)`` text that piece settles (either may be empty);
    ``finish()`` returns what was held back once the reply is complete; ``feed(piece, final)`` is both (the last
    piece with ``final``).
    """

    def __init__(
        self,
        start: str = THINK_START,
        end: str = THINK_END,
        implicit_ends: Sequence[str] = (TOOL_SECTION_BEGIN,),
    ):
        if not start or not end or any(not m for m in implicit_ends):
            raise ValueError("reasoning markers must be non-empty strings")
        self.start, self.end, self.implicit_ends = start, end, tuple(implicit_ends)
        self._buf = ""
        self._at_start = True  # the start marker is consumed only at the very beginning of the reply
        self._thinking = True

    @property
    def in_reasoning(self) -> bool:
        """Whether the reply is still in its reasoning part."""
        return self._thinking

    def push(self, piece: str) -> tuple[str, str]:
        if not self._thinking:
            return "", piece
        self._buf += piece
        if self._at_start:
            if len(self._buf) < len(self.start) and self.start.startswith(self._buf):
                return "", ""  # could still be the start marker
            if self._buf.startswith(self.start):
                self._buf = self._buf[len(self.start) :]
            self._at_start = False
        # the earliest end of reasoning: the end marker (consumed) or a tool-call section (kept, as content)
        cut, keep = -1, False
        for m, kept in [(self.end, False)] + [(m, True) for m in self.implicit_ends]:
            i = self._buf.find(m)
            if i >= 0 and (cut < 0 or i < cut):
                cut, keep, marker = i, kept, m
        if cut >= 0:
            reasoning = self._buf[:cut]
            content = self._buf[cut:] if keep else self._buf[cut + len(marker) :]
            self._buf, self._thinking = "", False
            return reasoning, content
        held = held_prefix(self._buf, (self.end, *self.implicit_ends))
        out = self._buf[: len(self._buf) - held]
        self._buf = self._buf[len(self._buf) - held :]
        return out, ""

    def finish(self) -> tuple[str, str]:
        """The held-back tail: it never became a marker, so it is reasoning (the reply ended while thinking)."""
        rest, self._buf = self._buf, ""
        self._at_start = False
        return (rest, "") if self._thinking else ("", rest)

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        """:meth:`push` of ``piece``, and with ``final`` (the reply's last piece) :meth:`finish` too."""
        r, c = self.push(piece)
        if final:
            r2, c2 = self.finish()
            r, c = r + r2, c + c2
        return r, c


def split_reasoning(text: str, **markers) -> tuple[str, str]:
    """``(reasoning, content)`` of a whole reply (see the module docstring for the rules)."""
    return ReasoningSplitter(**markers).feed(text, final=True)


def reasoning_params(params, special_id: Callable[[str], int | None]) -> None:
    """Set a chat request's :class:`~openk3.infer.sampling.SamplingParams` for a split reply: the think markers
    that are special tokens (``special_id(marker)``: their id, or None) stay in its text, where the splitter reads
    them, and a grammar applies after ``</think>`` where that is one token, as vLLM starts structured output after
    the reasoning."""
    marks = [i for i in map(special_id, (THINK_START, THINK_END)) if i is not None]
    params.keep_special_token_ids = [*params.keep_special_token_ids, *marks]
    end = special_id(THINK_END)
    if params.guided is not None and end is not None:
        params.guided_start_token_ids = [end]

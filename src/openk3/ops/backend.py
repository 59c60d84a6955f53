"""Backend selection per op: a fast path on CUDA when available, the plain reference elsewhere.

Each op has a registry of named backends: "kda", "mla", "moe", "attnres", "norm" (every RMSNorm module and the KDA
gated output norm), "conv" (the KDA short convolution) and "glu" (the gated activation of the dense FFN and the shared
experts; the routed experts' activation belongs to "moe"). ``auto`` picks the first available non-reference backend
for CUDA inputs and ``reference`` otherwise. Override per op with the environment variable ``OPENK3_BACKEND_<OP>``
(e.g. ``OPENK3_BACKEND_KDA=reference``) or per model with ``model.set_backend(op, name)``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

OPS = ("kda", "mla", "moe", "attnres", "norm", "conv", "glu")


@dataclass
class Backend:
    name: str
    available: Callable[[], tuple[bool, str]]  # (ok, reason)
    cuda_only: bool = True


_REGISTRY: dict[str, list[Backend]] = {
    op: [Backend("reference", lambda: (True, "plain PyTorch"), False)] for op in OPS
}


_NOTICED: set[str] = set()


def register(op: str, backend: Backend) -> None:
    if op not in _REGISTRY:
        raise ValueError(f"unknown op {op!r}; ops are {OPS}")
    _REGISTRY[op] = [b for b in _REGISTRY[op] if b.name != backend.name]
    _REGISTRY[op].insert(0, backend)  # newest fast path first


def names(op: str) -> list[str]:
    return [b.name for b in _REGISTRY[op]]


def resolve(op: str, is_cuda: bool, requested: str | None = None) -> str:
    """Backend name to use for ``op``. ``requested`` (from the model) beats the environment, which beats auto."""
    req = requested or os.environ.get(f"OPENK3_BACKEND_{op.upper()}", "auto")
    if req != "auto":
        for b in _REGISTRY[op]:
            if b.name == req:
                ok, why = b.available()
                if not ok:
                    raise RuntimeError(f"backend {req!r} for {op} is not available: {why}")
                if b.cuda_only and not is_cuda:
                    raise RuntimeError(f"backend {req!r} for {op} needs CUDA tensors")
                return req
        raise ValueError(f"unknown backend {req!r} for {op}; choose from {names(op)} or 'auto'")
    if is_cuda:
        why = []
        for b in _REGISTRY[op]:
            if b.name == "reference":
                continue
            ok, reason = b.available()
            if ok:
                return b.name
            why.append(f"{b.name}: {reason}")
        if why and op not in _NOTICED:  # one line, once per op, when CUDA runs the slow path
            _NOTICED.add(op)
            print(f"openk3: {op} uses the reference path on CUDA ({'; '.join(why)})", file=sys.stderr)
    return "reference"


def describe(is_cuda: bool) -> dict[str, dict]:
    """For ``openk3 env``: the backend each op resolves to, and every registered backend's availability."""
    out = {}
    for op in OPS:
        rows = {b.name: b.available() for b in _REGISTRY[op]}
        try:
            chosen = resolve(op, is_cuda)
        except (RuntimeError, ValueError) as e:
            chosen = f"error: {e}"
        out[op] = {
            "chosen": chosen,
            "backends": {k: {"available": v[0], "why": v[1]} for k, v in rows.items()},
        }
    return out


def split_choices(items) -> dict[str, str]:
    """``["op=name", ...]`` -> ``{"op": "name"}`` (names as given, ``auto`` included); ``ValueError`` on an item
    that is not ``OP=NAME``."""
    out: dict[str, str] = {}
    for item in items:
        if not isinstance(item, str) or item.count("=") != 1:
            raise ValueError(f"backend choices are OP=NAME, e.g. kda=reference; got {item!r}")
        op, name = (t.strip() for t in item.split("="))
        out[op] = name
    return out


def parse_choices(items, is_cuda: bool | None = None) -> dict[str, str | None]:
    """Per-op backend choices from ``["op=name", ...]`` (command lines) or ``{"op": "name"}`` (run files), checked
    against the registry: ``{op: name}``, with ``"auto"`` as None. Unknown ops or names raise ``ValueError`` with
    the valid choices; with ``is_cuda`` given, so does a backend that cannot run on that device."""
    try:  # register the fast paths, so that their names are known even before a model is built
        import openk3.fast  # noqa: F401
    except Exception:
        pass
    chosen = items if isinstance(items, dict) else split_choices(items)
    out: dict[str, str | None] = {}
    for op, name in chosen.items():
        if op not in OPS:
            raise ValueError(f"unknown op {op!r} in a backend choice; ops are {', '.join(OPS)}")
        if name != "auto" and name not in names(op):
            raise ValueError(f"unknown backend {name!r} for {op}; choose from {', '.join(names(op))} or auto")
        out[op] = None if name == "auto" else name
        if is_cuda is not None and out[op] is not None:
            try:
                resolve(op, is_cuda, out[op])
            except RuntimeError as e:
                raise ValueError(str(e)) from None
    return out

"""Host cost of structured output (guided decoding) masks at a large vocabulary, on the CPU.

Before each decode step the engine asks llguidance for each guided row's next-token bitmask
(``GuidedCompiler.mask_words``: one matcher's ``compute_bitmask``, several rows in one ``LLExecutor`` call spread
over its threads), wraps the int32 words in a tensor and copies them to the device, where
``mask_words_to_bool`` unpacks them (``Engine._keep_masks``). This script measures that host work with openk3's
own ``Tokenizer`` and ``GuidedCompiler``:

* the one-time costs: training a byte-level BPE tokenizer of each ``--vocab`` size on local text (cached under
  ``bench/out/guided_tok``; reported, never counted in the per-step numbers) and the tokenizer's llguidance view;
* per request: the grammar and matcher construction (``GuidedCompiler.matcher``);
* per decode step: ``mask_words`` for 1 row and for batches of ``--rows`` rows, each row walking a real accepted
  answer token by token (mask, then ``consume_token`` of the answer's next token, as ``Engine._append_token``
  does), median and p90 per step and per row;
* the host side of ``_keep_masks`` after the words are computed (``torch.from_numpy`` + ``device_tensor``: with
  ``--device cuda`` the host time of the non-blocking copy call from pageable memory), and the unpack
  ``mask_words_to_bool`` on ``--device`` (on the CPU: what a CPU engine runs on the host; on CUDA: until the device
  is synchronised, the copy included).

Example: ``python bench/bench_guided.py --vocab 32768,163840 --rows 1,8,32,64 --steps 48 --out bench/out/g.json``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import site
import statistics
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from openk3.infer.cache import device_tensor  # noqa: E402
from openk3.infer.guided import GuidedCompiler, mask_words_to_bool  # noqa: E402
from openk3.train.data import default_corpus  # noqa: E402
from openk3.train.tokenizer import Tokenizer  # noqa: E402

TOK_CACHE = ROOT / "bench" / "out" / "guided_tok"
_CORPUS_VERSION = 1  # bump when the corpus rule changes (the cache folder is keyed by it)
_DOC_SUFFIXES = (".py", ".pyi", ".md", ".rst", ".txt")


def corpus(max_bytes: int) -> tuple[list[str], int]:
    """Local text, no downloads: the standard library's sources (openk3's default training corpus), then
    the site-packages' ``.py`` / ``.pyi`` / ``.md`` / ``.rst`` / ``.txt`` files in path order, up to ``max_bytes``
    of UTF-8 in all. Returns the documents and their size."""
    docs = default_corpus(max_bytes)
    total = sum(len(d.encode("utf-8")) for d in docs)
    roots = sorted(
        {p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if os.path.isdir(p)}
    )
    files = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            files += [os.path.join(dirpath, f) for f in filenames if f.endswith(_DOC_SUFFIXES)]
    for path in sorted(files):
        if total >= max_bytes:
            break
        try:
            text = Path(path).read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue
        if text.strip():
            docs.append(text)
            total += len(text.encode("utf-8"))
    return docs, total


def load_tokenizer(vocab: int, corpus_bytes: int, cache_dir=TOK_CACHE, log=print) -> tuple[Tokenizer, dict]:
    """A byte-level BPE ``Tokenizer`` trained to ``vocab`` ids (openk3's ``Tokenizer.train_bpe``) on
    :func:`corpus`, cached in ``cache_dir``; with what the training took (recorded on first build)."""
    where = Path(cache_dir) / f"c{_CORPUS_VERSION}-{corpus_bytes}-v{vocab}"
    meta_path = where / "bench_meta.json"
    if meta_path.is_file():
        return Tokenizer.from_file(where), {**json.loads(meta_path.read_text()), "cached": True}
    log(f"training a {vocab}-token BPE on up to {corpus_bytes / 1e6:.0f} MB of local text (once; cached)...")
    t0 = time.perf_counter()
    docs, total = corpus(corpus_bytes)
    t1 = time.perf_counter()
    tok = Tokenizer.train_bpe(docs, vocab_size=vocab)
    t2 = time.perf_counter()
    tok.save(where)
    meta = {
        "target_vocab": vocab,
        "vocab_size": tok.vocab_size,
        "corpus_docs": len(docs),
        "corpus_bytes": total,
        "read_s": round(t1 - t0, 2),
        "train_s": round(t2 - t1, 2),
    }
    meta_path.write_text(json.dumps(meta, indent=1))
    return tok, {**meta, "cached": False}


# ---------------------------------------------------------------------------- grammars and their answers

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
_PERSON = {
    "name": "Ada Lovelace, Countess of Lovelace",
    "age": 36,
    "role": "editor",
    "tags": ["mathematics", "poetry", "the analytical engine"],
}
_ORDER = {
    "id": 4127,
    "status": "shipped",
    "items": [{"sku": "A-17", "qty": 3}, {"sku": "B-2", "qty": 1}],
    "comment": "left the north warehouse on Tuesday",
}
# name -> (SamplingParams.guided spec, a valid answer: its canonical tokens are the walk)
GRAMMARS = {
    "json_schema": ({"json": SCHEMA}, json.dumps(_PERSON)),
    "json_object": ({"json_object": True}, json.dumps(_ORDER)),
    "regex": ({"regex": r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,4}"}, "ada.lovelace@analytical-engine.org"),
    "choice": ({"choice": ["positive", "negative", "neutral", "mixed"]}, "neutral"),
}

# decode steps of the README / NOTES, for context only (measured elsewhere, on a GPU; not by this script)
CONTEXT_STEPS_MS = {
    "48B shape batch 1 (H200, README)": 2.3,
    "48B shape batch 64, ragged 4k-8k (H200, NOTES v31)": 33.5,
}


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class _Row:
    """One guided request walking its answer: ``ids`` (answer tokens, then EOS) from ``pos`` on."""

    def __init__(self, gc: GuidedCompiler, spec: dict, ids: list[int], start: int, compile_s: list[float]):
        t0 = time.perf_counter()
        self.m = gc.matcher(spec)
        compile_s.append(time.perf_counter() - t0)
        self.ids = ids
        self.pos = start
        if start and not self.m.consume_tokens(ids[:start]):
            raise RuntimeError(f"the answer's first {start} tokens are refused: {self.m.get_error()}")


def walk(gc, spec, ids, eos, rows, steps, warmup, device, compile_s) -> dict:
    """``rows`` guided requests decoding their answer (``ids``) for ``warmup + steps`` steps, spread over the walk
    (row r starts at token r * len / rows); a finished one is replaced by a fresh request (its matcher built outside
    the timed calls). Per step: ``mask_words`` of all rows, the host side of ``_keep_masks`` (words to the device
    tensor), the unpack, and each row's ``consume_token``."""
    V = gc.tokenizer.vocab_size
    live = [_Row(gc, spec, ids, (r * len(ids)) // rows, compile_s) for r in range(rows)]
    mask_s, glue_s, unpack_s, consume_s = [], [], [], []
    cuda = device.type == "cuda"
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        words = gc.mask_words([row.m for row in live])
        t1 = time.perf_counter()
        w = device_tensor(torch.from_numpy(words), torch.int32, device)
        t2 = time.perf_counter()
        bits = mask_words_to_bool(w, V)
        if cuda:
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        tc = 0.0
        for b, row in enumerate(live):
            t = row.ids[row.pos]
            if not (words[b, t >> 5] >> (t & 31)) & 1:
                raise RuntimeError(f"token {t} of the answer is not in its mask at step {row.pos}")
            a = time.perf_counter()
            ok = row.m.consume_token(t)
            tc += time.perf_counter() - a
            if not ok:
                raise RuntimeError(f"consume_token({t}) failed: {row.m.get_error()}")
            row.pos += 1
            if t == eos or row.m.is_stopped() or row.pos == len(row.ids):
                live[b] = _Row(gc, spec, ids, 0, compile_s)  # the next request (not timed here)
        if step >= warmup:
            mask_s.append(t1 - t0)
            glue_s.append(t2 - t1)
            unpack_s.append(t3 - t2)
            consume_s.append(tc)
        del bits
    med, p90 = statistics.median(mask_s), _q(mask_s, 0.9)
    cons = statistics.median(consume_s)
    return {
        "rows": rows,
        "steps": steps,
        "mask_ms_med": med * 1e3,
        "mask_ms_p90": p90 * 1e3,
        "mask_us_per_row_med": med / rows * 1e6,
        "mask_us_per_row_p90": p90 / rows * 1e6,
        "consume_ms_med": cons * 1e3,
        "glue_us_med": statistics.median(glue_s) * 1e6,
        "unpack_ms_med": statistics.median(unpack_s) * 1e3,
        "mask_bytes": int(words.nbytes),
        # tokens/s that the host's guided work alone would allow if nothing hid it (mask + consume, serial)
        "host_bound_tok_s": rows / (med + cons),
    }


def compile_times(gc, spec, reps: int) -> tuple[list[float], list[float]]:
    """``reps`` fresh matchers of ``spec`` (``GuidedCompiler.matcher``, what the engine runs per request) and the
    first mask of each (its lexer states are built lazily, so a fresh request's first masks cost more)."""
    comp, first = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        m = gc.matcher(spec)
        t1 = time.perf_counter()
        gc.mask_words([m])
        first.append(time.perf_counter() - t1)
        comp.append(t1 - t0)
    return comp, first


def machine() -> dict:
    import llguidance
    import tokenizers

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model or platform.processor(),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "llguidance": getattr(llguidance, "__version__", "?"),
        "tokenizers": tokenizers.__version__,
        "loadavg_start": os.getloadavg(),
    }


def _ints(s: str, name: str) -> list[int]:
    try:
        xs = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{name} takes comma-separated integers, got {s!r}") from None
    if not xs or min(xs) < 1:
        raise SystemExit(f"--{name} values must be >= 1, got {s!r}")
    return xs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--vocab", default="32768,163840", help="BPE vocabulary sizes (K3's vocab_size is 163840)"
    )
    ap.add_argument("--rows", default="1,8,32,64", help="guided rows per decode step")
    ap.add_argument("--steps", type=int, default=128, help="timed decode steps per (vocab, grammar, rows)")
    ap.add_argument("--warmup", type=int, default=4, help="untimed decode steps first")
    ap.add_argument("--compile-reps", type=int, default=20, help="fresh matchers timed per grammar")
    ap.add_argument("--grammars", default=",".join(GRAMMARS), help=f"of {', '.join(GRAMMARS)}")
    ap.add_argument("--corpus-mb", type=int, default=96, help="local text the tokenizers are trained on (MB)")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="llguidance executor threads for several rows (default: the engine's, llguidance's default)",
    )
    ap.add_argument("--cache-dir", default=str(TOK_CACHE), help="where trained tokenizers are kept")
    ap.add_argument("--device", default="cpu", help="where the words go (the engine's device); cpu here")
    ap.add_argument("--out", default=None, help="JSON results")
    a = ap.parse_args(argv)
    vocabs, row_counts = _ints(a.vocab, "vocab"), _ints(a.rows, "rows")
    names = [g for g in a.grammars.split(",") if g]
    if bad := [g for g in names if g not in GRAMMARS]:
        ap.error(f"unknown grammar {bad[0]!r}; choose from {', '.join(GRAMMARS)}")
    if a.steps < 1 or a.compile_reps < 1 or a.warmup < 0 or a.corpus_mb < 1:
        ap.error("--steps, --compile-reps and --corpus-mb must be >= 1, --warmup >= 0")
    device = torch.device(a.device)
    t_start = time.perf_counter()
    res = {"args": vars(a), "machine": machine(), "context_step_ms": CONTEXT_STEPS_MS}
    res["tokenizers"], res["compile"], res["rows"] = [], [], []
    for vocab in vocabs:
        tok, meta = load_tokenizer(
            vocab, a.corpus_mb * 1_000_000, a.cache_dir, log=lambda s: print(s, file=sys.stderr)
        )
        gc = GuidedCompiler(tok, [tok.eos_id])
        t0 = time.perf_counter()
        gc._lltokenizer()  # the tokenizer's llguidance view: once per engine, at its first guided request
        meta["lltokenizer_s"] = time.perf_counter() - t0
        if a.threads is not None:
            import llguidance

            gc._executor = llguidance.LLExecutor(num_threads=a.threads)
        V = tok.vocab_size
        meta["vocab"] = V
        res["tokenizers"].append(meta)
        for name in names:
            spec, answer = GRAMMARS[name]
            ids = tok.encode(answer, allow_special=False) + [tok.eos_id]
            comp, first = compile_times(gc, spec, a.compile_reps)
            res["compile"].append(
                {
                    "vocab": V,
                    "grammar": name,
                    "answer_tokens": len(ids),
                    "compile_ms_med": statistics.median(comp) * 1e3,
                    "compile_ms_p90": _q(comp, 0.9) * 1e3,
                    "first_mask_ms_med": statistics.median(first) * 1e3,
                    "first_mask_ms_p90": _q(first, 0.9) * 1e3,
                }
            )
            for rows in row_counts:
                comp_walk: list[float] = []
                r = walk(gc, spec, ids, tok.eos_id, rows, a.steps, a.warmup, device, comp_walk)
                res["rows"].append({"vocab": V, "grammar": name, "answer_tokens": len(ids), **r})
    res["wall_s"] = time.perf_counter() - t_start
    # (other processes on the machine skew these timings: the load averages say whether there were any)
    res["machine"]["loadavg_end"] = os.getloadavg()
    print_tables(res)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


def _load(la) -> str:
    return "/".join(f"{x:.2f}" for x in la)


def print_tables(res: dict) -> None:
    m = res["machine"]
    print(
        f"\nmachine: {m['cpu']}, {m['nproc']} CPUs; torch {m['torch']}, llguidance {m['llguidance']}, "
        f"tokenizers {m['tokenizers']}; wall {res['wall_s']:.1f} s; load average (1, 5, 15 min) "
        f"{_load(m['loadavg_start'])} at the start, {_load(m['loadavg_end'])} at the end\n"
    )
    print("| vocab | corpus | BPE training (once) | llguidance tokenizer view (once per engine) |")
    print("| ---: | ---: | ---: | ---: |")
    for t in res["tokenizers"]:
        train = f"{t['train_s']:.1f} s" + (" (cached)" if t["cached"] else "")
        print(
            f"| {t['vocab']:,} | {t['corpus_bytes'] / 1e6:.0f} MB, {t['corpus_docs']:,} files | {train} | "
            f"{t['lltokenizer_s'] * 1e3:.0f} ms |"
        )
    print(
        "\n| vocab | grammar | answer tokens | matcher build ms (med / p90) | fresh matcher's first mask ms (med / p90) |"
    )
    print("| ---: | --- | ---: | ---: | ---: |")
    for c in res["compile"]:
        print(
            f"| {c['vocab']:,} | {c['grammar']} | {c['answer_tokens']} | {c['compile_ms_med']:.2f} / "
            f"{c['compile_ms_p90']:.2f} | {c['first_mask_ms_med']:.3f} / {c['first_mask_ms_p90']:.3f} |"
        )
    print(
        "\n| vocab | grammar | rows | mask ms / step (med / p90) | us / row (med / p90) | consume ms / step | "
        "words -> tensor us | unpack ms | host-bound tok/s |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in res["rows"]:
        print(
            f"| {r['vocab']:,} | {r['grammar']} | {r['rows']} | {r['mask_ms_med']:.3f} / {r['mask_ms_p90']:.3f} | "
            f"{r['mask_us_per_row_med']:.1f} / {r['mask_us_per_row_p90']:.1f} | {r['consume_ms_med']:.3f} | "
            f"{r['glue_us_med']:.1f} | {r['unpack_ms_med']:.3f} | {r['host_bound_tok_s']:,.0f} |"
        )
    ctx = "; ".join(f"{k}: {v} ms" for k, v in res["context_step_ms"].items())
    print(
        "\nmask: GuidedCompiler.mask_words over all rows (1 row: compute_bitmask; several: one LLExecutor call); "
        "consume: each row's consume_token; words -> tensor: torch.from_numpy + device_tensor (host side of "
        "_keep_masks); unpack: mask_words_to_bool on --device (CUDA: synchronised, the copy included); host-bound "
        "tok/s: rows / (mask + consume). For context only, decode steps measured elsewhere on a GPU: " + ctx
    )


if __name__ == "__main__":
    main()

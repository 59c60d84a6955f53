"""``openk3 generate``, ``openk3 chat`` and ``openk3 serve`` (registered into the main CLI by ``register``).

Without ``--ckpt`` the commands use ``runs/default/final`` (``openk3 train``'s default output) when it exists, else
a freshly initialised ``tiny`` model with a small byte-level tokenizer, so they always run; ``--preset NAME`` runs a
freshly initialised model of that preset instead (random weights, for timing a real model's shape).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from openk3.config import PRESETS

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--ckpt",
        metavar="DIR",
        help="released-format checkpoint directory (default: runs/default/final "
        "if present, else a freshly initialised tiny model)",
    )
    g.add_argument(
        "--preset",
        metavar="NAME",
        choices=sorted(PRESETS),
        help="instead of a checkpoint, a freshly initialised model of this preset with random weights, built on "
        "the device (e.g. to time the engine or the server at a real model's shape: --preset kimi-linear-48b); "
        f"one of {', '.join(sorted(PRESETS))}",
    )
    g.add_argument(
        "--tokenizer", metavar="PATH", help="tokenizer file or directory (default: the checkpoint's)"
    )
    g.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    g.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        help="weights and cache dtype (default: bf16 on CUDA, fp32 on CPU)",
    )
    g.add_argument("--seed-init", type=int, default=0, help=argparse.SUPPRESS)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--page-size", type=int, default=16, help="tokens per cache page (default 16)")
    g.add_argument("--max-seqs", type=int, default=64, help="sequences decoded together at most (default 64)")
    g.add_argument(
        "--max-total-tokens",
        dest="pool_tokens",
        type=int,
        default=None,
        help="cache pool size in tokens, shared by every sequence (default: from free GPU memory; 32768 on CPU)",
    )
    g.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="fraction of free GPU memory to use"
    )
    g.add_argument("--max-model-len", type=int, default=None, help="context length cap (prompt + output)")
    g.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=4096,
        help="prompt tokens prefilled per engine step, over all prefilling prompts (default 4096)",
    )
    g.add_argument(
        "--batch-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefill a piece of each of several prompts in one forward (packed varlen sequences; default on). "
        "--no-batch-prefill: one prompt per prefill forward",
    )
    g.add_argument(
        "--prefill-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CUDA: the prefill forward's KDA chunk calls replayed from CUDA graphs, one per bucket of tokens and "
        "prompts, captured on first use (default on)",
    )
    g.add_argument(
        "--prefill-ffn-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CUDA: the prefill forward's FFN / MoE layers replayed from CUDA graphs, one per layer and multiple of "
        "256 tokens, captured on first use (default on)",
    )
    g.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    g.add_argument(
        "--prefix-cache-outputs",
        action="store_true",
        help="also snapshot generated tokens at the prefix interval, so that a prompt repeating a conversation "
        "so far (prompt and reply, token for token) reuses it (off by default)",
    )
    g.add_argument(
        "--prefix-interval",
        type=int,
        default=512,
        help="prefix-cache snapshot interval in tokens; smaller values reuse shorter shared prefixes, at the cost "
        "of more prefill work in each KDA layer (default 512)",
    )
    g.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="capture the decode step in CUDA graphs per batch bucket (default on; no effect on CPU)",
    )
    g.add_argument(
        "--fuse-projections",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode: one GEMM per attention layer over its input projections, stored side by side (default on)",
    )
    g.add_argument(
        "--fuse-ffn-projections",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode: one GEMM per FFN over its input projections (dense gate/up; MoE latent down + shared gate/up) "
        "and one over its output projections (latent up + shared down); default on",
    )
    g.add_argument(
        "--fuse-residual",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="decode: fold the residual adds into the attention / FFN output GEMMs (addmm); default off (no gain "
        "measured on an H200)",
    )
    g.add_argument(
        "--fuse-read-norm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode steps and prefill forwards: each AttnRes read and the RMSNorm after it in one launch (Triton "
        "reader); default on",
    )
    g.add_argument(
        "--fuse-kda-lowrank",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode, up to 16 rows: the KDA step kernel applies the low-rank up projections of the decay and of a "
        "low-rank gate itself (one GEMV fewer each per KDA layer); default on",
    )
    g.add_argument(
        "--fuse-mla-glue",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode, up to 16 rows: each MLA layer's latent norm, cache write and absorbed query in one launch, and "
        "W_UV with the output gate folded into the attention kernel's reduce; default on",
    )
    g.add_argument(
        "--guided-compact-json",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="structured output: JSON without whitespace between its tokens (vLLM's disable_any_whitespace; "
        "default off: whitespace as the model writes it)",
    )
    g.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode: launch step t+1 before step t's tokens reach the host, and append them while it runs (same "
        "tokens); default on (--no-overlap: one step at a time)",
    )
    g.add_argument(
        "--pdl",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode: launch openk3's Triton kernels with programmatic dependent launch (sm_90+: each starts while "
        "the one before drains), at batch 1; default on (--no-pdl: plain launches)",
    )
    g.add_argument(
        "--parallel-ffn",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode, MoE layers on CUDA: independent branches (router, shared experts) on a second stream of the "
        "same CUDA graph; default on",
    )
    g.add_argument(
        "--fuse-add-norm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode, models without AttnRes: each residual add and the RMSNorm after it in one launch; default on",
    )
    g.add_argument(
        "--triton-gemv",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode on CUDA, one row: the projections with weights of up to 32 MB as one Triton GEMV launch each "
        "instead of cuBLAS; default on",
    )
    g.add_argument(
        "--fuse-glu-gemv",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="decode on CUDA, one row, with --triton-gemv and --parallel-ffn: the shared experts' gated activation "
        "formed inside the GEMV that reads it, and a latent MoE's output GEMM reading its two inputs in place; "
        "default off (measured slower on an H200)",
    )
    g.add_argument(
        "--fuse-norm-gemv",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode on CUDA, one row, with --triton-gemv: a latent MoE's RMSNorm of the routed experts' mixture "
        "formed inside the FFN output GEMV that reads it (no norm launch, no concatenation); default on",
    )
    g.add_argument(
        "--gemv-residual",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode on CUDA, one row, with --triton-gemv, AttnRes models: the residual add after an output "
        "projection done in the GEMV's store (same values, one launch less per layer half); default on",
    )
    g.add_argument(
        "--fold-norms",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode on CUDA, one row, models without AttnRes (Kimi Linear layout): the add + norm launches between "
        "the layer halves folded into their neighbours (the router and input GEMVs form the norms, the experts' down "
        "+ combine kernel adds the shared output and the residual); same roundings; default on",
    )
    g.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="OP=NAME",
        help="force a backend for one op of the prefill path (kda, mla, moe, attnres, norm, conv, glu), e.g. "
        "--backend kda=reference; `openk3 env` lists the names (default: auto)",
    )
    g.add_argument(
        "--decode-backend", default=None, help="decode steps: auto (default), reference, or a registered name"
    )
    g.add_argument(
        "--mla-backend",
        default="auto",
        choices=["auto", "flashinfer"],
        help="MLA decode attention: auto (our Triton kernel on CUDA; default) or flashinfer (optional package "
        "flashinfer-python; faster at many heads, bench/NOTES.md v26)",
    )
    g.add_argument(
        "--moe-small-tokens",
        type=int,
        default=None,
        metavar="N",
        help="MoE layers seeing at most N tokens (decode at batch <= N) use the few-token Triton path on CUDA "
        "while the batch has at most 2 (token, expert slot) pairs per expert (default: $OPENK3_MOE_SMALL_N, else 16; "
        "0 = off)",
    )
    g.add_argument(
        "--moe-tiled",
        type=int,
        default=None,
        metavar="N",
        help="MoE layers of a larger decode batch whose (token, expert slot) pairs are at most N per expert on average "
        "use the expert-tiled Triton kernels (each expert's weights read once; default: $OPENK3_MOE_TILED, else 32, "
        "where they beat the grouped GEMMs on an H100, bench/NOTES.md v33-v34; 0 = off)",
    )


def _add_sampling_args(p: argparse.ArgumentParser, max_new_default: int | None) -> None:
    g = p.add_argument_group("sampling")
    default = max_new_default or "up to the context length"
    g.add_argument(
        "-n",
        "--max-new-tokens",
        "--max-tokens",
        dest="max_new_tokens",
        type=int,
        default=max_new_default,
        help=f"tokens to generate at most, as the API's max_tokens (default {default})",
    )
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 or -1 = off)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus mass (1 = off; default 0.95)")
    g.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="keep tokens at least this times as likely as the best (0 = off)",
    )
    g.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="no end-of-sequence or stop before this many tokens (default 0)",
    )
    g.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="HF-style penalty in [0.01, 100] (1 = off)"
    )
    g.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="OpenAI-style, per occurrence in the output (0 = off)",
    )
    g.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="OpenAI-style, once a token is in the output (0 = off)",
    )
    g.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s = p.add_argument_group("structured output (needs llguidance: pip install 'openk3[serve]')")
    x = s.add_mutually_exclusive_group()
    x.add_argument("--json-schema", metavar="JSON|FILE", help="reply with JSON matching this schema")
    x.add_argument("--json-object", action="store_true", help="reply with a JSON object")
    x.add_argument("--regex", help="reply with a match of this regular expression")
    x.add_argument("--choice", action="append", help="reply with one of these strings (repeatable)")
    x.add_argument("--grammar", metavar="FILE", help="reply in this Lark or GBNF grammar")


def _load(args):
    import torch

    from openk3.infer.engine import Engine, EngineConfig, load_for_inference

    if args.ckpt is not None and getattr(args, "preset", None) is not None:
        raise SystemExit("--ckpt and --preset: pass a checkpoint or a preset to initialise, not both")
    if args.moe_small_tokens is not None and args.moe_small_tokens < 0:
        raise SystemExit(f"--moe-small-tokens must be >= 0, got {args.moe_small_tokens}")
    if args.moe_tiled is not None and args.moe_tiled < 0:
        raise SystemExit(f"--moe-tiled must be >= 0, got {args.moe_tiled}")
    dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
    model, tok, name, source = load_for_inference(
        args.ckpt,
        device=args.device,
        dtype=dtype,
        tokenizer=args.tokenizer,
        seed=args.seed_init,
        preset=getattr(args, "preset", None),
    )
    from openk3.ops.backend import parse_choices

    for op, name in parse_choices(args.backend, next(model.parameters()).is_cuda).items():
        model.set_backend(op, name)
    cfg = EngineConfig(
        page_size=args.page_size,
        max_seqs=args.max_seqs,
        max_tokens=args.pool_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_prefill_tokens=args.max_prefill_tokens,
        prefix_cache=not args.no_prefix_cache,
        prefix_cache_outputs=args.prefix_cache_outputs,
        prefix_interval=args.prefix_interval,
        batch_prefill=args.batch_prefill,
        prefill_graphs=args.prefill_graphs,
        prefill_ffn_graphs=args.prefill_ffn_graphs,
        use_cuda_graphs=args.cuda_graphs,
        fuse_projections=args.fuse_projections,
        fuse_ffn_projections=args.fuse_ffn_projections,
        fuse_residual=args.fuse_residual,
        fuse_read_norm=args.fuse_read_norm,
        fuse_kda_lowrank=args.fuse_kda_lowrank,
        fuse_mla_glue=args.fuse_mla_glue,
        pdl=args.pdl,
        overlap=args.overlap,
        guided_compact_json=args.guided_compact_json,
        parallel_ffn=args.parallel_ffn,
        fuse_add_norm=args.fuse_add_norm,
        triton_gemv=args.triton_gemv,
        fuse_glu_gemv=args.fuse_glu_gemv,
        fuse_norm_gemv=args.fuse_norm_gemv,
        gemv_residual=args.gemv_residual,
        fold_norms=args.fold_norms,
        decode_backend=None if args.decode_backend in (None, "auto") else args.decode_backend,
        mla_backend=None if args.mla_backend == "auto" else args.mla_backend,
    )
    if args.moe_small_tokens is not None:
        from openk3.fast import moe_small

        moe_small.SMALL_N = args.moe_small_tokens
    if args.moe_tiled is not None:
        from openk3.fast import moe_tiled

        moe_tiled.TILED["max_pairs_per_expert"] = args.moe_tiled
    engine = Engine(model, tok, cfg)
    return engine, name, source


def _params(args):
    from openk3.infer.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        min_tokens=args.min_tokens,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        seed=args.seed,
        stop=list(args.stop),
        guided=_guided(args),
    ).validate()


def _guided(args) -> dict | None:
    """SamplingParams.guided from the structured-output options (a schema or grammar given as a file is read)."""
    import json
    import os

    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": list(args.choice)}
    if args.grammar is not None:
        with open(args.grammar, encoding="utf-8") as f:
            return {"grammar": f.read()}
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{") and os.path.exists(text):
            with open(text, encoding="utf-8") as f:
                text = f.read()
        try:
            return {"json": json.loads(text)}
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema: not JSON (nor a file of it): {e}") from None
    return None


def _info(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _describe(engine, name: str, source: str) -> None:
    r = engine.memory_report()
    _info(
        f"[openk3] model {name} from {source}; {engine.device}, {str(engine.dtype).replace('torch.', '')}; cache "
        f"{r['max_tokens']} tokens in pages of {r['page_size']}, {r['bytes_per_token']} B/token, "
        f"{r['bytes_per_sequence']} B/sequence, context {r['max_model_len']}"
    )


# ------------------------------------------------------------------------------------------------ generate
def cmd_generate(args) -> int:
    params = _params(args)  # (bad sampling flags are refused before the model loads)
    engine, name, source = _load(args)
    if not args.quiet:
        _describe(engine, name, source)
    prompts = args.prompt or ["def main():"]
    if len(prompts) == 1:
        echoed = False  # the prompt is echoed with the first output, so a refused prompt is not printed first

        def show(out):
            nonlocal echoed
            if not echoed:
                sys.stdout.write(prompts[0])
                echoed = True
            if out.new_text:
                sys.stdout.write(out.new_text)
            sys.stdout.flush()

        (req,) = engine.generate(prompts, params, on_output=show)
        if not echoed:
            sys.stdout.write(prompts[0])
        sys.stdout.write("\n")
        reqs = [req]
    else:
        reqs = engine.generate(prompts, params)
        for i, (p, r) in enumerate(zip(prompts, reqs)):
            print(f"--- [{i}] {p}{r.text}")
    for r in reqs:
        if r.error:
            raise RuntimeError(f"generation failed: {r.error}")
    if not args.quiet:
        n = sum(len(r.output_ids) for r in reqs)
        _info(f"[openk3] {n} tokens, finish: {', '.join(str(r.finish_reason) for r in reqs)}")
    return 0


# ------------------------------------------------------------------------------------------------ chat
def _render(tok, messages, tools=None) -> tuple[str, list[int]]:
    """Prompt text and extra stop ids: the tokenizer's chat template when it has one (or its <|im_start|> tokens),
    else a plain transcript (which cannot declare tools)."""
    im_end = tok.token_to_id("<|im_end|>")
    if tok.chat_template or tok.token_to_id("<|im_start|>") is not None:
        return tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools), [
            im_end
        ] if im_end is not None else []
    if tools:
        raise ValueError("--tools needs a tokenizer with a chat template (or <|im_start|> tokens)")
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nAssistant:", []


_CHAT_HELP = "/reset clears the history, /tool ID RESULT answers a tool call, /help shows this, /exit (or /quit, Ctrl-D) quits"


def _chat_tools(args, base):
    """The ToolRequest of ``--tools FILE`` and ``--tool-choice``, or None without tools."""
    if args.tools is None:
        return None
    import json

    from openk3.infer.tools import ToolError, tool_request

    try:
        with open(args.tools, encoding="utf-8") as f:
            tools = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--tools {args.tools}: cannot read a JSON list of tools ({e})") from None
    tc = args.tool_choice
    if tc not in ("auto", "required", "none"):
        tc = {"type": "function", "function": {"name": tc}}
    try:
        treq = tool_request({"tools": tools, "tool_choice": tc})
    except ToolError as e:
        raise ValueError(f"--tools / --tool-choice: {e}") from None
    if treq.parse and base.guided is not None:
        raise ValueError(
            "--tools cannot be combined with the structured-output options unless --tool-choice none"
        )
    return treq


def cmd_chat(args) -> int:
    base = _params(args)  # (bad sampling flags are refused before the model loads)
    treq = _chat_tools(args, base)
    engine, name, source = _load(args)
    _describe(engine, name, source)
    _info(f"[openk3] type a message; {_CHAT_HELP}")
    history = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = history[:1] if args.system else []
            _info("[openk3] history cleared")
            continue
        if line in ("/help", "/?"):
            _info(f"[openk3] {_CHAT_HELP}")
            continue
        if line.startswith("/tool"):
            parts = line.split(None, 2)
            if len(parts) < 3:
                _info("[openk3] /tool ID RESULT: the result of the tool call ID (as printed)")
                continue
            history.append({"role": "tool", "tool_call_id": parts[1], "content": parts[2]})
        else:
            history.append({"role": "user", "content": line})
        prompt, stop_ids = _render(engine.tokenizer, history, treq.tools if treq else None)
        params = _params(args)
        params.stop = base.stop + (["\nUser:"] if not stop_ids else [])
        params.stop_token_ids = stop_ids
        parser = _use_tools(engine, treq, params)
        splitter = _use_reasoning(engine, params) if args.reasoning_parser != "none" else None
        ids = engine.encode(prompt)
        if len(ids) >= engine.max_model_len - 1:
            _info("[openk3] the conversation no longer fits in the context; /reset to start over")
            history.pop()
            continue
        if params.max_tokens is not None:
            params.max_tokens = min(params.max_tokens, engine.max_model_len - len(ids))
        sys.stdout.write("assistant> " if interactive else "")
        sys.stdout.flush()

        answer = []

        def show(out, parser=parser, splitter=splitter, answer=answer):
            text = out.new_text
            if splitter is not None:  # reasoning to stderr, as it comes
                thought, text = splitter.feed(text, final=out.finished)
                if thought:
                    sys.stderr.write(thought)
                    sys.stderr.flush()
            answer.append(text)
            text = text if parser is None else parser.feed(text, final=out.finished).content
            if text:
                sys.stdout.write(text)
                sys.stdout.flush()

        (req,) = engine.generate([ids], params, on_output=show)
        sys.stdout.write("\n")
        if parser is not None and parser.calls:
            for c in parser.calls:
                sys.stdout.write(f"[tool call {c.id}] {c.name}({c.arguments})\n")
            calls = [c.openai() for c in parser.calls]
            history.append({"role": "assistant", "content": parser.content, "tool_calls": calls})
        else:
            # (with the reasoning split, only the answer stays in the conversation)
            history.append(
                {"role": "assistant", "content": req.text if splitter is None else "".join(answer)}
            )
        sys.stdout.flush()
        if req.error:
            raise RuntimeError(f"generation failed: {req.error}")
    return 0


def _add_reasoning_arg(p, what: str) -> None:
    p.add_argument(
        "--reasoning-parser",
        default="none",
        choices=["none", "kimi_k2"],  # server.REASONING_PARSERS
        help=f"kimi_k2: {what} (vLLM's option of that name; a grammar then applies after </think>; default none)",
    )


def _use_reasoning(engine, params):
    """Set a chat turn's params for Kimi's reasoning layout (as the server does); returns its splitter."""
    from openk3.infer.reasoning import ReasoningSplitter, reasoning_params

    reasoning_params(params, engine.tokenizer.special_tokens.get)
    return ReasoningSplitter()


def _use_tools(engine, treq, params):
    """Set a chat turn's params for its tools (as the server does); returns the reply's tool-call parser, or None."""
    if treq is None or not treq.parse:
        return None
    from openk3.infer.tools import ToolCallParser, tool_params

    tool_params(treq, params, engine.tokenizer.special_tokens.get, engine.cfg.guided_compact_json)
    return ToolCallParser()


# ------------------------------------------------------------------------------------------------ serve
def cmd_serve(args) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        # name what failed: a package that is present but whose own dependency is missing or too old reads the same
        raise RuntimeError(f"serving needs fastapi and uvicorn: pip install 'openk3[serve]' ({e})") from None
    from openk3.infer.server import check_api_key, serve

    max_request_bytes = int(args.max_request_mb * 2**20) if math.isfinite(args.max_request_mb) else 0
    if max_request_bytes < 1:
        raise ValueError(f"--max-request-mb must be a positive number, got {args.max_request_mb}")
    if not 0 <= args.port <= 65535:  # checked before the model loads, not by uvicorn's bind afterwards
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    # an empty key (e.g. --api-key "$KEY" with KEY unset) would serve without one: refused, not taken as "no key"
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty; leave it out to serve without a key")
    if args.api_key is None and "OPENK3_API_KEY" in os.environ and not os.environ["OPENK3_API_KEY"].strip():
        raise ValueError("OPENK3_API_KEY is set but empty; unset it to serve without a key")
    key = args.api_key or os.environ.get("OPENK3_API_KEY") or None
    try:
        check_api_key(key)
    except ValueError as e:
        raise ValueError(f"--api-key / OPENK3_API_KEY: {e}") from None
    engine, name, source = _load(args)
    _describe(engine, name, source)
    if engine.graphs_enabled:
        t0 = time.perf_counter()
        n = engine.capture_graphs()
        _info(f"[openk3] captured {n} decode CUDA graphs (batch buckets) in {time.perf_counter() - t0:.1f}s")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not key:
        _info(f"[openk3] warning: listening on {args.host} without an API key (--api-key or OPENK3_API_KEY)")
    model_name = args.model_name or name
    _info(
        f"[openk3] serving '{model_name}' at http://{args.host}:{args.port}/v1 (OpenAI API), /health, /metrics"
    )
    serve(
        engine,
        model_name=model_name,
        host=args.host,
        port=args.port,
        api_key=key,
        log_level=args.log_level,
        max_request_bytes=max_request_bytes,
        reasoning_parser=None if args.reasoning_parser == "none" else args.reasoning_parser,
    )
    return 0


# ------------------------------------------------------------------------------------------------ registration
def register(sub) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "generate",
        help="generate text from a prompt, streamed to the terminal",
        description="Generate a continuation of one or more prompts with the inference engine (paged cache, "
        "continuous batching). Text streams to stdout; model and cache information goes to stderr.",
        formatter_class=fmt,
        epilog="examples:\n  openk3 generate --prompt 'def fibonacci(n):' -n 64 --temperature 0\n"
        "  openk3 generate --ckpt runs/default/final --prompt 'import os' --top-p 0.9 --seed 1",
    )
    p.add_argument(
        "--prompt", action="append", help="prompt text (repeat for a batch; default 'def main():')"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="only print the text")
    _add_model_args(p)
    _add_sampling_args(p, 128)
    _add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "chat",
        help="interactive chat in the terminal (uses the tokenizer's chat template)",
        description="Chat with a model: each line you type is a user turn; the reply streams back. The prompt is "
        "rendered with the tokenizer's chat template when it has one. /reset clears the history, /help lists the "
        "commands, /exit quits.",
        formatter_class=fmt,
        epilog="examples:\n  openk3 chat\n  openk3 chat --ckpt runs/default/final --system 'You are terse.' "
        "--temperature 0.7",
    )
    p.add_argument("--system", help="system message")
    p.add_argument(
        "--tools",
        metavar="FILE",
        help='a JSON file of OpenAI tools ([{"type": "function", "function": {...}}, ...]) to declare; the '
        "model's calls are printed, and /tool ID RESULT answers one",
    )
    p.add_argument(
        "--tool-choice",
        default="auto",
        metavar="CHOICE",
        help="auto (default), required, none, or a function's name (required and a name force a call)",
    )
    _add_reasoning_arg(p, "the reply's <think>...</think> reasoning goes to stderr and the answer to stdout; only "
                       "the answer stays in the conversation")  # fmt: skip
    _add_model_args(p)
    _add_sampling_args(p, 256)
    _add_engine_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (FastAPI + uvicorn)",
        description="Serve a model over the OpenAI API: /v1/models, /v1/completions, /v1/chat/completions "
        "(streaming with server-sent events), /health and Prometheus /metrics. Binds to 127.0.0.1 by default.",
        formatter_class=fmt,
        epilog="examples:\n  openk3 serve --port 8000\n  openk3 serve --ckpt runs/default/final --api-key secret\n"
        "  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\\n"
        '       -d \'{"model": "openk3-tiny-random", "prompt": "def ", "max_tokens": 16}\'',
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or set OPENK3_API_KEY)")
    p.add_argument(
        "--model-name", help="model id clients must send (default: the checkpoint's directory name)"
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--max-request-mb",
        type=float,
        default=16.0,  # server.MAX_REQUEST_BYTES (not imported here: fastapi is optional)
        help="larger request bodies get a 413 error (MiB; default %(default)g)",
    )
    _add_reasoning_arg(p, "a thinking model's <think>...</think> reasoning goes to the chat reply's "
                       "reasoning_content apart from its content")  # fmt: skip
    _add_model_args(p)
    _add_engine_args(p)
    p.set_defaults(func=cmd_serve)

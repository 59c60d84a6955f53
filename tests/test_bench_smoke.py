"""The GPU benchmark scripts' CPU smoke modes: each runs end to end on tiny shapes and writes the JSON the notes are
built from, so that a script does not break between GPU runs unnoticed. Speed is not checked here."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_bench_e2e_decode_cpu_ragged_variants(tmp_path):
    out = tmp_path / "e2e.json"
    context = 64
    r = _run(
        [
            "bench/bench_e2e_decode.py", "--device", "cpu", "--presets", "tiny", "--batches", "1,4", "--steps", "3",
            "--context", str(context), "--ragged", "0.5", "--kernel-variants", "mla_per_row,mla_balance",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["errors"] == []
    rows = data["rows"]
    assert [(row["batch"], row["preset"]) for row in rows] == [
        (1, "tiny [mla_per_row] ragged>=0.5"),
        (4, "tiny [mla_per_row] ragged>=0.5"),
        (1, "tiny [mla_balance] ragged>=0.5"),
        (4, "tiny [mla_balance] ragged>=0.5"),
    ]
    warm, steps = 4, 3
    for row in rows:
        assert row["step_ms"] > 0 and row["tok_s"] > 0
        # the reported context is the prompts' mean length (in [context / 2, context]) plus the decoded tokens
        mean_prompt = row["context"] - warm - steps // 2
        assert context // 2 <= mean_prompt <= context
    # the same draw of lengths for every variant (one per batch size)
    assert rows[0]["context"] == rows[2]["context"] and rows[1]["context"] == rows[3]["context"]
    assert "| tiny [mla_balance] ragged>=0.5 | 4 |" in r.stdout


def test_bench_e2e_decode_first_layers(tmp_path):
    """--layers N: the preset's first N layers, its KDA / MLA pattern kept, and a roofline of those layers only."""
    import importlib.util

    from openk3.config import get_preset
    from openk3.cost import predict_decode_time

    spec = importlib.util.spec_from_file_location(
        "bench_e2e_decode", os.path.join(ROOT, "bench/bench_e2e_decode.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    full = get_preset("kimi-linear-48b")
    over = mod.first_layers("kimi-linear-48b", 13)
    cut = get_preset("kimi-linear-48b", **over)
    assert cut.layer_types == full.layer_types[:13] and cut.layer_types.count("mla") == 3
    assert cut.first_k_dense_replace == full.first_k_dense_replace
    assert mod.first_layers("kimi-linear-48b", 0) == {}
    assert predict_decode_time(cut, 1, 1024) < predict_decode_time(full, 1, 1024)
    out = tmp_path / "e2e.json"
    r = _run(
        [
            "bench/bench_e2e_decode.py", "--device", "cpu", "--presets", "tiny", "--batches", "1", "--steps", "2",
            "--context", "16", "--layers", "4", "--out", str(out),
        ]
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["preset"] == "tiny 4L" and row["layers"] == 4
    for bad in ("9", "-1"):
        r = _run(
            ["bench/bench_e2e_decode.py", "--device", "cpu", "--presets", "tiny", "--layers", bad],
            timeout=120,
        )
        assert r.returncode != 0 and "--layers" in r.stderr and "must be" in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.2"])
def test_bench_e2e_decode_rejects_bad_ragged(bad):
    r = _run(
        ["bench/bench_e2e_decode.py", "--device", "cpu", "--presets", "tiny", "--ragged", bad], timeout=120
    )
    assert r.returncode == 2
    assert "--ragged must lie in (0, 1]" in r.stderr


def _run_bench_serve(tmp_path, args: list[str]):
    """bench_serve.py with ``args`` (the server needs the serve extra): its stdout and its JSON."""
    for mod in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(mod)
    out = tmp_path / "serve.json"
    r = _run(["bench/bench_serve.py", *args, "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads(out.read_text())


def test_bench_serve_cpu(tmp_path):
    r, data = _run_bench_serve(
        tmp_path, ["--requests", "4", "--prompt-len", "16", "--max-tokens", "6", "--warmup-requests", "2"]
    )
    assert len(data["requests"]) == 4 and data["args"]["warmup_requests"] == 2
    assert all(0 < q["tokens"] <= 6 and q["ttft"] <= q["e2e"] for q in data["requests"])
    assert data["output_tokens"] == sum(q["tokens"] for q in data["requests"]) and data["wall_s"] > 0
    assert "throughput:" in r.stdout


def test_bench_serve_cpu_stub_forward(tmp_path):
    """``--stub-forward``: the engine alone and the server (its own process) decode with fixed logits; every request
    still gets its tokens."""
    r, data = _run_bench_serve(
        tmp_path,
        [
            "--requests",
            "4",
            "--prompt-len",
            "8",
            "--max-tokens",
            "5",
            "--warmup-requests",
            "0",
            "--stub-forward",
        ],
    )
    assert data["stub_forward"] is True and data["offline"]["output_tokens"] == 4 * 5
    assert [q["tokens"] for q in data["requests"]] == [5] * 4
    assert "(decode stubbed: fixed logits)" in r.stdout


def test_bench_engine_host_cpu(tmp_path):
    out = tmp_path / "engine_host.json"
    r = _run(
        [
            "bench/bench_engine_host.py", "--device", "cpu", "--batches", "1,3", "--vocab", "512", "--steps", "2",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(q["batch"], q["sampling"]) for q in rows] == [
        (b, s) for b in (1, 3) for s in ("greedy", "t=0.8 top_p=0.95")
    ]
    assert all(q["ms"] > 0 for q in rows)


def test_diag_mla_compile_cpu(tmp_path, monkeypatch):
    """The sm_90 compile diagnostic of the MLA split kernels runs here (no GPU) and reports both split forms of the
    Triton kernel, the warp-specialised Gluon kernel's split walk (both output forms) and persistent walk, and that
    walk's Triton preparation and reduce kernels; the Gluon kernel compiles to warpgroup MMAs fed by TMA, with
    per-partition register budgets, no spills, in one SM's shared memory."""
    pytest.importorskip("triton")
    from openk3.infer.mla_gluon import HAS_GLUON

    out = tmp_path / "mla_compile.json"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the script compiles; it refuses the interpreter)
    configs = "few,gluon" if HAS_GLUON else "few"
    r = _run(["bench/diag_mla_compile.py", "--configs", configs, "--rows", "16", "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())
    want = [("few", "per-row"), ("few", "balanced, 16 rows")]
    if HAS_GLUON:
        want += [("gluon", "partials"), ("gluon", "one split"), ("gluon", "persistent")]
        want += [("gluon", f"persistent {k}") for k in ("prep", "reduce", "reduce + post")]
    assert [(x["config"], x["form"]) for x in rows] == want
    for x in rows:
        assert 0 < x["regs"] <= 255 and x["sass_instrs"] > 0
    assert "| few | balanced, 16 rows |" in r.stdout
    for x in rows[:5]:
        assert x["shared"] > 0
    for x in rows[5:]:  # the persistent walk's Triton kernels: compiled (the interpreter does not type-check)
        assert x["spill_ld"] == 0 and x["spill_st"] == 0
    for x in rows[2:5]:
        assert x["spill_ld"] == 0 and x["spill_st"] == 0
        assert x["shared"] <= 227 * 1024  # Hopper's per-block limit
        assert x["hgmma"] > 0 and x["tma_loads"] > 0
        # the loader warp's small budget and the product groups' large ones
        assert min(x["setmaxnreg"]) <= 40 and max(x["setmaxnreg"]) >= 200


def test_diag_moe_compile_tiled_cpu(tmp_path, monkeypatch):
    """The expert-tiled MoE kernels compile for sm_90 here (no GPU; the interpreter tests do not type-check
    kernels): at their default tiles with no spills, the weight stream pipelined through shared memory (cp.async)
    within one SM's shared memory, the products on tensor cores."""
    pytest.importorskip("triton")
    out = tmp_path / "moe_tiled_compile.json"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the script compiles; it refuses the interpreter)
    r = _run(["bench/diag_moe_compile.py", "--tiled", "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted({x["kernel"] for x in rows}) == ["down", "gate/up"]
    default = [x for x in rows if x["default"]]
    assert [x["kernel"] for x in default] == ["gate/up", "down"]
    # the default tiles at every row step the auto rule takes (16, 32, 64 pair rows) fit too
    steps = [x for x in rows if x["tile"] in ([64, 128, 3],) and x["num_warps"] == 4]
    assert sorted((x["kernel"], x["bm"]) for x in steps) == [
        (k, b) for k in ("down", "gate/up") for b in (16, 32, 64)
    ]
    for x in default + steps:
        assert 0 < x["regs"] <= 255 and x["spill_ld"] == 0 and x["spill_st"] == 0
        assert x["cp_async"] > 0 and x["mma"] > 0 and 0 < x["shared"] <= 227 * 1024


def test_diag_moe_tiled_cpu(tmp_path, monkeypatch):
    """bench/diag_moe_tiled.py's smoke run under the Triton interpreter (fp16, a tiny expert shape): every path it
    times runs and agrees with the reference experts, and its JSON has one row per token count."""
    pytest.importorskip("triton")
    out = tmp_path / "moe_tiled.json"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    r = _run(
        [
            "bench/diag_moe_tiled.py",
            "--device",
            "cpu",
            "--shapes",
            "tiny",
            "--tokens",
            "5,20",
            "--out",
            str(out),
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [q["N"] for q in rows] == [5, 20]
    for q in rows:
        assert all(q[f"{p}_err"] < 2e-3 for p in ("tiled", "grouped", "per_pair")), q
    assert "| tiny N20" in r.stdout


@pytest.mark.parametrize("packed", [False, True])
def test_diag_prefill_cpu(tmp_path, packed):
    out = tmp_path / "prefill.json"
    r = _run(
        [
            "bench/diag_prefill.py", "--prompts", "3", "--prompt-len", "40", "--preset", "tiny",
            "--max-prefill-tokens", "32", "--prefix-interval", "16", "--out", str(out),
        ] + ([] if packed else ["--no-batch-prefill"])
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    for run in ("cold", "warm"):
        pieces = [p for f in data[run]["forwards"] for p in f["pieces"]]
        assert all(f["ms"] > 0 for f in data[run]["forwards"])
        # 3 prompts x 39 prefilled tokens; a piece ends at the prompt's end or where the step's budget (32) ran
        # out, and then it has at least a quarter of it (8 tokens); the snapshots (interval 16) are taken inside
        assert sum(n for _, n in pieces) == 3 * 39
        assert all(0 < n <= 32 for _, n in pieces)
        assert all(start + n == 39 or n >= 8 for start, n in pieces)
        # packed: some forward took pieces of several prompts
        assert (max(len(f["pieces"]) for f in data[run]["forwards"]) > 1) == packed
    assert data["model_forward_ms"] > 0
    assert "| tokens per forward |" in r.stdout and "top operations by device time" in r.stdout


def test_diag_kda_graphs_needs_cuda():
    """bench/diag_kda_graphs.py times fla's kernels and CUDA graphs: without a GPU it says so and exits non-zero."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run")
    r = _run(["bench/diag_kda_graphs.py", "--shapes", "64x1"])
    assert r.returncode != 0 and "needs CUDA" in r.stderr, r.stderr[-2000:]


def test_diag_engine_memory_cpu():
    """bench/diag_engine_memory.py's CPU mode: engines one after another on one model, each reported; on the CPU
    nothing is left over from one engine to the next."""
    r = _run(
        [
            "bench/diag_engine_memory.py",
            "--device",
            "cpu",
            "--engines",
            "2",
            "--context",
            "16",
            "--steps",
            "2",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("engine ")]
    assert [ln.split(":")[0] for ln in lines] == ["engine 0", "engine 1"], r.stdout
    assert "(+0.0 MiB against the engine before)" in lines[1]
    assert "0 new reachable storages since the engine before" in lines[1], lines[1]
    r = _run(["bench/diag_engine_memory.py", "--device", "cpu", "--engines", "0"], timeout=120)
    assert r.returncode == 2 and "must be >= 1" in r.stderr


def test_bench_guided_cpu(tmp_path):
    """bench/bench_guided.py on a tiny BPE (trained on the fly, then read from its cache): every grammar's answer
    walks through the engine's mask path (each answer token must be in its row's mask), for one row and a batch."""
    pytest.importorskip("llguidance")
    out = tmp_path / "guided.json"
    args = [
        "bench/bench_guided.py", "--vocab", "400", "--corpus-mb", "1", "--rows", "1,3", "--steps", "3",
        "--warmup", "1", "--compile-reps", "2", "--cache-dir", str(tmp_path / "tok"), "--out", str(out),
    ]  # fmt: skip
    for cached in (False, True):
        r = _run(args, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        data = json.loads(out.read_text())
        (tok,) = data["tokenizers"]
        assert tok["vocab"] == 400 and tok["cached"] is cached
    grammars = ["json_schema", "json_object", "regex", "choice"]
    assert [c["grammar"] for c in data["compile"]] == grammars
    assert [(q["grammar"], q["rows"]) for q in data["rows"]] == [(g, b) for g in grammars for b in (1, 3)]
    for q in data["rows"]:
        assert q["mask_ms_med"] > 0 and q["mask_ms_p90"] >= q["mask_ms_med"] and q["host_bound_tok_s"] > 0
        assert q["mask_bytes"] == q["rows"] * 4 * ((400 + 31) // 32)
    assert "| 400 | regex | 3 |" in r.stdout
    r = _run(["bench/bench_guided.py", "--rows", "0"], timeout=60)
    assert r.returncode != 0 and "--rows values must be >= 1" in r.stderr

#!/usr/bin/env bash
# Every GPU check and benchmark in one go, on one CUDA machine, each step time-boxed so that one slow step cannot eat
# the others (fla's Triton kernels compile and autotune on first use: cap that with OPENK3_AUTOTUNE_MAX=1). All steps
# together leave 8 files in OUT_DIR (a remote runner that returns at most 8 files gets them all).
#
#   OPENK3_AUTOTUNE_MAX=1 bash bench/run_gpu.sh OUT_DIR [steps]
#
# Time limits per step (seconds): T_TESTS=300 T_DECODE=150 T_E2E=300 T_AB=300 T_TRAIN=400, about
# 20 minutes in all; under a shorter per-command limit pass a subset of steps per call.
# steps (comma separated, default tests,decode,e2e,train; also ab: the medium decode A/B of the few-token MoE path and the decode fusions;
# flags: the GPU tests of the decode options that are off by default, then their A/B, bench_e2e_decode.py
# --compare-flags fuse_read_norm,fuse_kda_lowrank, for medium and the 48B shape at batch 1, 4, 16 -> e2e_flags.json;
# pdl: the engine GPU tests of programmatic dependent launch, the kernel tests with OPENK3_PDL=1, bench/diag_pdl.py
# -> diag_pdl.json, and the engine A/B --compare-flags pdl -> e2e_pdl.json; attnres_ab: the medium training step
# with AttnRes and with a plain residual, 5 paired rounds of one profiled step each: AttnRes's overhead in kernel
# time, also as a share of the decoder layers' own time (a plain model with half the layers) -> bench.json; overlap: the engine GPU tests of EngineConfig.overlap and its A/B -> e2e_overlap.json;
# attnres_tune: the fused read + norm GPU tests (every launch variant) and bench/diag_attnres_normed.py over the
# prepared variants: tf32x3 dots, 64 rows per program, 8 warps per row -> diag_attnres_normed.json;
# mla_glue: the GPU tests of the MLA glue steps and of EngineConfig.fuse_mla_glue, bench/diag_mla_glue.py (one MLA
# layer's decode half unfused vs fused, batch 1-16, with the default least split chunk and with 32 tokens),
# bench/diag_mla.py's least-chunk configs at batch 1, and the engine A/B --compare-flags fuse_mla_glue ->
# e2e_mla_glue.json; gemv: the GPU tests of the Triton GEMV and of EngineConfig.triton_gemv, bench/diag_gemv.py
# --sweep (each decode projection shape: cuBLAS, the GEMV, a launch sweep, with PDL) -> gemv.json, and the engine A/B
# --compare-flags $GEMV_FLAGS (default fuse_glu_gemv; v14: triton_gemv,pdl) at batch 1 (wall timing) -> e2e_gemv.json;
# moe1: the few-token MoE GPU tests and the engine's add + norm / MoE tests, then the batch-1 engine bench with the
# defaults, with OPENK3_MOE_DOWN_COMBINE=0 and with OPENK3_MOE_ROUTER_GEMV=0 -> e2e_moe1*.json, and
# bench/diag_decode_step.py -> step_*.txt); res: the GPU tests of the GEMV (gemv_gpu), of EngineConfig.gemv_residual and
# of the few-token gate/up tiles, bench/bench_decode.py's one-token MoE sweep (medium and 48B experts, whole-row gate/up
# tiles among them) -> decode_moe1.json, the medium A/B --compare-flags gemv_residual -> e2e_res.json, and the
# batch-1 engine bench with the default gate/up tile and OPENK3_MOE_UP_TILE=4,0,1 / 2,0,1 -> e2e_up*.json; fold: the
# GPU tests of the GEMV (persistent form, Normed rows written out), the down + combine adds and EngineConfig.fold_norms,
# bench/diag_gemv.py's persistent-form sweep and Normed products on the 48B shape's weights of 16 MB and more ->
# gemv_fold.json (FOLD_GEMV=0 skips those two), the 48B batch-1 A/B --compare-flags fold_norms -> e2e_fold.json, then
# the A/B again -> e2e_fold2.json, fold_norms on with the shared experts as a slot of the routed kernels
# (OPENK3_FOLD_SHARED=slot) and with the KDA input projections on cuBLAS (OPENK3_GEMV_NORMED_MAX_MB=32) ->
# e2e_fold_*.json; v23: the GPU tests of the draw / logprobs kernels, the no-sync engine cases (logit_bias among them)
# and the tl.topk routing selection, then the 48B batch-1 A/Bs of logprobs (no_logprobs) and of
# moe_small.SELECT_TOPK (select_max) -> e2e_v23_*.json; v24: the few-token MoE and engine GPU tests with the tl.topk
# selection on, the 48B batch-1 A/B of the gate/up tiles (up_16x128, up_8x256) -> e2e_v24_tiles.json, the
# fused selection up to 4 tokens at batch 2 and 4 (fuse_select_4) -> e2e_v24_fuse4.json, and
# both presets at batch 1 / 16 / 64 -> e2e_v24.json; serve: bench/bench_serve.py (a random-weight `medium`,
# SERVE_PRESET, behind `openk3 serve`, 64 streamed requests of 512 prompt tokens and 128 new tokens, all at once and at 16 per second; T_SERVE=240)
# -> serve_burst.json, serve_rate16.json; mla_peer: FlashInfer as the MLA decode step (needs flashinfer-python): its
# GPU tests, bench/diag_mla_peer.py (ours beside FlashInfer's paged MLA decode, 16 and 96 heads) -> diag_mla_peer.json,
# and the 48B-shape engine at context 4,096 with each MLA backend -> e2e_mla_peer.json.
# v27: the compiled MLA decode tests (per-row and balanced splits), bench/diag_mla_peer.py with ragged and with uniform
# lengths (per-row, balanced, FlashInfer when installed) -> peer_ragged.json, peer_uniform.json; v27e2e: the
# 48B-shape engine with each split form, 64 rows of ragged prompts (4k-8k tokens) -> e2e_v27_ragged.json and
# uniform prompts of 4,096 tokens at batch 1 / 16 / 64 -> e2e_v27.json; gluon: the GPU tests of the warp-specialised
# Gluon MLA kernel (tests_gluon.log: its persistent and split walks, the ping-pong forms included), then
# bench/diag_mla_peer.py with the Triton kernel, the Gluon kernel's persistent walk, its split walk and its ping-pong
# form with 32-token blocks (when the tests passed) and FlashInfer
# at 96, 64 and 32 heads (ragged, and uniform at 64 x 96 x 8k) ->
# peer_gluon.json, peer_gluon_uniform.json; gluon_e2e (H200: the 48B shape does not fit 80 GB): the engine GPU
# tests with the Gluon walk, then the 48B-shape engine with the Triton and the Gluon MLA walk at batch 16 / 64,
# 4,096-token prompts (twice each) -> e2e_gluon.json, and 64 ragged 4k-8k prompts (the Triton kernel, the Gluon
# split walk, the Gluon persistent walk) -> e2e_gluon_ragged.json.
# v31: the Gluon kernel's GPU tests, then bench/diag_mla_peer.py with the Triton kernel, the Gluon persistent and
# split walks and the persistent walk at any row count, at 16, 32 and 96 heads (ragged, and uniform at
# 64 x {16, 32, 96} x 8k) -> peer_v31.json, peer_v31_uniform.json; b1: `medium` and the 48B shape at batch 1,
# context 1,040 -> e2e_b1.json (on a card under 100 GB also the 48B shape's first B1_LAYERS=16 layers ->
# e2e_b1_48b_layers.json); tiled: the expert-tiled routed experts' GPU tests (tests_tiled.log),
# bench/diag_moe_tiled.py --sweep -> diag_moe_tiled.json, medium at batch 64 with and without them ->
# e2e_tiled_medium.json; tiled_bm: the tiled kernels' GPU tests, bench/diag_moe_tiled.py at 64-256 tokens with
# 16 / 32 / 64-row steps -> diag_moe_tiled_bm.json, medium at batch 128 / 256 with the grouped GEMMs and the tiled
# kernels up to 64 pairs per expert -> e2e_tiled_bm.json; tiled_e2e (H200): the 48B shape at batch 64, ragged
# 4k-8k prompts, the same A/B -> e2e_tiled_48b.json; prefill: the batch_prefill GPU tests (tests_prefill.log), then
# bench/diag_prefill.py (8 prompts of 512 tokens, each prefill forward timed; medium) with the defaults (packed),
# with snapshots every 64 tokens, and one sequence per forward -> diag_prefill_{default,snap64,one}.json;
# prefill_serve: the serve step's burst run with the defaults and with one sequence per prefill forward (512 tokens
# per step) -> serve_burst.json, serve_burst_one.json; prefill_snap: the batch_prefill, recurrent-kernel and
# prefix_cache_outputs GPU tests, then prefix snapshots
# inside packed pieces: diag_prefill.py at interval 64 (SNAP_PROFILE=' ' profiles it: diag_prefill_snap64.log), and 4 prompts of 2,048
# tokens with the default interval and with none inside -> diag_prefill_{snap64,2k,2k_nosnap}.json; snap_mode: the
# packed-snapshot GPU test with OPENK3_KDA_SNAP_MODE=rounds, then both snapshot modes at 8 x 512 tokens (interval 64)
# and 4 x 2,048 (interval 512) -> diag_snap64_{rounds,prefix}.json, diag_2k_{rounds,prefix}.json;
# prefill_host: the batch_prefill and RMSNorm GPU tests (PH_K: another -k expression; SKIP_TESTS=1 skips them), then diag_prefill.py at 2 x 2,048 and 8 x 512
# tokens (PH_SHAPES, also 64x64; PH_RUNS warm bursts, default 5) with this tree, with OLD_TREE (another tree, when
# set) and with this tree and the engine flags PH_BASE_ARGS (when set, e.g. "--no-prefill-graphs" or
# "--no-prefill-ffn-graphs") in the same call,
# a profile of each at 8 x 512 and where the prefill forwards synchronise (--sync-report; PH_PROFILE=0 skips both)
# -> diag_host_{old,base,new}_{2k,8x512,64x64}.json, diag_host_sync.json; PH_SERVE=1 adds the serving burst of
# prefill_serve with PH_BASE_ARGS and without -> serve_burst_{base,new}.json.
# Logs and JSON land in OUT_DIR:
#   tests.log (tests/gpu + the compiled decode-kernel tests), decode.json (bench/bench_decode.py, with the launch
#   sweeps), e2e_decode.json + profile_*.txt (bench/bench_e2e_decode.py --profile), e2e_ab.json (ab:
#   bench_e2e_decode.py for medium with the few-token MoE path off/on x the decode fusions off/FFN/FFN+residual),
#   bench.json + profile.txt
#   (bench/run_all.py: ceilings, KDA, MLA, MoE, AttnRes, norms, medium training step).
set -u
OUT_DIR=${1:?usage: bash bench/run_gpu.sh OUT_DIR [tests,decode,e2e,train]}
STEPS=${2:-tests,decode,e2e,train}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
T_TESTS=${T_TESTS:-300} T_DECODE=${T_DECODE:-150} T_E2E=${T_E2E:-300} T_AB=${T_AB:-300} T_TRAIN=${T_TRAIN:-400}

has() { [[ ",$STEPS," == *",$1,"* ]]; }

if has tests; then
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu tests/test_decode_kernels.py \
    >"$OUT_DIR/tests.log" 2>&1
  echo "tests: exit $? ($(tail -1 "$OUT_DIR/tests.log"))"
fi
if has decode; then
  timeout "$T_DECODE" python3 bench/bench_decode.py --out "$OUT_DIR/decode.json" --budget-s $((T_DECODE - 30)) \
    2>&1 | tail -60
fi
if has e2e; then
  timeout "$T_E2E" python3 bench/bench_e2e_decode.py --profile --steps 12 \
    --out "$OUT_DIR/e2e_decode.json" 2>&1 | grep -v "^\[.*{'preset" | tail -40
fi
if has ab; then
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets medium --batches 1,4,16,64 --steps 12 --moe-small 16 \
    --compare-fusion --out "$OUT_DIR/e2e_ab.json" 2>&1 | grep -v "^\[.*{'preset" | tail -30
fi
if has flags; then
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_fast_ops.py tests/gpu/test_engine_gpu.py \
    tests/test_decode_kernels.py -k "read_normed or fuse_read_norm or lowrank" >"$OUT_DIR/tests_flags.log" 2>&1
  echo "flag tests: exit $? ($(tail -1 "$OUT_DIR/tests_flags.log"))"
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets medium,kimi-linear-48b --batches 1,4,16 --steps 12 \
    --compare-flags fuse_read_norm,fuse_kda_lowrank --out "$OUT_DIR/e2e_flags.json" 2>&1 \
    | grep -v "^\[.*{'preset" | tail -30
fi
if has pdl; then
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_engine_gpu.py -k pdl \
    >"$OUT_DIR/tests_pdl.log" 2>&1
  echo "engine pdl tests: exit $? ($(tail -1 "$OUT_DIR/tests_pdl.log"))"
  OPENK3_PDL=1 timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/test_decode_kernels.py \
    tests/gpu/test_fast_ops.py -k "kda or mla or moe_small or attnres_reader or gumbel" >"$OUT_DIR/tests_pdl_kernels.log" 2>&1
  echo "kernel tests with OPENK3_PDL=1: exit $? ($(tail -1 "$OUT_DIR/tests_pdl_kernels.log"))"
  timeout "$T_DECODE" python3 bench/diag_pdl.py --out "$OUT_DIR/diag_pdl.json" 2>&1 | tail -30
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets medium,kimi-linear-48b --batches 1,16,64 --steps 12 \
    --compare-flags pdl --out "$OUT_DIR/e2e_pdl.json" 2>&1 | grep -v "^\[.*{'preset" | tail -30
fi
if has overlap; then
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_engine_gpu.py -k overlap \
    >"$OUT_DIR/tests_overlap.log" 2>&1
  echo "engine overlap tests: exit $? ($(tail -1 "$OUT_DIR/tests_overlap.log"))"
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets medium,kimi-linear-48b --batches 1,16,64 --steps 24 \
    --wall-timing --compare-flags overlap --out "$OUT_DIR/e2e_overlap.json" 2>&1 | grep -v "^\[.*{'preset" | tail -20
fi
if has attnres_tune; then
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_fast_ops.py tests/gpu/test_fast_model.py \
    -k "read_normed_grad or small_model" >"$OUT_DIR/tests_attnres.log" 2>&1
  echo "attnres tests: exit $? ($(tail -1 "$OUT_DIR/tests_attnres.log"))"
  W8="p2_bwd_norm=1x2048x8,p2_bwd_norm_direct=1x2048x8"
  timeout "$T_DECODE" python3 bench/diag_attnres_normed.py --maxnreg default --dot tf32x3 --rows 64 \
    --set "$W8@p2_bwd_norm=0,p2_bwd_norm_direct=128,p2_bwd_norm_direct.S3=128" \
    --set "$W8@p2_bwd_norm=0,p2_bwd_norm_direct=0,p2_bwd_norm_direct.S3=0" \
    --out "$OUT_DIR/diag_attnres_normed.json" 2>&1 | grep -v -i "warn" | tail -30
  echo "the same, 64 tokens per program of the one-pass backward (OPENK3_ATTNRES_P2_ROWS=64):"
  OPENK3_ATTNRES_P2_ROWS=64 timeout "$T_DECODE" python3 bench/diag_attnres_normed.py --maxnreg default \
    --set "$W8@p2_bwd_norm=0,p2_bwd_norm_direct=128,p2_bwd_norm_direct.S3=128" 2>&1 | grep -v -i "warn" | tail -8
fi
if has mla_glue; then
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_engine_gpu.py tests/test_decode_kernels.py \
    -k "mla_glue or mla_prep or mla_post or decode_post" >"$OUT_DIR/tests_mla_glue.log" 2>&1
  echo "MLA glue tests: exit $? ($(tail -1 "$OUT_DIR/tests_mla_glue.log"))"
  timeout "$T_DECODE" python3 bench/diag_mla_glue.py 2>&1 | tail -12
  echo "the same, at least 32 tokens per split:"
  timeout "$T_DECODE" python3 bench/diag_mla_glue.py --min-chunk 32 2>&1 | tail -12
  timeout "$T_DECODE" python3 bench/diag_mla.py --shapes 1x16x1024,1x32x1024,1x16x4096,4x16x1024 \
    --configs default,chunk64,chunk32 2>&1 | tail -14
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets medium,kimi-linear-48b --batches 1,4,16 --steps 12 \
    --compare-flags fuse_mla_glue --out "$OUT_DIR/e2e_mla_glue.json" 2>&1 | grep -v "^\[.*{'preset" | tail -20
fi
if has gemv; then
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_interpret_gemv_cpu.py \
    tests/gpu/test_engine_gpu.py -k "gemv" >"$OUT_DIR/tests_gemv.log" 2>&1
  echo "GEMV tests: exit $? ($(tail -1 "$OUT_DIR/tests_gemv.log"))"
  timeout "$T_DECODE" python3 bench/diag_gemv.py --sweep --out "$OUT_DIR/gemv.json" 2>&1 | tail -40
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets "${GEMV_PRESETS:-medium,kimi-linear-48b}" \
    --batches 1 --steps 24 --wall-timing --compare-flags "${GEMV_FLAGS:-fuse_glu_gemv}" --out "$OUT_DIR/e2e_gemv.json" 2>&1 \
    | grep -v "^\[.*{'preset" | tail -20
fi
if has moe1; then
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_fast_ops.py tests/gpu/test_engine_gpu.py \
    -k "moe_small_down_combine or moe_small_fused_select or moe_small_router or moe_small_experts or parallel_ffn_add_norm or moe_small_decode" \
    >"$OUT_DIR/tests_moe1.log" 2>&1
  echo "one-token MoE tests: exit $? ($(tail -1 "$OUT_DIR/tests_moe1.log"))"
  for v in "" OPENK3_MOE_DOWN_COMBINE=0 OPENK3_MOE_ROUTER_GEMV=0; do
    echo "== ${v:-defaults}"
    env $v timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets medium,kimi-linear-48b --batches 1 --steps 24 \
      --wall-timing --out "$OUT_DIR/e2e_moe1${v:+_${v%%=*}}.json" 2>&1 | grep "^| [mk]"
  done
  timeout "$T_DECODE" python3 bench/diag_decode_step.py --chain 0 --out "$OUT_DIR" 2>&1 | grep -v -i warn | tail -50
fi
if has res; then
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_interpret_gemv_cpu.py tests/gpu/test_engine_gpu.py \
    tests/gpu/test_fast_ops.py -k "gemv_gpu or gemv_residual or moe_small_experts_tiles or moe_small_fused_select" \
    >"$OUT_DIR/tests_res.log" 2>&1
  echo "GEMV residual / gate-up tile tests: exit $? ($(tail -1 "$OUT_DIR/tests_res.log"))"
  timeout "$T_DECODE" python3 bench/bench_decode.py --sections moe --moe-tokens 1 --moe-shapes medium,48b \
    --budget-s $((T_DECODE - 30)) --out "$OUT_DIR/decode_moe1.json" 2>&1 | grep "^moe experts"
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets medium --batches 1 --steps 24 --wall-timing \
    --compare-flags gemv_residual --out "$OUT_DIR/e2e_res.json" 2>&1 | grep "^| [mk]"
  for v in "" OPENK3_MOE_UP_TILE=4,0,1 OPENK3_MOE_UP_TILE=2,0,1; do
    echo "== ${v:-defaults}"
    tag=$(echo "${v:+_${v##*=}}" | tr , x)
    env $v timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets medium,kimi-linear-48b --batches 1 --steps 24 \
      --wall-timing --out "$OUT_DIR/e2e_up$tag.json" 2>&1 | grep "^| [mk]"
  done
fi
if has fold; then
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_engine_gpu.py tests/gpu/test_fast_ops.py \
    -k "fold_norms or moe_small_down_combine or moe_small_fused_select" >"$OUT_DIR/tests_fold.log" 2>&1
  echo "fold_norms / down + combine tests: exit $? ($(tail -1 "$OUT_DIR/tests_fold.log"))"
  if [ "${FOLD_GEMV:-1}" = 1 ]; then
    timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_interpret_gemv_cpu.py -k gemv_gpu \
      >"$OUT_DIR/tests_gemv.log" 2>&1
    echo "GEMV tests: exit $? ($(tail -1 "$OUT_DIR/tests_gemv.log"))"
    timeout "$T_DECODE" python3 bench/diag_gemv.py --presets kimi-linear-48b --sweep --sweep-set persist --min-mb 16 \
      --normed --out "$OUT_DIR/gemv_fold.json" 2>&1 | grep "^N \|copy"
  fi
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets kimi-linear-48b --batches 1 --steps 24 --wall-timing \
    --compare-flags fold_norms --out "$OUT_DIR/e2e_fold.json" 2>&1 | grep "^| [mk]\|WARN\|disabled"
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets kimi-linear-48b --batches 1 --steps 24 --wall-timing \
    --compare-flags fold_norms --out "$OUT_DIR/e2e_fold2.json" 2>&1 | grep "^| [mk]\|WARN\|disabled"
  for v in OPENK3_FOLD_SHARED=slot OPENK3_GEMV_NORMED_MAX_MB=32; do
    echo "== fold_norms on (default), $v"
    env $v timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets kimi-linear-48b --batches 1 --steps 24 \
      --wall-timing --out "$OUT_DIR/e2e_fold_${v##*=}.json" 2>&1 | grep "^| [mk]\|WARN\|disabled"
  done
fi
if has v23; then
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/test_decode_kernels.py tests/gpu/test_engine_gpu.py \
    tests/gpu/test_fast_ops.py -k "sample_kernels or logprobs or do_not_synchronise or select_topk or draw_kernels" \
    >"$OUT_DIR/tests_v23.log" 2>&1
  echo "v23 tests: exit $? ($(tail -1 "$OUT_DIR/tests_v23.log"))"
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets kimi-linear-48b --batches 1 --steps 24 --wall-timing \
    --temperature 0.8 --top-p 0.95 --logprobs 5 --kernel-variants default,no_logprobs,default \
    --out "$OUT_DIR/e2e_v23_logprobs.json" 2>&1 | grep "^| [mk]\|WARN\|disabled"
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets kimi-linear-48b --batches 1 --steps 24 --wall-timing \
    --kernel-variants default,select_max,default,select_max --out "$OUT_DIR/e2e_v23_topk.json" 2>&1 \
    | grep "^| [mk]\|WARN\|disabled"
fi
if has v24; then
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_fast_ops.py tests/gpu/test_engine_gpu.py \
    -k "moe_small or fold_norms or fast_decode_bf16" >"$OUT_DIR/tests_v24.log" 2>&1
  echo "v24 tests: exit $? ($(tail -1 "$OUT_DIR/tests_v24.log"))"
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets kimi-linear-48b --batches 1 --steps 24 --wall-timing \
    --kernel-variants default,up_16x128,up_8x256,default --out "$OUT_DIR/e2e_v24_tiles.json" 2>&1 \
    | grep "^| [mk]\|WARN\|disabled"
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets kimi-linear-48b --batches 2,4 --steps 24 --wall-timing \
    --kernel-variants default,fuse_select_4,default,fuse_select_4 --out "$OUT_DIR/e2e_v24_fuse4.json" 2>&1 \
    | grep "^| [mk]\|WARN\|disabled"
  timeout "$T_E2E" python3 bench/bench_e2e_decode.py --presets medium,kimi-linear-48b --batches 1,16,64 --wall-timing \
    --out "$OUT_DIR/e2e_v24.json" 2>&1 | grep "^| \|WARN\|disabled"
fi
if has prefill; then
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_engine_gpu.py -k batch_prefill \
    >"$OUT_DIR/tests_prefill.log" 2>&1
  echo "batch_prefill GPU tests: exit $? ($(tail -1 "$OUT_DIR/tests_prefill.log"))"
  # the defaults (packed prefill, 4,096 tokens per step), then with snapshots every 64 tokens taken inside the
  # packed pieces (their cost in the KDA layers), then one prompt per forward, 512 tokens per step
  for v in "default::" "snap64:--prefix-interval 64" "one:--no-batch-prefill --max-prefill-tokens 512"; do
    name=${v%%:*} args=${v#*:}
    timeout "$T_E2E" python3 bench/diag_prefill.py --prompts 8 --prompt-len 512 --preset medium --no-profile \
      ${args#:} --out "$OUT_DIR/diag_prefill_$name.json" 2>&1 | grep "^| \|^cold\|^warm\|forward\|rror"
  done
fi
if has prefill_snap; then
  # snapshots inside packed pieces: 8 x 512 tokens with interval 64 (profiled), then 4 x 2,048 tokens with the
  # default interval (512: 3 snapshots inside each prompt, 2 prompts per forward) and with none inside (4096)
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_fast_ops.py tests/gpu/test_engine_gpu.py \
    -k "batch_prefill or recurrent_inference or prefix_cache_outputs" >"$OUT_DIR/tests_prefill.log" 2>&1
  echo "batch_prefill GPU tests: exit $? ($(tail -1 "$OUT_DIR/tests_prefill.log"))"
  timeout "$T_E2E" python3 bench/diag_prefill.py --prompts 8 --prompt-len 512 --preset medium --prefix-interval 64 \
    ${SNAP_PROFILE:---no-profile} --out "$OUT_DIR/diag_prefill_snap64.json" >"$OUT_DIR/diag_prefill_snap64.log" 2>&1
  grep "^| \|^cold\|^warm\|forward\|rror" "$OUT_DIR/diag_prefill_snap64.log"
  for v in "2k:" "2k_nosnap:--prefix-interval 4096"; do
    timeout "$T_E2E" python3 bench/diag_prefill.py --prompts 4 --prompt-len 2048 --preset medium --no-profile \
      ${v#*:} --out "$OUT_DIR/diag_prefill_${v%%:*}.json" 2>&1 | grep "^| \|^cold\|^warm\|forward\|rror"
  done
fi
if has snap_mode; then
  # the two ways packed pieces take snapshots inside (OPENK3_KDA_SNAP_MODE): the GPU test with "rounds" (the
  # default is "prefix"), then
  # 8 x 512 tokens at interval 64 and 4 x 2,048 at the default interval, each in rounds and over the prefixes
  OPENK3_KDA_SNAP_MODE=rounds timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_engine_gpu.py \
    -k "batch_prefill and not no-prefix" >"$OUT_DIR/tests_snap_mode.log" 2>&1
  echo "batch_prefill GPU test, rounds: exit $? ($(tail -1 "$OUT_DIR/tests_snap_mode.log"))"
  for m in rounds prefix; do
    echo "== snapshots: $m"
    OPENK3_KDA_SNAP_MODE=$m timeout "$T_E2E" python3 bench/diag_prefill.py --prompts 8 --prompt-len 512 \
      --preset medium --prefix-interval 64 --no-profile --out "$OUT_DIR/diag_snap64_$m.json" 2>&1 | grep "^| <\|^warm"
    OPENK3_KDA_SNAP_MODE=$m timeout "$T_E2E" python3 bench/diag_prefill.py --prompts 4 --prompt-len 2048 \
      --preset medium --no-profile --out "$OUT_DIR/diag_2k_$m.json" 2>&1 | grep "^| <\|^warm"
  done
fi
if has prefill_host; then
  # the prefill forward's host work: the batch_prefill GPU tests, then bench/diag_prefill.py at 2 x 2,048 tokens
  # (snapshots inside, default interval) and 8 x 512 (none inside) with this tree and, when OLD_TREE names another
  # tree (e.g. `git archive HEAD~3 src bench | tar -x -C .scratch/old`), with that one in the same call; then
  # where this tree's prefill forwards synchronise with the host (--sync-report)
  if [[ ${SKIP_TESTS:-0} != 1 ]]; then
    timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_engine_gpu.py tests/gpu/test_fast_norm_conv.py \
      -k "${PH_K:-batch_prefill or rms_norm or chunk_graphs or prefill_graphs or row_graphs or ffn_graphs}" >"$OUT_DIR/tests_prefill_host.log" 2>&1
    echo "prefill_host GPU tests: exit $? ($(tail -1 "$OUT_DIR/tests_prefill_host.log"))"
  fi
  declare -A SHAPE=([2k]="--prompts 2 --prompt-len 2048" [8x512]="--prompts 8 --prompt-len 512"
    [64x64]="--prompts 64 --prompt-len 64")
  ph_arm() {  # an arm of the comparison: `top` (its tree) and `extra` (its engine flags)
    top=$ROOT
    extra=""
    [[ $1 == old ]] && top=$OLD_TREE
    [[ $1 == base ]] && extra=$PH_BASE_ARGS
    return 0
  }
  for name in ${PH_SHAPES:-2k 8x512}; do
    shape="$name:${SHAPE[$name]}"
    for tree in ${OLD_TREE:+old} ${PH_BASE_ARGS:+base} new; do
      ph_arm "$tree"
      echo "== $tree tree $extra, ${shape%%:*}"
      PYTHONPATH=$top/src:${PYTHONPATH:-} timeout "$T_E2E" python3 "$top/bench/diag_prefill.py" --preset medium \
        --warm-runs "${PH_RUNS:-5}" --no-profile ${shape#*:} $extra \
        --out "$OUT_DIR/diag_host_${tree}_${shape%%:*}.json" 2>&1 | grep "^warm forwards\|forward,\|reserved by\|rror"
    done
  done
  if [[ ${PH_SERVE:-0} == 1 ]]; then  # the serving burst, with PH_BASE_ARGS and without
    for tree in ${PH_BASE_ARGS:+base} new; do
      ph_arm "$tree"
      echo "== serve burst, this tree $extra"
      timeout "${T_SERVE:-240}" python3 bench/bench_serve.py --requests 64 --prompt-len 512 --max-tokens 128 \
        --preset medium $extra --out "$OUT_DIR/serve_burst_${tree}.json" 2>&1 | grep "^| \|throughput\|serving\|rror"
    done
  fi
  for tree in $([[ ${PH_PROFILE:-1} == 1 ]] && echo ${OLD_TREE:+old} new); do  # host time, profiled, 8 x 512
    ph_arm "$tree"
    PYTHONPATH=$top/src:${PYTHONPATH:-} timeout "$T_E2E" python3 "$top/bench/diag_prefill.py" --preset medium \
      --prompts 8 --prompt-len 512 --out "$OUT_DIR/diag_host_${tree}_prof.json" >"$OUT_DIR/diag_host_${tree}_prof.log" 2>&1
    echo "== $tree tree, profiled 8 x 512: $(grep -m2 "^Self" "$OUT_DIR/diag_host_${tree}_prof.log" | tr '\n' ' ')"
  done
  if [[ ${PH_PROFILE:-1} == 1 ]]; then
    timeout "$T_E2E" python3 bench/diag_prefill.py --preset medium --no-profile --prompts 2 --prompt-len 2048 \
      --sync-report --out "$OUT_DIR/diag_host_sync.json" 2>&1 | sed -n '/host synchronisations/,/^wrote/p'
  fi
fi
if has prefill_serve; then
  # the defaults (packed prefill, 4,096 tokens per step), then one prompt per prefill forward, 512 per step
  timeout "${T_SERVE:-240}" python3 bench/bench_serve.py --requests 64 --prompt-len 512 --max-tokens 128 --preset medium \
    --out "$OUT_DIR/serve_burst.json" 2>&1 | grep "^| \|throughput\|serving\|rror"
  timeout "${T_SERVE:-240}" python3 bench/bench_serve.py --requests 64 --prompt-len 512 --max-tokens 128 --preset medium \
    --no-batch-prefill --max-prefill-tokens 512 --out "$OUT_DIR/serve_burst_one.json" 2>&1 \
    | grep "^| \|throughput\|serving\|rror"
fi
if has serve; then
  # a random-weight model of SERVE_PRESET (default medium) behind the server
  SP="--preset ${SERVE_PRESET:-medium}"
  timeout "${T_SERVE:-240}" python3 bench/bench_serve.py --requests 64 --prompt-len 512 --max-tokens 128 $SP \
    --out "$OUT_DIR/serve_burst.json" 2>&1 | grep "^| \|throughput\|serving\|rror"
  timeout "${T_SERVE:-240}" python3 bench/bench_serve.py --requests 64 --prompt-len 512 --max-tokens 128 --rate 16 $SP \
    --out "$OUT_DIR/serve_rate16.json" 2>&1 | grep "^| \|throughput\|serving\|rror"
fi
if has v27; then
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/test_decode_kernels.py -m gpu \
    -k "test_mla_decode_gpu and not table" >"$OUT_DIR/tests_v27.log" 2>&1
  echo "v27 tests: exit $? ($(tail -1 "$OUT_DIR/tests_v27.log"))"
  timeout "$T_DECODE" python3 bench/diag_mla_peer.py --shapes 64x16x8192,64x96x8192,16x96x16384,256x16x4096,1x32x1040 \
    --out "$OUT_DIR/peer_ragged.json" 2>&1 | grep "^| \|copy\|rror"
  timeout "$T_DECODE" python3 bench/diag_mla_peer.py --uniform --shapes 64x16x8192,64x96x8192 \
    --out "$OUT_DIR/peer_uniform.json" 2>&1 | grep "^| \|copy\|rror"
fi
if has v27e2e; then
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets kimi-linear-48b --batches 64 --context 8192 --ragged 0.5 \
    --wall-timing --kernel-variants mla_per_row,mla_balance --out "$OUT_DIR/e2e_v27_ragged.json" \
    2>&1 | grep "^| [mk]\|WARN\|disabled\|rror"
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets kimi-linear-48b --batches 1,16,64 --context 4096 \
    --wall-timing --kernel-variants mla_per_row,mla_balance --out "$OUT_DIR/e2e_v27.json" \
    2>&1 | grep "^| [mk]\|WARN\|disabled\|rror"
fi
# gluon_round TAG VARIANTS SHAPES UNIFORM_SHAPES: the Gluon kernel's GPU tests in their own process (a wrong
# barrier phase would hang, not fail), then bench/diag_mla_peer.py with VARIANTS at SHAPES (ragged) and
# UNIFORM_SHAPES (uniform) -> peer_TAG.json, peer_TAG_uniform.json. The timing runs the Gluon variants unless a test
# failed (a test run that only ran out of time still lets them run: they have their own time box)
gluon_round() {
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/test_decode_kernels.py -m gpu -k "gluon" \
    >"$OUT_DIR/tests_gluon.log" 2>&1
  echo "gluon tests: exit $? ($(tail -1 "$OUT_DIR/tests_gluon.log"))"
  local v=$2
  if grep -m5 "Error\|assert\|FAILED" "$OUT_DIR/tests_gluon.log"; then v=ours; fi
  timeout "$T_DECODE" python3 bench/diag_mla_peer.py --variants "$v" --shapes "$3" --out "$OUT_DIR/peer_$1.json" \
    2>&1 | grep "^| \|copy\|matmul\|rror\|gluon\|flashinfer"
  timeout "$T_DECODE" python3 bench/diag_mla_peer.py --variants "$v" --uniform --shapes "$4" \
    --out "$OUT_DIR/peer_$1_uniform.json" 2>&1 | grep "^| \|rror"
}
if has gluon; then
  gluon_round gluon ours,gluon,gluon_split,gluon_pp32 \
    64x96x8192,16x96x16384,256x96x4096,4x96x16384,2x96x4096,64x64x8192,64x32x8192,8x32x4096,1x32x1040 64x96x8192
fi
if has gluon_e2e; then
  # the 48B shape needs the H200 (its bf16 weights do not fit an 80 GB card)
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_engine_gpu.py -k gluon \
    >"$OUT_DIR/tests_gluon_e2e.log" 2>&1
  echo "gluon engine tests: exit $? ($(tail -1 "$OUT_DIR/tests_gluon_e2e.log"))"
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets kimi-linear-48b --batches 16,64 --context 4096 \
    --wall-timing --kernel-variants mla_triton,mla_gluon,mla_triton,mla_gluon --out "$OUT_DIR/e2e_gluon.json" \
    2>&1 | grep "^| [mk]\|WARN\|disabled\|rror"
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets kimi-linear-48b --batches 64 --context 8192 --ragged 0.5 \
    --wall-timing --kernel-variants mla_triton,mla_gluon_split,mla_gluon --out "$OUT_DIR/e2e_gluon_ragged.json" \
    2>&1 | grep "^| [mk]\|WARN\|disabled\|rror"
fi
if has v31; then
  # 16, 32 and 96 heads, the persistent walk below its default row threshold too (gluon_persist)
  gluon_round v31 ours,gluon,gluon_split,gluon_persist \
    64x16x8192,256x16x4096,16x16x16384,8x16x4096,64x32x8192,8x32x4096,64x96x8192,16x96x16384,2x96x4096 \
    64x16x8192,64x32x8192,64x96x8192
fi
if has tiled; then
  # the expert-tiled routed experts of decode batches (openk3.fast.moe_tiled): GPU tests, the kernel diag against the
  # grouped GEMMs and the per-pair kernels, and medium at batch 64 with and without them
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_fast_ops.py tests/gpu/test_engine_gpu.py \
    -k "moe_tiled_gpu or moe_experts_no_grad or grouped_moe_inference_layout" >"$OUT_DIR/tests_tiled.log" 2>&1
  echo "tiled tests: exit $? ($(tail -1 "$OUT_DIR/tests_tiled.log"))"
  timeout "$T_DECODE" python3 bench/diag_moe_tiled.py --sweep --out "$OUT_DIR/diag_moe_tiled.json" 2>&1 | grep "^| \|copy"
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets medium --batches 64 --wall-timing \
    --kernel-variants moe_grouped,moe_tiled,moe_grouped,moe_tiled --out "$OUT_DIR/e2e_tiled_medium.json" 2>&1 \
    | grep "^| [mk]\|WARN\|disabled\|rror"
fi
if has tiled_bm; then
  # taller row steps for the expert-tiled kernels past 8 pairs per expert (moe_tiled.rows_per_step): the GPU tests,
  # the kernel diag at 64-256 tokens with fixed 16 / 32 / 64-row steps beside the auto rule, and medium at batch
  # 128 / 256 with the grouped GEMMs and with the tiled kernels up to 64 pairs per expert
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_fast_ops.py -k "moe_tiled_gpu" \
    >"$OUT_DIR/tests_tiled_bm.log" 2>&1
  echo "tiled tests: exit $? ($(tail -1 "$OUT_DIR/tests_tiled_bm.log"))"
  timeout "$T_DECODE" python3 bench/diag_moe_tiled.py --tokens 64,128,256 --per-pair-max 0 --bms 16,32,64,64w8 \
    --out "$OUT_DIR/diag_moe_tiled_bm.json" 2>&1 | grep "^| \|copy"
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets medium --batches 128,256 --wall-timing \
    --kernel-variants moe_grouped,moe_tiled_64,moe_grouped,moe_tiled_64 --out "$OUT_DIR/e2e_tiled_bm.json" 2>&1 \
    | grep "^| [mk]\|WARN\|disabled\|rror"
fi
if has tiled_e2e; then
  # the 48B shape (H200) at batch 16 / 64, ragged 4k-8k prompts, with and without the expert-tiled kernels
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets kimi-linear-48b --batches 64 --context 8192 --ragged 0.5 \
    --wall-timing --kernel-variants moe_grouped,moe_tiled,moe_grouped,moe_tiled --out "$OUT_DIR/e2e_tiled_48b.json" 2>&1 \
    | grep "^| [mk]\|WARN\|disabled\|rror"
fi
if has b1; then
  # batch 1 of both presets, wall timing at context 1,040 (the whole 48B shape needs the H200; on a card under 100 GB
  # its first B1_LAYERS=16 layers, 12 KDA + 4 MLA, -> e2e_b1_48b_layers.json)
  timeout "$T_E2E" python3 bench/bench_e2e_decode.py --presets medium,kimi-linear-48b --batches 1 --context 1040 \
    --wall-timing --out "$OUT_DIR/e2e_b1.json" 2>&1 | grep "^| [mk]\|WARN\|disabled\|rror"
  if [[ $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1) -le 100000 ]]; then
    timeout "$T_E2E" python3 bench/bench_e2e_decode.py --presets kimi-linear-48b --layers "${B1_LAYERS:-16}" \
      --batches 1 --context 1040 --wall-timing --out "$OUT_DIR/e2e_b1_48b_layers.json" 2>&1 \
      | grep "^| [mk]\|WARN\|disabled\|rror"
  fi
fi
if has mla_peer; then
  timeout "$T_TESTS" python3 -m pytest -q -rf -p no:warnings tests/gpu/test_mla_peer_gpu.py >"$OUT_DIR/tests_mla_peer.log" 2>&1
  echo "mla_peer tests: exit $? ($(tail -1 "$OUT_DIR/tests_mla_peer.log"))"
  timeout "$T_DECODE" python3 bench/diag_mla_peer.py --out "$OUT_DIR/diag_mla_peer.json" 2>&1 | grep "^| \|flashinfer\|copy"
  timeout "$T_AB" python3 bench/bench_e2e_decode.py --presets kimi-linear-48b --batches 1,16,64 --context 4096 \
    --wall-timing --mla-backends auto,flashinfer --out "$OUT_DIR/e2e_mla_peer.json" 2>&1 | grep "^| \|WARN\|disabled\|rror"
fi
if has attnres_ab; then
  BENCH_MODEL_KERNEL_AB=5 timeout "$T_TRAIN" python3 bench/run_all.py --sections ceil,model --out "$OUT_DIR" \
    2>&1 | tail -25
fi
if has train; then
  timeout "$T_TRAIN" python3 bench/run_all.py --out "$OUT_DIR" 2>&1 | tail -60
fi

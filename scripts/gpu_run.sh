#!/usr/bin/env bash
# The GPU check and the GPU benchmark, as one call on a GPU host without network access (docs/gpu.md).
#
#   first, with network:  the wheels of pdserve's serving dependencies into .whl/ (docs/gpu.md has the command)
#   on the GPU host:      bash scripts/gpu_run.sh, with .whl/ beside it, within ~9 minutes
#
# 1. installs the wheels into /tmp/site (no network needed) and prints the versions and GPUs;
# 2. builds the benchmark's checkpoint (qwen3-0.6b, ~1.2 GB) in the background meanwhile;
# 3. scripts/gpu_check.py (small model: fp32 token-exact, bf16 logit tolerance, 200 sampled requests,
#    zmq and cuda_ipc), within GPU_CHECK_S seconds;
# 4. python -m bench.gpu with the time left of GPU_RUN_TOTAL_S (the whole script: ~8 minutes).
# Writes to $OUT (at most 8 files come back): gpu_run.log, gpu_check.json, gpu.json, gpu.md, gpu.png,
# logs.tar.gz (every stack's log, the checkpoint build). Exit code: 0 when the check passed and the
# benchmark ran every system.
#
# A smoke test of this script on a CPU (the python3 on PATH must have the project's packages):
#   GPU_RUN_SKIP_INSTALL=1 GPU_BENCH_MODEL=tiny GPU_CHECK_ARGS="--device cpu --model tiny" \
#   GPU_BENCH_ARGS="--device cpu --model tiny --requests 16 --concurrency 8" OUT=/tmp/o bash scripts/gpu_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
TOTAL_S=${GPU_RUN_TOTAL_S:-470}
CHECK_S=${GPU_CHECK_S:-170}
BENCH_MODEL=${GPU_BENCH_MODEL:-qwen3-0.6b}
read -r -a CHECK_ARGS <<< "${GPU_CHECK_ARGS:-}"
read -r -a BENCH_ARGS <<< "${GPU_BENCH_ARGS:-}"
PACK_S=20    # kept back at the end to copy and pack the results
KILL_S=30    # after a timeout's SIGTERM, time for the stacks to stop before SIGKILL
OUT=${OUT:-/tmp/gpu_run_out}
WORK=/tmp/gpu_run
mkdir -p "$OUT" && rm -rf "$WORK" && mkdir -p "$WORK/logs"
elapsed() { echo $(( $(date +%s) - T0 )); }

main() {
    if [[ -z "${GPU_RUN_SKIP_INSTALL:-}" ]]; then
        if ! ls .whl/*.whl > /dev/null 2>&1; then
            echo "gpu_run: no wheels in .whl/: download them as docs/gpu.md says"
            exit 3
        fi
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || { echo "gpu_run: installing the wheels failed"; exit 3; }
    fi
    export PYTHONPATH=/tmp/site:$PWD PDSERVE_CACHE=${PDSERVE_CACHE:-/tmp/pdc} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    git rev-parse --short HEAD 2> /dev/null | sed 's/^/commit /'
    nvidia-smi -L 2> /dev/null || echo "no nvidia-smi"
    python3 -c "import torch, transformers, triton, zmq, fastapi; print('torch', torch.__version__, 'cuda', \
    torch.version.cuda, '| transformers', transformers.__version__, '| triton', triton.__version__, '| gpus', \
    torch.cuda.device_count())"

    echo "== [$(elapsed) s] building $BENCH_MODEL in the background"
    (
        t=$(date +%s)
        python3 -c "from pdserve.engine.checkpoint import resolve_model; print(resolve_model('$BENCH_MODEL'))"
        echo "rc $? after $(( $(date +%s) - t )) s"
    ) > "$WORK/logs/checkpoint.log" 2>&1 &
    BUILD=$!

    echo "== [$(elapsed) s] gpu_check (at most $CHECK_S s)"
    timeout -k $KILL_S $CHECK_S python3 scripts/gpu_check.py "${CHECK_ARGS[@]}" --out "$OUT/gpu_check.json" \
        --log-dir "$WORK/logs" > "$WORK/logs/gpu_check.out" 2>&1
    CHECK_RC=$?
    grep -E '^(fp32|bf16)-' "$WORK/logs/gpu_check.out" | cut -c1-600
    tail -n 3 "$WORK/logs/gpu_check.out"
    echo "gpu_check: exit code $CHECK_RC (124: timed out) after $(elapsed) s"

    wait $BUILD
    cat "$WORK/logs/checkpoint.log"

    LEFT=$(( TOTAL_S - $(elapsed) - PACK_S ))
    echo "== [$(elapsed) s] bench.gpu (budget $(( LEFT - KILL_S )) s)"
    BENCH_RC=124
    if (( LEFT - KILL_S > 60 )); then
        timeout -k $KILL_S $LEFT python3 -m bench.gpu --model "$BENCH_MODEL" "${BENCH_ARGS[@]}" \
            --budget-s $(( LEFT - KILL_S )) --out-dir "$WORK/bench" --no-progress > "$WORK/logs/bench_gpu.out" 2>&1
        BENCH_RC=$?
        grep -v -E 'Loading weights|it/s\]' "$WORK/logs/bench_gpu.out" | tail -n 60
    else
        echo "bench.gpu: not started, too little time left"
    fi
    echo "bench.gpu: exit code $BENCH_RC (124: timed out)"

    cp "$WORK"/bench/gpu.json "$WORK"/bench/gpu.md "$WORK"/bench/gpu.png "$OUT"/ 2> /dev/null
    cp "$WORK"/bench/logs/* "$WORK/logs/" 2> /dev/null
    tar czf "$OUT/logs.tar.gz" -C "$WORK" logs
    echo "== [$(elapsed) s] done: gpu_check $CHECK_RC, bench.gpu $BENCH_RC; $OUT: $(ls "$OUT" | tr '\n' ' ')"
    (( CHECK_RC == 0 && BENCH_RC == 0 ))
}

main 2>&1 | tee "$OUT/gpu_run.log"
exit "${PIPESTATUS[0]}"

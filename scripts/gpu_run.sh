#!/usr/bin/env bash
# The GPU check and the GPU benchmark, as one command on a GPU host without network access (docs/gpu.md),
# or in CPU mode anywhere.
#
#   where PyPI is reachable, once:  python scripts/deps.py fetch --python-version 3.12   (wheels into .whl/)
#   on the GPU host:                bash scripts/gpu_run.sh           (carry .whl there; no index needed)
#   CPU mode (tiny model, a few requests, every stage; the tests run it):  bash scripts/gpu_run.sh --cpu
#
# 1. installs from .whl/ (WHEELS) the distributions the host lacks, into /tmp/site, with no index;
# 2. imports every dependency pyproject.toml lists (runtime, gpu, bench): a missing or too old
#    one stops the run here, within seconds, naming it;
# 3. a smoke stage of at most GPU_SMOKE_S (60; 300 in CPU mode) seconds: one stack (fp32 colocated), a
#    few requests checked token for token against transformers; if it fails, nothing longer runs;
# 4. builds the benchmark's checkpoint (qwen3-0.6b, ~1.2 GB) in the background meanwhile, then
#    scripts/gpu_check.py (every stack: fp32 token-exact, bf16 logit tolerance, sampled requests),
#    within GPU_CHECK_S seconds;
# 5. python -m bench.gpu with the time left of GPU_RUN_TOTAL_S (the whole script: 240 s on a GPU, so that
#    a run and the machine's start fit in 5 minutes).
# Writes to $OUT (at most 8 files): gpu_run.log, gpu_check.json, gpu.json, gpu.md, gpu.png, logs.tar.gz.
# Exit code: 0 when every stage passed; 3 when the install or the dependency check failed; 4 when the
# smoke stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
CPU_MODE=0
[[ "${1:-}" == "--cpu" ]] && CPU_MODE=1
if (( CPU_MODE )); then  # a shared CPU is slow and noisy: generous limits (the GPU's are the ones that matter)
    DEFAULT_TOTAL=1200 DEFAULT_CHECK=400 DEFAULT_SMOKE=300 DEFAULT_MODEL=tiny SMOKE_MODEL=tiny DEVICE=cpu
    DEFAULT_CHECK_ARGS="--requests 2 --sampled 2 --max-tokens 4 --stacks fp32-shm"
    DEFAULT_BENCH_ARGS="--requests 6 --concurrency 3 --systems colocated --large-run 8 4"
else
    DEFAULT_TOTAL=240 DEFAULT_CHECK=90 DEFAULT_SMOKE=60 DEFAULT_MODEL=qwen3-0.6b SMOKE_MODEL=small DEVICE=cuda:0
    DEFAULT_CHECK_ARGS="" DEFAULT_BENCH_ARGS=""
fi
TOTAL_S=${GPU_RUN_TOTAL_S:-$DEFAULT_TOTAL}
CHECK_S=${GPU_CHECK_S:-$DEFAULT_CHECK}
SMOKE_S=${GPU_SMOKE_S:-$DEFAULT_SMOKE}
BENCH_MODEL=${GPU_BENCH_MODEL:-$DEFAULT_MODEL}
WHEELS=${WHEELS:-.whl}
read -r -a CHECK_ARGS <<< "${GPU_CHECK_ARGS:-$DEFAULT_CHECK_ARGS}"
read -r -a BENCH_ARGS <<< "${GPU_BENCH_ARGS:-$DEFAULT_BENCH_ARGS}"
PACK_S=20    # kept back at the end to copy and pack the results
KILL_S=30    # after a timeout's SIGTERM, time for the stacks to stop before SIGKILL
OUT=${OUT:-/tmp/gpu_run_out}
WORK=${GPU_RUN_WORK:-/tmp/gpu_run}
SITE=${GPU_RUN_SITE:-/tmp/site}
mkdir -p "$OUT" && rm -rf "$WORK" && mkdir -p "$WORK/logs"
elapsed() { echo $(( $(date +%s) - T0 )); }

install_and_check() {
    if [[ -z "${GPU_RUN_SKIP_INSTALL:-}" ]]; then
        python3 scripts/deps.py install --wheels "$WHEELS" --target "$SITE" || {
            echo "gpu_run: installing the wheels failed"; return 3; }
    fi
    export PYTHONPATH=$SITE:$PWD PDSERVE_CACHE=${PDSERVE_CACHE:-/tmp/pdc} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    python3 scripts/deps.py check --extras gpu bench || {
        echo "gpu_run: a dependency is missing (above); nothing was started"; return 3; }
    git rev-parse --short HEAD 2> /dev/null | sed 's/^/commit /'
    nvidia-smi -L 2> /dev/null || echo "no nvidia-smi"
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'| transformers', transformers.__version__, '| triton', triton.__version__, '| gpus', torch.cuda.device_count())"
}

smoke() {
    echo "== [$(elapsed) s] smoke: one stack, a few requests (at most $SMOKE_S s)"
    timeout -k $KILL_S "$SMOKE_S" python3 scripts/gpu_check.py --device "$DEVICE" --model "$SMOKE_MODEL" --requests 3 \
        --sampled 4 --max-tokens 8 --stacks fp32-colocated --log-dir "$WORK/logs/smoke" \
        > "$WORK/logs/smoke.out" 2>&1
    local rc=$?
    grep -E '^fp32-' "$WORK/logs/smoke.out" | cut -c1-400
    echo "smoke: exit code $rc (124: timed out) after $(elapsed) s"
    (( rc == 0 )) || { tail -n 20 "$WORK/logs/smoke.out"; return 4; }
}

main() {
    install_and_check || return $?
    smoke || return $?

    echo "== [$(elapsed) s] building $BENCH_MODEL in the background"
    (
        t=$(date +%s)
        python3 -c "from pdserve.checkpoint import resolve_model; print(resolve_model('$BENCH_MODEL'))"
        echo "rc $? after $(( $(date +%s) - t )) s"
    ) > "$WORK/logs/checkpoint.log" 2>&1 &
    BUILD=$!

    echo "== [$(elapsed) s] gpu_check (at most $CHECK_S s)"
    timeout -k $KILL_S "$CHECK_S" python3 scripts/gpu_check.py --device "$DEVICE" "${CHECK_ARGS[@]}" \
        --out "$OUT/gpu_check.json" --log-dir "$WORK/logs" > "$WORK/logs/gpu_check.out" 2>&1
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
        timeout -k $KILL_S $LEFT python3 -m bench.gpu --model "$BENCH_MODEL" --device "$DEVICE" "${BENCH_ARGS[@]}" \
            --budget-s $(( LEFT - KILL_S )) --out-dir "$WORK/bench" --no-progress > "$WORK/logs/bench_gpu.out" 2>&1
        BENCH_RC=$?
        grep -v -E 'Loading weights|it/s\]' "$WORK/logs/bench_gpu.out" | tail -n 60
    else
        echo "bench.gpu: not started, too little time left"
    fi
    echo "bench.gpu: exit code $BENCH_RC (124: timed out)"

    cp "$WORK"/bench/gpu.json "$WORK"/bench/gpu.md "$WORK"/bench/gpu.png "$OUT"/ 2> /dev/null
    cp -r "$WORK"/bench/logs/. "$WORK/logs/" 2> /dev/null
    echo "== [$(elapsed) s] done: gpu_check $CHECK_RC, bench.gpu $BENCH_RC; $OUT: $(ls "$OUT" | tr '\n' ' ')"
    (( CHECK_RC == 0 && BENCH_RC == 0 ))
}

main 2>&1 | tee "$OUT/gpu_run.log"
RC=${PIPESTATUS[0]}
tar czf "$OUT/logs.tar.gz" -C "$WORK" logs 2> /dev/null
exit "$RC"

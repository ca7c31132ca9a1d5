#!/usr/bin/env bash
# The GPU check and the GPU benchmark, as one command on a GPU host without network access (docs/gpu.md),
# or in CPU mode anywhere.
#
#   where PyPI is reachable, once:  python scripts/deps.py fetch --python-version 3.12   (wheels into .whl/)
#   on the GPU host:                bash scripts/gpu_run.sh           (carry .whl there; no index needed)
#   CPU mode (tiny model, a few requests, every stage; the tests run it):  bash scripts/gpu_run.sh --cpu
#
# 0. starts writing the built-in checkpoints the stages load (`small`, `qwen3-0.6b`; `tiny` in CPU mode), in the
#    background: it needs only torch and transformers, which the host holds, so it runs beside steps 1 and 2, and
#    the kit's checkpoint stage waits for it (pdserve.checkpoint's lock);
# 1. installs from .whl/ (WHEELS) the distributions the host lacks, into /tmp/site, with no index;
# 2. imports every dependency pyproject.toml lists (runtime, gpu, bench): a missing or too old
#    one stops the run here, within seconds, naming it;
# 3. scripts/kit.py: the stages (smoke, gpu_check's stacks, bench.gpu's systems, and those this tree holds of the
#    start-up, profile, fault, KV-copy, attention and cost stages) in order of value, each under its own budget, within
#    GPU_KIT_WINDOW_S seconds (300 on a GPU, steps 1 and 2 included: the kit gets what is left; 1500 in CPU mode,
#    where every stage runs on tiny sizes, one after another); on a GPU the checks run at once, then the
#    measurements one at a time, then the stages the window left out that fit the time left;
#    GPU_KIT_STAGES names the stages to run instead (a plan past the window is refused in one line).
# Writes to $OUT (4 files): gpu_run.log, kit.md, kit.json (every stage: time, result), logs.tar.gz (each stage's
# output and JSON). Exit code: 0 when every planned stage passed; 1 when one did not; 2 when the plan was refused;
# 3 when the install or the dependency check failed; 124 when the kit ran GPU_KIT_OVERRUN_S (90) past its window
# and was stopped (its report says how far it got; 137 if it had not stopped 30 s later). A lent call's time
# limit: the window, that overrun, 30 s for the kit to stop, and the tarball: 300 + 90 + 30 + a few seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
CPU_MODE=0
[[ "${1:-}" == "--cpu" ]] && CPU_MODE=1
DEVICE=cuda:0
(( CPU_MODE )) && DEVICE=cpu
read -r -a STAGES <<< "${GPU_KIT_STAGES:-}"
WHEELS=${WHEELS:-.whl}
OUT=${OUT:-/tmp/gpu_run_out}
WORK=${GPU_RUN_WORK:-/tmp/gpu_run}
SITE=${GPU_RUN_SITE:-/tmp/site}
mkdir -p "$OUT" && rm -rf "$WORK" && mkdir -p "$WORK/logs"
export PDSERVE_CACHE=${PDSERVE_CACHE:-/tmp/pdc}
MODELS=(small qwen3-0.6b)
(( CPU_MODE )) && MODELS=(tiny)
PYTHONPATH=$PWD python3 -c "import sys; from pdserve.checkpoint import resolve_model; [resolve_model(m) for m in \
sys.argv[1:]]" "${MODELS[@]}" > "$WORK/logs/checkpoints.out" 2>&1 &
BUILD_PID=$!

install_and_check() {
    if [[ -z "${GPU_RUN_SKIP_INSTALL:-}" ]]; then
        python3 scripts/deps.py install --wheels "$WHEELS" --target "$SITE" || {
            echo "gpu_run: installing the wheels failed"; return 3; }
    fi
    export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    python3 scripts/deps.py check --extras gpu bench || {
        echo "gpu_run: a dependency is missing (above); nothing was started"; return 3; }
    git rev-parse --short HEAD 2> /dev/null | sed 's/^/commit /'
    nvidia-smi -L 2> /dev/null || echo "no nvidia-smi"
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'| transformers', transformers.__version__, '| triton', triton.__version__, '| gpus', torch.cuda.device_count())"
}

main() {
    install_and_check || return $?
    local args=(--device "$DEVICE" --out "$OUT" --work "$WORK")
    # on a GPU the window (GPU_KIT_WINDOW_S, 300 s) holds the install too: the kit gets what is left of it
    local window=${GPU_KIT_WINDOW_S:-}
    (( ! CPU_MODE )) && window=$(( ${window:-300} - ($(date +%s) - T0) ))
    [[ -n "$window" ]] && args+=(--window "$window")
    (( ${#STAGES[@]} )) && args+=(--stages "${STAGES[@]}")
    # on a GPU the kit is stopped (SIGTERM: it stops its stages and stacks; its report holds the stages that ended)
    # once it runs GPU_KIT_OVERRUN_S (90) past its window, so that the report and the tarball are there in bounded time
    local limit=() hard=$(( ${window:-0} > 0 ? ${window:-0} : 0 ))
    (( ! CPU_MODE )) && limit=(timeout --signal=TERM --kill-after=30 $(( hard + ${GPU_KIT_OVERRUN_S:-90} )))
    "${limit[@]}" python3 scripts/kit.py "${args[@]}"
    local rc=$?
    cat "$OUT/kit.md" 2> /dev/null
    echo "gpu_run: kit exit code $rc after $(( $(date +%s) - T0 )) s"
    return $rc
}

main 2>&1 | tee "$OUT/gpu_run.log"
RC=${PIPESTATUS[0]}
kill "$BUILD_PID" 2> /dev/null  # done by now, unless the run ended before the kit
wait "$BUILD_PID" 2> /dev/null
tar czf "$OUT/logs.tar.gz" -C "$WORK" logs stages 2> /dev/null
exit "$RC"

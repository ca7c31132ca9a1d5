#!/bin/bash
# round (f): as round (e), with a second calibration run (Poisson, 3 req/s, seed 3) beside the burst one
# usage: bash round_e.sh OUT_DIR   (from the repository root, with the venv's python as PY)
set -u
D=${1:?out dir}
PY=${PY:-.venv/bin/python}
mkdir -p $D
log() { echo "$(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >> $D/log.txt; }
log waiting for load below 1
until awk '{exit !($1<1.0)}' /proc/loadavg; do sleep 15; done
log costs start
$PY -m bench.costs --corun-core 1 --out $D/costs.json > $D/costs.out 2>&1; log costs end rc=$?
run() {
  local name=$1; shift
  log $name start
  $PY -m bench.run_bench --systems disagg --workloads sharegpt_like --no-kv-bandwidth \
    --no-overhead --no-progress --name $name --out-dir $D "$@" > $D/$name.out 2>&1
  log $name end rc=$?
}
P2=(--engine-arg=--num-prefill --engine-arg=2)
D2=(--engine-arg=--num-decode --engine-arg=2)
run cal-1p1d --num-requests 16 --seed 1
run cal-1p1d-rate3 --num-requests 32 --rates 3 --seed 3
for r in r1 r2; do
  run 1p1d-$r --num-requests 16; run 2p1d-$r --num-requests 16 "${P2[@]}"; run 1p2d-$r --num-requests 16 "${D2[@]}"
done
for t in 1p1d 2p1d 1p2d; do
  args=(); [ $t = 2p1d ] && args=("${P2[@]}"); [ $t = 1p2d ] && args=("${D2[@]}")
  run $t-rate3 --num-requests 32 --rates 3 --seed 2 "${args[@]}"
done
log all done

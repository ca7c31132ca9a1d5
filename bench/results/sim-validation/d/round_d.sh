#!/bin/bash
# round (d): wait for an idle host, then costs, a calibration run, six validated runs
# usage: bash round_d.sh OUT_DIR   (from the repository root, with the venv's python as PY)
set -u
export PYTHONPATH=$PWD
PY=${PY:-.venv/bin/python}
D=${1:?out dir}
mkdir -p $D
log() { echo "$(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >> $D/log.txt; }
log waiting
until awk '{exit !($1<1.5)}' /proc/loadavg; do sleep 30; done
log costs start
$PY -m bench.costs --corun-core 1 --out $D/costs.json > $D/costs.out 2>&1; log costs end rc=$?
run() {
  local name=$1; shift
  log $name start
  $PY -m bench.run_bench --systems disagg --workloads sharegpt_like --num-requests 16 --no-kv-bandwidth \
    --no-overhead --no-progress --name $name --out-dir $D "$@" > $D/$name.out 2>&1
  log $name end rc=$?
}
P2=(--engine-arg=--num-prefill --engine-arg=2)
D2=(--engine-arg=--num-decode --engine-arg=2)
run cal-1p1d --seed 1
for r in r1 r2; do
  run 1p1d-$r; run 2p1d-$r "${P2[@]}"; run 1p2d-$r "${D2[@]}"
done
log all done

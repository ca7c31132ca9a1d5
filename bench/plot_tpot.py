"""TPOT p50/p99 of colocated vs disaggregated serving, from run_bench result files, as one PNG.

    python -m bench.plot_tpot bench/results/2026-11-30-e0d682f-disagg-closed.json \
        bench/results/2026-11-30-e0d682f-disagg-open.json --out bench/results/2026-11-30-e0d682f-disagg-tpot.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def rows(paths: list[str]) -> dict[str, dict[str, tuple[float, float]]]:
    """label -> system -> (TPOT p50, TPOT p99) in ms."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for path in paths:
        for r in json.load(open(path))["results"]:
            if not r["ok"] or r["system"] not in ("colocated", "disagg"):
                continue
            label = r["label"] if r["rate"] else f"{r['workload']} closed"
            tpot = r["summary"]["tpot_s"]
            out.setdefault(label, {})[r["system"]] = (tpot["p50"] * 1e3, tpot["p99"] * 1e3)
    return out


def plot(data: dict[str, dict[str, tuple[float, float]]], out: str) -> None:
    labels = [k for k in data if len(data[k]) == 2]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for ax, idx, title in ((axes[0], 0, "TPOT p50 (ms)"), (axes[1], 1, "TPOT p99 (ms, lower is better)")):
        xs = range(len(labels))
        for off, system in ((-0.2, "colocated"), (0.2, "disagg")):
            ax.bar([x + off for x in xs], [data[lab][system][idx] for lab in labels], 0.4, label=system)
        ax.set_xticks(list(xs), labels, rotation=25, ha="right", fontsize=8)
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle("pdserve: decode TPOT, colocated (2 cores) vs disaggregated (1 core prefill + 1 core decode)")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", default="bench/runs/disagg-tpot.png")
    a = ap.parse_args()
    plot(rows(a.results), a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

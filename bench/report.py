"""Writing a run's results: JSON (everything), a Markdown table, and a PNG bar plot."""

from __future__ import annotations

import json
from pathlib import Path

BASELINE = "static"
TABLE_HEADER = (
    "| workload | system | output tok/s | req/s | ratio vs static | TTFT p50 / p99 (s) | "
    "TPOT p50 / p99 (ms) | E2E mean (s) | SLO attainment |"
)


def _fmt(x: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "—" if x is None else f"{x * scale:.{digits}f}"


def _pair(dist: dict | None, digits: int, scale: float = 1.0) -> str:
    if dist is None:
        return "—"
    return f"{_fmt(dist['p50'], digits, scale)} / {_fmt(dist['p99'], digits, scale)}"


def baseline_throughput(results: list[dict]) -> dict[str, float]:
    """Output tok/s of static batching per workload label."""
    return {r["label"]: r["summary"]["output_throughput"] for r in results if r["system"] == BASELINE and r["ok"]}


def table_row(r: dict, base: dict[str, float]) -> str:
    if not r["ok"]:
        why = (r["error"] or "failed").splitlines()[0][:100]
        return f"| {r['label']} | {r['system']} | failed: {why} | | | | | | |"
    s = r["summary"]
    ratio = s["output_throughput"] / base[r["label"]] if base.get(r["label"]) else None
    e2e = s["e2e_s"]["mean"] if s["e2e_s"] else None
    cells = [
        r["label"],
        r["system"],
        _fmt(s["output_throughput"], 1),
        _fmt(s["request_throughput"], 3),
        _fmt(ratio, 2) + ("×" if ratio else ""),
        _pair(s["ttft_s"], 3),
        _pair(s["tpot_s"], 1, 1e3),
        _fmt(e2e, 3),
        f"{s['slo_attainment']:.0%}",
    ]
    if s["num_failed"]:
        cells[1] += f" ({s['num_failed']} failed)"
    return "| " + " | ".join(cells) + " |"


def _overhead_lines(ov: dict | None) -> list[str]:
    if not ov:
        return []
    if "error" in ov:
        return ["", f"Engine overhead: failed: {ov['error']}"]
    return [
        "",
        f"## Engine overhead ({ov['workload']}, closed, in-process, {ov['num_steps']} steps)",
        "",
        "| engine wall (s) | compute floor (s) | step / bare forward | median per step | prepare share of bare |",
        "|---|---|---|---|---|",
        f"| {ov['engine_wall_s']:.3f} | {ov['compute_floor_s']:.3f} | {ov['engine_overhead']:.3f}× | "
        f"{ov['engine_overhead_step_p50']:.3f}× | {ov['prepare_share_of_bare']:.1%} |",
    ]


def _kv_lines(kv: dict | None) -> list[str]:
    if not kv:
        return []
    body = kv.get("markdown") or f"failed: {kv.get('error')}"
    return ["", "## KV transfer (bench/kv_bandwidth.py)", "", body]


def _goodput_lines(goodput: dict) -> list[str]:
    if not goodput:
        return []
    lines = [
        "",
        "## Goodput (highest swept rate with ≥ 90% SLO attainment)",
        "",
        "| workload | system | rate |",
        "|---|---|---|",
    ]
    for key, rate in goodput.items():
        workload, system = key.split("|")
        lines.append(f"| {workload} | {system} | {'none' if rate is None else f'{rate:g} req/s'} |")
    return lines


def router_cpu_lines(results: list[dict]) -> list[str]:
    """The router's CPU per streamed token, for the runs that measured it (pdserve over HTTP)."""
    rows = [r for r in results if r.get("router_cpu_us_per_token") is not None]
    if not rows:
        return []
    note = "utime + stime of the router process over the run, from /proc (10 ms ticks: short runs round)."
    lines = ["", "## Router CPU per streamed token", "", note, ""]
    lines += ["| workload | system | router CPU (s) | µs per token |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['system']} | {r['router_cpu_s']:.3f} | {r['router_cpu_us_per_token']:.1f} |")
    return lines


def _agreement_lines(results: list[dict]) -> list[str]:
    """Greedy outputs should match across systems; list only the runs where they do not."""
    rows = [r for r in results if r.get("token_agreement") is not None]
    if not rows:
        return []
    refs = sorted({r["token_reference"] for r in rows})
    off = [r for r in rows if r["token_agreement"] < 1.0]
    lines = ["", f"Greedy tokens vs {', '.join(refs)}: {len(rows) - len(off)} of {len(rows)} runs identical."]
    lines += [f"- {r['label']} / {r['system']}: {r['token_agreement']:.0%} of requests identical" for r in off]
    return lines


def markdown(run: dict) -> str:
    results = run["results"]
    base = baseline_throughput(results)
    c = run["config"]
    head = [
        f"# pdserve benchmark: {c['name']}",
        "",
        f"Model `{c['model']}`, max batch {c['max_batch']}, token budget {c['max_num_batched_tokens']}, "
        f"{'quick smoke run (not a measurement)' if c['quick'] else 'full run'}; SLO: TTFT ≤ {c['slo_ttft_s']} s, "
        f"TPOT ≤ {c['slo_tpot_s'] * 1e3:.0f} ms. Static batching does not stream: its TTFT is its E2E, it has "
        "no TPOT. `static` and `hf_cb` run inside the benchmark process; pdserve (and any external server) "
        "is driven over HTTP through its router, with the load generator on the same cores.",
        "",
        TABLE_HEADER,
        "|" + "---|" * 9,
    ]
    lines = head + [table_row(r, base) for r in results]
    lines += _overhead_lines(run.get("engine_overhead")) + _kv_lines(run.get("kv_bandwidth"))
    lines += router_cpu_lines(results)
    lines += _goodput_lines(run.get("goodput", {})) + _agreement_lines(results)
    return "\n".join(lines) + "\n"


def plot(run: dict, path: Path) -> None:
    """Grouped bars: output tok/s and mean E2E per workload, one bar per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in run["results"] if r["ok"]]
    labels = list(dict.fromkeys(r["label"] for r in run["results"]))
    systems = list(dict.fromkeys(r["system"] for r in run["results"]))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 3 * len(labels)), 4), layout="constrained")
    width = 0.8 / max(1, len(systems))
    for j, system in enumerate(systems):
        by_label = {r["label"]: r["summary"] for r in ok if r["system"] == system}
        xs = [i + j * width for i in range(len(labels))]
        tput = [by_label[lab]["output_throughput"] if lab in by_label else 0 for lab in labels]
        e2e = [by_label[lab]["e2e_s"]["mean"] if lab in by_label and by_label[lab]["e2e_s"] else 0 for lab in labels]
        axes[0].bar(xs, tput, width, label=system)
        axes[1].bar(xs, e2e, width, label=system)
    for ax, title in zip(
        axes, ("output tokens/s (higher is better)", "mean E2E latency, s (lower is better)"), strict=True
    ):
        ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(labels))], labels, rotation=15)
        ax.set_title(title)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize="small")
    fig.suptitle(f"{run['config']['name']} ({run['config']['model']})")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_all(run: dict, out_dir: Path, name: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md", out_dir / f"{name}.png"]
    paths[0].write_text(json.dumps(run, indent=1))
    paths[1].write_text(markdown(run))
    plot(run, paths[2])
    return paths

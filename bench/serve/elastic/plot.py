"""The PNG of `pdserve bench serve --compare elastic --plot PREFIX`: PREFIX_elastic.png, goodput
per layout and workload (left) and, on the phases workload, the elastic layout's roles and
short-prompt threshold over time against the phases (right)."""
from __future__ import annotations

from bench.plotting import figure


def plot(prefix: str, result: dict) -> None:
    names = [lay["name"] for lay in result["layouts"]]
    loads = result["workloads"]
    with figure(f"{prefix}_elastic.png", dpi=120, ncols=2, figsize=(11, 4)) as (_, axes):
        ax = axes[0]
        width = 0.8 / max(1, len(names))
        for j, name in enumerate(names):
            xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(loads))]
            ax.bar(xs, [w["by_layout"][name]["grid_goodput_rps"] for w in loads], width, label=name)
        ax.set_xticks(range(len(loads)), [w["name"].replace("long_share=", "long ") for w in loads], fontsize=8)
        ax.set_ylabel("goodput (requests/s within SLO,\nmean over the SLO grid)", fontsize=9)
        ax.set_title(f"both passes pooled; elastic / best static: min over mixes "
                     f"{_fmt(result.get('elastic_vs_best_static_min'))}, phases "
                     f"{_fmt(result.get('elastic_vs_best_static_phases'))}", fontsize=8)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        _roles(axes[1], result)


def _roles(ax, result: dict) -> None:
    phases = result.get("phases") or []
    load = next((w for w in result["workloads"] if w["kind"] == "phases"), None)
    elastic = load["by_layout"].get("elastic") if load else None
    if not phases or elastic is None:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no phases workload with the elastic layout", ha="center")
        return
    t = 0.0
    for i, p in enumerate(phases):
        ax.axvspan(t, t + p["seconds"], color=f"C{i % 10}", alpha=0.08)
        ax.text(t + p["seconds"] / 2, 2.1 + 0.22 * (i % 2), f"{p['name']}\n{p['rate']:g}/s, long {p['long_share']:g}",
                ha="center", va="bottom", fontsize=6)  # staggered: short phases' labels would overlap
        t += p["seconds"]
    runs = elastic["roles_over_time"]
    for run in runs:
        pts = run["prefill_nodes"]
        ax.step([x for x, _ in pts], [n for _, n in pts], where="post", label=f"prefill nodes, pass {run['pass']}")
    if any(run["thresholds"] for run in runs):  # the planner's live threshold, when it set one
        thr = ax.twinx()
        for run in runs:
            if run["thresholds"]:
                thr.step([x for x, _ in run["thresholds"]], [v for _, v in run["thresholds"]], where="post", ls=":",
                         label=f"threshold, pass {run['pass']}")
        thr.set_yscale("log", base=2)
        thr.set_ylabel("short-prompt threshold (tokens)", fontsize=8)
        thr.legend(fontsize=7, loc="lower right")
    ax.set_ylim(-0.1, 2.8)
    ax.set_yticks([0, 1, 2])
    ax.set_xlabel("seconds into the phases play")
    ax.set_ylabel("nodes serving prefill (of 2)")
    ax.set_title(f"elastic: {elastic['role_switches']} role switch(es), dropped {elastic['dropped']}", fontsize=8)
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"

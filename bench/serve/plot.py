"""The PNGs of `pdserve bench serve --plot PREFIX`: PREFIX_cdf.png (TTFT and TPOT distributions
at each layout's heaviest load), PREFIX_goodput.png (goodput against offered load) and, with
``--compare colocated --long-shares``, PREFIX_crossover.png (the goodput ratio against the
long-document share and the SLO)."""
from __future__ import annotations

from bench.plotting import figure
from bench.serve.metrics import Slo


def plot_latency(prefix: str, layouts: dict[str, list[dict]], slo: Slo | None) -> None:
    with figure(f"{prefix}_cdf.png", dpi=120, ncols=2, figsize=(10, 3.8)) as (_, axes):
        for name, points in layouts.items():
            top = max(points, key=lambda p: p["rate"] or 0)  # the heaviest load: where layouts differ
            recs = [r for r in top["_records"] if r.ok]
            for ax, values, what in ((axes[0], [r.ttft for r in recs], "TTFT"),
                                     (axes[1], [t for r in recs if (t := r.tpot) is not None], "TPOT")):
                xs = sorted(values)
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{name} @ {top['rate']} req/s")
                ax.set_xlabel(f"{what} (s)")
                ax.set_ylabel("fraction of requests")
        if slo is not None:
            axes[0].axvline(slo.ttft_s, color="grey", ls="--", lw=1, label="SLO")
            axes[1].axvline(slo.tpot_s, color="grey", ls="--", lw=1, label="SLO")
        for ax in axes:
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    if slo is None or not any(len(p) > 1 for p in layouts.values()):
        return
    with figure(f"{prefix}_goodput.png", dpi=120, figsize=(5.5, 3.8)) as (_, ax):
        for name, points in layouts.items():
            ps = sorted(points, key=lambda p: p["rate"])
            ax.plot([p["rate"] for p in ps], [p["goodput_rps"] for p in ps], marker="o", label=name)
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel("goodput (requests/s within SLO)")
        ttft = ", ".join(f"{k} {v:.2f}s" for k, v in slo.ttft_by_kind) or f"{slo.ttft_s:.2f}s"
        ax.set_title(f"TTFT <= {ttft}; TPOT <= {slo.tpot_s * 1000:.0f} ms", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()


def plot_crossover(prefix: str, per_share: list[dict], head: dict) -> None:
    """PREFIX_crossover.png: the goodput ratio against the long-document share (left) and, at the
    headline share, against the SLO's TTFT factor for each TPOT factor (right). Above 1 the
    disaggregated layout serves more requests within the SLO."""
    rows = [r for r in per_share if r.get("goodput_ratio") is not None]
    grid = head.get("slo_grid") or []
    with figure(f"{prefix}_crossover.png", dpi=120, ncols=2, figsize=(10, 3.8)) as (_, axes):
        ax = axes[0]
        ax.plot([r["long_share"] for r in rows], [r["goodput_ratio"] for r in rows], marker="o")
        ax.set_xlabel("share of requests that are long documents")
        ax.set_ylabel("goodput ratio (disagg / colocated)")
        ax.set_title(f"SLO: TTFT {head['slo']['ttft_factor']:g}x, TPOT {head['slo']['tpot_factor']:g}x unloaded",
                     fontsize=9)
        ax = axes[1]
        for fp in sorted({g["tpot_factor"] for g in grid}):
            pts = [g for g in grid if g["tpot_factor"] == fp and g["goodput_ratio"] is not None]
            ax.plot([g["ttft_factor"] for g in pts], [g["goodput_ratio"] for g in pts], marker="o",
                    label=f"TPOT <= {fp:g}x")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT SLO (x unloaded TTFT of the request's kind)")
        ax.set_ylabel("goodput ratio (disagg / colocated)")
        ax.set_title(f"long-document share {head['long_share']:g}", fontsize=9)
        if grid:
            ax.legend(fontsize=8)
        for ax in axes:
            ax.axhline(1.0, color="grey", lw=1)
            ax.axhline(1.3, color="grey", lw=1, ls="--")
            ax.grid(alpha=0.3)

"""`pdserve status`'s KV tier figures: per node and tier (device, host, disk) the blocks held,
the usage, the hits, the bytes moved down and back, the mean time to bring a block back and the
errors, all from the node's ``pdserve:kv_tier_*`` / ``kv_offload_*`` / ``kv_onboard_*`` series
(telemetry/metrics.py). Pure: deploy/status.py feeds it samples and rows."""
from __future__ import annotations

from collections.abc import Mapping

P = "pdserve:"
TIER_ORDER = ("device", "host", "disk")

# Sample name -> figure, per ``tier`` label (errors are summed over their reasons).
TIER_SAMPLES = {
    P + "kv_tier_blocks": "blocks",
    P + "kv_tier_usage": "usage",
    P + "kv_tier_capacity_bytes": "capacity_bytes",
    P + "kv_tier_hits_total": "hits",
    P + "kv_offload_bytes_total": "offload_bytes",
    P + "kv_onboard_bytes_total": "onboard_bytes",
    P + "kv_onboard_seconds_sum": "onboard_seconds_sum",
    P + "kv_onboard_seconds_count": "onboard_seconds_count",
    P + "kv_tier_errors_total": "errors",
}


def add_tier_sample(out: dict, sample) -> bool:
    """Fold one tier sample into ``out["tiers"][tier]``; False for any other sample."""
    key = TIER_SAMPLES.get(sample.name)
    if key is None or "tier" not in sample.labels:
        return False
    t = out.setdefault("tiers", {}).setdefault(sample.labels["tier"], {})
    t[key] = t.get(key, 0.0) + sample.value
    return True


def tier_row(figures: Mapping) -> dict | None:
    """A node row's ``tiers``: tier -> its figures, mean onboard time in seconds (None before
    any), byte and count figures as ints; None when the node exports no lower tier."""
    tiers = figures.get("tiers") or {}
    if not any(t in tiers for t in ("host", "disk")):
        return None
    out = {}
    for tier in TIER_ORDER:
        t = tiers.get(tier)
        if t is None:
            continue
        n = t.get("onboard_seconds_count", 0)
        out[tier] = {"blocks": int(t.get("blocks", 0)), "usage": t.get("usage"), "hits": int(t.get("hits", 0)),
                     "capacity_bytes": int(t.get("capacity_bytes", 0)), "offload_bytes": int(t.get("offload_bytes", 0)),
                     "onboard_bytes": int(t.get("onboard_bytes", 0)),
                     "mean_onboard_s": t.get("onboard_seconds_sum", 0.0) / n if n else None,
                     "errors": int(t.get("errors", 0))}
    return out


def render_tiers(row: Mapping, fmt_bytes) -> str | None:
    """One indented line under a node's row: each tier's blocks, usage, hits, moves, errors."""
    tiers = row.get("tiers")
    if not tiers:
        return None
    parts = []
    for tier, t in tiers.items():
        text = f"{tier} {t['blocks']} blk"
        if tier != "device":
            text += f" ({t['usage']:.0%} of {fmt_bytes(t['capacity_bytes'])})" if t["usage"] is not None else ""
            text += f", down {fmt_bytes(t['offload_bytes'])}, back {fmt_bytes(t['onboard_bytes'])}"
            if t["mean_onboard_s"] is not None:
                text += f" in {t['mean_onboard_s'] * 1e3:.2f}ms avg"
        text += f", {t['hits']} hits"
        if t["errors"]:
            text += f", {t['errors']} errors"
        parts.append(text)
    return "    KV tiers: " + "; ".join(parts)


def tier_errors(row: Mapping) -> list[str]:
    """A line per tier that counted errors (each was a miss, never a failed request)."""
    return [f"{row['node_id']}: {t['errors']} {tier}-tier KV error(s) (misses, recomputed; "
            f"pdserve:kv_tier_errors_total says which)"
            for tier, t in (row.get("tiers") or {}).items() if t["errors"]]

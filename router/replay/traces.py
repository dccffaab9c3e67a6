"""Serving traces as plain request records: Mooncake's JSON Lines (with prefix-chained block
hash ids) and Azure's LLM inference CSVs (lengths and timestamps only). Files and their
provenance: ../shared/data/traces/README.md."""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # one per block of the prompt, prefix-chained (Mooncake)


def load_trace(path: str, max_requests: int | None = None) -> list[TraceRequest]:
    """Mooncake JSON Lines (timestamp ms, input_length, output_length, hash_ids) or an Azure
    LLM inference CSV (TIMESTAMP, ContextTokens, GeneratedTokens: no prefix information)."""
    out: list[TraceRequest] = []
    with open(path) as f:
        first = f.readline()
        if first.lstrip().startswith("{"):
            for line in [first, *f]:
                if line.strip():
                    d = json.loads(line)
                    out.append(TraceRequest(d["timestamp"] / 1e3, int(d["input_length"]),
                                            int(d["output_length"]), tuple(d.get("hash_ids", ()))))
                if max_requests and len(out) >= max_requests:
                    break
        else:
            header = [h.strip() for h in first.split(",")]
            ti, ci, gi = header.index("TIMESTAMP"), header.index("ContextTokens"), header.index("GeneratedTokens")
            t0 = None
            for line in f:
                cols = line.strip().split(",")
                if len(cols) < len(header):
                    continue
                t = _parse_azure_time(cols[ti])
                t0 = t if t0 is None else t0
                out.append(TraceRequest(t - t0, int(cols[ci]), int(cols[gi])))
                if max_requests and len(out) >= max_requests:
                    break
    out.sort(key=lambda r: r.arrival_s)
    return out


def _parse_azure_time(s: str) -> float:
    # "2023-11-16 18:15:46.6805900": seconds since midnight is enough (traces span an hour).
    hms = s.split(" ")[-1]
    h, m, sec = hms.split(":")
    return int(h) * 3600 + int(m) * 60 + float(sec)

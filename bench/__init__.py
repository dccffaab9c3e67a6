"""Benchmarks behind `pdserve bench NAME [--json]`.

Each benchmark is a module in this package exposing

    add_arguments(parser: argparse.ArgumentParser) -> None
    run(args: argparse.Namespace, report: Reporter) -> dict

``run`` prints progress and a table through ``report`` and returns the JSON-able result, which
the CLI prints as the last line when ``--json`` is given. Every figure is measured against a
baseline in the same run.
"""
from __future__ import annotations

import importlib
import sys
import time

# name on the command line -> module in this package
BENCHMARKS: dict[str, str] = {
    "exactness": "exactness",
    "kv-memory": "kv_memory",
    "kv-tiers": "kv_tiers",
    "engine": "engine_throughput",
    "transfer": "transfer",
    "router": "router_replay",
    "specdec": "specdec",
    "verify-cost": "verify_cost",
    "serve": "serve.run",
    "load": "load",
    "redis-hang": "redis_hang",
    "structured": "structured",
    "kv-index": "kv_index",
}


def benchmark_module(name: str):
    """The module behind `pdserve bench NAME` (named so that importing `bench.load`, the
    load benchmark, cannot shadow it as a package attribute)."""
    if name not in BENCHMARKS:
        known = ", ".join(sorted(BENCHMARKS))
        raise SystemExit(f"unknown benchmark {name!r}; known: {known}")
    return importlib.import_module(f"bench.{BENCHMARKS[name]}")


class Reporter:
    """Progress lines and tables on stderr-or-stdout; never mixed into the final JSON line."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stdout
        self._t0 = time.perf_counter()

    def progress(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self._t0:7.1f}s] {msg}", file=self.stream, flush=True)

    def table(self, headers: list[str], rows: list[list[object]]) -> None:
        cells = [[_fmt(c) for c in r] for r in rows]
        widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
        line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
        print(line, file=self.stream)
        print("  ".join("-" * w for w in widths), file=self.stream)
        for r in cells:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)), file=self.stream)
        self.stream.flush()


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)

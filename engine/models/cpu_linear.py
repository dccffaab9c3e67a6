"""CPU matmul kernels for ``y = x W^T``, chosen per weight shape and row count by measuring them.

Why measure: on CPUs the fastest kernel for a given row count depends on the BLAS build and
the processor in ways no rule predicts. On the AMD dev VMs, for example, torch's float32
``F.linear`` goes to MKL, which takes slow paths on a non-Intel CPU (bfloat16 already goes to
oneDNN), while MKL's "tall weight times 2..4 columns" kernel is the fastest of all, at memory
bandwidth (the measured table is in docs/engine.md). A decode step's and a speculative
verification's costs both hinge on these numbers, so the engine measures the candidates once
per (CPU, torch, threads, dtype, weight shapes) and caches the plan on disk
(``$PDSERVE_CACHE_DIR/kernels``).

Kernels (all accumulate in the weight's dtype with float32 accumulation, so results differ
from each other only by summation order):

* ``aten``: ``F.linear``, torch's default;
* ``onednn``: ``torch.ops.mkldnn._linear_pointwise``, oneDNN's inner product;
* ``mkl_nt``: ``(W @ x^T)^T`` through ``torch.mm``; one row is padded to two because MKL's
  one-row path (gemv) is the slow one.
"""
from __future__ import annotations

import bisect
import fcntl
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

PLAN_VERSION = 1
# Row counts measured; a count between two of them uses the next larger one's kernel.
TUNE_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 64, 128)
MKL_NT_MAX_ROWS = 16  # beyond this the tall-times-thin form never wins (and is slow to measure)

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _aten(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b)


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _mkl_nt(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    m = x.shape[0]  # x: [M, in], w: [out, in]
    xt = (x if m > 1 else torch.cat((x, x))).t()  # [in, max(M, 2)]
    y = torch.mm(w, xt)[:, :m].t().contiguous()  # [M, out]
    return y if b is None else y + b


KERNELS: dict[str, Kernel] = {"aten": _aten, "onednn": _onednn, "mkl_nt": _mkl_nt}


@dataclass(frozen=True, slots=True)
class ShapePlan:
    """The best kernel of one weight shape at each measured row count."""

    rows: tuple[int, ...]  # ascending
    kernels: tuple[str, ...]
    ms: tuple[float, ...]  # that kernel's time per call at that row count, milliseconds


class LinearPlan:
    """Which kernel every ``Linear`` uses for a given number of rows, and what a forward's
    matmuls cost at a given number of rows (the speculative-decoding cost model reads this)."""

    def __init__(self, shapes: dict[tuple[int, int], ShapePlan], counts: dict[tuple[int, int], int]):
        self.shapes = shapes
        self.counts = counts  # weights of each shape in one forward (the LM head included)
        self._fns = {s: tuple(KERNELS[k] for k in p.kernels) for s, p in shapes.items()}

    def curve(self) -> tuple[tuple[int, float], ...]:
        """``gemm_ms`` at every measured row count: what a node registers (kv_index/matmul_curve.py)."""
        rows = sorted({r for p in self.shapes.values() for r in p.rows})
        return tuple((r, self.gemm_ms(r)) for r in rows)

    def kernel(self, shape: tuple[int, int], rows: int) -> Kernel:
        plan = self.shapes.get(shape)
        return _aten if plan is None else self._fns[shape][_bucket(plan, rows)]

    def kernel_name(self, shape: tuple[int, int], rows: int) -> str:
        plan = self.shapes[shape]
        return plan.kernels[_bucket(plan, rows)]

    def gemm_ms(self, rows: int) -> float:
        """Predicted milliseconds of one forward's matmuls with ``rows`` rows through every
        weight (a batch-1 verification of rows - 1 drafts, or a decode step of ``rows``
        sequences); linear between measured counts, extrapolated past the last."""
        return sum(self.counts[s] * _interp(p.rows, p.ms, rows) for s, p in self.shapes.items())

    def to_json(self) -> dict:
        return {
            "version": PLAN_VERSION,
            "shapes": [{"shape": list(s), "count": self.counts[s], "rows": list(p.rows),
                        "kernels": list(p.kernels), "ms": list(p.ms)} for s, p in self.shapes.items()],
        }

    @classmethod
    def from_json(cls, d: dict) -> "LinearPlan":
        if d.get("version") != PLAN_VERSION:
            raise ValueError(f"kernel plan version {d.get('version')} != {PLAN_VERSION}")
        shapes, counts = {}, {}
        for e in d["shapes"]:
            s = (int(e["shape"][0]), int(e["shape"][1]))
            if any(k not in KERNELS for k in e["kernels"]):
                raise ValueError(f"unknown kernel in plan: {e['kernels']}")
            shapes[s] = ShapePlan(tuple(e["rows"]), tuple(e["kernels"]), tuple(float(x) for x in e["ms"]))
            counts[s] = int(e["count"])
        return cls(shapes, counts)

    def describe(self) -> str:
        """One line per shape: row range -> kernel, for logs and docs."""
        out = []
        for s, p in self.shapes.items():
            runs, lo = [], 1
            for i, (r, k) in enumerate(zip(p.rows, p.kernels)):
                if i + 1 == len(p.rows) or p.kernels[i + 1] != k:
                    runs.append(f"{lo}-{r}:{k}" if lo != r else f"{r}:{k}")
                    lo = r + 1
            out.append(f"{s[0]}x{s[1]} x{self.counts[s]}  " + " ".join(runs))
        return "\n".join(out)


def _bucket(plan: ShapePlan, rows: int) -> int:
    """The measured row count whose kernel serves ``rows``: the next larger, or the last."""
    return min(bisect.bisect_left(plan.rows, rows), len(plan.rows) - 1)


def _interp(xs: tuple[int, ...], ys: tuple[float, ...], x: int) -> float:
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def available_kernels(dtype: torch.dtype) -> list[str]:
    """Kernels that run and agree with ``F.linear`` for this dtype on this build."""
    g = torch.Generator().manual_seed(0)  # not the global RNG: callers' seeds stay untouched
    x, w, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((3, 64), (48, 64), (48,)))
    ref = F.linear(x.double(), w.double(), b.double())
    tol = 1e-3 if dtype == torch.float32 else 0.5
    names = []
    for name, fn in KERNELS.items():
        try:
            with torch.inference_mode():
                ok = all(torch.allclose(fn(x[:m], w, b).double(), ref[:m], atol=tol, rtol=tol) for m in (1, 3))
        except (RuntimeError, NotImplementedError):
            ok = False
        if ok:
            names.append(name)
    return names


@torch.inference_mode()
def tune(
    weights: list[torch.Tensor],  # every weight of one forward, in the order the forward reads them
    rows: tuple[int, ...] = TUNE_ROWS,
    candidates: list[str] | None = None,
    passes: int = 2,
    kernels: dict[str, Kernel] = KERNELS,
    progress: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> LinearPlan:
    """Time every candidate kernel on every weight at every row count and keep the fastest.

    A pass runs one kernel over all weights in forward order, so each weight is read cold as
    in a real forward (a loop over one small matrix would time the cache, not the model).
    The best of ``passes`` passes counts, per weight shape.
    """
    dtype = weights[0].dtype
    names = candidates if candidates is not None else available_kernels(dtype)
    # A plan names kernels, so only KERNELS' names can go in one; tests substitute the functions.
    if any(n not in KERNELS for n in names):
        raise ValueError(f"unknown kernels {names}; known: {sorted(KERNELS)}")
    counts: dict[tuple[int, int], int] = {}
    for w in weights:
        s = (w.shape[0], w.shape[1])
        counts[s] = counts.get(s, 0) + 1
    g = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(max(rows), k, generator=g).to(dtype) for k in {s[1] for s in counts}}
    for name in names:  # first calls allocate scratch and start thread pools
        for w in weights[: len(counts)]:
            kernels[name](inputs[w.shape[1]][:1], w, None)
    best: dict[tuple[int, int], list[tuple[str, float]]] = {s: [] for s in counts}
    for i, m in enumerate(rows):
        per: dict[tuple[int, int], dict[str, float]] = {s: {} for s in counts}
        for name in names:
            if name == "mkl_nt" and m > MKL_NT_MAX_ROWS:
                continue
            fn = kernels[name]
            for _ in range(passes):
                took: dict[tuple[int, int], float] = {s: 0.0 for s in counts}
                for w in weights:
                    x = inputs[w.shape[1]][:m]
                    t0 = clock()
                    fn(x, w, None)
                    took[(w.shape[0], w.shape[1])] += clock() - t0
                for s, t in took.items():
                    per[s][name] = min(per[s].get(name, float("inf")), t * 1e3 / counts[s])
        for s in counts:
            name = min(per[s], key=per[s].get)
            best[s].append((name, per[s][name]))
        if progress:
            total = sum(counts[s] * best[s][-1][1] for s in counts)
            progress(f"tuning matmul kernels: {i + 1}/{len(rows)} row counts ({m} rows: {total:.1f} ms)")
    shapes = {s: ShapePlan(tuple(rows), tuple(n for n, _ in b), tuple(t for _, t in b)) for s, b in best.items()}
    return LinearPlan(shapes, counts)


def plan_key(weights: list[torch.Tensor]) -> str:
    """What a cached plan is valid for: this CPU, torch build, thread count, dtype and shapes."""
    counts: dict[str, int] = {}
    for w in weights:
        k = f"{w.shape[0]}x{w.shape[1]}"
        counts[k] = counts.get(k, 0) + 1
    ident = {
        "version": PLAN_VERSION,
        "cpu": _cpu_name(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(weights[0].dtype),
        "shapes": sorted(counts.items()),
        "rows": list(TUNE_ROWS),
    }
    return hashlib.blake2b(json.dumps(ident, sort_keys=True).encode(), digest_size=10).hexdigest()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_or_tune(
    weights: list[torch.Tensor],
    cache_dir: Path,
    progress: Callable[[str], None] | None = None,
) -> LinearPlan:
    """The cached plan for these weights on this machine, tuning (and caching) it if missing.

    Processes starting together (a prefill and a decode node on one machine) serialize on one
    lock for the whole cache directory, whatever their model or thread count: timing kernels
    while another process does the same would measure contention. (A node already serving
    beside a tuning one still disturbs it; the plan is a start, not a guarantee.) An unusable
    cache directory (read-only, full) only costs the caching: the plan is measured in memory.
    """
    key = plan_key(weights)
    path = cache_dir / f"{key}.json"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock = open(cache_dir / "tune.lock", "w")
    except OSError:
        return tune(weights, progress=progress)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            try:
                return LinearPlan.from_json(json.loads(path.read_text()))
            except (ValueError, KeyError, TypeError, json.JSONDecodeError):
                pass  # a plan from another version or a damaged file: measure again
        plan = tune(weights, progress=progress)
        try:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(plan.to_json()))
            os.replace(tmp, path)
        except OSError:
            pass  # not cached; measured again next time
        return plan

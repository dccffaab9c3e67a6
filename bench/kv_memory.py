"""`pdserve bench kv-memory`: paged KV blocks against contiguous per-request reservations.

The request lengths of three public traces are replayed through the real ``KVCacheManager``
and, as the baselines in the same run, through two contiguous allocators: one that reserves
``max_model_len`` slots per request up front (what a server without paging must do when it
cannot know the output length), and the stronger one that reserves exactly prompt + output
length (what a server that knows each request's ``max_tokens`` does, with ``max_tokens`` set to
the length the trace actually produced: the best case for reserving). All get the same KV budget.

The replay is a saturated backlog: every request of a trace is queued in arrival order at the
start, so each system runs as many sequences as its memory allows. That measures capacity,
which is what the concurrency ratio is about. One step = one token for every running sequence::

    step:  1. running sequences that reached their output length free their memory
           2. the others grow by one token (paged: preempt the newest on a full pool,
              it goes back to the head of the queue and is recomputed later)
           3. admit from the queue head, FCFS, while the prompt (+1 for the first output
              token) fits; paged keeps a watermark of free blocks for running sequences

    waste = (allocated KV slots - slots holding a token) / allocated KV slots,
            measured at the first step with each system's peak concurrency.

The peak can be a short spike, so the saturated mean (running sequences averaged over the
steps that still had a backlog, i.e. while memory and not demand bounded the batch) is
reported beside it: ``concurrency_ratio_mean``.

Prefix caching is off: the traces carry lengths, not token contents.
"""
from __future__ import annotations

import argparse
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

from bench.plotting import figure
from engine.kv_cache_manager import KVCacheManager

_REPO = Path(__file__).resolve().parents[1]

TRACES = {
    "azure-code": "AzureLLMInferenceTrace_code.csv",
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
    "mooncake-conv": "conversation_trace.jsonl",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces-dir", type=Path, default=_REPO.parent / "shared" / "data" / "traces")
    parser.add_argument("--kv-tokens", type=int, default=262144, help="KV budget in token slots")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=8192, help="longer requests are skipped")
    parser.add_argument("--max-requests", type=int, default=2000, help="first N requests of each trace")
    parser.add_argument("--watermark", type=float, default=0.01, help="fraction of blocks kept free at admission")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE.png")


class Request(NamedTuple):
    prompt_len: int
    output_len: int


def load_trace(path: Path, limit: int) -> list[Request]:
    """The first ``limit`` requests in arrival order, read by the router simulator's loader."""
    from router.replay.traces import load_trace as read_trace

    return [Request(r.input_tokens, r.output_tokens) for r in read_trace(str(path), limit)]


# ---- the two allocators under test ---------------------------------------------------------


class _Allocator(Protocol):
    def admit(self, rid: str, num_tokens: int, final_tokens: int) -> bool: ...
    def grow(self, rid: str, num_tokens: int) -> bool: ...
    def release(self, rid: str) -> None: ...
    def allocated_slots(self) -> int: ...


class _Paged:
    def __init__(self, kv_tokens: int, block_size: int, watermark: float) -> None:
        self.mgr = KVCacheManager(kv_tokens // block_size, block_size, enable_prefix_caching=False)
        self.reserve = math.ceil(watermark * self.mgr.num_blocks)

    def admit(self, rid: str, num_tokens: int, final_tokens: int) -> bool:
        if not self.mgr.can_allocate(rid, 0, num_tokens, reserve_blocks=self.reserve):
            return False
        return self.mgr.allocate_slots(rid, 0, num_tokens)

    def grow(self, rid: str, num_tokens: int) -> bool:
        return self.mgr.allocate_slots(rid, num_tokens - 1, num_tokens)

    def release(self, rid: str) -> None:
        self.mgr.free(rid)

    def allocated_slots(self) -> int:
        # Prefix caching is off, so every non-free block is held by a running sequence.
        return (self.mgr.num_blocks - self.mgr.num_free_blocks) * self.mgr.block_size


class _Contiguous:
    def __init__(self, kv_tokens: int, max_model_len: int) -> None:
        self.capacity = kv_tokens // max_model_len
        self.max_model_len = max_model_len
        self.held: set[str] = set()

    def admit(self, rid: str, num_tokens: int, final_tokens: int) -> bool:
        if len(self.held) >= self.capacity:
            return False
        self.held.add(rid)
        return True

    def grow(self, rid: str, num_tokens: int) -> bool:
        return True  # the reservation already covers max_model_len, and longer requests are skipped

    def release(self, rid: str) -> None:
        self.held.discard(rid)

    def allocated_slots(self) -> int:
        return len(self.held) * self.max_model_len


class _ContiguousReserve:
    """Reserves prompt + output length per request at admission: a server that knows
    ``max_tokens`` and holds one contiguous region per request (no growth, no preemption)."""

    def __init__(self, kv_tokens: int) -> None:
        self.capacity = kv_tokens
        self.held: dict[str, int] = {}
        self.reserved = 0

    def admit(self, rid: str, num_tokens: int, final_tokens: int) -> bool:
        if self.reserved + final_tokens > self.capacity:
            return False
        self.held[rid] = final_tokens
        self.reserved += final_tokens
        return True

    def grow(self, rid: str, num_tokens: int) -> bool:
        return True  # within the reservation by construction

    def release(self, rid: str) -> None:
        self.reserved -= self.held.pop(rid, 0)

    def allocated_slots(self) -> int:
        return self.reserved


# ---- replay --------------------------------------------------------------------------------


@dataclass(slots=True)
class _Seq:
    rid: str
    req: Request
    generated: int = 0  # output tokens so far; kept across a preemption (recomputed on re-admission)

    @property
    def num_tokens(self) -> int:
        return self.req.prompt_len + self.generated


@dataclass(slots=True)
class ReplayResult:
    steps: int = 0
    preemptions: int = 0
    peak_concurrency: int = 0
    peak_allocated: int = 0  # slots allocated at the peak-concurrency step
    peak_used: int = 0  # slots holding a token at that step
    concurrency_trace: list[int] = field(default_factory=list)
    # The peak can be a short spike; these average over the steps that still had a backlog,
    # i.e. while memory, not demand, bounded the batch.
    saturated_steps: int = 0
    saturated_seq_steps: int = 0
    saturated_allocated: int = 0
    saturated_used: int = 0

    @property
    def saturated_mean_concurrency(self) -> float:
        return self.saturated_seq_steps / self.saturated_steps if self.saturated_steps else 0.0

    @property
    def saturated_mean_waste(self) -> float:
        return 1.0 - self.saturated_used / self.saturated_allocated if self.saturated_allocated else 0.0

    @property
    def waste_at_peak(self) -> float:
        return 1.0 - self.peak_used / self.peak_allocated if self.peak_allocated else 0.0


def replay(requests: list[Request], alloc: _Allocator) -> ReplayResult:
    queue = deque(_Seq(f"r{i}", r) for i, r in enumerate(requests))
    running: dict[str, _Seq] = {}  # admission order: the last one is preempted first
    out = ReplayResult()
    while queue or running:
        out.steps += 1
        for seq in [s for s in running.values() if s.generated >= s.req.output_len]:
            alloc.release(seq.rid)
            del running[seq.rid]
        for seq in list(running.values()):
            if seq.rid not in running:
                continue  # preempted earlier in this step
            while not alloc.grow(seq.rid, seq.num_tokens + 1):
                victim = next(reversed(running.values()))
                alloc.release(victim.rid)
                del running[victim.rid]
                queue.appendleft(victim)
                out.preemptions += 1
                if victim is seq:
                    break
            else:
                seq.generated += 1
        while queue and alloc.admit(queue[0].rid, queue[0].num_tokens + 1,
                                    queue[0].req.prompt_len + queue[0].req.output_len):
            seq = queue.popleft()
            seq.generated += 1  # the prefill step yields the first output token
            running[seq.rid] = seq
        if not running and queue:
            raise RuntimeError(f"request {queue[0].rid} ({queue[0].req}) can never be admitted")
        out.concurrency_trace.append(len(running))
        if len(running) > out.peak_concurrency or queue:
            allocated = alloc.allocated_slots()
            used = sum(s.num_tokens for s in running.values())
            if len(running) > out.peak_concurrency:
                out.peak_concurrency, out.peak_allocated, out.peak_used = len(running), allocated, used
            if queue:
                out.saturated_steps += 1
                out.saturated_seq_steps += len(running)
                out.saturated_allocated += allocated
                out.saturated_used += used
    return out


def run(args: argparse.Namespace, report) -> dict:
    if args.max_model_len > args.kv_tokens:
        raise SystemExit("--max-model-len must not exceed --kv-tokens")
    per_trace: dict[str, dict] = {}
    results: dict[str, tuple[ReplayResult, ReplayResult, ReplayResult]] = {}
    for name, fname in TRACES.items():
        t0 = time.perf_counter()
        offered = load_trace(args.traces_dir / fname, args.max_requests)
        # Output length 0 still needs the prefill slot of its (not returned) first token.
        reqs = [Request(r.prompt_len, max(r.output_len, 1)) for r in offered]
        kept = [r for r in reqs if r.prompt_len + r.output_len <= args.max_model_len]
        report.progress(f"{name}: {len(kept)} requests replayed, {len(reqs) - len(kept)} skipped (> max-model-len)")
        paged = replay(kept, _Paged(args.kv_tokens, args.block_size, args.watermark))
        contiguous = replay(kept, _Contiguous(args.kv_tokens, args.max_model_len))
        reserve = replay(kept, _ContiguousReserve(args.kv_tokens))
        results[name] = (paged, contiguous, reserve)
        per_trace[name] = {
            "requests": len(kept),
            "skipped": len(reqs) - len(kept),
            "mean_prompt_len": sum(r.prompt_len for r in kept) / max(len(kept), 1),
            "mean_output_len": sum(r.output_len for r in kept) / max(len(kept), 1),
            "paged_peak_concurrency": paged.peak_concurrency,
            "contiguous_peak_concurrency": contiguous.peak_concurrency,
            "paged_waste": paged.waste_at_peak,
            "contiguous_waste": contiguous.waste_at_peak,
            "concurrency_ratio": paged.peak_concurrency / max(contiguous.peak_concurrency, 1),
            "paged_saturated_mean_concurrency": paged.saturated_mean_concurrency,
            "contiguous_saturated_mean_concurrency": contiguous.saturated_mean_concurrency,
            "saturated_concurrency_ratio": paged.saturated_mean_concurrency
            / max(contiguous.saturated_mean_concurrency, 1e-9),
            "paged_saturated_mean_waste": paged.saturated_mean_waste,
            "contiguous_saturated_mean_waste": contiguous.saturated_mean_waste,
            "reserve_peak_concurrency": reserve.peak_concurrency,
            "reserve_waste": reserve.waste_at_peak,
            "reserve_saturated_mean_concurrency": reserve.saturated_mean_concurrency,
            "concurrency_ratio_vs_reserve_max_tokens": paged.peak_concurrency / max(reserve.peak_concurrency, 1),
            "concurrency_ratio_mean_vs_reserve_max_tokens": paged.saturated_mean_concurrency
            / max(reserve.saturated_mean_concurrency, 1e-9),
            "paged_steps": paged.steps,
            "contiguous_steps": contiguous.steps,
            "reserve_steps": reserve.steps,
            "paged_preemptions": paged.preemptions,
            "seconds": time.perf_counter() - t0,
        }
    report.table(
        ["trace", "reqs", "skipped", "peak paged", "peak contig", "ratio", "mean ratio (saturated)",
         "peak reserve", "ratio vs reserve", "mean ratio vs reserve", "waste paged", "waste contig",
         "waste reserve", "preempt", "steps paged/contig/reserve"],
        [
            [n, r["requests"], r["skipped"], r["paged_peak_concurrency"], r["contiguous_peak_concurrency"],
             r["concurrency_ratio"], r["saturated_concurrency_ratio"], r["reserve_peak_concurrency"],
             r["concurrency_ratio_vs_reserve_max_tokens"], r["concurrency_ratio_mean_vs_reserve_max_tokens"],
             r["paged_waste"], r["contiguous_waste"], r["reserve_waste"], r["paged_preemptions"],
             f"{r['paged_steps']}/{r['contiguous_steps']}/{r['reserve_steps']}"]
            for n, r in per_trace.items()
        ],
    )
    if args.plot is not None:
        _plot(args.plot, results)
        report.progress(f"plot written to {args.plot}")
    # Conservative aggregates: the worst trace for paging on each figure.
    return {
        "paged_waste": max(r["paged_waste"] for r in per_trace.values()),
        "contiguous_waste": min(r["contiguous_waste"] for r in per_trace.values()),
        "concurrency_ratio": min(r["concurrency_ratio"] for r in per_trace.values()),
        "saturated_concurrency_ratio": min(r["saturated_concurrency_ratio"] for r in per_trace.values()),
        # Issue 15's name for the saturated mean; the old key stays for scripts that read it.
        "concurrency_ratio_mean": min(r["saturated_concurrency_ratio"] for r in per_trace.values()),
        "concurrency_ratio_vs_reserve_max_tokens": min(
            r["concurrency_ratio_vs_reserve_max_tokens"] for r in per_trace.values()),
        "concurrency_ratio_mean_vs_reserve_max_tokens": min(
            r["concurrency_ratio_mean_vs_reserve_max_tokens"] for r in per_trace.values()),
        "reserve_waste": min(r["reserve_waste"] for r in per_trace.values()),
        "aggregate": "paged_waste: max over traces; contiguous_waste, reserve_waste and every ratio: "
                     "min over traces",
        "per_trace": per_trace,
        "kv_tokens": args.kv_tokens,
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "max_requests": args.max_requests,
        "watermark": args.watermark,
    }


def _plot(path: Path, results: dict[str, tuple[ReplayResult, ReplayResult, ReplayResult]]) -> None:
    with figure(path, dpi=100, ncols=len(results), figsize=(5 * len(results), 3.5), squeeze=False) as (_, axes):
        for ax, (name, (paged, contiguous, reserve)) in zip(axes[0], results.items()):
            ax.plot(paged.concurrency_trace, label=f"paged (peak {paged.peak_concurrency})")
            ax.plot(contiguous.concurrency_trace,
                    label=f"contiguous max_model_len (peak {contiguous.peak_concurrency})")
            ax.plot(reserve.concurrency_trace, label=f"contiguous prompt+max_tokens (peak {reserve.peak_concurrency})")
            ax.set_title(name)
            ax.set_xlabel("decode step")
            ax.set_ylabel("running sequences")
            ax.legend(fontsize="small")

"""Plain functions the test modules share (fixtures are in conftest.py, clusters.py, services.py).

- ``wait_for``: poll a condition until it holds or a timeout passes.
- ``engine_config``, ``node_engine_config``: a tiny model's ``EngineConfig`` on CPU, sized by
  keyword: the cluster tests' engine and the hand-driven node tests' engine.
- ``prompt``: a deterministic prompt of token ids below the tiny models' vocabulary.
- ``tokens_of``: the token ids of a node's or router's streamed responses.
- ``run_bench``: ``pdserve bench ... --json`` in a subprocess, its JSON line parsed.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from engine.config import CacheConfig, EngineConfig, SchedulerConfig

REPO = Path(__file__).resolve().parent.parent


def wait_for(cond: Callable[[], object], timeout: float = 15.0, every: float = 0.02) -> bool:
    """Poll ``cond`` every ``every`` seconds until it is true; False if ``timeout`` seconds pass
    first. The condition is asked once more at the deadline, so a slow poll never loses a late
    success. Tests assert on the result: a timeout bounds a failure, it is not a measurement."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return bool(cond())


def engine_config(model: str | Path, *, block_size: int = 16, num_blocks: int = 256,
                  scheduler: SchedulerConfig = SchedulerConfig(), **fields) -> EngineConfig:
    """A tiny model's engine for tests: float32 on CPU with one torch thread (the tests share two
    cores) and a fixed pool of ``num_blocks`` blocks of ``block_size`` tokens. The defaults are
    the cluster tests' engine (nodes under a router); ``fields`` are other ``EngineConfig`` fields."""
    return EngineConfig(model=str(model), dtype="float32", device="cpu", num_threads=1,
                        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks), scheduler=scheduler,
                        **fields)


def node_engine_config(model: str | Path, num_blocks: int = 64, **fields) -> EngineConfig:
    """The engine of the tests that drive node servers by hand: 4-token blocks, so that short
    prompts span several blocks, and a batch of at most 128 tokens and 8 sequences."""
    return engine_config(model, block_size=4, num_blocks=num_blocks,
                         scheduler=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8), **fields)


def prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids in [3, 503), different for each ``seed`` (ids 0-2 are left to special tokens)."""
    return [(seed * 7919 + i * 31) % 500 + 3 for i in range(n)]


def tokens_of(msgs: Iterable) -> list[int]:
    """The token ids of the ``chunk`` messages of a ``GenerateResponse`` stream, in order."""
    return [t for m in msgs if m.WhichOneof("kind") == "chunk" for t in m.chunk.token_ids]


def run_bench(*args: str, timeout: float = 600) -> dict:
    """``pdserve bench <args> --json`` from the repository root: its last stdout line, parsed.
    A failure shows the end of the bench's stderr."""
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", *args, "--json"],
                       cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])

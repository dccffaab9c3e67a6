"""Rank 0 of a tensor-parallel engine: the worker processes, the gloo group, and the model runner
that broadcasts each step's inputs before running its own shard (vLLM's executor/worker split).

Rank 0 is the ordinary LLMEngine (scheduler, KV cache manager, sampler) over its shard: its
model config says its heads, so its KV pool holds its KV heads, and every other rank allocates
the same number of blocks, so one block table addresses every rank's pool. A rank that dies or
stalls fails the engine as a whole: the step that notices raises TensorParallelError and every
later step raises it again at once (nothing hangs: every collective has a timeout).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch

from engine.attention.kv_cache import bytes_per_block, kv_cache_shape
from engine.config import EngineConfig
from engine.device import resolve_device, torch_dtype
from engine.engine import LLMEngine
from engine.model_runner import ModelRunner, StepBatch
from engine.models.loader import checkpoint_fingerprint, resolve_source
from engine.parallel.kv_regroup import SharedPools
from engine.parallel.plan import TensorParallelConfig, TensorParallelError, check_tensor_parallel, shard_config
from engine.parallel.shard import load_shard, make_row_parallel
from engine.parallel.step import StepInputs, broadcast, pack, stop_header
from engine.parallel.worker import WorkerSpec, make_group, open_store
from engine.scheduler import SchedulerOutput

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Workers:
    """Ranks 1 .. N-1 as child processes, and rank 0's end of the gloo group."""

    def __init__(self, spec: WorkerSpec, tp: TensorParallelConfig, kv_paths: list[str]):
        self.tp = tp
        self.failure: str | None = None  # set once: the engine is failed from then on
        self.store, self.group = None, None
        self.procs: list[subprocess.Popen] = []
        # The store first (port 0: the kernel picks a free one), so workers know where to join.
        self.store = open_store(0, tp.size, True, tp.start_timeout_s)
        spec = dataclasses.replace(spec, store_port=self.store.port)
        for rank in range(1, tp.size):
            argv = WorkerSpec.argv(dataclasses.replace(spec, rank=rank, kv_path=kv_paths[rank - 1]))
            # stdin is the worker's lifeline (it exits when ours closes); stderr is shared.
            self.procs.append(subprocess.Popen([sys.executable, "-m", "engine.parallel.worker", *argv],
                                               cwd=_REPO, stdin=subprocess.PIPE))

    def join(self) -> None:
        """Wait until every rank joined the group (bounded by start_timeout_s), failing early
        when a worker exits first (a load error: its message is on stderr)."""
        box: dict = {}

        def connect() -> None:
            try:
                box["group"] = make_group(self.store, 0, self.tp.size, self.tp.start_timeout_s)
            except Exception as e:  # reported below, on the caller's thread
                box["error"] = e

        t = threading.Thread(target=connect, daemon=True)
        t.start()
        deadline = time.monotonic() + self.tp.start_timeout_s
        while t.is_alive() and time.monotonic() < deadline:
            t.join(0.05)
            dead = self.dead()
            if dead:
                raise TensorParallelError(f"tensor-parallel start failed: {dead}")
        if t.is_alive():
            raise TensorParallelError(f"tensor-parallel start failed: {self.tp.size} ranks did not all join "
                                      f"within {self.tp.start_timeout_s:g} s")
        if "error" in box:
            raise TensorParallelError(f"tensor-parallel start failed: {box['error']}") from box["error"]
        self.group = box["group"]

    def dead(self) -> str | None:
        """Which worker exited, if any."""
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                return f"rank {rank} (pid {p.pid}) exited with code {p.returncode}"
        return None

    def fail(self, why: str) -> TensorParallelError:
        """Fail the engine as a whole: the other workers are killed (their shards are useless
        without the lost one) and this error is what every later step raises."""
        if self.failure is None:
            self.failure = why
            self._kill()
        return TensorParallelError(f"tensor-parallel engine failed: {self.failure}")

    def send_step(self, step: StepInputs) -> None:
        if self.failure is not None:
            raise self.fail(self.failure)
        dead = self.dead()
        if dead:
            raise self.fail(dead)
        header, payload = pack(step)  # [5], [n] int64
        timeout = timedelta(seconds=self.tp.step_timeout_s)
        try:
            broadcast(self.group, header, timeout)
            broadcast(self.group, payload, timeout)
        except RuntimeError as e:
            raise self.fail(self._why(e)) from e

    def _why(self, e: Exception) -> str:
        # A closed connection usually means a dead worker: name it when it already exited.
        time.sleep(0.05)
        return self.dead() or f"a collective failed or took more than {self.tp.step_timeout_s:g} s: {e}"

    def close(self) -> None:
        """Ask the workers to stop, then kill whatever did not within stop_timeout_s."""
        if self.group is not None and self.failure is None and not self.dead():
            try:
                broadcast(self.group, stop_header(), timedelta(seconds=self.tp.stop_timeout_s))
                deadline = time.monotonic() + self.tp.stop_timeout_s
                for p in self.procs:
                    p.wait(max(0.0, deadline - time.monotonic()))
            except (RuntimeError, subprocess.TimeoutExpired):
                pass  # a worker gone or stuck: killed below
        self._kill()  # the rest (a failed engine, a start that did not finish) at once
        self.failure = self.failure or "closed"

    def _kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stdin is not None:
                p.stdin.close()


class TPModelRunner(ModelRunner):
    """ModelRunner whose forward first broadcasts the step to the workers; the all-reduces in
    its model's row-parallel layers then pair with theirs."""

    def __init__(self, workers: Workers, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.workers = workers

    def _layer_hook(self, out, tables):
        # Layer-wise KV streaming would hand the transfer rank 0's KV heads only.
        if self.kv_layer_listener is not None:
            raise TensorParallelError("layer-wise KV streaming is not supported with tensor parallelism yet")
        return None

    def _run_model(self, out: SchedulerOutput, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        self.workers.send_step(StepInputs(input_ids=batch.input_ids, positions=batch.positions,
                                          q_lens=batch.q_lens, seq_lens=batch.seq_lens,
                                          block_tables=batch.tables, block_copies=list(out.block_copies)))
        try:
            return super()._run_model(out, batch)
        except RuntimeError as e:  # an all-reduce inside the forward
            raise self.workers.fail(self.workers._why(e)) from e


class TensorParallelEngine:
    """An LLMEngine over ``tp.size`` ranks; ``engine`` is used as any engine, ``close`` (or the
    with block) stops the workers. ``kv_pools``: every rank's pool in rank order (rank 0's is
    ``engine.kv_cache``, the others map the workers' shared memory), ``[L, N, 2, bs, H_kv/TP, D]``
    each: what kv_regroup.py gathers a send from and scatters a receive into."""

    def __init__(self, engine: LLMEngine, workers: Workers, kv_pools: list[torch.Tensor]):
        self.engine = engine
        self.workers = workers
        self.kv_pools = kv_pools

    @property
    def size(self) -> int:
        return self.workers.tp.size

    def close(self) -> None:
        self.workers.close()

    def __enter__(self) -> "TensorParallelEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _refuse_unsupported(config: EngineConfig) -> None:
    # Each of these reads or writes rank 0's KV or model outside the broadcast step.
    if config.speculative.enabled:
        raise TensorParallelError("speculative decoding is not supported with tensor parallelism yet")
    if config.cache.host_cache_mib or config.cache.disk_cache_dir:
        raise TensorParallelError("KV tiers (host / disk cache) are not supported with tensor parallelism yet")


def start_tp_engine(config: EngineConfig, tp: TensorParallelConfig, progress=None, tokenizer=None,
                    load_tokenizer: bool = True) -> TensorParallelEngine:
    """Validate, start the workers, load rank 0's shard and build its engine; raises
    TensorParallelError with the reason, never leaving a worker behind."""
    device = resolve_device(config.device)
    directory = resolve_source(config.model, progress)
    full, fingerprint = checkpoint_fingerprint(directory)
    check_tensor_parallel(full, tp.size, device.type, torch.cuda.device_count())
    if device.type != "cpu":
        raise TensorParallelError(f"tensor parallelism runs on CPU (gloo) only so far, not {device.type}")
    _refuse_unsupported(config)
    dtype = torch_dtype(config.dtype)
    cc = config.cache
    num_blocks = cc.num_blocks or max(1, cc.kv_cache_bytes // bytes_per_block(shard_config(full, tp.size),
                                                                               cc.block_size, dtype))
    config = dataclasses.replace(config, cache=dataclasses.replace(cc, num_blocks=num_blocks))
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // tp.size)
    # The workers' pools in shared memory rank 0 maps too (kv_regroup.py): [L, N, 2, bs, H_kv/TP, D] each.
    shared = SharedPools(tp.size, kv_cache_shape(shard_config(full, tp.size), num_blocks, cc.block_size), dtype)
    spec = WorkerSpec(rank=0, size=tp.size, store_port=0, model_dir=str(directory), dtype=config.dtype,
                      num_blocks=num_blocks, block_size=cc.block_size, num_threads=threads,
                      start_timeout_s=tp.start_timeout_s, step_timeout_s=tp.step_timeout_s,
                      idle_timeout_s=tp.idle_timeout_s, kv_path="")
    try:
        workers = Workers(spec, tp, shared.paths)
    except BaseException:
        shared.unlink()
        raise
    try:
        # The whole model's fingerprint: a block's KV leaves and arrives with all its heads
        # (kv_regroup.py), so nodes of any TP size share blocks, hashes and the router's view.
        loaded = load_shard(directory, 0, tp.size, dtype, device, fingerprint)
        workers.join()
        make_row_parallel(loaded.model, workers.group, tp.step_timeout_s)
        engine = LLMEngine(config, progress=progress, loaded=loaded, tokenizer=tokenizer,
                           load_tokenizer=load_tokenizer, runner_class=functools.partial(TPModelRunner, workers))
    except BaseException:
        workers.close()
        raise
    finally:
        shared.unlink()  # every worker mapped its file (or is gone): no name left to clean up
    return TensorParallelEngine(engine, workers, [engine.kv_cache, *shared.pools])

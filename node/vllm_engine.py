"""A vLLM engine behind the node's engine seam: ``VllmEngine`` has the part of ``LLMEngine``'s
interface that ``AsyncEngine`` (node/engine_thread.py) and ``NodeServer`` use, and runs the real
engine in a child process under vLLM's own Python (node/vllm_child.py).

Why a child: vLLM pins transformers, llguidance and numpy older than the project's, so it lives
in its own environment (`make vllm`: .venv-vllm). The node actor stays in the project's venv;
the two talk over a socket pair with protobuf frames (node/vllm_wire.py). Everything the node
does around its engine (registration, heartbeats, leases, drain, metrics, health) is then the
same code as for a pdserve-engine node: the engine loop thread steps this object as it would
an LLMEngine, and a step here is "take what the child sent".

A dead child is a dead engine: a reader thread sees the socket close and wakes the loop, and
the next ``step`` (or ``service_tiers`` on an idle loop) raises ``VllmWorkerDied``, a
``BaseException`` like node/faults.py's ``InjectedLoopDeath``: it passes the step's handler and
ends the loop, so the node turns unhealthy at once (NOT_SERVING, out of the index, its streams
end UNAVAILABLE and the router moves them) instead of after ``max_step_failures`` steps.

Load figures are the node's own view (requests it sent, tokens each holds, blocks at vLLM's
block size), since vLLM's scheduler lives in the child; they steer placement as an LLMEngine's do.
"""
from __future__ import annotations

import logging
import math
import os
import queue
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.errors import InvalidRequestError
from engine.outputs import CompletionOutput, RequestOutput, RequestTimes
from node.output_stream import EngineStoppedError
from node.vllm_wire import FrameError, FrameReader, UnsupportedByVllm, parse_event, send, to_worker_sampling
from protos.pdserve.v1 import vllm_worker_pb2 as wpb
from tokens.sampling_params import SamplingParams

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON_ENV = "PDSERVE_VLLM_PYTHON"
# How long one step waits for the child's next output before handing the loop back (commands
# run between steps, so this bounds how late an abort or a new request reaches the child).
STEP_WAIT_S = 0.02
START_TIMEOUT_S = 300.0


class VllmWorkerDied(BaseException):
    """The vLLM child exited or failed: past the step's ``except Exception``, out of the loop."""


def vllm_python(configured: str | None = None, env=os.environ) -> str:
    """vLLM's interpreter: ``configured``, else $PDSERVE_VLLM_PYTHON, else the repo's
    .venv-vllm (`make vllm`). Raises naming all three when none exists."""
    for cand in (configured, env.get(VLLM_PYTHON_ENV), str(REPO / ".venv-vllm" / "bin" / "python")):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise FileNotFoundError(f"no vLLM Python: set --vllm-python or ${VLLM_PYTHON_ENV}, or run `make vllm` "
                            f"(builds {REPO / '.venv-vllm'} from requirements/vllm.lock)")


def check_checkpoint(model_dir: str | Path) -> None:
    """Refuse a checkpoint vLLM would serve wrongly without an error: tied embeddings stored only
    as ``lm_head.weight`` (this project's model cache of format 1) load in vLLM as zero
    embeddings and every answer is token id 0. The cache of format 2 stores them as
    ``model.embed_tokens.weight`` (engine/models/builtin.py)."""
    from engine.models.loader import tensor_names

    names = tensor_names(model_dir)
    if "model.embed_tokens.weight" not in names:
        raise InvalidRequestError(
            f"{model_dir} has no model.embed_tokens.weight (tied embeddings stored as lm_head.weight only): vLLM "
            f"would serve it with zero embeddings; convert it again (delete the cache dir) or add the tensor")


def resumed_params(params: SamplingParams, resumed: int) -> SamplingParams:
    """A continuation's parameters for vLLM, which sees the ``resumed`` tokens as prompt: the
    token budgets count them. Greedy and unpenalized continuations are then the run that never
    failed; vLLM's seeded draws and its presence/frequency penalties do not count them (docs/
    cluster.md, "vLLM nodes")."""
    if params.max_tokens <= resumed:
        raise InvalidRequestError(f"max_tokens {params.max_tokens} already spent by {resumed} resumed tokens")
    return replace(params, max_tokens=params.max_tokens - resumed, min_tokens=max(0, params.min_tokens - resumed))


@dataclass(slots=True)
class _Open:
    """One request the child holds, as the node sees it."""

    prompt: list[int]
    times: RequestTimes
    output: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


class _Sched:
    """The scheduler figures AsyncEngine reads, from the node's own view of its requests."""

    def __init__(self, reqs: dict[str, _Open]) -> None:
        self._reqs = reqs
        self.num_preemptions = 0

    @property
    def running(self) -> list[_Open]:
        return [r for r in self._reqs.values() if r.output]

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self._reqs) - self.num_running


class _Kv:
    def __init__(self, eng: VllmEngine) -> None:
        self._eng = eng

    @property
    def num_free_blocks(self) -> int:
        e = self._eng
        used = sum(math.ceil(r.num_tokens / e.block_size) for r in e._open.values())
        return max(0, e.num_blocks - used)

    @property
    def usage(self) -> float:
        e = self._eng
        return 1.0 - self.num_free_blocks / e.num_blocks if e.num_blocks else 0.0


class _NoStructured:
    def compile(self, spec) -> None:
        if spec is not None:
            raise InvalidRequestError(f"structured: a vLLM node does not take structured outputs yet ({spec.kind})")


class VllmEngine:
    """Starts the child and waits for its Ready (raises naming the child's last words when it
    does not come); see the module docstring."""

    def __init__(self, model_dir: str, *, dtype: str = "float32", seed: int = 0, max_model_len: int | None = None,
                 kv_cache_bytes: int | None = None, python: str | None = None, fingerprint: str, env: dict | None = None,
                 start_timeout_s: float = START_TIMEOUT_S, step_tokens: int | None = None) -> None:
        check_checkpoint(model_dir)
        self._open: dict[str, _Open] = {}
        self._pending: list[RequestOutput] = []  # aborts answered here, handed out by the next step
        self._events: queue.Queue = queue.Queue()
        self._notify: Callable[[], None] | None = None
        self.scheduler, self.kv, self.structured = _Sched(self._open), _Kv(self), _NoStructured()
        self.num_steps, self.last_step_prefill_tokens = 0, 0
        self.step_tokens = step_tokens
        self.prefix_query_tokens = self.prefix_hit_tokens = 0
        self.dead: str | None = None
        self._sock, child = socket.socketpair()
        self._stderr = tempfile.NamedTemporaryFile(prefix="pdserve-vllm-", suffix=".log", delete=False)
        argv = [vllm_python(python), "-m", "node.vllm_child", "--fd", str(child.fileno()), "--model", str(model_dir),
                "--dtype", dtype, "--seed", str(seed)]
        if max_model_len:
            argv += ["--max-model-len", str(max_model_len)]
        if kv_cache_bytes:
            argv += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
        child_env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        self.proc = subprocess.Popen(argv, pass_fds=[child.fileno()], env=child_env, cwd=REPO,
                                     stdin=subprocess.DEVNULL, stdout=self._stderr, stderr=subprocess.STDOUT)
        child.close()
        self.ready = self._wait_ready(start_timeout_s)
        self.num_blocks, self.block_size = self.ready.num_blocks, self.ready.block_size
        self.max_model_len, self.vocab_size = self.ready.max_model_len, self.ready.vocab_size
        self.fingerprint = fingerprint
        threading.Thread(target=self._read, name=f"vllm-reader-{self.proc.pid}", daemon=True).start()

    def _wait_ready(self, timeout_s: float) -> wpb.WorkerReady:
        reader = FrameReader()
        self._sock.settimeout(timeout_s)
        try:
            while True:
                for frame in reader.read_available(self._sock):
                    ev = parse_event(frame)
                    if ev.WhichOneof("kind") == "ready":
                        self._reader = reader
                        self._sock.settimeout(None)
                        return ev.ready
                    self.proc.kill()
                    raise RuntimeError(ev.failed.message or "the vLLM child sent no Ready")
        except (FrameError, OSError) as err:  # it died without a word: its log says why
            self.proc.kill()
            raise RuntimeError(f"the vLLM child did not start ({err}); its log {self._stderr.name} ends: "
                               f"{self.last_words()}") from err

    def last_words(self, n: int = 600) -> str:
        try:
            return Path(self._stderr.name).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # ---- the reader thread: the child's frames into a queue, its end noted
    def _read(self) -> None:
        try:
            while True:
                for frame in self._reader.read_available(self._sock):
                    self._events.put(parse_event(frame))
                    self._wake()
        except (FrameError, OSError) as err:
            rc = self.proc.wait()
            self.dead = f"the vLLM child (pid {self.proc.pid}) exited with {rc} ({err})"
            self._events.put(None)
            self._wake()

    def _wake(self) -> None:
        if self._notify is not None:
            self._notify()

    # ---- what AsyncEngine calls (its loop thread)
    def set_tiers_notifier(self, fn: Callable[[], None]) -> None:
        self._notify = fn  # wakes the loop when the child sent something or died

    def set_step_tokens(self, n: int | None) -> None:
        self.step_tokens = n

    def set_kv_layer_listener(self, listener) -> None:
        pass  # no layer-by-layer KV out of vLLM (issue 46, section 2)

    def add_request(self, request_id: str | None, prompt_token_ids: Sequence[int], params: SamplingParams,
                    hold_kv: bool = False, resumed_output_tokens: int = 0, stream_kv: bool = False,
                    cache_salt: bytes = b"") -> str:
        self._check_alive()
        prompt = list(prompt_token_ids)
        if hold_kv or stream_kv:
            raise InvalidRequestError("a vLLM node prefills for itself only: no held or streamed KV")
        if cache_salt:
            raise InvalidRequestError("cache_salt: a vLLM node does not salt its prefix cache per tenant yet")
        if not request_id or request_id in self._open:
            raise InvalidRequestError(f"request id {request_id!r} is missing or already running")
        if not prompt or len(prompt) >= self.max_model_len:
            raise InvalidRequestError(f"prompt has {len(prompt)} tokens; the vLLM engine's context is "
                                      f"{self.max_model_len} tokens")
        if any(t >= self.vocab_size for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        if resumed_output_tokens:  # a migrated request: its first k "prompt" tokens are output (router/migration.py)
            params = resumed_params(params, resumed_output_tokens)
        try:
            wire = to_worker_sampling(params)
        except UnsupportedByVllm as err:
            raise InvalidRequestError(f"{err.field}: {err}") from None
        send(self._sock, wpb.WorkerCommand(add=wpb.WorkerAdd(request_id=request_id, prompt_token_ids=prompt,
                                                             sampling=wire)))
        self._open[request_id] = _Open(prompt, RequestTimes(arrival_time=time.monotonic()))
        self.prefix_query_tokens += len(prompt)
        return request_id

    def abort(self, request_id: str) -> bool:
        req = self._open.pop(request_id, None)
        if req is None:
            return False
        if self.dead is None:
            try:
                send(self._sock, wpb.WorkerCommand(abort=wpb.WorkerAbort(request_id=request_id)))
            except OSError:
                pass  # the child is gone; the reader reports it
        req.times.finished_time = time.monotonic()
        self._pending.append(RequestOutput(request_id, req.prompt, [CompletionOutput(
            0, req.output, [], "", "", finish_reason="abort")], True, 0, req.times))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._open or self._pending)

    def step(self) -> list[RequestOutput]:
        outs, self._pending = self._pending, []
        self.last_step_prefill_tokens = 0
        try:
            ev = self._events.get(timeout=STEP_WAIT_S) if not outs else self._events.get_nowait()
        except queue.Empty:
            return outs
        while ev is not None:
            out = self._event(ev)
            if out is not None:
                outs.append(out)
            try:
                ev = self._events.get_nowait()
            except queue.Empty:
                break
        if ev is None:
            raise VllmWorkerDied(self.dead or "the vLLM child is gone")
        if outs:
            self.num_steps += 1
        return outs

    def _event(self, ev: wpb.WorkerEvent) -> RequestOutput | None:
        kind = ev.WhichOneof("kind")
        if kind == "failed":
            if not ev.failed.request_id:
                raise VllmWorkerDied(ev.failed.message)
            req = self._open.pop(ev.failed.request_id, None)
            if req is not None:  # the stream ends; vLLM's reason is logged
                log.warning("vLLM refused request %s: %s", ev.failed.request_id, ev.failed.message)
                return RequestOutput(ev.failed.request_id, req.prompt, [CompletionOutput(
                    0, req.output, [], "", "", finish_reason="abort")], True, 0, req.times)
            return None
        o = ev.output
        req = self._open.get(o.request_id)
        if req is None:
            return None  # aborted here already
        now = time.monotonic()
        if not req.output and o.new_token_ids:
            req.times.first_scheduled_time = req.times.first_token_time = now
            self.last_step_prefill_tokens += len(req.prompt)
            self.prefix_hit_tokens += o.num_cached_tokens
        req.output.extend(o.new_token_ids)
        if o.finished:
            del self._open[o.request_id]
            req.times.finished_time = now
        return RequestOutput(o.request_id, req.prompt, [CompletionOutput(
            0, list(req.output), list(o.new_token_ids), "", o.text_delta,
            finish_reason=o.finish_reason or None)], o.finished, o.num_cached_tokens, req.times)

    def service_tiers(self) -> None:
        if self.dead is not None:  # an idle loop woken by the reader: the child is gone
            raise VllmWorkerDied(self.dead)

    def take_kv_events(self) -> list:
        return []  # vLLM's blocks are not in pdserve's index yet (issue 46, section 2)

    def stats(self) -> dict:
        return {"num_blocks": self.num_blocks, "free_blocks": self.kv.num_free_blocks, "kv_usage": self.kv.usage,
                "running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting, "preemptions": 0,
                "prefix_cache_query_tokens": self.prefix_query_tokens, "prefix_cache_hit_tokens": self.prefix_hit_tokens,
                "cached_blocks": 0, "device_hit_blocks": 0, "tiers": None, "speculative": None,
                "engine_backend": "vllm", "vllm_version": self.ready.vllm_version, "vllm_pid": self.proc.pid}

    def _check_alive(self) -> None:
        if self.dead is not None:  # a command's caller gets what a stopped engine raises
            raise EngineStoppedError(self.dead)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the child to exit, then make sure it did."""
        if self.proc.poll() is None:
            try:
                send(self._sock, wpb.WorkerCommand(shutdown=wpb.WorkerShutdown()))
                self.proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._sock.close()
        if self.proc.returncode == 0:  # a clean exit: its log says nothing worth keeping
            Path(self._stderr.name).unlink(missing_ok=True)


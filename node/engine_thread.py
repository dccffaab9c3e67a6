"""AsyncEngine: one thread owns an LLMEngine; any other thread talks to it through commands.

LLMEngine is single-threaded by design. A node's gRPC handlers run on a thread pool, so they
never touch the engine: they submit commands (add a request, reserve or release KV, abort) that
the loop thread runs between steps, and they read their request's outputs from its own
``OutputStream`` (node/output_stream.py)::

    gRPC threads --commands (Future)--> [ loop thread: commands, step, dispatch ] --> streams
                                                   |                                    |
                            KV events -> on_kv_events callback        per-request queues

The loop steps while the engine has work and sleeps on a condition otherwise (no busy spin),
including when waiting requests cannot be admitted: only a command (abort, release) can free
the blocks they need, and every command wakes the loop. The engine's KV tiers (host and disk,
engine/kv_tiers/) wake it too when a copy or a file write finished, so an idle loop still takes
their results (events, freed blocks) at once.

A step that raises fails every open request (``RequestFailedError``, "engine step failed: ...";
the servers answer INTERNAL and the router moves them once). ``max_step_failures`` failed steps
in a row, or the loop thread dying of anything else, make the engine unhealthy
(node/health.py): the loop stops, whatever is still open fails with ``EngineStoppedError``
naming the reason, and ``on_unhealthy(reason)`` tells the node (which leaves the index).

No ray, grpc or redis here: the servers wrap this.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from engine.engine import LLMEngine
from engine.outputs import RequestOutput
from node.faults import StepFault
from node.health import StepHealth
from node.output_stream import EngineStoppedError, OutputStream, RequestFailedError
from node.step_time import DecodeStepAverage, LoadSnapshot, StepAverage, fresh
from tokens.sampling_params import SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a caller waits for a command to run: a command waits at most for the step in
# progress, so this only trips when the loop is wedged.
COMMAND_TIMEOUT_S = 60.0
# The engine's cumulative stats (``stats``) are re-read at most this often while it steps, and
# after the last step before it idles: a scrape reads the copy, never waits for a step.
STATS_PERIOD_S = 0.05
# An idle loop wakes this often to show it is alive (AsyncEngine.progress).
IDLE_TICK_S = 0.25


class _Command:
    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[LLMEngine], Any]) -> None:
        self.fn = fn
        self.future: Future = Future()


class AsyncEngine:
    """Runs ``engine`` on a loop thread (started here); see the module docstring.

    ``on_kv_events`` receives each batch of block events (BlockStored / BlockRemoved /
    AllBlocksCleared) on the loop thread: it must be quick (hand them to another thread), as
    must ``on_unhealthy`` (called once, on the loop thread, as it stops).
    """

    def __init__(
        self,
        engine: LLMEngine,
        on_kv_events: Callable[[list], None] | None = None,
        name: str = "engine-loop",
        max_step_failures: int = 3,
        on_unhealthy: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_kv_events = on_kv_events
        self._cond = threading.Condition()
        self._commands: deque[_Command] = deque()
        self._stopping = False
        # Owned by the loop thread (commands run there too): request id -> its stream.
        self._streams: dict[str, OutputStream] = {}
        # LoadSnapshot.step_s and .decode_step_s; the loop thread writes, _snapshot and load read
        self._steps, self._decode_steps = StepAverage(), DecodeStepAverage()
        self._load = self._snapshot()
        self._stats: dict = engine.stats()
        self._stats_at = time.monotonic()
        self.health = StepHealth(max_step_failures)
        self.unhealthy_reason: str | None = None  # set once, when the loop stops unhealthy
        self._on_unhealthy = on_unhealthy
        # Fault injection (node/faults.py): hooked into the model on first use only.
        self.step_fault = StepFault()
        # Fault injection (tests and `pdserve chaos`: a slow node): seconds to sleep after each
        # step. Set in the node's own process only; nothing on the wire reaches it.
        self.step_delay_s = 0.0
        # Liveness (``progress``): bumped by the loop on every iteration (after each step, and
        # every IDLE_TICK_S while it sleeps) and by each decoder layer a step completes. A
        # decode node heartbeats a silent stream only while it moves (decode_node/server.py),
        # so an engine wedged in a step (stuck in a layer, or between steps) goes quiet and the
        # router's progress deadline moves its requests; one merely slow (a long prompt chunk
        # beside a full batch on a CPU core: steps of seconds in the elastic benchmark)
        # still moves, layer by layer.
        self._ticks = 0
        self._layers_done = 0  # written by the model's layer hooks, on the loop thread only
        self._tiers_woke = False  # a tier worker finished something (loop thread resets it)
        engine.set_tiers_notifier(self._wake_for_tiers)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ commands
    def call(self, fn: Callable[[LLMEngine], T]) -> Future:
        """Run ``fn(engine)`` on the loop thread between steps; its result or exception
        lands in the returned Future."""
        cmd = _Command(fn)
        with self._cond:
            if self._stopping or not self._thread.is_alive():
                raise EngineStoppedError(self._stopped_why())
            self._commands.append(cmd)
            self._cond.notify()
        return cmd.future

    def run(self, fn: Callable[[LLMEngine], T], timeout: float = COMMAND_TIMEOUT_S) -> T:
        """``call`` and wait for the result (re-raising the command's exception)."""
        return self.call(fn).result(timeout)

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        hold_kv: bool = False,
        resumed_output_tokens: int = 0,
        stream_kv: bool = False,
        cache_salt: bytes = b"",
    ) -> OutputStream:
        """Queue a request; raises InvalidRequestError right away when it can never run.
        ``stream_kv``, ``cache_salt``: see ``LLMEngine.add_request`` (the engine's
        kv_layer_listener hears of its blocks layer by layer, on the loop thread)."""

        # A constraint compiles here, on the caller's thread: a slow compile never stalls a step.
        self.engine.structured.compile(params.structured)

        def add(eng: LLMEngine) -> OutputStream:
            rid = eng.add_request(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                  params=params, hold_kv=hold_kv, resumed_output_tokens=resumed_output_tokens,
                                  stream_kv=stream_kv, cache_salt=cache_salt)
            return self._open_stream(rid)

        return self.run(add)

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        params: SamplingParams,
        num_cached_tokens: int = 0,
        resumed_output_tokens: int = 0,
        cache_salt: bytes = b"",
    ) -> OutputStream:
        """Decode role: continue a request whose prompt KV sits in its reserved blocks."""

        self.engine.structured.compile(params.structured)  # as in add_request

        def add(eng: LLMEngine) -> OutputStream:
            eng.add_prefilled_request(request_id, prompt_token_ids, output_token_ids, params,
                                      num_cached_tokens=num_cached_tokens, resumed_output_tokens=resumed_output_tokens,
                                      cache_salt=cache_salt)
            return self._open_stream(request_id)

        return self.run(add)

    def reserve_kv(self, request_id: str, prompt_token_ids: Sequence[int],
                   cache_salt: bytes = b"") -> tuple[list[int], int] | None:
        return self.run(lambda eng: eng.reserve_kv(request_id, prompt_token_ids, cache_salt))

    def release_kv(self, request_id: str) -> None:
        self.run(lambda eng: eng.release_kv(request_id))

    def held_block_table(self, request_id: str) -> list[int]:
        return self.run(lambda eng: eng.held_block_table(request_id))

    def abort(self, request_id: str) -> bool:
        """Abort a running or waiting request; its stream ends with an abort output."""
        return self.run(lambda eng: eng.abort(request_id))

    # ---- prefix export and import (a peer fetches a prefix: node/ and the role servers)
    def held_prefix(self, block_hashes: Sequence[int], token_ids: Sequence[int], cache_salt: bytes = b"") -> list[int]:
        """``LLMEngine.held_prefix`` on the loop thread: the tier of each leading block held."""
        return self.run(lambda eng: eng.held_prefix(block_hashes, token_ids, cache_salt))

    def export_prefix(self, export_id: str, block_hashes: Sequence[int], token_ids: Sequence[int],
                      cache_salt: bytes = b"") -> list[int]:
        """``LLMEngine.export_prefix``: the block ids, held until ``release_export``; send them
        from ``engine.kv_cache`` with any transport. Always release, also after a failed send."""
        return self.run(lambda eng: eng.export_prefix(export_id, block_hashes, token_ids, cache_salt))

    def release_export(self, export_id: str) -> None:
        self.run(lambda eng: eng.release_export(export_id))

    def commit_kv(self, request_id: str, prompt_token_ids: Sequence[int], cache_salt: bytes = b"") -> int:
        """``LLMEngine.commit_kv``: KV received into ``reserve_kv``'s blocks becomes cached."""
        return self.run(lambda eng: eng.commit_kv(request_id, prompt_token_ids, cache_salt))

    @property
    def load(self) -> LoadSnapshot:
        """Refreshed every loop iteration; safe to read from any thread (one attribute read).
        An idle loop refreshes nothing, so the step time is dropped here once it is stale: a
        node once slow must not stay avoided forever for want of steps to measure."""
        return fresh(self._load, self._steps, self._decode_steps, time.monotonic())

    @property
    def stats(self) -> dict:
        """``LLMEngine.stats()`` as of the last refresh (see STATS_PERIOD_S); safe to read from
        any thread: the loop replaces the dict, never mutates it."""
        return self._stats

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def num_step_errors(self) -> int:
        return self.health.failed_steps

    def set_step_fault(self, steps: int, fatal: bool = False) -> int:
        """Fault injection (node/faults.py): the next ``steps`` steps raise inside the model's
        forward (-1: every step until ``set_step_fault(0)``; ``fatal``: the loop thread dies of
        it). Returns the steps it failed so far."""
        if not self.step_fault.installed:  # hooks change on the loop thread, between steps
            self.run(lambda eng: self.step_fault.install(eng.runner.model))
        self.step_fault.arm(steps, fatal)
        return self.step_fault.raised

    def _stopped_why(self) -> str:
        if self.unhealthy_reason is not None:
            return f"the engine stopped, unhealthy: {self.unhealthy_reason}"
        return "the engine loop is not running"

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop after the step in progress; open streams and queued commands fail
        with EngineStoppedError. Then the engine's tiers finish their queued file writes (the
        disk tier is what a restarted node finds)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("engine loop did not stop within %.1fs", timeout)
                return
            self.engine.close()

    def fail_open(self, reason: str) -> int:
        """Fail every open request with ``EngineStoppedError(reason)`` (the servers answer
        UNAVAILABLE, and routers move the request exactly: router/migration.py) and free its
        blocks; the loop goes on. What a role switch does with work still held when its drain
        time is up (node/role_switch.py). Returns how many requests were failed."""

        def fail(eng: LLMEngine) -> int:
            n = len(self._streams)
            self._fail_requests(EngineStoppedError(reason))
            return n

        return self.run(fail)

    def set_on_unhealthy(self, callback: Callable[[str], None] | None) -> None:
        """Who hears that the engine turned unhealthy: the server serving over it now (a node
        that switched role hands its engine to the next role's server)."""
        self._on_unhealthy = callback

    def _wake_for_tiers(self) -> None:
        # Called on a tier worker thread.
        with self._cond:
            self._tiers_woke = True
            self._cond.notify()

    # ------------------------------------------------------------------ loop thread
    def _open_stream(self, request_id: str) -> OutputStream:
        stream = OutputStream(request_id, self._cancel)
        self._streams[request_id] = stream
        return stream

    def _cancel(self, request_id: str) -> None:
        # Fire and forget: a client disconnect callback must not block on the loop.
        self.call(lambda eng: eng.abort(request_id))

    @property
    def progress(self) -> int:
        """A counter that moves while the engine does: loop iterations and decoder layers run."""
        return self._ticks + self._layers_done

    def _count_layers(self) -> None:
        """Hook every decoder layer of the engine's model (where it has a ``layers`` list): one
        more layer done moves ``progress``. Installed on the loop thread, before its first step."""
        model = getattr(getattr(self.engine, "runner", None), "model", None)
        for layer in getattr(model, "layers", None) or ():
            layer.register_forward_hook(self._layer_done)

    def _layer_done(self, module, args, output) -> None:
        self._layers_done += 1

    def _run(self) -> None:
        busy = False
        self._count_layers()
        self._publish_events()  # what the engine found at start (its disk tier's blocks)
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or busy or self._tiers_woke):
                        # A sleeping loop is idle, not wedged: a request waiting for blocks
                        # that only a command can free keeps its heartbeats.
                        self._cond.wait(IDLE_TICK_S)
                        self._ticks += 1
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, deque()
                    self._tiers_woke = False
                for cmd in commands:
                    self._run_command(cmd)
                busy = self._step()
                self._ticks += 1
        except BaseException as err:  # the loop is gone (logged here, not re-raised): a dead engine is a dead node
            log.exception("engine loop crashed")
            self.unhealthy_reason = self.unhealthy_reason or f"engine loop died: {err!r}"
        finally:
            unhealthy = self.unhealthy_reason
            self._fail_everything(EngineStoppedError(self._stopped_why() if unhealthy else "the engine was shut down"))
            if unhealthy is not None and self._on_unhealthy is not None:
                try:
                    self._on_unhealthy(unhealthy)
                except Exception:
                    log.exception("on_unhealthy callback failed")

    def _run_command(self, cmd: _Command) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return
        try:
            result = cmd.fn(self.engine)
        except BaseException as err:  # delivered to the caller, who decides
            cmd.future.set_exception(err)
        else:
            cmd.future.set_result(result)

    def _step(self) -> bool:
        """One engine step + dispatch; returns whether stepping again can make progress."""
        eng = self.engine
        steps_before = eng.num_steps
        outputs: list[RequestOutput] = []
        try:
            if eng.has_unfinished_requests():
                # The batch a decode-only step runs: the sequences running as it starts (one that
                # joins or resumes computes prompt tokens, and the step is not decode-only).
                running = eng.scheduler.running
                batch, context = len(running), sum(s.num_tokens for s in running)
                t0 = time.monotonic()
                outputs = eng.step()
                if self.step_delay_s > 0:
                    time.sleep(self.step_delay_s)
                if outputs:  # a step that ran the model alone is decode-only when it computed no prompt
                    decode_only = eng.num_steps != steps_before and eng.last_step_prefill_tokens == 0
                    self._measured(time.monotonic() - t0, (batch, context) if decode_only else None)
                if eng.num_steps != steps_before:  # it ran the model (not only handed out aborts)
                    self.health.succeeded()
            else:
                eng.service_tiers()  # an idle engine still takes its tiers' finished copies
        except Exception as err:
            log.exception("engine step failed; failing its %d open requests", len(self._streams))
            self._fail_requests(RequestFailedError(f"engine step failed: {err!r}"))
            reason = self.health.failed(err)
            if reason is not None:  # the node is broken, not the requests: stop here
                log.error("engine unhealthy: %s", reason)
                with self._cond:
                    self.unhealthy_reason, self._stopping = reason, True
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # a request whose stream was already failed
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]
        self._publish_events()
        self._load = self._snapshot()
        progressed = bool(outputs) or eng.num_steps != steps_before
        busy = progressed and eng.has_unfinished_requests()
        now = time.monotonic()
        if not busy or now - self._stats_at >= STATS_PERIOD_S:
            self._stats, self._stats_at = eng.stats(), now
        return busy

    def _measured(self, seconds: float, decode_batch: tuple[int, int] | None) -> None:
        """Fold one step's wall time into the average, and into the decode-only one with its
        (batch, context tokens) when it ran no prompt tokens."""
        now = time.monotonic()
        self._steps.add(seconds, now)
        if decode_batch is not None and decode_batch[0] > 0:
            self._decode_steps.add(seconds, *decode_batch, now)

    def _publish_events(self) -> None:
        events = self.engine.take_kv_events()
        if events and self._on_kv_events is not None:
            try:
                self._on_kv_events(events)
            except Exception:  # the index is a hint; a lost batch must not stop serving
                log.exception("on_kv_events callback failed; %d block events dropped", len(events))

    def _fail_requests(self, err: BaseException) -> None:
        """Abort every open request (freeing its blocks) and hand ``err`` to its reader.

        A failed step leaves no way to tell which requests it had scheduled, so all open ones
        fail: their state may be half-updated.
        """
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of %r after a failed step also failed", rid)
            stream.put(err)
        self._streams.clear()

    def _fail_everything(self, err: BaseException) -> None:
        with self._cond:
            self._stopping = True
            commands, self._commands = self._commands, deque()
        for cmd in commands:
            if cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(err)
        for stream in self._streams.values():
            stream.put(err)
        self._streams.clear()

    def _snapshot(self) -> LoadSnapshot:
        eng = self.engine
        sched = eng.scheduler
        now = time.monotonic()
        decode_s, decode_running, decode_tokens = self._decode_steps.value(now)
        return LoadSnapshot(
            waiting=sched.num_waiting,
            running=sched.num_running,
            running_tokens=sum(s.num_tokens for s in sched.running),
            free_blocks=eng.kv.num_free_blocks,
            num_blocks=eng.num_blocks,
            kv_usage=eng.kv.usage,
            step_s=self._steps.value(now),
            decode_step_s=decode_s,
            decode_step_running=decode_running,
            decode_step_tokens=decode_tokens,
        )

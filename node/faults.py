"""Fault injection for `pdserve chaos --scenario step-error` and tests: engine steps that raise.

Off unless the node's own process turns it on (``NodeServer.set_step_fault``, reached through
the Ray actor's ``set_step_fault`` or a test holding the server), as the KV fault of
prefill_node/faults.py is: no pdserve message can. Armed, it raises from inside the model's
forward pass, at the last decoder layer, so a failing step is the real one: the scheduler has
placed the batch and the earlier layers have written their KV when the exception comes, as
with an accelerator error mid-step. What the node does next (fail that step's requests, count
the step, turn unhealthy after ``max_step_failures`` in a row) is its ordinary code.

``fatal``: the exception is one the step's handler does not catch (a ``BaseException``), so it
ends the engine's loop thread, as an error in the loop's own code would: the node is dead.
"""
from __future__ import annotations

import threading


class InjectedStepError(RuntimeError):
    """The exception an armed ``StepFault`` raises inside a step."""


class InjectedLoopDeath(BaseException):
    """What a ``fatal`` fault raises: past the step's ``except Exception``, out of the loop."""


class StepFault:
    """Makes the next ``steps`` forward passes of one model raise (-1: every one until cleared).

    ``install`` hooks the model once (on the engine's loop thread: hooks must not change while a
    forward runs); ``arm`` may be called from any thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._left = 0
        self._fatal = False
        self.raised = 0  # steps this fault failed so far
        self._handle = None

    @property
    def installed(self) -> bool:
        return self._handle is not None

    def install(self, model) -> None:
        """Hook ``model`` (a torch module): its last decoder layer if it has a ``layers`` list,
        else the model's own forward."""
        if self._handle is None:
            layers = getattr(model, "layers", None)
            target = layers[-1] if layers else model
            self._handle = target.register_forward_pre_hook(self._before_forward)

    def arm(self, steps: int, fatal: bool = False) -> None:
        """``steps`` > 0: that many steps raise; -1: every step until ``arm(0)``; 0: off."""
        if steps < -1:
            raise ValueError(f"steps must be > 0, -1 (every step) or 0 (off), got {steps}")
        with self._lock:
            self._left, self._fatal = steps, fatal

    @property
    def armed(self) -> bool:
        return self._left != 0

    def _before_forward(self, module, args) -> None:
        with self._lock:
            if self._left == 0:
                return
            if self._left > 0:
                self._left -= 1
            self.raised += 1
            n, fatal = self.raised, self._fatal
        raise (InjectedLoopDeath if fatal else InjectedStepError)(f"injected step fault #{n} (set_step_fault)")

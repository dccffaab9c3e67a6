"""The planner's rounds on disk: each round's signals and decision as one JSON line, and back.

``python -m frontend.server --planner-record FILE`` (``pdserve up --planner-record FILE``) appends
a line per round the router leads: what the planner saw (``PlannerSignals``: nodes, finished
requests, fitted costs) and what it decided. Read back with ``read_rounds``, a recording is the
planner's input series, so its model and rules can be judged and tuned offline against what
the layouts measured (``decide`` replayed on it; ``pdserve bench serve --compare elastic
--planner-records PREFIX`` records every layout, the static ones through an advisory planner).

Plain data both ways (JSON, no pickle): a recording from another machine is parsed field by
field and refused with the line number when a field is missing or of the wrong type.
"""
from __future__ import annotations

import json
import math
import threading
from dataclasses import asdict, fields
from typing import IO

from kv_index.nodes import Role
from router.cost_model import DecodeCost, PrefillCost
from router.planner.decide import Decision
from router.planner.signals import NodeSignal, PlannerSignals, RequestSample


def round_json(s: PlannerSignals, d: Decision) -> dict:
    """One round as JSON-ready data (infinities as null: JSON has none)."""
    sig = asdict(s)
    for n in sig["nodes"]:
        n["role"] = Role(n["role"]).value
    return {"signals": sig, "decision": {"action": d.action, "reason": d.reason, "detail": d.detail,
                                         "threshold": d.threshold,
                                         "layout": {"prefill": d.layout.prefill, "decode": d.layout.decode},
                                         "figures": {k: v if math.isfinite(v) else None for k, v in d.figures.items()}}}


def signals_from_json(data: dict) -> PlannerSignals:
    """The ``PlannerSignals`` of ``round_json(...)["signals"]``; ValueError when it is not one."""
    try:
        nodes = tuple(NodeSignal(**{**_known(NodeSignal, n), "role": Role(n["role"])}) for n in data["nodes"])
        reqs = tuple(RequestSample(**_known(RequestSample, r)) for r in data["requests"])
        top = _known(PlannerSignals, data)
        top.update(nodes=nodes, requests=reqs, prefill=PrefillCost(**_known(PrefillCost, data["prefill"])),
                   decode=DecodeCost(**_known(DecodeCost, data["decode"])),
                   decode_by_mix=tuple((int(p), int(d), DecodeCost(**_known(DecodeCost, c)))
                                       for p, d, c in data.get("decode_by_mix", ())))
        return PlannerSignals(**top)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a planner round's signals: {e!r}") from None


def _known(cls, data: dict) -> dict:
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def read_rounds(path: str) -> list[tuple[PlannerSignals, dict]]:
    """(signals, decision as recorded) per line of a recording."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                out.append((signals_from_json(data["signals"]), data["decision"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{i}: {e}") from None
    return out


class RoundRecorder:
    """Appends ``round_json`` lines to a file (the planner thread calls it; one lock, one
    flush a round: a recording cut short by a crash ends at its last whole round)."""

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._file: IO[str] = open(path, "a")

    def __call__(self, s: PlannerSignals, d: Decision) -> None:
        line = json.dumps(round_json(s, d))
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()

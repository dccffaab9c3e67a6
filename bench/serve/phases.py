"""A shifting workload for `pdserve bench serve --phases FILE`: phases played in order, each
with its own request rate and share of long documents, as plain data.

The file is a JSON list of phases::

    [{"seconds": 40, "rate": 1.0, "long_share": 0.05, "name": "chat"},
     {"seconds": 40, "rate": 0.8, "long_share": 0.5, "name": "documents"},
     {"seconds": 12, "rate": 3.0, "long_share": 0.2, "name": "burst"}]

``seconds`` (> 0), ``rate`` (requests per second, > 0) and ``long_share`` (in [0, 1]) are
required; ``name`` is an optional label for reports and plots. Any other key is refused, so a
misspelt field fails loudly instead of being ignored. Requests within a phase arrive as a
Poisson process at its rate (gamma gaps with ``burstiness`` below 1), drawn from
``serve_workload.mixed(long_share)``; each phase starts at the sum of the durations before it.
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.serve import workload as wl

REQUIRED = ("seconds", "rate", "long_share")
OPTIONAL = ("name",)
# The phases file shipped with the benchmark (chat-heavy, document-heavy, a burst).
DEFAULT_FILE = Path(__file__).resolve().parent / "data" / "elastic_default.json"


class PhasesError(ValueError):
    """A phases file that cannot be played; the message names the file, the phase and the field."""


@dataclass(frozen=True, slots=True)
class Phase:
    seconds: float
    rate: float  # requests per second
    long_share: float  # fraction of the phase's requests that are long documents
    name: str = ""

    def label(self, index: int) -> str:
        return self.name or f"phase {index + 1}"


def parse_phases(data: object, source: str = "phases") -> list[Phase]:
    """Phases from the decoded JSON, checked; ``source`` names the file in every error."""
    if not isinstance(data, list) or not data:
        raise PhasesError(f"{source}: expected a non-empty JSON list of phases, got {_kind(data)}")
    out = []
    for i, item in enumerate(data):
        where = f"{source}: phase {i + 1}"
        if not isinstance(item, dict):
            raise PhasesError(f"{where}: expected an object with {', '.join(REQUIRED)}, got {_kind(item)}")
        unknown = sorted(set(item) - set(REQUIRED) - set(OPTIONAL))
        if unknown:
            raise PhasesError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; "
                              f"allowed: {', '.join(REQUIRED + OPTIONAL)}")
        missing = [k for k in REQUIRED if k not in item]
        if missing:
            raise PhasesError(f"{where}: missing field(s) {', '.join(map(repr, missing))}")
        seconds = _number(item["seconds"], f"{where}: 'seconds'")
        rate = _number(item["rate"], f"{where}: 'rate'")
        share = _number(item["long_share"], f"{where}: 'long_share'")
        if seconds <= 0:
            raise PhasesError(f"{where}: 'seconds' must be > 0, got {item['seconds']!r}")
        if rate <= 0:
            raise PhasesError(f"{where}: 'rate' must be > 0 (requests per second), got {item['rate']!r}")
        if not 0.0 <= share <= 1.0:
            raise PhasesError(f"{where}: 'long_share' must be in [0, 1], got {item['long_share']!r}")
        name = item.get("name", "")
        if not isinstance(name, str):
            raise PhasesError(f"{where}: 'name' must be a string, got {_kind(name)}")
        out.append(Phase(seconds, rate, share, name))
    return out


def load_phases(path: str | Path) -> list[Phase]:
    """The phases of a JSON file; PhasesError (with the file's name) when it cannot be read,
    is not JSON, or a phase is malformed."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise PhasesError(f"{path}: cannot read the phases file ({e.strerror or e})") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PhasesError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from e
    return parse_phases(data, str(path))


def _number(value: object, what: str) -> float:
    # bool is an int subclass: `"rate": true` is a mistake, not 1 request per second.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PhasesError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _kind(value: object) -> str:
    return {list: "a list", dict: "an object", str: "a string"}.get(type(value), repr(value))


def starts(phases: Sequence[Phase]) -> list[float]:
    """Each phase's start offset (seconds from the run's start)."""
    out, t = [], 0.0
    for p in phases:
        out.append(t)
        t += p.seconds
    return out


def total_seconds(phases: Sequence[Phase]) -> float:
    return sum(p.seconds for p in phases)


def phase_index(phases: Sequence[Phase], t: float) -> int:
    """The phase playing at offset ``t`` (the last one for a time at or past the end)."""
    for i, s in enumerate(starts(phases)):
        if t < s + phases[i].seconds:
            return i
    return len(phases) - 1


def phased(phases: Sequence[Phase], seed: int = 0, burstiness: float = 1.0,
           max_tokens_cap: int | None = None) -> list[wl.LoadRequest]:
    """The requests of a play of ``phases``: each phase's arrivals at its rate within its own
    window, lengths from its mix. A seed is a workload (every layout gets the same requests)."""
    rng = random.Random(seed)
    out = []
    for start, phase in zip(starts(phases), phases):
        mix = wl.mixed(phase.long_share)
        t = start + rng.gammavariate(burstiness, 1.0 / (phase.rate * burstiness))
        while t < start + phase.seconds:
            p, o, label = mix.draw(rng)
            if max_tokens_cap:
                o = min(o, max_tokens_cap)
            out.append(wl.LoadRequest(t, wl.random_prompt(p, rng), o, label))
            t += rng.gammavariate(burstiness, 1.0 / (phase.rate * burstiness))
    return out

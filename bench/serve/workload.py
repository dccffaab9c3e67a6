"""What `pdserve bench serve` sends and when: arrival processes and prompts, as plain data.

A workload is a list of ``LoadRequest`` (arrival offset, prompt token ids, output length). Three
sources:

- synthetic arrivals at a rate: Poisson (exponential gaps) or gamma with a shape below 1 for
  bursts (the coefficient of variation of the gaps is 1/sqrt(shape)), over a length mix;
- a trace's own timestamps and lengths (``router/replay/traces.py`` reads Mooncake's JSONL and
  Azure's CSV), scaled to this machine with ``time_scale`` and ``max_len``. Mooncake's
  ``hash_ids`` name shared prompt blocks; each id becomes one fixed block of synthetic tokens, so
  two requests that share a prefix in the trace share it here too and the prefix cache and
  the router's index see real reuse;
- the ``mixed`` workload of the disaggregated-vs-colocated comparison: steady chat-like requests
  (short prompt, long answer) with long prompts mixed in (long prompt, short answer), the regime
  where a long prefill stalls every running decode on a colocated engine.

Token ids are drawn from ``[TOKEN_LO, TOKEN_HI)``, a range of ordinary tokens of the builtin
model's vocabulary (no special tokens, so no early EOS from the prompt itself).
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

TOKEN_LO, TOKEN_HI = 1000, 30000


@dataclass(frozen=True, slots=True)
class LoadRequest:
    arrival_s: float  # offset from the start of the run
    prompt: tuple[int, ...]
    max_tokens: int
    kind: str = ""  # a label for reports ("chat", "long", "trace", ...)


@dataclass(frozen=True, slots=True)
class LengthMix:
    """A mixture of (weight, prompt range, output range, label) classes."""

    classes: tuple[tuple[float, tuple[int, int], tuple[int, int], str], ...]

    def draw(self, rng: random.Random) -> tuple[int, int, str]:
        total = sum(c[0] for c in self.classes)
        x = rng.random() * total
        for weight, (plo, phi), (olo, ohi), label in self.classes:
            x -= weight
            if x <= 0:
                return rng.randint(plo, phi), rng.randint(olo, ohi), label
        _, (plo, phi), (olo, ohi), label = self.classes[-1]
        return rng.randint(plo, phi), rng.randint(olo, ohi), label


# The comparison's workload: chat turns that decode for a while, and one request in five a long
# document with a short answer. Sized for SmolLM2-135M on one CPU core per node.
MIXED_LONG_SHARE = 0.2


def mixed(long_share: float = MIXED_LONG_SHARE) -> LengthMix:
    """The comparison's mix with ``long_share`` of the requests long documents (the crossover
    sweep varies it: more long prompts load the prefill side, fewer leave decode the bottleneck)."""
    if not 0.0 <= long_share <= 1.0:
        raise ValueError(f"long_share must be in [0, 1], got {long_share}")
    return LengthMix((
        (1.0 - long_share, (48, 128), (64, 128), "chat"),
        (long_share, (768, 1024), (8, 16), "long"),
    ))


MIXED = mixed()


def arrivals(n: int, rate: float, rng: random.Random, burstiness: float = 1.0) -> list[float]:
    """``n`` arrival offsets at ``rate`` per second: gamma gaps with shape ``burstiness`` (1 =
    Poisson; below 1 burstier), mean 1/rate either way."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def random_prompt(length: int, rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(length))


def synthetic(n: int, rate: float, mix: LengthMix, seed: int = 0, burstiness: float = 1.0,
              shared_prefix: int = 0) -> list[LoadRequest]:
    """``n`` requests at ``rate``; every prompt starts with the same ``shared_prefix`` tokens (a
    system prompt) when given, and is otherwise distinct."""
    rng = random.Random(seed)
    prefix = random_prompt(shared_prefix, random.Random(seed + 1))
    out = []
    for t in arrivals(n, rate, rng, burstiness):
        p, o, label = mix.draw(rng)
        body = random_prompt(max(1, p - len(prefix)), rng)
        out.append(LoadRequest(t, prefix + body, o, label))
    return out


def from_trace(records: Sequence, *, time_scale: float = 1.0, max_len: int | None = None,
               block_tokens: int = 512, seed: int = 0, max_tokens_cap: int | None = None) -> list[LoadRequest]:
    """Trace records (``TraceRequest``: arrival_s, input_tokens, output_tokens, hash_ids) as a
    workload. ``time_scale`` multiplies the gaps (2 = half the rate). ``max_len`` scales every
    length down by one factor so the longest prompt fits (the shape of the length mix is kept);
    Mooncake's blocks (``block_tokens`` tokens each in the trace) shrink by the same factor, so
    shared prefixes stay shared."""
    if not records:
        return []
    longest = max(r.input_tokens for r in records)
    scale = min(1.0, max_len / longest) if max_len else 1.0
    block = max(1, round(block_tokens * scale))
    blocks: dict[int, tuple[int, ...]] = {}
    rng = random.Random(seed)
    t0 = records[0].arrival_s
    out = []
    for r in records:
        length = max(1, round(r.input_tokens * scale))
        prompt: list[int] = []
        for h in r.hash_ids:
            if h not in blocks:
                blocks[h] = random_prompt(block, random.Random(hash((seed, h))))
            prompt.extend(blocks[h])
        prompt = prompt[:length]
        prompt.extend(random_prompt(length - len(prompt), rng))  # the trace's unshared tail, if any
        out_len = max(1, round(r.output_tokens * scale))
        if max_tokens_cap:
            out_len = min(out_len, max_tokens_cap)
        out.append(LoadRequest((r.arrival_s - t0) * time_scale, tuple(prompt), out_len, "trace"))
    return out


def at_rate(workload: Sequence[LoadRequest], rate: float, seed: int = 0, burstiness: float = 1.0) -> list[LoadRequest]:
    """The same requests (prompts, lengths, order) with fresh arrivals at ``rate``: a rate sweep
    replays one request set at several rates, so only the load differs between points."""
    times = arrivals(len(workload), rate, random.Random(seed), burstiness)
    return [LoadRequest(t, r.prompt, r.max_tokens, r.kind) for t, r in zip(times, workload)]


def salted(workload: Sequence[LoadRequest], salt: int) -> list[LoadRequest]:
    """The same requests with every token shifted by one per-``salt`` offset within the ordinary
    token range. A sweep sends each point (and the unloaded and warm-up requests) its own salt:
    the lengths and the prefix sharing inside a point stay as they were, but nothing a layout
    cached at one point is hit at the next. Replaying the same token ids instead let each point
    hit what the previous one left in the prefix cache, unevenly between layouts (in the
    2026-11-30 run the colocated layout's chat prompts were 62% cached at 0.9 req/s, the
    disaggregated layout's 0%)."""
    if salt == 0:
        return list(workload)
    span = TOKEN_HI - TOKEN_LO
    shift = (salt * 7919) % span or 1  # 7919: a prime, so successive salts spread over the range
    return [LoadRequest(r.arrival_s, tuple(TOKEN_LO + (t - TOKEN_LO + shift) % span for t in r.prompt),
                        r.max_tokens, r.kind) for r in workload]

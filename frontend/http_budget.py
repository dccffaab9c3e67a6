"""The HTTP front's bounds as plain data, no I/O (``frontend/http_front.py`` applies them):

    body_limit_bytes    the largest body a request can usefully send, from the model's context
    body_shape          a JSON body's depth and what parsing it makes, measured unparsed
    ByteBudget          the body bytes held across all requests at once (and their parsed size)
    Admission           the requests held at once
    RetryHint           the Retry-After of a refusal, from how fast the admitted drain

Why three bounds: one body is bounded by what the context can use (a bigger one is 413, never
useful), but many bodies at once are bounded only by how many requests are admitted; the byte
budget bounds their sum, so the router's memory is bounded by it whatever the concurrency.

    requests in flight   |####....|   Admission: past `limit`          -> 429 (not read)
    body bytes held      |######..|   ByteBudget: past `capacity`      -> 429 (not read further)
    one body             |###|        body_limit_bytes: past the limit -> 413
"""
from __future__ import annotations

from dataclasses import dataclass

from tool_calling.json_limits import MAX_JSON_DEPTH, depth_of_structure, structure

# JSON a chat message costs besides its text: braces, the role and content keys, quotes,
# separators, some indentation (`{"role": "assistant", "content": ""}, ` is 38 bytes).
MESSAGE_JSON_BYTES = 64
# The rest of a request: model, sampling fields, 16 stop strings of 256 characters escaped,
# pdserve's extra fields.
BASE_JSON_BYTES = 64 * 1024
# The least any model gets: room for batched token prompts and generous formatting on small
# contexts (a 64-token test model would otherwise get 74 KiB).
MIN_BODY_BYTES = 1 << 20


# What one JSON value of a body costs the router once parsed, besides the body's own bytes:
# the Python object json.loads makes (a dict 64 bytes, a list 56, an int 28, each plus its
# slot), pydantic's model of it and the protobuf field it becomes. Measured with tracemalloc
# over json.loads + model_validate + to_generate for the worst shapes (many empty messages:
# 153 bytes a value; lists of {} or [], many keys, token lists: 21 to 107).
PARSED_VALUE_BYTES = 160
# A body nests its own few levels around a tool's schema or a call's arguments
# (messages[i].tool_calls[j].function.arguments): those get MAX_JSON_DEPTH of their own, and
# the router's check of them names the field.
MAX_BODY_DEPTH = MAX_JSON_DEPTH + 8


@dataclass(frozen=True, slots=True)
class BodyShape:
    depth: int  # levels of arrays and objects
    values: int  # containers, keys and elements (an upper bound: separators outside strings)

    @property
    def parsed_bytes(self) -> int:
        return self.values * PARSED_VALUE_BYTES


def body_shape(body: bytes) -> BodyShape:
    """A JSON body's shape, measured without parsing it (at C speed: tool_calling/json_limits.py).
    Every value but the first is after a "," or a ":" or opens a container, so counting those
    outside strings bounds the number of values parsing makes. Strings are not counted again:
    the body's bytes, already in the budget, are about the size of their parsed text."""
    rest = structure(body)
    values = rest.count(b",") + rest.count(b":") + rest.count(b"[") + rest.count(b"{")
    return BodyShape(depth_of_structure(rest), values)


def body_limit_bytes(max_model_len: int, token_json_bytes: int) -> int:
    """The body limit a model's context implies. A prompt of ``max_model_len`` tokens has at
    most ``token_json_bytes`` bytes of JSON per token (its longest token, escaped), and every
    chat message costs at least one token of the template, so at most ``max_model_len``
    messages each add ``MESSAGE_JSON_BYTES``. A body larger than that cannot be a request the
    model can take."""
    if max_model_len < 1 or token_json_bytes < 1:
        raise ValueError(f"max_model_len and token_json_bytes must be >= 1, got {max_model_len}, {token_json_bytes}")
    return max(MIN_BODY_BYTES, max_model_len * (token_json_bytes + MESSAGE_JSON_BYTES) + BASE_JSON_BYTES)


class ByteBudget:
    """Body bytes held at once, across requests. A request takes its bytes before reading them
    (a declared Content-Length at once, a chunked body chunk by chunk) and gives them back when
    its response has ended; ``try_take`` refuses what would pass ``capacity``."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.held = 0
        self.peak = 0
        self.refused = 0

    def try_take(self, n: int) -> bool:
        if n < 0:
            raise ValueError(f"cannot take {n} bytes")
        if self.held + n > self.capacity:
            self.refused += 1
            return False
        self.held += n
        self.peak = max(self.peak, self.held)
        return True

    def give_back(self, n: int) -> None:
        if not 0 <= n <= self.held:
            raise ValueError(f"giving back {n} bytes, but {self.held} are held")
        self.held -= n


class Admission:
    """Requests held at once; ``try_enter`` refuses past ``limit``, each entry is left once."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.active = 0
        self.peak = 0
        self.refused = 0

    def try_enter(self) -> bool:
        if self.active >= self.limit:
            self.refused += 1
            return False
        self.active += 1
        self.peak = max(self.peak, self.active)
        return True

    def leave(self) -> None:
        if self.active <= 0:
            raise ValueError("leave() without a matching try_enter()")
        self.active -= 1


class RetryHint:
    """The Retry-After of the front door's 429s, from how fast it drains: about as long as
    the clients it refused lately will take to get in, at the rate requests lately left.

        hint = span * refused / finished    (span: the last window and this one so far)

    clamped to [base_ms, max_ms]. While nothing has left in the span the drain is slower than
    one request per span, so ``finished`` counts as 1 (an upper bound on the rate, the hint
    a lower bound on the wait); only a lone refusal keeps ``base_ms`` (a fresh router at its
    limit for a moment). Answering the base while nothing finished sent every client of a
    tenfold overload back within 0.2 s for as long as the first admitted requests ran. A fixed
    short hint under a tenfold overload has every
    refused client back within it, so the router spends its time refusing the same clients
    (and reading the bodies they send anyway); a hint that grows with the backlog spreads
    them over the time the admitted requests need."""

    def __init__(self, base_ms: int, max_ms: int = 20_000, window_s: float = 2.0) -> None:
        if not 0 < base_ms <= max_ms or window_s <= 0:
            raise ValueError(f"need 0 < base_ms <= max_ms and window_s > 0, got {base_ms}, {max_ms}, {window_s}")
        self.base_ms, self.max_ms, self.window_s = base_ms, max_ms, window_s
        self._bucket = 0
        self._now = [0, 0]  # refused, finished in the current window
        self._last = [0, 0]  # in the one before

    def _roll(self, now: float) -> None:
        bucket = int(now // self.window_s)
        if bucket != self._bucket:
            self._last = self._now if bucket == self._bucket + 1 else [0, 0]
            self._now = [0, 0]
            self._bucket = bucket

    def refused(self, now: float) -> None:
        self._roll(now)
        self._now[0] += 1

    def finished(self, now: float) -> None:
        self._roll(now)
        self._now[1] += 1

    def hint_ms(self, now: float) -> int:
        self._roll(now)
        refused, finished = self._now[0] + self._last[0], self._now[1] + self._last[1]
        if refused <= 1 and finished == 0:
            return self.base_ms
        finished = max(1, finished)
        span_s = self.window_s + now % self.window_s  # the last window and this one so far
        ms = 1000 * span_s * refused / finished
        return int(min(self.max_ms, max(self.base_ms, ms)))

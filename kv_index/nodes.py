"""What the index says about a node, as plain data: its role, address, model, load and index
bookkeeping. No redis, grpc or torch: placement policies and the router's node view work on
these, and tests build them by hand."""
from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from kv_index.matmul_curve import MatmulCurve, parse_curve


class Role(enum.StrEnum):
    """A node's job in the cluster. The value is what the registry stores and what names the
    node's Ray pool (``{role}_pool``)."""

    PREFILL = "prefill"  # computes prompts' KV and pushes it to decode nodes
    DECODE = "decode"  # receives KV (or prefills short prompts itself) and streams tokens


class OnboardTotals(NamedTuple):
    """KV a node brought back from one lower tier into its device pool, cumulative: bytes,
    seconds spent and the number of separate copies (runs). The registry holds it as
    "bytes,seconds,runs"."""

    bytes: int = 0
    seconds: float = 0.0
    runs: int = 0

    @staticmethod
    def parse(text: str) -> OnboardTotals:
        """From the registry's "bytes,seconds,runs" ("" or a malformed value: none)."""
        try:
            b, s, n = text.split(",")
            return OnboardTotals(int(b), float(s), int(n))
        except ValueError:
            return OnboardTotals()

    def wire(self) -> str:
        return f"{self.bytes},{self.seconds:.6f},{self.runs}"

    def since(self, before: OnboardTotals) -> OnboardTotals:
        """What was onboarded after ``before`` was read: the difference, or all of it when the
        totals went down (the node restarted and counts from zero again)."""
        if self.runs < before.runs or self.bytes < before.bytes:
            return self
        return OnboardTotals(self.bytes - before.bytes, self.seconds - before.seconds, self.runs - before.runs)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str
    role: Role
    grpc_address: str  # host:port of the node's gRPC server
    fingerprint: str
    block_size: int
    num_blocks: int
    metrics_address: str = ""  # host:port of the node's Prometheus /metrics ("" = none)
    # KV data plane besides gRPC, fastest first. Decode nodes: where they receive
    # ("shm://<host key>/host:port", "tcp://host:port"); prefill nodes: what they send over,
    # no address ("shm://<host key>/", "tcp://"; router/cost_model.py first_transport).
    kv_endpoints: tuple[str, ...] = ()
    # Its matmul time per decode step by batch rows (its CPU kernel plan; () where unknown):
    # the planner's decode fit adds it to a line (kv_index/matmul_curve.py says why).
    matmul_ms: MatmulCurve = ()
    # load, as of the last heartbeat
    waiting: int = 0
    running: int = 0
    running_tokens: int = 0
    free_blocks: int = 0
    kv_usage: float = 0.0
    draining: bool = False  # finishing its requests before it stops: place nothing new here
    step_s: float = 0.0  # seconds per engine step, recent average (0: unknown, e.g. idle)
    decode_step_s: float = 0.0  # the same over steps that ran no prompt tokens: decode alone (0: unknown)
    decode_step_running: float = 0.0  # those steps' batch and context, averaged alike (0: unknown)
    decode_step_tokens: float = 0.0
    # Not in the registry: the router's node view fills it from the node's own heartbeats
    # (router/step_history.py), its best recent step_s at a comparable batch (0: too few samples).
    step_best_s: float = 0.0
    updated_at: float = 0.0
    # index bookkeeping: last applied event batch and when the node published it (-1/0: none)
    index_seq: int = -1
    event_at: float = 0.0
    # KV brought back from its host and disk tiers to its device since the node started
    # (cumulative; a restart starts them again at zero)
    onboard_host: OnboardTotals = OnboardTotals()
    onboard_disk: OnboardTotals = OnboardTotals()

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))  # "decode" from a test or a hash -> Role.DECODE

    @staticmethod
    def from_hash(node_id: str, h: Mapping[bytes, bytes]) -> NodeInfo:
        """From the node's registry HASH. ValueError for a role this build does not know."""
        g = {k.decode(): v.decode() for k, v in h.items()}
        return NodeInfo(
            node_id=node_id,
            role=g["role"],
            grpc_address=g["grpc"],
            fingerprint=g["fingerprint"],
            block_size=int(g["block_size"]),
            num_blocks=int(g["num_blocks"]),
            metrics_address=g.get("metrics", ""),
            kv_endpoints=tuple(e for e in g.get("kv_endpoints", "").split(",") if e),
            matmul_ms=parse_curve(g.get("matmul_ms", "")),
            waiting=int(g.get("waiting", 0)),
            running=int(g.get("running", 0)),
            running_tokens=int(g.get("running_tokens", 0)),
            free_blocks=int(g.get("free_blocks", 0)),
            kv_usage=float(g.get("kv_usage", 0.0)),
            draining=g.get("draining", "0") not in ("0", ""),
            step_s=float(g.get("step_s", 0.0)),
            decode_step_s=float(g.get("decode_step_s", 0.0)),
            decode_step_running=float(g.get("decode_step_running", 0.0)),
            decode_step_tokens=float(g.get("decode_step_tokens", 0.0)),
            updated_at=float(g.get("updated_at", 0.0)),
            index_seq=int(g.get("seq", -1)),
            event_at=float(g.get("event_at", 0.0)),
            onboard_host=OnboardTotals.parse(g.get("onboard_host", "")),
            onboard_disk=OnboardTotals.parse(g.get("onboard_disk", "")),
        )


class PrefixMatch(NamedTuple):
    """How many of a prompt's leading blocks one node holds, and where (the index's tiers:
    kv_index/schema.py TIER_*). Each block counts once, in the fastest tier the node holds it
    in; a hit in a lower tier costs an onboard before the prefill can use it."""

    blocks: int  # leading blocks held, in any tier
    host: int = 0  # of those, held in host memory and not on the device
    disk: int = 0  # of those, held on disk only

    @property
    def device(self) -> int:
        return self.blocks - self.host - self.disk


@dataclass(frozen=True, slots=True)
class StepReport:
    """One unit of prefill work a node measured: ``new_tokens`` computed over a context of
    ``context_tokens`` (cached + new) in ``seconds``. The router fits its cost model on these."""

    new_tokens: int
    context_tokens: int
    seconds: float


def index_freshness(nodes: Iterable[NodeInfo], now: float) -> dict[str, float]:
    """Age in seconds of the newest applied event batch, per node (its clock vs ``now``).
    A node that published nothing since registering shows the age of its registration."""
    return {n.node_id: max(0.0, now - n.event_at) for n in nodes if n.event_at > 0}

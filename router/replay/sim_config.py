"""What the trace simulator's nodes really are: the true prefill cost (``NodeTruth``), the true
cost of bringing blocks back from a node's lower tiers (``TierTruth``), and the cluster's shape
and load (``SimConfig``). No policy is given any of it: pdserve's cost book starts from a
generic prior and learns the nodes from their reports, as in production."""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from router.cost_model import DecodeCost
from router.replay.traces import TraceRequest


@dataclass(frozen=True, slots=True)
class NodeTruth:
    """What a prefill really costs a simulated node at speed 1. Deliberately outside the family
    the router fits (``PrefillCost``: a + b*new + c*new*(cached + new/2)) and away from its
    prior: a prompt shorter than ``min_tokens`` costs as much as ``min_tokens`` (an accelerator
    step is not cheaper for fewer tokens), every ``chunk_tokens`` of chunked prefill adds a
    step's overhead, the linear term is cheaper and attention dearer than the prior says (a 7k
    prompt is 20% cheaper than the prior predicts, an 85k one 6% dearer)."""

    fixed_s: float = 0.025
    per_token_s: float = 6.0e-5
    attn_s: float = 1.6e-9
    min_tokens: int = 512
    chunk_tokens: int = 8192
    chunk_s: float = 0.008

    def seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        chunks = -(-new_tokens // self.chunk_tokens)
        return (self.fixed_s + self.per_token_s * max(new_tokens, self.min_tokens) + self.chunk_s * chunks
                + self.attn_s * new_tokens * (cached_tokens + new_tokens / 2))


@dataclass(frozen=True, slots=True)
class TierTruth:
    """What bringing a node's blocks back to its device really costs: a fixed cost per run
    (a DMA set up; a file opened, read and checksummed) plus bytes at a bandwidth. Defaults, an
    accelerator node of today: pinned host memory over PCIe 5 (64 GB/s nominal; 40 GB/s of
    page-sized copies) and one NVMe drive read sequentially (5 GB/s). Both far from the
    router's priors (router/cost_model.py ONBOARD_PRIORS, a CPU VM's), which it must unlearn."""

    host_fixed_s: float = 1e-4
    host_bandwidth: float = 40e9
    disk_fixed_s: float = 1e-3
    disk_bandwidth: float = 5e9

    def host_s(self, num_bytes: float) -> float:
        return self.host_fixed_s + num_bytes / self.host_bandwidth if num_bytes > 0 else 0.0

    def disk_s(self, num_bytes: float) -> float:
        return self.disk_fixed_s + num_bytes / self.disk_bandwidth if num_bytes > 0 else 0.0


@dataclass(frozen=True, slots=True)
class SimConfig:
    prefill_nodes: int = 8
    decode_nodes: int = 4
    cache_tokens: int = 3_000_000  # device KV cache per prefill node
    host_cache_tokens: int = 0  # host-memory tier per prefill node (0: none)
    disk_cache_tokens: int = 0  # disk tier per prefill node (0: none)
    block_size: int = 512
    load: float = 0.8  # offered prefill work without any cache hit / total prefill capacity
    truth: NodeTruth = NodeTruth()
    tiers: TierTruth = TierTruth()
    speed_spread: float = 0.4  # prefill node i's time x (1 + spread * (rank(i) / (N-1) - 1/2)): 0.8x-1.2x
    step_noise: float = 0.1  # sigma of the log-normal factor on each prefill's time
    decode_cost: DecodeCost = DecodeCost()
    kv_bytes_per_token: int = 131072
    bandwidth: float = 25e9  # bytes/s between any two nodes (KV pushes and fetches)
    decode_max_batch: int = 128
    report_delay_s: float = 0.5  # a step report reaches the cost book one router refresh later
    slo_class: str = "standard"
    # The step noise's draws and the order of the nodes' speeds: seed 0 keeps node i at rank i
    # (prefill-0 the fastest, the figures before issue 45), any other seed shuffles the ranks.
    seed: int = 0
    # The queue-bound gate (admission "queue_bound"): a request whose true wait on the node its
    # policy chose exceeds this fraction of its TTFT budget is rejected, whatever the policy.
    gate_queue_fraction: float = 1.0

    def speed(self, i: int) -> float:
        n = self.prefill_nodes
        return 1.0 + (self.speed_spread * (self.speed_rank(i) / (n - 1) - 0.5) if n > 1 else 0.0)

    def speed_rank(self, i: int) -> int:
        """Prefill node i's place in speed order, 0 the fastest."""
        if self.seed == 0:
            return i
        ranks = list(range(self.prefill_nodes))
        random.Random(self.seed).shuffle(ranks)
        return ranks[i]

    def blocks(self, tokens: int) -> int:
        return max(0, tokens // self.block_size)

    @property
    def tiered(self) -> bool:
        return self.host_cache_tokens > 0 or self.disk_cache_tokens > 0

    @property
    def node_cache_tokens(self) -> int:
        """A prefill node's whole hierarchy: device + host + disk."""
        return self.cache_tokens + self.host_cache_tokens + self.disk_cache_tokens


def time_scale(requests: Sequence[TraceRequest], cfg: SimConfig) -> float:
    """Factor on arrival times that makes the offered load ``cfg.load``: the trace's prefill
    work without any cache hit (true cost at speed 1, the nodes' mean), over the span, per
    node, equals ``load`` of a node's time."""
    if len(requests) < 2:
        return 1.0
    work = sum(cfg.truth.seconds(r.input_tokens) for r in requests)
    span = requests[-1].arrival_s - requests[0].arrival_s
    if span <= 0:
        return 1.0
    return work / (cfg.prefill_nodes * cfg.load * span)

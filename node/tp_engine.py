"""A node's engine over one process or over ``NodeConfig.tensor_parallel`` ranks, and where its KV
is read from for a send.

With tensor parallelism the node's ``LLMEngine`` is rank 0's (engine/parallel/executor.py): its
``kv_cache`` holds rank 0's KV heads only. The wire carries every KV head of a block
(kv_transfer/layout.py), so a send first gathers the blocks from all ranks' pools into a
full-head staging tensor (engine/parallel/kv_regroup.py) and sends from that, whatever the
receiver's own tensor-parallel size.
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.engine import LLMEngine
from engine.parallel.executor import TensorParallelEngine, start_tp_engine
from engine.parallel.kv_regroup import LandingArea, gather_blocks, landing_slots
from engine.parallel.plan import TensorParallelConfig
from node.config import NodeConfig


def build_engine(config: NodeConfig, **kwargs) -> LLMEngine | TensorParallelEngine:
    """The node's engine (``kwargs`` as for ``LLMEngine``); a ``TensorParallelEngine`` when
    ``config.tensor_parallel`` > 1, whose workers the node closes when it stops. A size that
    does not fit the model raises TensorParallelError naming the limit."""
    if config.tensor_parallel == 1:
        return LLMEngine(config.engine, **kwargs)
    kwargs.pop("proposer_factory", None)  # no speculation with TP (NodeConfig refuses it)
    return start_tp_engine(config.engine, TensorParallelConfig(size=config.tensor_parallel), **kwargs)


def send_view(engine: LLMEngine, tp: TensorParallelEngine | None, src_block_ids: Sequence[int],
              skip_leading_blocks: int = 0) -> tuple:
    """(pool tensor, block ids) a push of blocks ``src_block_ids[skip_leading_blocks:]`` reads:
    the engine's pool itself, or (tensor parallel) a staging tensor ``[L, k, 2, bs, H_kv, D]``
    with those k blocks gathered from every rank, addressed 0 .. k-1 (the skipped leading ids
    are placeholders the push does not read)."""
    if tp is None:
        return engine.kv_cache, list(src_block_ids)
    sent = list(src_block_ids)[skip_leading_blocks:]
    staging = gather_blocks(tp.kv_pools, sent)
    return staging, [0] * skip_leading_blocks + list(range(len(sent)))


def tp_landing(tp: TensorParallelEngine | None, engine: LLMEngine) -> LandingArea | None:
    """The full-head landing area a tensor-parallel node receives KV into: prompts pushed to a
    decode node, prefixes a prefill node fetches (engine/parallel/kv_regroup.py LandingArea;
    None: one process, KV lands in the engine's pool)."""
    if tp is None:
        return None
    return LandingArea(tp.kv_pools, landing_slots(engine.num_blocks, tp.size, engine.max_model_len, engine.block_size))

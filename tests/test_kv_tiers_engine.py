"""KV tiers on a real tiny engine: bit-identical round trips device -> host -> disk -> device,
greedy outputs identical with tiers on and off when hits come from host and disk, a corrupted
file (real bytes flipped) a miss and a metric, a disk budget that fits nothing stops admitting
and a failing disk pauses the tier (then it retries),
a restarted engine re-registering its disk blocks and refusing another model's or block size's,
export and import between two engines, the engine loop woken by tier copies, and the metrics and
`pdserve status` lines they make."""
from __future__ import annotations

import random
import time

import pytest
import torch
from prometheus_client import generate_latest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.models.tiny import save_tiny_model
from kv_index.events import TIER_DEVICE, TIER_DISK, TIER_HOST, BlockStored, fold_kv_events_by_tier
from tokens.block_hash import hash_prompt_blocks
from tokens.sampling_params import SamplingParams

BS = 4
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # layers x K/V x tokens x KV heads x head dim x fp32 (tiny_hf_config)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)
ONE = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module")
def model_dir(tiny_dir):
    return tiny_dir  # conftest's session model (llama, seed 0): read only here


def make(path, num_blocks=16, host_blocks=0, disk=None, disk_files=64, block_size=BS) -> LLMEngine:
    bb = 2 * 2 * block_size * 2 * 16 * 4  # layers x K/V x tokens x KV heads x head dim x fp32
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, host_cache_mib=host_blocks * bb / 2**20,
                        disk_cache_dir=str(disk) if disk else None,
                        disk_cache_mib=disk_files * (bb + 300) / 2**20 if disk else 0)
    return LLMEngine(EngineConfig(model=str(path), device="cpu", cache=cache,
                                  scheduler=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=4)),
                     load_tokenizer=False)


def settle(eng: LLMEngine) -> None:
    """Let the tier threads finish and take their results (an idle engine loop does this)."""
    for _ in range(4):
        eng.tiers.copier.wait_idle(10)
        if eng.tiers.writer is not None:
            eng.tiers.writer.wait_idle(10)
        eng.service_tiers()


def prompts(n, length=17, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


def run(eng, ps, params=GREEDY):
    """One at a time, settling the tiers between requests (what an idle loop does)."""
    out = []
    for p in ps:
        out.append(eng.generate([p], params)[0].outputs[0].token_ids)
        if eng.tiers is not None:
            settle(eng)
    return out


def kv_of(eng, tokens, n_blocks) -> torch.Tensor:
    ids = [eng.kv.pool.cached[h].block_id for h in hash_prompt_blocks(tokens, BS, eng.fingerprint.encode())[:n_blocks]]
    return eng.kv_cache[:, ids].clone()  # [L, n, 2, bs, H_kv, D]


def push_down(eng, seed) -> None:
    """Unrelated prompts through a small pool: the blocks before them leave the device pool, and
    a small host tier writes them to disk."""
    run(eng, prompts(6, seed=seed), ONE)


def test_round_trip_device_host_disk_device_is_bit_identical(model_dir, tmp_path):
    eng = make(model_dir, num_blocks=16, host_blocks=4, disk=tmp_path)
    p = prompts(1, seed=1)[0]
    run(eng, [p], ONE)
    before = kv_of(eng, p, 4)
    hashes = hash_prompt_blocks(p, BS, eng.fingerprint.encode())
    assert eng.held_prefix(hashes, p) == [TIER_DEVICE] * 4
    push_down(eng, seed=2)
    assert eng.held_prefix(hashes, p) == [TIER_DISK] * 4  # not in the pool, nor in host memory
    ids = eng.export_prefix("x", hashes, p)  # read back from disk, through host, into the pool
    assert len(ids) == 4 and all(eng.kv.pool.blocks[b].ref_cnt == 1 for b in ids)
    assert torch.equal(eng.kv_cache[:, ids], before)  # bit for bit
    assert eng.held_prefix(hashes, p) == [TIER_DEVICE] * 4
    eng.release_export("x")
    assert all(eng.kv.pool.blocks[b].ref_cnt == 0 for b in ids)
    s = eng.stats()["tiers"]
    assert s["disk"]["hits"] == 4 and s["disk"]["onboard_bytes"] == 4 * BLOCK_BYTES
    eng.close()


def test_greedy_outputs_identical_with_tiers_on_and_off(model_dir, tmp_path):
    """A device pool of 12 blocks for prompts that share 3-block heads (the working set is
    about 4 x 3 heads + 14 x 2 other blocks): hits must come from the host (16 blocks) and the
    disk tiers, and change no token."""
    rng = random.Random(5)
    heads = prompts(4, length=12, seed=3)
    work = [rng.choice(heads) + prompts(1, length=rng.randint(2, 9), seed=i)[0] for i in range(14)]
    off = run(make(model_dir, num_blocks=12), work)
    eng = make(model_dir, num_blocks=12, host_blocks=16, disk=tmp_path)
    on = run(eng, work)
    assert on == off
    s = eng.stats()["tiers"]
    assert s["host"]["hits"] > 0 and s["disk"]["hits"] > 0, s
    assert eng.kv.pool.prefix_hit_tokens > 0
    eng.close()


def test_corrupt_disk_file_is_a_miss_and_a_metric(model_dir, tmp_path):
    from telemetry.metrics import NodeMetrics

    eng = make(model_dir, num_blocks=16, host_blocks=4, disk=tmp_path)
    p = prompts(1, seed=7)[0]
    ref = run(make(model_dir), [p])
    run(eng, [p], ONE)
    push_down(eng, seed=8)
    h1 = hash_prompt_blocks(p, BS, eng.fingerprint.encode())[1]
    path = eng.tiers.disk.path(h1)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40  # one bit of the KV payload, in the file itself
    path.write_bytes(bytes(raw))
    assert run(eng, [p]) == ref  # block 0 came back, block 1 was recomputed (and so was 2, 3)
    s = eng.stats()["tiers"]["disk"]
    assert s["errors"]["checksum"] == 1 and s["hits"] == 1
    text = generate_latest(NodeMetrics("m", "prefill", "n0", engine_stats=eng.stats).registry).decode()
    assert 'pdserve:kv_tier_errors_total{model_name="m",node_id="n0",reason="checksum",role="prefill",tier="disk"} 1.0' \
        in text
    eng.close()


def test_a_disk_budget_that_fits_nothing_stops_admitting(model_dir, tmp_path):
    eng = make(model_dir, num_blocks=8, host_blocks=24, disk=tmp_path, disk_files=0.5)
    ps = prompts(4, seed=11)
    assert run(eng, ps + ps) == run(make(model_dir), ps + ps)  # serving goes on, from the host tier
    s = eng.stats()["tiers"]
    assert not s["disk"]["admitting"] and s["disk"]["blocks"] == 0
    assert s["disk"]["errors"]["no_space"] == 1 and s["host"]["hits"] > 0
    assert [f.name for f in tmp_path.iterdir()] == [".lock"]
    eng.close()


def test_a_real_write_failure_pauses_the_disk_tier_and_nothing_else(model_dir, tmp_path):
    """The disk tier's directory vanishes under the running engine (a volume unmounted, a
    directory removed), so its writes fail with a real ENOENT from the kernel: the tier pauses,
    counts it, and serving goes on unchanged. Once the directory is back and the pause is over,
    the next write goes through: one failure no longer stops the tier for the process's life."""
    import shutil

    cache = tmp_path / "kv"
    eng = make(model_dir, num_blocks=16, host_blocks=4, disk=cache)
    disk = eng.tiers.disk
    now = [1000.0]
    disk.clock = lambda: now[0]  # the pause is 5 s of this clock, not of the test's wall time
    shutil.rmtree(cache)
    p = prompts(1, seed=27)[0]
    ref = run(make(model_dir), [p] + prompts(6, seed=28) + [p])
    assert run(eng, [p] + prompts(6, seed=28) + [p]) == ref
    s = eng.stats()["tiers"]["disk"]
    # Writes already queued behind the first failure fail too, each counted (how many depends
    # on when the worker thread reports the first); they do not lengthen the pause.
    assert s["errors"]["io_error"] >= 1 and not s["admitting"] and s["blocks"] == 0
    assert disk.stopped_reason == "io_error"
    cache.mkdir()
    now[0] += 5.0  # the first pause is over: the next spill is the retry
    push_down(eng, seed=29)
    s = eng.stats()["tiers"]["disk"]
    assert s["admitting"] and s["blocks"] >= 1 and sorted(cache.glob("*.kvb"))
    eng.close()


def test_restart_reregisters_disk_blocks_and_refuses_other_layouts(model_dir, tmp_path, tmp_path_factory):
    eng = make(model_dir, num_blocks=16, host_blocks=4, disk=tmp_path)
    p = prompts(1, seed=13)[0]
    ref = run(eng, [p])
    push_down(eng, seed=14)
    on_disk = {h for h, e in eng.tiers.disk.entries.items() if e.ready}
    eng.close()  # finishes queued writes, releases the directory
    again = make(model_dir, num_blocks=16, host_blocks=4, disk=tmp_path)
    stored, _, _ = fold_kv_events_by_tier(again.take_kv_events())
    assert set(stored[TIER_DISK]) == on_disk and len(on_disk) >= 4
    hashes = hash_prompt_blocks(p, BS, again.fingerprint.encode())
    assert again.held_prefix(hashes, p) == [TIER_DISK] * 4
    assert run(again, [p]) == ref and again.stats()["tiers"]["disk"]["hits"] == 4
    again.close()
    files = sorted(f.name for f in tmp_path.iterdir())
    bigger = make(model_dir, num_blocks=16, host_blocks=4, disk=tmp_path, block_size=8)
    other_dir = save_tiny_model(tmp_path_factory.mktemp("other") / "llama", arch="llama", seed=1)
    for eng2 in (bigger, None):
        if eng2 is None:
            eng2 = make(other_dir, num_blocks=16, host_blocks=4, disk=tmp_path)
        assert eng2.take_kv_events() == []  # nothing re-registered
        assert eng2.stats()["tiers"]["disk"]["errors"]["foreign"] == len(files) - 1  # all but .lock
        eng2.close()
    assert sorted(f.name for f in tmp_path.iterdir()) == files  # left in place


def test_export_from_disk_then_import_into_another_engine(model_dir, tmp_path):
    holder = make(model_dir, num_blocks=16, host_blocks=8, disk=tmp_path)
    p = prompts(1, length=21, seed=17)[0]
    ref = run(holder, [p])
    push_down(holder, seed=18)
    peer = make(model_dir, num_blocks=16)
    hashes = hash_prompt_blocks(p, BS, holder.fingerprint.encode())
    table, cached = peer.reserve_kv("fetch-1", p)
    assert cached == 0 and len(table) == 6
    ids = holder.export_prefix("e1", hashes, p)
    assert len(ids) == 5
    # What a transport does: the holder's pool blocks, by id, into the peer's reserved blocks.
    peer.kv_cache[:, table[:5]] = holder.kv_cache[:, ids]
    holder.release_export("e1")
    assert peer.commit_kv("fetch-1", p[:20]) == 20
    assert peer.held_prefix(hashes, p) == [TIER_DEVICE] * 5
    assert run(peer, [p]) == ref and peer.kv.pool.prefix_hit_tokens == 20
    holder.close()


def test_engine_loop_takes_tier_results_while_idle(model_dir, tmp_path):
    from node.engine_thread import AsyncEngine

    eng = make(model_dir, num_blocks=16, host_blocks=8, disk=tmp_path)
    seen: list = []
    loop = AsyncEngine(eng, on_kv_events=seen.extend)
    try:
        stream = loop.add_request(prompts(1, seed=21)[0], ONE)
        while not stream.get(timeout=10).finished:
            pass
        deadline = time.monotonic() + 10
        while not any(isinstance(e, BlockStored) and e.tier == TIER_HOST for e in seen):
            assert time.monotonic() < deadline, "the host tier's copies never reached the loop"
            time.sleep(0.01)
    finally:
        loop.shutdown()
    assert eng.tiers.closed  # shutdown finished the tiers and released the directory
    make(model_dir, num_blocks=16, host_blocks=8, disk=tmp_path).close()


def test_status_shows_each_tier(model_dir, tmp_path):
    from deploy.status import Sample, node_row, parse_metrics, render
    from kv_index.nodes import NodeInfo
    from telemetry.metrics import NodeMetrics

    eng = make(model_dir, num_blocks=16, host_blocks=4, disk=tmp_path)
    p = prompts(1, seed=23)[0]
    run(eng, [p], ONE)
    push_down(eng, seed=24)
    run(eng, [p], ONE)
    text = generate_latest(NodeMetrics("m", "prefill", "n0", engine_stats=eng.stats).registry).decode()
    row = node_row(NodeInfo("n0", "prefill", "x:1", "fp", BS, 16), time.time(), Sample(time.time(), parse_metrics(text)))
    tiers = row["tiers"]
    assert tiers["disk"]["hits"] == 4 and tiers["host"]["blocks"] > 0 and tiers["device"]["blocks"] > 0
    assert tiers["disk"]["mean_onboard_s"] > 0
    report = {"time": time.time(), "cluster": {}, "pools": {"prefill": [row]}, "health": [],
              "index": {"freshness_s": {}}, "router": None, "errors": []}
    assert "KV tiers: device" in render(report)
    eng.close()


def test_each_node_gets_its_own_disk_directory(tmp_path):
    from deploy.nodes import NodeTemplate
    from engine.config import EngineConfig

    tpl = NodeTemplate(engine=EngineConfig(cache=CacheConfig(host_cache_mib=1, disk_cache_dir=str(tmp_path),
                                                              disk_cache_mib=8)), redis_url="redis://r")
    assert tpl.config("prefill", 0).engine.cache.disk_cache_dir == str(tmp_path / "prefill-0")
    assert tpl.config("decode", 2).engine.cache.disk_cache_dir == str(tmp_path / "decode-2")


def test_a_restarted_node_republishes_its_disk_blocks_to_the_index(model_dir, tmp_path, redis_url):
    """A warm restart against a real Redis: the blocks an earlier life left on disk are in the
    index under the node's id, with the disk tier's bit, before any request."""
    import uuid

    import redis as redis_lib

    from kv_index.schema import node_holdings, tier_bit
    from tests.clusters import start_node

    earlier = make(model_dir, num_blocks=16, host_blocks=4, disk=tmp_path)
    p = prompts(1, seed=31)[0]
    run(earlier, [p], ONE)
    push_down(earlier, seed=32)
    hashes = hash_prompt_blocks(p, BS, earlier.fingerprint.encode())[:4]
    assert earlier.held_prefix(hashes, p) == [TIER_DISK] * 4
    earlier.close()
    ns = f"tiers-{uuid.uuid4().hex[:6]}"
    node = start_node("prefill", "prefill-0", make(model_dir, num_blocks=16, host_blocks=4, disk=tmp_path),
                      redis_url=redis_url, namespace=ns, metrics_port=None)
    r = redis_lib.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 15
        while True:
            held = node_holdings(r, ns, "prefill-0")[2]
            masks = [held.get(h) for h in hashes]
            if all(m is not None and int(m) & tier_bit(TIER_DISK) for m in masks):
                break
            assert time.monotonic() < deadline, f"disk blocks not in the index: {masks}"
            time.sleep(0.05)
    finally:
        node.stop()
        r.close()


def test_copies_group_runs_and_move_any_pairs_exactly() -> None:
    """Host copies go run by run (consecutive blocks into consecutive slots in one copy); pairs
    in any order, runs or not, land bit-exactly and touch nothing else."""
    import torch

    from engine.kv_tiers.mover import copy_in, copy_out, runs

    assert runs([(4, 0), (5, 1), (6, 2), (9, 3), (10, 4), (2, 7), (3, 9)]) == [(4, 0, 3), (9, 3, 2), (2, 7, 1), (3, 9, 1)]
    assert runs([]) == [] and runs([(1, 1), (1, 2)]) == [(1, 1, 1), (1, 2, 1)]
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(3, 12, 2, 4, 2, 8, generator=g)  # [L, blocks, 2, bs, H_kv, D]
    host = torch.zeros(8, 3, 2, 4, 2, 8)  # [slots, L, 2, bs, H_kv, D]
    out_pairs = [(5, 0), (6, 1), (7, 2), (0, 6), (11, 4), (3, 5)]
    copy_out(pool, host, out_pairs)
    for block, slot in out_pairs:
        assert torch.equal(host[slot], pool[:, block])
    assert not host[[3, 7]].any()
    before = pool.clone()
    in_pairs = [(0, 8), (1, 9), (2, 10), (6, 1), (4, 2)]
    copy_in(pool, host, in_pairs)
    for slot, block in in_pairs:
        assert torch.equal(pool[:, block], host[slot])
    untouched = [b for b in range(12) if b not in {8, 9, 10, 1, 2}]
    assert torch.equal(pool[:, untouched], before[:, untouched])

"""Cost models fitted online from synthetic step reports: no sockets."""
from __future__ import annotations

import random

import pytest

from kv_index.nodes import StepReport
from router.cost_model import (
    TRANSPORT_PRIORS,
    CostBook,
    OnlineFit,
    PrefillCost,
    PrefillCostFit,
    TransferCost,
    TransferFit,
    first_transport,
    solve,
)


def test_solve_3x3_and_singular_direction():
    assert solve([[2, 0, 0], [0, 4, 0], [0, 0, 1]], [2, 8, 3]) == pytest.approx([1, 2, 3])
    # No information about the last coefficient: it stays 0 instead of blowing up.
    assert solve([[1, 0, 0], [0, 1, 0], [0, 0, 0]], [5, 6, 0]) == pytest.approx([5, 6, 0])


def test_prefill_cost_formula():
    m = PrefillCost(fixed_s=0.01, per_token_s=1e-4, attn_s=1e-8)
    # 1000 new tokens over 3000 cached: attention sees on average 3000 + 500 tokens.
    assert m.predict(1000, 3000) == pytest.approx(0.01 + 0.1 + 1e-8 * 1000 * 3500)
    assert m.predict(0, 5000) == 0.0  # a full hit computes nothing


def test_fit_recovers_true_constants_from_noisy_reports():
    true = PrefillCost(fixed_s=0.03, per_token_s=2.0e-4, attn_s=4.0e-9)
    fit = PrefillCostFit(prior=PrefillCost())  # the prior is off by 2-4x on every term
    rng = random.Random(0)
    for _ in range(400):
        new = rng.randint(16, 16000)
        cached = rng.choice([0, 0, rng.randint(0, 30000)])
        fit.add(StepReport(new, cached + new, true.predict(new, cached) * rng.uniform(0.97, 1.03)))
    got = fit.model
    assert got.fixed_s == pytest.approx(true.fixed_s, rel=0.25)
    assert got.per_token_s == pytest.approx(true.per_token_s, rel=0.05)
    assert got.attn_s == pytest.approx(true.attn_s, rel=0.15)
    for new, cached in [(4000, 0), (2000, 20000)]:
        assert got.predict(new, cached) == pytest.approx(true.predict(new, cached), rel=0.05)
    # A short prompt is mostly the intercept, which +-3% noise on multi-second reports barely
    # pins down: there the (scaled) prior still shows.
    assert got.predict(100, 0) == pytest.approx(true.predict(100, 0), rel=0.1)


def test_clustered_reports_keep_the_slope_of_the_scaled_prior():
    """Chat-like reports (30-55 tokens) on a node 40x slower than the prior: the data fixes
    the level, not the slope; the fit must still charge for tokens, or a cached prefix is
    worth nothing to placement."""
    true = PrefillCost(fixed_s=0.1, per_token_s=3.5e-3, attn_s=0.0)
    fit = PrefillCostFit(prior=PrefillCost())
    rng = random.Random(1)
    for _ in range(9):
        new = rng.randint(30, 55)
        fit.add(StepReport(new, new, true.predict(new) * rng.uniform(0.8, 1.2)))
    m = fit.model
    assert fit.scale > 10
    # 223 new tokens vs 15 new over a cached 208: the cached placement must look much cheaper.
    assert m.predict(223) - m.predict(15, 208) > 0.25 * (true.predict(223) - true.predict(15))


def test_prior_holds_until_reports_arrive_and_full_hits_are_ignored():
    fit = PrefillCostFit(prior=PrefillCost())
    assert fit.model == PrefillCost()
    fit.add(StepReport(0, 4096, 0.002))  # nothing computed: no information on compute cost
    assert fit.num_reports == 0 and fit.model == PrefillCost()


def test_forgetting_follows_a_node_that_slows_down():
    base = PrefillCost(0.01, 1e-4, 0.0)
    fit = PrefillCostFit(prior=base, forget=0.98)
    for i in range(300):
        new = 500 + 37 * (i % 50)
        fit.add(StepReport(new, new, base.predict(new)))
    slow = PrefillCost(0.02, 2e-4, 0.0)
    for i in range(300):
        new = 500 + 37 * (i % 50)
        fit.add(StepReport(new, new, slow.predict(new)))
    assert fit.model.predict(2000) == pytest.approx(slow.predict(2000), rel=0.05)


def test_online_fit_is_plain_least_squares_without_forgetting():
    f = OnlineFit(2, forget=1.0)
    for x in range(10):
        f.add((1.0, float(x)), 3.0 + 2.0 * x)
    assert f.coef() == pytest.approx([3.0, 2.0])


def test_cost_book_per_node_models_and_pair_bandwidth():
    book = CostBook(prior=PrefillCost(), default_bandwidth=10e9, kv_bytes_per_token=1000)
    assert book.prefill("never-seen") == PrefillCost()
    assert book.transfer_s("a", "b", 10_000) == pytest.approx(1e7 / 10e9)
    assert book.transfer_s("a", "a", 10_000) == 0.0
    for _ in range(30):
        book.add_transfer("a", "b", 2_000_000_000, 1.0)  # 2 GB/s measured, no fixed cost
    assert book.bandwidth("a", "b") == pytest.approx(2e9, rel=1e-3)
    book.add_transfer("c", "d", 4_000_000_000, 1.0)
    assert book.bandwidth("c", "d") == pytest.approx(4e9, rel=1e-3)  # pairs are fitted apart
    assert book.bandwidth("a", "b") == pytest.approx(2e9, rel=1e-3)
    # pairs are directed; one that never transferred gets the pooled fit of all pairs
    assert 2e9 < book.bandwidth("b", "a") == book.bandwidth("x", "y") < 2.2e9
    # few reports: every node gets the pooled fit; enough: p0 gets its own
    book = CostBook(prior=PrefillCost(), min_reports=3)
    book.add_step("p0", StepReport(1000, 1000, 5.0))
    assert book.prefill("p0") == book.prefill("p1") != PrefillCost()
    for _ in range(3):
        book.add_step("p0", StepReport(1000, 1000, 5.0))
    book.add_step("p2", StepReport(1000, 1000, 0.5))  # a faster peer moves the pooled fit only
    assert book.prefill("p0").predict(1000) > book.prefill("p1").predict(1000) == book.prefill("p2").predict(1000)


def test_transfer_predictions_use_the_measured_model_bytes_per_token():
    book = CostBook(kv_bytes_per_token=131072)
    # A small model: 64 token slots moved in 64 KiB at 1 GB/s.
    book.add_transfer("a", "b", 65536, 65536 / 1e9, num_tokens=64)
    assert book.kv_bytes_per_token == 1024
    assert book.transfer_s("a", "b", 1000) == pytest.approx(1000 * 1024 / 1e9)


# -- KV transfers: fixed cost + bytes / bandwidth, per pair and transport ---------------------------

BLOCK = 720_896  # bytes of one 16-token block of a small fp32 model (the bench's 1-block transfer)


def test_transfer_fit_separates_fixed_cost_from_bandwidth():
    """Chat-sized and long prompts mixed: a bytes/seconds average reads the fixed cost as low
    bandwidth; the fit recovers both."""
    true = TransferCost(fixed_s=2.0e-3, bandwidth=0.8e9)
    fit = TransferFit(TRANSPORT_PRIORS["grpc"])  # prior: 1.3 ms, 1.1 GB/s
    rng = random.Random(2)
    ratios = []
    for _ in range(300):
        nb = BLOCK * rng.choice([1, 1, 1, 2, 3, 4, 16, 64])
        s = true.seconds(nb) * rng.uniform(0.95, 1.05)
        fit.add(nb, s)
        ratios.append(nb / s)
    m = fit.model
    assert m.fixed_s == pytest.approx(true.fixed_s, rel=0.15)
    assert m.bandwidth == pytest.approx(true.bandwidth, rel=0.1)
    for blocks in (1, 64):
        assert m.seconds(blocks * BLOCK) == pytest.approx(true.seconds(blocks * BLOCK), rel=0.05)
    naive_bw = sum(ratios[-50:]) / 50
    assert naive_bw < 0.6 * true.bandwidth  # what the old EWMA of bytes/seconds would have said


def test_reports_of_one_size_fix_the_level_and_keep_the_priors_split():
    """Every prompt 1 block, 3x slower than the prior: the 1-block prediction follows the data;
    the split between fixed cost and bandwidth stays the prior's (scaled), not noise's."""
    prior = TRANSPORT_PRIORS["tcp"]
    fit = TransferFit(prior)
    rng = random.Random(3)
    for _ in range(200):
        fit.add(BLOCK, 3 * prior.seconds(BLOCK) * rng.uniform(0.9, 1.1))
    m = fit.model
    assert m.seconds(BLOCK) == pytest.approx(3 * prior.seconds(BLOCK), rel=0.05)
    assert m.seconds(64 * BLOCK) == pytest.approx(3 * prior.seconds(64 * BLOCK), rel=0.2)
    assert m.fixed_s > 0 and m.bandwidth < prior.bandwidth


def test_priors_before_any_transfer():
    fit = TransferFit(TRANSPORT_PRIORS["shm"])
    assert fit.model == TRANSPORT_PRIORS["shm"] and fit.n == 0 and fit.scale == 1.0
    book = CostBook(default_bandwidth=10e9, default_fixed_s=1e-3, kv_bytes_per_token=1000)
    assert book.transfer_s("p", "d", 1000) == pytest.approx(1e-3 + 1e6 / 10e9)
    assert book.transfer_model("p", "d") == TransferCost(1e-3, 10e9)
    assert book.transfer_fits() == []
    # The transports' priors order as measured: shm cheapest, gRPC dearest, at every size.
    for nb in (BLOCK, 64 * BLOCK):
        assert (TRANSPORT_PRIORS["shm"].seconds(nb) < TRANSPORT_PRIORS["tcp"].seconds(nb)
                < TRANSPORT_PRIORS["grpc"].seconds(nb))


def test_a_pair_is_predicted_by_the_transport_it_last_used():
    book = CostBook(kv_bytes_per_token=BLOCK // 16)
    shm, grpc_ = TransferCost(0.2e-3, 4e9), TransferCost(1.5e-3, 1e9)
    for blocks in [1, 4, 16, 64] * 10:
        book.add_transfer("p", "d", blocks * BLOCK, shm.seconds(blocks * BLOCK), transport="shm")
    assert book.transfer_model("p", "d").bandwidth == pytest.approx(4e9, rel=0.05)
    # shm failed once; the push fell back to gRPC: the pair is predicted at gRPC's cost now.
    book.add_transfer("p", "d", 16 * BLOCK, grpc_.seconds(16 * BLOCK), transport="grpc")
    assert book.transfer_model("p", "d") == book._pairs[("p", "d")].fits["grpc"].model
    assert book.transfer_s("p", "d", 256) > 2 * shm.seconds(16 * BLOCK)
    # ... until shm works again: its fit was kept.
    book.add_transfer("p", "d", 16 * BLOCK, shm.seconds(16 * BLOCK), transport="shm")
    assert book.transfer_s("p", "d", 256) == pytest.approx(shm.seconds(16 * BLOCK), rel=0.05)
    views = {(v.transport, v.current) for v in book.transfer_fits()}
    assert views == {("grpc", False), ("shm", True)}
    # A pair that never transferred is predicted by the pooled fit of the last transport seen.
    assert book.transfer_model("p2", "d") == book._pooled_transfers["shm"].model


def test_streamed_transfers_charge_only_the_exposed_part():
    book = CostBook(kv_bytes_per_token=BLOCK // 16)
    true = TransferCost(0.4e-3, 3e9)
    for blocks in [4, 16, 64] * 20:
        nb = blocks * BLOCK
        # 8 pushes during the compute; the request waits for about a quarter of a one-push transfer.
        book.add_transfer("p", "d", nb, true.seconds(nb, pushes=8), transport="tcp",
                          exposed_s=0.25 * true.seconds(nb), streamed=True, pushes=8)
        book.add_transfer("p", "d2", nb, true.seconds(nb), transport="tcp")  # not streamed
    # The raw model knows the bandwidth: p -> d has only streamed, so tcp's pooled fit of whole
    # pushes (p -> d2's) prices it, not the streamed pushes' summed time.
    assert book.bandwidth("p", "d") == pytest.approx(3e9, rel=0.05)
    assert book.transfer_model("p", "d").fixed_s == pytest.approx(0.4e-3, rel=0.1)
    assert book.transfer_s("p", "d", 1024) == pytest.approx(0.25 * book.raw_transfer_s("p", "d", 1024), rel=0.05)
    assert book.transfer_s("p", "d2", 1024) == book.raw_transfer_s("p", "d2", 1024)
    # Streaming switched off on the node: the exposed share climbs back towards the whole.
    for _ in range(30):
        book.add_transfer("p", "d", 16 * BLOCK, true.seconds(16 * BLOCK), transport="tcp")
    assert book.transfer_s("p", "d", 1024) > 0.95 * book.raw_transfer_s("p", "d", 1024)


def test_a_fully_hidden_streamed_transfer_costs_nothing_and_bad_exposed_figures_teach_nothing():
    book = CostBook(kv_bytes_per_token=BLOCK // 16)
    for _ in range(10):  # the last push landed before the compute ended
        book.add_transfer("p", "d", BLOCK, 1e-3, transport="tcp", exposed_s=0.0, streamed=True, pushes=2)
    assert book.raw_transfer_s("p", "d", 16) > 0 and book.transfer_s("p", "d", 16) < 0.15 * book.raw_transfer_s("p", "d", 16)
    book = CostBook(kv_bytes_per_token=BLOCK // 16)
    for exposed in (-1.0, float("nan")):
        book.add_transfer("p", "d", BLOCK, 1e-3, transport="tcp", exposed_s=exposed, streamed=True)
    assert book._pairs[("p", "d")].exposed_fraction == 1.0 and not book._pairs[("p", "d")].streamed_seen


@pytest.mark.parametrize("nb, seconds", [(0, 1e-3), (-5, 1e-3), (BLOCK, 0.0), (BLOCK, -1.0),
                                         (BLOCK, float("nan")), (BLOCK, float("inf"))])
def test_unusable_reports_teach_nothing(nb, seconds):
    book = CostBook(kv_bytes_per_token=1000)
    before = book.transfer_s("p", "d", 1000)
    book.add_transfer("p", "d", nb, seconds, num_tokens=16, transport="tcp")
    assert book.transfer_s("p", "d", 1000) == before and book.kv_bytes_per_token == 1000
    assert not TransferFit(TRANSPORT_PRIORS["tcp"]).add(nb, seconds)


def test_an_absurd_report_moves_the_fit_a_bounded_step():
    fit = TransferFit(TRANSPORT_PRIORS["tcp"])
    true = TransferCost(0.5e-3, 3e9)
    for blocks in [1, 4, 16, 64] * 20:
        fit.add(blocks * BLOCK, true.seconds(blocks * BLOCK))
    settled = fit.model
    for absurd in (1e-12, 1e4):  # a clock step either way
        f = TransferFit(TRANSPORT_PRIORS["tcp"])
        for blocks in [1, 4, 16, 64] * 20:
            f.add(blocks * BLOCK, true.seconds(blocks * BLOCK))
        assert f.add(16 * BLOCK, absurd)
        for blocks in (1, 64):
            nb = blocks * BLOCK
            assert settled.seconds(nb) / 3 < f.model.seconds(nb) < 3 * settled.seconds(nb)
        assert 0 < f.model.bandwidth <= 1e13 and f.model.fixed_s >= 0
    # A real change still gets through within a few dozen reports.
    slow = TransferCost(5e-3, 0.3e9)
    for blocks in [1, 4, 16, 64] * 25:
        fit.add(blocks * BLOCK, slow.seconds(blocks * BLOCK))
    assert fit.model.seconds(16 * BLOCK) == pytest.approx(slow.seconds(16 * BLOCK), rel=0.1)


def test_orchestrator_feeds_the_book_from_prefill_responses():
    from protos.pdserve.v1 import kv_pb2
    from router.cost_lessons import learn_transfer

    book = CostBook(kv_bytes_per_token=1)
    # A node from before the transports: no transport named, nothing streamed; it pushed over gRPC.
    old = kv_pb2.PrefillResponse(blocks_sent=2, bytes_sent=2 * BLOCK, transfer_s=4e-3)
    learn_transfer(book, "p", "d", old, block_size=16)
    assert book.kv_bytes_per_token == BLOCK // 16
    assert [(v.transport, v.transfers) for v in book.transfer_fits()] == [("grpc", 1)]
    new = kv_pb2.PrefillResponse(blocks_sent=2, bytes_sent=2 * BLOCK, transfer_s=2e-3, transport="tcp",
                                 transfer_exposed_s=2e-4, kv_streamed=True, kv_pushes=4)
    learn_transfer(book, "p", "d", new, block_size=16)
    assert book._pairs[("p", "d")].transport == "tcp"
    assert book.transfer_s("p", "d", 32) < book.raw_transfer_s("p", "d", 32)
    nothing = kv_pb2.PrefillResponse()  # everything cached on the decode node: nothing sent
    learn_transfer(book, "p", "d", nothing, block_size=16)
    # The streamed one taught the exposed share only: tcp is priced by its pooled fit (prior).
    assert [(v.transport, v.transfers, v.current) for v in book.transfer_fits()] == [("grpc", 1, False),
                                                                                     ("tcp", 0, True)]
    assert book.transfer_model("p", "d") == TRANSPORT_PRIORS["tcp"]


def test_fitted_transfers_are_exported_as_gauges():
    from prometheus_client import generate_latest

    from telemetry.metrics import RouterMetrics

    book = CostBook()
    book.add_transfer("p0", "d0", 16 * BLOCK, 5e-3, transport="grpc")
    book.add_transfer("p0", "d0", 16 * BLOCK, 2e-3, transport="tcp")
    m = RouterMetrics("m")
    m.watch_transfers(book.transfer_fits)
    text = generate_latest(m.registry).decode()
    for transport in ("grpc", "tcp"):
        labels = f'{{dst="d0",model_name="m",src="p0",transport="{transport}"}}'
        assert f"pdserve:router_kv_bandwidth_bytes_per_second{labels}" in text
        assert f"pdserve:router_kv_fixed_seconds{labels}" in text
    assert 'pdserve:router_kv_exposed_fraction{dst="d0",model_name="m",src="p0",transport="tcp"} 1.0' in text
    assert 'pdserve:router_kv_exposed_fraction{dst="d0",model_name="m",src="p0",transport="grpc"}' not in text


def test_streamed_pushes_teach_the_exposed_share_not_the_bandwidth():
    """Streamed pushes share the cores with the prefill's compute: timed at a third of the
    bandwidth, they must not make the pair's whole pushes (and fetches) look 3x dearer."""
    book = CostBook(kv_bytes_per_token=BLOCK // 16)
    true = TransferCost(0.4e-3, 3e9)
    for blocks in [1, 4, 16, 64] * 10:
        book.add_transfer("p", "d", blocks * BLOCK, true.seconds(blocks * BLOCK), transport="tcp")
    settled = book.transfer_model("p", "d")
    assert settled.bandwidth == pytest.approx(3e9, rel=0.05)
    for blocks in [4, 16, 64] * 20:
        nb = blocks * BLOCK
        contended = TransferCost(0.4e-3, 1e9).seconds(nb, pushes=6)
        book.add_transfer("p", "d", nb, contended, transport="tcp", exposed_s=0.1 * true.seconds(nb),
                          streamed=True, pushes=6)
    assert book.transfer_model("p", "d") == settled  # the fit saw none of them
    assert book._pooled_transfers["tcp"].model == settled
    assert book.transfer_s("p", "d", 1024) == pytest.approx(0.1 * book.raw_transfer_s("p", "d", 1024), rel=0.05)
    # A pair that has only streamed is priced by the transport's pooled fit of whole pushes.
    book.add_transfer("p", "d3", 16 * BLOCK, 1.0, transport="tcp", exposed_s=0.0, streamed=True, pushes=4)
    assert book.transfer_model("p", "d3") == settled
    assert book.transfer_s("p", "d3", 256) < book.raw_transfer_s("p", "d3", 256)


BOOT = "0b0e5d6c-1111-2222-3333-444455556666"
PREFILL_SENDS = (f"shm://{BOOT}/", "tcp://")
DECODE_HERE = (f"shm://{BOOT}/10.0.0.1:7000", "tcp://10.0.0.1:7000")
DECODE_ELSEWHERE = ("shm://another-boot/10.0.0.2:7000", "tcp://10.0.0.2:7000")


@pytest.mark.parametrize("sender, receiver, expected", [
    (PREFILL_SENDS, DECODE_HERE, "shm"),  # same host: shared memory
    (PREFILL_SENDS, DECODE_ELSEWHERE, "tcp"),  # another host: its shm endpoint is skipped
    (("tcp://",), DECODE_HERE, "tcp"),  # the sender has no shm transport
    ((f"shm://{BOOT}/",), DECODE_ELSEWHERE, "grpc"),  # nothing in common
    ((), DECODE_HERE, "grpc"),  # TLS: the prefill node has only gRPC
    (PREFILL_SENDS, (), "grpc"),  # TLS on the decode node: no data port
    (PREFILL_SENDS, ("tcp://10.0.0.1:7000", f"shm://{BOOT}/10.0.0.1:7000"), "tcp"),  # the receiver's order
    (PREFILL_SENDS, ("rdma://x", "tcp://10.0.0.2:7000"), "tcp"),  # unknown schemes skipped
    (PREFILL_SENDS, PREFILL_SENDS, "grpc"),  # another sender: no address to send to
])
def test_first_transport_walks_the_receivers_endpoints_as_the_sender_does(sender, receiver, expected):
    assert first_transport(sender, receiver) == expected


def test_a_pair_with_no_transfer_yet_is_predicted_by_its_senders_first_transport():
    book = CostBook(default_bandwidth=25e9, kv_bytes_per_token=BLOCK // 16)
    book.note_endpoints({"p": PREFILL_SENDS, "d-here": DECODE_HERE, "d-far": DECODE_ELSEWHERE,
                         "p-tls": (), "d-tls": ()})
    assert book.transfer_model("p", "d-here") == TRANSPORT_PRIORS["shm"]
    assert book.transfer_model("p", "d-far") == TRANSPORT_PRIORS["tcp"]
    assert book.transfer_model("p-tls", "d-tls") == TRANSPORT_PRIORS["grpc"]
    assert book.transfer_model("p", "unknown") == TransferCost(0.0, 25e9)  # not in the view: the default
    # Another pair's tcp transfers move the guess for every tcp pair (the pooled fit) ...
    slow = TransferCost(2e-3, 0.5e9)
    for blocks in [1, 4, 16, 64] * 10:
        book.add_transfer("p2", "d2", blocks * BLOCK, slow.seconds(blocks * BLOCK), transport="tcp")
    assert book.transfer_model("p", "d-far") == book._pooled_transfers["tcp"].model
    assert book.transfer_model("p", "d-far").bandwidth == pytest.approx(0.5e9, rel=0.1)
    assert book.transfer_model("p", "d-here") == TRANSPORT_PRIORS["shm"]  # ... not the shm ones
    # Once the pair transferred, what carried it decides (the shm attach was refused: tcp).
    book.add_transfer("p", "d-here", 16 * BLOCK, slow.seconds(16 * BLOCK), transport="tcp")
    assert book.transfer_model("p", "d-here") == book._pairs[("p", "d-here")].fits["tcp"].model


def test_a_pair_whose_first_transport_is_dist_is_priced_by_the_dist_prior():
    """Both ends run with --kv-dist (dist:// between shm and tcp): on another host the sender
    tries dist first, so the pair starts at dist's prior (slower than tcp's on CPU), and its
    own dist transfers replace it."""
    sends = (f"shm://{BOOT}/", "dist://", "tcp://")
    far = ("shm://another-boot/10.0.0.2:7000", "dist://10.0.0.2:7000", "tcp://10.0.0.2:7000")
    assert first_transport(sends, far) == "dist"
    assert first_transport(PREFILL_SENDS, far) == "tcp"  # a sender without --kv-dist
    book = CostBook(kv_bytes_per_token=BLOCK // 16)
    book.note_endpoints({"p": sends, "d": far, "p-tcp": PREFILL_SENDS})
    prior = TRANSPORT_PRIORS["dist"]
    assert book.transfer_model("p", "d") == prior
    assert book.transfer_model("p-tcp", "d") == TRANSPORT_PRIORS["tcp"]
    assert TRANSPORT_PRIORS["shm"].bandwidth > TRANSPORT_PRIORS["tcp"].bandwidth > prior.bandwidth
    assert prior.bandwidth > TRANSPORT_PRIORS["grpc"].bandwidth
    measured = TransferCost(0.5e-3, 2.0e9)
    for blocks in [1, 4, 16, 64] * 10:
        book.add_transfer("p", "d", blocks * BLOCK, measured.seconds(blocks * BLOCK), transport="dist")
    assert book.transfer_model("p", "d").bandwidth == pytest.approx(2.0e9, rel=0.1)


def test_the_node_view_tells_the_book_what_each_node_advertises():
    from kv_index.nodes import NodeInfo
    from router.node_view import NodeRefresher

    class Registry:  # stands in for IndexReader's reads: what the registry holds now
        def __init__(self, nodes):
            self.nodes = nodes

        def live_nodes(self):
            return dict(self.nodes)

        def read_steps(self, cursors):
            return {}

    def node(node_id, role, kv_endpoints):
        return NodeInfo(node_id=node_id, role=role, grpc_address=f"{node_id}:1", fingerprint="fp", block_size=16,
                        num_blocks=100, kv_endpoints=kv_endpoints)

    book = CostBook(kv_bytes_per_token=BLOCK // 16)
    reg = Registry({"p": node("p", "prefill", PREFILL_SENDS), "d": node("d", "decode", DECODE_ELSEWHERE)})
    NodeRefresher(reg, refresh_s=1.0, prune_every_s=10.0, costs=book).refresh_once()
    assert book.transfer_model("p", "d") == TRANSPORT_PRIORS["tcp"]


# -- onboarding: a node's host and disk tiers back to its device ----------------------------------
def test_onboard_starts_from_the_tier_prior_and_learns_each_node():
    from router.cost_model import ONBOARD_PRIORS

    book = CostBook(kv_bytes_per_token=1000)
    assert book.onboard_s("a", "host", 0) == 0.0
    assert book.onboard_s("a", "host", 4000) == pytest.approx(ONBOARD_PRIORS["host"].seconds(4e6))
    assert book.onboard_s("a", "disk", 4000) > book.onboard_s("a", "host", 4000)
    # node a's disk reads at 5 GB/s with 1 ms per file, spread sizes: both coefficients fitted
    rng = random.Random(3)
    for _ in range(40):
        nbytes = rng.choice((2e5, 2e6, 3e7))
        book.add_onboard("a", "disk", nbytes, (1e-3 + nbytes / 5e9) * rng.uniform(0.97, 1.03))
    fit = book.onboard_model("a", "disk")
    assert fit.bandwidth == pytest.approx(5e9, rel=0.1) and fit.fixed_s == pytest.approx(1e-3, rel=0.2)
    # a node without reports is predicted by the tier's pooled fit, not the prior; host untouched
    assert book.onboard_model("b", "disk") == book.onboard_model("a", "disk")
    assert book.onboard_model("a", "host") == ONBOARD_PRIORS["host"]
    views = {(v.node_id, v.tier): v for v in book.onboard_fits()}
    assert set(views) == {("", "disk"), ("a", "disk")} and views[("a", "disk")].onboards == 40


def test_onboard_tiers_by_name_or_index_number_and_bad_reports_teach_nothing():
    from kv_index.schema import TIER_DEVICE, TIER_DISK, TIER_HOST

    book = CostBook()
    for bad in ((0, 0.1), (1e6, 0.0), (-5, 0.1), (1e6, float("nan")), (float("inf"), 1.0)):
        book.add_onboard("a", "host", *bad)
    assert book.onboard_fits() == []
    book.add_onboard("a", TIER_HOST, 1e8, 1e8 / 30e9)
    book.add_onboard("a", TIER_DISK, 1e8, 1e8 / 3e9)
    assert {(v.tier, v.onboards) for v in book.onboard_fits() if v.node_id == "a"} == {("host", 1), ("disk", 1)}
    assert book.onboard_s("a", TIER_HOST, 1000) == book.onboard_s("a", "host", 1000)
    for tier in (TIER_DEVICE, "device", "ssd"):
        with pytest.raises(ValueError, match="no onboard cost"):
            book.add_onboard("a", tier, 1e6, 0.1)
    # one absurd report moves the fit a bounded step (the transfer fits' clipping)
    before = book.onboard_s("a", "host", 1000)
    book.add_onboard("a", "host", 1e8, 1e5)
    assert book.onboard_s("a", "host", 1000) < 1000 * before

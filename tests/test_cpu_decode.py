"""The native CPU decode attention (engine/attention/cpu_decode.c) against float64 attention over
random paged caches, inside the torch reference backend, and its build/load/fallback paths."""
from __future__ import annotations

import logging
import os
import random
import shutil

import pytest
import torch

from engine.attention import cpu_decode, get_attention_backend
from engine.attention.backend import flat_layer
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_ref import TorchRefBackend

BS = 16
BF16_EPS = 2.0**-8  # half a bf16 ulp, relative: the error of one correct rounding


def have_compiler() -> bool:
    return shutil.which(os.environ.get("CC") or "cc") is not None  # what cpu_decode.load uses


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    if not have_compiler():
        pytest.skip("no C compiler on this machine: the engine falls back to gather + SDPA")
    k = cpu_decode.load(tmp_path_factory.mktemp("kernels"))
    assert k is not None, "a C compiler is here, so the kernel must build and load"
    return k


def paged_decodes(seq_lens, hq, hkv, d, seed=0):
    """A bf16 layer cache with shuffled blocks, one decode query per sequence (its own K/V
    already in place), and the decodes' tokens interleaved with other rows of q."""
    gen = torch.Generator().manual_seed(seed)
    widths = [(n + BS - 1) // BS for n in seq_lens]
    blocks = list(range(sum(widths) + 3))
    random.Random(seed).shuffle(blocks)
    tables = [[blocks.pop() for _ in range(w)] for w in widths]
    num_blocks = sum(widths) + 3
    cache = torch.randn(num_blocks, 2, BS, hkv, d, generator=gen).to(torch.bfloat16)
    t = 2 * len(seq_lens) + 1
    q = torch.randn(t, hq, d, generator=gen).to(torch.bfloat16)
    q_start = [2 * i + 1 for i in range(len(seq_lens))]  # rows 0, 2, 4, ... are not decodes
    return cache, tables, q, q_start


def exact(cache, tables, seq_lens, q, q_start, scale) -> torch.Tensor:  # [n, Hq, D] float64
    hq, hkv = q.shape[1], cache.shape[3]
    outs = []
    for table, n, t in zip(tables, seq_lens, q_start):
        pos = torch.arange(n)
        blk = torch.tensor(table)[pos // BS]
        k = cache[blk, 0, pos % BS].double()  # [n, Hkv, D]
        v = cache[blk, 1, pos % BS].double()
        k = k.repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = v.repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[t].double(), k) * scale  # [Hq, n]
        outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(outs)


def call(kernel, cache, tables, seq_lens, q, q_start, scale, out):
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    kernel(q, flat_layer(cache), padded, torch.tensor(seq_lens, dtype=torch.int32),
           torch.tensor(q_start, dtype=torch.int32), BS, scale, out)


def assert_rounded_once(got, ref):
    """Within one rounding of the exact result (plus float32 accumulation), and almost always
    the correctly rounded value itself."""
    got = got.double()
    assert ((got - ref).abs() <= BF16_EPS * 1.01 * ref.abs() + 1e-6).all()
    assert (got == ref.to(torch.bfloat16).double()).double().mean() > 0.99


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 16)])
@pytest.mark.parametrize("seq_lens", [
    [1, 5, 16, 17, 300, 512, 513, 1100],  # ragged; 512 / 513 / 1100 cross the 512-position chunks
    [1300],
])
# Work items are whole rows of KV heads when there are >= 2 sequences per thread, else one
# head each: seeing 1 thread or 64 covers both whatever this machine has.
@pytest.mark.parametrize("threads", [1, 64])
def test_kernel_is_correctly_rounded_attention(kernel, hq, hkv, d, seq_lens, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    cache, tables, q, q_start = paged_decodes(seq_lens, hq, hkv, d)
    scale = d**-0.5
    out = torch.full_like(q, 7.0)
    call(kernel, cache, tables, seq_lens, q, q_start, scale, out)
    assert_rounded_once(out[q_start], exact(cache, tables, seq_lens, q, q_start, scale))
    # Rows that are not decodes are left alone.
    others = [i for i in range(q.shape[0]) if i not in q_start]
    assert (out[others] == 7.0).all()


@pytest.mark.parametrize("peak", [3, 700, 1299])  # in the first chunk, a middle one, the last
def test_peaked_softmax_rescales_across_chunks(kernel, peak):
    # One key far above the rest: the running max jumps (peak in a later chunk) or stays (peak
    # in the first), and what came before must be rescaled exactly once.
    seq_lens = [1300]
    cache, tables, q, q_start = paged_decodes(seq_lens, 4, 2, 32, seed=3)
    blk, off = tables[0][peak // BS], peak % BS
    cache[blk, 0, off] = (4 * q[q_start[0], ::2]).to(torch.bfloat16)  # KV head h matches query head 2h
    scale = 32**-0.5
    out = torch.zeros_like(q)
    call(kernel, cache, tables, seq_lens, q, q_start, scale, out)
    assert_rounded_once(out[q_start], exact(cache, tables, seq_lens, q, q_start, scale))


def test_backend_routes_decodes_to_the_kernel_and_leaves_the_rest_to_sdpa(kernel):
    # A prefill chunk after cached context, a verification (q_len 4) and three decodes.
    q_lens, ctx = [20, 4, 1, 1, 1], [30, 60, 5, 200, 700]
    seq_lens = [q + c for q, c in zip(q_lens, ctx)]
    hq, hkv, d = 6, 2, 32
    gen = torch.Generator().manual_seed(1)
    widths = [(n + BS - 1) // BS for n in seq_lens]
    blocks = list(range(sum(widths)))
    random.Random(1).shuffle(blocks)
    tables = [[blocks.pop() for _ in range(w)] for w in widths]
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, BS)
    cache = torch.randn(sum(widths), 2, BS, hkv, d, generator=gen).to(torch.bfloat16)
    t = sum(q_lens)
    q, k, v = (torch.randn(t, h, d, generator=gen).to(torch.bfloat16) for h in (hq, hkv, hkv))

    outs = {}
    for name, dk in (("sdpa", None), ("kernel", kernel)):
        backend = TorchRefBackend(hq, hkv, d, decode_kernel=dk)
        backend.begin_step(meta)
        c = cache.clone()
        outs[name] = backend.forward(0, q, k, v, c)
    assert backend._decodes is not None and backend._decodes.seq_lens.tolist() == [6, 201, 701]
    decode_rows = [meta.query_start[s] for s in (2, 3, 4)]
    other_rows = [i for i in range(t) if i not in decode_rows]
    # Prefill and verification rows: the same SDPA calls, bit for bit.
    assert torch.equal(outs["kernel"][other_rows], outs["sdpa"][other_rows])
    # Decode rows: one rounding from exact attention over the cache as the step left it (the
    # new K/V written in).
    dec = [2, 3, 4]
    written = c.view(sum(widths), 2, BS, hkv, d)
    ref = exact(written, [tables[s] for s in dec], [seq_lens[s] for s in dec], q, decode_rows, d**-0.5)
    assert_rounded_once(outs["kernel"][decode_rows], ref)


def test_get_attention_backend_uses_the_kernel_for_cpu_bfloat16_only(kernel):
    cpu = torch.device("cpu")
    assert get_attention_backend(cpu, 4, 2, 16, torch.bfloat16, decode_kernel=kernel).decode_kernel is kernel
    assert get_attention_backend(cpu, 4, 2, 16, torch.float32, decode_kernel=kernel).decode_kernel is None


def test_kernel_rejects_what_it_cannot_read(kernel):
    cache, tables, q, q_start = paged_decodes([5], 4, 2, 16)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="bf16 only"):
        call(kernel, cache.float(), tables, [5], q.float(), q_start, 0.25, out.float())
    with pytest.raises(ValueError, match="contiguous"):
        call(kernel, cache, tables, [5], q.transpose(0, 1).contiguous().transpose(0, 1), q_start, 0.25, out)


@pytest.mark.parametrize("bad", ["seq_len 0", "seq_len past the table", "q row past q", "block past the cache"])
def test_kernel_refuses_out_of_range_indices_before_reading_them(kernel, bad):
    seq_lens = [5, 40]
    cache, tables, q, q_start = paged_decodes(seq_lens, 4, 2, 16)
    if bad == "seq_len 0":
        seq_lens = [0, 40]
    elif bad == "seq_len past the table":
        seq_lens = [5, 3 * BS + 1]  # the table holds 3 blocks
    elif bad == "q row past q":
        q_start = [1, q.shape[0]]
    else:
        tables = [tables[0], tables[1][:2] + [cache.shape[0]]]
    out = torch.full_like(q, 7.0)
    with pytest.raises(ValueError, match="out of range"):
        call(kernel, cache, tables, seq_lens, q, q_start, 0.25, out)
    assert (out == 7.0).all()  # checked before anything was written


def test_loading_twice_reuses_the_built_library(tmp_path, monkeypatch):
    if not have_compiler():
        pytest.skip("no C compiler")
    first = cpu_decode.load(tmp_path)
    assert first is not None

    def no_rebuild(cc, path):
        raise AssertionError("rebuilt a cached kernel")

    monkeypatch.setattr(cpu_decode, "_build", no_rebuild)
    assert cpu_decode.load(tmp_path).path == first.path


def test_a_read_only_cache_still_gets_a_kernel(tmp_path, monkeypatch):
    if not have_compiler():
        pytest.skip("no C compiler")
    built = cpu_decode.load(tmp_path / "rw")
    assert built is not None

    def no_lock(*args, **kwargs):  # what opening the lock file does in a read-only directory
        raise PermissionError("read-only file system")

    monkeypatch.setattr(cpu_decode, "open", no_lock, raising=False)
    # A prebuilt library there is used as it is ...
    assert cpu_decode.load(tmp_path / "rw").path == built.path
    # ... and without one the kernel is built into a private directory.
    elsewhere = cpu_decode.load(tmp_path / "empty")
    assert elsewhere is not None and not elsewhere.path.is_relative_to(tmp_path)
    assert not list((tmp_path / "empty").glob("*.so"))


def test_no_compiler_or_a_failing_build_falls_back_with_a_reason(tmp_path, caplog):
    assert cpu_decode.load(tmp_path, compiler="/nonexistent/cc") is None
    with caplog.at_level(logging.WARNING, logger=cpu_decode.__name__):
        assert cpu_decode.load(tmp_path, compiler="false") is None  # runs, exits 1: a failed build
    assert "unavailable" in caplog.text and "failed" in caplog.text
    assert not list(tmp_path.glob("*.so"))


def test_loading_leaves_float_behaviour_of_the_process_alone(kernel):
    # gcc links crtfastmath.o into -ffast-math shared objects, which would set flush-to-zero for
    # the whole process on load; the kernel is linked without it.
    assert (torch.tensor([1e-40]) * 1.0).item() != 0.0

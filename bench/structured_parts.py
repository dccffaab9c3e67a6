"""Each part of the mask work in absolute microseconds per token, for `pdserve bench structured`.

The engine's own grammar code (engine/structured/: ``StructuredDecoding.prepare``,
``StepMasks.apply``, ``StructuredDecoding.advance``) replayed over the tokens the engine
emitted, in steps of up to ``batch`` sequences, with no forward pass in between, so each part
is timed alone::

    fill     prepare + wait: every live sequence's next mask into its bitmask row
             (serial: one matcher after another; parallel: the batch at once on llguidance's
             pool; overlap: parallel on the fill's thread, with no forward to hide behind, so
             fill_overlap - fill_parallel is the thread hand-off a step pays)
    apply    the step's masks onto a [batch, vocab] logits block (-inf where refused)
    advance  each matcher over the token its sequence emitted

``us_per_token`` = a part's time over all steps / the tokens advanced. A step of the engine
pays fill + apply + advance on top of its forward, unless the fill overlaps the forward
(FillMode.OVERLAP, measured end to end in bench/structured_decode.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class PartTimes:
    fill_s: float = 0.0
    apply_s: float = 0.0
    advance_s: float = 0.0
    tokens: int = 0
    compile_ms: list[float] = field(default_factory=list)  # compiles the requests' add paid

    def us_per_token(self) -> dict[str, float]:
        n = max(self.tokens, 1)
        return {"fill": round(self.fill_s * 1e6 / n, 2), "apply": round(self.apply_s * 1e6 / n, 2),
                "advance": round(self.advance_s * 1e6 / n, 2)}


def replay(sd, requests: list[tuple], batch: int, logits) -> PartTimes:
    """``sd``: a StructuredDecoding (its fill mode is the one timed); ``requests``:
    (StructuredOutput, emitted token ids); ``logits`` [>= batch, vocab] float32."""
    from engine.scheduler import ScheduledSeq
    from engine.sequence import Sequence
    from tokens.sampling_params import SamplingParams
    times = PartTimes()
    cache = sd.compiler.get().cache
    for g in range(0, len(requests), batch):
        before = len(cache.compile_ms)
        live = []
        for i, (so, toks) in enumerate(requests[g:g + batch]):
            seq = Sequence(f"replay-{g + i}", 0, [0], 1, SamplingParams(structured=so), 0.0)
            sd.add(seq.seq_id, so, [])
            live.append((ScheduledSeq(seq, 0, 1, sample=True), toks))
        times.compile_ms += cache.compile_ms[before:]
        step = 0
        while live:
            items = [it for it, _ in live]
            block = logits[:len(items)].clone()
            t0 = time.perf_counter()
            masks = sd.prepare(items)
            masks.wait()
            t1 = time.perf_counter()
            masks.apply(block, items, [])
            t2 = time.perf_counter()
            ended = [sd.advance(it.seq.seq_id, [toks[step]]) is not None for it, toks in live]
            t3 = time.perf_counter()
            times.fill_s += t1 - t0
            times.apply_s += t2 - t1
            times.advance_s += t3 - t2
            times.tokens += len(live)
            step += 1
            done = [it.seq.seq_id for (it, toks), end in zip(live, ended) if end or step == len(toks)]
            sd.forget(*done)
            live = [(it, toks) for it, toks in live if it.seq.seq_id not in done]
    return times


def part_figures(eng, requests: list[tuple], fresh_requests, batch: int) -> tuple[dict, list[float]]:
    """The parts of one case -> (us_per_token with ``fill`` serial, ``fill_parallel`` and
    ``fill_overlap``, the compiles the requests paid). ``fresh_requests()``: the requests under schemas never
    compiled (a cold case: each mode replays its own), or None (warm: one untimed pass
    first, so every template is compiled and its lexer warmed)."""
    import torch

    from engine.structured.decoding import FillMode, StructuredDecoding
    vocab = eng.model_config.vocab_size
    logits = torch.randn(max(batch, 1), vocab, generator=torch.Generator().manual_seed(0))
    sd = StructuredDecoding(eng.structured.compiler, vocab, eng.eos_token_ids)
    if fresh_requests is None:
        replay(sd, requests, batch, logits)
    got = {}
    for mode in FillMode:
        sd.fill = mode
        got[mode] = replay(sd, fresh_requests() if fresh_requests else requests, batch, logits)
    us = got[FillMode.SERIAL].us_per_token()
    for mode in (FillMode.PARALLEL, FillMode.OVERLAP):
        us[f"fill_{mode.value}"] = got[mode].us_per_token()["fill"]
    return us, [ms for t in got.values() for ms in t.compile_ms]

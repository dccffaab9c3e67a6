"""xgrammar against llguidance on one tokenizer: schema coverage, compile time, mask cost
(`pdserve bench structured --compare-engines`; the figures and the choice: docs/structured.md).

Both engines are driven the same way: compile a JSON schema, then walk an instance of it
token by token, filling the 32-tokens-per-int32 bitmask before each token and applying it to a
logits row with the engine's own apply. Coverage per construct (bench/structured_cases.py):
``covered`` (compiles, accepts the valid instance, refuses the invalid one), ``ignored``
(compiles but lets the invalid instance through), ``refused`` (compile error), ``broken``
(compiles but refuses the valid instance).
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field

from bench.structured_cases import CASES


@dataclass
class EngineStats:
    name: str
    version: str
    coverage: dict[str, str] = field(default_factory=dict)
    compile_ms: list[float] = field(default_factory=list)
    fill_us: list[float] = field(default_factory=list)  # one mask, batch 1
    apply_us: list[float] = field(default_factory=list)  # one [1, vocab] row
    fill8_us: list[float] = field(default_factory=list)  # 8 masks, one step of a batch of 8
    apply8_us: list[float] = field(default_factory=list)  # one [8, vocab] block

    def summary(self) -> dict:
        med = (lambda xs: round(statistics.median(xs), 1) if xs else None)
        counts = {k: sum(1 for v in self.coverage.values() if v == k) for k in ("covered", "ignored", "refused",
                                                                                 "broken")}
        return {"engine": self.name, "version": self.version, **counts, "cases": len(self.coverage),
                "compile_ms_p50": round(statistics.median(self.compile_ms), 2) if self.compile_ms else None,
                "mask_us_batch1": med(self.fill_us), "apply_us_batch1": med(self.apply_us),
                "mask_us_batch8": med(self.fill8_us), "apply_us_batch8": med(self.apply8_us),
                "coverage": dict(self.coverage)}


class _XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import torch
        import xgrammar as xg
        self.xg, self.torch = xg, torch
        self.version = _dist_version("xgrammar")
        info = xg.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        # No cache: every compile is measured cold, as a new schema would be.
        self.compiler = xg.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True)

    def matcher(self, compiled):
        return self.xg.GrammarMatcher(compiled)

    def bitmask(self, batch: int):
        return self.xg.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, m, bitmask, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def can_end(self, m, eos: int, bitmask) -> bool:
        m.fill_next_token_bitmask(bitmask, 0)
        return bool((int(bitmask[0, eos // 32]) >> (eos % 32)) & 1)

    def apply(self, logits, bitmask) -> None:
        self.xg.apply_token_bitmask_inplace(logits, bitmask)


class _LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int) -> None:
        import llguidance
        import torch

        from engine.structured.mask import apply_bitmask
        self.ll, self.torch, self._apply = llguidance, torch, apply_bitmask
        self.version = llguidance.get_version()
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        # Matcher creation is llguidance's compile (its lexer is built lazily from here on).
        m = self.ll.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(self, grammar):
        return self.ll.LLMatcher(self.tok, grammar, log_level=0)

    def bitmask(self, batch: int):
        return self.torch.full((batch, (self.vocab_size + 31) // 32), -1, dtype=self.torch.int32)

    def fill(self, m, bitmask, row: int) -> None:
        v = bitmask[row]
        m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def can_end(self, m, eos: int, bitmask) -> bool:
        return m.is_accepting()

    def apply(self, logits, bitmask) -> None:
        self._apply(logits, bitmask)


def _dist_version(name: str) -> str:
    from importlib.metadata import version
    return version(name)


def _walk(eng, compiled, tokens: list[int], eos: int, stats: EngineStats | None, logits) -> bool:
    """Feed ``tokens`` under the mask; True when every token is allowed and the end is reached."""
    m = eng.matcher(compiled)
    bitmask = eng.bitmask(1)
    for tok in tokens:
        t0 = time.perf_counter()
        eng.fill(m, bitmask, 0)
        t1 = time.perf_counter()
        if stats is not None:
            row = logits.clone()
            t2 = time.perf_counter()
            eng.apply(row, bitmask)
            stats.apply_us.append((time.perf_counter() - t2) * 1e6)
            stats.fill_us.append((t1 - t0) * 1e6)
        if not (int(bitmask[0, tok // 32]) >> (tok % 32)) & 1:
            return False
        if not eng.accept(m, tok):
            return False
    return eng.can_end(m, eos, bitmask)


def _walk_batch8(eng, compiled, tokens: list[int], stats: EngineStats, logits8) -> None:
    ms = [eng.matcher(compiled) for _ in range(8)]
    bitmask = eng.bitmask(8)
    for tok in tokens:
        t0 = time.perf_counter()
        for i, m in enumerate(ms):
            eng.fill(m, bitmask, i)
        t1 = time.perf_counter()
        block = logits8.clone()
        t2 = time.perf_counter()
        eng.apply(block, bitmask)
        stats.apply8_us.append((time.perf_counter() - t2) * 1e6)
        stats.fill8_us.append((t1 - t0) * 1e6)
        for m in ms:
            eng.accept(m, tok)


def measure(eng, encode, eos: int, vocab_size: int) -> EngineStats:
    """Coverage over every case; compile and mask timings over the covered ones."""
    import torch
    stats = EngineStats(eng.name, eng.version)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, vocab_size, generator=gen)
    logits8 = torch.randn(8, vocab_size, generator=gen)
    for c in CASES:
        t0 = time.perf_counter()
        try:
            compiled = eng.compile(c.schema)
        except Exception:  # noqa: BLE001 - each engine raises its own error types for a refused schema
            stats.coverage[c.name] = "refused"
            continue
        compile_ms = (time.perf_counter() - t0) * 1e3
        if not _walk(eng, compiled, encode(json.dumps(c.valid)), eos, None, logits):
            stats.coverage[c.name] = "broken"
            continue
        bad_ok = _walk(eng, compiled, encode(json.dumps(c.invalid)), eos, None, logits)
        stats.coverage[c.name] = "ignored" if bad_ok else "covered"
        stats.compile_ms.append(compile_ms)
        valid_tokens = encode(json.dumps(c.valid))
        _walk(eng, compiled, valid_tokens, eos, stats, logits)
        _walk_batch8(eng, compiled, valid_tokens, stats, logits8)
    return stats


def compare(model_dir: str, vocab_size: int) -> list[dict]:
    """Both engines on the tokenizer in ``model_dir``; one summary dict per engine."""
    from pathlib import Path

    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(model_dir)
    eos = hf.eos_token_id

    def encode(text: str) -> list[int]:
        return hf.encode(text, add_special_tokens=False)

    tokenizer_json = (Path(model_dir) / "tokenizer.json").read_text()
    results = [measure(_LLGuidance(tokenizer_json, vocab_size, eos), encode, eos, vocab_size).summary()]
    try:  # not a pdserve dependency (it imports torch and pulls triton): `pip install xgrammar`
        xgr = _XGrammar(hf, vocab_size)
    except ImportError as e:
        return results + [{"engine": "xgrammar", "error": f"not installed ({e}): pip install xgrammar"}]
    return results + [measure(xgr, encode, eos, vocab_size).summary()]

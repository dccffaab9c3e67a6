"""LLMEngine: add_request / step / abort over the scheduler, model runner and detokenizer.

One engine serves one model in one process. Each ``step`` runs one scheduler iteration and
returns a ``RequestOutput`` for every request that produced something (new tokens, text, a
finish), so callers stream by looping on ``step``. ``generate`` is the blocking helper.

With ``EngineConfig.speculative`` on, each step also runs the speculation loop
(``engine/speculative/loop.py``): lookahead slots planned by the adaptive controller, drafts from
the injected ``Proposer``, all k + 1 positions verified in the step's one forward pass, and
only the accepted run kept by the scheduler (docs/speculative.md).
"""
from __future__ import annotations

import itertools
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator
from typing import Sequence as Seq

import torch

from engine.attention import cpu_decode, get_attention_backend
from engine.attention.kv_cache import allocate_kv_cache, bytes_per_block
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import KV_PREEMPTED, KVLayerListener, ModelRunner
from engine.models.builtin import cache_dir
from engine.models.config import ModelConfig
from engine.models.cpu_linear import load_or_tune
from engine.models.loader import LoadedModel, load_model
from engine.sampler import Sampler
from engine.scheduler import SampledTokens, Scheduler
from engine.sequence import Sequence, seq_id_of
from engine.speculative.loop import SpeculativeDecoding
from engine.speculative.proposer import Proposer, SpecStats
from tokens.detokenizer import IncrementalDetokenizer, StopStringMatcher
from tokens.sampling_params import SamplingParams
from tokens.stop import FinishReason

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]  # every generated token so far
    new_token_ids: list[int]  # generated in this step
    text: str  # detokenized so far, stop strings trimmed ("" without a tokenizer)
    text_delta: str
    logprobs: list[float] | None = None
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    spec: SpecStats | None = None  # speculative-decoding counters of this sample (None: off)


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Times any of the request's sequences was preempted (recomputed) so far: a node's trace
    # marks each new one as it streams the request's outputs.
    num_preemptions: int = 0

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics


@dataclass(slots=True)
class _SeqText:
    """Per-sample text state; None parts when the engine runs without a tokenizer."""

    detok: IncrementalDetokenizer | None
    stops: StopStringMatcher | None
    text: str = ""
    logprobs: list[float] | None = None


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    texts: dict[int, _SeqText] = field(default_factory=dict)
    # Output tokens this request produced elsewhere before it came here (a migrated request):
    # not streamed again; the detokenizer replays them (_append_text).
    resumed: int = 0


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig = EngineConfig(),
        progress: Callable[[str], None] | None = None,
        loaded: LoadedModel | None = None,
        tokenizer=None,
        load_tokenizer: bool = True,
        proposer_factory: Callable[["LLMEngine"], Proposer | None] | None = None,
    ) -> None:
        """``proposer_factory`` builds the speculative-decoding proposer from this engine (its
        model, KV cache, device); required when ``config.speculative`` is on. Decode nodes
        pass ``decode_node.proposers.build_proposer``. It may return None when it measured that its
        drafter cannot pay here; the engine then runs without speculation (``self.spec`` None)."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = torch_dtype(config.dtype)
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        if loaded is None:
            loaded = load_model(config.model, self.dtype, self.device, progress=progress)
        self.loaded = loaded
        self.model_config: ModelConfig = loaded.config
        self.linear_plan = None
        if self.device.type == "cpu" and config.cpu_kernels == "auto":
            self.linear_plan = load_or_tune(loaded.model.matmul_weights(), cache_dir() / "kernels", progress)
        loaded.model.set_linear_plan(self.linear_plan)
        # KV of the same weights in another dtype is different KV: the dtype is part of the
        # key that seeds block hashes and that KV transfers are checked against.
        self.fingerprint: str = f"{loaded.fingerprint}-{config.dtype}"
        if tokenizer is None and load_tokenizer:
            tokenizer = load_hf_tokenizer(loaded.tokenizer_path)
        self.tokenizer = tokenizer

        mc = self.model_config
        cc = config.cache
        self.block_size = cc.block_size
        self.max_model_len = min(config.scheduler.max_model_len or mc.max_model_len, mc.max_model_len)
        per_block = bytes_per_block(mc, cc.block_size, self.dtype)
        num_blocks = cc.num_blocks or max(1, cc.kv_cache_bytes // per_block)
        self.num_blocks = num_blocks
        if progress:
            progress(f"allocating KV cache: {num_blocks} blocks x {cc.block_size} tokens "
                     f"({num_blocks * per_block / 2**20:.0f} MiB)")
        self.kv_cache = allocate_kv_cache(mc, num_blocks, cc.block_size, self.dtype, self.device)
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching,
                                 extra_key=self.fingerprint.encode())
        eos = tuple(mc.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos = eos + (tokenizer.eos_token_id,)
        self.eos_token_ids = eos
        self.scheduler = Scheduler(config.scheduler, cc, self.kv, self.max_model_len, eos)
        decode_kernel = None
        if self.device.type == "cpu" and config.cpu_kernels == "auto" and self.dtype == torch.bfloat16:
            decode_kernel = cpu_decode.load(cache_dir() / "kernels")
        backend = get_attention_backend(self.device, mc.num_heads, mc.num_kv_heads, mc.head_dim, self.dtype,
                                        decode_kernel=decode_kernel)
        self.runner = ModelRunner(loaded.model, self.kv_cache, backend, cc.block_size, self.device,
                                  Sampler(eos_token_ids=eos, seed=config.seed))
        self.spec: SpeculativeDecoding | None = None
        self._whole_batch = False  # inside generate(): the caller waits for every request
        if config.speculative.enabled:
            if proposer_factory is None:
                raise ValueError(
                    f"speculative method {config.speculative.method!r} is configured but no proposer "
                    "factory was passed (decode nodes pass decode_node.proposers.build_proposer)")
            # None: the factory measured that its drafter cannot pay on this machine (a bf16
            # draft on a CPU without bf16 matmuls); the engine serves without speculation.
            proposer = proposer_factory(self)
            if proposer is not None:
                if proposer.target_states is not None:
                    self.runner.send_target_states(proposer.target_states, proposer.observe_target)
                gemm = self.linear_plan.gemm_ms if self.linear_plan is not None else None
                self.spec = SpeculativeDecoding(config.speculative, proposer, gemm)
        self._requests: dict[str, _Request] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self._ids = itertools.count()
        self.num_steps = 0

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        """Tokenize a prompt; ``chat`` wraps it in the model's chat template first."""
        if self.tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer: pass prompt_token_ids")
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            return encode_chat(self.tokenizer, messages)
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def add_request(
        self,
        request_id: str | None = None,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: Seq[int] | None = None,
        arrival_time: float | None = None,
        hold_kv: bool = False,
        resumed_output_tokens: int = 0,
        stream_kv: bool = False,
    ) -> str:
        """Queue a request. ``hold_kv`` (prefill role) keeps its blocks after it finishes, for
        ``held_block_table`` / ``release_kv`` once they have been streamed to a decode node.
        ``stream_kv`` (prefill role): tell the ``kv_layer_listener`` layer by layer which of
        its blocks hold final KV (model_runner.KVLayerListener).

        ``resumed_output_tokens``: the last k of ``prompt_token_ids`` are output tokens the
        request already produced on a node that failed. The sequence then starts exactly as a
        preempted one (prompt + k outputs, no KV): max_tokens, min_tokens, penalties and the
        seeded generator of each step see the k outputs, so the continuation is the run that
        never failed. Only for n = 1 (forks happen at the first output token).
        """
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequestError("a request needs a prompt or prompt_token_ids")
            prompt_token_ids = self.encode(prompt)
        tokens = [int(t) for t in prompt_token_ids]
        k = self._check_resumed(tokens, params, resumed_output_tokens)
        self._validate(tokens[: len(tokens) - k], params)
        now = time.monotonic() if arrival_time is None else arrival_time
        req = _Request(request_id, tokens[: len(tokens) - k], params, RequestMetrics(arrival_time=now), resumed=k)
        self._requests[request_id] = req
        self.scheduler.add_sequence(
            Sequence(request_id=request_id, index=0, token_ids=list(tokens),
                     num_prompt_tokens=len(tokens) - k, params=params, arrival_time=now, hold_kv=hold_kv,
                     stream_kv=stream_kv)
        )
        return request_id

    @staticmethod
    def _check_resumed(tokens: list[int], params: SamplingParams, k: int) -> int:
        if k == 0:
            return 0
        if params.n != 1:
            raise InvalidRequestError(f"a resumed request continues one sequence: n must be 1, got {params.n}")
        if not 0 < k < len(tokens):
            raise InvalidRequestError(f"resumed_output_tokens is {k} but the prompt has {len(tokens)} tokens "
                                      "(at least one must be prompt)")
        if k >= params.max_tokens:
            raise InvalidRequestError(f"resumed_output_tokens is {k}: max_tokens ({params.max_tokens}) leaves "
                                      "nothing to generate")
        return k

    # ------------------------------------------------------------------ role modes
    def reserve_kv(self, request_id: str, prompt_token_ids: Seq[int]) -> tuple[list[int], int] | None:
        """Decode role: blocks for a prompt whose KV will arrive from a prefill node.

        Returns the block table covering the prompt and how many leading tokens this node
        already holds in its prefix cache (their blocks need not be sent), or None when the
        pool cannot take the prompt now.
        """
        seq_id = seq_id_of(request_id, 0)
        if request_id in self._requests or self.kv.has_seq(seq_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        tokens = [int(t) for t in prompt_token_ids]
        hit = self.kv.lookup_prefix(tokens) if self.config.cache.enable_prefix_caching else None
        cached = hit.num_tokens if hit else 0
        if not self.kv.allocate_slots(seq_id, cached, len(tokens), hit):
            return None
        return self.kv.get_block_table(seq_id), cached

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        output_token_ids: Seq[int],
        params: SamplingParams,
        num_cached_tokens: int = 0,
        arrival_time: float | None = None,
        resumed_output_tokens: int = 0,
    ) -> None:
        """Decode role: continue a request whose prompt KV now sits in its reserved blocks.

        ``output_token_ids`` are the tokens the prefill node already sampled (usually one);
        the first ``step`` reports them as new tokens, so the decode node is the only stream.
        ``resumed_output_tokens``: as in ``add_request`` (the KV covers them too).
        """
        seq_id = seq_id_of(request_id, 0)
        if not self.kv.has_seq(seq_id):
            raise InvalidRequestError(f"no KV reserved for request {request_id!r}")
        prompt = [int(t) for t in prompt_token_ids]
        outs = [int(t) for t in output_token_ids]
        k = self._check_resumed(prompt, params, resumed_output_tokens)
        self._validate(prompt[: len(prompt) - k], params)
        if not outs:
            raise InvalidRequestError("a prefilled request needs the prefill node's first token")
        self.kv.cache_computed_blocks(seq_id, prompt, len(prompt))
        now = time.monotonic() if arrival_time is None else arrival_time
        req = _Request(request_id, prompt[: len(prompt) - k], params, RequestMetrics(arrival_time=now), resumed=k)
        self._requests[request_id] = req
        seq = Sequence(request_id=request_id, index=0, token_ids=prompt + outs,
                       num_prompt_tokens=len(prompt) - k, params=params, arrival_time=now,
                       num_computed_tokens=len(prompt), num_cached_tokens=num_cached_tokens)
        seq.first_token_time = now
        self.scheduler.add_sequence(seq)
        # The prefill node's token may already end the request (EOS, a stop token, max_tokens=1).
        self.scheduler.check_stop(seq)
        delta = "".join(self._append_text(req, seq, t, final=seq.is_finished and i == len(outs) - 1)[0]
                        for i, t in enumerate(outs))
        done = self.scheduler.request_finished(request_id)
        self._pending.append(self._request_output(
            req, [self._completion(req, seq, outs, delta, None, None)], finished=done))
        if done:
            self._finish_request(req)

    def set_kv_layer_listener(self, listener: KVLayerListener | None) -> None:
        """Prefill role: who hears, per layer, which blocks of ``stream_kv`` requests are final
        (model_runner.KVLayerListener). None: nobody (no per-layer work)."""
        self.runner.kv_layer_listener = listener

    def held_block_table(self, request_id: str) -> list[int]:
        """Prefill role: the blocks of a finished ``hold_kv`` request (prompt KV)."""
        return self.kv.get_block_table(seq_id_of(request_id, 0))

    def release_kv(self, request_id: str) -> None:
        """Give back held (prefill role) or reserved (decode role) blocks; idempotent."""
        seq_id = seq_id_of(request_id, 0)
        if self.kv.has_seq(seq_id) and request_id not in self._requests:
            self.kv.free(seq_id)

    def _validate(self, tokens: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        try:
            params.validate(vocab)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        n = len(tokens)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens but the model's context is {self.max_model_len} tokens "
                f"(at least one token must remain for the output)"
            )
        if n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                f"exceeds the model's context of {self.max_model_len} tokens"
            )
        need = math.ceil((n + params.max_tokens) / self.block_size) * params.n
        if need > self.num_blocks:
            raise InvalidRequestError(
                f"request needs {need} KV blocks (prompt {n} + max_tokens {params.max_tokens}, "
                f"n={params.n}) but the KV cache has only {self.num_blocks} blocks"
            )

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; returns False for an unknown id."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        seqs = self.scheduler.abort(request_id)
        outs = []
        for seq in seqs:
            outs.append(self._completion(req, seq, [], "", None, None))
        self._pending.append(self._request_output(req, outs, finished=True))
        self._finish_request(req)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ------------------------------------------------------------------ stepping
    @property
    def proposer(self) -> Proposer | None:
        return self.spec.proposer if self.spec is not None else None

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        spec = self.spec
        sched = self.scheduler.schedule(spec.plan_lookahead(self.scheduler) if spec is not None else None)
        if sched.preempted and self.runner.kv_layer_listener is not None:
            for seq in sched.preempted:  # their blocks are gone: what the listener heard is void
                if seq.stream_kv:
                    self.runner.kv_layer_listener(seq.request_id, KV_PREEMPTED, 0, ())
        if sched.is_empty:
            return outputs
        self.num_steps += 1
        if spec is not None:
            spec.propose(sched, self.kv.get_block_table, self.scheduler.num_running)
        before = {item.seq.seq_id: item.seq.num_tokens for item in sched.scheduled}
        t0 = time.perf_counter()
        sampled = self.runner.execute(sched, self.kv.get_block_table)
        forward_ms = (time.perf_counter() - t0) * 1e3
        touched = self.scheduler.update_from_output(sched, sampled)
        if spec is not None:
            spec.observe_step(sched, sampled, forward_ms,
                              whole_batch=self._whole_batch and self.scheduler.num_waiting == 0)

        by_request: dict[str, list[CompletionOutput]] = {}
        for seq in touched:
            req = self._requests[seq.request_id]
            # A forked child is new this step: its one token is the last.
            new = seq.token_ids[before.get(seq.seq_id, seq.num_tokens - 1):]
            delta, new = self._append_run(req, seq, new)
            logprobs, tops = _pick_logprobs(seq, sampled, len(new))
            by_request.setdefault(seq.request_id, []).append(
                self._completion(req, seq, new, delta, logprobs, tops)
            )
        for rid, comps in by_request.items():
            req = self._requests[rid]
            done = self.scheduler.request_finished(rid)
            outputs.append(self._request_output(req, comps, finished=done))
            if done:
                self._finish_request(req)
        return outputs

    def _forget_speculation(self, request_id: str) -> None:
        if self.spec is not None:
            for seq in self.scheduler.sequences(request_id):
                self.spec.forget(seq.seq_id)

    # ------------------------------------------------------------------ text
    def _append_run(self, req: _Request, seq: Sequence, new: list[int]) -> tuple[str, list[int]]:
        """Detokenize a step's new tokens (several after a verification); a stop string met
        before the last of them cuts the rest off (they were never output)."""
        delta = ""
        for i, tok in enumerate(new):
            last = i == len(new) - 1
            d, hit = self._append_text(req, seq, tok, final=seq.is_finished and last)
            delta += d
            if hit and not last:
                del seq.token_ids[len(seq.token_ids) - (len(new) - 1 - i):]
                seq.finish_reason = FinishReason.STOP  # may have been finished by a later token
                return delta, new[: i + 1]
        return delta, new

    def _append_text(self, req: _Request, seq: Sequence, token: int, final: bool) -> tuple[str, bool]:
        """-> (text delta, a stop string matched). ``final``: the sequence ends with this token."""
        st = req.texts.get(seq.index)
        if st is None:
            detok = (IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
                     if self.tokenizer is not None else None)
            stops = (StopStringMatcher(tuple(req.params.stop), req.params.include_stop_str_in_output)
                     if req.params.stop and detok is not None else None)
            st = req.texts[seq.index] = _SeqText(detok, stops)
            if detok is not None and req.resumed:
                # A resumed request's earlier outputs, replayed one by one as the node that
                # streamed them did: their text was sent, and what that node held back (part
                # of a character, the start of a stop string) is held here too, so the text
                # goes on exactly where the client's stopped.
                start = seq.num_prompt_tokens
                for earlier in seq.token_ids[start : start + req.resumed]:
                    sent = detok.step([earlier])
                    if stops is not None:
                        stops.feed(sent)
        if st.detok is None:
            return "", False
        delta = st.detok.step([token])
        if final:  # text held back for a split character is final now
            delta += st.detok.flush()
        hit = False
        if st.stops is not None:
            delta, hit = st.stops.feed(delta)
            if hit and not seq.is_finished:
                self.scheduler.finish_and_release(seq, FinishReason.STOP)
            elif final and not hit:
                delta += st.stops.flush()  # a held-back partial stop string was just text
        st.text += delta
        return delta, hit

    def _completion(self, req, seq, new_ids, delta, logprobs, tops) -> CompletionOutput:
        """``logprobs`` / ``tops``: one entry per new token, or None."""
        st = req.texts.get(seq.index)
        if logprobs is not None:
            if st is None:
                st = req.texts[seq.index] = _SeqText(None, None)
            st.logprobs = (st.logprobs or []) + list(logprobs)
        return CompletionOutput(
            index=seq.index,
            token_ids=seq.output_token_ids,
            new_token_ids=new_ids,
            text=st.text if st else "",
            text_delta=delta,
            logprobs=st.logprobs if st else None,
            new_logprobs=list(logprobs) if logprobs is not None else None,
            new_top_logprobs=list(tops) if tops is not None else None,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            spec=self.spec.seq_stats(seq.seq_id) if self.spec is not None else None,
        )

    def _finish_request(self, req: _Request) -> None:
        req.metrics.finished_time = time.monotonic()
        self._forget_speculation(req.request_id)
        self.scheduler.forget(req.request_id)
        self._requests.pop(req.request_id, None)

    def _request_output(self, req: _Request, comps, finished: bool) -> RequestOutput:
        seqs = self.scheduler.sequences(req.request_id)
        first = seqs[0] if seqs else None
        if first is not None:
            req.metrics.first_scheduled_time = first.first_scheduled_time
            req.metrics.first_token_time = first.first_token_time
            # max: a sample that finished early has left ``seqs``, its preemptions not the count
            req.metrics.num_preemptions = max(req.metrics.num_preemptions, sum(s.num_preemptions for s in seqs))
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            outputs=comps,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens if first else 0,
            metrics=req.metrics,
        )

    # ------------------------------------------------------------------ helpers
    def generate(
        self,
        prompts: Iterable[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        hold_kv: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion as one continuous batch; results in input order.

        Each result's outputs hold every sample's full token ids and text.
        """
        prompts = list(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = []
        for p, sp in zip(prompts, plist):
            if isinstance(p, str):
                ids.append(self.add_request(prompt=p, params=sp, hold_kv=hold_kv))
            else:
                ids.append(self.add_request(prompt_token_ids=p, params=sp, hold_kv=hold_kv))
        final: dict[str, RequestOutput] = {}
        latest: dict[str, dict[int, CompletionOutput]] = {rid: {} for rid in ids}
        # The caller waits for the whole batch: speculation is judged by the batch's end.
        outer, self._whole_batch = self._whole_batch, True
        try:
            while len(final) < len(ids):
                for out in self.step():
                    if out.request_id not in latest:
                        continue
                    for c in out.outputs:
                        latest[out.request_id][c.index] = c
                    if out.finished:
                        out.outputs = [latest[out.request_id][i] for i in sorted(latest[out.request_id])]
                        final[out.request_id] = out
        finally:
            self._whole_batch = outer
        return [final[r] for r in ids]

    def stream(self, prompt_token_ids: Seq[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield this request's outputs step by step (other queued requests keep running)."""
        rid = self.add_request(prompt_token_ids=prompt_token_ids, params=params)
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return

    def take_kv_events(self) -> list:
        return self.kv.take_events()

    def stats(self) -> dict:
        pool = self.kv.pool
        return {
            "num_blocks": self.num_blocks,
            "free_blocks": self.kv.num_free_blocks,
            "kv_usage": self.kv.usage,
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_query_tokens": pool.prefix_query_tokens,
            "prefix_cache_hit_tokens": pool.prefix_hit_tokens,
            "speculative": self.spec.snapshot() if self.spec is not None else None,
        }


def _pick_logprobs(
    seq: Sequence, sampled: dict[str, SampledTokens], num_new: int
) -> tuple[list[float] | None, list | None]:
    """The logprobs of this sequence's ``num_new`` new tokens (several after a verification).

    On the step that forks an n > 1 request, the parent's entry holds all n samples and a new
    child's sample is at its own index there.
    """
    own = seq.seq_id in sampled
    st = sampled[seq.seq_id] if own else sampled[seq_id_of(seq.request_id, 0)]
    k = 0 if own else seq.index
    lps = st.logprobs[k : k + num_new] if st.logprobs else None
    tops = st.top_logprobs[k : k + num_new] if st.top_logprobs else None
    return lps, tops


def load_hf_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return AutoTokenizer.from_pretrained(str(Path(path)), local_files_only=True)


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template; send a plain prompt")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]

"""LLMEngine: add_request / step / abort over the scheduler, model runner and detokenizer.

One engine serves one model in one process. Each ``step`` runs one scheduler iteration and
returns a ``RequestOutput`` for every request that produced something (new tokens, text, a
finish), so callers stream by looping on ``step``. ``generate`` is the blocking helper. What
only the node roles call (held and reserved KV, prefilled requests) is ``RoleModes``
(engine/engine_roles.py); the KV tiers and prefix export / import are ``TieredKV``
(engine/engine_tiers.py).

With ``EngineConfig.speculative`` on, each step also runs the speculation loop
(``engine/speculative/loop.py``): lookahead slots planned by the adaptive controller, drafts from
the injected ``Proposer``, all k + 1 positions verified in the step's one forward pass, and
only the accepted run kept by the scheduler (docs/speculative.md).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Callable, Iterable, Iterator
from typing import Sequence as Seq

import torch

from engine.attention import cpu_decode, get_attention_backend
from engine.attention.kv_cache import allocate_kv_cache, bytes_per_block
from engine.config import EngineConfig
from engine.device import resolve_device, torch_dtype
from engine.engine_roles import RoleModes
from engine.engine_tiers import TieredKV
from engine.errors import InvalidRequestError
from engine.kv_cache_manager import KVCacheManager
from engine.limits import RequestLimits
from engine.model_runner import KV_PREEMPTED, ModelRunner
from engine.models.builtin import cache_dir
from engine.models.config import ModelConfig
from engine.models.cpu_linear import load_or_tune
from engine.models.loader import LoadedModel, load_model
from engine.outputs import CompletionOutput, RequestOutput, RequestState, RequestTimes, pick_logprobs
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from engine.sequence import Sequence, seq_id_of
from engine.speculative.loop import SpeculativeDecoding
from engine.speculative.proposer import Proposer
from engine.structured.decoding import StructuredDecoding
from engine.tokenizer import encode_chat, load_hf_tokenizer
from tokens.sampling_params import SamplingParams
from tokens.stop import FinishReason


class LLMEngine(TieredKV, RoleModes):
    def __init__(
        self,
        config: EngineConfig = EngineConfig(),
        progress: Callable[[str], None] | None = None,
        loaded: LoadedModel | None = None,
        tokenizer=None,
        load_tokenizer: bool = True,
        proposer_factory: Callable[["LLMEngine"], Proposer | None] | None = None,
        runner_class: Callable[..., ModelRunner] = ModelRunner,
    ) -> None:
        """``proposer_factory`` builds the speculative-decoding proposer from this engine (its
        model, KV cache, device); required when ``config.speculative`` is on. Decode nodes
        pass ``engine.speculative.proposers.build_proposer``. It may return None when it measured that its
        drafter cannot pay here; the engine then runs without speculation (``self.spec`` None).
        ``runner_class``: builds the runner (tensor parallel: engine/parallel/executor.py)."""
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
        self.limits = RequestLimits(mc.vocab_size, self.max_model_len, cc.block_size, num_blocks)
        if progress:
            progress(f"allocating KV cache: {num_blocks} blocks x {cc.block_size} tokens "
                     f"({num_blocks * per_block / 2**20:.0f} MiB)")
        self.kv_cache = allocate_kv_cache(mc, num_blocks, cc.block_size, self.dtype, self.device)
        tier_copies = self._build_tiers(cc, num_blocks, progress)  # host and disk tiers, if configured
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching,
                                 extra_key=self.fingerprint.encode(), tiers=self.tiers)
        self._start_tiers()
        eos = tuple(mc.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos = eos + (tokenizer.eos_token_id,)
        self.eos_token_ids = eos
        # Constrained decoding: a grammar matcher per constrained sequence (engine/structured/).
        self.structured = StructuredDecoding.for_engine(tokenizer, mc.vocab_size, eos)
        self.scheduler = Scheduler(config.scheduler, cc, self.kv, self.max_model_len, eos)
        decode_kernel = None
        if self.device.type == "cpu" and config.cpu_kernels == "auto" and self.dtype == torch.bfloat16:
            decode_kernel = cpu_decode.load(cache_dir() / "kernels")
        backend = get_attention_backend(self.device, mc.num_heads, mc.num_kv_heads, mc.head_dim, self.dtype,
                                        decode_kernel=decode_kernel)
        self.runner = runner_class(loaded.model, self.kv_cache, backend, cc.block_size, self.device,
                                  Sampler(eos_token_ids=eos, seed=config.seed))
        self.runner.tier_copies = tier_copies
        self._whole_batch = False  # inside generate(): the caller waits for every request
        self.spec: SpeculativeDecoding | None = None  # set before the factory, which gets this engine
        if config.speculative.enabled:
            self.spec = self._start_speculation(proposer_factory)
        self._requests: dict[str, RequestState] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self._ids = itertools.count()
        self.num_steps = 0
        # Prompt tokens (chunks of prefills, recomputes) the last step ran beside its decodes:
        # a node's decode-only step time leaves out the steps that had any (node/engine_thread.py).
        self.last_step_prefill_tokens = 0

    def _start_speculation(self, proposer_factory) -> SpeculativeDecoding | None:
        cfg = self.config.speculative
        if proposer_factory is None:
            raise ValueError(
                f"speculative method {cfg.method!r} is configured but no proposer "
                "factory was passed (decode nodes pass engine.speculative.proposers.build_proposer)")
        # None: the factory measured that its drafter cannot pay on this machine (a bf16
        # draft on a CPU without bf16 matmuls); the engine serves without speculation.
        proposer = proposer_factory(self)
        if proposer is None:
            return None
        if proposer.target_states is not None:
            self.runner.send_target_states(proposer.target_states, proposer.observe_target)
        gemm = self.linear_plan.gemm_ms if self.linear_plan is not None else None
        return SpeculativeDecoding(cfg, proposer, gemm)

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
        cache_salt: bytes = b"",
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

        ``cache_salt``: the request's prompt blocks are hashed under it (tokens/block_hash.py),
        so they are reused only by requests of the same salt.
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
        k = self.limits.check(tokens, params, resumed_output_tokens)
        self.structured.add(seq_id_of(request_id, 0), params.structured, tokens[len(tokens) - k:])
        now = time.monotonic() if arrival_time is None else arrival_time
        req = RequestState(request_id, tokens[: len(tokens) - k], params, RequestTimes(arrival_time=now), resumed=k)
        self._requests[request_id] = req
        self.scheduler.add_sequence(
            Sequence(request_id=request_id, index=0, token_ids=list(tokens),
                     num_prompt_tokens=len(tokens) - k, params=params, arrival_time=now, hold_kv=hold_kv,
                     stream_kv=stream_kv, cache_salt=bytes(cache_salt))
        )
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; returns False for an unknown id."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        seqs = self.scheduler.abort(request_id)
        outs = []
        for seq in seqs:
            outs.append(self._completion(req, seq, [], ""))
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
        self.service_tiers()
        sched = self.scheduler.schedule(spec.plan_lookahead(self.scheduler) if spec is not None else None)
        if sched.preempted and self.runner.kv_layer_listener is not None:
            for seq in sched.preempted:  # their blocks are gone: what the listener heard is void
                if seq.stream_kv:
                    self.runner.kv_layer_listener(seq.request_id, KV_PREEMPTED, 0, ())
        if sched.is_empty:
            return outputs
        self.num_steps += 1
        self.last_step_prefill_tokens = sum(i.num_new_tokens for i in sched.scheduled if i.num_new_tokens > 1)
        try:
            self._swap_in(sched.swap_ins)  # before a drafter or the forward pass reads them
            if spec is not None:
                spec.propose(sched, self.kv.get_block_table, self.scheduler.num_running)
            masks = self.structured.prepare(sched.scheduled) if self.structured.active else None
            before = {item.seq.seq_id: item.seq.num_tokens for item in sched.scheduled}
            t0 = time.perf_counter()
            sampled = self.runner.execute(sched, self.kv.get_block_table, masks)
            forward_ms = (time.perf_counter() - t0) * 1e3
        finally:
            self.kv.finish_swap_ins()  # the step synchronized: the host slots were read
        if masks is not None:
            self.structured.fork(sched.scheduled)  # before the samples' first tokens are appended
        touched = self.scheduler.update_from_output(sched, sampled)
        self.service_tiers()  # blocks cached by this step start their copy to the host tier
        if spec is not None:
            spec.observe_step(sched, sampled, forward_ms,
                              whole_batch=self._whole_batch and self.scheduler.num_waiting == 0)

        by_request: dict[str, list[CompletionOutput]] = {}
        for seq in touched:
            req = self._requests[seq.request_id]
            # A forked child is new this step: its one token is the last.
            new = seq.token_ids[before.get(seq.seq_id, seq.num_tokens - 1):]
            new = self.structured.follow(seq, new, self.scheduler)
            delta, new = self._append_run(req, seq, new)
            logprobs, tops = pick_logprobs(seq, sampled, len(new))
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
    def _append_run(self, req: RequestState, seq: Sequence, new: list[int]) -> tuple[str, list[int]]:
        """Detokenize a step's new tokens (several after a verification); a stop string met
        before the last of them cuts the rest off (they were never output)."""
        delta, kept = self._feed_text(req, seq, new)
        if kept is not None and kept < len(new):
            del seq.token_ids[len(seq.token_ids) - (len(new) - kept):]
            seq.finish_reason = FinishReason.STOP  # may have been finished by a later token
            new = new[:kept]
        return delta, new

    def _feed_text(self, req: RequestState, seq: Sequence, new: list[int]) -> tuple[str, int | None]:
        """-> ``SequenceText.append``'s (delta, kept); a stop string finishes the sequence."""
        if self.tokenizer is None:
            return "", None
        delta, kept = req.text(seq, self.tokenizer).append(new, final=seq.is_finished)
        if kept is not None and not seq.is_finished:
            self.scheduler.finish_and_release(seq, FinishReason.STOP)
        return delta, kept

    def _completion(self, req: RequestState, seq: Sequence, new_ids: list[int], delta: str,
                    logprobs: list[float] | None = None, tops: list | None = None) -> CompletionOutput:
        return req.completion(seq, new_ids, delta, logprobs, tops,
                              self.spec.seq_stats(seq.seq_id) if self.spec is not None else None)

    def _finish_request(self, req: RequestState) -> None:
        req.times.finished_time = time.monotonic()
        self._forget_speculation(req.request_id)
        self.structured.forget(*(seq.seq_id for seq in self.scheduler.sequences(req.request_id)))
        self.scheduler.forget(req.request_id)
        self._requests.pop(req.request_id, None)

    def _request_output(self, req: RequestState, comps: list[CompletionOutput], finished: bool) -> RequestOutput:
        return req.output(self.scheduler.sequences(req.request_id), comps, finished)

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

    @property
    def step_tokens(self) -> int:
        """The per-step token budget in force (decode tokens + prefill chunk tokens)."""
        return self.scheduler.config.max_num_batched_tokens

    def set_step_tokens(self, tokens: int) -> None:
        """Change the per-step token budget from the next step on (a node's role sets it:
        node/config.py ``NodeConfig.step_tokens``). Only the scheduler reads it, once a step."""
        if tokens < 1:
            raise ValueError(f"the step budget must be >= 1 token, got {tokens}")
        self.scheduler.config = replace(self.scheduler.config, max_num_batched_tokens=tokens)

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
            "cached_blocks": len(pool.cached),
            "device_hit_blocks": self.kv.device_hit_blocks,
            "tiers": self.tiers.snapshot() if self.tiers is not None else None,
            "speculative": self.spec.snapshot() if self.spec is not None else None,
        }

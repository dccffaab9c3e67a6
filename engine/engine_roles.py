"""The engine's role modes: the part of ``LLMEngine`` that only the two node roles call.

The prefill role runs requests with ``hold_kv`` and streams their KV out (a per-layer listener,
the held block table, then ``release_kv``); the decode role reserves blocks for a prompt whose
KV will arrive, then continues the request from the prefill node's first token.

``RoleModes`` is a base of ``LLMEngine`` (engine/engine.py); it uses the engine's ``kv``
(KVCacheManager), ``scheduler``, ``runner``, ``limits``, ``structured``, ``config``,
``_requests`` and ``_pending``, its text and output helpers (``_feed_text``, ``_completion``,
``_request_output``, ``_finish_request``) and ``TieredKV._swap_in_now``. Every method runs on
the engine's thread (node/engine_thread.py submits them as commands between steps).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING
from typing import Sequence as Seq

from engine.errors import InvalidRequestError
from engine.outputs import RequestState, RequestTimes
from engine.sequence import Sequence, seq_id_of
from tokens.sampling_params import SamplingParams
from tokens.stop import FinishReason

if TYPE_CHECKING:  # an annotation only: the role modes need no torch
    from engine.model_runner import KVLayerListener


class RoleModes:
    def reserve_kv(self, request_id: str, prompt_token_ids: Seq[int],
                   cache_salt: bytes = b"") -> tuple[list[int], int] | None:
        """Decode role: blocks for a prompt whose KV will arrive from a prefill node (its
        prefix-cache hit looked up under ``cache_salt``).

        Returns the block table covering the prompt and how many leading tokens this node
        already holds in its prefix cache (their blocks need not be sent), or None when the
        pool cannot take the prompt now.
        """
        seq_id = seq_id_of(request_id, 0)
        if request_id in self._requests or self.kv.has_seq(seq_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        tokens = [int(t) for t in prompt_token_ids]
        hit = self.kv.lookup_prefix(tokens, cache_salt) if self.config.cache.enable_prefix_caching else None
        cached = hit.num_tokens if hit else 0
        if not self.kv.allocate_slots(seq_id, cached, len(tokens), hit):
            return None
        self._swap_in_now()  # blocks from the host or disk tier: in place before the KV arrives
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
        cache_salt: bytes = b"",
    ) -> None:
        """Decode role: continue a request whose prompt KV now sits in its reserved blocks
        (registered as cached under ``cache_salt``, the one ``reserve_kv`` was given).

        ``output_token_ids`` are the tokens the prefill node already sampled (usually one);
        the first ``step`` reports them as new tokens, so the decode node is the only stream.
        ``resumed_output_tokens``: as in ``add_request`` (the KV covers them too).
        """
        seq_id = seq_id_of(request_id, 0)
        if not self.kv.has_seq(seq_id):
            raise InvalidRequestError(f"no KV reserved for request {request_id!r}")
        prompt = [int(t) for t in prompt_token_ids]
        outs = [int(t) for t in output_token_ids]
        k = self.limits.check(prompt, params, resumed_output_tokens)
        if not outs:
            raise InvalidRequestError("a prefilled request needs the prefill node's first token")
        # The grammar catches up with the resumed outputs and the prefill node's token(s).
        self.structured.add(seq_id, params.structured, prompt[len(prompt) - k:] + outs)
        self.kv.cache_computed_blocks(seq_id, prompt, len(prompt), cache_salt)
        now = time.monotonic() if arrival_time is None else arrival_time
        req = RequestState(request_id, prompt[: len(prompt) - k], params, RequestTimes(arrival_time=now), resumed=k)
        self._requests[request_id] = req
        seq = Sequence(request_id=request_id, index=0, token_ids=prompt + outs,
                       num_prompt_tokens=len(prompt) - k, params=params, arrival_time=now,
                       num_computed_tokens=len(prompt), num_cached_tokens=num_cached_tokens,
                       cache_salt=bytes(cache_salt))
        seq.first_token_time = now
        self.scheduler.add_sequence(seq)
        # The prefill node's token may already end the request (EOS, a stop token, max_tokens=1).
        self.scheduler.check_stop(seq)
        if self.structured.ended(seq.seq_id) and not seq.is_finished:  # add() advanced it over outs
            self.scheduler.finish_and_release(seq, FinishReason.STOP)
        delta, _ = self._feed_text(req, seq, outs)
        done = self.scheduler.request_finished(request_id)
        self._pending.append(self._request_output(
            req, [self._completion(req, seq, outs, delta)], finished=done))
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

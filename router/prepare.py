"""A request made ready for the nodes: validated (router/validation.py), its prompt's blocks
hashed, one index lookup, placed by the policy, admitted against its SLO class; and a
migration's continuation placed again. The result is a ``Prepared`` (router/request_state.py).

Everything here blocks (tokenizing, the Redis lookup), so the orchestrator runs it on a worker
thread and keeps its event loop for the streams. The node view is read, never waited for
(router/node_view.py refreshes it in the background). The lookup is the one Redis round trip
on the request path: bounded by a short timeout and skipped while Redis is failing
(router/index_guard.py), so a hung Redis costs a request at most that timeout.

Tenants: a request's blocks are hashed under its cache salt (``cache_salt``; tokens/block_hash.py
seeds the chain's root with it), derived from the API key it came with (``cache_salt_scope``
"key", when keys are on) and its own ``GenerateRequest.cache_salt``. Blocks of two salts never
match, in the index, the transfers or any node's cache, so one key cannot reuse another's
cached prompts nor see them in ``cached_prompt_tokens`` or in its time to first token. The
nodes get only the derived 16 bytes, never the key or the client's text.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import replace

import grpc

from protos.convert import sampling_to_proto
from protos.pdserve.v1 import serving_pb2 as pb
from router.admission import SLO_CLASSES, decide
from router.config import RouterConfig
from router.index_guard import GuardedLookup
from router.migration import Continuation, Exclusions
from router.node_view import NodeRefresher, NodeView, PrefillLedger
from router.placement import NoCapacityError, Placement, PlacementPolicy, PlacementRequest
from router.request_state import Prepared, fresh_node_id
from router.tokenizer import PromptTokenizer
from router.validation import RequestValidator, RouterError, invalid
from security.api_keys import ApiKeys
from telemetry import tracing
from tokens.block_hash import hash_prompt_blocks

# Characters of a request's cache_salt: it only has to be unguessable (vLLM takes any string;
# 256 leaves room for any encoding of a 128-bit secret and bounds the bytes hashed per request).
MAX_CACHE_SALT_CHARS = 256
_SALT_PERSON = b"pdserve-salt-v1"  # blake2b's personalization: these digests are salts only


def derive_cache_salt(tenant: bytes, request_salt: str) -> bytes:
    """The salt the nodes hash a request's blocks under: b"" when there is neither a tenant
    nor a salt of the request's own (the unsalted hashes of every request before salts), else
    16 bytes of blake2b over both, length-prefixed (so no two (tenant, salt) pairs collide)."""
    if not tenant and not request_salt:
        return b""
    h = hashlib.blake2b(digest_size=16, person=_SALT_PERSON)
    for part in (tenant, request_salt.encode()):
        h.update(struct.pack("<I", len(part)) + part)
    return h.digest()


class Preparer:
    """``prepare`` a new request, ``place_continuation`` a migrated one. Holds no request state:
    safe on several worker threads at once."""

    def __init__(self, config: RouterConfig, tokenizer: PromptTokenizer, refresher: NodeRefresher,
                 reader: GuardedLookup, policy: PlacementPolicy, ledger: PrefillLedger) -> None:
        self.config = config
        self.validator = RequestValidator(config, tokenizer)
        self.refresher = refresher
        self.reader = reader
        self.policy = policy
        self.ledger = ledger  # the prefill nodes' queues as this router sees them
        # Tenants are told apart by key only where keys are checked (the front doors refuse a
        # request without an accepted one): without keys anyone could claim any key's salt.
        self.tenant_keys = ApiKeys(config.api_keys) if config.api_keys and config.cache_salt_scope == "key" else None

    def cache_salt(self, req: pb.GenerateRequest, authorization: str | None) -> bytes:
        """``req``'s salt (see the module docstring); raises RouterError (INVALID_ARGUMENT)
        for a cache_salt over its limit."""
        if len(req.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise invalid(f"cache_salt may have at most {MAX_CACHE_SALT_CHARS} characters, got {len(req.cache_salt)}",
                          "cache_salt")
        tenant = self.tenant_keys.identity(authorization) if self.tenant_keys is not None else None
        return derive_cache_salt(tenant or b"", req.cache_salt)

    def prepare(self, req: pb.GenerateRequest, client_id: str, max_tokens_to_context: bool = False,
                excluded: frozenset = frozenset(), authorization: str | None = None) -> Prepared:
        """Validate, place, admit; raises RouterError. ``excluded``: (node id, address) of nodes
        that failed lately (Exclusions.active); ``authorization``: the request's Authorization
        value (its API key: the tenant its cache salt is derived from)."""
        cfg = self.config
        salt = self.cache_salt(req, authorization)
        valid = self.validator.validate(req, max_tokens_to_context)
        prompt, params, slo_class = valid.prompt, valid.params, valid.slo_class
        view = self.refresher.view
        if not view.has_decode:
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              view.error or f"no live decode node for model {cfg.model_name!r}; retry later")
        try:
            try:
                hashes, placement = self._place(view, prompt, params.n, params.max_tokens, slo_class, excluded, salt)
            except NoCapacityError:
                if not excluded:
                    raise
                # Avoiding failed nodes is a preference for a new request: better a node that
                # failed a moment ago (it may be back) than no answer.
                hashes, placement = self._place(view, prompt, params.n, params.max_tokens, slo_class, frozenset(), salt)
        except NoCapacityError as e:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        if placement.estimate is not None:
            verdict = decide(placement.estimate, SLO_CLASSES[slo_class], len(prompt))
            if not verdict.admit:
                raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, verdict.reason, verdict.retry_after_ms, "slo")
        return Prepared(client_id, fresh_node_id(client_id), prompt, params, sampling_to_proto(params), hashes,
                        view.fingerprint, view.block_size, placement, slo_class, cache_salt=salt)

    def place_continuation(self, prep: Prepared, cont: Continuation, excluded: frozenset) -> Prepared:
        """The next attempt of ``prep``, continuing as ``cont`` says, placed away from
        ``excluded``; raises NoCapacityError. No admission check: the request was admitted and
        has a client waiting."""
        view = self.refresher.view
        hashes, placement = self._place(view, cont.prompt, prep.params.n, cont.remaining_tokens, prep.slo_class,
                                        excluded, prep.cache_salt)
        return replace(prep, node_id=fresh_node_id(prep.client_id), prompt=cont.prompt, block_hashes=hashes,
                       fingerprint=view.fingerprint, block_size=view.block_size, placement=placement,
                       resumed=cont.resumed_output_tokens)

    def _place(self, view: NodeView, prompt: list[int], n: int, max_tokens: int, slo_class: str,
               excluded: frozenset, salt: bytes = b"") -> tuple[list[int], Placement]:
        """Block hashes (under ``salt``), one index lookup, the policy's choice among the nodes
        not excluded. Raises NoCapacityError."""
        nodes = Exclusions.usable(view.nodes, excluded)
        hashes = hash_prompt_blocks(prompt, view.block_size, view.fingerprint.encode(), salt=salt)
        # The index is a hint: {} (no prefix information) when it fails or is being skipped.
        matched = self.reader.match(hashes, [x.node_id for x in nodes]) if self.policy.uses_index else {}
        tracing.event("index_matched",
                      {"pdserve.index.longest_match_blocks": max((m.blocks for m in matched.values()), default=0)})
        placement = self.policy.choose(PlacementRequest(len(prompt), view.block_size, n, max_tokens, slo_class),
                                       nodes, matched, self.ledger.backlog_s())
        tracing.event("placed")
        return hashes, placement

"""Speculative decoding inside the engine: the proposer seam (``proposer``), the loop around a
step (``loop``), adaptive k (``control``) and the accept / recover / bonus math
(``rejection_sampler``). Proposers themselves live with the decode role (``engine/speculative/proposers/``)
and are injected; nothing here imports them."""

"""The link between a vLLM node and its vLLM child (protos/pdserve/v1/vllm_worker.proto): framing
and the mapping of pdserve's sampling parameters onto vLLM's. Plain functions: both processes
import this module (the child under vLLM's own Python, with only protobuf of the project's
dependencies), so it needs the standard library, ``tokens`` and ``protos`` only.

Framing: a 4-byte big-endian length, then the message. A frame above ``MAX_FRAME`` is refused
before it is read (a corrupt length must not make the reader allocate gigabytes).

Refusals: what this bridge cannot pass to vLLM is refused by name (``UnsupportedByVllm``, a
``ValueError`` naming the parameter) before the request reaches the child, so a client gets a
400 that says which parameter, never a silently different sampling.
"""
from __future__ import annotations

import socket
import struct

from protos.pdserve.v1 import vllm_worker_pb2 as wpb
from tokens.sampling_params import SamplingParams

HEADER = struct.Struct(">I")
MAX_FRAME = 64 << 20  # a prompt of millions of tokens still fits; a garbled length does not


class FrameError(ConnectionError):
    """The peer closed the socket, or sent a frame that cannot be one."""


class UnsupportedByVllm(ValueError):
    """A sampling parameter the vLLM bridge cannot honour; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def encode(msg) -> bytes:
    body = msg.SerializeToString()
    if len(body) > MAX_FRAME:
        raise FrameError(f"message of {len(body)} bytes is above the {MAX_FRAME}-byte frame limit")
    return HEADER.pack(len(body)) + body


def send(sock: socket.socket, msg) -> None:
    sock.sendall(encode(msg))


class FrameReader:
    """Reads whole frames off a stream socket; ``feed`` takes bytes already read (tests, a
    non-blocking reader), ``read`` blocks for the next frame."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Append ``data``; returns the complete frames it finished, in order."""
        self._buf += data
        frames = []
        while len(self._buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self._buf)
            if n > MAX_FRAME:
                raise FrameError(f"frame of {n} bytes announced, above the {MAX_FRAME}-byte limit")
            if len(self._buf) < HEADER.size + n:
                break
            frames.append(bytes(self._buf[HEADER.size:HEADER.size + n]))
            del self._buf[:HEADER.size + n]
        return frames

    def read_available(self, sock: socket.socket) -> list[bytes]:
        """One ``recv`` (blocking as the socket is set): the frames it completed. Raises
        FrameError when the peer has closed."""
        data = sock.recv(1 << 20)
        if not data:
            raise FrameError("the peer closed the socket")
        return self.feed(data)


def parse_event(frame: bytes) -> wpb.WorkerEvent:
    ev = wpb.WorkerEvent()
    ev.ParseFromString(frame)
    return ev


def parse_command(frame: bytes) -> wpb.WorkerCommand:
    cmd = wpb.WorkerCommand()
    cmd.ParseFromString(frame)
    return cmd


def to_worker_sampling(p: SamplingParams) -> wpb.WorkerSampling:
    """pdserve's parameters -> the wire's; raises UnsupportedByVllm for what the bridge cannot
    carry. ``n`` > 1 (the router's samples share one prompt's KV, which vLLM forks itself but
    this bridge streams as one sequence), logprobs and structured outputs are not bridged yet."""
    if p.n != 1:
        raise UnsupportedByVllm("n", f"a vLLM node serves one sample per request: n must be 1, got {p.n}")
    if p.logprobs is not None:
        raise UnsupportedByVllm("logprobs", "a vLLM node does not return logprobs yet")
    if p.structured is not None:
        raise UnsupportedByVllm("structured", f"a vLLM node does not take structured outputs yet "
                                              f"({p.structured.kind})")
    return wpb.WorkerSampling(
        max_tokens=p.max_tokens, min_tokens=p.min_tokens, temperature=p.temperature, top_k=p.top_k,
        top_p=p.top_p, min_p=p.min_p, repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        has_seed=p.seed is not None, seed=p.seed or 0, stop_token_ids=list(p.stop_token_ids),
        stop=list(p.stop), include_stop_str_in_output=p.include_stop_str_in_output, ignore_eos=p.ignore_eos)


def vllm_sampling_kwargs(s: wpb.WorkerSampling) -> dict:
    """The wire's parameters -> ``vllm.SamplingParams(**kwargs)`` (the child's side). Greedy is
    temperature 0 in both; vLLM's "top_k off" is 0 or -1, pdserve's 0."""
    return {
        "n": 1, "max_tokens": s.max_tokens, "min_tokens": s.min_tokens, "temperature": s.temperature,
        "top_k": s.top_k if s.top_k > 0 else 0, "top_p": s.top_p, "min_p": s.min_p,
        "repetition_penalty": s.repetition_penalty, "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty, "seed": s.seed if s.has_seed else None,
        "stop_token_ids": list(s.stop_token_ids), "stop": list(s.stop),
        "include_stop_str_in_output": s.include_stop_str_in_output, "ignore_eos": s.ignore_eos,
    }

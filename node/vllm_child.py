"""The vLLM engine of a vLLM node, in a child process under vLLM's own Python:
``python -m node.vllm_child --fd N --model DIR ...`` (node/vllm_engine.py starts it).

It imports vLLM, the standard library and node/vllm_wire.py only (vLLM's environment has
protobuf but none of the project's other pins). One socket, inherited as fd N, carries
WorkerCommands in and WorkerEvents out (protos/pdserve/v1/vllm_worker.proto). vLLM's engine
runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the node): one process is the
whole engine, so a SIGKILL of it is the engine gone, with no orphaned engine core left holding
the cores.

The loop: block on the socket while vLLM has nothing to do; otherwise take whatever commands
arrived, run one step and send each request's delta. The socket closing (the node gone) or a
Shutdown ends the process; a step that raises is reported (WorkerFailed without a request id)
and ends it too, since vLLM's state after a failed step is not known good.
"""
from __future__ import annotations

import argparse
import os
import select
import socket
import sys

from node.vllm_wire import FrameError, FrameReader, parse_command, send, vllm_sampling_kwargs
from protos.pdserve.v1 import vllm_worker_pb2 as wpb


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m node.vllm_child")
    p.add_argument("--fd", type=int, required=True, help="the socket to the node, inherited")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="vLLM's KV cache size (else it sizes it from the host's memory and may refuse to start)")
    return p.parse_args(argv)


def build_engine(a: argparse.Namespace):
    from vllm import EngineArgs, LLMEngine

    kwargs = dict(model=a.model, dtype=a.dtype, seed=a.seed, enforce_eager=True, disable_log_stats=True)
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                 "kv_cache_memory_bytes"):
        if getattr(a, name) is not None:
            kwargs[name] = getattr(a, name)
    return LLMEngine.from_engine_args(EngineArgs(**kwargs))


def ready_event(engine) -> wpb.WorkerEvent:
    import vllm

    cfg = engine.vllm_config
    return wpb.WorkerEvent(ready=wpb.WorkerReady(
        num_blocks=cfg.cache_config.num_gpu_blocks or 0, block_size=cfg.cache_config.block_size,
        max_model_len=cfg.model_config.max_model_len, vocab_size=cfg.model_config.get_vocab_size(),
        vllm_version=vllm.__version__, pid=os.getpid()))


def output_event(out) -> wpb.WorkerEvent:
    c = out.outputs[0]
    return wpb.WorkerEvent(output=wpb.WorkerOutput(
        request_id=out.request_id, new_token_ids=list(c.token_ids), text_delta=c.text or "",
        finish_reason=c.finish_reason or "", finished=bool(out.finished),
        num_cached_tokens=out.num_cached_tokens or 0))


class Worker:
    def __init__(self, engine, sock: socket.socket) -> None:
        self.engine, self.sock = engine, sock
        self.reader = FrameReader()

    def command(self, cmd: wpb.WorkerCommand) -> bool:
        """Run one command; False: stop."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        kind = cmd.WhichOneof("kind")
        if kind == "shutdown":
            return False
        if kind == "abort":
            self.engine.abort_request([cmd.abort.request_id])
        elif kind == "add":
            add = cmd.add
            try:
                params = SamplingParams(**vllm_sampling_kwargs(add.sampling), output_kind=RequestOutputKind.DELTA)
                self.engine.add_request(add.request_id, {"prompt_token_ids": list(add.prompt_token_ids)}, params)
            except Exception as err:  # vLLM refused the request: its reason goes to the client
                send(self.sock, wpb.WorkerEvent(failed=wpb.WorkerFailed(request_id=add.request_id,
                                                                       message=f"vLLM refused it: {err}")))
        return True

    def run(self) -> int:
        while True:
            busy = self.engine.has_unfinished_requests()
            readable, _, _ = select.select([self.sock], [], [], 0 if busy else None)
            if readable:
                try:
                    frames = self.reader.read_available(self.sock)
                except (FrameError, OSError):
                    return 0  # the node is gone: nothing to serve
                for frame in frames:
                    if not self.command(parse_command(frame)):
                        return 0
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as err:
                send(self.sock, wpb.WorkerEvent(failed=wpb.WorkerFailed(message=f"vLLM step failed: {err!r}")))
                return 1
            for out in outputs:
                send(self.sock, output_event(out))


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    sock = socket.socket(fileno=a.fd)
    try:
        engine = build_engine(a)
    except Exception as err:
        send(sock, wpb.WorkerEvent(failed=wpb.WorkerFailed(message=f"vLLM did not start: {err!r}")))
        return 1
    send(sock, ready_event(engine))
    return Worker(engine, sock).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The checked-in generated code matches the .proto sources, and the messages behave."""
from __future__ import annotations

import re
import shutil
from importlib.metadata import version
from pathlib import Path

import pytest

from protos.freshness import differences, generated_grpc_version
from protos.generate import PROTOS_DIR, generate
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc, serving_pb2, serving_pb2_grpc


def _generated(root: Path) -> dict[Path, bytes]:
    return {p.relative_to(root): p.read_bytes() for p in root.rglob("*_pb2*.py*") if p.is_file()}


def _checked_in_generator() -> str | None:
    return generated_grpc_version((PROTOS_DIR / "pdserve/v1/serving_pb2_grpc.py").read_text())


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    generate(tmp_path)
    fresh, checked_in = _generated(tmp_path), _generated(PROTOS_DIR)
    assert fresh, "protoc generated nothing"
    same = version("grpcio-tools") == _checked_in_generator()
    stale = differences(fresh, checked_in, same_generator=same)
    assert not stale, (
        f"generated code is stale or missing: {stale}; run `python -m protos.generate` "
        f"(grpcio-tools here {version('grpcio-tools')}, checked-in code made by {_checked_in_generator()})"
    )


def test_the_lock_pins_the_generator_of_the_checked_in_code() -> None:
    # With that release installed the comparison above is byte for byte.
    assert version("grpcio-tools") == _checked_in_generator()


def test_another_generator_release_is_not_staleness(tmp_path: Path) -> None:
    # A fresh machine with the next patch release of grpcio-tools: the version stamps differ,
    # messages and stubs do not.
    generate(tmp_path)
    fresh = _generated(tmp_path)
    bumped = {
        path: re.sub(rb"GRPC_GENERATED_VERSION = '[^']+'", b"GRPC_GENERATED_VERSION = '9.99.9'", data)
        .replace(b"# Protobuf Python Version: ", b"# Protobuf Python Version: 99.")
        for path, data in fresh.items()
    }
    assert bumped != fresh
    assert differences(bumped, fresh, same_generator=False) == []
    assert differences(bumped, fresh, same_generator=True) != []


@pytest.mark.parametrize(
    ("edit", "what"),
    [
        # A field renamed: the messages differ.
        (lambda text: text.replace("string request_id = 1;", "string request_key = 1;", 1), "messages"),
        # A server-streaming RPC made unary: the stubs differ (and the descriptor).
        (lambda text: text.replace("returns (stream GenerateResponse)", "returns (GenerateResponse)", 1), "stubs"),
    ],
)
def test_a_changed_proto_is_staleness(tmp_path: Path, edit, what: str) -> None:
    copy = tmp_path / "src"
    shutil.copytree(PROTOS_DIR / "pdserve", copy / "pdserve")
    serving = copy / "pdserve/v1/serving.proto"
    edited = edit(serving.read_text())
    assert edited != serving.read_text(), "the edit must change the proto"
    serving.write_text(edited)
    generate(tmp_path / "out", root=copy)
    stale = differences(_generated(tmp_path / "out"), _generated(PROTOS_DIR), same_generator=False)
    assert any("serving_pb2.py (messages)" in s for s in stale), stale
    if what == "stubs":
        assert any("serving_pb2_grpc.py (service stubs)" in s for s in stale), stale


def test_generated_imports_resolve_inside_the_protos_package() -> None:
    # kv.proto imports serving.proto: the generated import must not be the bare `pdserve.v1`
    # (which would be the SDK package).
    assert kv_pb2.PrefillRequest.DESCRIPTOR.fields_by_name["sampling"].message_type is (
        serving_pb2.SamplingParams.DESCRIPTOR
    )
    assert hasattr(serving_pb2_grpc, "PdServeStub") and hasattr(kv_pb2_grpc, "KVTransferStub")


def test_generate_response_oneof_round_trip() -> None:
    chunk = serving_pb2.GenerateResponse(
        request_id="r1",
        chunk=serving_pb2.Chunk(
            index=1,
            token_ids=[5, 6],
            text="hi",
            logprobs=[serving_pb2.TokenLogprobs(token_id=5, logprob=-0.5, top=[serving_pb2.TopLogprob(token_id=7)])],
        ),
    )
    back = serving_pb2.GenerateResponse.FromString(chunk.SerializeToString())
    assert back == chunk and back.WhichOneof("kind") == "chunk"
    assert list(back.chunk.token_ids) == [5, 6] and back.chunk.logprobs[0].top[0].token_id == 7

    done = serving_pb2.GenerateResponse(
        request_id="r1",
        complete=serving_pb2.Complete(
            index=0,
            finish_reason=serving_pb2.FINISH_REASON_LENGTH,
            usage=serving_pb2.Usage(prompt_tokens=10, completion_tokens=4, cached_prompt_tokens=8),
            timings=serving_pb2.Timings(queue_s=0.001, first_token_s=0.25, total_s=1.5),
        ),
    )
    back = serving_pb2.GenerateResponse.FromString(done.SerializeToString())
    assert back.WhichOneof("kind") == "complete"
    assert back.complete.finish_reason == serving_pb2.FINISH_REASON_LENGTH
    assert back.complete.timings.first_token_s == pytest.approx(0.25)

    # Setting another member of the oneof replaces the previous one.
    back.error.code = 13
    assert back.WhichOneof("kind") == "error" and not back.HasField("complete")


def test_sampling_params_presence() -> None:
    # Fields whose engine default is not zero are optional: unset is distinguishable from 0.
    empty = serving_pb2.SamplingParams()
    for name in ("n", "max_tokens", "temperature", "top_p", "repetition_penalty", "seed", "logprobs"):
        assert not empty.HasField(name), name
    greedy = serving_pb2.SamplingParams.FromString(serving_pb2.SamplingParams(temperature=0.0).SerializeToString())
    assert greedy.HasField("temperature") and greedy.temperature == 0.0


def test_prompt_is_one_of_text_chat_tokens() -> None:
    req = serving_pb2.GenerateRequest(text="hello")
    req.tokens.ids.extend([1, 2, 3])
    assert req.WhichOneof("prompt") == "tokens" and req.text == ""
    req.chat.messages.add(role="user", content="hi")
    assert req.WhichOneof("prompt") == "chat"
    assert not req.HasField("request_id")


def test_enum_names_are_defined_once_by_the_protos():
    """Finish reasons and SLO classes in code are the proto enums' names, both ways."""
    from pdserve.core import SLO_CLASSES as SDK_SLO_CLASSES
    from pdserve.core import finish_reason_name
    from protos.convert import finish_reason_to_proto, slo_class_from_proto
    from protos.pdserve.v1 import serving_pb2 as pb
    from router.admission import SLO_CLASSES
    from tokens.stop import FinishReason

    wire_reasons = {v for v in pb.FinishReason.values() if v != pb.FINISH_REASON_UNSPECIFIED}
    assert {finish_reason_to_proto(r) for r in FinishReason} == wire_reasons
    assert {finish_reason_name(v) for v in wire_reasons} == {r.value for r in FinishReason}
    wire_classes = [v for v in pb.SloClass.values() if v != pb.SLO_CLASS_UNSPECIFIED]
    assert {slo_class_from_proto(v) for v in wire_classes} == set(SLO_CLASSES) == set(SDK_SLO_CLASSES)
    assert slo_class_from_proto(pb.SLO_CLASS_UNSPECIFIED) is None  # the router's default applies

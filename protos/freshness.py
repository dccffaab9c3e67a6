"""What must match between checked-in generated code and a fresh `protoc` run.

The generated files carry the generator's version (`GRPC_GENERATED_VERSION`, the protobuf
runtime stamp), so a byte comparison breaks whenever a fresh machine resolves another patch
release of grpcio-tools, though nothing a program sees has changed. What matters is compared
instead, read from the source with `ast` (nothing generated is imported or executed):

- `*_pb2.py`: the serialized FileDescriptorProto, i.e. every message, field, enum and service
  exactly as the .proto declares them;
- `*_pb2_grpc.py`: every stub attribute and servicer handler (method path, call kind,
  request and response (de)serializers);
- `*_pb2.pyi`: derived from the descriptor (so covered by it) but laid out by the generator, so
  compared only byte for byte.

When the installed grpcio-tools is the release that generated the checked-in code (the lock pins
that release), every file is compared byte for byte.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from google.protobuf import descriptor_pb2

_GRPC_VERSION_RE = re.compile(r"^GRPC_GENERATED_VERSION = '([^']+)'", re.MULTILINE)


def generated_grpc_version(grpc_file_text: str) -> str | None:
    """The grpcio-tools release that wrote a *_pb2_grpc.py file."""
    found = _GRPC_VERSION_RE.search(grpc_file_text)
    return found.group(1) if found else None


def file_descriptor(pb2_text: str) -> descriptor_pb2.FileDescriptorProto:
    """The FileDescriptorProto a *_pb2.py file registers (its AddSerializedFile literal)."""
    for node in ast.walk(ast.parse(pb2_text)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "AddSerializedFile":
            proto = descriptor_pb2.FileDescriptorProto()
            proto.ParseFromString(ast.literal_eval(node.args[0]))
            return proto
    raise ValueError("no AddSerializedFile(...) call: not a *_pb2.py file")


def _call_signature(call: ast.Call) -> tuple[str, ...]:
    """`channel.unary_stream('/pkg.Svc/M', request_serializer=..., ...)` as comparable strings."""
    kind = call.func.attr if isinstance(call.func, ast.Attribute) else ast.unparse(call.func)
    args = [ast.unparse(a) for a in call.args]
    keywords = sorted(f"{k.arg}={ast.unparse(k.value)}" for k in call.keywords)
    return (kind, *args, *keywords)


def grpc_surface(grpc_text: str) -> dict[str, tuple[str, ...]]:
    """Every stub method (`Stub.attr`) and servicer handler (`add_*_to_server[name]`) of a
    *_pb2_grpc.py file, keyed by where it is declared."""
    surface: dict[str, tuple[str, ...]] = {}
    for top in ast.parse(grpc_text).body:
        if isinstance(top, ast.ClassDef) and top.name.endswith("Stub"):
            for node in ast.walk(top):
                if (
                    isinstance(node, ast.Assign)
                    and isinstance(node.value, ast.Call)
                    and isinstance(node.targets[0], ast.Attribute)
                ):
                    surface[f"{top.name}.{node.targets[0].attr}"] = _call_signature(node.value)
        elif isinstance(top, ast.FunctionDef) and top.name.startswith("add_"):
            for node in ast.walk(top):
                if isinstance(node, ast.Dict):
                    for key, value in zip(node.keys, node.values):
                        if isinstance(key, ast.Constant) and isinstance(value, ast.Call):
                            surface[f"{top.name}[{key.value}]"] = _call_signature(value)
    return surface


def differences(fresh: dict[Path, bytes], checked_in: dict[Path, bytes], same_generator: bool) -> list[str]:
    """Relative paths whose content differs in what matters (see the module docstring);
    `same_generator`: the fresh files come from the release that made the checked-in ones."""
    stale = []
    for path in sorted(fresh.keys() | checked_in.keys()):
        new, old = fresh.get(path), checked_in.get(path)
        if new is None or old is None:
            stale.append(f"{path} ({'missing' if old is None else 'not generated'})")
        elif same_generator:
            if new != old:
                stale.append(f"{path} (bytes, same generator release)")
        elif path.name.endswith("_pb2.py"):
            if file_descriptor(new.decode()) != file_descriptor(old.decode()):
                stale.append(f"{path} (messages)")
        elif path.name.endswith("_pb2_grpc.py"):
            if grpc_surface(new.decode()) != grpc_surface(old.decode()):
                stale.append(f"{path} (service stubs)")
    return stale

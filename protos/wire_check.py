"""Parse a protobuf from untrusted bytes and, when that fails, say which field broke it.

protobuf's own ``DecodeError`` says only "Error parsing message" or "String field had bad
UTF-8": a client cannot tell which of its fields was wrong. ``parse`` re-reads refused bytes
with a small walker over the wire format (tags, varints, lengths, nested messages, UTF-8 of
string fields) that names the first field it cannot read, as a path like
``chat.messages[1].content``. The walker runs only on bytes protobuf already refused, so it
never decides what is accepted; protobuf does.
"""
from __future__ import annotations

from typing import TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)

_MAX_DEPTH = 100  # protobuf's default recursion limit
_VARINT_TYPES = frozenset({
    FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_BOOL, FieldDescriptor.TYPE_ENUM,
})


class MalformedMessageError(ValueError):
    """Bytes that are not a valid message of the expected type. ``field``: the path of the
    field where reading failed (None when the walker could not tell)."""

    def __init__(self, type_name: str, field: str | None, problem: str) -> None:
        where = f"field {field}: " if field else ""
        super().__init__(f"the request is not a valid {type_name} message: {where}{problem}")
        self.type_name, self.field, self.problem = type_name, field, problem


class _Broken(Exception):
    def __init__(self, field: str | None, problem: str) -> None:
        super().__init__(problem)
        self.field, self.problem = field, problem


def parse(cls: type[M], data: bytes) -> M:
    """``cls.FromString(data)``; raises MalformedMessageError naming the field instead of
    protobuf's DecodeError."""
    try:
        return cls.FromString(data)
    except DecodeError as e:
        field, problem = explain(cls.DESCRIPTOR, data)
        raise MalformedMessageError(cls.DESCRIPTOR.full_name, field, problem or str(e)) from None


def explain(descriptor: Descriptor, data: bytes) -> tuple[str | None, str | None]:
    """(field path, problem) of the first thing in ``data`` that cannot be read as
    ``descriptor``; (None, None) when the walker finds nothing wrong."""
    try:
        _walk(descriptor, memoryview(data), 0, len(data), "", 0)
    except _Broken as b:
        return b.field, b.problem
    return None, None


def _varint(data: memoryview, i: int, end: int, field: str | None, what: str) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= end:
            raise _Broken(field, f"{what} is truncated (the message ends inside a varint)")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
        if shift >= 70:
            raise _Broken(field, f"{what} is a varint longer than 10 bytes")


def _walk(desc: Descriptor, data: memoryview, i: int, end: int, path: str, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise _Broken(path or None, f"messages nested deeper than {_MAX_DEPTH} levels")
    seen: dict[int, int] = {}
    while i < end:
        tag, i = _varint(data, i, end, path or None, f"the field tag at byte {i}")
        number, wire_type = tag >> 3, tag & 7
        field = desc.fields_by_number.get(number)
        name = field.name if field is not None else f"#{number} (unknown)"
        if field is not None and field.is_repeated:
            name += f"[{seen.get(number, 0)}]"
            seen[number] = seen.get(number, 0) + 1
        here = f"{path}.{name}" if path else name
        if number == 0:
            raise _Broken(path or None, f"field number 0 at byte {i - 1} (bytes that are not a protobuf message)")
        if wire_type == 0:
            _, i = _varint(data, i, end, here, "the value")
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
            if i + size > end:
                raise _Broken(here, f"a {size}-byte value is truncated ({end - i} bytes left)")
            i += size
        elif wire_type == 2:
            length, i = _varint(data, i, end, here, "the length")
            if i + length > end:
                raise _Broken(here, f"declares {length} bytes but only {end - i} remain (truncated)")
            if field is not None:
                _check_delimited(field, data, i, i + length, here, depth)
            i += length
        elif wire_type in (3, 4):
            raise _Broken(here, f"group wire type {wire_type} (deprecated groups are not accepted)")
        else:
            raise _Broken(here, f"invalid wire type {wire_type}")


def _check_delimited(field: FieldDescriptor, data: memoryview, i: int, end: int, here: str, depth: int) -> None:
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            bytes(data[i:end]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Broken(here, f"is not valid UTF-8 (byte {e.start} of the string)") from None
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        _walk(field.message_type, data, i, end, here, depth + 1)
    elif field.is_repeated and field.type in _VARINT_TYPES:
        while i < end:  # packed varints
            _, i = _varint(data, i, end, here.rsplit("[", 1)[0], "a packed value")

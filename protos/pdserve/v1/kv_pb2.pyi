from protos.pdserve.v1 import serving_pb2 as _serving_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]

class ChecksumAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKSUM_ALGORITHM_UNSPECIFIED: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_CRC32: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_XXH3_64: _ClassVar[ChecksumAlgorithm]
DTYPE_UNSPECIFIED: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_BFLOAT16: Dtype
CHECKSUM_ALGORITHM_UNSPECIFIED: ChecksumAlgorithm
CHECKSUM_ALGORITHM_CRC32: ChecksumAlgorithm
CHECKSUM_ALGORITHM_XXH3_64: ChecksumAlgorithm

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "first_token_ids", "cached_prompt_tokens", "resumed_output_tokens", "heartbeat_s", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _serving_pb2.SamplingParams
    first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_prompt_tokens: int
    resumed_output_tokens: int
    heartbeat_s: float
    cache_salt: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_serving_pb2.SamplingParams, _Mapping]] = ..., first_token_ids: _Optional[_Iterable[int]] = ..., cached_prompt_tokens: _Optional[int] = ..., resumed_output_tokens: _Optional[int] = ..., heartbeat_s: _Optional[float] = ..., cache_salt: _Optional[bytes] = ...) -> None: ...

class PushPrefixRequest(_message.Message):
    __slots__ = ("request_id", "model_fingerprint", "block_size", "token_ids", "block_hashes", "first_block_index", "dest_block_ids", "dest_address", "dest_kv_endpoints", "token", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    DEST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DEST_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEST_KV_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_fingerprint: str
    block_size: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    first_block_index: int
    dest_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dest_address: str
    dest_kv_endpoints: _containers.RepeatedScalarFieldContainer[str]
    token: bytes
    cache_salt: bytes
    def __init__(self, request_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., first_block_index: _Optional[int] = ..., dest_block_ids: _Optional[_Iterable[int]] = ..., dest_address: _Optional[str] = ..., dest_kv_endpoints: _Optional[_Iterable[str]] = ..., token: _Optional[bytes] = ..., cache_salt: _Optional[bytes] = ...) -> None: ...

class PushPrefixResponse(_message.Message):
    __slots__ = ("blocks_sent", "bytes_sent", "transport", "transfer_s", "onboarded_host_blocks", "onboarded_disk_blocks", "onboard_s")
    BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    ONBOARDED_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ONBOARDED_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ONBOARD_S_FIELD_NUMBER: _ClassVar[int]
    blocks_sent: int
    bytes_sent: int
    transport: str
    transfer_s: float
    onboarded_host_blocks: int
    onboarded_disk_blocks: int
    onboard_s: float
    def __init__(self, blocks_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., transport: _Optional[str] = ..., transfer_s: _Optional[float] = ..., onboarded_host_blocks: _Optional[int] = ..., onboarded_disk_blocks: _Optional[int] = ..., onboard_s: _Optional[float] = ...) -> None: ...

class KVBlockMessage(_message.Message):
    __slots__ = ("header", "chunk", "trailer", "attach", "dist_attach")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    DIST_ATTACH_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    chunk: KVChunk
    trailer: KVTrailer
    attach: KVAttach
    dist_attach: KVDistAttach
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., trailer: _Optional[_Union[KVTrailer, _Mapping]] = ..., attach: _Optional[_Union[KVAttach, _Mapping]] = ..., dist_attach: _Optional[_Union[KVDistAttach, _Mapping]] = ...) -> None: ...

class KVDistAttach(_message.Message):
    __slots__ = ("request_id", "token", "chunk_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token: bytes
    chunk_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., token: _Optional[bytes] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class KVDistReady(_message.Message):
    __slots__ = ("store_port", "group_key", "timeout_ms")
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    store_port: int
    group_key: str
    timeout_ms: int
    def __init__(self, store_port: _Optional[int] = ..., group_key: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class KVAttach(_message.Message):
    __slots__ = ("path", "size", "request_id", "token")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    request_id: str
    token: bytes
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., request_id: _Optional[str] = ..., token: _Optional[bytes] = ...) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("request_id", "model_fingerprint", "block_size", "num_layers", "layer_start", "layer_count", "dtype", "block_shape", "first_block_index", "dest_block_ids", "block_hashes", "num_tokens", "payload_bytes", "checksum_algorithm", "token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    DEST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_fingerprint: str
    block_size: int
    num_layers: int
    layer_start: int
    layer_count: int
    dtype: Dtype
    block_shape: _containers.RepeatedScalarFieldContainer[int]
    first_block_index: int
    dest_block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    payload_bytes: int
    checksum_algorithm: ChecksumAlgorithm
    token: bytes
    def __init__(self, request_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_count: _Optional[int] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., block_shape: _Optional[_Iterable[int]] = ..., first_block_index: _Optional[int] = ..., dest_block_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., checksum_algorithm: _Optional[_Union[ChecksumAlgorithm, str]] = ..., token: _Optional[bytes] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("seq", "data", "raw_bytes", "checksum", "shm_offset", "over_group")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    OVER_GROUP_FIELD_NUMBER: _ClassVar[int]
    seq: int
    data: bytes
    raw_bytes: int
    checksum: int
    shm_offset: int
    over_group: bool
    def __init__(self, seq: _Optional[int] = ..., data: _Optional[bytes] = ..., raw_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., shm_offset: _Optional[int] = ..., over_group: _Optional[bool] = ...) -> None: ...

class KVTrailer(_message.Message):
    __slots__ = ("checksum",)
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    checksum: int
    def __init__(self, checksum: _Optional[int] = ...) -> None: ...

class PushBlocksResponse(_message.Message):
    __slots__ = ("blocks_written", "bytes_written")
    BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    blocks_written: int
    bytes_written: int
    def __init__(self, blocks_written: _Optional[int] = ..., bytes_written: _Optional[int] = ...) -> None: ...

class KVStreamReply(_message.Message):
    __slots__ = ("ok", "error", "dist")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DIST_FIELD_NUMBER: _ClassVar[int]
    ok: PushBlocksResponse
    error: KVStreamError
    dist: KVDistReady
    def __init__(self, ok: _Optional[_Union[PushBlocksResponse, _Mapping]] = ..., error: _Optional[_Union[KVStreamError, _Mapping]] = ..., dist: _Optional[_Union[KVDistReady, _Mapping]] = ...) -> None: ...

class KVStreamError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ReserveBlocksRequest(_message.Message):
    __slots__ = ("request_id", "model_fingerprint", "block_size", "num_tokens", "block_hashes", "prompt_token_ids", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_fingerprint: str
    block_size: int
    num_tokens: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: bytes
    def __init__(self, request_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., num_tokens: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[bytes] = ...) -> None: ...

class ReserveBlocksResponse(_message.Message):
    __slots__ = ("num_cached_blocks", "block_ids", "lease_s", "kv_endpoints", "token")
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    num_cached_blocks: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_s: float
    kv_endpoints: _containers.RepeatedScalarFieldContainer[str]
    token: bytes
    def __init__(self, num_cached_blocks: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., lease_s: _Optional[float] = ..., kv_endpoints: _Optional[_Iterable[str]] = ..., token: _Optional[bytes] = ...) -> None: ...

class ReleaseReservationRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseReservationResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class RenewReservationRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class RenewReservationResponse(_message.Message):
    __slots__ = ("found", "lease_s")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    found: bool
    lease_s: float
    def __init__(self, found: _Optional[bool] = ..., lease_s: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_address", "reservation", "resumed_output_tokens", "fetch", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _serving_pb2.SamplingParams
    decode_address: str
    reservation: ReserveBlocksResponse
    resumed_output_tokens: int
    fetch: KVFetch
    cache_salt: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_serving_pb2.SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., reservation: _Optional[_Union[ReserveBlocksResponse, _Mapping]] = ..., resumed_output_tokens: _Optional[int] = ..., fetch: _Optional[_Union[KVFetch, _Mapping]] = ..., cache_salt: _Optional[bytes] = ...) -> None: ...

class KVFetch(_message.Message):
    __slots__ = ("holder_address", "num_blocks", "timeout_s")
    HOLDER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    holder_address: str
    num_blocks: int
    timeout_s: float
    def __init__(self, holder_address: _Optional[str] = ..., num_blocks: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_ids", "first_logprobs", "cached_tokens", "blocks_sent", "bytes_sent", "prefill_s", "transfer_s", "transport", "transfer_exposed_s", "kv_streamed", "kv_pushes", "kv_fallbacks", "fetch_outcome", "fetch_blocks", "fetch_bytes", "fetch_s", "fetch_transport", "fetch_transfer_s", "fetch_onboarded_host_blocks", "fetch_onboarded_disk_blocks", "fetch_onboard_s")
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_EXPOSED_S_FIELD_NUMBER: _ClassVar[int]
    KV_STREAMED_FIELD_NUMBER: _ClassVar[int]
    KV_PUSHES_FIELD_NUMBER: _ClassVar[int]
    KV_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    FETCH_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    FETCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    FETCH_S_FIELD_NUMBER: _ClassVar[int]
    FETCH_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    FETCH_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    FETCH_ONBOARDED_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FETCH_ONBOARDED_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FETCH_ONBOARD_S_FIELD_NUMBER: _ClassVar[int]
    first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_logprobs: _containers.RepeatedCompositeFieldContainer[_serving_pb2.TokenLogprobs]
    cached_tokens: int
    blocks_sent: int
    bytes_sent: int
    prefill_s: float
    transfer_s: float
    transport: str
    transfer_exposed_s: float
    kv_streamed: bool
    kv_pushes: int
    kv_fallbacks: int
    fetch_outcome: str
    fetch_blocks: int
    fetch_bytes: int
    fetch_s: float
    fetch_transport: str
    fetch_transfer_s: float
    fetch_onboarded_host_blocks: int
    fetch_onboarded_disk_blocks: int
    fetch_onboard_s: float
    def __init__(self, first_token_ids: _Optional[_Iterable[int]] = ..., first_logprobs: _Optional[_Iterable[_Union[_serving_pb2.TokenLogprobs, _Mapping]]] = ..., cached_tokens: _Optional[int] = ..., blocks_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., transport: _Optional[str] = ..., transfer_exposed_s: _Optional[float] = ..., kv_streamed: _Optional[bool] = ..., kv_pushes: _Optional[int] = ..., kv_fallbacks: _Optional[int] = ..., fetch_outcome: _Optional[str] = ..., fetch_blocks: _Optional[int] = ..., fetch_bytes: _Optional[int] = ..., fetch_s: _Optional[float] = ..., fetch_transport: _Optional[str] = ..., fetch_transfer_s: _Optional[float] = ..., fetch_onboarded_host_blocks: _Optional[int] = ..., fetch_onboarded_disk_blocks: _Optional[int] = ..., fetch_onboard_s: _Optional[float] = ...) -> None: ...

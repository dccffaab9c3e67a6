from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerSampling(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "has_seed", "seed", "stop_token_ids", "stop", "include_stop_str_in_output", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    has_seed: bool
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class WorkerAdd(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: WorkerSampling
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[WorkerSampling, _Mapping]] = ...) -> None: ...

class WorkerAbort(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class WorkerShutdown(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerCommand(_message.Message):
    __slots__ = ("add", "abort", "shutdown")
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    add: WorkerAdd
    abort: WorkerAbort
    shutdown: WorkerShutdown
    def __init__(self, add: _Optional[_Union[WorkerAdd, _Mapping]] = ..., abort: _Optional[_Union[WorkerAbort, _Mapping]] = ..., shutdown: _Optional[_Union[WorkerShutdown, _Mapping]] = ...) -> None: ...

class WorkerReady(_message.Message):
    __slots__ = ("num_blocks", "block_size", "max_model_len", "vocab_size", "vllm_version", "pid")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VLLM_VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    vllm_version: str
    pid: int
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., vllm_version: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class WorkerOutput(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "text_delta", "finish_reason", "finished", "num_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_delta: str
    finish_reason: str
    finished: bool
    num_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., text_delta: _Optional[str] = ..., finish_reason: _Optional[str] = ..., finished: _Optional[bool] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class WorkerFailed(_message.Message):
    __slots__ = ("request_id", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    message: str
    def __init__(self, request_id: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("ready", "output", "failed")
    READY_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ready: WorkerReady
    output: WorkerOutput
    failed: WorkerFailed
    def __init__(self, ready: _Optional[_Union[WorkerReady, _Mapping]] = ..., output: _Optional[_Union[WorkerOutput, _Mapping]] = ..., failed: _Optional[_Union[WorkerFailed, _Mapping]] = ...) -> None: ...

"""KV heads regrouped between a tensor-parallel engine's rank pools and the wire's full-head layout.

Each rank's paged pool holds its own KV heads: ``[L, N, 2, bs, H_kv/TP, D]``, contiguous (the
attention kernels need it). The wire carries the TP-1 layout, every KV head of a block-layer
(``[2, bs, H_kv, D]``), so nodes of any two tensor-parallel sizes exchange KV and neither needs
the other's size. Rank r holds KV heads ``[r H_kv/TP, (r+1) H_kv/TP)`` (engine/parallel/plan.py),
so the full-head block is the ranks' blocks side by side on the head axis.

On CPU the worker ranks allocate their pools in shared memory that rank 0 maps too
(``SharedPools``): a gather before a send and a scatter after a receive are plain tensor copies
in rank 0's process, no collective. On CUDA this would be an NCCL gather to rank 0 (and a
scatter back), which is not built.

A receiving node lands full-head transfers in a ``LandingArea``: a bounded full-head pool whose
slots its reservations name on the wire (the receivers write into it unchanged); each landed
transfer is scattered from its slots into the engine blocks of every rank before the sender is
answered (node/kv_inbox.py), and the slots go back when the reservation is taken, dropped or
expires. A reservation that finds too few free slots is refused like a full pool.
"""
from __future__ import annotations

import errno
import fcntl
import math
import os
import re
import tempfile
import threading
import uuid
from collections.abc import Sequence

import torch

from engine.parallel.plan import TensorParallelError


def _shm_dir() -> str:
    # /dev/shm is memory on Linux; elsewhere a temporary directory still shares the pages.
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def map_pool(path: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The pool file at ``path`` as a contiguous tensor of ``shape`` (shared: writes from any
    process that mapped it are seen by all)."""
    return torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(*shape)


_PREFIX = "pdserve-tp-"
# pdserve-tp-<pid of rank 0>-<8 hex>-rank<r>: the creator's pid and a lock say whether it lives.
_NAME = re.compile(rf"{_PREFIX}(\d+)-[0-9a-f]{{8}}-rank\d+")


def shm_room_error(directory: str, free_bytes: int, pool_bytes: int, ranks: int) -> str | None:
    """Why ``ranks - 1`` pools of ``pool_bytes`` each do not fit ``free_bytes`` in
    ``directory`` (None when they do). A tmpfs pool file is sparse: without this check (and the
    allocation that follows it) a /dev/shm smaller than the pools is found out under load, when a
    page is first touched and there is none (SIGBUS)."""
    need = (ranks - 1) * pool_bytes
    if need <= free_bytes:
        return None
    return (f"tensor-parallel KV pools need {need} bytes ({ranks - 1} ranks x {pool_bytes} bytes, "
            f"{need / 2**30:.2f} GiB) in {directory}, which has {free_bytes} bytes ({free_bytes / 2**30:.2f} GiB) "
            f"free: make it larger (the chart's shmSize) or the KV cache smaller (--kv-cache-mib, num_blocks)")


def remove_leftovers(directory: str) -> list[str]:
    """Remove the pool files an earlier rank 0 left in ``directory`` when it was killed before it
    removed their names (a SIGKILL while loading): files whose creator is not running and whose
    lock nobody holds. -> the paths removed."""
    removed = []
    for name in os.listdir(directory):
        m = _NAME.fullmatch(name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live creator in another pid namespace
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


class SharedPools:
    """The worker ranks' pool files, created (zeroed, sized) by rank 0 before the workers start,
    mapped by each worker and by rank 0. Once every rank has mapped its file the names are
    removed (``unlink``): the memory then lives exactly as long as the processes that map it.
    Until then each file is locked by its creator, and a start removes what a killed creator
    left (``remove_leftovers``). The pools' pages are allocated at start, so a directory too
    small for them is refused then, by name and sizes (TensorParallelError), not found out by a
    SIGBUS under load."""

    def __init__(self, ranks: int, shape: Sequence[int], dtype: torch.dtype, directory: str | None = None) -> None:
        self.shape = tuple(shape)  # one rank's pool: [L, N, 2, bs, H_kv/TP, D]
        self.dtype = dtype
        directory = directory or _shm_dir()
        nbytes = math.prod(self.shape) * dtype.itemsize
        remove_leftovers(directory)
        st = os.statvfs(directory)
        why = shm_room_error(directory, st.f_bavail * st.f_frsize, nbytes, ranks)
        if why:
            raise TensorParallelError(why)
        tag = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.paths = [os.path.join(directory, f"{tag}-rank{r}") for r in range(1, ranks)]
        self.pools: list[torch.Tensor] = []  # ranks 1 .. TP-1, in rank order
        self._locks: list[int] = []  # open, flocked fds of the files, until unlink
        try:
            for path in self.paths:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                self._locks.append(fd)
                fcntl.flock(fd, fcntl.LOCK_EX)
                _allocate(fd, nbytes, directory, ranks)  # zeros, as allocate_kv_cache's pools
                self.pools.append(map_pool(path, self.shape, dtype))
        except BaseException:
            self.unlink()
            raise

    def unlink(self) -> None:
        """Remove the files' names (idempotent); mapped memory stays until unmapped."""
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        locks, self._locks = self._locks, []
        for fd in locks:
            os.close(fd)


def _allocate(fd: int, nbytes: int, directory: str, ranks: int) -> None:
    """Every page of the file now (a tmpfs file is otherwise sparse: another process may fill
    the room meanwhile); ENOSPC is the same refusal as the size check's."""
    if not hasattr(os, "posix_fallocate"):  # macOS: sparse, as before
        os.ftruncate(fd, nbytes)
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        raise TensorParallelError(f"tensor-parallel KV pools need {(ranks - 1) * nbytes} bytes ({ranks - 1} ranks x "
                                  f"{nbytes} bytes) in {directory}, which filled up while they were allocated "
                                  f"(another process took the room): make it larger or the KV cache smaller") from None


def gather_blocks(pools: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """Blocks ``block_ids`` of every layer with all KV heads: ``[L, k, 2, bs, H_kv, D]``, contiguous,
    from the rank pools (``pools[r]``: ``[L, N, 2, bs, H_kv/TP, D]``, rank order)."""
    first = pools[0]
    num_layers, _, two, bs, heads, head_dim = first.shape
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=first.device)
    out = torch.empty((num_layers, len(idx), two, bs, heads * len(pools), head_dim), dtype=first.dtype,
                      device=first.device)
    for r, pool in enumerate(pools):
        out[:, :, :, :, r * heads:(r + 1) * heads].copy_(pool.index_select(1, idx))
    return out


def scatter_blocks(staging: torch.Tensor, pools: Sequence[torch.Tensor], block_ids: Sequence[int],
                   layers: range | None = None) -> None:
    """The inverse: ``staging`` (``[L, k, 2, bs, H_kv, D]``, its block j going to ``block_ids[j]``)
    into the rank pools; ``layers`` limits it to those layers (all by default)."""
    heads = pools[0].shape[4]
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=staging.device)
    sl = slice(layers.start, layers.stop) if layers is not None else slice(None)
    for r, pool in enumerate(pools):
        pool[sl].index_copy_(1, idx, staging[sl, :, :, :, r * heads:(r + 1) * heads])


def landing_slots(num_blocks: int, tp: int, max_model_len: int, block_size: int) -> int:
    """Room for one longest prompt, or as many bytes as one rank's pool if that is more, never
    more blocks than the pool has."""
    return min(num_blocks, max(math.ceil(max_model_len / block_size), num_blocks // tp))


class LandingArea:
    """``slots`` full-head blocks in front of the rank ``pools``; thread-safe."""

    def __init__(self, pools: Sequence[torch.Tensor], slots: int) -> None:
        num_layers, _, two, bs, heads, head_dim = pools[0].shape  # [L, N, 2, bs, H_kv/TP, D]
        self.pools = list(pools)
        # [L, slots, 2, bs, H_kv, D]: what the receivers see as "the pool".
        self.tensor = torch.zeros((num_layers, slots, two, bs, heads * len(pools), head_dim), dtype=pools[0].dtype,
                                  device=pools[0].device)
        self._lock = threading.Lock()
        self._free = list(range(slots - 1, -1, -1))  # a stack: low slots first
        self._held: dict[str, dict[int, int]] = {}  # request -> landing slot -> engine block

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def take(self, request_id: str, engine_blocks: Sequence[int]) -> tuple[int, ...] | None:
        """Landing slots for ``engine_blocks`` (in order), or None when too few are free."""
        with self._lock:
            if request_id in self._held or len(engine_blocks) > len(self._free):
                return None
            slots = tuple(self._free.pop() for _ in engine_blocks)
            self._held[request_id] = dict(zip(slots, engine_blocks))
            return slots

    def scatter(self, request_id: str, slots: Sequence[int], layers: range) -> None:
        """Landed ``slots`` (layers ``layers``) into their engine blocks on every rank."""
        with self._lock:
            where = self._held.get(request_id, {})
            engine_blocks = [where[s] for s in slots]  # the receiver validated them against the reservation
        sl = slice(layers.start, layers.stop)
        idx = torch.tensor(list(slots), dtype=torch.long)
        staging = self.tensor[sl].index_select(1, idx)  # [layers, k, 2, bs, H_kv, D]
        scatter_blocks(staging, [pool[sl] for pool in self.pools], engine_blocks)

    def free(self, request_id: str) -> None:
        """Give the request's slots back (idempotent)."""
        with self._lock:
            held = self._held.pop(request_id, None)
            if held:
                self._free.extend(held)

"""The native CPU decode-attention kernel (``cpu_decode.c``): built once per machine, loaded with ctypes.

The kernel reads each decode's K and V rows from the paged cache where they lie instead of
gathering them into a padded copy for SDPA (why, and the figures: docs/engine.md, "CPU decode
attention"). It is compiled on first use with the system C compiler (``$CC``, else ``cc``) for
this CPU (``-march=native``) and cached under ``$PDSERVE_CACHE_DIR/kernels`` by a key of the
source, the compiler and the CPU, so a node builds it once (about a second) and later starts
load the cached library. Processes starting together serialize on the same lock file as the
matmul plans.

No compiler, a failed build or a library that does not load is not an error: ``load`` returns
None with the reason logged, and the torch path (gather + SDPA) serves every step as before.
Nothing that came over a socket reaches this code; it only ever reads tensors of this process.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
# Fast math for the vectorized expf at compile time only: linking with -ffast-math would pull in
# crtfastmath.o, which turns on flush-to-zero for the whole process when the library loads.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]
_CPU_FIELDS = {"vendor_id", "cpu family", "model", "model name", "flags", "CPU implementer", "CPU architecture",
               "CPU variant", "CPU part", "Features"}


class DecodeKernel:
    """``__call__`` attends every decode (one query per sequence) of a step for one layer."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        fn = lib.pd_decode_attention_bf16
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [p, i64, p, i64, p, i64, p, p, i64, i64, i64, i64, i64, ctypes.c_float, i64, p]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(
        self,
        q: torch.Tensor,  # [T, Hq, D] bf16, contiguous
        flat_kv: torch.Tensor,  # [N * 2 * bs, Hkv, D] bf16, one layer viewed flat (backend.flat_layer)
        tables: torch.Tensor,  # [n, W] int32, contiguous: block table of each decode
        seq_lens: torch.Tensor,  # [n] int32, positions each decode attends (its own included)
        q_start: torch.Tensor,  # [n] int32, the token (row of q and out) of each decode
        block_size: int,
        scale: float,
        out: torch.Tensor,  # [T, Hq, D] bf16, contiguous; the decodes' rows are written
    ) -> None:
        _, hq, d = q.shape
        hkv = flat_kv.shape[1]
        n = tables.shape[0]
        if not (q.dtype == flat_kv.dtype == out.dtype == torch.bfloat16):
            raise ValueError(f"bf16 only: q {q.dtype}, kv {flat_kv.dtype}, out {out.dtype}")
        if not (tables.dtype == seq_lens.dtype == q_start.dtype == torch.int32):
            raise ValueError("tables, seq_lens and q_start must be int32")
        if not all(t.is_contiguous() and t.device.type == "cpu" for t in (q, flat_kv, tables, seq_lens, q_start, out)):
            raise ValueError("every tensor must be a contiguous CPU tensor")
        if (q.dim() != 3 or flat_kv.dim() != 3 or tables.dim() != 2 or out.shape != q.shape or flat_kv.shape[2] != d
                or hq % hkv or seq_lens.shape != (n,) or q_start.shape != (n,) or block_size < 1
                or flat_kv.shape[0] % (2 * block_size)):
            raise ValueError(f"shapes disagree: q {tuple(q.shape)}, kv {tuple(flat_kv.shape)}, "
                             f"tables {tuple(tables.shape)}, out {tuple(out.shape)}")
        if n == 0:
            return
        # A sequence's whole row of KV heads per item reads each cache row once, contiguously
        # (the fastest order); with few sequences that leaves threads idle, so split by head.
        heads_per_item = hkv if n >= 2 * torch.get_num_threads() else 1
        rc = self._fn(q.data_ptr(), q.shape[0], flat_kv.data_ptr(), flat_kv.shape[0] // (2 * block_size),
                      tables.data_ptr(), tables.shape[1], seq_lens.data_ptr(), q_start.data_ptr(), n, hq, hkv, d,
                      block_size, scale, heads_per_item, out.data_ptr())
        if rc == -2:
            raise ValueError("cpu decode attention: a query row, sequence length or block id is out of range "
                             "(checked in the kernel before anything is read)")
        if rc != 0:
            raise MemoryError("cpu decode attention: a thread could not allocate its scratch buffer")


def load(cache_dir: Path, compiler: str | None = None) -> DecodeKernel | None:
    """The kernel for this machine, built into ``cache_dir`` if it is not there yet; None
    (with the reason logged) when it cannot be built or loaded here."""
    cc = compiler or os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        log.info("cpu decode attention: no C compiler %r; decode attention stays on gather + SDPA", cc)
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        path = cache_dir / f"cpu_decode-{_key(version)}.so"
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            lock = open(cache_dir / "tune.lock", "w")
        except OSError:
            # A read-only cache (an image's prebuilt one, say): use what is there, else build
            # into a private temporary directory.
            if not path.exists():
                path = Path(tempfile.mkdtemp(prefix="pdserve-kernels-")) / path.name
                _build(cc, path)
            return DecodeKernel(ctypes.CDLL(str(path)), path)
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                _build(cc, path)
        return DecodeKernel(ctypes.CDLL(str(path)), path)
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        log.warning("cpu decode attention unavailable (%s); decode attention stays on gather + SDPA", e)
        return None


def _build(cc: str, path: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="pdserve-cc-") as tmp:
        obj = Path(tmp) / "cpu_decode.o"
        lib = Path(tmp) / "cpu_decode.so"
        for cmd in ([cc, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)], [cc, str(obj), "-o", str(lib), *LINK_FLAGS]):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                raise OSError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()[-500:]}")
        tmp_dst = path.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(lib, tmp_dst)
        os.replace(tmp_dst, path)  # atomic: a reader never sees half a library


def _key(compiler_version: str) -> str:
    """Source, compiler and CPU: -march=native code is only valid on the CPU it was built for."""
    flags = platform.machine()
    try:  # the first processor's identity: x86 (vendor, model, flags) and ARM (implementer, part, features)
        for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines():
            if line.split(":")[0].strip() in _CPU_FIELDS:
                flags += "\n" + line
    except OSError:
        flags += platform.processor()
    ident = "\n".join([SOURCE.read_text(), compiler_version, " ".join(COMPILE_FLAGS + LINK_FLAGS), flags])
    return hashlib.blake2b(ident.encode(), digest_size=10).hexdigest()

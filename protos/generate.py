"""Regenerate the Python code for every .proto under protos/: `python -m protos.generate`.

protoc runs with `protos/` as the include root, so the proto packages match their folders
(pdserve.v1 <-> pdserve/v1/, as buf's PACKAGE_DIRECTORY_MATCH wants). protoc then writes
imports such as `from pdserve.v1 import serving_pb2`, which would resolve to the SDK package
`pdserve/`; they are rewritten to `from protos.pdserve.v1 import ...`.

The output depends only on the .proto files and the grpcio-tools version (which bundles
protoc), so tests/test_protos.py can regenerate into a temporary folder and compare.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTOS_DIR = Path(__file__).resolve().parent
PYTHON_PACKAGE = "protos"  # where the include root lives as a Python package
# `from pdserve.v1 import x_pb2 as ...` -> `from protos.pdserve.v1 import x_pb2 as ...`
_IMPORT_RE = re.compile(r"^from (pdserve\.\S+) import (\S+_pb2)", re.MULTILINE)


def proto_files(root: Path = PROTOS_DIR) -> list[Path]:
    return sorted(root.rglob("*.proto"))


def generate(out_dir: Path, root: Path = PROTOS_DIR) -> list[Path]:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto under root into out_dir."""
    import grpc_tools
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    out_dir.mkdir(parents=True, exist_ok=True)
    sources = [str(p.relative_to(root)) for p in proto_files(root)]
    well_known = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = sorted(p for p in out_dir.rglob("*_pb2*.py*") if p.is_file())
    for path in written:
        text = path.read_text()
        fixed = _IMPORT_RE.sub(rf"from {PYTHON_PACKAGE}.\1 import \2", text)
        if fixed != text:
            path.write_text(fixed)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTOS_DIR, help="output root (default: in place)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

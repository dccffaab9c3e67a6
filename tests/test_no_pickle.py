"""Nothing that talks over a socket may deserialize Python objects (architecture: every message
is a protobuf, KV payloads are raw bytes)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("router", "node", "prefill_node", "decode_node", "kv_transfer", "kv_index", "tokens", "protos", "pdserve",
           "security")
FORBIDDEN = re.compile(
    r"^\s*(?:import|from)\s+(?:pickle|cPickle|_pickle|cloudpickle|dill)\b"  # imports
    r"|\btorch\.load\s*\("
    r"|\bpickle\.loads?\b"
    r"|\brecv_pyobj\b",
    re.MULTILINE,
)


def test_no_pickle_near_sockets() -> None:
    hits = []
    for folder in CHECKED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            for m in FORBIDDEN.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                hits.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0).strip()}")
    assert not hits, "pickle-style deserialization in networked code:\n" + "\n".join(hits)


def test_pattern_catches_the_usual_forms() -> None:
    for bad in ("import pickle", "from cloudpickle import dumps", "import dill as d", "x = torch.load(f)",
                "pickle.loads(b)", "sock.recv_pyobj()", "    import _pickle"):
        assert FORBIDDEN.search(bad), bad
    for ok in ("import pickletools_not", "# no pickle here", "weights = safetensors.torch.load_file(p)"):
        assert not FORBIDDEN.search(ok), ok

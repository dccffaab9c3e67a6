# The two commands a new machine needs:
#   make run    set up, then run the main job: the whole cluster on this machine (Redis, Ray,
#               a prefill node, a decode node, the router), streaming a first answer through it;
#               it keeps serving until Ctrl-C
#   make test   set up, then run the test suite (what CI runs)
PROMPT ?= Explain in two sentences why the KV cache makes LLM decoding fast.
PYTEST_ARGS ?=

.PHONY: setup run test protos lock

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

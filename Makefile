# The README's two commands. Each sets up what it needs first (idempotent: a second run re-uses it all).
#   make demo   run the demo release of the bundled model (SmolLM2-135M) on this machine
#   make test   run the test suite (unit + real-component tests: real model, llmcompressor, vLLM, Prefect)
SHELL := /bin/bash
PY := .venv/bin/python
PYTEST_ARGS ?= --durations=20

.PHONY: demo demo-repair test lint setup lmeval mlflow s3 model browser docs docs-env clean-envs release-time gpu-wheels gpu-check

# A release that runs to a REJECT (3) or INCONCLUSIVE (4) decision is a result for the demo, not a failure.
# `.venv` is this checkout's own environment (scripts/setup.sh setup_checkout_env), so its python imports this
# checkout; PYTHONPATH says so once more for a `.venv` left from an older setup (a link to the shared environment).
demo: setup model
	PYTHONPATH=$(CURDIR) $(PY) -m quantgate.cli.main release releases/demo.yaml; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 3 ] || [ $$rc -eq 4 ]

# The demo with a repair rung (docs/repair.md): the INT8 candidate's REJECT, then INT8 again with the layers that cost
# the most KL kept at 16 bits, gated with the same policy. After `make demo` its first rung comes from the cache.
demo-repair: setup model
	PYTHONPATH=$(CURDIR) $(PY) -m quantgate.cli.main release releases/demo-repair.yaml; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 3 ] || [ $$rc -eq 4 ]

# How long the demo takes from cached environments and model, where the time goes, re-run and added-candidate costs,
# the time to verdict against a full release (decide_early: false) and a ladder of two rungs (about 30 min on 2 cores).
RELEASE_TIME_ARGS ?= --full --ladder w4a16-gptq
release-time: setup model
	$(PY) bench/release_time.py $(RELEASE_TIME_ARGS)

# Two passes: the unit tests (not marked slow) in TEST_WORKERS processes (pytest-xdist: they are independent, and two
# processes keep both cores busy through each other's waits), then the real-component tests (slow) one at a time in
# one process, sharing its servers and measured work (they time, kill and count processes, which another test beside
# them would disturb; and two of them side by side oversubscribe the 2 cores' OpenMP threads: two llmcompressor
# quantizations that take 38 s alone each ran over 9 minutes beside each other, on 2026-12-07 on an Intel Xeon; with
# OMP_WAIT_POLICY=PASSIVE two at a time were only 1.2x as fast, each test 1.7x slower: docs/measurements.md).
# A pass that collects no test is not a failure unless neither collects one (exit 5).
TEST_WORKERS ?= 2
test: setup lmeval mlflow s3 model browser lint docs-env
	@$(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) $(PYTEST_ARGS); unit=$$?; \
	 $(PY) -m pytest -m slow $(PYTEST_ARGS); real=$$?; \
	 for rc in $$unit $$real; do [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc; done; \
	 [ $$unit -eq 0 ] || [ $$real -eq 0 ] || { echo "make test: no test was collected"; exit 5; }

# Static checks, before the tests: ruff with the rule set in pyproject.toml ([tool.ruff]), on the package and the flow;
# then mypy on the package ([tool.mypy]), run from the lint environment against the pipeline environment's packages
# (hence `setup` first).
lint: setup
	scripts/setup.sh lint >/dev/null
	.venv-lint/bin/ruff check --quiet quantgate flows
	.venv-lint/bin/mypy --python-executable .venv/bin/python quantgate

# The report/dashboard tests open pages in a real headless Chromium (Debian's package).
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
	  || echo "[setup] chromium missing and not root: the browser tests will skip (apt-get install chromium)"

setup:
	scripts/setup.sh all

# lm-evaluation-harness in its own environment (.venv-lmeval): the `lm_eval:` eval kind runs it as a child process.
# The test suite runs a real lm-eval task, so `make test` builds it; a release builds it on first use.
lmeval:
	scripts/setup.sh lmeval

# An MLflow tracking server in its own environment (.venv-mlflow): the MLflow export test starts a real one.
mlflow:
	scripts/setup.sh mlflow

# An S3 API server in its own environment (.venv-s3, moto's server mode): the work-pools test stores results in it.
s3:
	scripts/setup.sh s3

# The documentation site (mkdocs.yml, docs/) into site/ (git-ignored), from its own environment (.venv-docs, pinned in
# requirements/docs.lock). --strict: a broken link, a missing anchor or a page left out of the nav fails the build.
# Nothing is fetched while it builds. `make test` builds the environment; tests/test_docs_site.py builds the site.
docs: docs-env
	.venv-docs/bin/mkdocs build --strict --site-dir site

docs-env:
	scripts/setup.sh docs >/dev/null

model: setup
	.venv/bin/quantgate models demo >/dev/null

# The GPU path on an NVIDIA machine (scripts/gpu_check.sh): `make gpu-wheels` where PyPI is reachable, then carry
# .gpu-wheels/ with the checkout and run `make gpu-check` there (no network needed; exits 2 without a GPU).
gpu-wheels:
	scripts/gpu_check.sh --prepare

gpu-check:
	scripts/gpu_check.sh

clean-envs:
	rm -rf "$${QUANTGATE_HOME:-$$HOME/.cache/quantgate}/envs" .venv .venv-serve .venv-lmeval .venv-lint .venv-mlflow .venv-s3 .venv-docs

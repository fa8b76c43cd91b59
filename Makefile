# The two commands of the README's Quick start, plus helpers. Everything installs itself into .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
TEST_EXTRAS ?= dev
RUN_EXTRAS ?=
PYTEST_ARGS ?=

.PHONY: run test install install-test broker-up broker-down bench clean

run: install
	$(PY) -m stream_rl.cli.main run $(RUN_ARGS)

test: install-test
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

install:
	VENV=$(VENV) ops/install.sh "$(RUN_EXTRAS)"

install-test:
	VENV=$(VENV) ops/install.sh "$(TEST_EXTRAS)"

broker-up: install
	$(PY) -m stream_rl.cli.main broker up

broker-down:
	$(PY) -m stream_rl.cli.main broker down

clean:
	rm -rf runs .stream-rl .pytest_cache

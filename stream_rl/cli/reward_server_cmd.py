"""``stream-rl reward-server``: serve a reward over HTTP (the protocol of :mod:`stream_rl.rewards.http`) so that
rewards run on their own machines and scale apart from the scorers.

Consumes: what to serve: a built-in reward's short name (the verifiers ``gsm8k``, ``math_boxed``,
``multiple_choice``; ``exact_match``, ``contains_answer``, ``last_number_match``; ``code_tests``), a
``package.module:function`` reference (per rollout, or batch when marked ``batched``), or a reward-model
directory (the scorer's one-label classifier layout, scored on ``prompt + response`` text with its own tokenizer).
Produces: a server on ``--host`` (127.0.0.1 unless told otherwise; an IPv6 address such as ``::1`` is served on
IPv6) and ``--port`` (0: a free one); its URL on stdout as ``reward server serving <what> at <url>`` once it
listens. It answers our protocol and OpenRLHF's remote-reward clients (:mod:`stream_rl.rewards.server`).
Guarantees: a target that cannot be served exits 2 with one line saying why; heavy imports (torch) only for a
reward-model directory; SIGTERM/SIGINT stop it cleanly; the limits of :class:`stream_rl.rewards.server.ServerLimits`
(``--max-connections``, ``--connection-timeout-s``, ``--stuck-after-s``) bound what slow or many clients take.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

from stream_rl.cli.common import fail
from stream_rl.rewards.server import ServerLimits

LOOPBACK = ("127.0.0.1", "::1", "localhost")
_LIMITS = ServerLimits()


def served_scorer(target: str, *, batch_size: int, device: str, dtype: str) -> Any:
    """The batch scoring function for ``target`` (see the module docstring); ValueError when it cannot be served."""
    from stream_rl.rewards.calls import is_batched
    from stream_rl.rewards.names import BUILTIN_NAMES, resolve
    from stream_rl.rewards.server import per_rollout_scorer

    from consumers.scorer.scoring import preflight_rewards

    if target not in BUILTIN_NAMES and Path(target).is_dir():
        return _reward_model_scorer(Path(target), batch_size=batch_size, device=device, dtype=dtype)
    if target not in BUILTIN_NAMES and ":" not in target:
        raise ValueError(f"{target!r} is not a built-in reward ({', '.join(BUILTIN_NAMES)}), "
                         f"a 'module:function' reference or a directory")
    fn = resolve(target)  # the one registry of short names; RewardFnError (a ValueError) names what is wrong
    preflight_rewards([fn])  # code_tests: SandboxUnavailable here, before the port opens
    return fn if is_batched(fn) else per_rollout_scorer(fn, target)


def _reward_model_scorer(path: Path, *, batch_size: int, device: str, dtype: str) -> Any:
    from types import SimpleNamespace

    from consumers.scorer.reward_model import RewardModelScorer

    model = RewardModelScorer.from_dir(path, input_mode="text", dtype=dtype, batch_size=batch_size, device=device)

    def score(prompts, responses, answers, metadatas):  # lists of B -> B floats (or a rollout's Exception)
        ids: list[Any] = []
        for prompt, response in zip(prompts, responses):
            try:
                ids.append(model.token_ids(SimpleNamespace(prompt_text=prompt, response_text=response)))
            except ValueError as exc:
                ids.append(exc)
        good = [i for i in ids if not isinstance(i, Exception)]
        scores = iter(model.scores(good) if good else [])
        return [i if isinstance(i, Exception) else next(scores) for i in ids]

    return score


def reward_server(
        target: Annotated[str, typer.Argument(help="a built-in reward name, 'package.module:function' or a "
                                                   "reward-model directory")],
        host: Annotated[str, typer.Option(help="address to listen on (loopback by default)")] = "127.0.0.1",
        port: Annotated[int, typer.Option(min=0, max=65535, help="port (0: a free one)")] = 0,
        batch_size: Annotated[int, typer.Option(min=1, max=4096, help="rollouts scored per chunk")] = 64,
        parallel: Annotated[int, typer.Option(min=1, max=1024, help="chunks scored at once (1 for a reward model; "
                                                                     "more only for thread-safe functions)")] = 1,
        device: Annotated[str, typer.Option(help="reward model device (cpu, cuda, cuda:N)")] = "cpu",
        dtype: Annotated[str, typer.Option(help="reward model dtype (float32, bfloat16, float16)")] = "float32",
        max_connections: Annotated[int, typer.Option(min=1, help="connections handled at once; one more is answered "
                                                                  "503 and closed")] = _LIMITS.max_connections,
        connection_timeout_s: Annotated[float, typer.Option(min=0.001, help="seconds a client has to send its request, "
                                                                        "and to read the answer")
                                        ] = _LIMITS.connection_timeout_s,
        stuck_after_s: Annotated[float, typer.Option(min=0.001, help="GET /health answers 503 while a scoring call "
                                                                 "has run longer")] = _LIMITS.stuck_after_s,
        openrlhf_fallback: Annotated[float, typer.Option(help="the reward answered to an OpenRLHF client for a "
                                                              "rollout that failed (its reason in 'errors')")] = 0.0,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="print what would be served and exit")] = False,
) -> None:
    """Serve a reward function, built-in reward or reward model over HTTP (POST /, GET /health)."""
    if dry_run:
        typer.echo(f"would serve {target} on {host}:{port} (batch size {batch_size})")
        raise typer.Exit(0)
    from stream_rl.rewards.server import RewardServer

    try:
        limits = ServerLimits(max_connections=max_connections, connection_timeout_s=connection_timeout_s,
                              stuck_after_s=stuck_after_s)
        score = served_scorer(target, batch_size=batch_size, device=device, dtype=dtype)
        server = RewardServer(score, name=target, host=host, port=port, batch_size=batch_size, parallel=parallel,
                              limits=limits, openrlhf_fallback=openrlhf_fallback)
    except (ValueError, OSError) as exc:
        fail(f"reward-server: {exc}", 2)
    if host not in LOOPBACK:
        typer.echo(f"warning: reward-server listens on {host}: reachable from other machines, unauthenticated",
                   err=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    typer.echo(f"reward server serving {target} at {server.url}")
    try:
        server.serve_forever()
    finally:
        server.server_close()

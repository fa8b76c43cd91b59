"""Data-parallel ranks of one trainer: a leader that owns Kafka, followers that mirror its engine calls.

Consumes: the torch.distributed environment that ``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``; ``stream-rl train --nproc N`` runs torch's own elastic launcher, which sets the
same) and ``trainer.collective_timeout_s``.
Produces: :class:`Ranks`: this process's rank, the leader's command channel (:meth:`Ranks.send`,
:meth:`Ranks.receive`) and the collectives a step needs: lockstep micro-batch plans (:meth:`Ranks.chunks`), sums of
row-disjoint tensors (:meth:`Ranks.sum_`), gathers of JSON metrics (:meth:`Ranks.gather_json`) and the gradient
all-reduce (:meth:`Ranks.all_reduce_grads`).

Guarantees:
- One rank (no ``WORLD_SIZE``, or 1): no process group is created and every collective is the identity, so the
  single-process trainer runs exactly the code it ran before ranks existed.
- Effectively-once is the leader's alone: rank 0 consumes, batches, checkpoints and commits; every rank receives
  the step's scored rollouts from it (msgpack, the wire codec), builds the same batch and trains its share of rows.
  Nothing is pickled: a command is an int64 header ``[code, payload bytes]`` plus a uint8 payload tensor.
- Lockstep: in every pass, every rank runs the same number of forwards and backwards (ZeRO-3 gathers parameters
  in each forward, ZeRO-2 reduces in each backward). A rank short of rows runs a *ghost* micro batch: a real row
  of the same minibatch whose loss is multiplied by 0, so it adds nothing to the gradient and is not recorded.
- Bounded: the process group's timeout bounds every collective, so a rank that dies or hangs makes the others
  raise within ``trainer.collective_timeout_s`` (torchrun also stops the whole group as soon as one rank exits
  with an error). An idle leader sends a heartbeat every quarter of that bound, so followers waiting for its next
  command never time out while it waits for rollouts.
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta
from enum import IntEnum
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)


class Command(IntEnum):
    """What the leader asks every rank to do next (the follower's loop dispatches on it)."""

    HEARTBEAT = 0
    STEP = 1  # payload: msgpack {"state": TrainState json, "records": [ScoredRollout record values]}
    WEIGHTS = 2  # gather the policy's full weights (a collective under ZeRO)
    SAVE = 3  # gather weights and optimizer state for a checkpoint
    STOP = 4


class RankFailure(RuntimeError):
    """A collective did not complete: a peer rank died, hung past the timeout or stopped early."""


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the torchrun environment; (0, 1, 0) outside it."""
    return (int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
            int(os.environ.get("LOCAL_RANK", "0")))


class Ranks:
    """This process's place among the trainer's data-parallel ranks (see the module docstring)."""

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0, timeout_s: float = 600.0,
                 backend: str | None = None):
        self.rank, self.world, self.local_rank, self.timeout_s = rank, world, local_rank, timeout_s
        self.backend = backend
        self.device = torch.device("cpu")
        self.broken = False
        self._last_send = time.monotonic()

    @classmethod
    def from_env(cls, timeout_s: float, use_cuda: bool) -> Ranks:
        """The ranks torchrun started; creates the default process group (NCCL on CUDA, else gloo) when world > 1."""
        rank, world, local_rank = env_world()
        if world == 1:
            return cls(timeout_s=timeout_s)
        import torch.distributed as dist

        backend = "nccl" if use_cuda else "gloo"
        ranks = cls(rank, world, local_rank, timeout_s, backend)
        if use_cuda:
            ranks.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(ranks.device)
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        log.info("rank %d of %d (local rank %d, %s)", rank, world, local_rank, backend)
        return ranks

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- the leader's command channel ------------------------------------------------------------------------

    def send(self, command: Command, payload: bytes = b"") -> None:
        """Leader: tell every follower what to do next (no-op with one rank)."""
        if self.world == 1:
            return
        header = torch.tensor([int(command), len(payload)], dtype=torch.int64, device=self.device)
        self._collective(f"send {command.name}", self._broadcast, header)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
            self._collective(f"send {command.name} payload", self._broadcast, data)
        self._last_send = time.monotonic()

    def heartbeat(self) -> None:
        """Leader, while idle: a heartbeat every quarter of the timeout keeps waiting followers from timing out."""
        if self.world > 1 and time.monotonic() - self._last_send > self.timeout_s / 4:
            self.send(Command.HEARTBEAT)

    def receive(self) -> tuple[Command, bytes]:
        """Follower: the leader's next command and its payload (heartbeats are swallowed)."""
        while True:
            header = torch.zeros(2, dtype=torch.int64, device=self.device)
            self._collective("receive", self._broadcast, header)
            code, size = (int(v) for v in header.tolist())
            payload = b""
            if size:
                data = torch.empty(size, dtype=torch.uint8, device=self.device)
                self._collective("receive payload", self._broadcast, data)
                payload = data.cpu().numpy().tobytes()
            if code != Command.HEARTBEAT:
                return Command(code), payload

    # -- the step's collectives ------------------------------------------------------------------------------

    def chunks(self, rows: Tensor, micro_batch_size: int) -> list[tuple[Tensor, bool]]:
        """This rank's micro batches of ``rows`` as ``(index, real)``: every rank gets the same number; ``real``
        is False for a ghost (one real row of ``rows``, to be weighted 0). ``rows`` is split into
        ``world * n`` near-equal contiguous parts with ``n = ceil(len(rows) / (world * micro_batch_size))``;
        rank r takes parts ``r * n .. r * n + n - 1``, none larger than ``micro_batch_size``."""
        n = max(1, -(-len(rows) // (self.world * micro_batch_size)))
        parts = rows.tensor_split(self.world * n)[self.rank * n:(self.rank + 1) * n]
        return [(part, True) if len(part) else (rows[:1], False) for part in parts]

    def sum_(self, tensor: Tensor) -> Tensor:
        """``tensor`` summed over ranks, in place (each rank filled its own rows, zeros elsewhere)."""
        if self.world > 1:
            moved = tensor.to(self.device)
            self._collective("sum", _all_reduce, moved)
            if moved is not tensor:
                tensor.copy_(moved)
        return tensor

    def gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-encodable; NaN allowed), in rank order."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        data = json.dumps(obj).encode()
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world)]
        self._collective("gather sizes", dist.all_gather, sizes,
                         torch.tensor([len(data)], dtype=torch.int64, device=self.device))
        width = max(int(s) for s in sizes)
        mine = torch.zeros(width, dtype=torch.uint8, device=self.device)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(width, dtype=torch.uint8, device=self.device) for _ in range(self.world)]
        self._collective("gather", dist.all_gather, parts, mine)
        return [json.loads(p[:int(s)].cpu().numpy().tobytes()) for p, s in zip(parts, sizes)]

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over ranks (a missing gradient counts as zeros), in one flat buffer."""
        if self.world == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self._collective("gradient all-reduce", _all_reduce, flat)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    # -- plumbing --------------------------------------------------------------------------------------------

    def _broadcast(self, tensor: Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(tensor, src=0)

    def _collective(self, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except (RuntimeError, ValueError) as exc:  # gloo/NCCL raise RuntimeError (DistBackendError) on a lost peer
            self.broken = True
            raise RankFailure(f"trainer rank {self.rank} of {self.world}: {what} failed ({exc.__class__.__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}): a peer rank died, hung "
                              f"past trainer.collective_timeout_s={self.timeout_s:g} or stopped") from exc

    def close(self, together: bool = False) -> None:
        """Tear the process group down. ``together``: every rank is closing at this point of the protocol (after
        ``STOP``), so they first meet at a barrier: gloo aborts a rank ("terminate called without an active
        exception") whose peer tore its connections down while it was still closing its own. Not on an error path,
        where a peer may be inside another collective."""
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized() and not self.broken:
                try:
                    if together:
                        dist.barrier()
                except (RuntimeError, ValueError):
                    self.broken = True
                    return
                dist.destroy_process_group()


def _all_reduce(tensor: Tensor) -> None:
    import torch.distributed as dist

    dist.all_reduce(tensor)


SOLO = Ranks()
"""The single-process trainer's ranks (world 1): every collective is the identity."""

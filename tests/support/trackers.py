"""Reading back what the experiment trackers wrote, each with its own library's reader.

- TensorBoard: ``EventAccumulator`` (purged events of a restarted writer are hidden, as TensorBoard shows them);
- MLflow: ``MlflowClient`` against the store the tracker wrote;
- W&B: the offline run's ``.wandb`` files, decoded into W&B's own protobuf ``Record`` messages
  (:func:`stream_rl.telemetry.trackers.wandb_backend.read_records`: wandb 0.2x dropped its Python datastore reader).
Each returns ``{metric: {step: [values...]}}``: a list per step, so a duplicated step shows as two values.
"""

from __future__ import annotations

import glob
import json
import os
from collections import defaultdict
from pathlib import Path


def tensorboard_scalars(tracker_dir: Path) -> dict[str, dict[int, list[float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(tracker_dir) / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    out: dict[str, dict[int, list[float]]] = {}
    for tag in acc.Tags()["scalars"]:
        per: dict[int, list[float]] = defaultdict(list)
        for ev in acc.Scalars(tag):
            per[ev.step].append(ev.value)
        out[tag] = dict(per)
    return out


def tensorboard_texts(tracker_dir: Path, tag: str) -> dict[int, str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(tracker_dir) / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    return {ev.step: ev.tensor_proto.string_val[0].decode() for ev in acc.Tensors(f"{tag}/text_summary")}


def mlflow_client(tracker_dir: Path):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=(Path(tracker_dir) / "mlruns").resolve().as_uri())


def mlflow_run_id(tracker_dir: Path) -> str:
    return json.loads((Path(tracker_dir) / "mlflow.json").read_text())["run_id"]


def mlflow_scalars(tracker_dir: Path) -> dict[str, dict[int, list[float]]]:
    client, run_id = mlflow_client(tracker_dir), mlflow_run_id(tracker_dir)
    out: dict[str, dict[int, list[float]]] = {}
    for key in client.get_run(run_id).data.metrics:
        per: dict[int, list[float]] = defaultdict(list)
        for m in client.get_metric_history(run_id, key):
            per[m.step].append(m.value)
        out[key] = dict(per)
    return out


def wandb_records(tracker_dir: Path) -> list:
    from stream_rl.telemetry.trackers.wandb_backend import read_records

    records = []
    for path in sorted(glob.glob(str(Path(tracker_dir) / "wandb" / "offline-run-*" / "run-*.wandb"))):
        records += list(read_records(Path(path)))
    return records


def wandb_scalars(tracker_dir: Path) -> dict[str, dict[int, list[float]]]:
    out: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rec in wandb_records(tracker_dir):
        if rec.WhichOneof("record_type") != "history":
            continue
        step = int(rec.history.step.num)
        for item in rec.history.item:
            key = item.key or "/".join(item.nested_key)
            if key.startswith("_"):
                continue
            value = json.loads(item.value_json)
            if isinstance(value, (int, float)):
                out[key][step].append(float(value))
    return {k: dict(v) for k, v in out.items()}


READERS = {"tensorboard": tensorboard_scalars, "mlflow": mlflow_scalars, "wandb": wandb_scalars}


def every_file_bytes(root: Path) -> bytes:
    """The bytes of every file under ``root`` (to prove a value appears nowhere)."""
    return b"".join(p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file())


def wandb_finished(tracker_dir: Path) -> bool:
    """The newest W&B session's file ends with its exit record (W&B's service finishes the file after
    ``run.finish()`` returns)."""
    from stream_rl.telemetry.trackers.wandb_backend import read_records

    sessions = sorted(glob.glob(str(Path(tracker_dir) / "wandb" / "offline-run-*" / "run-*.wandb")))
    records = list(read_records(Path(sessions[-1]))) if sessions else []
    return bool(records) and records[-1].WhichOneof("record_type") == "exit"


def read_back(name: str, tracker_dir: Path) -> dict[str, dict[int, list[float]]]:
    """:data:`READERS` ``[name]``, once a W&B run's file is complete."""
    if name == "wandb":
        from support.waiting import wait_for

        wait_for(lambda: wandb_finished(tracker_dir), "the W&B run's exit record")
    return READERS[name](tracker_dir)

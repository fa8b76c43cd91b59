"""The base class of every config section (kept apart so role packages can define their sections), and the
device setting every role that runs a model shares."""

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"
"""What a role's ``device`` setting accepts: ``auto`` (resolved by :func:`stream_rl.models.devices.resolve_device`:
CUDA when torch sees a GPU, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""


class Section(BaseModel):
    """A config section: unknown fields are errors, assignments are validated, and a field listed in ``REMOVED``
    is refused with its own message (what replaced it) instead of the generic unknown-field error."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    REMOVED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, message in cls.REMOVED.items():
                if name in data:
                    raise ValueError(message)
        return data

"""The base class of every config section (kept apart so role packages can define their sections)."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown fields are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

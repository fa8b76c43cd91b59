"""The ``[data]`` section: how prompt files are read and how conversational prompts are rendered for the policy.

Consumes: values validated by pydantic. Produces: :class:`DataConfig`, read by the prompt loader
(``stream-rl prompts validate | load``, ``stream-rl run``) and by producers running multi-turn environments (which
continue a conversation on the same chat template).
Guarantees: every field has a description and bounds; nothing is imported from transformers here.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from stream_rl.config.base import Section


class DataConfig(Section):
    """Prompt files as users have them (plain text, verl or TRL layouts) and the chat template that renders them."""

    chat_template: str = Field(
        "auto", min_length=1,
        description="how a conversational prompt (messages) becomes the policy's text: 'auto' uses the policy "
        "tokenizer's own chat template (a tokenizer without one is refused when the file is validated), 'none' "
        "refuses conversational prompts, anything else is the path of a Jinja file that overrides the model's")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="extra variables passed to the chat template (e.g. {enable_thinking = false} for Qwen3)")
    prompt_key: str | None = Field(
        None, min_length=1, description="column holding the prompt (text or messages); None: detected "
        "(text, messages, or prompt as in verl and TRL)")
    answer_key: str | None = Field(
        None, min_length=1, description="column holding the reference answer (dotted for a nested field, e.g. "
        "reward_model.ground_truth); None: detected (answer, solution, label, reward_model.ground_truth)")
    id_key: str | None = Field(
        None, min_length=1, description="column holding the prompt id; None: prompt_id when present, else the "
        "line or row number")
    metadata_keys: list[str] | None = Field(
        None, description="columns copied into the prompt's string tags (nested values flattened to dotted keys); "
        "None: metadata, data_source, ability and extra_info when present")
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="a prompt with more tokens (a conversational one counted by its rendered ids) is "
        "dropped at validate/load time as too_many_tokens, naming its line (--max-tokens overrides it); None: only "
        "the producer's length check (prompt + max_new_tokens <= the model's length)")

    @field_validator("metadata_keys")
    @classmethod
    def _keys_nonempty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not key for key in value):
            raise ValueError("metadata_keys must not contain an empty name")
        return value

"""A tiny chat policy for the tests: the product's (:mod:`stream_rl.demo.chat_model`, also written by
``stream-rl demo chat-model DIR``), re-exported under the names the tests use."""

from __future__ import annotations

from stream_rl.demo.chat_model import build_chat_model_dir, chat_llama_config

__all__ = ["build_chat_model_dir", "chat_llama_config"]

"""statechat: a chat app and server for Qwen3.5 hybrid models that never pays twice for a prefix."""

from __future__ import annotations

__version__ = "0.1.0"

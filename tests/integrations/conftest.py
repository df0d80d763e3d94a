"""The trainer adapters run against the same live stack as the harnesses (tests/harnesses):
a real server on a real port, the real Qwen3 tokenizer, the engine double sampling."""

from tests.harnesses.conftest import double

__all__ = ["double"]

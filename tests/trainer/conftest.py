"""The session-package stack (a real server on a loopback port, both stores, the engine
double) for the trainer-facing API."""

from tests.engine_double import _engine_double_pool, engine_double, engine_doubles
from tests.session.conftest import memory_stack, qwen3_model, stack

__all__ = [
    "_engine_double_pool",
    "engine_double",
    "engine_doubles",
    "memory_stack",
    "qwen3_model",
    "stack",
]

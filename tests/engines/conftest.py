from tests.engine_double import _engine_double_pool, engine_double, engine_doubles
from tests.vllm_fixture import vllm_engine

__all__ = ["_engine_double_pool", "engine_double", "engine_doubles", "vllm_engine"]

from tests.engine_double import _engine_double_pool, engine_double, engine_doubles
from tests.engine_double_sglang import _sglang_double, sglang_double
from tests.vllm_fixture import vllm_engine

__all__ = [
    "_engine_double_pool",
    "_sglang_double",
    "engine_double",
    "engine_doubles",
    "sglang_double",
    "vllm_engine",
]

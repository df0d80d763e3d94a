"""A replica that comes back from being down is compared with this server's tokenizer again
before it serves (`session_server/tokenizer_match.py`, via the replica set's unverified hook):
an engine restarted on another model's tokenizer gets no turns. Against the engine double (its
`/tokenize` answers with a real tokenizer: Qwen3's, then Llama 3.2's); the first comparison
at start-up is checked against the real vLLM CPU engine in
tests/integration/test_tokenizer_match_vllm.py."""

from __future__ import annotations

import pytest

from session_server.engines import EngineClient, EngineError
from session_server.tokenizer import load_tokenizer
from session_server.tokenizer_match import TokenizerProbe
from tests.engine_double import EngineDouble, ScriptedCompletion
from tests.real_tokenizers import llama32_dir, qwen3_dir

PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
SAMPLING = {"temperature": 0.6, "max_tokens": 8}


async def test_a_replica_back_with_another_tokenizer_is_refused(
    engine_double: EngineDouble,
) -> None:
    qwen3 = load_tokenizer(str(qwen3_dir()))
    engine_double.tokenize = qwen3.encode
    engine_double.default = lambda prompt, sampling: ScriptedCompletion([9707, 151645])
    probe = TokenizerProbe.of(qwen3)
    async with EngineClient(
        [engine_double.url], model=engine_double.model, health_interval_s=60, tokenizer_probe=probe
    ) as client:
        [replica] = client.replicas
        assert replica.tokenizer_differs is None
        assert (await client.generate("s", PROMPT, SAMPLING)).engine_url == engine_double.url

        engine_double.healthy = False  # restarting...
        await client.check_health()
        with pytest.raises(EngineError) as down:
            await client.generate("s", PROMPT, SAMPLING)
        # Down and not yet compared: the retryable "no engine ready", not a mismatch.
        assert (down.value.status, down.value.type) == (503, "EngineUnavailable")

        engine_double.tokenize = load_tokenizer(str(llama32_dir())).encode  # ...on another model
        engine_double.healthy = True
        await client.check_health()
        with pytest.raises(EngineError) as refused:
            await client.generate("s", PROMPT, SAMPLING)
        assert (refused.value.status, refused.value.type) == (503, "TokenizerMismatch")
        assert replica.refused is not None and replica.refused.startswith("tokenizer mismatch")
        generated = [r for r in engine_double.requests if r.path.endswith("generate")]
        assert len(generated) == 1  # nothing reached the engine once it differed

        engine_double.tokenize = qwen3.encode  # fixed: the next round lets it serve again
        await client.check_health()
        assert (await client.generate("s", PROMPT, SAMPLING)).engine_url == engine_double.url


def test_the_probe_text_holds_special_tokens_and_template_markers() -> None:
    qwen3 = load_tokenizer(str(qwen3_dir()))
    probe = TokenizerProbe.of(qwen3)
    assert "<|im_start|>" in probe.text and "<|endoftext|>" in probe.text
    assert 151644 in probe.token_ids  # <|im_start|> as one special id, not its pieces
    assert probe.difference(probe.token_ids) is None
    other = probe.difference([*probe.token_ids[:3], 7])
    assert other is not None and "first different at 3" in other

"""The engine double (tests/engine_double.py, a TEST DOUBLE of vLLM: no real engine can be
killed and restarted in seconds on this machine) as its own process, so that a test can kill
it with SIGKILL like a crashed engine pod.

Every request is answered after `--latency-ms` with a short Qwen3 reply that names the prompt
length (so replies differ from turn to turn), ending with <|im_end|>; streams send one chunk
per token with `--chunk-ms` between them.

    python -m tests.reliability.engine_proc --port P [--latency-ms 20] [--chunk-ms 5]
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from tokenizers import Tokenizer

from tests.engine_double import EngineDouble, ScriptedCompletion
from tests.real_tokenizers import qwen3_dir

_TOKENIZER = Tokenizer.from_file(str(qwen3_dir() / "tokenizer.json"))
_IM_END = _TOKENIZER.token_to_id("<|im_end|>")


def _answer(prompt_ids: list[int], _sampling: dict[str, Any]) -> ScriptedCompletion:
    text = f"Noted, {len(prompt_ids)} tokens so far."
    return ScriptedCompletion([*_TOKENIZER.encode(text, add_special_tokens=False).ids, _IM_END])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--latency-ms", type=float, default=20)
    parser.add_argument("--chunk-ms", type=float, default=5)
    args = parser.parse_args()
    double = EngineDouble(
        port=args.port,
        default=_answer,
        latency_s=args.latency_ms / 1000,
        chunk_delay_s=args.chunk_ms / 1000,
    )
    double.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("ready", flush=True)
    stop.wait()
    double.stop()


if __name__ == "__main__":
    main()

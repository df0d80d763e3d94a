"""What tokenkeep adds to a vLLM engine, shipped into the engine's environment as the top-level
module `tokenkeep_vllm` (`localengine.start` and the engine image, `images/build.py`; the
ModelServer pods run that image). Nothing here imports tokenkeep: it runs inside vLLM's API
server and worker processes, next to vLLM's own packages.

- `EngineKey` (`--middleware tokenkeep_vllm.EngineKey`): with `TOKENKEEP_ENGINE_KEY` set, every
  request but the health probes needs `Authorization: Bearer <key>`. vLLM's own `--api-key`
  guards only `/v1`, `/v2`, `/inference` and `/cohere`: the development endpoints a policy
  publish uses (`/pause`, `/collective_rpc`, `/update_weight_version`, ...) would stay open to
  anyone who reaches the pod.
- `TiedReload` (`--worker-extension-cls tokenkeep_vllm.TiedReload`): in-place weight reloads
  that are exact for models with tied embeddings.

vLLM 0.32's `reload_weights` reloads layer by layer. A model whose output layer is its
embedding (`tie_word_embeddings`, like the tiny Qwen3) has no `lm_head.weight` in its
checkpoint: the reload logs "ParallelLMHead: Failed to load weights" and puts that layer's
OLD tensor back, and the tensor is shared with the embedding, so the embedding goes back to
the old weights too. On the CPU there is a second copy: the output layer's GEMM runs on a
packed copy of its weight (oneDNN / sgl-kernel, made by `process_weights_after_loading`),
which a write into `lm_head.weight` does not reach. Measured: the engine's logprobs drifted
from the trainer's by 0.2-0.7 nats after a few steps while every other layer moved.
`reload_weights_tied` reloads, copies the checkpoint's embedding into the (shared)
embedding and output layer, and repacks the output layer.
"""

from __future__ import annotations

import hmac
import json
import os
from pathlib import Path
from typing import Any

KEY_VARIABLE = "TOKENKEEP_ENGINE_KEY"
# What a kubelet or a load balancer probes, and what Prometheus scrapes, without credentials;
# they change nothing (SGLang's --api-key leaves the same paths open).
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})


class EngineKey:
    """ASGI middleware: refuse (401, vLLM's error shape) any request without the engine key,
    on every path but the health probes and /metrics. Without `TOKENKEEP_ENGINE_KEY` it lets
    all through (a local engine bound to 127.0.0.1)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        key = os.environ.get(KEY_VARIABLE, "")
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            self.expected is None
            or scope["type"] not in ("http", "websocket")
            or scope.get("path") in OPEN_PATHS
        ):
            await self.app(scope, receive, send)
            return
        presented = b""
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                presented = value
                break
        if hmac.compare_digest(presented, self.expected):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps(
            {
                "error": {
                    "message": "this engine needs its key (Authorization: Bearer ...)",
                    "type": "Unauthorized",
                    "param": None,
                    "code": 401,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class TiedReload:
    """Mixed into vLLM's worker class; `self` is the worker (no attribute here may share a
    name with the worker's: vLLM refuses the extension)."""

    model_runner: Any
    model_config: Any
    reload_weights: Any

    def reload_weights_tied(self, weights_path: str) -> dict[str, Any]:
        import torch
        from safetensors import safe_open

        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        tied = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))
        if not tied:
            return {"weights_path": weights_path, "tied": False, "lm_head_vs_checkpoint": None}
        embedding = None
        for path in sorted(Path(weights_path).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
                    if name.endswith("embed_tokens.weight"):
                        embedding = f.get_tensor(name)
        if embedding is None:
            raise ValueError(f"no embed_tokens.weight under {weights_path}")
        rows = embedding.shape[0]
        with torch.no_grad():
            for layer in (model.model.embed_tokens, model.lm_head):
                layer.weight.data[:rows].copy_(embedding.to(layer.weight.dtype))
        # Re-dispatch the logits GEMM so its packed weight is the new one.
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
        gap = float((model.lm_head.weight.data[:rows].float() - embedding.float()).abs().max())
        return {"weights_path": weights_path, "tied": True, "lm_head_vs_checkpoint": gap}

    def weight_sums(self) -> dict[str, float]:
        """Each parameter's sum (float64): a cheap fingerprint to compare with a checkpoint."""
        model = self.model_runner.get_model()
        return {name: float(p.data.double().sum()) for name, p in model.named_parameters()}

"""A vLLM worker extension (`--worker-extension-cls`) for in-place weight reloads of models
with tied embeddings. It runs inside vLLM's worker processes, in the engine's environment:
`localengine.start(dev_mode=True)` copies this file there as a top-level module.

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

from pathlib import Path
from typing import Any


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

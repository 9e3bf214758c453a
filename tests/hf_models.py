"""Small randomly initialised Hugging Face models, saved to disk, for oracle tests.

transformers is the independent reference: our loader reads what
``save_pretrained`` wrote and our engine must reproduce its logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers

torch.set_num_threads(1)


def _drelu_forward(mlp):
    """transformers has no dReLU MLP; patch LlamaMLP/MistralMLP/Qwen2MLP.forward to compute it."""

    def forward(x):
        return mlp.down_proj(torch.relu(mlp.gate_proj(x)) * torch.relu(mlp.up_proj(x)))

    return forward


def _drelu_experts_forward(experts):
    """The same for MixtralExperts (``relu(gate) * relu(up)`` in each routed expert): TurboSparse-Mixtral."""

    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for token, slot in zip(*torch.where(top_k_index >= 0)):
            e = top_k_index[token, slot]
            gate, up = torch.nn.functional.linear(hidden_states[token], experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(torch.relu(gate) * torch.relu(up), experts.down_proj[e])
            out[token] += y * top_k_weights[token, slot]
        return out

    return forward


def _randomize(model, seed: int, embedding_std: float = 0.2) -> None:
    """Larger-than-default random weights so every path (biases, norms) matters in the logits; the token embedding's
    of standard deviation ``embedding_std``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                std = embedding_std if name.endswith("embed_tokens.weight") else 0.2
                p.copy_(std * torch.randn(p.shape, generator=gen))


def build(
    folder: Path,
    family: str,
    *,
    seed: int = 0,
    config_overrides: dict | None = None,
    drelu: bool = False,
    saved_model_type: str | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    embedding_std: float = 0.2,
):
    """Create, randomise and save a model; return the torch model (float32) that matches the saved weights.

    ``drelu`` patches the MLP to dReLU and marks the saved config so our loader
    reads it as dReLU (``hidden_act: drelu``, or ``saved_model_type='bamboo'``).
    ``embedding_std``: the token embedding's spread (a tied Gemma's, scaled by sqrt(d_model) on the way in,
    otherwise outweighs the rest of the stream, and greedy decoding repeats its last token).
    """
    torch.manual_seed(seed)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),  # q/k/v biases: randomised too
        "opt": (transformers.OPTConfig, transformers.OPTForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),  # norms randomised around 2
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),  # norms randomised around 2
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),  # per-head q/k norms randomised too
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),  # fused qkv_proj and gate_up_proj
    }[family]
    config = config_cls(**(config_overrides or {}))
    model = model_cls(config).eval()
    _randomize(model, seed, embedding_std)
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    # The reference is what transformers itself loads from the folder, in float32:
    # casting the in-memory model back would keep buffers (rotary inv_freq) rounded to half precision.
    model = model_cls.from_pretrained(folder, dtype=torch.float32).eval()
    if drelu:
        for layer in model.model.layers:
            if family == "mixtral":
                layer.mlp.experts.forward = _drelu_experts_forward(layer.mlp.experts)
            else:
                layer.mlp.forward = _drelu_forward(layer.mlp)
        path = Path(folder) / "config.json"
        saved = json.loads(path.read_text())
        if saved_model_type:
            saved["model_type"] = saved_model_type
        else:
            saved["hidden_act"] = "drelu"
        path.write_text(json.dumps(saved, indent=2))
    return model


def reference_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor(tokens[None, :], dtype=torch.long), use_cache=False)
    return out.logits[0].double().numpy()

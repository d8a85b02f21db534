"""The named model shapes (presets) and the check of a config's overrides of them.

Why a module of its own, free of torch: the config validates `train.sft.shape` / `reward.sft.shape` when it
is loaded, so that a shape no model can have (a negative head count, a hidden size the heads do not divide)
or one this machine cannot hold is one clear line naming the field, not a traceback from deep inside the
bootstrap's first tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pivotrl.errors import FieldError

# Qwen2-style shapes (GQA, SwiGLU, RMSNorm, RoPE, q/k/v bias, tied embeddings like Qwen2.5-0.5B).
# debug ≈ 1.0M parameters (unit tests), small ≈ 12.6M (quickstart, benchmarks).
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "debug": dict(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    ),
    "small": dict(
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    ),
    # ~64 M parameters: the larger policy of `benchmarks.train_step` (the train barrier at a size where the
    # optimizer step and the publish, not the round trips, dominate).
    "medium": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=10,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ),
}

#: The most parameters a bootstrap model may have: it is trained from scratch on this machine's CPU, with
#: weights, gradients and AdamW moments in fp32 (16 bytes a parameter, 16 GB at this bound).
MAX_BOOTSTRAP_PARAMETERS = 1_000_000_000
#: RoPE's tables and the engine's KV cache are sized by the context; beyond this a model is not "tiny".
MAX_POSITIONS = 1 << 17
#: Rough bound on the vocabulary (the character tokenizer and the small chat tokenizers are far below it).
VOCAB_BOUND = 1024


def check_shape(base: str, shape: Mapping[str, Any]) -> None:
    """Raise `FieldError` (a ValueError) naming ``<key>``, a field of ``shape``, when the preset ``base``
    with ``shape``'s overrides is no model: an unknown field, a size below 1, heads that do not divide the
    hidden size or key/value heads that do not divide the heads, an odd head size (RoPE rotates pairs),
    more than `MAX_POSITIONS` positions, or more than `MAX_BOOTSTRAP_PARAMETERS` parameters."""
    preset = MODEL_SIZES[base]
    for key, value in shape.items():
        if key not in preset:
            raise FieldError("", key, f"unknown field; choose from {', '.join(preset)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FieldError("", key, f"a whole number >= 1 is wanted, got {value!r}")
    dims = {**preset, **shape}
    hidden, heads, kv = dims["hidden_size"], dims["num_attention_heads"], dims["num_key_value_heads"]
    culprit = next((k for k in ("num_attention_heads", "hidden_size") if k in shape), "num_attention_heads")
    if hidden % heads:
        raise FieldError("", culprit, f"{heads} heads do not divide hidden_size {hidden}")
    if (hidden // heads) % 2:
        raise FieldError("", culprit, f"the head size hidden_size / num_attention_heads = {hidden // heads} "
                         "must be even (RoPE rotates pairs)")
    if heads % kv:
        which = "num_key_value_heads" if "num_key_value_heads" in shape else "num_attention_heads"
        raise FieldError("", which, f"{kv} key/value heads do not divide {heads} attention heads")
    if dims["max_position_embeddings"] > MAX_POSITIONS:
        got = dims["max_position_embeddings"]
        raise FieldError("", "max_position_embeddings", f"at most {MAX_POSITIONS}, got {got}")
    layers, inter, head = dims["num_hidden_layers"], dims["intermediate_size"], hidden // heads
    per_layer = hidden * (2 * hidden + 2 * kv * head) + 3 * hidden * inter + 2 * hidden
    params = VOCAB_BOUND * hidden + layers * per_layer
    if params > MAX_BOOTSTRAP_PARAMETERS:
        big = max(shape, key=lambda k: shape[k] / preset[k])
        raise FieldError("", big, f"this shape has about {params / 1e9:.1f}B parameters; a bootstrap model "
                         f"trains on the CPU here and may have at most {MAX_BOOTSTRAP_PARAMETERS / 1e9:.0f}B")

"""Per-layer sliding windows as megatron-core configures them (issue 15 item 1).

megatron-core's ``TransformerConfig.window_size`` (flash-attn's ``(left, right)``; HSAP plans are
causal, so ``right`` is 0) applies to the layers ``megatron.core.transformer.utils.
is_layer_window_attention(window_size, window_attn_skip_freq, layer_number)`` selects: every layer
when ``window_attn_skip_freq`` is None, all but every N-th for an int N, or a 0/1 list per layer
(Gemma/GPT-OSS patterns). Each distinct window gets one plan of the batch, all on the layout of
the full-attention plan (``Plan.with_window``): the batch is sharded once.
"""

from __future__ import annotations

from typing import Any

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.window import normalize_window

__all__ = ["layer_window", "model_windows"]


def layer_window(config: Any, layer_number: int) -> tuple[int, int] | None:
    """The normalised window of layer ``layer_number`` (1-based, as Megatron counts), or None."""
    from megatron.core.transformer.utils import is_layer_window_attention

    window = getattr(config, "window_size", None)
    if not is_layer_window_attention(window, getattr(config, "window_attn_skip_freq", None), layer_number):
        return None
    try:
        return normalize_window(tuple(window))
    except ConfigError as err:
        raise ConfigError(f"--window-size {window} (TransformerConfig.window_size): {err}") from None


def model_windows(config: Any) -> tuple[tuple[int, int] | None, ...]:
    """The distinct windows of the model's layers (None: full attention), in layer order."""
    out: dict[tuple[int, int] | None, None] = {}
    for layer in range(1, int(config.num_layers) + 1):
        out[layer_window(config, layer)] = None
    return tuple(out)

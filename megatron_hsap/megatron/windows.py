"""Per-layer sliding windows as megatron-core configures them (issue 15 item 1).

megatron-core's ``TransformerConfig.window_size`` (flash-attn's ``(left, right)``; HSAP plans are
causal, so ``right`` is 0) applies to the layers ``megatron.core.transformer.utils.
is_layer_window_attention(window_size, window_attn_skip_freq, layer_number)`` selects: every layer
when ``window_attn_skip_freq`` is None, all but every N-th for an int N, or a 0/1 list per layer
(Gemma/GPT-OSS patterns). Each distinct window gets one plan of the batch, all on the layout of
the full-attention plan (``shared_layout.compile_on_layout``): the batch is sharded once.
"""

from __future__ import annotations

from typing import Any

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.window import normalize_window

__all__ = ["layer_window", "model_windows", "megatron_window", "LOOK_AHEAD_HINT"]

# What a model with look-ahead windows (right > 0: bidirectional or prefix layers) can do instead.
LOOK_AHEAD_HINT = (
    "HSAP plans causal windows only (token i sees keys [i - left, i]); for layers that look ahead use "
    "--context-parallel-impl ring with --cp-comm-type a2a or all_gather (Transformer Engine's context "
    "parallelism accepts windows with those two types), or make the window causal: --window-size (LEFT,0)"
)


def megatron_window(window: Any) -> tuple[int, int] | None:
    """``--window-size`` (``TransformerConfig.window_size``) normalised as the planner takes it, or
    ``ConfigError`` naming the flag; a look-ahead window (``right > 0``) also gets :data:`LOOK_AHEAD_HINT`."""
    if window is None:
        return None
    try:
        return normalize_window(tuple(window))
    except (ConfigError, TypeError) as err:
        hint = ""
        if isinstance(window, (tuple, list)) and len(window) == 2 and isinstance(window[1], int) and window[1] > 0:
            hint = f". {LOOK_AHEAD_HINT}"
        raise ConfigError(f"--window-size {window} (TransformerConfig.window_size): {err}{hint}") from None


def layer_window(config: Any, layer_number: int) -> tuple[int, int] | None:
    """The normalised window of layer ``layer_number`` (1-based, as Megatron counts), or None."""
    from megatron.core.transformer.utils import is_layer_window_attention

    window = getattr(config, "window_size", None)
    if not is_layer_window_attention(window, getattr(config, "window_attn_skip_freq", None), layer_number):
        return None
    return megatron_window(window)


def model_windows(config: Any) -> tuple[tuple[int, int] | None, ...]:
    """The distinct windows of the model's layers (None: full attention), in layer order."""
    out: dict[tuple[int, int] | None, None] = {}
    for layer in range(1, int(config.num_layers) + 1):
        out[layer_window(config, layer)] = None
    return tuple(out)

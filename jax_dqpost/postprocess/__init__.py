"""FlashAttention's backward postprocess as a JAX op: its public entry points (``api.py``: ``dq_postprocess``,
``flash_attention_postprocess``, ``dq_accum_from_dq``, ``Gradients``), their arguments checked and made the op's
operands (``arguments.py``), and the primitive with every rule, its plan, its jax.numpy reference, its CUDA lowering
and the FFI target (``_primitive/``; ``_primitive/backward.py`` is the op for the package's own attention)."""

from .api import Gradients, dq_accum_from_dq, dq_postprocess, flash_attention_postprocess

__all__ = ["dq_postprocess", "flash_attention_postprocess", "Gradients", "dq_accum_from_dq"]

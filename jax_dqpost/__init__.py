"""jax-dqpost: attention with learnable sinks that JAX users call, FlashAttention-4 on GPUs finished by FlashAttention's
backward postprocess as JAX primitives.

``dot_product_attention`` is ``jax.nn.dot_product_attention`` with ``sinks`` (one learnable logit per query head, as
gpt-oss has) and ``implementation='fa4'``: FlashAttention-4's kernels where they run the call, jax.numpy elsewhere
(``'xla'``). ``flax_attention_fn`` is the same as flax's ``attention_fn``. Its ``context_axis`` shards the sequence
over a ``jax.shard_map`` axis (context parallelism); ``zigzag`` and ``unzigzag`` order a sequence for its
load-balanced layout.

``dq_postprocess`` turns the fp32 dQ accumulator written by FlashAttention's backward kernels (in their
MMA accumulator order, described by ``AccumLayout``) into dQ in bf16/fp16: one fp32 multiply by the
softmax scale and one round-to-nearest-even; it returns one array. ``flash_attention_postprocess`` does dQ, dK and
dV (grouped-query attention) and the learnable sink's gradient in one launch; it returns ``Gradients(dq, dk, dv,
dsink)``, None where a member was not computed. On CUDA they run CuTe DSL kernels through our own
XLA FFI target; on every other platform, a bit-identical jax.numpy reference.
"""

from .postprocess._primitive import ffi as _ffi
from .postprocess._primitive.ffi import DISABLED_CHECKS
from ._version import __version__
from .postprocess import Gradients, dq_accum_from_dq, dq_postprocess, flash_attention_postprocess
from ._kernel.arch import cuda_arch
from .attention import dot_product_attention, flax_attention_fn, unzigzag, zigzag
from .layout import AccumLayout

_ffi.register_at_import()  # where jax has a CUDA plugin: artifacts exported with our calls find their handler

__all__ = ["dot_product_attention", "flax_attention_fn", "zigzag", "unzigzag", "dq_postprocess",
           "flash_attention_postprocess", "Gradients", "dq_accum_from_dq", "AccumLayout", "cuda_arch",
           "DISABLED_CHECKS", "__version__"]  # in the order docs/api.md presents them

"""jax-dqpost: FlashAttention's backward dQ postprocess as a JAX primitive.

``dq_postprocess`` turns the fp32 dQ accumulator written by FlashAttention's backward kernels (in their
MMA accumulator order, described by ``AccumLayout``) into dQ in bf16/fp16: one fp32 multiply by the
softmax scale and one round-to-nearest-even. On CUDA it runs a CuTe DSL kernel through our own XLA FFI
target; on every other platform, a bit-identical jax.numpy reference.
"""

from ._version import __version__
from .api import dq_accum_from_dq, dq_postprocess
from .arch import cuda_arch
from .layout import AccumLayout

__all__ = ["AccumLayout", "__version__", "cuda_arch", "dq_accum_from_dq", "dq_postprocess"]

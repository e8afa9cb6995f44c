"""The JAX op: the primitive ``postprocess_p`` and every rule of it (``rules``), its one parameter, the call's
:class:`~.plan.Plan`, its lowerings (``reference``: jax.numpy, every platform but CUDA; ``cuda_lowering``: one
custom call carrying the compiled kernel) and the XLA FFI target that call names (``ffi``: registered at ``import
jax_dqpost``)."""

"""The benchmark of the postprocess on the local GPU, run from the repository root (README.md here says how).

``__main__`` is the benchmark (``python -m benchmarks``), ``fa4jax`` the fa4-jax backward; ``cases`` holds the
problems and the implementations timed side by side, ``fused`` those of the fused op, ``devices`` the multi-GPU
comparison, ``harness`` the timing and the GPU timeline helpers (every script here uses them), ``probes`` the
overheads around the kernel, ``report`` the tables and the plot, ``internals`` the private APIs of jax_dqpost the
others use. ``ncu_kernels`` and ``probe_timeline`` take kernel-level and timeline evidence for the report's gaps.
"""

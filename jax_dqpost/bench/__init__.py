"""The benchmark of the dQ postprocess on the local GPU (``python -m jax_dqpost.bench``; ``__main__.py``).

``cases`` holds the problems and the implementations timed side by side, ``harness`` the timing and the GPU
timeline helpers (public: ``tools/`` uses them), ``probes`` the overheads around the kernel, ``report`` the
tables and the plot.
"""

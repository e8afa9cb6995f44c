"""The CUDA kernel and how it is compiled: which kernel a call compiles (``spec``), for which GPU (``arch``), by
which build of the CuTe DSL (``cute_runtime``), once (``cache``, in memory and on disk; ``precompile``, ahead of
time); the kernel itself (``kernel``: the entry and the sink gradient; ``schedule``: which tile a CTA converts;
``tile``: the conversion; ``fragments``: where an MMA fragment puts each value); and what the kernel and the JAX side
share: the calling convention (``abi``) and the varlen work list (``varlen``). ``kernel``, ``schedule`` and ``tile``
import cutlass: ``cache`` imports them lazily."""

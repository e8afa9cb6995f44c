"""The CUDA kernel and how it is compiled: which kernel a call compiles (``spec``) and with which tuning
(``tuning``, which also lists every kernel a call may choose), for which GPU (``arch``), by which build of the CuTe
DSL (``cute_runtime``), once (``cache``, in memory and on disk); the kernel itself (``kernel``: the entry and the
sink gradient; ``schedule``: which tile a CTA converts; ``tile``: the conversion, by ``layout/fragments.py``'s maps);
and what the kernel and the JAX side share: the calling convention (``abi``) and the varlen work list (``varlen``).
``kernel``, ``schedule`` and ``tile`` import cutlass: ``cache`` imports them lazily."""

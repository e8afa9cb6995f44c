"""The benchmark's problems and implementations: one :class:`Case` per (configuration, packing, size), with
the buffers and launchers of every implementation, and :func:`measure`."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from jax_dqpost import AccumLayout, dq_postprocess

from . import harness, internals

# FlashAttention-4's Hopper dQ configurations, by head dim (AccumLayout.flash_attention(90, D, causal=...)).
CONFIGS = [("hd64", 64, False), ("hd96", 96, False), ("hd128-causal", 128, True), ("hd128", 128, False),
           ("hd192", 192, False), ("hd256", 256, False)]
PACKINGS = ("dense", "varlen")
SIZES = [2**16, 2**20, 2**24, 2**27, 2**30]  # bytes moved per call (approximately)
REFERENCE_SHAPE = (2, 32, 8192)  # (B, H, S): the table of docs/performance.md
ROTATE_BYTES = 256 << 20  # distinct buffers cycled per sample
L2_BYTES = 50 << 20  # the H200's L2
PLOTTED = {"ours": "jax-dqpost", "FA4": "FlashAttention-4", "copy": "copy of the bytes", "xla_device": "XLA's op"}
"""The plot's columns, all device times (graph replay, or the GPU timeline for XLA's op), and their labels."""
METHOD = ("ours/FA4/copy: CUDA events around the replay of a CUDA graph of back-to-back calls, >= 5 ms (*_eager: "
          "events around eager launches); xla_device/ours_jax_device: the GPU timeline of a jitted program, median "
          "of its runs in one trace (every row); ours_jax/xla_same_bytes/jnp_gather: wall clock of pipelined jitted "
          "calls (reference rows); median of samples of >= 2 ms; >= 256 MiB of rotated buffers (32 buffers where "
          "256 would fit in the L2); seconds per call")


def problem(head_dim: int, target_bytes: int | None):
    """(B, H, S) moving about ``target_bytes`` per call (None: :data:`REFERENCE_SHAPE`)."""
    if target_bytes is None:
        return REFERENCE_SHAPE
    per_token_head = head_dim * 6
    heads = int(min(32, max(1, target_bytes // (per_token_head * 1024))))
    seqlen = max(8, round(target_bytes / (heads * per_token_head)))
    return 1, heads, seqlen


REFERENCE_SEQUENCES = 64  # sequences of the reference shape's varlen row


def pack_size(tokens: int) -> int:
    """Sequences in a varlen row of the size sweep: a pack of 2 to 8 sequences of about 2048 tokens (one sequence
    if there are fewer than 2 tokens); the short-sequence sweep times many short ones."""
    return max(1, min(tokens, 8, max(2, round(tokens / 2048))))


SHORT_SEQUENCES = (64, 164, 500, 2000, 4000, 8000)  # sequence counts of the short-sequence sweep (hd128)
SHORT_TOKENS = 16384


def short_lengths(rng, total: int, count: int) -> list[int]:
    """``cu_seqlens`` of about ``count`` sequences with lengths uniform in ``1 .. 2 * total // count - 1`` (mean
    ``total / count``), the last one cut so that they add up to ``total``."""
    top = max(1, 2 * total // count - 1)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(rng.integers(1, top + 1)))
    lengths[-1] -= sum(lengths) - total
    return [0] + np.cumsum(lengths).tolist()


def sector_bound_bytes(layout: AccumLayout, head_dim: int, heads: int, cu, seqused=None, granule: int = 32) -> int:
    """The bytes a postprocess of these sequences must move at the least in ``layout``'s order: per head, every
    ``granule``-byte block of the accumulator holding an element of a sequence's rows (an order interleaves rows
    inside a tile, so a sequence shorter than a tile still needs the blocks of its rows' groups), plus the dQ rows
    written. Sequence ``b``'s rows start a tile (FlashAttention's padded offsets). ``granule``: 32, the L2's sector
    (the sector bound), or the L2's fetch granularity from DRAM (:func:`harness.l2_fetch_granularity`; 64 bytes by
    default on the H200: the granule bound)."""
    tm, pos, floats = layout.tile_m, layout.tile_index_map(head_dim), granule // 4
    # blocks[r]: the blocks a tile whose first r rows are converted reads
    blocks = np.array([0] + [len(np.unique(pos[:r].ravel() // floats)) for r in range(1, tm + 1)], np.int64)
    lengths = np.diff(np.asarray(cu, np.int64))
    conv = lengths if seqused is None else np.minimum(np.asarray(seqused, np.int64), lengths)
    full, part = conv // tm, conv % tm
    read = int((full * blocks[tm] + blocks[part]).sum()) * granule
    return heads * (read + int(lengths.sum()) * head_dim * 2)


def random_lengths(rng, total: int, count: int) -> list[int]:
    """``cu_seqlens``: ``count`` random positive lengths adding up to ``total``."""
    count = max(1, min(count, total))
    cuts = np.sort(rng.choice(np.arange(1, total), count - 1, replace=False)) if count > 1 else np.array([], int)
    return [0] + [int(c) for c in cuts] + [total]


def benchmark_rows(sizes=SIZES) -> int:
    """How many cases :func:`benchmark_cases` yields for ``sizes``."""
    return len(CONFIGS) * len(PACKINGS) * (1 + len(sizes))


def benchmark_cases(torch, fa4, sizes=SIZES):
    """``(size, Case)`` for every row of ``python -m benchmarks``, in its order: each configuration's reference shape
    (size None), dense then varlen, then each configuration's and packing's ``sizes``. One generator draws every
    varlen row's lengths in that order, so a tool that measures some rows builds the cases before them too and
    gets the lengths of a full run (``--quick`` measures fewer sizes: its later rows draw others)."""
    rng = np.random.default_rng(0)
    todo = [(c, p, None) for c in CONFIGS for p in PACKINGS] + [(c, p, s) for c in CONFIGS for p in PACKINGS
                                                                 for s in sizes]
    for (name, head_dim, causal), packing, size in todo:
        yield size, Case(name, head_dim, causal, packing, size, rng, torch, fa4)


class Case:
    """One (configuration, packing, size): the call's plan, buffers and launchers of every implementation.
    ``torch`` and ``fa4`` may be None (their columns are then not measured)."""

    def __init__(self, name, head_dim, causal, packing, target_bytes, rng, torch, fa4, sequences=None, cu=None,
                 traced=False):
        """``cu``: the varlen ``cu_seqlens_q`` (default: ``sequences`` random lengths over the problem's tokens;
        default :data:`REFERENCE_SEQUENCES` at the reference shape, else :func:`pack_size`);
        ``traced``: launch the grid of traced offsets (``WorkList.max_tiles`` slots) instead of the exact one of
        static offsets."""
        if packing not in PACKINGS:
            raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
        self.torch, self.fa4 = torch, fa4
        self.layout = AccumLayout.flash_attention(90, head_dim, causal=causal, tensor="dq", version="4.0.0b36")
        self.name, self.packing, self.D, self.traced = name, packing, head_dim, traced
        B, H, S = problem(head_dim, target_bytes)
        self.B, self.H, self.S = B, H, S
        self.tokens = B * S
        tm = self.layout.tile_m
        if packing == "dense":
            self.part, self.cu, self.meta = internals.dense_part(self.layout, head_dim, jnp.bfloat16, S), None, None
            self.acc_shape, self.out_shape = self.layout.accum_shape(B, H, S, head_dim), (B, S, H, head_dim)
        else:
            if sequences is None:
                sequences = REFERENCE_SEQUENCES if target_bytes is None else pack_size(self.tokens)
            self.cu = random_lengths(rng, self.tokens, sequences) if cu is None else list(cu)
            if self.cu[-1] != self.tokens:
                raise ValueError(f"cu must end at the problem's {self.tokens} tokens, got {self.cu[-1]}")
            self.part, self.meta = internals.varlen_part(self.layout, head_dim, jnp.bfloat16, self.cu, self.tokens,
                                                         traced)
            work = self.part.work
            self.acc_shape = self.layout.varlen_accum_shape(work.batch, H, self.tokens, head_dim)
            self.out_shape = (self.tokens, H, head_dim)
            self.tile_ctas = H * int(sum(-(-n // tm) for n in np.diff(self.cu)))  # a grid without the work list
        self.plan = internals.plan([self.part])
        self.ctas = self.plan.launch([self.acc_shape])[1]  # launched (every batch's): tiles split or whole
        dr = self.part.padded_head_dim
        self.bytes = self.tokens * H * (dr * 4 + head_dim * 2)  # useful bytes: rows of the sequences only
        per_call = int(np.prod(self.acc_shape)) * 4 + int(np.prod(self.out_shape)) * 2
        # as many buffers as fill ROTATE_BYTES, at most 256; 32 where even 256 would sit in the L2
        self.copies = max(2, min(256 if 256 * per_call > L2_BYTES else 32, -(-ROTATE_BYTES // per_call)))
        self.scale = head_dim ** -0.5

    # torch-side buffers (ours, FA4, copy)
    def torch_buffers(self):
        t = self.torch
        self.t_acc = [t.randn(self.acc_shape, device="cuda", dtype=t.float32) for _ in range(self.copies)]
        self.t_out = [t.empty(self.out_shape, device="cuda", dtype=t.bfloat16) for _ in range(self.copies)]
        self.t_scale = t.tensor([self.scale], device="cuda", dtype=t.float32)
        self.t_meta = t.from_numpy(self.meta).cuda() if self.meta is not None else self.t_scale
        self.t_cu = t.tensor(self.cu, dtype=t.int32, device="cuda") if self.cu is not None else None

    def free_torch(self):
        self.t_acc = self.t_out = self.t_meta = self.t_cu = None
        self.torch.cuda.empty_cache()

    def ours(self, **tuning):
        """Launcher of our kernel; ``tuning``: ``internals.executor``'s keywords (experiments only)."""
        import cuda.bindings.driver as cuda

        ex = internals.executor(self.plan, [self.acc_shape], **tuning)
        args = [internals.launch_args(self.plan, [self.acc_shape], dict(dq_accum=a, q_aux=self.t_meta,
                                                                         scales=self.t_scale, dq=o))
                for a, o in zip(self.t_acc, self.t_out)]

        def run(n):
            stream = cuda.CUstream(self.torch.cuda.current_stream().cuda_stream)  # the capture stream, too
            for i in range(n):
                ex(*args[i % self.copies], stream)
        return run

    def fa4_run(self):
        import cutlass

        lt = self.layout

        def run(n):
            for i in range(n):
                k = i % self.copies
                self.fa4(self.t_acc[k], self.t_out[k], self.scale, self.t_cu, None, 90, cutlass.BFloat16, self.D,
                         lt.tile_m, lt.num_threads, lt.atom_layout, lt.swap_ab, fake_mode=False,
                         hdim_multiple_of=lt.hdim_multiple_of)
        return run

    def copy_run(self):
        t = self.torch
        words = self.bytes // 2 // 16 * 4  # half the bytes each way, as int32 (16-byte multiples)
        src = [t.empty(words, dtype=t.int32, device="cuda") for _ in range(self.copies)]
        dst = [t.empty(words, dtype=t.int32, device="cuda") for _ in range(self.copies)]

        def run(n):  # an elementwise kernel (read N, write N): in a CUDA graph a memcpy node is slow at some sizes
            for i in range(n):
                t.bitwise_or(src[i % self.copies], 0, out=dst[i % self.copies])
        return run

    # JAX side (ours through jax.jit, XLA's op of the same bytes, and the gather a user would write)
    def jax_inputs(self):
        import jax

        keys = jax.random.split(jax.random.PRNGKey(0), self.copies)
        self.j_acc = [jax.random.normal(k, self.acc_shape, np.float32) for k in keys]

    def jax_run(self, fn, rotate=True):
        import jax

        f = jax.jit(fn)
        copies = self.copies if rotate else 1

        def run(n):
            out = None
            for i in range(n):
                out = f(self.j_acc[i % copies])
            return out
        return run

    def ours_jax_fn(self):
        import jax.numpy as jnp

        if self.cu is None:
            return lambda a: dq_postprocess(a, self.scale, seqlen_q=self.S, head_dim=self.D, dtype=jnp.bfloat16,
                                            layout=self.layout)
        cu = jnp.asarray(self.cu, jnp.int32) if self.traced else self.cu
        return lambda a: dq_postprocess(a, self.scale, head_dim=self.D, total_q=self.tokens, cu_seqlens_q=cu,
                                        dtype=jnp.bfloat16, layout=self.layout)

    def same_bytes_fn(self):
        """An XLA op moving about the bytes of a call (x * scale -> bf16 of the whole accumulator, its padded
        rows included, no reordering): what a plain jax.jit call of this size costs."""
        import jax.numpy as jnp

        return lambda a: (a * np.float32(self.scale)).astype(jnp.bfloat16)

    def device_times(self, samples: int) -> dict:
        """Device time per call from the GPU timeline (jax.profiler) of one jitted program over the rotated
        buffers: ``xla_device``, XLA's fused ``(x * scale).astype(bf16)`` of exactly the call's useful bytes
        (``tokens * H * Dr`` floats in, as many bf16 out: the practical roofline); ``ours_jax_device``, our op."""
        import jax

        elems = self.tokens * self.H * self.part.padded_head_dim
        keys = jax.random.split(jax.random.PRNGKey(2), self.copies)
        flat = [jax.random.normal(k, (elems,), np.float32) for k in keys]
        scale, ours = np.float32(self.scale), self.ours_jax_fn()
        out = {}
        for name, fn, args, kernel in (
                ("xla_device", lambda xs: [(x * scale).astype(jnp.bfloat16) for x in xs], flat, ""),
                ("ours_jax_device", lambda xs: [ours(x) for x in xs], self.j_acc, harness.OUR_KERNEL)):
            t = harness.device_time_per_call(jax.jit(fn), (args,), kernel, self.copies, max(5, samples // 2))
            if t:
                out[name] = t
        return out

    def gather_fn(self):
        """A user's jax.numpy version: gather every element from its position in the tile order."""
        import jax.numpy as jnp

        lt, D = self.layout, self.D
        Dr, tm = lt.padded_head_dim(D), lt.tile_m
        pos = jnp.asarray(lt.tile_index_map(D)[:, :D].astype(np.int32))  # (tm, D)
        if self.cu is None:
            S = self.S

            def f(a):
                tiles = a.reshape(self.B, self.H, -1, tm * Dr)
                x = jnp.take(tiles, pos.ravel(), axis=3).reshape(self.B, self.H, -1, D)[:, :, :S]
                return (jnp.transpose(x, (0, 2, 1, 3)) * self.scale).astype(jnp.bfloat16)
            return f
        cu = np.asarray(self.cu)
        t = np.arange(self.tokens)
        b = np.searchsorted(cu, t, side="right") - 1
        row = (cu[b] + b * tm) // tm * tm + (t - cu[b])  # accumulator row of every token
        flat = jnp.asarray((row // tm * tm * Dr)[:, None] + np.asarray(pos)[row % tm])  # (T, D)

        def f(a):
            return (jnp.transpose(a[:, flat], (1, 0, 2)) * self.scale).astype(jnp.bfloat16)
        return f

    def same_bits_as_fa4(self) -> bool:
        t = self.torch
        self.ours()(1)
        mine = self.t_out[0].clone()
        self.t_out[0].fill_(float("nan"))
        self.fa4_run()(1)
        t.cuda.synchronize()  # (varlen: the sequences cover every row, so FlashAttention-4 writes them all)
        return bool(t.equal(mine.view(t.int16), self.t_out[0].view(t.int16)))


def measure(case: Case, samples: int, wall: bool = True) -> dict:
    """Every implementation of ``case`` this machine can run: torch's (ours, FA4 and copy by graph replay), the
    GPU-timeline columns (:meth:`Case.device_times`) and, with ``wall`` (the reference rows), the wall-clock ones."""
    res = {"config": case.name, "packing": case.packing, "head_dim": case.D, "B": case.B, "H": case.H, "S": case.S,
           "tokens": case.tokens, "bytes": case.bytes, "buffers": case.copies,
           "layout": [case.layout.tile_m, case.layout.num_threads, case.layout.atom_layout, case.layout.swap_ab,
                      case.layout.hdim_multiple_of]}
    if case.cu is not None:
        res.update(sequences=len(case.cu) - 1, ctas=case.ctas, tile_ctas=case.tile_ctas, **bound_bytes(case))
    torch = case.torch
    if torch is not None:
        case.torch_buffers()
        res["ours"], res["ours_eager"] = harness.graph_per_call(torch, case.ours(), case.copies, samples)
        if case.fa4 is not None:
            try:
                res["FA4"], res["FA4_eager"] = harness.graph_per_call(torch, case.fa4_run(), case.copies, samples)
                res["same_bits_as_FA4"] = case.same_bits_as_fa4()
            except Exception as e:  # noqa: BLE001 - report what the peer cannot run
                res["FA4_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        res["copy"], res["copy_eager"] = harness.graph_per_call(torch, case.copy_run(), case.copies, samples)
        case.free_torch()
    case.jax_inputs()
    res.update(case.device_times(samples))
    if wall:
        timed = functools.partial(harness.per_call, calls=case.copies, samples=samples, clock=harness.wall_clock,
                                  min_sample_s=harness.MIN_WALL_SAMPLE_S)
        res["ours_jax"] = timed(case.jax_run(case.ours_jax_fn()))
        res["ours_jax_same_input"] = timed(case.jax_run(case.ours_jax_fn(), rotate=False))
        res["xla_same_bytes"] = timed(case.jax_run(case.same_bytes_fn()))
        res["jnp_gather"] = timed(case.jax_run(case.gather_fn()))
    case.j_acc = None
    return res


def short_cases(torch, fa4):
    """The short-sequence sweep (hd128, FlashAttention-4's dQ preset, 32 heads, :data:`SHORT_TOKENS` tokens): for
    each count in :data:`SHORT_SEQUENCES`, random lengths (:func:`short_lengths`, one generator of its own), static
    and traced offsets."""
    rng = np.random.default_rng(1)
    for count in SHORT_SEQUENCES:
        cu = short_lengths(rng, SHORT_TOKENS, count)
        for traced in (False, True):
            yield Case(f"hd128-{count}seq", 128, False, "varlen", None, rng, torch, fa4, cu=cu, traced=traced)


def bound_bytes(case: Case) -> dict:
    """A varlen case's ``bound_bytes`` and ``granule_bound_bytes`` (:func:`sector_bound_bytes`: in 32-byte sectors
    and in the L2's fetch granules), and the granularity."""
    granule = harness.l2_fetch_granularity()
    return {"bound_bytes": sector_bound_bytes(case.layout, case.D, case.H, case.cu), "l2_fetch_granularity": granule,
            "granule_bound_bytes": sector_bound_bytes(case.layout, case.D, case.H, case.cu, granule=max(32, granule))}


def measure_short(case: Case, samples: int) -> dict:
    """A short-sequence case: ours and (static offsets) FlashAttention-4 by graph replay, ours through ``jax.jit``
    from the GPU timeline, and the bounds of the lengths in the layout's order (:func:`sector_bound_bytes`): the sector
    bound and the granule bound at the device's L2 fetch granularity."""
    lengths = np.diff(case.cu)
    res = {"config": case.name, "packing": "varlen", "traced": case.traced, "sequences": len(lengths),
           "max_length": int(lengths.max()), "tokens": case.tokens, "bytes": case.bytes, **bound_bytes(case),
           "ctas": case.ctas, "tile_ctas": case.tile_ctas}
    if case.torch is not None:
        case.torch_buffers()
        res["ours"], _ = harness.graph_per_call(case.torch, case.ours(), case.copies, samples)
        if case.fa4 is not None and not case.traced:
            try:
                res["FA4"], _ = harness.graph_per_call(case.torch, case.fa4_run(), case.copies, samples)
                res["same_bits_as_FA4"] = case.same_bits_as_fa4()
            except Exception as e:  # noqa: BLE001 - report what the peer cannot run
                res["FA4_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        case.free_torch()
    import jax

    case.jax_inputs()
    ours = case.ours_jax_fn()
    t = harness.device_time_per_call(jax.jit(lambda xs: [ours(x) for x in xs]), (case.j_acc,), harness.OUR_KERNEL,
                                     case.copies, 3)
    if t:
        res["ours_jax_device"] = t
    case.j_acc = None
    return res

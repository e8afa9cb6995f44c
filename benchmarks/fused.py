"""The benchmark of the fused postprocess (dQ, dK, dV and dsink in one launch) at grouped-query attention shapes.

Per case (B=2, H=32, H_kv=8, S=8192; FlashAttention-4's Hopper presets for dQ and dK/dV), device time per call:

- ``fused``: our fused kernel; ``fused_sink``: the same with the learnable-sink gradient (dense cases);
- ``FA4_3``: FlashAttention-4's three postprocess launches (dQ, with the sink when ``fused_sink`` is measured, dK,
  dV); ``ours_3``: our kernel launched once per tensor (one part each);
- these four by CUDA events around the replay of a CUDA graph of back-to-back calls (torch);
- ``xla_same_bytes``: XLA's own fused ``(acc * scale).astype(bf16)`` of the three accumulators, and ``fused_jax``:
  ``jax.jit(flash_attention_postprocess)``; both from the GPU timeline (jax.profiler) of one jitted program
  running the op on every rotated buffer set: span of its kernels over the calls.
"""

from __future__ import annotations

import numpy as np

from jax_dqpost import AccumLayout, flash_attention_postprocess

from . import harness, internals
from .cases import ROTATE_BYTES, random_lengths

GQA_SHAPE = (2, 32, 8, 8192)  # (B, H, H_kv, S)
CASES = [(64, "dense", False), (128, "dense", False), (192, "dense", False), (256, "dense", False),
         (128, "dense", True), (128, "varlen", False)]
METHOD = ("fused/fused_sink/FA4_3/ours_3: CUDA events around the replay of a CUDA graph of back-to-back calls; "
          "xla_same_bytes/fused_jax: GPU timeline (jax.profiler) of one jitted program over the rotated buffers, "
          "first kernel start to last kernel end over the calls; median of samples; seconds per call")


class FusedCase:
    def __init__(self, head_dim, packing, sink, rng, torch, fa4):
        import jax.numpy as jnp

        B, H, G, S = GQA_SHAPE
        self.torch, self.fa4, self.D, self.packing, self.sink = torch, fa4, head_dim, packing, sink
        self.name = f"hd{head_dim}-{packing}" + ("-sink" if sink else "")
        self.ql = AccumLayout.flash_attention(90, head_dim, causal=False, tensor="dq", version="4.0.0b36")
        self.kl = AccumLayout.flash_attention(90, head_dim, causal=False, tensor="dkv", version="4.0.0b36")
        self.T = B * S
        if packing == "dense":
            q = internals.dense_part(self.ql, head_dim, jnp.bfloat16, S)
            k = internals.dense_part(self.kl, head_dim, jnp.bfloat16, S)
            self.cu, self.metas = None, (None, None)
            self.acc_shapes = (self.ql.accum_shape(B, H, S, head_dim), self.kl.accum_shape(B, G, S, head_dim),
                               self.kl.accum_shape(B, G, S, head_dim))
            self.out_shapes = ((B, S, H, head_dim), (B, S, G, head_dim), (B, S, G, head_dim))
            self.rows = ((B, H, S), (B, H, self.ql.padded_seqlen(S)))
        else:
            self.cu = random_lengths(rng, self.T, 64)
            q, mq = internals.varlen_part(self.ql, head_dim, jnp.bfloat16, self.cu, self.T)
            k, mk = internals.varlen_part(self.kl, head_dim, jnp.bfloat16, self.cu, self.T)
            self.metas = (mq, mk)
            batch = len(self.cu) - 1
            self.acc_shapes = (self.ql.varlen_accum_shape(batch, H, self.T, head_dim),
                               self.kl.varlen_accum_shape(batch, G, self.T, head_dim),
                               self.kl.varlen_accum_shape(batch, G, self.T, head_dim))
            self.out_shapes = ((self.T, H, head_dim), (self.T, G, head_dim), (self.T, G, head_dim))
            self.rows = ((H, self.T), (H, q.work.padded_total))
        self.parts = (q, k, k)
        self.plan = internals.plan(self.parts, np.dtype(np.float32) if sink else None)
        self.scale = head_dim ** -0.5
        dr = q.padded_head_dim
        tokens_heads = self.T * (H + 2 * G)
        self.bytes = tokens_heads * (dr * 4 + head_dim * 2)  # useful bytes: the sequences' rows of all three
        per_call = sum(int(np.prod(s)) * 4 for s in self.acc_shapes) + sum(int(np.prod(s)) * 2 for s in self.out_shapes)
        self.copies = max(2, min(64, -(-ROTATE_BYTES // per_call)))

    # ---- torch side: ours (fused and three single), FA4's three launches ----------------------------------
    def buffers(self):
        t = self.torch
        self.t_acc = [[t.randn(s, device="cuda", dtype=t.float32) for s in self.acc_shapes] for _ in range(self.copies)]
        self.t_out = [[t.empty(s, device="cuda", dtype=t.bfloat16) for s in self.out_shapes]
                      for _ in range(self.copies)]
        self.t_scales = t.tensor([self.scale, self.scale, 1.0], device="cuda", dtype=t.float32)
        self.t_meta = [t.from_numpy(m).cuda() if m is not None else self.t_scales for m in self.metas]
        self.t_cu = t.tensor(self.cu, dtype=t.int32, device="cuda") if self.cu is not None else None
        H = GQA_SHAPE[1]
        self.t_sink = t.randn(H, device="cuda", dtype=t.float32)
        if self.cu is None:
            self.t_lse = (self.t_sink[None, :, None] + t.rand(self.rows[0], device="cuda") * 3).contiguous()
            self.t_dpsum = t.randn(self.rows[1], device="cuda", dtype=t.float32)
        else:
            self.t_lse = (self.t_sink[:, None] + t.rand(self.rows[0], device="cuda") * 3).contiguous()
            self.t_dpsum = t.randn(self.rows[1], device="cuda", dtype=t.float32)
        self.t_dsink = [t.empty(H, device="cuda", dtype=t.float32) for _ in range(self.copies)]

    def fused_run(self, sink: bool):
        import cuda.bindings.driver as cuda

        plan = self.plan if sink else internals.plan(self.parts)
        ex = internals.executor(plan, self.acc_shapes)
        args = []
        for i in range(self.copies):
            (qa, ka, va), (qo, ko, vo) = self.t_acc[i], self.t_out[i]
            buffers = dict(dq_accum=qa, dk_accum=ka, dv_accum=va, q_aux=self.t_meta[0], k_aux=self.t_meta[1],
                           scales=self.t_scales, learnable_sink=self.t_sink, lse=self.t_lse, dpsum=self.t_dpsum,
                           dq=qo, dk=ko, dv=vo, dsink=self.t_dsink[i])
            args.append(internals.launch_args(plan, self.acc_shapes, buffers))

        def run(n):
            stream = cuda.CUstream(self.torch.cuda.current_stream().cuda_stream)
            for i in range(n):
                ex(*args[i % self.copies], stream)
        return run

    def singles_run(self):
        """Our kernel launched once per tensor (one part each)."""
        import cuda.bindings.driver as cuda

        plans = [internals.plan([p]) for p in self.parts]
        executors = [internals.executor(p, [s]) for p, s in zip(plans, self.acc_shapes)]
        scales = [self.t_scales[j:j + 1] for j in range(3)]

        def run(n):
            stream = cuda.CUstream(self.torch.cuda.current_stream().cuda_stream)
            for i in range(n):
                k = i % self.copies
                for j, (plan, ex) in enumerate(zip(plans, executors)):
                    buffers = dict(dq_accum=self.t_acc[k][j], q_aux=self.t_meta[min(j, 1)], scales=scales[j],
                                   dq=self.t_out[k][j])  # each tensor as the one part (dQ's) of its own call
                    ex(*internals.launch_args(plan, [self.acc_shapes[j]], buffers), stream)
        return run

    def fa4_run(self, sink: bool):
        import cutlass
        from flash_attn.cute.flash_bwd_postprocess import LearnableSinkBwdTensors

        def conv(acc, out, scale, layout, hdim, sink_tensors=None):
            self.fa4(acc, out, scale, self.t_cu, None, 90, cutlass.BFloat16, hdim, layout.tile_m, layout.num_threads,
                     layout.atom_layout, layout.swap_ab, sink_tensors=sink_tensors, fake_mode=False,
                     hdim_multiple_of=layout.hdim_multiple_of)

        def run(n):
            for i in range(n):
                k = i % self.copies
                (qa, ka, va), (qo, ko, vo) = self.t_acc[k], self.t_out[k]
                st = LearnableSinkBwdTensors(self.t_dpsum, self.t_lse, self.t_sink, self.t_dsink[k]) if sink else None
                conv(qa, qo, self.scale, self.ql, self.D, st)
                conv(ka, ko, self.scale, self.kl, self.D)
                conv(va, vo, 1.0, self.kl, self.D)
        return run

    def same_bits_as_fa4(self, sink: bool) -> bool:
        t = self.torch
        self.fused_run(sink)(1)
        t.cuda.synchronize()
        mine = [o.clone() for o in self.t_out[0]] + ([self.t_dsink[0].clone()] if sink else [])
        for o in self.t_out[0]:
            o.fill_(float("nan"))
        self.fa4_run(sink)(1)
        t.cuda.synchronize()
        theirs = list(self.t_out[0]) + ([self.t_dsink[0]] if sink else [])
        return all(t.equal(a.view(t.int16 if a.element_size() == 2 else t.int32),
                           b.view(t.int16 if b.element_size() == 2 else t.int32)) for a, b in zip(mine, theirs))

    # ---- JAX side: XLA's op of the same bytes and ours through jax.jit, from the GPU timeline --------------
    def jax_device(self, samples: int) -> dict:
        import jax
        import jax.numpy as jnp

        keys = jax.random.split(jax.random.PRNGKey(1), self.copies * 3)
        sets = [[jax.random.normal(keys[3 * i + j], s, np.float32) for j, s in enumerate(self.acc_shapes)]
                for i in range(self.copies)]
        B, H, G, S = GQA_SHAPE
        kw = dict(head_dim=self.D, dq_layout=self.ql, dkv_layout=self.kl)
        if self.cu is None:
            kw.update(seqlen_q=S, seqlen_k=S)
        else:
            kw.update(total_q=self.T, total_k=self.T, cu_seqlens_q=self.cu, cu_seqlens_k=self.cu)

        def xla(sets):
            return [[(a * np.float32(s)).astype(jnp.bfloat16) for a, s in zip(accs, (self.scale, self.scale, 1.0))]
                    for accs in sets]

        def ours(sets):
            return [flash_attention_postprocess(*accs, self.scale, **kw) for accs in sets]

        out = {}
        for name, fn, kernel in (("xla_same_bytes", xla, ""), ("fused_jax", ours, harness.OUR_KERNEL)):
            t = harness.device_time_per_call(jax.jit(fn), (sets,), kernel, self.copies, max(3, samples // 5))
            if t:
                out[name] = t
        return out


def measure(samples: int, torch, fa4, rng) -> list[dict]:
    """Every case of :data:`CASES`."""
    rows = []
    for k, (head_dim, packing, sink) in enumerate(CASES):
        case = FusedCase(head_dim, packing, sink, rng, torch, fa4)
        harness.log(f"[fused {k + 1}/{len(CASES)}] {case.name} B,H,H_kv,S={GQA_SHAPE}")
        rows.append(measure_case(case, samples))
    return rows


def measure_case(case: FusedCase, samples: int) -> dict:
    """Every implementation of ``case`` this machine can run."""
    torch, fa4, sink = case.torch, case.fa4, case.sink
    ql, kl = case.ql, case.kl
    r = {"config": case.name, "head_dim": case.D, "packing": case.packing, "sink": sink, "shape": GQA_SHAPE,
         "bytes": case.bytes, "buffers": case.copies,
         "dq_layout": [ql.tile_m, ql.num_threads, ql.atom_layout, ql.swap_ab, ql.hdim_multiple_of],
         "dkv_layout": [kl.tile_m, kl.num_threads, kl.atom_layout, kl.swap_ab, kl.hdim_multiple_of]}
    if torch is not None:
        case.buffers()
        r["fused_sink" if sink else "fused"], _ = harness.graph_per_call(torch, case.fused_run(sink), case.copies,
                                                                          samples)
        if sink:
            r["fused"], _ = harness.graph_per_call(torch, case.fused_run(False), case.copies, samples)
        r["ours_3"], _ = harness.graph_per_call(torch, case.singles_run(), case.copies, samples)
        if fa4 is not None:
            try:
                r["FA4_3"], _ = harness.graph_per_call(torch, case.fa4_run(sink), case.copies, samples)
                r["same_bits_as_FA4"] = case.same_bits_as_fa4(sink)
            except Exception as e:  # noqa: BLE001 - report what the peer cannot run
                r["FA4_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        case.t_acc = case.t_out = None
        torch.cuda.empty_cache()
    r.update(case.jax_device(samples))
    return r


def table(rows) -> str:
    head = (f"{'case':>18} | {'MB':>6} | {'ours us (TB/s)':>15} | {'+sink us':>8} | {'FA4 x3 us':>9} | "
            f"{'ours x3 us':>10} | {'FA4/fused':>9} | {'of XLA op':>9} | {'XLA op us':>9} | {'jax us':>7} | bits")
    lines = [head, "-" * len(head)]
    for r in rows:
        f = r.get("fused_sink" if r["sink"] else "fused")  # compared with FA4's launches doing the same work
        us = lambda k: f"{r[k] * 1e6:.1f}" if k in r else "-"  # noqa: E731
        lines.append(
            f"{r['config']:>18} | {r['bytes'] / 1e6:6.0f} | "
            + (f"{f * 1e6:7.1f} ({r['bytes'] / f / 1e12:4.2f})" if f else "-").rjust(15)
            + f" | {us('fused_sink'):>8} | {us('FA4_3'):>9} | {us('ours_3'):>10} | "
            + (f"{r['FA4_3'] / f:9.3f}" if f and "FA4_3" in r else "-".rjust(9)) + " | "
            + (f"{r['xla_same_bytes'] / f:9.1%}" if f and "xla_same_bytes" in r else "-".rjust(9))
            + f" | {us('xla_same_bytes'):>9} | {us('fused_jax'):>7} | {r.get('same_bits_as_FA4', '-')}")
    return "\n".join(lines)

"""The fused Comba backward as a pipeline of named stages on chunks of 64 steps, no autograd.

Notation as in reference.py: per (b, h) and chunk n, gc the inclusive cumsum of g inside the chunk,
gam = exp(gc), Gam = exp(gc[-1]), E_ij = exp(gc_i - gc_j) (j <= i), L = strict_lower((beta P) K^T * E),
A = (I + L)^-1, Vn = A (beta V) - A (beta gam P) S, X = A^T dVn.

  1. transform     (chunk-parallel)  A of each chunk in fp32 by 16 x 16 blocks -> HBM in bf16.
  2. forward_scan  (serial over chunks)  the forward's states again: S_n (bf16) and Vn (bf16) -> HBM.
  3. reverse_scan  (serial over chunks, reversed, dS in fp32)  dS'_n (bf16) and X = A^T dVn (bf16) -> HBM, with
     dv = beta X and dbeta's v part sum_v(v X) where the gradient kernel does not make them.
  4. grads         (chunk-parallel)  dq, dk, dp and dbeta, and the terms of d gc.
  5. dg            (chunk-parallel)  dg from the terms of d gc (fused into stage 4 where a Gluon kernel runs it).
The scans depend only on the transform, so they run side by side on two streams; the gradients wait on both.
Each stage is a Triton kernel (`triton/`) or, where `dispatch.plan` says so, a Gluon kernel (`gluon/`); the scratch
between the stages (A, S_n, dS'_n, Vn, X, dbeta's v parts, d gc's terms) is allocated here, once a call.

A and the states are materialised in HBM: the solve would sit on the serial path of the scans, and the
chunk-parallel gradient kernels need the states of their chunk without a scan of their own.
"""

import functools

import torch

from . import dispatch, forward
from . import triton as triton_kernels
from .reference import pad_time

try:  # Gluon, Triton's explicit-layout dialect; dispatch plans Gluon stages only under releases that have it
    from . import gluon as gluon_kernels
except ImportError:
    gluon_kernels = None


def backward_stages(q, k, v, p, beta, g, do, scale: float, grads=None, plan=None):
    """The backward as ordered launches: ({stage name: fn() launching it}, the six gradients once all ran).

    Each stage reads only what earlier stages wrote, so after one full pass any stage can be re-run (timed)
    alone. Inputs contiguous, K and V in {64, 128}; the gradients are (dq, dk, dv, dp, dbeta, dg) with dg in
    float32, padded in time to a multiple of the chunk (fused_backward trims them); `grads`, when given, are
    contiguous tensors of those shapes and dtypes to write them into; `plan` is `dispatch.plan`'s for the call.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    plan = plan or dispatch.plan(q, V)
    q, k, v, p, beta, g, do = (pad_time(x) for x in (q, k, v, p, beta, g, do))
    Tp = q.shape[1]
    BH = B * H
    dev = q.device
    gluon = plan.gluon
    # dbeta's v parts: none where the gradient kernel makes it, one from a Gluon reverse scan, else one per V block of
    # the Triton reverse scan.
    NV = 0 if plan.v_adjoint_in_grads else 1 if "reverse_scan" in gluon else V // triton_kernels.chunk.scan_block(K, V)
    A, S, Vn = forward.state_scratch(q, V)
    dS = torch.empty_like(S)
    X = torch.empty_like(Vn)
    dbeta_v = torch.empty(NV, *beta.shape, device=dev, dtype=torch.float32)
    dq, dk, dv, dp, dbeta, dg = _gradients_like(q, k, v, p, beta, g) if grads is None else grads
    t = gluon_kernels.chunk.tiles(q, k, p, v, do, A, S, dS, Vn, X) if gluon else None
    stages = forward.state_stages(k, v, p, beta, g, (A, S, Vn), plan, t)
    if "reverse_scan" in gluon:
        stages["reverse_scan"] = lambda: gluon_kernels.reverse.launch(t, q, v, beta, g, dv, dbeta_v, scale)
    else:
        stages["reverse_scan"] = lambda: triton_kernels.reverse.launch(
            q, k, v, p, beta, g, do, A, dS, X, dv, dbeta_v, scale, v_adjoint=not plan.v_adjoint_in_grads)
    if plan.v_adjoint_in_grads:
        stages["grads"] = lambda: gluon_kernels.grads64.launch(t, q, beta, g, dq, dk, dv, dp, dbeta, dg, scale)
    elif "grads" in gluon:
        stages["grads"] = lambda: gluon_kernels.grads.launch(t, q, do, beta, g, dbeta_v, dq, dk, dp, dbeta, dg, scale)
    else:
        dgc_parts = torch.empty(3, BH, Tp, device=dev, dtype=torch.float32)  # d gc terms, per gradient part
        stages["grads"] = lambda: triton_kernels.grads.launch(q, k, p, beta, g, do, S, dS, Vn, X, dbeta_v, dq, dk, dp,
                                                              dbeta, dgc_parts, scale)
        stages["dg"] = lambda: triton_kernels.grads.launch_dg(dgc_parts, dg)
    return stages, (dq, dk, dv, dp, dbeta, dg)


def _gradients_like(q, k, v, p, beta, g):
    """Uninitialised (dq, dk, dv, dp, dbeta, dg): each like its input, dg in float32."""
    return (*(torch.empty_like(x) for x in (q, k, v, p, beta)), torch.empty_like(g, dtype=torch.float32))


@functools.cache
def _side_streams(device: torch.device, n: int) -> tuple:
    """n streams of `device`, made once and reused by every call."""
    return tuple(torch.cuda.Stream(device) for _ in range(n))


def _launch_on_streams(pieces, device: torch.device):
    """Launch each piece's stages ({name: launch}) on a pair of streams of `device`, the first piece's pair starting
    with its current stream, the others forked from it, and join them back into it. `device` is made the current
    device meanwhile: a Triton or Gluon kernel launches on the current device, whatever its tensors' device."""
    main = torch.cuda.current_stream(device)
    streams = (main, *_side_streams(device, 2 * len(pieces) - 1))
    with torch.cuda.device(device):
        for own in streams[2::2]:
            own.wait_stream(main)
        for stages, own, side in zip(pieces, streams[0::2], streams[1::2]):
            with torch.cuda.stream(own):
                stages["transform"]()
                side.wait_stream(own)
                with torch.cuda.stream(side):
                    stages["reverse_scan"]()
                stages["forward_scan"]()
                own.wait_stream(side)
                for name, launch in stages.items():
                    if name not in ("transform", "forward_scan", "reverse_scan"):  # the gradient stages
                        launch()
        for own in streams[2::2]:
            main.wait_stream(own)


def fused_backward(q, k, v, p, beta, g, do, scale: float):
    """(dq, dk, dv, dp, dbeta, dg) in their inputs' dtypes (dg float32); inputs contiguous, K, V in {64, 128}. A Gluon
    kernel that fails to compile switches the Gluon path off and the call runs the Triton kernels
    (`dispatch.with_fallback`)."""
    return dispatch.with_fallback(lambda plan: _backward(q, k, v, p, beta, g, do, scale, plan), q, v.shape[-1])


def _backward(q, k, v, p, beta, g, do, scale: float, plan):
    B, T = q.shape[:2]
    inputs = [pad_time(x) for x in (q, k, v, p, beta, g, do)]
    grads = _gradients_like(*inputs[:6])
    cuts = [B * i // plan.pieces for i in range(plan.pieces + 1)]
    # Every piece's scratch is allocated before the launches and referenced until the streams are joined, so the
    # allocator cannot hand one piece's freed scratch to another piece's stream while it still runs.
    pieces = [backward_stages(*(x[a:b] for x in inputs), scale, tuple(x[a:b] for x in grads), plan)[0]
              for a, b in zip(cuts, cuts[1:])]
    if q.is_cuda:
        _launch_on_streams(pieces, q.device)
    else:
        for stages in pieces:
            for launch in stages.values():
                launch()
    if grads[0].shape[1] == T:
        return grads
    return tuple(x[:, :T].contiguous() for x in grads)

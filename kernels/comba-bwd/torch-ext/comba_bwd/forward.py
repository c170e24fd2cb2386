"""The fused Comba forward as a pipeline of named stages on chunks of 64 steps, no autograd.

Notation as in reference.py: per (b, h) and chunk n, gc the inclusive cumsum of g inside the chunk,
gam = exp(gc), E_ij = exp(gc_i - gc_j) (j <= i), L = strict_lower((beta P) K^T * E), A = (I + L)^-1.

  1. transform     (chunk-parallel)  A of each chunk in fp32 by 16 x 16 blocks -> HBM in bf16.
  2. forward_scan  (serial over chunks)  S_n, the state before chunk n, and Vn = A (beta V) - A (beta gam P) S_n,
     both bf16 -> HBM.
  3. output        (chunk-parallel)  O = scale [(gam Q) S_n + (lower(Q K^T) * E) Vn].
Stages 1 and 2 are the backward's own first stages (`state_stages`: the same kernels, `dispatch.plan` choosing
Triton or Gluon the same way). A, S_n and Vn are scratch: the backward of a training step makes them again.
"""

import torch

from . import dispatch
from . import triton as triton_kernels
from .common.devices import on_device
from .reference import CHUNK, pad_time

try:  # Gluon, Triton's explicit-layout dialect; dispatch plans Gluon stages only under releases that have it
    from . import gluon as gluon_kernels
except ImportError:
    gluon_kernels = None


def state_scratch(q: torch.Tensor, V: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised (A, S, Vn), what the transform and the forward scan write for inputs q (B, T, H, K) with T a
    multiple of the chunk: A (BH, N, 64, 64), S (BH, N, K, V), Vn (BH, T, V), bf16 whatever the inputs' dtype (the
    tensor-core operands of the later stages)."""
    B, T, H, K = q.shape
    N = T // CHUNK
    empty = lambda *shape: torch.empty(*shape, device=q.device, dtype=torch.bfloat16)  # noqa: E731
    return empty(B * H, N, CHUNK, CHUNK), empty(B * H, N, K, V), empty(B * H, T, V)


def state_stages(k, v, p, beta, g, scratch, plan, tiles=None) -> dict:
    """{"transform", "forward_scan"}: launches that fill `scratch` = (A, S, Vn) (`state_scratch`) for
    inputs padded to whole chunks, by the kernels `plan` (`dispatch.plan`) picks; `tiles` are the Gluon descriptors
    (`gluon.chunk.tiles`) where the Gluon forward scan runs. The forward's first two stages, and the backward's where
    it recomputes them."""
    A, S, Vn = scratch
    stages = {}
    if "transform" in plan.gluon:
        stages["transform"] = lambda: gluon_kernels.transform.launch(k, p, beta, g, A)
    else:
        stages["transform"] = lambda: triton_kernels.transform.launch(k, p, beta, g, A)
    if "forward_scan" in plan.gluon:
        stages["forward_scan"] = lambda: gluon_kernels.states.launch(tiles, k, v, beta, g)
    else:
        stages["forward_scan"] = lambda: triton_kernels.states.launch(k, v, p, beta, g, A, S, Vn)
    return stages


def forward_stages(q, k, v, p, beta, g, scale: float, plan=None):
    """The forward as ordered launches: ({stage name: fn() launching it}, o once all ran).

    Inputs contiguous with T a multiple of the chunk, K and V in {64, 128}; each stage reads only what earlier
    stages wrote, so after one full pass any stage can be re-run (timed) alone."""
    V = v.shape[-1]
    plan = plan or dispatch.plan(q, V)
    A, S, Vn = scratch = state_scratch(q, V)
    o = torch.empty_like(v)
    t = gluon_kernels.chunk.tiles(q, k, p, v, None, A, S, None, Vn, None) if "forward_scan" in plan.gluon else None
    stages = state_stages(k, v, p, beta, g, scratch, plan, t)
    stages["output"] = lambda: triton_kernels.output.launch(q, k, beta, g, S, Vn, o, scale)
    return stages, o


def fused_forward(q, k, v, p, beta, g, scale: float):
    """o (B, T, H, V) in v's dtype; inputs contiguous, K and V in {64, 128}, any T >= 1. A Gluon kernel that fails to
    compile switches the Gluon path off and the call runs the Triton kernels (`dispatch.with_fallback`)."""
    return dispatch.with_fallback(lambda plan: _forward(q, k, v, p, beta, g, scale, plan), q, v.shape[-1])


def _forward(q, k, v, p, beta, g, scale: float, plan):
    T = q.shape[1]
    inputs = [pad_time(x) for x in (q, k, v, p, beta, g)]
    stages, o = forward_stages(*inputs, scale, plan)
    with on_device(q):
        for launch in stages.values():
            launch()
    return o if o.shape[1] == T else o[:, :T].contiguous()

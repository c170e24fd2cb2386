"""The plan and the path of a comba call, in one place: kernel_path, the fast-path table, which stages Gluon kernels
take, how the batch is cut, the fall-back from Gluon to Triton, the CUDA entry points `comba_forward_cuda` and
`comba_backward_cuda`, which run the stages of `pipeline` in order on the plan, `comba_state_forward_cuda` and
`comba_state_backward_cuda`, a model's call (a carried state, grouped value heads, packed sequences, fla's read
order, q/k/p L2 normalisation), which the Triton kernels take, and
`comba_decode_cuda`, the decode step: the fused recurrent kernel (`portable.decode`) at the sizes it takes, the
recurrent reference otherwise; `comba_decode_direct` is what it does for a call signature, kept by the public function
(`DIRECT_DECODES`).

The portable path (Triton kernels, `portable/`: the chunk transform, the scans' terms, the two state scans, the
adjoint, the forward's output, the gradients and dg) runs on every CUDA GPU the metadata accepts under every supported
Triton; the Gluon kernels (`hopper/`) run only where their row of FAST_PATHS says they were verified, and the call
takes the Triton kernels everywhere else. The forward takes the stages it shares with the backward (the transform, the
forward scan) from the same plan. The stages (`pipeline`, which imports the kernels) are imported on a CUDA call's
first use: they need triton.
"""

from typing import NamedTuple

import torch

from .common.devices import on_device
from .common.direct_calls import DirectCalls, stage_module
from .common.fast_paths import FastPath, FastPaths, falls_back
from .recurrent import comba_decode_reference
from .reference import resolve_scale

# The Gluon kernels of the chunked pipeline's stages (`hopper/`), one row: they run together where it says they do.
CHUNK_GLUON = "chunk-gluon"
FAST_PATHS = FastPaths("comba-bwd", (
    FastPath(CHUNK_GLUON, "Gluon warpgroup-MMA kernels for bf16 inputs with V = 128: both scans and the gradients at "
             "K = 128; the chunk transform, the forward scan and the gradients (with dv) at K = 64", ((9, 0),),
             verified=("3.6", "3.7", "3.8", "3.9"), compiles=("3.6", "3.7", "3.8", "3.9")),
))

# bf16 inputs only: the Gluon kernels take their operand type from k, and A, S_n, Vn, dS'_n and X are bf16 whatever
# the inputs, so float16 inputs would have those bits read as float16 (the Triton kernels convert them instead).
GLUON_DTYPES = (torch.bfloat16,)
GLUON_V = 128
# The stages Gluon kernels take by K (the others run the Triton kernels). At K = 64 the Gluon reverse scan is slower
# than the Triton one; at K = 128 the Gluon transform is slower than the Triton one.
GLUON_STAGES = {128: ("forward_scan", "reverse_scan", "grads"), 64: ("transform", "forward_scan", "grads")}

# The portable path cuts the batch in BATCH_PIECES pieces. On CUDA each piece is launched on a stream of its own, and
# its reverse scan on one more stream beside its forward scan (the scans depend only on the chunk-parallel stages
# before them). The stages are bound by different things (the transform by its chain of small products, the scans by
# their serial chunk loop and HBM, the gradient kernel by L2), and a scan's last wave is partial, so stages of the two
# pieces fill each other's idle SMs; three pieces are no faster than two. The reverse scan's side stream pays in one
# piece as well. Where Gluon kernels run, the batch stays whole: launching one piece's Gluon stages takes the host
# almost as long as the GPU takes to run them, so in two pieces the call would be bound by the host (at K = 64 as at
# K = 128).
BATCH_PIECES = 2

# Where the Triton scans form their chunk-local terms inside their loops (U = A (beta V) and -W = -A (beta gam P) in
# the forward scan, dVlocal and -W^T in the reverse scan) and the reverse scan makes X = A^T dVn, dv and dbeta's v part,
# so that neither the scan_terms stage nor the adjoint stage runs: a plain call (no carried state, equal heads, not
# packed, the spec's read order) at K in LOCAL_TERMS_V with V up to LOCAL_TERMS_V[K], which one scan program holds
# whole (`portable.chunk.SCAN_BLOCK`), so no program repeats another's terms. At K = 64 the loops take the terms'
# products (64 deep, as the state's are) with two CTAs an SM still, and their longer chains cost the call less than
# the stages' round trips through HBM (U in fp32, -W, dVlocal and dVn written and read back); at K = 128 and 256 (V in
# two or more blocks, [64, K] tiles) the stages keep the terms off the serial loops, as they do in a model's call
# (`plan`'s `model`: its V up to 512, grouped heads, packed sequences and fla's read order run the forms verified
# there).
LOCAL_TERMS_V = {64: 128}


def kernel_path(x: torch.Tensor) -> str:
    """Which implementation `comba_attention` and `comba_backward` take for tensors on `x`'s device: "triton" or
    "reference"."""
    return "triton" if x.is_cuda else "reference"


class Plan(NamedTuple):
    """How one call runs: the stages Gluon kernels take, whether the gradient kernel (not the reverse scan's stages)
    makes dv and dbeta's v part, the pieces the batch is cut in, and whether the Triton scans form their chunk-local
    terms and the adjoint in their loops (LOCAL_TERMS_V) rather than taking them from the scan_terms and adjoint
    stages."""

    gluon: tuple[str, ...]
    v_adjoint_in_grads: bool
    pieces: int
    local_terms: bool


def gluon_stages(device: torch.device, dtype: torch.dtype, K: int, V: int) -> tuple[str, ...]:
    """The stages Gluon kernels run for inputs of `dtype` on `device` with these K and V: where FAST_PATHS runs the
    Gluon path (their warpgroup MMA is Hopper's alone; meta tensors, an offline compile for sm_90, under the releases
    it compiles under), with bf16 inputs and V = 128, GLUON_STAGES[K]."""
    if V != GLUON_V or dtype not in GLUON_DTYPES or K not in GLUON_STAGES or not FAST_PATHS.runs(CHUNK_GLUON, device):
        return ()
    return GLUON_STAGES[K]


def plan(q: torch.Tensor, V: int, model: bool = False) -> Plan:
    """The plan of a call with q (B, T, H, K) and V. dv and dbeta's v part come from the K = 64 Gluon gradient kernel,
    which reads X anyway, where it runs, else from the Gluon reverse scan or the Triton one's adjoint stage. The batch
    is cut in BATCH_PIECES (at most B) on the portable path and stays whole where Gluon kernels run (BATCH_PIECES says
    why). A model's call (`model`: a carried state or grouped value heads, which the Gluon kernels do not take) runs
    the Triton kernels. The Triton scans form their chunk-local terms in their loops in a plain call at the K and V of
    LOCAL_TERMS_V."""
    B, K = q.shape[0], q.shape[-1]
    gluon = () if model else gluon_stages(q.device, q.dtype, K, V)
    pieces = 1 if gluon else BATCH_PIECES
    local_terms = not model and V <= LOCAL_TERMS_V.get(K, 0)
    return Plan(gluon, "grads" in gluon and K == 64, min(pieces, B), local_terms)


def with_fallback(call, q: torch.Tensor, V: int):
    """call(plan), a pipeline run that takes `plan(q, V)`'s kernels. A Gluon kernel compiles at its first launch of a
    specialization; if a call that takes Gluon kernels raises so (`falls_back`), the Gluon path is switched off for the
    process (FAST_PATHS.failed, one warning) and call runs again with the plan made anew, on the Triton kernels, after
    the device has finished what the failed attempt launched (its scratch is freed)."""
    first = plan(q, V)
    if not first.gluon:
        return call(first)
    try:
        return call(first)
    except Exception as error:
        if not falls_back(error):
            raise
        FAST_PATHS.failed(CHUNK_GLUON, error)
        if q.is_cuda and not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize(q.device)
        return call(plan(q, V))


def comba_forward_cuda(q, k, v, p, beta, g, scale: float):
    """o (B, T, H, V) in v's dtype; inputs contiguous, K in {64, 128, 256}, V in {64, 128}, any T >= 1. A Gluon
    kernel that fails to compile switches the Gluon path off and the call runs the Triton kernels (`with_fallback`)."""
    from . import pipeline  # the kernels need triton: imported on a CUDA call's first use

    return with_fallback(lambda plan: pipeline.run_forward(q, k, v, p, beta, g, scale, plan), q, v.shape[-1])


def comba_state_forward_cuda(q, k, v, p, beta, g, initial_state, scale: float, output_final_state: bool,
                             cu_seqlens=None, read_order: str = "decay_first", use_qk_l2norm: bool = False):
    """(o (B, T, HV, V) in v's dtype, final state (N, HV, K, V) fp32, or an empty tensor without output_final_state)
    from initial_state (N, HV, K, V) fp32 or None (zeros); q, k, p (B, T, H, K) and v, beta, g with HV heads, HV a
    multiple of H, contiguous, K in {64, 128, 256} and V in {64, 128, 256, 512}, any T >= 1. N = B, or the sequences of
    cu_seqlens ((N + 1,) offsets of sequences packed in a batch of one), whose offsets are not read on the host (no
    synchronisation): the sequences are laid out chunk-aligned on the device (`pipeline.Packing`).
    read_order: "decay_first" (the spec's) or "fla"; use_qk_l2norm: q, k and p L2-normalised first (`portable.l2norm`).
    The Triton kernels (`plan`'s model plan)."""
    from . import pipeline  # the kernels need triton: imported on a CUDA call's first use

    out = pipeline.run_forward(q, k, v, p, beta, g, scale, plan(q, v.shape[-1], model=True), initial_state,
                               output_final_state, cu_seqlens, read_order == "fla", use_qk_l2norm)
    return out if output_final_state else (out, v.new_empty(0, dtype=torch.float32))


def comba_state_backward_cuda(q, k, v, p, beta, g, initial_state, do, d_final, scale: float, cu_seqlens=None,
                              read_order: str = "decay_first", use_qk_l2norm: bool = False):
    """(dq, dk, dv, dp, dbeta, dg, d_initial_state) of `comba_state_forward_cuda`'s call, given do and d_final, the
    gradient of its final state (N, HV, K, V) fp32 or None (zeros); d_initial_state (N, HV, K, V) fp32, or an empty
    tensor where initial_state is None; with use_qk_l2norm the gradients of the raw q, k, p (the normalisation made
    again for the stages). The Triton kernels (`plan`'s model plan)."""
    from . import pipeline  # the kernels need triton: imported on a CUDA call's first use

    grads = pipeline.run_backward(q, k, v, p, beta, g, do, scale, plan(q, v.shape[-1], model=True), initial_state,
                                  d_final, cu_seqlens, read_order == "fla", use_qk_l2norm)
    return grads if initial_state is not None else (*grads, v.new_empty(0, dtype=torch.float32))


def comba_backward_cuda(q, k, v, p, beta, g, do, scale: float):
    """(dq, dk, dv, dp, dbeta, dg) in their inputs' dtypes (dg float32); inputs contiguous, K in {64, 128, 256}, V in
    {64, 128}, any T >= 1. A Gluon kernel that fails to compile switches the Gluon path off and the call runs the
    Triton kernels (`with_fallback`)."""
    from . import pipeline  # the kernels need triton: imported on a CUDA call's first use

    return with_fallback(lambda plan: pipeline.run_backward(q, k, v, p, beta, g, do, scale, plan), q, v.shape[-1])


def comba_decode_cuda(q, k, v, p, beta, g, state, scale: float | None, cu_seqlens, use_qk_l2norm: bool,
                      read_order: str):
    """(o (B, T, HV, V) in v's dtype, new_state (N, HV, K, V) float32) of a checked decode call without autograd (the
    registered op's entry point, and the public function's direct call, which hands its scale over unresolved: None
    is K ** -0.5). K in {64, 128, 256}, V in {64, 128, 256, 512} (`portable.decode.takes`): one launch of the fused
    kernel into new tensors, `state` only read; shapes decide everything, no value is read on the host, so the call
    can be captured in a CUDA graph. Other sizes: the recurrent reference (`comba_decode_reference`)."""
    decode = stage_module(__package__, "portable.decode")  # the kernels need triton: imported on first use
    K, V = q.shape[-1], v.shape[-1]
    if not decode.takes(K, V, q.dtype):
        return comba_decode_reference(q, k, v, p, beta, g, state, scale, cu_seqlens=cu_seqlens,
                                      use_qk_l2norm=use_qk_l2norm, read_order=read_order)
    q, k, v, p = q.contiguous(), k.contiguous(), v.contiguous(), p.contiguous()
    beta, g = beta.contiguous(), g.contiguous()
    o = torch.empty_like(v)
    if state is None:
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        new_state = torch.empty(N, v.shape[2], K, V, dtype=torch.float32, device=q.device)
    else:
        state = state.contiguous()
        new_state = torch.empty_like(state)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()
    with on_device(q):
        decode.launch(q, k, v, p, beta, g, state, o, new_state, resolve_scale(scale, K), cu_seqlens, use_qk_l2norm,
                      read_order == "fla")
    return o, new_state


# The kept direct calls of `comba_decode` (`comba_decode_direct`) by its call signature: see
# `common.direct_calls.DirectCalls`. The decode's plans depend on nothing a process changes.
DIRECT_DECODES = DirectCalls()


def comba_decode_direct(q, k, v, p, beta, g, state, scale: float | None, cu_seqlens, use_qk_l2norm: bool,
                        read_order: str):
    """What `comba_decode_cuda` does for this call, once it ran on tensors on 16 bytes, for every call of the same
    shapes, dtypes, device and arguments on contiguous tensors on 16 bytes (`common.direct_calls.launches_directly`):
    a function (q, k, v, p, beta, g, state, cu_seqlens) -> (o, new_state) that allocates both and launches the kept
    kernel, `state` only read. None where the call runs the reference or no launcher is kept (the interpreter, no
    call on 16 bytes yet)."""
    decode = stage_module(__package__, "portable.decode")
    K, V = q.shape[-1], v.shape[-1]
    if not decode.takes(K, V, q.dtype):
        return None
    N, HV = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1, v.shape[2]
    launch_kept = decode.kept_launch(q, k, v, p, beta, g, state, N, resolve_scale(scale, K), cu_seqlens, use_qk_l2norm,
                                     read_order == "fla")
    if launch_kept is None:
        return None
    empty, empty_like, float32, device = torch.empty, torch.empty_like, torch.float32, q.device

    def comba_decode_kept(q, k, v, p, beta, g, state, cu_seqlens):
        o = empty_like(v)
        new_state = empty(N, HV, K, V, dtype=float32, device=device) if state is None else empty_like(state)
        launch_kept(q, k, v, p, beta, g, state, new_state, o, cu_seqlens)
        return o, new_state

    return comba_decode_kept

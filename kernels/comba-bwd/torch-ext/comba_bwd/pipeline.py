"""The fused forward and backward as ordered lists of named stages on chunks of 64 steps, no autograd: the one place
that sequences the stage modules' launches (`portable/`, `hopper/`), by the plan `dispatch.plan` makes.

Notation as in reference.py: per (b, h) and chunk n, gc the inclusive cumsum of g inside the chunk,
gam = exp(gc), Gam = exp(gc[-1]), E_ij = exp(gc_i - gc_j) (j <= i), L = strict_lower((beta P) K^T * E),
A = (I + L)^-1, U = A (beta V), W = A (beta gam P), Vn = U - W S, dVlocal = (scale lower(Q K^T) * E)^T dO,
X = A^T dVn.

The forward:
  1. transform     (chunk-parallel)  A of each chunk in fp32 by 16 x 16 blocks -> HBM in bf16.
  2. scan_terms    (chunk-parallel)  U (fp32) and -W (bf16) -> HBM, where the Triton forward scan runs (not where it
                   forms them in its loop: `dispatch.Plan.local_terms`).
  3. forward_scan  (serial over chunks)  S_n, the state before chunk n, and Vn, both bf16 -> HBM.
  4. output        (chunk-parallel)  O = scale [(gam Q) S_n + (lower(Q K^T) * E) Vn].
The backward makes the forward's stages 1 to 3 again (`state_stages`: the same kernels, picked the same way), its
scan_terms stage making -W where either Triton scan runs, U where the forward one does and dVlocal (bf16) where the
reverse one does, then:
  4. reverse_scan  (serial over chunks, reversed, dS in fp32)  dS'_n and dVn (bf16) -> HBM (the Gluon one: dS'_n and
     X, with dv and dbeta's v part).
  5. adjoint       (chunk-parallel, after the Triton reverse scan)  X = A^T dVn (bf16) -> HBM, with dv = beta X and
     dbeta's v part sum_v(v X) where the gradient kernel does not make them.
  6. grads         (chunk-parallel)  dq, dk, dp and dbeta, and the terms of d gc.
  7. dg            (chunk-parallel)  dg from the terms of d gc (fused into stage 6 where a Gluon kernel runs it).
Where the plan's local_terms (`dispatch.LOCAL_TERMS_V`: a plain call at K = 64) says so, the Triton scans form their
chunk-local terms in their loops and the reverse scan stores X (with dv and dbeta's v part) in place of dVn: neither
scan_terms nor adjoint runs, and U, -W, dVlocal and dVn are not allocated.
The scans depend only on the chunk-parallel stages before them, so in the backward they run side by side on two
streams; the stages after them wait on both. The scratch between the stages (A, W, U, dVlocal, S_n, dS'_n, Vn, dVn, X,
dbeta's v part, d gc's terms) is allocated here, once a call. A, the scans' terms and the states are materialised in
HBM: the solve and the chunk-local products would sit on the serial path of the scans (and be repeated by each of a
chunk's V-block programs), and the chunk-parallel kernels need the states of their chunk without a scan of their own.
All of it is scratch of the call: the backward of a training step makes it again.

A model's call (`dispatch.plan(..., model=True)`, the Triton kernels only) may carry a state and group its value heads:
the forward scan starts from the initial state and writes the final one; the reverse scan starts from the final
state's gradient and writes the initial state's. With HV value heads over H key heads (q, k, p), every stage runs
per value head and reads its key head; dq, dk and dp come per value head (fp32) and are summed over each group by one
launch (`portable.l2norm.launch_backward`). Where the call L2-normalises q, k and p (fla's
`use_qk_l2norm_in_kernel`), one launch normalises them ahead of the forward's stages and again ahead of the
backward's, and the backward's dq, dk and dp come in fp32 to that same last launch, which applies the normalisation's
backward with the group sum.
The stages run on chunks of 64 rows and keep their scratch on whole chunks, while they read the call's inputs and write
its outputs where they are (`portable.chunk.chunk_rows`): a T that is not a multiple of the chunk ends in a chunk whose
rows from T on read as zeros and are not written; packed sequences (`cu_seqlens`, a batch of one) take chunks of their
own, each sequence's last chunk ending with it (`Packing`'s table). Zero q, k, v, p, beta and g (and do) leave the
state as it is, so those rows are the zero padding of whole chunks without a copy, and each scan program runs over one
sequence's chunks from its own state. The Gluon kernels take whole chunks of the inputs: where a plan runs them, the
inputs are padded in time (a copy) and the outputs cut back.

This module imports the kernels, so triton: `dispatch` imports it on a CUDA call's first use.
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from . import dispatch, portable
from .common.devices import on_device
from .common.checks import bounded_offsets
from .reference import CHUNK, pad_time

try:  # Gluon, Triton's explicit-layout dialect; dispatch plans Gluon stages only under releases that have it
    from . import hopper
except ImportError:
    hopper = None


class Stage(NamedTuple):
    """One stage of a call: its name (the benchmark's `ms_<name>` column), the launch of its stage module and the
    arguments that launch takes."""

    name: str
    launch: Callable
    args: tuple

    def run(self) -> None:
        self.launch(*self.args)


def chunks_of(T: int, packing=None) -> int:
    """The chunks the stages run on for inputs of T rows: those of `packing` (`Packing`), else T / 64 rounded up."""
    return packing.chunks if packing is not None else -(-T // CHUNK)


def state_scratch(q: torch.Tensor, v: torch.Tensor, N: int, plan, backward: bool = False) -> tuple:
    """Uninitialised (A, W, U, S, Vn), what the transform, the scans' terms and the forward scan write on N chunks for
    inputs q (B, ·, H, K) and v (B, ·, HV, V) on `plan`: A (B * HV, N, 64, 64), -W (B * HV, N * 64, K) where a Triton
    scan runs (the forward one, or in the backward either), U (B * HV, N * 64, V) where the Triton forward scan runs
    (each None where not, or where the scans form them in their loops: plan.local_terms), S (B * HV, N, K, V),
    Vn (B * HV, N * 64, V); bf16 whatever the inputs' dtype (the tensor-core operands of the later stages), but U,
    fp32: Vn = U - W S_n is the small remainder of two nearly equal terms, and U rounded to bf16 would carry an error
    relative to U into it, which dg's nearly cancelling terms magnify."""
    B, _, HV, V = v.shape
    K = q.shape[-1]
    empty = lambda *shape: torch.empty(*shape, device=q.device, dtype=torch.bfloat16)  # noqa: E731
    forward = "forward_scan" not in plan.gluon and not plan.local_terms
    reverse = backward and "reverse_scan" not in plan.gluon and not plan.local_terms
    W = empty(B * HV, N * CHUNK, K) if forward or reverse else None
    U = torch.empty(B * HV, N * CHUNK, V, device=q.device, dtype=torch.float32) if forward else None
    return empty(B * HV, N, CHUNK, CHUNK), W, U, empty(B * HV, N, K, V), empty(B * HV, N * CHUNK, V)


class Packing(NamedTuple):
    """Sequences packed in a batch of one, each on chunks of its own: `cu_chunks` (N + 1,) int32, sequence s on chunks
    cu_chunks[s] to cu_chunks[s + 1] (the scans' ranges); `layout` (chunks, 2) int32, each chunk's first packed row
    and the end of its rows, at most 64 on (`portable.chunk.chunk_rows`), (T, T) for the chunks past the last
    sequence's; `chunks`, the host-side bound (T + N (64 - 1)) // 64 on the chunk count that sizes the scratch and the
    chunk-parallel kernels' grids."""

    cu_chunks: torch.Tensor
    layout: torch.Tensor
    chunks: int

    @property
    def sequences(self) -> int:
        """How many sequences are packed (the scans' programs a value head and V block)."""
        return self.cu_chunks.shape[0] - 1

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, T: int) -> "Packing":
        """The chunks of the N sequences of cu_seqlens (N + 1 offsets, 0 to T), each on whole chunks from its first
        row, made on cu_seqlens' device from the offsets bounded into the T rows (`common.checks.bounded_offsets`),
        without reading them on the host: no synchronisation with the GPU, and offsets a GPU call does not check
        (outside [0, T], or decreasing) still make chunks inside the packed rows. The chunks past the last
        sequence's, up to the bound, hold no rows."""
        offsets = bounded_offsets(cu_seqlens, T).to(torch.int32)
        N = offsets.numel() - 1
        chunks = max(1, (T + N * (CHUNK - 1)) // CHUNK)
        starts, ends = offsets[:-1], offsets[1:]
        counts = (ends - starts + CHUNK - 1) // CHUNK
        cu_chunks = torch.cat([offsets.new_zeros(1), counts.cumsum(0, dtype=torch.int32)])
        chunk = torch.arange(chunks, device=offsets.device, dtype=torch.int32)
        seq = torch.searchsorted(cu_chunks[1:], chunk, right=True)
        real = seq < N
        seq = torch.where(real, seq, 0)
        first = starts[seq] + (chunk - cu_chunks[seq]) * CHUNK
        layout = torch.where(real[:, None], torch.stack([first, torch.minimum(first + CHUNK, ends[seq])], 1), T)
        return cls(cu_chunks, layout.contiguous(), chunks)


def state_stages(k, v, p, beta, g, scratch, plan, tiles=None, initial_state=None, final_state=None,
                 packing=None, read_first=False, local=None) -> list[Stage]:
    """[transform, scan_terms, forward_scan]: the stages that fill `scratch` = (A, W, U, S, Vn) (`state_scratch`), by
    the kernels `plan` (`dispatch.plan`) picks, scan_terms only where `scratch` holds W (the Triton forward scan forms
    U and -W itself where it does not: plan.local_terms); `tiles` are the Gluon descriptors (`hopper.chunk.tiles`)
    where the Gluon forward scan runs. `local` = (q, do, dv_local, scale) in a
    backward whose reverse scan is Triton's: scan_terms makes dVlocal into dv_local too. The forward scan starts from
    `initial_state` (B, HV, K, V) fp32 (None: zeros) and writes the state after the last chunk into `final_state`
    where given (a model's plan); with `packing` (`Packing`, B = 1) the states are one per packed sequence,
    (N, HV, K, V); read_first takes fla's read order (a model's plan). The forward's first stages, and the
    backward's where it makes them again."""
    A, W, U, S, Vn = scratch
    if "transform" in plan.gluon:
        stages = [Stage("transform", hopper.transform.launch, (k, p, beta, g, A))]
    else:
        stages = [Stage("transform", portable.transform.launch, (k, p, beta, g, A, read_first, packing))]
    if W is not None:
        stages.append(Stage("scan_terms", portable.scan_terms.launch,
                            (k, v, p, beta, g, A, W, U, read_first, packing, *(local or ()))))
    if "forward_scan" in plan.gluon:
        stages.append(Stage("forward_scan", hopper.forward_scan.launch, (tiles, k, v, beta, g)))
    else:
        stages.append(Stage("forward_scan", portable.forward_scan.launch,
                            (k, v, p, beta, g, A, W, U, S, Vn, initial_state, final_state, packing)))
    return stages


def forward_stages(q, k, v, p, beta, g, scale: float, plan=None, initial_state=None, final_state=None,
                   packing=None, read_first=False) -> tuple[list[Stage], torch.Tensor]:
    """The forward's stages in order, [transform, scan_terms (where the Triton forward scan runs), forward_scan,
    output], and o, which they fill.

    Inputs contiguous, any T (a multiple of the chunk where the plan runs Gluon kernels: `_plan_rows`), K in
    {64, 128, 256}, V in {64, 128} (a model's call: 256, 512 too); `plan` is `dispatch.plan`'s for the call;
    initial_state, final_state, packing and read_first as `state_stages` takes them. Each stage reads only what
    earlier stages wrote, so after one full pass any stage can be run (timed) again alone."""
    V = v.shape[-1]
    plan = plan or dispatch.plan(q, V, model=read_first or is_model_call(q, v, initial_state, final_state, packing))
    A, _, _, S, Vn = scratch = state_scratch(q, v, chunks_of(q.shape[1], packing), plan)
    o = torch.empty_like(v)
    t = hopper.chunk.tiles(q, k, p, v, None, A, S, None, Vn, None) if "forward_scan" in plan.gluon else None
    stages = state_stages(k, v, p, beta, g, scratch, plan, t, initial_state, final_state, packing, read_first)
    stages.append(Stage("output", portable.output.launch, (q, k, beta, g, S, Vn, o, scale, packing)))
    return stages, o


def is_model_call(q, v, *states) -> bool:
    """Whether a call with inputs q, v and these state (or packing) tensors (or None) is a model's: a state in, out or
    its gradient, packed sequences, or grouped value heads."""
    return q.shape[2] != v.shape[2] or any(x is not None for x in states)


def _plan_rows(xs, plan) -> list[torch.Tensor]:
    """The inputs as the plan's stages take them: zero-padded in time to whole chunks where Gluon kernels run (their
    tiles span whole chunks of the (B, T) rows), as they are where only the Triton kernels run."""
    return [pad_time(x) for x in xs] if plan.gluon else list(xs)


def _call_rows(x: torch.Tensor, T: int) -> torch.Tensor:
    """x (B, T', ...), an output of the stages, on the call's T rows (T' > T where `_plan_rows` padded)."""
    return x if x.shape[1] == T else x[:, :T].contiguous()


def run_forward(q, k, v, p, beta, g, scale: float, plan, initial_state=None, output_final_state=False,
                cu_seqlens=None, read_first=False, l2norm=False):
    """o (B, T, HV, V) in v's dtype by the forward's stages on `plan`, and with output_final_state (o, the state after
    the last step (N, HV, K, V) fp32); the scan starts from initial_state (N, HV, K, V) fp32 (None: zeros). N = B, or
    the sequences of cu_seqlens ((N + 1,) offsets, B = 1, not read on the host: `Packing.of`); read_first: fla's read
    order; l2norm: q, k and p L2-normalised first. Inputs contiguous, any T >= 1."""
    B, T, HV, V = v.shape
    if l2norm:
        with on_device(q):
            q, k, p = portable.l2norm.launch_forward(q, k, p)
    packing = None if cu_seqlens is None else Packing.of(cu_seqlens, T)
    N = B if packing is None else packing.sequences
    inputs = _plan_rows((q, k, v, p, beta, g), plan)
    final = q.new_empty(N, HV, q.shape[-1], V, dtype=torch.float32) if output_final_state else None
    stages, o = forward_stages(*inputs, scale, plan, initial_state, final, packing, read_first)
    with on_device(q):
        for stage in stages:
            stage.run()
    o = _call_rows(o, T)
    return (o, final) if output_final_state else o


def backward_stages(q, k, v, p, beta, g, do, scale: float, grads=None, plan=None, initial_state=None, d_final=None,
                    d_initial=None, packing=None, read_first=False) -> tuple[list[Stage], tuple]:
    """The backward's stages in order, [transform, scan_terms (where a Triton scan runs), forward_scan, reverse_scan,
    adjoint (after the Triton reverse scan), grads] and dg where the Triton gradient kernel runs, and the six
    gradients, which they fill; neither scan_terms nor adjoint where the scans form their terms and the adjoint in
    their loops (plan.local_terms).

    Each stage reads only what earlier stages wrote, so after one full pass any stage can be run (timed) again alone.
    Inputs contiguous, any T (a multiple of the chunk where the plan runs Gluon kernels: `_plan_rows`), K in
    {64, 128, 256}, V in {64, 128} (a model's call: 256, 512 too); the gradients are (dq, dk, dv, dp, dbeta, dg) on
    the inputs' rows with dg in float32, dq, dk and dp one per value head (`_gradients_like`); `grads`, when given,
    are contiguous tensors of those shapes and dtypes to write them into; `plan` is `dispatch.plan`'s for the call. A
    model's call starts the forward scan from initial_state and the reverse scan from d_final, the final state's
    gradient (each (B, HV, K, V) fp32, None: zeros), and writes the initial state's gradient into d_initial where
    given; with packing (`state_stages`) the states are one per packed sequence; read_first: fla's read order.
    """
    B, T, HV, V = v.shape
    K = q.shape[-1]
    plan = plan or dispatch.plan(q, V, model=read_first or is_model_call(q, v, initial_state, d_final, d_initial,
                                                                         packing))
    N = chunks_of(T, packing)
    BH = B * HV
    dev = q.device
    gluon = plan.gluon
    # dbeta's v part, B * N * 64 * HV (`portable.chunk.part_rows`): none where the gradient kernel makes it, else one,
    # from the Gluon reverse scan, the Triton adjoint or (plan.local_terms) the Triton reverse scan.
    NV = 0 if plan.v_adjoint_in_grads else 1
    dbeta_v = torch.empty(NV, B, N * CHUNK, HV, device=dev, dtype=torch.float32)
    scratch = A, W, _, S, Vn = state_scratch(q, v, N, plan, backward=True)
    dS = torch.empty_like(S)
    X = torch.empty_like(Vn)
    dq, dk, dv, dp, dbeta, dg = _gradients_like(q, k, v, p, beta, g) if grads is None else grads
    t = hopper.chunk.tiles(q, k, p, v, do, A, S, dS, Vn, X) if gluon else None
    stage_terms = "reverse_scan" not in gluon and not plan.local_terms
    dv_local, dVn = (torch.empty_like(Vn), torch.empty_like(Vn)) if stage_terms else (None, None)
    local = None if dv_local is None else (q, do, dv_local, scale)
    stages = state_stages(k, v, p, beta, g, scratch, plan, t, initial_state, None, packing, read_first, local)
    if "reverse_scan" in gluon:
        stages.append(Stage("reverse_scan", hopper.reverse_scan.launch, (t, q, v, beta, g, dv, dbeta_v, scale)))
    else:
        stages.append(Stage("reverse_scan", portable.reverse_scan.launch,
                            (q, k, v, p, beta, g, do, A, W, dv_local, dS, dVn, X, dv, dbeta_v, scale,
                             not plan.v_adjoint_in_grads, d_final, d_initial, packing)))
        if stage_terms:
            stages.append(Stage("adjoint", portable.adjoint.launch,
                                (v, beta, A, dVn, X, dv, dbeta_v, not plan.v_adjoint_in_grads, packing)))
    if plan.v_adjoint_in_grads:
        stages.append(Stage("grads", hopper.grads.launch_grads64, (t, q, beta, g, dq, dk, dv, dp, dbeta, dg, scale)))
    elif "grads" in gluon:
        stages.append(Stage("grads", hopper.grads.launch, (t, q, do, beta, g, dbeta_v, dq, dk, dp, dbeta, dg, scale)))
    else:
        # d gc terms, per gradient part, and in fla's read order the terms of d gr (`portable.dg`)
        dgc_parts = torch.empty(4 if read_first else 3, BH, N * CHUNK, device=dev, dtype=torch.float32)
        stages.append(Stage("grads", portable.grads.launch,
                            (q, k, p, beta, g, do, S, dS, Vn, X, dbeta_v, dq, dk, dp, dbeta, dgc_parts, scale, packing)))
        stages.append(Stage("dg", portable.dg.launch, (dgc_parts, dg, packing)))
    return stages, (dq, dk, dv, dp, dbeta, dg)


def _gradients_like(q, k, v, p, beta, g, keys_in_fp32=False):
    """Uninitialised (dq, dk, dv, dp, dbeta, dg): each like its input, dg in float32; with grouped value heads
    (HV > H) dq, dk and dp one per value head, (B, T, HV, K) in float32, for the sum over each group, and in float32
    too where keys_in_fp32 (for the normalisation's backward)."""
    B, T, HV = beta.shape
    if HV == q.shape[2] and not keys_in_fp32:
        keys = [torch.empty_like(x) for x in (q, k, p)]
    else:
        keys = [q.new_empty(B, T, HV, q.shape[-1], dtype=torch.float32) for _ in range(3)]
    dq, dk, dp = keys
    return dq, dk, torch.empty_like(v), dp, torch.empty_like(beta), torch.empty_like(g, dtype=torch.float32)


@functools.cache
def _side_streams(device: torch.device, n: int) -> tuple:
    """n streams of `device`, made once and reused by every call."""
    return tuple(torch.cuda.Stream(device) for _ in range(n))


def _launch_on_streams(pieces: list[list[Stage]], device: torch.device):
    """Run each piece's backward stages (`backward_stages`) on a pair of streams of `device`, the first piece's pair
    starting with its current stream, the others forked from it, and join them back into it: the chunk-parallel
    stages before the scans (the transform, the scans' terms), then the reverse scan on the side stream beside the
    forward scan, then the gradient stages once both scans are done.
    `device` is made the current device meanwhile: a Triton or Gluon kernel launches on the current device, whatever
    its tensors' device."""
    main = torch.cuda.current_stream(device)
    streams = (main, *_side_streams(device, 2 * len(pieces) - 1))
    with torch.cuda.device(device):
        for own in streams[2::2]:
            own.wait_stream(main)
        for stages, own, side in zip(pieces, streams[0::2], streams[1::2]):
            scans = [stage.name for stage in stages].index("forward_scan")
            forward_scan, reverse_scan = stages[scans:scans + 2]
            with torch.cuda.stream(own):
                for stage in stages[:scans]:
                    stage.run()
                side.wait_stream(own)
                with torch.cuda.stream(side):
                    reverse_scan.run()
                forward_scan.run()
                own.wait_stream(side)
                for stage in stages[scans + 2:]:
                    stage.run()
        for own in streams[2::2]:
            main.wait_stream(own)


def run_backward(q, k, v, p, beta, g, do, scale: float, plan, initial_state=None, d_final=None, cu_seqlens=None,
                 read_first=False, l2norm=False):
    """(dq, dk, dv, dp, dbeta, dg) in their inputs' dtypes (dg float32) by the backward's stages on `plan`, the batch
    cut in plan.pieces; inputs contiguous, any T >= 1. A model's call starts from initial_state, with d_final the
    gradient of the final state (each (N, HV, K, V) fp32 or None: zeros), and, where initial_state is given, returns
    its gradient (fp32) after the six; N = B, or the sequences of cu_seqlens (as `run_forward` takes it);
    read_first: fla's read order; l2norm: the call L2-normalised q, k and p, whose gradients these are."""
    B, T, H = q.shape[:3]
    keys = q, k, p
    if l2norm:
        with on_device(q):
            q, k, p = portable.l2norm.launch_forward(q, k, p)
    packing = None if cu_seqlens is None else Packing.of(cu_seqlens, T)
    inputs = _plan_rows((q, k, v, p, beta, g, do), plan)
    grads = _gradients_like(*inputs[:6], keys_in_fp32=l2norm)
    d_initial = None if initial_state is None else torch.empty_like(initial_state)
    states = (initial_state, d_final, d_initial)
    cuts = [B * i // plan.pieces for i in range(plan.pieces + 1)]
    # Every piece's scratch is allocated before the launches and referenced until the streams are joined, so the
    # allocator cannot hand one piece's freed scratch to another piece's stream while it still runs. Packed
    # sequences are a batch of one, one piece, with a state per sequence.
    if packing is None:
        pieces = [backward_stages(*(x[a:b] for x in inputs), scale, tuple(x[a:b] for x in grads), plan,
                                  *(None if x is None else x[a:b] for x in states), None, read_first)[0]
                  for a, b in zip(cuts, cuts[1:])]
    else:
        pieces = [backward_stages(*inputs, scale, grads, plan, *states, packing, read_first)[0]]
    if q.is_cuda:
        _launch_on_streams(pieces, q.device)
    else:
        for stages in pieces:
            for stage in stages:
                stage.run()
    grads = tuple(_call_rows(x, T) for x in grads)
    if v.shape[2] != H or l2norm:
        dq, dk, dv, dp, dbeta, dg = grads
        with on_device(q):
            dq, dk, dp = portable.l2norm.launch_backward(*keys, dq, dk, dp, l2norm)
        grads = (dq, dk, dv, dp, dbeta, dg)
    return grads if d_initial is None else (*grads, d_initial)

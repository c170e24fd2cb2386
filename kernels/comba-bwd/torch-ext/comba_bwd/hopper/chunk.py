"""What the Gluon kernels (`transform`, `forward_scan`, `reverse_scan`, `grads`) share: the chunk, their operand type,
their warps at K = 128, the SMs of a persistent grid, the gates of a chunk, the finite part of an operand and the TMA
descriptors of their tensors."""

import functools
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..reference import CHUNK, G_FLOOR

BT = gl.constexpr(CHUNK)
FLOOR = gl.constexpr(G_FLOOR)  # the log-decay floor of reference.G_FLOOR: -inf is a hard reset
# bf16 inputs only (`dispatch.GLUON_DTYPES`): the kernels take their operand type from k.
GL_DTYPES = {torch.bfloat16: gl.bfloat16}
WARPS = 8  # two warpgroups: the layouts of the kernels at K = 128 are written for them


@functools.cache
def sms(device: torch.device) -> int:
    """The SMs of `device`, for the persistent grids; an H200's 132 for meta tensors (an offline compile)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


@gluon.jit
def scal_base(b, h, N, H):
    """The offset of (b, 0, h) in a (B, T, H) tensor of N chunks in time."""
    return b.to(gl.int64) * (N * BT) * H + h


@gluon.jit
def finite_or_zero(x):
    """x with its NaN and inf entries zeroed: an operand of a causal product taken finite, as
    `common.finite.finite_part` takes it in the Triton kernels (a masked weight of 0 times inf is NaN)."""
    return gl.where(gl.abs(x) < float("inf"), x, 0.0)


@gluon.constexpr_function
def gate_layout(num_warps):
    """The [BT, BT] blocked layout over the kernel's warps in whose slices the gates come (`gate_loads`)."""
    return gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])


@gluon.jit
def gate_loads(g, beta, scal_base, t0, H):
    """The gates of the chunk from t0 as loaded (g at least FLOOR): g [BT] in the column slice and beta [BT] in the
    row slice of a [BT, BT] blocked layout over the kernel's warps. The forward scan loads them a chunk ahead
    (`chunk_gates` turns them into the chunk's gates), so that their latency is not on the chunk's path, as the
    K = 128 gradient kernel does with g in a layout of fewer registers (`gate_columns`); the reverse scan and
    the K = 64 gradient kernel, which are slower so, load them with the chunk (`gates`)."""
    sq: gl.constexpr = gate_layout(gl.num_warps())
    gj = gl.maximum(gl.load(g + scal_base + (t0 + gl.arange(0, BT, layout=gl.SliceLayout(0, sq))) * H), FLOOR)
    return gj, gl.load(beta + scal_base + (t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, sq))) * H)


@gluon.jit
def gate_columns(g_rows):
    """g [BT] as `gate_loads` gives it (at least FLOOR, in the column slice of its layout) from g loaded in any
    layout: a kernel that holds the next chunk's g a whole chunk keeps it in a layout of fewer registers."""
    sq: gl.constexpr = gate_layout(gl.num_warps())
    return gl.maximum(gl.convert_layout(g_rows, gl.SliceLayout(0, sq)), FLOOR)


@gluon.jit
def chunk_gates(gj, beta_rows):
    """gc (the inclusive cumsum of g in the chunk, as a masked row sum: a scan does not lower in these layouts), glast
    and beta, fp32, gc and beta [BT] in the row slice of the [BT, BT] blocked layout, from `gate_loads`."""
    sq: gl.constexpr = gate_layout(gl.num_warps())
    ri = gl.arange(0, BT, layout=gl.SliceLayout(1, sq))
    rj = gl.arange(0, BT, layout=gl.SliceLayout(0, sq))
    gc = gl.sum(gl.where(rj[None, :] <= ri[:, None], gj[None, :], 0.0), 1)
    return gc, gl.sum(gj, 0), beta_rows.to(gl.float32)


@gluon.jit
def gates(g, beta, scal_base, t0, H):
    """`chunk_gates` of the chunk from t0, loaded now."""
    gj, beta_rows = gate_loads(g, beta, scal_base, t0, H)
    return chunk_gates(gj, beta_rows)


@functools.cache
def shared_layout(block: tuple, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The default shared-memory layout of `block` tiles, made once: making it is most of a descriptor's host
    cost."""
    return gl.NVMMASharedLayout.get_default_for(list(block), GL_DTYPES[dtype])


def descriptor(x2d: torch.Tensor, block: tuple) -> TensorDescriptor:
    """A TMA descriptor of `block` tiles of the matrix x2d, in the default shared-memory layout for them."""
    return TensorDescriptor.from_tensor(x2d, list(block), shared_layout(block, x2d.dtype))


def chunk_rows(x: torch.Tensor) -> TensorDescriptor:
    """[64, D] tiles (a chunk of one head) of a (B, T, H, D) tensor, taken as the (B T, H D) matrix."""
    B, T, H, D = x.shape
    return descriptor(x.view(B * T, H * D), (CHUNK, D))


class Tiles(NamedTuple):
    """The descriptors of the tensors that more than one stage reads: the inputs' chunk rows, A's [64, 64] tiles, the
    states' [K, V] tiles and Vn's and X's [64, V] ones. Made once a call and shared by the backward's kernels, so
    that no descriptor is made twice: the host's time a call counts where the GPU's is short."""

    q: TensorDescriptor
    k: TensorDescriptor
    p: TensorDescriptor
    v: TensorDescriptor
    do: TensorDescriptor
    A: TensorDescriptor
    S: TensorDescriptor
    dS: TensorDescriptor
    Vn: TensorDescriptor
    X: TensorDescriptor


def tiles(q, k, p, v, do, A, S, dS, Vn, X) -> Tiles:
    """The Tiles of inputs (B, T, H, *), A (BH, N, 64, 64), S and dS (BH, N, K, V), Vn and X (BH, T, V); the forward,
    which has no do, dS or X, passes None for them and gets None for their descriptors."""
    K, V = q.shape[-1], v.shape[-1]

    def rows(x, block):
        return None if x is None else descriptor(x.view(-1, V), block)

    return Tiles(*(None if x is None else chunk_rows(x) for x in (q, k, p, v, do)),
                 descriptor(A.view(-1, CHUNK), (CHUNK, CHUNK)), rows(S, (K, V)), rows(dS, (K, V)), rows(Vn, (CHUNK, V)),
                 rows(X, (CHUNK, V)))

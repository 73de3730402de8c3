"""``SparseSelfAttention``: DeepSpeed's module, on current PyTorch, CPU and CUDA.

::

    from zkit_sparse import SparseSelfAttention, FixedSparsityConfig
    attn = SparseSelfAttention(FixedSparsityConfig(num_heads=12, block=64), max_seq_length=8192)
    out = attn(q, k, v, key_padding_mask=pad, attn_mask=None)   # [batch, heads, seq, head_dim]

Masks follow DeepSpeed: ``key_padding_mask`` is ``[batch, seq]`` and ``attn_mask`` ``[seq, seq]``;
mode ``"add"`` adds the mask to the scores, mode ``"mul"`` masks where the mask is 0. ``causal``
(default: the layout's ``attention == "unidirectional"``) masks future keys inside the diagonal
blocks too, which DeepSpeed left to an explicit ``attn_mask``. A row with every key masked gives
a zero output (and zero gradients) rather than NaN.

Paths: a layout with every block present runs PyTorch's SDPA. Otherwise ``backend`` picks one
of three (:mod:`zkit_sparse.backends`): ``flex``, PyTorch's compiled FlexAttention; ``numba``,
the Numba-CUDA kernels of ``zkit-cuda-numba``; ``torch``, the batched-PyTorch path
(:mod:`zkit_sparse.block_attention_torch`), the default on the CPU. For CUDA tensors ``auto``
runs the fastest usable one of the measured GPU table (:mod:`zkit_sparse.backend_table`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from zkit_sparse import backends
from zkit_sparse.block_attention_torch import MaskSpec, block_sparse_attention
from zkit_sparse.block_attention_flex import flex_block_sparse_attention
from zkit_sparse.block_lut import BlockLUT, build_lut, compress_heads
from zkit_sparse.flex_block_mask import DEFAULT_FLEX_BLOCK, flex_tile, layout_block_mask
from zkit_sparse.layouts import SparsityConfig
from zkit_sparse.reusable_buffer import ReusableBuffer

_MASK_MODES = ("add", "mul")
#: Fixed cost of one row bucket of the PyTorch path (about 25 tensor ops of ~10 us on one CPU
#: core), in flops; weighed against the flops a pad slot wastes when buckets are chosen.
_BUCKET_OVERHEAD_FLOPS = 1.0e7


def _additive(mask: torch.Tensor, mode: str, name: str) -> torch.Tensor:
    if mode == "mul" or mask.dtype == torch.bool:
        keep = mask if mask.dtype == torch.bool else mask != 0
        return torch.zeros(mask.shape, device=mask.device).masked_fill_(~keep, float("-inf"))
    if not mask.is_floating_point():
        raise TypeError(f"{name} in 'add' mode must be a float or bool tensor, got {mask.dtype}")
    return mask.to(torch.promote_types(mask.dtype, torch.float32))


def pad_to_block_size(block: int, *tensors: torch.Tensor, dim: int = 2, value: float = 0.0):
    """Pad ``tensors`` along ``dim`` to a multiple of ``block``; returns ``(pad, padded...)``.

    Mask the padded keys with a key-padding mask and drop the padded query rows from the output.
    """
    length = tensors[0].shape[dim]
    pad = (-length) % block
    if pad == 0:
        return (0, *tensors)
    padded = []
    for t in tensors:
        widths = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, pad]
        padded.append(F.pad(t, widths, value=value))
    return (pad, *padded)


class SparseSelfAttention(torch.nn.Module):
    """Block-sparse scaled dot-product attention, DeepSpeed's ``SparseSelfAttention``.

    Args:
        sparsity_config: the layout (``FixedSparsityConfig(num_heads, block, ...)`` ...).
        key_padding_mask_mode: ``"add"`` or ``"mul"`` (DeepSpeed's default ``"add"``).
        attn_mask_mode: ``"add"`` or ``"mul"`` (DeepSpeed's default ``"mul"``).
        max_seq_length: longest sequence; shorter ones use the top-left part of its layout,
            exactly as DeepSpeed does.
        causal: mask future keys; ``None`` = the layout's ``attention == "unidirectional"``.
        dropout: attention-probability dropout, applied in training mode.
        workspace_elems: score elements per chunk of the PyTorch path (bounds its working memory
            beyond the saved probabilities).
        save_probs: the PyTorch path keeps the block-sparse probabilities for the backward
            (fastest; memory grows with nonzero blocks x ``block**2``). ``False`` recomputes them
            in the backward, FlashAttention-style: memory O(seq x head_dim) plus one chunk, one
            more block matmul per nonzero block.
        backend: ``"auto"`` (CUDA tensors: the fastest backend usable for the call, FlexAttention
            needing torch with Triton and ``dropout`` 0, Numba the zkit-cuda-numba kernels, in
            the measured row of :data:`zkit_sparse.backend_table.GPU_TABLE` nearest the length
            and density; other devices: PyTorch), or one of ``"flex"``, ``"numba"``,
            ``"torch"`` (unavailable = an error).
        use_kernels: the older switch: ``True`` = ``backend="numba"``, ``False`` =
            ``backend="torch"``, ``None`` = ``backend``.
        flex_block_size: FlexAttention's tile (an int or ``(query, key)`` pair); the layout's
            blocks are expressed inside partial tiles. Training on CUDA needs a tile that the
            compiled backward's kernel tiles divide (multiples of 128 on an H100 at head_dim
            64); another is refused at the first training call, before compiling.
        flex_kernel_options: ``kernel_options`` passed to ``flex_attention`` (tile sizes of
            its forward and backward kernels).
        flex_compile: run the flex backend through the process's compiled ``flex_attention``:
            ``None`` (default) compiles CUDA calls and runs CPU calls eagerly (a CPU call is
            forward-only and compiling costs seconds per shape); ``True`` compiles on the CPU too
            (the kernel the GPU runs, without the ``T x T`` scores eager FlexAttention
            materialises); ``False`` runs eagerly everywhere (debugging a mask).
    """

    def __init__(
        self,
        sparsity_config: SparsityConfig,
        key_padding_mask_mode: str = "add",
        attn_mask_mode: str = "mul",
        max_seq_length: int = 2048,
        *,
        causal: bool | None = None,
        dropout: float = 0.0,
        workspace_elems: int = 1 << 21,
        save_probs: bool = True,
        use_kernels: bool | None = None,
        backend: str = "auto",
        flex_block_size: int | tuple[int, int] = DEFAULT_FLEX_BLOCK,
        flex_kernel_options: dict | None = None,
        flex_compile: bool | None = None,
    ):
        super().__init__()
        if not isinstance(sparsity_config, SparsityConfig):
            raise TypeError(
                f"sparsity_config must be a zkit_sparse SparsityConfig, got {type(sparsity_config).__name__}"
            )
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode),
                           ("attn_mask_mode", attn_mask_mode)):
            if mode not in _MASK_MODES:
                raise ValueError(f"{name} must be 'add' or 'mul', got {mode!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.sparsity_config = sparsity_config
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        if causal is None:
            causal = getattr(sparsity_config, "attention", "bidirectional") == "unidirectional"
        self.causal = bool(causal)
        self.dropout = float(dropout)
        if workspace_elems < 1:
            raise ValueError(f"workspace_elems must be >= 1, got {workspace_elems}")
        self.workspace_elems = int(workspace_elems)
        self.save_probs = bool(save_probs)
        if use_kernels is not None:
            if backend != "auto":
                raise ValueError(f"give use_kernels={use_kernels} or backend={backend!r}, not both")
            backend = "numba" if use_kernels else "torch"
        self.use_kernels = use_kernels
        self.backend = backends.check_backend(backend, self.dropout)
        flex_tile(flex_block_size)
        self.flex_block_size = flex_block_size
        self.flex_kernel_options = flex_kernel_options
        if flex_compile is not None and type(flex_compile) is not bool:
            raise ValueError(f"flex_compile must be True, False or None, got {flex_compile!r}")
        self.flex_compile = flex_compile
        self.master_layout = sparsity_config.make_layout(max_seq_length)
        self._luts: dict[tuple, object] = {}  # lookup tables and BlockMasks per (kind, length, device)
        self._prob_buffer = ReusableBuffer()  # saved probabilities, reused from step to step
        self._checked_shapes: tuple | None = None  # the input shapes forward last validated

    def release_buffers(self) -> None:
        """Free the probability buffer kept between steps (it is allocated again when needed)."""
        self._prob_buffer.release()

    def extra_repr(self) -> str:
        return (f"{self.sparsity_config!r}, max_seq_length={self.max_seq_length}, "
                f"causal={self.causal}, dropout={self.dropout}, backend={self.backend!r}")

    # -- layout -----------------------------------------------------------------------------
    def layout(self, seq_len: int) -> torch.Tensor:
        """The ``[heads, nb, nb]`` layout used for ``seq_len`` tokens."""
        self._check_length(seq_len)
        nb = seq_len // self.sparsity_config.block
        return self.master_layout[:, :nb, :nb]

    def _check_length(self, seq_len: int) -> None:
        block = self.sparsity_config.block
        if seq_len % block != 0:
            raise ValueError(
                f"sequence length {seq_len} is not divisible by the block size {block}: pad it "
                f"with zkit_sparse.pad_to_block_size and mask the padding"
            )
        if seq_len > self.max_seq_length:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_length {self.max_seq_length} of this "
                f"SparseSelfAttention; build it with a larger max_seq_length"
            )

    def _every_block_present(self, seq_len: int) -> bool:
        # Once per length: a reduction over the [heads, nb, nb] layout (even the slice taking it)
        # is host work before every launch otherwise (milliseconds at 16384 tokens on one core).
        key = ("dense", seq_len)
        if key not in self._luts:
            self._luts[key] = bool(self.layout(seq_len).all())
        return self._luts[key]

    def density(self, seq_len: int) -> float:
        """Present blocks / all blocks of the layout for ``seq_len`` tokens (once per length)."""
        key = ("density", seq_len)
        if key not in self._luts:
            self._luts[key] = self.layout(seq_len).bool().float().mean().item()
        return self._luts[key]

    def lut(self, seq_len: int, device: torch.device) -> BlockLUT:
        key = (seq_len, device)
        if key not in self._luts:
            layout, block = self.layout(seq_len), self.sparsity_config.block
            heads_per_row = self.sparsity_config.num_heads / compress_heads(layout).shape[0]
            # flops of one pad slot: six block matmuls, head_dim 64 assumed, batch 1
            slot_flops = 12 * block * block * 64 * heads_per_row
            self._luts[key] = build_lut(layout, block, self.causal,
                                        bucket_overhead=_BUCKET_OVERHEAD_FLOPS / slot_flops).to(device)
        return self._luts[key]

    # -- forward ----------------------------------------------------------------------------
    def _check(self, query, key, value, key_padding_mask, attn_mask) -> None:
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 4:
                raise ValueError(f"{name} must be [batch, heads, seq, head_dim], got {tuple(t.shape)}")
        if not (query.shape == key.shape and key.shape[:3] == value.shape[:3]):
            raise ValueError(
                f"query, key and value shapes differ: {tuple(query.shape)}, {tuple(key.shape)}, "
                f"{tuple(value.shape)} (self-attention needs equal lengths)"
            )
        if value.shape[-1] != query.shape[-1]:
            raise ValueError("value's head_dim must equal query's head_dim")
        heads = query.shape[1]
        if heads != self.sparsity_config.num_heads:
            raise ValueError(
                f"query has {heads} heads but the sparsity config was built for "
                f"{self.sparsity_config.num_heads}"
            )
        b, _, t, _ = query.shape
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (b, t):
            raise ValueError(
                f"key_padding_mask must be [batch, seq] = {(b, t)}, got {tuple(key_padding_mask.shape)}"
            )
        if attn_mask is not None and tuple(attn_mask.shape) != (t, t):
            raise ValueError(f"attn_mask must be [seq, seq] = {(t, t)}, got {tuple(attn_mask.shape)}")

    def forward(self, query, key, value, key_padding_mask=None, attn_mask=None):
        # The checks depend on the shapes only: asked again when they change (they were a third
        # of the module's host time per call, on top of the compiled kernel's launch).
        shapes = (query.shape, key.shape, value.shape,
                  None if key_padding_mask is None else key_padding_mask.shape,
                  None if attn_mask is None else attn_mask.shape)
        seq_len = query.shape[2]
        if shapes != self._checked_shapes:
            self._check(query, key, value, key_padding_mask, attn_mask)
            self._check_length(seq_len)
            self._checked_shapes = shapes
        scale = 1.0 / math.sqrt(query.shape[-1])
        dropout = self.dropout if self.training else 0.0
        kp = (None if key_padding_mask is None else
              _additive(key_padding_mask, self.key_padding_mask_mode, "key_padding_mask"))
        am = None if attn_mask is None else _additive(attn_mask, self.attn_mask_mode, "attn_mask")
        if self._every_block_present(seq_len):
            return self._dense(query, key, value, kp, am, scale, dropout)
        backend = self.backend_for(query)
        if backend == "flex":
            return flex_block_sparse_attention(
                query, key, value, self.flex_block_mask(seq_len, query.device), scale, kp, am,
                compile_backend="inductor" if self._compiles_flex(query) else None,
                kernel_options=self.flex_kernel_options)
        lut = self.lut(seq_len, query.device)
        if backend == "numba":
            kernels = _cuda_kernels(block=lut.block)
            key_ = ("kernel", seq_len, query.device)
            if key_ not in self._luts:
                self._luts[key_] = kernels.build_kernel_lut(lut.layout, lut.block, query.device)
            return kernels.block_sparse_attention(query, key, value, self._luts[key_], scale,
                                                  kp, am, self.causal, dropout)
        masks = MaskSpec(key_padding=kp, attn=am, causal=self.causal)
        return block_sparse_attention(query, key, value, lut, masks, scale, dropout,
                                      self.workspace_elems, self.save_probs, self._prob_buffer)

    def backend_for(self, query: torch.Tensor) -> str:
        """The backend a call with ``query`` runs on (layouts with every block present aside)."""
        if self.backend == "auto":
            seq_len = query.shape[2]
            return backends.auto_backend(query.device.type, query.dtype, self.dropout,
                                         self.sparsity_config.block, seq_len, self.density(seq_len))
        if self.backend == "numba" and not query.is_cuda:
            raise RuntimeError(f"backend 'numba' (use_kernels=True) needs CUDA tensors; got tensors on {query.device}")
        if self.backend == "flex":
            reason = backends.flex_unavailable_reason(query.device.type)
            if reason is not None:
                raise RuntimeError(f"backend 'flex' unavailable: {reason}")
        return self.backend

    def _compiles_flex(self, query: torch.Tensor) -> bool:
        return query.is_cuda if self.flex_compile is None else self.flex_compile

    def flex_block_mask(self, seq_len: int, device: torch.device):
        """The FlexAttention ``BlockMask`` of ``seq_len`` tokens, built once per length and device."""
        key = ("flex", seq_len, device)
        if key not in self._luts:
            self._luts[key] = layout_block_mask(self.layout(seq_len), self.sparsity_config.block,
                                                seq_len, self.causal, device, self.flex_block_size)
        return self._luts[key]

    def _dense(self, q, k, v, kp, am, scale, dropout):
        if kp is None and am is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scale,
                                                  is_causal=self.causal)
        bias = None
        if kp is not None:
            bias = kp[:, None, None, :]
        if am is not None:
            bias = am if bias is None else bias + am
        if self.causal:
            t = q.shape[2]
            future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu_(1)
            causal_bias = torch.zeros(t, t, device=q.device).masked_fill_(future, float("-inf"))
            bias = causal_bias if bias is None else bias + causal_bias
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout,
                                             scale=scale)
        # Fully masked rows: zero, as on the block-sparse paths (SDPA gives NaN).
        return torch.nan_to_num(out, nan=0.0)


def _cuda_kernels(block: int):
    reason = backends.numba_unavailable_reason(block)
    if reason is not None:
        raise RuntimeError(f"backend 'numba' (use_kernels=True): Numba-CUDA block-sparse kernels unavailable: {reason}")
    from zkit_cuda_numba import attention as kernels

    return kernels

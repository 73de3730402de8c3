"""``OneBitCommunicator``: a communicator whose all-reduce (and reduce-scatter) of floating-point
tensors is 1-bit compressed with error feedback; every other collective goes to the transport.

Used as the ``"onebit"`` communicator (``zkit.Stack(communicator="onebit")``) it turns any
optimizer into error-feedback signSGD-style training: the partitioner's gradient all-reduce sends
one bit per element. The error buffers are per tensor: a tensor is known by the ``key=`` its caller
gives (zkit's partitioners name each gradient unit, ``"grad/3"``, so a unit keeps its buffers while
it travels in a scratch bucket that carries other units too, and after a restart). A caller that
gives no key: by its position in the round of reductions (``"all_reduce/0"``, ...), once the
engine marks the end of a micro-step (the plugin's ``zkit_after_backward`` calls
:meth:`end_round`); before that, by storage address, size and dtype.
"""
from __future__ import annotations

import warnings
from typing import Any, Hashable, Sequence

import torch
import torch.distributed as dist

from zkit.core.communicator import Communicator, DoneHandle, check_op
from zkit_onebit.collectives import compressed_all_reduce, compressed_reduce_scatter
from zkit_onebit.compression import ChunkLayout, ErrorFeedback

#: Tensors smaller than this are reduced exactly: norms, overflow flags and loss values must not be
#: compressed, and for tiny tensors the fixed per-chunk scale costs more than it saves.
DEFAULT_MIN_NUMEL = 4096
#: A caller that hands a new tensor every step would grow error buffers without bound.
DEFAULT_MAX_BUFFERS = 4096


class OneBitCommunicator(Communicator):
    """1-bit compressed ``all_reduce``/``reduce_scatter`` over a transport communicator.

    ``compress``: whether compression is on; off, every call is exact (1-bit Adam turns it on at
    its freeze step). ``compress_reduce_scatter``: compress ``reduce_scatter`` too (ZeRO stages 1
    and 2 reduce gradients with it). ``min_numel``: smaller tensors, and integer tensors, are
    reduced exactly, as are ``max``/``min`` reductions. ``stage_on_host``: route packets through
    host memory (a gloo group carrying CUDA tensors).

    Compressed collectives run synchronously: with ``async_op=True`` the returned handle is
    already complete.
    """

    def __init__(
        self,
        transport: Communicator,
        *,
        compress: bool = True,
        compress_reduce_scatter: bool = True,
        min_numel: int = DEFAULT_MIN_NUMEL,
        max_buffers: int = DEFAULT_MAX_BUFFERS,
        stage_on_host: bool = False,
    ) -> None:
        if not isinstance(transport, Communicator):
            raise TypeError(f"OneBitCommunicator needs a zkit Communicator as transport, got {transport!r}")
        if isinstance(transport, OneBitCommunicator):
            raise TypeError("OneBitCommunicator cannot wrap another OneBitCommunicator")
        if min_numel < 1:
            raise ValueError(f"min_numel must be >= 1, got {min_numel}")
        super().__init__(transport.rank, transport.world_size)
        self.transport = transport
        self.compress = compress
        self.compress_reduce_scatter = compress_reduce_scatter
        self.min_numel = min_numel
        self.max_buffers = max_buffers
        self.stage_on_host = stage_on_host
        self._feedback: dict[Hashable, ErrorFeedback] = {}
        self._pending: dict[Hashable, dict[str, Any]] = {}
        self._warned_layout = False  # a loaded buffer of another layout was reported (once per load)
        self._ordinal: dict[tuple, str] = {}
        self._round: dict[str, int] | None = None

    @property
    def backend(self) -> str | None:
        return getattr(self.transport, "backend", None)

    def set_compression(self, on: bool) -> None:
        """Turn compression on or off (1-bit Adam keeps it off during its warm-up)."""
        self.compress = bool(on)

    # -- error buffers ---------------------------------------------------------------------------
    def _compresses(self, tensor: torch.Tensor, op: str) -> bool:
        return (
            self.compress
            and self.world_size > 1
            and op in ("sum", "avg")
            and tensor.is_floating_point()
            and tensor.numel() >= self.min_numel
        )

    def feedback_for(self, key: Hashable, layout: ChunkLayout, device: torch.device) -> ErrorFeedback:
        """The error buffers of ``key`` (created zero, or from a loaded checkpoint)."""
        fb = self._feedback.get(key)
        if fb is not None and fb.layout == layout:
            return fb
        if fb is None and len(self._feedback) >= self.max_buffers:
            raise RuntimeError(
                f"OneBitCommunicator holds error buffers for {len(self._feedback)} distinct tensors: the "
                f"caller reduces a new tensor every step. Reduce persistent buffers, or pass key= to "
                f"all_reduce/reduce_scatter naming which buffer a tensor is."
            )
        fb = ErrorFeedback.zeros(layout, device, with_server=layout.kind == "flat")
        pending = self._pending.pop(key, None)
        saved = None if pending is None else (pending.get("kind"), pending.get("numel"), pending.get("world_size"))
        if saved == (layout.kind, layout.numel, layout.world_size):
            fb.load_state_dict(pending)
        elif saved is not None and not self._warned_layout:
            # a checkpoint of another ZeRO stage (all-reduce at 0, reduce-scatter at 1-2) or bucket
            # size: as on another world size, the run goes on from zero error buffers
            self._warned_layout = True
            warnings.warn(
                f"1-bit error feedback {key!r} was saved for (kind, numel, world_size) = {saved} and this run "
                f"reduces {(layout.kind, layout.numel, layout.world_size)} (a checkpoint of another ZeRO stage "
                f"or bucket size): starting with zero error buffers",
                stacklevel=2,
            )
        self._feedback[key] = fb
        return fb

    def end_round(self) -> None:
        """Mark the end of one backward's reductions: from now on tensors passed without ``key=``
        are named by their position within a round."""
        self._round = {}

    def _default_key(self, kind: str, tensor: torch.Tensor) -> str:
        if self._round is not None:
            position = self._round.get(kind, 0)
            self._round[kind] = position + 1
            return f"{kind}/{position}"
        identity = (kind, tensor.data_ptr(), tensor.numel(), tensor.dtype, tensor.device)
        key = self._ordinal.get(identity)
        if key is None:
            key = self._ordinal[identity] = f"{kind}/{sum(1 for k in self._ordinal if k[0] == kind)}"
        return key

    def reset_error_feedback(self) -> None:
        """Forget every error buffer (e.g. after the model's buffers were reallocated)."""
        self._feedback.clear()
        self._pending.clear()
        self._ordinal.clear()
        self._round = {} if self._round is not None else None

    def state_dict(self) -> dict[str, Any]:
        """Error buffers keyed by string (explicit ``key=`` strings and the default ordinal names),
        for this rank's checkpoint."""
        out = {str(k): fb.state_dict() for k, fb in self._feedback.items() if isinstance(k, str)}
        out.update({k: v for k, v in self._pending.items() if k not in out})
        return {"world_size": self.world_size, "buffers": out}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore error buffers saved by :meth:`state_dict`; they attach when their key is used."""
        if state.get("world_size") != self.world_size:
            warnings.warn(
                f"1-bit error feedback was saved on {state.get('world_size')} ranks and is restored on "
                f"{self.world_size}: starting with zero error buffers",
                stacklevel=2,
            )
            self.reset_error_feedback()
            return
        self._feedback = {k: v for k, v in self._feedback.items() if not isinstance(k, str)}
        self._pending = dict(state.get("buffers", {}))
        self._warned_layout = False

    # -- compressed collectives -------------------------------------------------------------------
    def all_reduce(self, tensor, op="sum", async_op=False, key: Hashable | None = None):
        check_op(op)
        if not self._compresses(tensor, op):
            handle = self.transport.all_reduce(tensor, op=op, async_op=async_op)
            self.account("all_reduce", self.transport.ring_bytes("all_reduce", _nbytes(tensor)))
            return handle
        layout = ChunkLayout.for_all_reduce(tensor.numel(), self.world_size)
        fb = self.feedback_for(key if key is not None else self._default_key("all_reduce", tensor), layout, tensor.device)
        compressed_all_reduce(self.transport, tensor, fb, op=op, stage_on_host=self.stage_on_host)
        self.account("all_reduce_1bit", 2 * self.transport.ring_bytes("all_gather", layout.packet_bytes * self.world_size))
        return DoneHandle() if async_op else None

    def reduce_scatter(self, output, input, op="sum", async_op=False, key: Hashable | None = None):
        check_op(op)
        if not (self.compress_reduce_scatter and self._compresses(input, op)):
            handle = self.transport.reduce_scatter(output, input, op=op, async_op=async_op)
            self.account("reduce_scatter", self.transport.ring_bytes("reduce_scatter", _nbytes(input)))
            return handle
        layout = ChunkLayout.for_reduce_scatter(input.numel(), self.world_size)
        fb = self.feedback_for(key if key is not None else self._default_key("reduce_scatter", input), layout, input.device)
        compressed_reduce_scatter(self.transport, output, input, fb, op=op, stage_on_host=self.stage_on_host)
        self.account("reduce_scatter_1bit", self.transport.ring_bytes("all_to_all", layout.packet_bytes * self.world_size))
        return DoneHandle() if async_op else None

    # -- delegated collectives --------------------------------------------------------------------
    def all_gather(self, output, input, async_op=False):
        self.account("all_gather", self.transport.ring_bytes("all_gather", _nbytes(output)))
        return self.transport.all_gather(output, input, async_op=async_op)

    def all_to_all(self, output, input, async_op=False):
        self.account("all_to_all", self.transport.ring_bytes("all_to_all", _nbytes(input)))
        return self.transport.all_to_all(output, input, async_op=async_op)

    def broadcast(self, tensor, src, async_op=False):
        # src is a global rank, as in torch.distributed.
        self.account("broadcast", _nbytes(tensor) if dist.get_rank() == src else 0)
        return self.transport.broadcast(tensor, src, async_op=async_op)

    def send(self, tensor, dst):
        self.account("send", _nbytes(tensor))
        self.transport.send(tensor, dst)

    def recv(self, tensor, src):
        self.account("recv", 0)
        self.transport.recv(tensor, src)

    def isend(self, tensor, dst):
        self.account("send", _nbytes(tensor))
        return self.transport.isend(tensor, dst)

    def irecv(self, tensor, src):
        self.account("recv", 0)
        return self.transport.irecv(tensor, src)

    def barrier(self):
        self.transport.barrier()

    def all_gather_object(self, obj):
        return self.transport.all_gather_object(obj)

    def subgroup(self, ranks: Sequence[int]) -> "OneBitCommunicator":
        return type(self)(
            self.transport.subgroup(ranks),
            compress=self.compress,
            compress_reduce_scatter=self.compress_reduce_scatter,
            min_numel=self.min_numel,
            max_buffers=self.max_buffers,
            stage_on_host=self.stage_on_host,
        )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def make_onebit_communicator(group: Any = None, config: Any = None, *, transport: Communicator) -> OneBitCommunicator:
    """Factory of the ``"onebit"`` communicator record (``wraps="torch"``): 1-bit compression over
    ``transport``, the assembly's torch.distributed communicator of ``group``; packets are staged
    through host memory when gloo carries CUDA tensors."""
    host = getattr(transport, "backend", None) == "gloo" and torch.cuda.is_available()
    return OneBitCommunicator(transport, stage_on_host=host)

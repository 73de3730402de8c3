"""Executes one stage's instruction stream with real modules and torch.distributed point-to-point.

Transfers: consecutive transfer instructions are one batch. Its sends are posted at once and not
waited for until the end of the global batch (a send never holds the stage up; this is the model
:func:`zkit_pipeline.simulate.simulate` proves deadlock-free); its receives are posted together
(``batch_isend_irecv``) and waited for. The first tensor crossing each (direction, chunk) carries a
small header with its dtype and shape; later ones reuse the cached shape.

Split backward (``BackwardInput`` / ``BackwardWeight``) uses autograd twice on one retained graph:
first for the input gradient only, then for the weight gradients; torch skips the weight matmuls in
the first pass, but the second walks the chunk's activation-gradient path again.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from zkit.core.assembly import Assembly
from zkit.core.microstep import MicroStep
from zkit_pipeline.module import PipelineModule
from zkit_pipeline.probe import StageProbe
from zkit_pipeline.schedules import (
    Backward,
    BackwardInput,
    BackwardWeight,
    CommInstruction,
    Forward,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    forward_only,
)
from zkit_pipeline.schedules.instructions import is_first_virtual, is_last_virtual, peer_of
from zkit_pipeline.topology import ProcessGrid

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_HEADER = 10  # dtype, ndim, up to 8 dims


class PipelineRunner:
    """Runs global batches of a :class:`PipelineModule` on this rank.

    ``step`` is called at ``OptimizerStep`` (``engine.run_optimizer_step``, or a plain optimizer's step
    and zero_grad). ``partitioner`` (ZeRO) reduces data-parallel gradients; without one, gradients
    are averaged over the data axis of ``grid``. ``micro_step`` (an engine's
    :class:`zkit.core.microstep.MicroStep`) scales the loss and runs around every backward that
    accumulates weight gradients, with the hooks and the partitioner's reduction, as
    ``engine.backward`` does; without one the loss is averaged over the micro-batches.
    Construction is collective (creates groups).
    """

    def __init__(
        self,
        module: PipelineModule,
        schedule: Callable[..., Iterable[Any]],
        micro_batches: int,
        *,
        grid: ProcessGrid | None = None,
        step: Callable[[], Any] | None = None,
        partitioner: Any = None,
        schedule_params: dict[str, Any] | None = None,
        micro_step: MicroStep | None = None,
        comm: Any = None,
        probe: "StageProbe | None" = None,
        assembly: Assembly | None = None,
    ) -> None:
        rank = dist.get_rank()
        self.grid = grid or module.grid or ProcessGrid(pipe=module.num_stages, data=dist.get_world_size() // module.num_stages)
        if self.grid.degree("pipe") != module.num_stages:
            raise ValueError(
                f"PipelineRunner: the grid has {self.grid.degree('pipe')} pipeline stages but the module "
                f"{module.num_stages}"
            )
        self.module, self.schedule, self.m = module, schedule, micro_batches
        self.params = dict(schedule_params or {})
        if module.virtual_stages > 1:
            self.params.setdefault("virtual_stages", module.virtual_stages)
        self.step_fn, self.partitioner = step, partitioner
        #: where this stage's activations live: receive buffers, shape headers and the loss go
        #: there too (NCCL moves device tensors only)
        self.device = next((p.device for p in module.parameters()), torch.device("cpu"))
        if partitioner is not None and micro_step is None:
            raise ValueError("PipelineRunner: a partitioner is driven through micro_step= (the engine's protocol)")
        self.micro_step = micro_step or _Unscaled(micro_batches)
        self.coord = self.grid.coord(rank)
        if self.coord.pipe != module.stage_id:
            raise ValueError(f"PipelineRunner: rank {rank} is pipeline stage {self.coord.pipe}, module stage {module.stage_id}")
        # every group's communicator is the assembly's (the engine's; else the installed plugins')
        assembly = assembly or Assembly.build()
        if self.grid is module.grid and module.grid_groups:
            # the module created the grid's groups (and its tied groups) when it was built
            self.comms = {axis: assembly.communicator(g) for axis, g in module.grid_groups.items()}
        else:
            self.comms = self.grid.build(rank, communicator=lambda group, _config: assembly.communicator(group))
            module.setup_tied(self.grid, rank)
        module.bind_communicators(assembly)
        stage = getattr(partitioner, "stage", None)
        if stage is not None and stage >= 3:
            raise ValueError(
                f"PipelineRunner: ZeRO stage {stage} is not supported with pipeline parallelism (its "
                f"parameters are gathered per forward, which the pipeline's chunks do not do); use ZeRO "
                f"stage 0, 1 or 2"
            )
        if stage == 2 and module.ties_stages:
            raise ValueError(
                f"PipelineRunner: ZeRO stage {stage} with a TiedLayerSpec shared by several pipeline "
                f"stages is not supported: stage {stage} frees each gradient into its shard during "
                f"backward, before the tied gradients can be summed across stages; use ZeRO stage 0 or 1"
            )
        #: carries activations and gradients between stages (global ranks): ``comm`` when given
        #: (the engine's world communicator, which counts them), else the pipe group's
        self.p2p = comm if comm is not None else self.comms["pipe"]
        #: per-instruction timers and saved-activation bytes (off unless a probe is given)
        self.probe: StageProbe = probe or StageProbe(enabled=False)
        self._training_channels = True
        # shapes are exchanged once per channel and cached on both ends
        self._shapes: dict[tuple[str, int, int], tuple[torch.dtype, tuple[int, ...]]] = {}
        self._sent_header: set[tuple[str, int, int]] = set()

    # -- point-to-point --------------------------------------------------------------------------
    def _peer_rank(self, inst: CommInstruction) -> int:
        stage, _ = peer_of(inst, self.module.stage_id, self.module.num_stages)
        return self.grid.rank(pipe=stage, data=self.coord.data, tensor=self.coord.tensor)

    def _key(self, inst: CommInstruction, sending: bool) -> tuple[str, int, int]:
        kind = "act" if isinstance(inst, (SendActivation, RecvActivation)) else "grad"
        _, peer_chunk = peer_of(inst, self.module.stage_id, self.module.num_stages)
        if not self._training_channels:
            kind += "-eval"  # evaluation batches may have other shapes than training ones
        # both ends name the channel by (kind, sender chunk, receiver chunk)
        return (kind, inst.chunk, peer_chunk) if sending else (kind, peer_chunk, inst.chunk)

    def _transfer(self, batch: list[CommInstruction], st: "_State") -> None:
        self._training_channels = st.train
        # a sent tensor is held until its send completed, not to the end of the batch
        st.keep = [(work, t) for work, t in st.keep if not _completed(work)]
        ops = []
        for inst in batch:
            if isinstance(inst, (SendActivation, SendGrad)):
                t = st.outbox.pop((inst.micro_batch, inst.chunk, type(inst)))
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"pipeline stages pass one tensor between stages; chunk {inst.chunk} produced {type(t).__name__}")
                t = t.detach().contiguous()
                key, peer = self._key(inst, True), self._peer_rank(inst)
                if key not in self._sent_header:
                    self._sent_header.add(key)
                    st.pending.append(self.p2p.isend(_header(t), peer))
                st.pending.append(self.p2p.isend(t, peer))
                st.keep.append((st.pending[-1], t))
        for inst in batch:
            if isinstance(inst, (RecvActivation, RecvGrad)):
                key, peer = self._key(inst, False), self._peer_rank(inst)
                if key not in self._shapes:
                    h = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
                    self.p2p.recv(h, peer)
                    self._shapes[key] = (_DTYPES[int(h[0])], tuple(int(d) for d in h[2 : 2 + int(h[1])]))
                dtype, shape = self._shapes[key]
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                ops.append((buf, peer))
                st.inbox[(inst.micro_batch, inst.chunk, type(inst))] = buf
        # every receive posted before any is waited for: a peer may be receiving from us too
        for work in [self.p2p.irecv(buf, peer) for buf, peer in ops]:
            work.wait()

    # -- one global batch ------------------------------------------------------------------------
    def train_batch(self, data_iter: Iterator[Any]) -> torch.Tensor:
        """Run the schedule once over ``micro_batches`` micro-batches; return the mean loss (on
        every rank)."""
        mod, p, s = self.module, self.module.num_stages, self.module.stage_id
        stream = list(self.schedule(p, s, self.m, **self.params))
        # The data-parallel reduction starts in the last instruction that produces weight gradients
        # (overlapping its backward), as the engine's last micro-step does. Tied gradients must be
        # summed across stages before that reduction, so with ties it waits for ReduceGrads.
        weight_grads = [i for i, x in enumerate(stream) if isinstance(x, (Backward, BackwardWeight))]
        boundary_at = weight_grads[-1] if weight_grads and not mod.ties_stages else None
        mod.train()
        self._parameters_ready()
        st = _State(train=True)
        with self.probe.batch(), self.probe.saved_tensors(mod):
            self._execute(stream, st, data_iter, boundary_at)
        return self._mean_loss(st.losses)

    def eval_batch(self, data_iter: Iterator[Any]) -> torch.Tensor:
        """Forward ``micro_batches`` micro-batches through the stages without gradients; return
        their mean loss (on every rank of the pipe group, from the last stage). Parameters,
        gradients and the optimizer are untouched; the module's train/eval mode is restored."""
        mod = self.module
        stream = list(forward_only(mod.num_stages, mod.stage_id, self.m, virtual_stages=mod.virtual_stages))
        was_training = mod.training
        mod.eval()
        self._parameters_ready()
        st = _State(train=False)
        try:
            with torch.no_grad():
                self._execute(stream, st, data_iter, None)
        finally:
            mod.train(was_training)
        return self._mean_loss(st.losses)

    def _parameters_ready(self) -> None:
        """A partitioner that refreshes parameters in the background after its step (ZeRO's
        ``overlap_param_gather``) is waited for here: the stages' chunks run outside
        ``engine.forward``, where the engine would wait."""
        wait = getattr(self.partitioner, "wait_for_parameters", None)
        if wait is not None:
            wait()

    def _execute(self, stream: list[Any], st: "_State", data_iter: Iterator[Any], boundary_at: int | None) -> None:
        mod, p, s, v = self.module, self.module.num_stages, self.module.stage_id, self.module.virtual_stages
        i = 0
        while i < len(stream):
            inst = stream[i]
            if isinstance(inst, CommInstruction):
                j = i
                while j < len(stream) and isinstance(stream[j], CommInstruction):
                    j += 1
                self._transfer(stream[i:j], st)
                i = j
                continue
            mb, c = getattr(inst, "micro_batch", 0), getattr(inst, "chunk", 0)
            first, last = is_first_virtual(s, c), is_last_virtual(s, c, p, v)
            if isinstance(inst, LoadMicroBatch):
                st.batches[mb] = next(data_iter)
            elif isinstance(inst, Forward):
                x = st.batches[mb][0] if first else st.inbox.pop((mb, c, RecvActivation))
                if st.train and not first and x.is_floating_point():
                    x.requires_grad_(True)
                with self.probe.compute(inst):
                    out = mod(x, chunk=c)  # the module's call: torch.compile of the module applies
                    if last:
                        loss = mod.loss_fn(out, st.batches[mb][1])
                        st.losses.append(loss.detach())
                        st.loss_of[mb] = loss
                        out = self.micro_step.scale(loss)
                if last:
                    st.batches.pop(mb, None)
                else:
                    st.outbox[(mb, c, SendActivation)] = out
                if st.train:
                    st.saved[(mb, c)] = (x, out)
            elif isinstance(inst, (Backward, BackwardInput)):
                x, out = st.saved[(mb, c)]
                grad = None if last else st.inbox.pop((mb, c, RecvGrad))
                if isinstance(inst, Backward):
                    st.saved.pop((mb, c))
                    with self.micro_step.backward(st.micro_loss(mb, last), i == boundary_at), \
                            self.probe.compute(inst):
                        if out.requires_grad:  # not on a first stage whose parameters are all frozen
                            torch.autograd.backward(out, grad)
                    gx = x.grad if not first else None
                else:  # input gradient only: no parameter's .grad is touched
                    st.grads[(mb, c)] = grad
                    with self.probe.compute(inst):
                        gx = None if first else torch.autograd.grad(out, x, grad, retain_graph=True)[0]
                if not first:
                    st.outbox[(mb, c, SendGrad)] = gx
            elif isinstance(inst, BackwardWeight):
                x, out = st.saved.pop((mb, c))
                params = [q for q in mod.chunks[c].parameters() if q.requires_grad]
                with self.micro_step.backward(st.micro_loss(mb, last), i == boundary_at), \
                        self.probe.compute(inst):
                    if params:
                        torch.autograd.backward(out, st.grads.pop((mb, c)), inputs=params)
            elif isinstance(inst, ReduceTiedGrads):
                mod.reduce_tied_grads()
            elif isinstance(inst, ReduceGrads):
                self._reduce_grads(reduced=boundary_at is not None)
            elif isinstance(inst, OptimizerStep):
                for work in st.pending:
                    work.wait()
                st.pending.clear()
                if self.step_fn is not None:
                    self.step_fn()
            i += 1
        for work in st.pending:
            work.wait()

    def _reduce_grads(self, reduced: bool) -> None:
        """Average gradients over the data axis, unless the last weight backward already did."""
        if self.partitioner is not None:
            if not reduced:
                self.micro_step.reduce()
            return
        data = self.comms.get("data")
        if data is None or data.world_size == 1:
            return
        for q in self.module.parameters():
            if q.requires_grad:
                if q.grad is None:
                    q.grad = torch.zeros_like(q)
                data.all_reduce(q.grad, op="avg")

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The batch's loss on every rank, as DeepSpeed's ``train_batch`` returns it: the last
        stage's mean over micro-batches, averaged over the data-parallel replicas, detached."""
        value = torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)
        value = value.detach().float().reshape(1).clone()
        pipe = self.comms["pipe"]
        last = self.grid.rank(pipe=self.module.num_stages - 1, data=self.coord.data, tensor=self.coord.tensor)
        pipe.broadcast(value, src=last)
        data = self.comms.get("data")
        if data is not None and data.world_size > 1:
            data.all_reduce(value, op="avg")
        return value[0]


class _State:
    """Tensors in flight during one global batch (``train``: with backward, else forward only)."""

    def __init__(self, train: bool) -> None:
        self.train = train
        self.batches: dict[int, Any] = {}
        self.saved: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.grads: dict[tuple[int, int], torch.Tensor | None] = {}
        self.inbox: dict[tuple, torch.Tensor] = {}
        self.outbox: dict[tuple, Any] = {}
        self.losses: list[torch.Tensor] = []
        #: the last stage's loss of each micro-batch until its weight gradients are computed
        self.loss_of: dict[int, torch.Tensor] = {}
        self.pending: list[Any] = []
        self.keep: list[tuple[Any, torch.Tensor]] = []


    def micro_loss(self, micro_batch: int, last: bool) -> torch.Tensor | None:
        """The loss the micro-step hooks see: the micro-batch's on the last stage (its last
        weight-gradient pass takes it), None on the stages before."""
        return self.loss_of.pop(micro_batch, None) if last else None


class _Unscaled:
    """The micro-step of a runner without an engine: the loss averaged over the micro-batches,
    no hooks and no partitioner."""

    def __init__(self, micro_batches: int) -> None:
        self.m = micro_batches

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss / self.m

    def backward(self, loss: torch.Tensor | None, boundary: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def reduce(self) -> None:
        pass


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > _HEADER - 2:
        raise ValueError(f"pipeline transfers support up to {_HEADER - 2} dimensions, got {t.dim()}")
    if t.dtype not in _DTYPES:
        raise ValueError(f"pipeline transfers do not support dtype {t.dtype}")
    h = [0] * _HEADER
    h[0], h[1] = _DTYPES.index(t.dtype), t.dim()
    h[2 : 2 + t.dim()] = t.shape
    return torch.tensor(h, dtype=torch.int64, device=t.device)  # where the activation is: NCCL's rule


def _completed(work: Any) -> bool:
    """Whether a send's handle has finished (one without ``is_completed`` finished on return)."""
    is_completed = getattr(work, "is_completed", None)
    return True if is_completed is None else bool(is_completed())

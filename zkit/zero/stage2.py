"""Stage 2: optimizer states and gradients partitioned.

No full-size gradient buffer exists. Autograd produces each parameter's gradient as usual; when all
gradients of a unit are final, they are packed into a bucket (scratch of one unit), the bucket is
reduce-scattered into this rank's gradient shard, and the parameters' ``.grad`` are freed. This
happens at every micro-step (accumulation happens in the shard), overlapped with the rest of
backward when ``overlap_comm`` is on (scratch for two of the largest unit, shared by as many units as
fit: :class:`~zkit.zero.buckets.ScratchRing`). Between steps neither the shards nor
the buckets exist: :meth:`zero_grad` hands them back. Per-rank model states: 2Ψ + 14Ψ/N;
communication: the same 2Ψ as data parallelism (reduce-scatter + all-gather).

With the optimizer offloaded (:meth:`~zkit.core.allocator.Allocator.grads_beside_master`), the shards are
fp32 ``"master_grad"`` buffers in host memory instead: each reduced chunk is copied out of its
bucket on the compute stream as it completes (ZeRO-Offload), so the device holds no gradient
shards at all, only the buckets; later micro-steps land in a host staging shard and are added at
the end of backward. Where the chunks land is the gradient sink's (:mod:`zkit.zero.grad_sinks`):
these shards, or a master store that takes the gradients itself (NVMe), behind one path here.

At one replica there is nothing to reduce and a unit's shard is the whole unit: the shards are the
parameters' gradients themselves, written in place (each ``.grad`` a view of its unit's buffer,
DDP's ``gradient_as_bucket_view``; :class:`~zkit.zero.grad_sinks.GradViews`), unless they must be
copied anyway (beside an offloaded master, into a store, in another accumulation dtype, or scaled
before and after a reduction).
"""
from __future__ import annotations

import contextlib

import torch

from zkit.zero.buckets import GradientBucketer, ScratchRing
from zkit.zero.config import zero_config
from zkit.zero.grad_buffers import GradBuffers
from zkit.zero.grad_sinks import GradShards, GradViews, ParamGrads, StoreGrads
from zkit.zero.scratch_buckets import ScratchBuckets
from zkit.zero.zero_partitioner import ZeroPartitioner


class Stage2(ZeroPartitioner):
    stage = 2

    def _init_grads(self) -> None:
        #: where the reduced chunks land (:mod:`zkit.zero.grad_sinks`): the shards in memory, a
        #: master store that takes the gradients itself (NVMe), or at one replica the parameters'
        #: gradients themselves
        store = self.master_store
        if store.takes_grads:
            self.grads: GradShards | StoreGrads | GradViews | ParamGrads = (
                ParamGrads(self.unit_params, store) if self._store_grads_in_place() else StoreGrads(store))
        elif self._grads_in_place():
            self.grads = GradViews(GradBuffers(self.units, self.unit_params, self.allocator, self.dtype))
        else:
            self.grads = GradShards(self.units, self.allocator, self.accum_dtype, self.comm_dtype,
                                    self.allocator.grads_beside_master(), self.ctx.device)
        buckets = 2 if zero_config(self.ctx.config).overlap_comm and len(self.units) > 1 else 1
        self._ring = ScratchRing(max((u.padded for u in self.units), default=0), buckets)
        #: where the gradients are packed for their reduction (their views made once)
        self.buckets = ScratchBuckets(self._ring, self.units, self.comm_dtype, self.allocator, self.rank)
        self._launched: dict[int, torch.Tensor] = {}
        self.bucketer = GradientBucketer(
            [len(ps) for ps in self.unit_params],
            self._launch,
            self._finish,
            names=self.unit_names(),
            fits=lambda unit: self._ring.fits(self.units[unit].padded),
        )

    def _grads_in_place(self) -> bool:
        """Whether the shards can be the parameters' gradients (see the module docstring): one
        replica, shards of the parameters' dtype on their device, nothing scaled around a reduction."""
        return (self.comm.world_size == 1 and not self.allocator.grads_beside_master()
                and self.allocator.place("grad") == self.ctx.device and self.accum_dtype == self.dtype
                and self.pre_scale == 1.0 and self.post_scale == 1.0)

    def _store_grads_in_place(self) -> bool:
        """Whether a store that takes the gradients takes them where autograd leaves them (its
        memory is the training device's, :attr:`~zkit.core.stores.MasterStore.shares_buffers`): one
        replica, fp32 gradients, nothing scaled. Each complete unit's parameters' gradients then go
        to its ``add_grad_in_place``: no buffer, no bucket, no copy."""
        return (self.master_store.shares_buffers and self.comm.world_size == 1 and self.dtype == torch.float32
                and self.accum_dtype == self.dtype and self.allocator.place("master_grad") == self.ctx.device
                and self.pre_scale == 1.0 and self.post_scale == 1.0)

    @property
    def keeps_grad_buffers(self) -> bool:
        """Gradients written in place are the same buffers every step."""
        return isinstance(self.grads, GradViews)

    @property
    def grad_shards(self) -> list[torch.Tensor]:
        """Per unit, this rank's reduced gradient; empty between steps (made at the first reduction
        of a batch), and always empty with a master store that takes the gradients itself."""
        return self.grads.shards

    @property
    def grads_beside_master(self) -> bool:
        """The shards are fp32 host buffers beside the master (optimizer offload), filled by copies
        out of the buckets."""
        return self.grads.beside_master

    @property
    def staged_grads(self) -> list[torch.Tensor]:
        """Beside the master: a later micro-step's chunks, until backward ends."""
        return self.grads.staged

    @property
    def hooks_each_gradient(self) -> bool:
        # one replica, written in place: no bucket to fill, each gradient is in its view already
        return not isinstance(self.grads, GradViews)

    def no_sync_allowed(self) -> bool:
        return False

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if self.grads.in_place:
            self.grads.take(param)
        self.bucketer.ready(self.unit_of[id(param)])

    def backward_context(self, boundary: bool):
        if not self.gradient_reduction:
            raise RuntimeError(
                "ZeRO stage 2 reduces gradients at every micro-step; gradient reduction cannot be switched off"
            )
        if self.grads.in_place:
            if not self._hooked:  # a backward outside the engine's may have left its own .grad
                self.grads.buffers.take_all()
            self.grads.hold()
        return contextlib.nullcontext()

    def after_backward(self, boundary: bool) -> None:
        self.bucketer.flush()
        self.grads.end_backward()
        if not self._hooked:
            self.grads.buffers.take_all()

    def _launch(self, unit: int):
        if self.grads.in_place:
            return None  # one replica: the gradients are in their shard already
        bucket = self.buckets.take(unit)
        flat = bucket.flat
        # Into the sink's memory, or in place into the bucket's own chunk (gloo and NCCL allow an
        # output that is this rank's chunk of the input): no landing area beyond the bucket.
        target = self.grads.reduce_target(unit, bucket.chunk)
        params = self.unit_params[unit]
        bucket.fill([p.grad for p in params])
        for p in params:
            p.grad = None
        if self.pre_scale != 1.0:
            bucket.real.mul_(self.pre_scale)
        self._launched[unit] = target
        if self.comm.world_size == 1:
            if target.data_ptr() != flat.data_ptr():  # else the chunk is the whole bucket already
                target.copy_(flat)
            return None
        return self.comm.reduce_scatter(target, flat, self.reduce_op, async_op=True, key=self.unit_key(unit))

    def _finish(self, unit: int) -> None:
        if self.grads.in_place:
            self.grads.unit_complete(unit)
            return
        target = self._launched.pop(unit)
        if self.post_scale != 1.0:
            target.mul_(self.post_scale)
        self.grads.add_grad(unit, target)
        self.buckets.give_back()

    def reduced_grad_shards(self):
        if not self._hooked:  # a backward outside the engine's may have left its own .grad
            self.grads.buffers.take_all()
        return self.grads.get()

    def zero_grad(self) -> None:
        # Between steps no gradient memory is held: the shards and the scratch buckets go back to
        # the allocator and are made again by the next batch's first reduction (as DeepSpeed and
        # torch's zero_grad(set_to_none=True) do). Peak memory during a step is unchanged.
        self.master_store.zero_grad()
        self.grads.release()
        self.buckets.release()
        for params in self.unit_params:
            for p in params:
                p.grad = None

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
the end of backward.
"""
from __future__ import annotations

import contextlib

import torch

from zkit.zero.buckets import GradientBucketer, ScratchRing
from zkit.zero.zero_partitioner import ZeroPartitioner


class Stage2(ZeroPartitioner):
    stage = 2

    def _init_grads(self) -> None:
        #: per unit, this rank's reduced gradient; empty between steps (made at the first reduction
        #: of a batch), and always empty with a master store that takes the gradients itself (NVMe).
        self.grad_shards: list[torch.Tensor] = []
        self.store_takes_grads = self.master_store.takes_grads
        self.accumulated = False  # do the shards already hold earlier micro-steps of this batch?
        #: the shards are fp32 host buffers beside the master (optimizer offload), filled by copies
        #: out of the buckets; ``_staged`` holds a later micro-step's chunks until backward ends
        self.grads_beside_master = not self.store_takes_grads and self.allocator.grads_beside_master()
        self._staged: list[torch.Tensor] = []
        buckets = 2 if self.ctx.config.zero_optimization.overlap_comm and len(self.units) > 1 else 1
        self._ring = ScratchRing(max((u.padded for u in self.units), default=0), buckets)
        #: the ring's segments (a bucket of the largest unit each), made by a batch's reductions as
        #: needed and handed back after the step
        self._segments: list[torch.Tensor | None] = [None] * buckets
        self._launched: dict[int, torch.Tensor] = {}
        self.bucketer = GradientBucketer(
            [len(ps) for ps in self.unit_params],
            self._launch,
            self._finish,
            names=self.unit_names(),
            fits=lambda unit: self._ring.fits(self.units[unit].padded),
        )

    def no_sync_allowed(self) -> bool:
        return False

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self.bucketer.ready(self.unit_of[id(param)])

    def backward_context(self, boundary: bool):
        if not self.gradient_reduction:
            raise RuntimeError(
                "ZeRO stage 2 reduces gradients at every micro-step; gradient reduction cannot be switched off"
            )
        return contextlib.nullcontext()

    def after_backward(self, boundary: bool) -> None:
        self.bucketer.flush()
        if self.grads_beside_master:
            # the copies out of the buckets were queued on the compute stream: the host reads the
            # shards (norm, step) and adds the staged micro-step only once they have landed
            if self.ctx.device.type != "cpu":
                torch.accelerator.synchronize(self.ctx.device)
            for shard, staged in zip(self.grad_shards, self._staged):
                shard.add_(staged)
            for staged in self._staged:
                self.allocator.release(staged, "master_grad")
            self._staged = []
        self.accumulated = True

    def _take_bucket(self, numel: int) -> torch.Tensor:
        seg, start, end = self._ring.take(numel)
        if self._segments[seg] is None:
            self._segments[seg] = self.allocator.empty(self._ring.segment, self.comm_dtype, "bucket")
        return self._segments[seg][start:end]

    def _ensure_grad_shards(self, overwritten: bool = False) -> list[torch.Tensor]:
        """The gradient shards, made if the batch has none yet; ``overwritten``: the caller is the
        batch's first reduction, which writes every shard whole (all units are reduced by the end
        of backward), so they need not be zeroed first."""
        if not self.grad_shards and not self.store_takes_grads:
            make = self.allocator.empty if overwritten else self.allocator.zeros
            if self.grads_beside_master:
                self.grad_shards = [make(u.shard, torch.float32, "master_grad") for u in self.units]
            else:
                self.grad_shards = [make(u.shard, self.accum_dtype, "grad") for u in self.units]
        return self.grad_shards

    def _launch(self, unit: int):
        u = self.units[unit]
        # the first micro-step reduces straight into the shards, unless through a wider dtype
        # (beside the master, the first micro-step's copies write the shards whole)
        self._ensure_grad_shards(overwritten=not self.accumulated and (
            self.accum_dtype == self.comm_dtype or self.grads_beside_master))
        flat = self._take_bucket(u.padded)
        for slot, p in zip(u.slots, self.unit_params[unit]):
            view = flat[slot.offset : slot.offset + slot.numel]
            if p.grad is None:
                view.zero_()  # unused in this forward
            else:
                view.copy_(p.grad.reshape(-1))
                p.grad = None
        flat[u.numel :].zero_()
        if self.pre_scale != 1.0:
            flat[: u.numel].mul_(self.pre_scale)
        if (self.accumulated or self.store_takes_grads or self.accum_dtype != self.comm_dtype
                or self.grads_beside_master):
            # Later micro-steps reduce in place into the bucket's own chunk (gloo and NCCL allow
            # an output that is this rank's chunk of the input), then add it to the shard: no
            # landing area beyond the bucket. A master store takes every micro-step's chunk; a
            # wider accumulation dtype takes it through an add that converts.
            lo, hi = u.shard_range(self.rank)
            target = flat[lo:hi]
        else:
            target = self.grad_shards[unit]
        self._launched[unit] = target
        if self.comm.world_size == 1:
            if target.data_ptr() != flat.data_ptr():  # else the chunk is the whole bucket already
                target.copy_(flat)
            return None
        return self.comm.reduce_scatter(target, flat, self.reduce_op, async_op=True, key=self.unit_key(unit))

    def _finish(self, unit: int) -> None:
        target = self._launched.pop(unit)
        if self.post_scale != 1.0:
            target.mul_(self.post_scale)
        if self.store_takes_grads:
            self.master_store.add_grad(unit, target)
        elif self.grads_beside_master:
            # on the compute stream, so the bucket is not written again before the copy has read it
            if not self.accumulated:
                self.grad_shards[unit].copy_(target, non_blocking=True)
            else:
                if not self._staged:
                    self._staged = [self.allocator.empty(u.shard, torch.float32, "master_grad") for u in self.units]
                self._staged[unit].copy_(target, non_blocking=True)
        elif target is not self.grad_shards[unit]:
            self.grad_shards[unit].add_(target)
        self._ring.give_back()

    def _grad_shards(self):
        if self.store_takes_grads:
            raise RuntimeError("the gradient shards are in the allocator's master store (NVMe offload), not in memory")
        return self._ensure_grad_shards()

    def zero_grad(self) -> None:
        # Between steps no gradient memory is held: the shards and the scratch buckets go back to
        # the allocator and are made again by the next batch's first reduction (as DeepSpeed and
        # torch's zero_grad(set_to_none=True) do). Peak memory during a step is unchanged.
        self.master_store.zero_grad()
        for shard in self.grad_shards:
            self.allocator.release(shard, "master_grad" if self.grads_beside_master else "grad")
        for segment in self._segments:
            if segment is not None:
                self.allocator.release(segment, "bucket")
        self.grad_shards, self._segments = [], [None] * self._ring.count
        for params in self.unit_params:
            for p in params:
                p.grad = None
        self.accumulated = False

"""Built-in plugin: the communicator over ``torch.distributed`` (gloo, NCCL), registered as
``torch`` by :mod:`zkit.torch_distributed.communicator`.

Public names: :class:`DeferredCommunicator`, the communicator an object built before the engine
(a tensor-parallel layer, weights tied across pipeline stages) holds until it is bound to an
engine's assembly (:mod:`zkit.torch_distributed.deferred_communicator`)."""
from zkit.torch_distributed.deferred_communicator import DeferredCommunicator

__all__ = ["DeferredCommunicator"]

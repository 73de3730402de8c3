"""Built-in plugin: the communicator over ``torch.distributed`` (gloo, NCCL), registered as
``torch`` by :mod:`zkit.torch_distributed.communicator`."""

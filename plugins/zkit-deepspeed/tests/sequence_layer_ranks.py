"""Rank function of test_sequence_layer.py: DeepSpeed's DistributedAttention on the drop-in against
attention over the whole sequence in one process."""
from __future__ import annotations

import torch


def sdpa(q, k, v, layout):
    """The local attention DeepSpeed's examples pass: causal SDPA over ``layout``'s tensors."""
    def heads_first(t):
        return t.permute(0, 2, 1, 3) if layout == 0 else t.permute(1, 2, 0, 3)

    q, k, v = heads_first(q), heads_first(k), heads_first(v)
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.permute(0, 2, 1, 3) if layout == 0 else out.permute(2, 0, 1, 3)


def distributed_attention(layout: int, kv_heads: int) -> dict:
    from deepspeed.sequence.layer import DistributedAttention

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(0)
    seq, batch, heads, dim = 16, 2, 4, 8
    shape = (batch, seq, heads, dim) if layout == 0 else (seq, batch, heads, dim)
    kv_shape = shape[:2] + (kv_heads, dim)
    q, k, v = torch.randn(shape, generator=g), torch.randn(kv_shape, generator=g), torch.randn(kv_shape, generator=g)
    seq_dim = 1 if layout == 0 else 0
    width = seq // world
    mine = [t.narrow(seq_dim, rank * width, width).clone().requires_grad_() for t in (q, k, v)]
    attn = DistributedAttention(lambda a, b, c: sdpa(a, b, c, layout), torch.distributed.group.WORLD)
    out = attn(*mine, layout)
    out.square().sum().backward()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = sdpa(*whole, layout)
    want.square().sum().backward()
    return {"out": (out - want.narrow(seq_dim, rank * width, width)).abs().max().item(),
            "grads": max((m.grad - w.grad.narrow(seq_dim, rank * width, width)).abs().max().item()
                         for m, w in zip(mine, whole)),
            "bytes": attn.comm.stats()["all_to_all"]["bytes"], "shape": tuple(out.shape)}


def groups_after_initialize() -> dict:
    """``deepspeed.initialize`` with ``sequence_parallel_size`` 2 over zkit-sequence's model: what
    DeepSpeed's ``groups`` accessors answer."""
    import deepspeed
    from deepspeed.utils import groups
    from zkit_sequence.llama import LlamaConfig, LlamaLM

    model = LlamaLM(LlamaConfig(vocab_size=32, n_layer=1, d_model=16, n_head=2, n_kv_head=2, ffn=16, max_seq_len=8))
    engine, *_ = deepspeed.initialize(model=model, config={
        "sequence_parallel_size": 2, "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    group = groups._get_sequence_parallel_group()
    out = {"size": groups._get_sequence_parallel_world_size(), "rank": groups._get_sequence_parallel_rank(),
           "same": group is engine.sequence_parallel_group, "train_batch": engine.train_batch_size(),
           "seq_dp": groups._get_sequence_data_parallel_world_size()}
    engine.destroy()
    groups._set_sequence_parallel_group(None)
    return out


def adapter_batches() -> list[dict]:
    """DeepSpeed's own test of UlyssesSPDataLoaderAdapter (tests/unit/ulysses_alst/test_ulysses_sp_hf.py):
    the first two batches each rank gets, as lists."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    def collate(batch):
        input_ids, position_ids = batch[0]
        return dict(input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0),
                    labels=input_ids.unsqueeze(0))

    ds = torch.utils.data.TensorDataset(torch.tensor([[1, 10, 10, 10, 2, 2], [1, 20, 20, 20, 2, 2]]),
                                        torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]))
    dl = torch.utils.data.DataLoader(ds, batch_size=1, collate_fn=collate)
    adapter = UlyssesSPDataLoaderAdapter(dl, sp_rank=torch.distributed.get_rank(), sp_group=None,
                                         sp_world_size=2, device="cpu")
    return [{k: v.tolist() for k, v in next(adapter).items()} for _ in range(2)]

"""Rank functions of test_ulysses_hf.py: DeepSpeed's UlyssesSPAttentionHF on the drop-in against
the same attention over the whole sequence in one process."""
from __future__ import annotations

import torch

VOCAB, SEQ, BATCH, HEADS, DIM = 64, 16, 2, 4, 8


class _Attention(torch.nn.Module):
    """What Transformers' attention functions read from the attention module."""

    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.num_key_value_groups = HEADS // kv_heads
        self.is_causal = True


def hf_attention(kv_heads: int) -> dict:
    """Transformers' sdpa attention function run by UlyssesSPAttentionHF on this rank's slice of the
    sequence: the output slice and the inputs' gradients against the whole sequence's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, HEADS, SEQ, DIM, generator=g)
    k, v = (torch.randn(BATCH, kv_heads, SEQ, DIM, generator=g) for _ in range(2))
    width = SEQ // world
    mine = [t[:, :, rank * width:(rank + 1) * width].clone().requires_grad_() for t in (q, k, v)]
    module = _Attention(kv_heads)
    attn = UlyssesSPAttentionHF(sdpa_attention_forward, batch_size=BATCH, attn_head_count=HEADS, attn_head_size=DIM,
                                kv_head_count=kv_heads, num_hidden_layers=1,
                                process_group=torch.distributed.group.WORLD, seq_length_is_variable=True)
    positions = torch.arange(SEQ)[rank * width:(rank + 1) * width].expand(BATCH, -1)
    out, _ = attn(module, *mine, None, position_ids=positions)  # [batch, seq / P, heads * dim]
    out.square().sum().backward()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want, _ = sdpa_attention_forward(module, *whole, None)  # [batch, seq, heads, dim]
    want.square().sum().backward()
    want = want.reshape(BATCH, SEQ, -1)[:, rank * width:(rank + 1) * width]
    return {"out": (out - want).abs().max().item(), "shape": tuple(out.shape),
            "grads": max((m.grad - w.grad[:, :, rank * width:(rank + 1) * width]).abs().max().item()
                         for m, w in zip(mine, whole)),
            "groups_after": module.num_key_value_groups, "bytes": attn.comm.stats()["all_to_all"]["bytes"]}


def tiny_llama(kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HEADS * DIM, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=kv_heads,
                                        max_position_embeddings=SEQ, attn_implementation="sdpa"))


def llama_logits() -> dict:
    """A Llama's logits with register_with_transformers, each rank its slice of the sequence,
    against the model's over the whole sequence before registering; and the groups it returned."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).expand(BATCH, -1)
    want = model(input_ids=ids, position_ids=positions).logits
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation="sdpa",
                                                          sequence_parallel_size=world, micro_batch_size=BATCH)
    width = SEQ // world
    piece = slice(rank * width, (rank + 1) * width)
    got = model(input_ids=ids[:, piece], position_ids=positions[:, piece]).logits
    return {"logits": (got - want[:, piece]).abs().max().item(), "module": mpu.__name__,
            "sp": (mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank()),
            "seq_dp": mpu.get_sequence_data_parallel_world_size(),
            "model_parallel": mpu.get_model_parallel_world_size()}


def initialize_with_mpu(sequence_parallel_size: int) -> dict:
    """deepspeed.initialize(mpu=) with the groups register_with_transformers returned: what the
    engine and DeepSpeed's groups accessors answer; a config naming another size is refused."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from deepspeed.utils import groups

    model = tiny_llama()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation="sdpa",
                                                          sequence_parallel_size=sequence_parallel_size,
                                                          micro_batch_size=1)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    refused = None
    try:
        deepspeed.initialize(model=model, config={**config, "sequence_parallel_size": 1}, mpu=mpu)
    except ValueError as exc:
        refused = str(exc)
    engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    out = {"refused": refused, "dp_world_size": engine.dp_world_size, "seq_dp_world_size": engine.seq_dp_world_size,
           "sequence_parallel_size": engine.sequence_parallel_size, "train_batch": engine.train_batch_size(),
           "same_group": engine.get_sequence_parallel_group() is mpu.get_sequence_parallel_group(),
           "groups": (groups._get_data_parallel_world_size(), groups._get_sequence_parallel_world_size(),
                      groups._get_sequence_data_parallel_world_size()),
           "mpu": engine.mpu is mpu}
    engine.destroy()
    groups._set_sequence_parallel_group(None)
    return out


def initialize_errors() -> list[str]:
    """parallel_state_sp's refusals of sizes the world cannot split, and its getter before any."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

    errors = []
    for size in (4, 1):
        try:
            mpu.initialize_sequence_parallel(size)
        except (RuntimeError, ValueError) as exc:
            errors.append(str(exc))
    try:
        mpu.get_sequence_parallel_group()
    except RuntimeError as exc:
        errors.append(str(exc))
    return errors

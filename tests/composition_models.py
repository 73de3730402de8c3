"""The models of the composition matrix (tests/composition.py) and their parameters under one set
of names: the residual network, or with a model feature the GPT, whole, split into pipeline stages,
over tensor ranks, or both."""
from __future__ import annotations

import torch

import composition as matrix


class Residual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(h)


class Embed(torch.nn.Module):
    """Token and position embeddings: the first layer of the GPT."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = torch.nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1]) if positions is None else positions)


class Head(torch.nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.ln_f = torch.nn.LayerNorm(cfg.d_model)
        self.lm_head = torch.nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class FinalNorm(torch.nn.Module):
    """The head's layer norm as a layer of its own: a pipeline's head that reuses the embedding's
    weight is a use of the tied embedding, which holds no norm."""

    def __init__(self, ln_f: torch.nn.LayerNorm) -> None:
        super().__init__()
        self.ln_f = ln_f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)


def tied_head(embed: Embed, x: torch.Tensor) -> torch.Tensor:
    """The LM head of the tied GPT: the token embedding's weight, as Net's lm_head."""
    return torch.nn.functional.linear(x, embed.wte.weight)


#: the key of the tied embedding in a pipeline (``tied_modules.<key>``) and its layer in the plain GPT
TIED_KEY, TIED_LAYER = "embed", 0


def gpt_config(features: tuple[str, ...]):
    from zkit.models.gpt import GPTConfig

    sparse = "block_sparse" in features
    attention = "block_sparse" if sparse else "dense"
    kwargs = {"mode": "fixed", "block": 8, "num_local_blocks": 2} if sparse else {}
    if "sequence_parallel" in features:  # the same attention, on each rank's heads of the whole sequence
        attention, kwargs = "ulysses", {"inner": attention, **kwargs}
    return GPTConfig(vocab_size=16, seq_len=32, n_layer=2, n_head=2, d_model=8, attention=attention,
                     attention_kwargs=kwargs, tie_embeddings="tied_weights" in features)


def checkpoints(features: tuple[str, ...]) -> bool:
    """Whether each block runs through zkit's activation checkpointing (either section)."""
    return "act_ckpt" in features or "act_ckpt_plain" in features


def is_gpt(features: tuple[str, ...]) -> bool:
    return any(f in matrix.GPT_FEATURES for f in features)


def layers(features: tuple[str, ...]) -> list[torch.nn.Module]:
    """The model as a layer list (the same weights whether it is split into stages or not)."""
    torch.manual_seed(0)
    if not is_gpt(features):
        return [torch.nn.Linear(8, 16), Residual(), Residual(), torch.nn.Linear(16, 4)]
    from zkit.models.gpt import Block

    cfg = gpt_config(features)
    blocks = [Block(cfg) for _ in range(cfg.n_layer)]
    for block in blocks:
        # a key bias has no gradient (softmax ignores a constant shift): Adam would turn its rounding
        # noise, which differs with every reduction order, into steps of the learning rate
        block.attn.qkv.bias = None
    return [Embed(cfg), *blocks, Head(cfg)]


class Net(torch.nn.Module):
    """The layers in order; with ``ckpt`` each block runs through zkit.activations.recompute."""

    def __init__(self, features: tuple[str, ...]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers(features))
        self.ckpt = checkpoints(features)
        if "tied_weights" in features:
            self.layers[-1].lm_head.weight = self.layers[0].wte.weight

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        from zkit.activations import recompute
        from zkit.models.gpt import Block

        for layer in self.layers:
            blocks = isinstance(layer, (Residual, Block))
            if isinstance(layer, Embed):
                x = layer(x, positions)
            else:
                x = recompute.checkpoint(layer, x) if self.ckpt and blocks else layer(x)
        return x


def split_mlps(model: torch.nn.Module, tp) -> torch.nn.Module:
    """Each block's MLP as a column- then a row-parallel linear over the tensor group."""
    from zkit.models.gpt import MLP
    from zkit_pipeline.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    for module in model.modules():
        if isinstance(module, Residual):
            module.mlp[0] = ColumnParallelLinear.from_dense(module.mlp[0], tp)
            module.mlp[2] = RowParallelLinear.from_dense(module.mlp[2], tp)
        elif isinstance(module, MLP):
            module.fc = ColumnParallelLinear.from_dense(module.fc, tp)
            module.proj = RowParallelLinear.from_dense(module.proj, tp)
    return model


def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if y.dtype == torch.long:  # the GPT's next tokens
        return torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
    return (out.float() - y).pow(2).mean()


def micro_step_loss(engine, features: tuple[str, ...], xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """The loss of one micro-batch through ``engine``; with sequence parallelism, of this rank's
    half of every sequence (with its positions), the sequence-mean cross-entropy."""
    if "sequence_parallel" not in features:
        return loss(engine(xs), ys)
    from zkit_sequence import sequence_communicator, sequence_cross_entropy, shard, with_positions

    comm = sequence_communicator(engine)
    xs, ys, positions = shard(with_positions((xs, ys)), comm.rank, comm.world_size)
    return sequence_cross_entropy(engine(xs, positions[0]), ys, comm)


def batch(step: int, features: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: 4 rows, 2 per data-parallel rank of the 2-rank reference."""
    g = torch.Generator().manual_seed(step)
    if is_gpt(features):
        return torch.randint(0, 16, (4, 32), generator=g), torch.randint(0, 16, (4, 32), generator=g)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def is_pipeline(features: tuple[str, ...]) -> bool:
    return "pipeline" in features or "pipeline_dp" in features


def tied_pipeline_layers(plain: list[torch.nn.Module]) -> list:
    """The tied GPT's layers for zkit-pipeline: the embedding a TiedLayerSpec (each stage that uses
    it holds a copy; their gradients are summed over the stages), used first as itself and last
    through :func:`tied_head`, after the head's norm. The plain model's own embedding is the tied
    module, so the pipeline starts from Net's weights."""
    from zkit_pipeline import TiedLayerSpec

    embed, *blocks, head = plain

    class PlainEmbedding(TiedLayerSpec):
        def build(self) -> torch.nn.Module:
            return embed

    return [PlainEmbedding(TIED_KEY, Embed), *blocks, FinalNorm(head.ln_f),
            PlainEmbedding(TIED_KEY, Embed, forward_fn=tied_head)]


def build(features: tuple[str, ...]) -> torch.nn.Module:
    """The model of a cell, on this rank."""
    tensor_parallel = "tensor_parallel" in features
    if tensor_parallel and not is_pipeline(features):
        from zkit_pipeline import TensorParallelModule

        return TensorParallelModule(lambda tp: split_mlps(Net(features), tp), tensor=2)
    if not is_pipeline(features):
        return Net(features)
    from zkit_pipeline import PipelineModule, ProcessGrid

    grid, stage_layers = None, layers(features)
    partition = "uniform"
    if "tied_weights" in features:
        stage_layers = tied_pipeline_layers(stage_layers)
        partition = "type:Block"  # one block per stage, as the untied GPT's uniform split
    if tensor_parallel:  # 2 stages x 2 tensor ranks (x 2 replicas for pipeline_dp): the layers are
        # split before the stages are cut
        from zkit.torch_distributed.communicator import TorchCommunicator

        grid = ProcessGrid(pipe=2, tensor=2, data=2 if "pipeline_dp" in features else 1)
        tp = TorchCommunicator(grid.build_groups(torch.distributed.get_rank())["tensor"], None)
        stage_layers = [split_mlps(layer, tp) if isinstance(layer, torch.nn.Module) else layer  # not a spec
                        for layer in stage_layers]
    return PipelineModule(stage_layers, num_stages=2, loss_fn=loss, partition_method=partition, topology=grid,
                          activation_checkpoint_interval=1 if checkpoints(features) else 0)


def _whole(model: torch.nn.Module, group) -> dict[str, torch.Tensor]:
    """A tensor-parallel model's sliced parameters put together from the tensor ``group``."""
    from zkit_pipeline.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    out = {}
    for name, module in model.named_modules():
        dim = 0 if isinstance(module, ColumnParallelLinear) else 1 if isinstance(module, RowParallelLinear) else None
        for pname, p in module.named_parameters(recurse=False) if dim is not None else ():
            if getattr(p, "tensor_parallel", False):
                parts = [torch.empty_like(p) for _ in range(module.comm.world_size)]
                torch.distributed.all_gather(parts, p.detach().contiguous(), group=group)
                out[f"{name}.{pname}"] = torch.cat(parts, dim=dim if pname == "weight" else 0)
    return out


def named_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters under the plain model's names (``layers.<global index>....``)."""
    from zkit.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        tensor_group = getattr(model, "grid_groups", {}).get("tensor")
        if hasattr(model, "tensor_comm"):  # a TensorParallelModule: module.<plain name>
            model = model.module
        whole = _whole(model, tensor_group) if tensor_group is not None else {}
        params = {name: whole.get(name, p.detach()).float().clone() for name, p in model.named_parameters()}
    if not hasattr(model, "layer_range"):
        return params
    # a pipeline stage: gather every stage's parameters (the head's and the last block's too, and
    # the tied embedding from each stage that holds it: the copies must be equal)
    names = plain_names(model)
    mine = {names[name]: p for name, p in params.items()}
    stages: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(stages, mine)
    out: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, p in stage.items():
            if name in out and not torch.equal(out[name], p):
                raise AssertionError(f"{name} differs between the ranks that hold it by "
                                     f"{(out[name] - p).abs().max().item():.3g}")
            out[name] = p
    return out


def plain_names(model: torch.nn.Module) -> dict[str, str]:
    """``{parameter name in a pipeline stage: its name in Net}``: ``layers.<global index>....``."""
    out = {}
    for name, whole in model.layer_names().items():
        first, rest = whole.split(".", 1)
        if first == "tied_modules":  # tied_modules.<key>.<name in the embedding>
            key, rest = rest.split(".", 1)
            assert key == TIED_KEY, key
            first = str(TIED_LAYER)
        out[name] = f"layers.{first}.{rest}"
    return out

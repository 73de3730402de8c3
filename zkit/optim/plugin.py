"""zkit's built-in optimizers: ``adam``, ``adamw``, ``sgd`` (torch's own, in their fastest form)
and ``lamb`` (:class:`zkit.optim.Lamb`), and the built-in answers for a client's ``optimizer=`` and
``lr_scheduler=`` (:mod:`zkit.optim.client`).

The config's ``optimizer.params`` keep DeepSpeed's names and meanings:

* ``"Adam"`` with ``adam_w_mode`` (default ``true``) is AdamW, i.e. decoupled weight decay, exactly
  as in DeepSpeed; ``"adam_w_mode": false`` gives Adam with L2 weight decay added to the gradient.
  ``"AdamW"`` is always decoupled. ``weight_decay`` defaults to 0 for both (DeepSpeed's default,
  not torch's 0.01 for AdamW). ``torch_adam`` is accepted: zkit always steps with torch's Adam.
* ``"FusedAdam"`` (``"fused_adam"``), DeepSpeed's name for the optimizer it steps for ``"Adam"`` on
  a GPU, is ``"Adam"`` here, on every device: torch's fused kernel. zkit-cuda-numba's Numba kernel
  is chosen by its own name (``fused_adam_cuda``, the same settings); it is slower than torch's.
* Each torch optimizer runs ``fused=True`` when torch has a fused kernel for every parameter's
  device and dtype (CPU and CUDA, all floating dtypes), else ``foreach``. ``fused``/``foreach``
  in the params override that choice.

``state_names`` lists every per-parameter tensor an optimizer *may* keep, shaped like the
parameter. Torch creates state lazily, so a name can be absent from a parameter's state: before
the first step, ``max_exp_avg_sq`` without ``amsgrad``, ``momentum_buffer`` with ``momentum=0``.
Declaring ``max_exp_avg_sq`` lets ``amsgrad`` work under every ZeRO stage and in checkpoints.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

import zkit
from zkit.core.config import params as check
from zkit.optim.client import client_lr_scheduler, client_optimizer_record
from zkit.optim.lamb import Lamb
from zkit.core.records import OptimizerRecord

_FUSED_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia")
_COMMON = {"lr", "weight_decay", "maximize", "fused", "foreach"}
_ADAM_KEYS = _COMMON | {"betas", "eps", "amsgrad", "adam_w_mode", "torch_adam", "bias_correction"}
_SGD_KEYS = _COMMON | {"momentum", "dampening", "nesterov"}
_LAMB_KEYS = {
    "lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay", "max_grad_norm",
    "max_coeff", "min_coeff", "amsgrad", "fused",
}


def _params_of(param_groups: Iterable[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for g in param_groups:
        if isinstance(g, dict):
            ps = g["params"]
            out.extend([ps] if isinstance(ps, torch.Tensor) else ps)
        else:
            out.append(g)
    return out


def _implementation(owner: str, param_groups: list, given: dict[str, Any]) -> dict[str, bool]:
    """``fused`` where torch has a kernel for every parameter, else ``foreach``; an explicit
    ``fused``/``foreach`` in the config wins."""
    fused = given.pop("fused", None)
    foreach = given.pop("foreach", None)
    if fused is not None:
        check.boolean(owner, "fused", fused)
    if foreach is not None:
        check.boolean(owner, "foreach", foreach)
    if fused and foreach:
        raise ValueError(f"{owner}: fused and foreach cannot both be true; pick one")
    if fused is None and foreach is None:
        params = _params_of(param_groups)
        fused = bool(params) and all(
            torch.is_floating_point(p) and p.device.type in _FUSED_DEVICES for p in params
        )
        return {"fused": True} if fused else {"foreach": True}
    return {"fused": bool(fused)} if fused is not None else {"foreach": bool(foreach)}


def _common(owner: str, p: dict[str, Any], lr_default: float) -> dict[str, Any]:
    return {
        "lr": check.number(owner, "lr", p.pop("lr", lr_default), low=0.0),
        "weight_decay": check.number(owner, "weight_decay", p.pop("weight_decay", 0.0), low=0.0),
        "maximize": check.boolean(owner, "maximize", p.pop("maximize", False)),
    }


def adam_settings(name: str, params: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """What a config's ``"Adam"``/``"AdamW"`` (``name`` ``"adam"``/``"adamw"``) asks for, checked
    with DeepSpeed's names and defaults: ``(decoupled, kwargs)`` where ``decoupled`` is AdamW's
    decay (``adam_w_mode``, default true) and ``kwargs`` are ``lr``, ``weight_decay`` (default
    0), ``maximize``, ``betas``, ``eps``, ``amsgrad`` and the ``fused``/``foreach`` choice as
    given (``None`` when not). Every implementation of these types (torch's here, a CPU-offload
    optimizer elsewhere) reads them from here, so one config computes the same thing on each."""
    owner = f"optimizer {name!r}"
    check.check_known("optimizer", name, params, _ADAM_KEYS)
    p = dict(params)
    w_mode = check.boolean(owner, "adam_w_mode", p.pop("adam_w_mode", True))
    if name == "adamw" and not w_mode:
        raise ValueError(
            "optimizer 'adamw': adam_w_mode=false contradicts AdamW (decoupled weight decay); for "
            "Adam with L2 weight decay use type 'Adam' with adam_w_mode=false"
        )
    check.boolean(owner, "torch_adam", p.pop("torch_adam", False))
    if not check.boolean(owner, "bias_correction", p.pop("bias_correction", True)):
        raise ValueError(f"{owner}: bias_correction=false is not supported; torch's Adam always corrects")
    kwargs = _common(owner, p, 1e-3)
    kwargs["betas"] = check.betas(owner, p.pop("betas", (0.9, 0.999)))
    kwargs["eps"] = check.number(owner, "eps", p.pop("eps", 1e-8), low=0.0)
    kwargs["amsgrad"] = check.boolean(owner, "amsgrad", p.pop("amsgrad", False))
    kwargs["fused"], kwargs["foreach"] = p.pop("fused", None), p.pop("foreach", None)
    return w_mode, kwargs


def _adam(name: str, param_groups: list, params: dict[str, Any]) -> torch.optim.Optimizer:
    w_mode, kwargs = adam_settings(name, params)
    given = {k: kwargs.pop(k) for k in ("fused", "foreach") if kwargs[k] is not None}
    kwargs.update(_implementation(f"optimizer {name!r}", param_groups, given))
    cls = torch.optim.AdamW if w_mode else torch.optim.Adam
    return cls(param_groups, **kwargs)


def make_adam(param_groups: list, **params: Any) -> torch.optim.Optimizer:
    """DeepSpeed's ``"Adam"``: AdamW unless ``adam_w_mode=false``."""
    return _adam("adam", param_groups, params)


def make_adamw(param_groups: list, **params: Any) -> torch.optim.Optimizer:
    """DeepSpeed's ``"AdamW"``: torch's AdamW (decoupled weight decay, default 0)."""
    return _adam("adamw", param_groups, params)


def make_sgd(param_groups: list, **params: Any) -> torch.optim.Optimizer:
    """torch's SGD with DeepSpeed's (= torch's) parameter names."""
    owner = "optimizer 'sgd'"
    check.check_known("optimizer", "sgd", params, _SGD_KEYS)
    p = dict(params)
    kwargs = _common(owner, p, 1e-3)
    kwargs["momentum"] = check.number(owner, "momentum", p.pop("momentum", 0.0), low=0.0)
    kwargs["dampening"] = check.number(owner, "dampening", p.pop("dampening", 0.0))
    kwargs["nesterov"] = check.boolean(owner, "nesterov", p.pop("nesterov", False))
    if kwargs["nesterov"] and (kwargs["momentum"] <= 0 or kwargs["dampening"] != 0):
        raise ValueError(f"{owner}: nesterov=true needs momentum > 0 and dampening = 0")
    kwargs.update(_implementation(owner, param_groups, p))
    return torch.optim.SGD(param_groups, **kwargs)


def make_lamb(param_groups: list, **params: Any) -> torch.optim.Optimizer:
    """DeepSpeed's ``"Lamb"`` (``FusedLamb`` semantics): see :class:`zkit.optim.Lamb`."""
    check.check_known("optimizer", "lamb", params, _LAMB_KEYS)
    return Lamb(param_groups, **params)


@zkit.hookimpl(trylast=True)
def zkit_register_optimizers():
    yield OptimizerRecord(
        name="adam",
        factory=make_adam,
        aliases=("fusedadam", "fused_adam"),
        state_names=("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
        state_format="adam",
        description="Adam; decoupled weight decay (AdamW) unless adam_w_mode=false, as in DeepSpeed",
    )
    yield OptimizerRecord(
        name="adamw",
        factory=make_adamw,
        state_names=("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
        state_format="adam",
        description="AdamW (decoupled weight decay), torch's fused kernel",
    )
    yield OptimizerRecord(
        name="sgd",
        factory=make_sgd,
        state_names=("momentum_buffer",),
        description="SGD with momentum / Nesterov, torch's fused kernel",
    )
    yield OptimizerRecord(
        name="lamb",
        factory=make_lamb,
        state_names=("exp_avg", "exp_avg_sq"),
        elementwise=False,
        description="LAMB with DeepSpeed FusedLamb semantics (per-parameter trust ratio)",
    )


@zkit.hookimpl(trylast=True)
def zkit_client_optimizer(optimizer):
    return client_optimizer_record(optimizer)


@zkit.hookimpl(trylast=True)
def zkit_client_lr_scheduler(lr_scheduler, optimizer):
    return client_lr_scheduler(lr_scheduler, optimizer)

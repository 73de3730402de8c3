"""Names DeepSpeed's own unit tests and DeepSpeedExamples import, with DeepSpeed's behaviour: the op
builders, git_version_info, the ZeRO config model, DeepSpeedConfigModel, utils.groups, ZeRO-3 leaf
marks, LR-schedule constants, OnDevice, and the refusals among them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deepspeed  # noqa: F401 - the drop-in's alias
from deepspeed.refused import FeatureNotProvided

HERE = Path(__file__).resolve().parent
PEER_PYTHON = HERE.parents[2] / ".venv-peers" / "bin" / "python"


def _facts(python: str) -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    out = subprocess.run([python, str(HERE / "peer_facts.py")], capture_output=True, text=True, env=env,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not PEER_PYTHON.exists(), reason=f"no DeepSpeed peer environment at {PEER_PYTHON} (make peers)")
def test_constants_config_defaults_and_layouts_equal_deepspeeds():
    ours, theirs = _facts(sys.executable), _facts(str(PEER_PYTHON))
    for key in ("lr", "stages", "zero_default", "zero_stage3", "builders", "build_var", "expert_ranks", "partitions",
                "call"):
        assert ours[key] == theirs[key], key
    assert set(theirs["version_keys"]) <= set(ours["version_keys"])


def test_op_builders_say_which_ops_zkit_provides():
    import deepspeed.ops
    from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder, FusedLambBuilder

    assert CPUAdamBuilder().is_compatible() and FusedAdamBuilder().is_compatible()  # zkit-offload is installed
    assert not FusedLambBuilder().is_compatible()
    assert deepspeed.ops.__compatible_ops__[FusedLambBuilder.NAME] is False
    assert deepspeed.ops.__compatible_ops__["deepspeed_not_implemented"] is False
    with pytest.raises(FeatureNotProvided, match="DeepSpeed's compiled op 'cpu_adam' is not built by zkit: use "
                                                 "deepspeed.ops.adam.DeepSpeedCPUAdam"):
        CPUAdamBuilder().load()
    from deepspeed import git_version_info

    assert git_version_info.version.startswith("0.19.8") and not any(git_version_info.installed_ops.values())
    assert git_version_info.compatible_ops == deepspeed.ops.__compatible_ops__


def test_zero_config_model_rules():
    from pydantic import ValidationError

    from deepspeed.runtime.zero.config import (DeepSpeedZeroConfig, DeepSpeedZeroOffloadOptimizerConfig,
                                               DeepSpeedZeroOffloadParamConfig)

    assert isinstance(DeepSpeedZeroConfig(cpu_offload_param=True).offload_param, DeepSpeedZeroOffloadParamConfig)
    assert isinstance(DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
    both = DeepSpeedZeroConfig(offload_param={}, offload_optimizer={"device": "cpu"})
    assert isinstance(both.offload_param, DeepSpeedZeroOffloadParamConfig)
    assert DeepSpeedZeroConfig(stage=3).overlap_comm and not DeepSpeedZeroConfig(stage=2).overlap_comm
    assert DeepSpeedZeroConfig(stage3_max_reuse_distance=5).max_reuse_distance == 5
    assert DeepSpeedZeroConfig(prefetch_bucket_size=6).prefetch_bucket_size == 6
    with pytest.raises(ValidationError, match="stage3_typo"):
        DeepSpeedZeroConfig(stage3_typo=1)
    with pytest.raises(ValidationError, match="compute_grad_norm=false is supported only with ZeRO Stage 1 or 2"):
        DeepSpeedZeroConfig(stage=3, compute_grad_norm=False)
    with pytest.raises(AssertionError, match="Cannot provide deprecated parameter "
                                         "'stage3_gather_fp16_weights_on_model_save' and replacing parameter "
                                         "'gather_16bit_weights_on_model_save' together"):
        DeepSpeedZeroConfig(stage3_gather_fp16_weights_on_model_save=True, gather_16bit_weights_on_model_save=False)


def test_config_model_base_drops_auto_and_moves_deprecated_fields():
    from typing import List, Optional

    from pydantic import Field

    from deepspeed.runtime.config_utils import DeepSpeedConfigModel, get_config_default

    class Conf(DeepSpeedConfigModel):
        size: int = 3
        old: Optional[str] = Field(None, json_schema_extra={"deprecated": True, "new_param": "new",
                                                            "new_param_fn": lambda x: [x]})
        new: Optional[List[str]] = None

    assert Conf(size="auto").size == 3 and Conf(old="a").new == ["a"]
    assert get_config_default(Conf, "size") == 3
    with pytest.raises(ValueError, match="'nope' is not a field"):
        get_config_default(Conf, "nope")


def test_groups_answer_for_a_data_parallel_world_and_refuse_experts():
    from deepspeed.utils import groups

    assert groups._get_sequence_parallel_world_size() == 1 and groups._get_model_parallel_world_size() == 1
    with pytest.raises(KeyError, match="No sequence parallel group found: no engine was built"):
        groups._get_sequence_parallel_group()
    with pytest.raises(FeatureNotProvided, match="zkit has no mixture-of-experts"):
        groups._create_expert_and_data_parallel(2)
    if torch.distributed.is_initialized():  # an earlier test in this process made a group
        assert groups._get_data_parallel_world_size() == torch.distributed.get_world_size()
    else:
        with pytest.raises(RuntimeError, match="dist is not initialized"):
            groups._get_data_parallel_world_size()


def test_z3_leaf_marks():
    from deepspeed.utils import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_suffix,
                                 unset_z3_leaf_modules, z3_leaf_module)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2)))
    assert set_z3_leaf_modules(model, [torch.nn.Linear]) == [model[0], model[1][1]]
    assert get_z3_leaf_modules(model) == [model[0], model[1][1]] and z3_leaf_module(model[0])
    assert unset_z3_leaf_modules(model, ["torch.nn.modules.linear.Linear"]) == [model[0], model[1][1]]
    assert get_z3_leaf_modules(model) == []
    with pytest.raises(ValueError, match="No modules of type \\[<class 'torch.nn.modules.conv.Conv1d'>\\] found"):
        set_z3_leaf_modules(model, [torch.nn.Conv1d])
    assert set_z3_leaf_modules(model, [torch.nn.Conv1d], raise_if_not_found=False) == []
    assert set_z3_leaf_modules_by_suffix(model, ["1.1"]) == ([model[1][1]], [])
    with pytest.raises(TypeError, match="leaf_module_classes must be a list of types or names"):
        set_z3_leaf_modules(model, [3])
    # DeepSpeed's module path imports too, and the name stays callable after it
    import importlib

    importlib.import_module("deepspeed.utils.z3_leaf_module")
    assert importlib.import_module("deepspeed.utils").z3_leaf_module(model[1][1])


def test_on_device_builds_on_meta_and_restores_the_default_dtype():
    with deepspeed.OnDevice(dtype=torch.float16, device="meta"):
        layer = torch.nn.Linear(4, 4)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.float16
    assert torch.get_default_dtype() == torch.float32 and torch.empty(1).device.type == "cpu"
    with deepspeed.OnDevice(dtype=torch.float16, enabled=False):
        assert torch.nn.Linear(2, 2).weight.dtype == torch.float32
    with pytest.raises(ValueError, match="OnDevice: dtype must be a floating dtype, got torch.int64"):
        deepspeed.OnDevice(dtype=torch.int64)


def test_refused_builders_and_local_fragment_access_name_the_alternative():
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils import safe_get_local_grad

    with pytest.raises(FeatureNotProvided, match="DeepSpeedZeroOptimizer .* is not built directly with zkit"):
        DeepSpeedZeroOptimizer(None)
    with pytest.raises(FeatureNotProvided, match="use safe_get_full_grad, which every rank calls together"):
        safe_get_local_grad(torch.nn.Parameter(torch.ones(1)))
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

    with pytest.raises(ValueError, match="DeepSpeedCPUAdagrad\\(amsgrad=True\\) is not supported"):
        DeepSpeedCPUAdagrad([torch.nn.Parameter(torch.ones(1))], amsgrad=True)


def test_core_range_lists_parse_as_deepspeeds_launcher_does():
    from deepspeed.utils.numa import parse_range_list

    assert parse_range_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    with pytest.raises(ValueError, match="Bad range: '0,2-6,5-9', sub ranges must not overlap"):
        parse_range_list("0,2-6,5-9")
    with pytest.raises(ValueError, match="Bad range: '6-2', range end must larger than or equal to start"):
        parse_range_list("1,6-2")
    with pytest.raises(ValueError, match="Bad range: 'a', range must be either a number or two number"):
        parse_range_list("a")
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer

    with pytest.raises(FeatureNotProvided, match="FP16_Optimizer \\(DeepSpeed's FP16 optimizer wrapper\\) is not "
                                                 "built directly with zkit"):
        FP16_Optimizer(None)

"""DeepSpeed's own unit tests under the drop-in: which files run on a CPU, what real DeepSpeed
0.19.8 gives on them, and why the drop-in's counts differ where they do.

``contrib/deepspeed_unit_tests.py`` runs the files; ``docs/deepspeed-coverage.md`` shows the
figures below; ``plugins/zkit-deepspeed/tests/test_deepspeed_unit_tests.py`` reruns the drop-in
side where a DeepSpeed source tree is given (``ZKIT_DEEPSPEED_SRC``).
"""
from __future__ import annotations

import attrs


@attrs.frozen
class FileResult:
    """pytest's counts for one test file (``errors``: the file did not import, or timed out)."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    note: str = attrs.field(default="", eq=False)  #: the first failure or the import error, for reading

    def counts(self) -> str:
        return f"{self.passed}/{self.failed}/{self.skipped}/{self.errors}"

    def as_dict(self) -> dict:
        return attrs.asdict(self)


#: Files of DeepSpeed's ``tests/unit`` that run on a CPU (``DS_ACCELERATOR=cpu``, gloo): under real
#: DeepSpeed 0.19.8 at least one of their tests passes. Chosen among the directories of the features
#: zkit provides (ZeRO and its config, LR schedules, checkpoints, groups, the launcher's arguments,
#: pipeline schedules); DeepSpeed's tests of inference, MoE, compression, sequence parallelism and
#: compiled ops were not run. Measured from DeepSpeed's tests at commit edaa7221 (2026-08-22).
CPU_CAPABLE_FILES: tuple[str, ...] = (
    "checkpoint/test_latest_checkpoint.py",
    "launcher/test_ds_arguments.py",
    "launcher/test_user_args.py",
    "runtime/pipe/test_pipe_schedule.py",
    "runtime/pipe/test_topology.py",
    "runtime/test_data.py",
    "runtime/test_ds_config_dict.py",
    "runtime/test_ds_config_model.py",
    "runtime/test_multi_output_model.py",
    "runtime/test_runtime_utils.py",
    "runtime/zero/test_ignore_unused_parameters.py",
    "runtime/zero/test_zero_config.py",
    "runtime/zero/test_zero_context.py",
    "runtime/zero/test_zero_context_ancestry.py",
    "runtime/zero/test_zero_context_return.py",
    "runtime/zero/test_zero_dynamic_class.py",
    "runtime/zero/test_zero_grad_clip.py",
    "runtime/zero/test_zero_hook_attribute_delegation.py",
    "runtime/zero/test_zero_late_module_attach.py",
    "runtime/zero/test_zero_leaf_module.py",
    "runtime/zero/test_zero_linear_direct_init.py",
    "runtime/zero/test_zero_nesting_init.py",
    "runtime/zero/test_zero_tiled.py",
    "utils/test_groups.py",
    "utils/test_init_on_device.py",
    "utils/test_partition_balanced.py",
)

#: real DeepSpeed 0.19.8's counts (passed, failed, skipped, errors) on this machine's CPU
DEEPSPEED_RESULTS: dict[str, FileResult] = {
    "checkpoint/test_latest_checkpoint.py": FileResult(1, 1, 0, 0),
    "launcher/test_ds_arguments.py": FileResult(7, 0, 0, 0),
    "launcher/test_user_args.py": FileResult(2, 5, 4, 0),
    "runtime/pipe/test_pipe_schedule.py": FileResult(17, 0, 0, 0),
    "runtime/pipe/test_topology.py": FileResult(7, 0, 2, 0),
    "runtime/test_data.py": FileResult(5, 0, 0, 0),
    "runtime/test_ds_config_dict.py": FileResult(23, 2, 5, 0),
    "runtime/test_ds_config_model.py": FileResult(9, 0, 0, 0),
    "runtime/test_multi_output_model.py": FileResult(2, 0, 0, 0),
    "runtime/test_runtime_utils.py": FileResult(2, 0, 4, 0),
    "runtime/zero/test_ignore_unused_parameters.py": FileResult(2, 0, 0, 0),
    "runtime/zero/test_zero_config.py": FileResult(6, 0, 0, 0),
    "runtime/zero/test_zero_context.py": FileResult(6, 1, 4, 0),
    "runtime/zero/test_zero_context_ancestry.py": FileResult(1, 0, 1, 0),
    "runtime/zero/test_zero_context_return.py": FileResult(4, 0, 1, 0),
    "runtime/zero/test_zero_dynamic_class.py": FileResult(2, 0, 0, 0),
    "runtime/zero/test_zero_grad_clip.py": FileResult(2, 0, 2, 0),
    "runtime/zero/test_zero_hook_attribute_delegation.py": FileResult(1, 0, 0, 0),
    "runtime/zero/test_zero_late_module_attach.py": FileResult(6, 0, 0, 0),
    "runtime/zero/test_zero_leaf_module.py": FileResult(9, 0, 14, 0),
    "runtime/zero/test_zero_linear_direct_init.py": FileResult(3, 0, 2, 0),
    "runtime/zero/test_zero_nesting_init.py": FileResult(3, 0, 0, 0),
    "runtime/zero/test_zero_tiled.py": FileResult(6, 0, 36, 0),
    "utils/test_groups.py": FileResult(1, 0, 0, 0),
    "utils/test_init_on_device.py": FileResult(2, 0, 0, 0),
    "utils/test_partition_balanced.py": FileResult(1, 0, 0, 0),
}

#: the drop-in's counts
ZKIT_RESULTS: dict[str, FileResult] = {
    "checkpoint/test_latest_checkpoint.py": FileResult(1, 1, 0, 0),
    "launcher/test_ds_arguments.py": FileResult(7, 0, 0, 0),
    "launcher/test_user_args.py": FileResult(0, 0, 0, 1),
    "runtime/pipe/test_pipe_schedule.py": FileResult(0, 0, 0, 1),
    "runtime/pipe/test_topology.py": FileResult(0, 0, 0, 1),
    "runtime/test_data.py": FileResult(5, 0, 0, 0),
    "runtime/test_ds_config_dict.py": FileResult(0, 0, 0, 1),
    "runtime/test_ds_config_model.py": FileResult(9, 0, 0, 0),
    "runtime/test_multi_output_model.py": FileResult(0, 2, 0, 0),
    "runtime/test_runtime_utils.py": FileResult(1, 1, 4, 0),
    "runtime/zero/test_ignore_unused_parameters.py": FileResult(1, 1, 0, 0),
    "runtime/zero/test_zero_config.py": FileResult(6, 0, 0, 0),
    "runtime/zero/test_zero_context.py": FileResult(4, 4, 3, 0),
    "runtime/zero/test_zero_context_ancestry.py": FileResult(1, 0, 1, 0),
    "runtime/zero/test_zero_context_return.py": FileResult(4, 0, 1, 0),
    "runtime/zero/test_zero_dynamic_class.py": FileResult(2, 0, 0, 0),
    "runtime/zero/test_zero_grad_clip.py": FileResult(0, 4, 0, 0),
    "runtime/zero/test_zero_hook_attribute_delegation.py": FileResult(0, 1, 0, 0),
    "runtime/zero/test_zero_late_module_attach.py": FileResult(0, 0, 0, 1),
    "runtime/zero/test_zero_leaf_module.py": FileResult(9, 0, 14, 0),
    "runtime/zero/test_zero_linear_direct_init.py": FileResult(0, 0, 0, 1),
    "runtime/zero/test_zero_nesting_init.py": FileResult(3, 0, 0, 0),
    "runtime/zero/test_zero_tiled.py": FileResult(0, 0, 0, 1),
    "utils/test_groups.py": FileResult(1, 0, 0, 0),
    "utils/test_init_on_device.py": FileResult(2, 0, 0, 0),
    "utils/test_partition_balanced.py": FileResult(1, 0, 0, 0),
}

#: why the drop-in's counts differ from DeepSpeed's, per file
DIFFERENCES: dict[str, str] = {
    "launcher/test_user_args.py": (
        "imports deepspeed.launcher.multinode_runner (pdsh/MPI runners), which zkit refuses; DeepSpeed's own "
        "run fails 5 because no `deepspeed` command is on PATH"
    ),
    "runtime/pipe/test_pipe_schedule.py": (
        "imports deepspeed.runtime.pipe (DeepSpeed's pipeline-engine schedules), which zkit refuses: "
        "zkit-pipeline has its own"
    ),
    "runtime/pipe/test_topology.py": (
        "imports deepspeed.runtime.pipe (DeepSpeed's pipeline topology), which zkit refuses: zkit-pipeline's "
        "ProcessGrid is its own"
    ),
    "runtime/test_ds_config_dict.py": (
        "imports hjson, which DeepSpeed installs and zkit's environment does not have"
    ),
    "runtime/test_multi_output_model.py": (
        "DeepSpeed's engine.backward returns the loss divided by the gradient-accumulation steps; zkit's "
        "returns the loss as given (the gradients are the same)"
    ),
    "runtime/test_runtime_utils.py": (
        "test_count_used_parameters_enables_grad_for_grad_acc_lookup calls count_used_parameters_in_backward, "
        "a ZeRO-3 internal zkit refuses"
    ),
    "runtime/zero/test_ignore_unused_parameters.py": (
        "zero_optimization.ignore_unused_parameters=false (DeepSpeed: raise when a parameter gets no "
        "gradient) is refused by zkit's config as not implemented"
    ),
    "runtime/zero/test_zero_context.py": (
        "zkit keeps a released ZeRO-3 parameter's full shape (an expanded view; DeepSpeed: an empty tensor), "
        "so TestZeroGatheredParametersFree, which checks for 0-sized data outside GatheredParameters, fails; "
        "MiCS is refused (DeepSpeed's MiCS test fails as well); zkit's CPU accelerator reports fp16 support, "
        "so test_scatter_halftype runs instead of skipping and finds zkit.zero.Init keeping fp32 shards; "
        "test_throughput_calculation reads the engine's tput_timer, which zkit's engine does not have"
    ),
    "runtime/zero/test_zero_grad_clip.py": (
        "asserts the engine's optimizer is DeepSpeed's DeepSpeedZeroOptimizer_Stage3 and reads its "
        "gradient-norm internals; zkit's engine.optimizer is a torch optimizer over the shards. Its fp16 "
        "cases run because zkit's CPU accelerator reports fp16 support (DeepSpeed's skips them)"
    ),
    "runtime/zero/test_zero_hook_attribute_delegation.py": (
        "checks the attributes DeepSpeed's ZeRO-3 hooks put on modules (pre_bwd_fn, "
        "applied_pre_backward_ref_cnt); zkit's stage 3 gathers on use and installs no such hooks"
    ),
    "runtime/zero/test_zero_late_module_attach.py": (
        "imports deepspeed.runtime.zero.parameter_offload (ZeRO-3 hook internals), which zkit refuses"
    ),
    "runtime/zero/test_zero_linear_direct_init.py": (
        "imports InsertPostInitMethodToModuleSubClasses, a ZeRO-3 hook internal zkit refuses"
    ),
    "runtime/zero/test_zero_tiled.py": (
        "imports deepspeed.runtime.zero.tiling (TiledLinear), which zkit refuses"
    ),
}

#: CPU-capable files whose counts were not measured here, and why
NOT_MEASURED: dict[str, str] = {
    "runtime/test_lr_schedulers.py": ("its 40-odd multi-process tests ran past 20 minutes under both "
                                      "DeepSpeed and the drop-in on this 2-core machine"),
}

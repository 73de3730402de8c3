"""Prints, as JSON, facts of the DeepSpeed this interpreter imports that the drop-in must match: the LR
schedule constants, the ZeRO config's defaults and aliases, the op builders' names, the
git_version_info keys, the expert-parallel rank layouts. Run under both interpreters by
``test_deepspeed_names.py``."""
import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from deepspeed import git_version_info  # noqa: E402
from deepspeed.ops import op_builder  # noqa: E402
from deepspeed.runtime import lr_schedules  # noqa: E402
from deepspeed.runtime.utils import call_to_str, partition_balanced, partition_uniform  # noqa: E402
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum  # noqa: E402
from deepspeed.utils.groups import _get_expert_parallel_ranks  # noqa: E402


def _zero(**kwargs):
    c = DeepSpeedZeroConfig(**kwargs)
    skip = {"offload_param", "offload_optimizer", "leaf_module", "zenflow"}
    return {k: (v if isinstance(v, (bool, int, float, str, type(None))) else repr(v))
            for k, v in c.model_dump().items() if k not in skip}


facts = {
    "lr": {k: v for k, v in vars(lr_schedules).items() if k.isupper() and isinstance(v, (str, list))},
    "stages": {s.name: int(s) for s in ZeroStageEnum},
    "zero_default": _zero(),
    "zero_stage3": _zero(stage=3, stage3_prefetch_bucket_size=7, stage3_param_persistence_threshold=5,
                         stage3_gather_fp16_weights_on_model_save=True),
    # on the CPU accelerator DeepSpeed has no FusedLambBuilder of its own: its NAME is a placeholder
    "builders": {n: getattr(op_builder, n).NAME for n in ("CPUAdamBuilder", "FusedAdamBuilder", "AsyncIOBuilder",
                                                          "CPUAdagradBuilder", "CPULionBuilder")},
    "build_var": op_builder.CPUAdamBuilder().BUILD_VAR,
    "version_keys": sorted(k for k in ("version", "git_hash", "git_branch", "installed_ops", "compatible_ops",
                                       "torch_info") if hasattr(git_version_info, k)),
    "expert_ranks": [_get_expert_parallel_ranks(16, 2, 4), _get_expert_parallel_ranks(16, 2, 2, 2),
                     _get_expert_parallel_ranks(16, 1, 4, 1, True), _get_expert_parallel_ranks(8, 1, 2, 2, True)],
    "partitions": [[int(b) for b in partition_balanced(w, n)] for w, n in [
        ([1, 2, 1], 4), ([1, 1, 1, 1, 0, 1], 4), ([5, 1, 1, 7, 2, 2, 9, 0, 3], 3), ([2, 2, 2, 2], 2),
        ([0, 0, 4, 1], 3), ([9, 1, 1, 1, 1, 1, 1, 1], 4)]] + [[int(b) for b in partition_uniform(a, b)]
                                                          for a in range(9) for b in (1, 3, 4)],
    "call": call_to_str("f", 1, "a", k=[2]),
}
print(json.dumps(facts, sort_keys=True, default=str))  # the last line: DeepSpeed logs to stdout too

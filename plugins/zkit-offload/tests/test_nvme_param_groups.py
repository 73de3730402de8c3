"""NVMe optimizer offload at ZeRO stages 2-3 with two param groups (decay / no decay, as Hugging
Face's Trainer builds them) trains like the same run offloaded to the CPU and not offloaded, on 1
and 2 gloo ranks, and a checkpoint of it resumes into such a run."""
import pytest

from zkit.testing import run_ranks

import param_groups_ranks as pgr
from offload_ranks import max_diff

STAGES = (2, 3)


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def runs(request, tmp_path_factory):
    nvme, ckpt = tmp_path_factory.mktemp("nvme"), tmp_path_factory.mktemp("ckpt")
    results = run_ranks(pgr.grouped_runs, request.param, args=(str(nvme), str(ckpt), list(STAGES)), timeout=300)
    assert list(nvme.iterdir()) == []  # every swap directory removed by engine.close()
    return results


@pytest.mark.parametrize("stage", STAGES)
def test_nvme_offload_with_param_groups_matches_cpu_offload_and_no_offload(runs, stage):
    for rank in runs:
        nvme, cpu, none = (rank[(stage, device, 0.0)] for device in ("nvme", "cpu", "none"))
        assert (nvme["allocator"], cpu["allocator"], none["allocator"]) == ("nvme", "host", "flat")
        # the same fused CPU kernel steps the state in host memory and streamed from NVMe
        assert max_diff(nvme["params"], cpu["params"]) < 1e-6
        assert nvme["losses"] == pytest.approx(cpu["losses"], rel=1e-6)
        # torch's AdamW without offload differs from the CPU kernel in the last fp32 bits
        assert max_diff(nvme["params"], none["params"]) < 1e-5
        assert nvme["losses"] == pytest.approx(none["losses"], rel=1e-6)
        # the no-decay group is honoured: decaying it too ends elsewhere
        assert max_diff(nvme["params"], rank[(stage, "nvme", pgr.DECAY)]["params"]) > 1e-4
    assert max_diff(runs[0][(stage, "nvme", 0.0)]["params"], runs[-1][(stage, "nvme", 0.0)]["params"]) == 0


@pytest.mark.parametrize("stage", STAGES)
def test_nvme_offload_with_param_groups_resumes_from_a_checkpoint(runs, stage):
    for rank in runs:
        full, resumed = rank[(stage, "nvme", 0.0)], rank[(stage, "resumed")]
        assert resumed["steps"] == 4
        assert max_diff(resumed["params"], full["params"]) < 1e-6
        assert resumed["losses"] == pytest.approx(full["losses"][2:], rel=1e-6)

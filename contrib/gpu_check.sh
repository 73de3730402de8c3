#!/usr/bin/env bash
# Every check that needs a GPU, in one command, each part bounded in time so that the whole fits a
# short loan of a GPU machine. Parts (any of them, in this order by default):
#   report  the device, driver, torch/numba versions and `zkit report` (which backends were chosen)
#   tests   the GPU-only tests (tests/gpu, cuda_numba/tests/test_gpu.py); the torch.compile tests
#           (tests/gpu/test_compile_gpu.py, over 90 s) only with GPU_COMPILE_TESTS=1
#   zero    contrib/bench/bench_gpu.py: plain PyTorch, FSDP2, zkit stages 0-3, offload, compiled rows,
#           one profiler trace per contestant; then zkit-3-nvme alone, 1 + 3 steps, within ZERO_NVME_S
#           (0: skip it)
#   sparse  contrib/bench/bench_sparse_attention.py --gpu: the block-sparse attention table (4096 to
#           131072 tokens, block 64 and 128 layouts, the flex backend against a hand-written
#           FlexAttention call and flash SDPA, the 12-layer GPT), within SPARSE_S
# Usage, from the repository root, with zkit and its plugins importable:
#   OUT=results/gpu bash contrib/gpu_check.sh [report] [tests] [zero] [sparse]
# It writes OUT/<part>.log, the tables, and OUT/<part>.tar.gz with everything the part produced.
set -uo pipefail
out=${OUT:-results/gpu}
mkdir -p "$out"
work=$(mktemp -d)
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(report tests zero sparse)
py=${PYTHON:-python3}

part_report() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$py" -c "import torch, numpy, numba; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__, 'numba', numba.__version__)"
    "$py" -m zkit.cli report
}

part_tests() {
    local skip=(--ignore=tests/gpu/test_compile_gpu.py)
    [ "${GPU_COMPILE_TESTS:-0}" = 1 ] && skip=()
    timeout "${TESTS_S:-100}" "$py" -m pytest -q -p no:cacheprovider "${skip[@]}" tests/gpu cuda_numba/tests/test_gpu.py
}

part_zero() {
    # ~310 s on one H100 (the compiled rows ~65 s each, then the offload bound); the disk-bound NVMe
    # row last, on its own clock
    local names=torch,fsdp2,zkit-0,zkit-1,zkit-2,zkit-3,zkit-2-offload,zkit-3-offload,torch-compile,zkit-2-compile
    timeout "${ZERO_S:-360}" "$py" contrib/bench/bench_gpu.py --contestants "${ZERO_CONTESTANTS:-$names}" \
        --timeout 90 --trace --out "$work/zero"
    cp "$work"/zero/*.md "$out"/ 2>/dev/null
    local nvme_s=${ZERO_NVME_S:-60}
    [ "$nvme_s" -gt 0 ] || return 0
    timeout "$nvme_s" "$py" contrib/bench/bench_gpu.py --contestants zkit-3-nvme --warmup 1 --steps 3 \
        --timeout "$((nvme_s - 5))" --out "$work/zero/nvme"
    cp "$work/zero/nvme/bench_gpu.md" "$out/bench_gpu_nvme.md" 2>/dev/null
}

part_sparse() {
    # most wanted cases first (see sparse_attention_gpu.cases); what the budget skips is listed as
    # such: rerun it with --families / --seq / --stages
    timeout "${SPARSE_S:-540}" "$py" contrib/bench/bench_sparse_attention.py --gpu --out-dir "$work/sparse" \
        --budget-s "${SPARSE_BUDGET_S:-420}"
    cp "$work/sparse/table.md" "$out/sparse.md" 2>/dev/null
}

status=0
for part in "${parts[@]}"; do
    start=$(date +%s)
    echo "== $part" >&2
    "part_$part" > >(tee "$out/$part.log") 2>&1 || status=1
    echo "== $part: $(( $(date +%s) - start )) s" >&2
    [ -d "$work/$part" ] && tar czf "$out/$part.tar.gz" -C "$work" "$part"
done
exit $status

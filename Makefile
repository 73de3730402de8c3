# Set-up and the two entry points of the README. Everything installs into .venv from the package
# registry; constraints.txt pins the CPU build of torch.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PACKAGES := -e ".[test]" -e plugins/zkit-offload -e plugins/zkit-onebit -e plugins/zkit-pipeline \
            -e plugins/zkit-sparse -e plugins/zkit-sequence -e "cuda_numba[ptx]" -e "plugins/zkit-deepspeed[hf,all]"
NPROC ?= 2
STEPS ?= 200
# The real DeepSpeed, in its own environment: tests compare against it and import its checkpoints
# (they are skipped with a reason when it is missing). The C++ ops DeepSpeed would compile on first use
# are built here, at set-up, rather than inside the tests. pytest: contrib/deepspeed_unit_tests.py runs
# DeepSpeed's own unit tests in it.
PEERS_VENV ?= .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed
PEER_PACKAGES := deepspeed==0.19.8 ninja py-cpuinfo psutil hjson pydantic msgpack einops transformers pytest \
                 accelerate safetensors lightning

.PHONY: setup peers demo test clean

$(STAMP): pyproject.toml constraints.txt plugins/*/pyproject.toml cuda_numba/pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt $(PACKAGES)
	touch $(STAMP)

setup: $(STAMP)

$(PEERS_STAMP): constraints.txt
	test -x $(PEERS_VENV)/bin/python || $(PY) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q -c constraints.txt torch==2.13.0
	$(PEERS_VENV)/bin/python -m pip install -q -c constraints.txt $(PEER_PACKAGES)
	DS_ACCELERATOR=cpu $(PEERS_VENV)/bin/python tests/deepspeed_peer_ops.py
	touch $(PEERS_STAMP)

peers: $(PEERS_STAMP)

demo: $(STAMP)
	$(BIN)/zkit run --nproc $(NPROC) contrib/examples/train_gpt.py \
		--config contrib/examples/configs/gpt_zero0.json --steps $(STEPS)

test: $(STAMP) $(PEERS_STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(PEERS_VENV) runs .pytest_cache

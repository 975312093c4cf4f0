# FlashAttention in CUDA C++, in four chapters: 1, fp32 on the CUDA cores (flash.cu); 2, fp16 and
# bf16 on the tensor cores (flash_fp16.cu); 3, Hopper's own instructions (flash_hopper.cu,
# flash_hopper_backward.cu); 4, grouped K/V heads and decoding (flash_decode.cu).
# `make help` lists the targets.

# Every build runs on all the machine's cores unless -j is given (make -j1 for a serial build).
ifeq ($(MAKELEVEL)$(filter -j%,$(MAKEFLAGS)),0)
MAKEFLAGS += -j$(shell nproc 2>/dev/null || echo 2)
endif

CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(shell command -v nvcc 2>/dev/null || echo $(CUDA_HOME)/bin/nvcc)
SANITIZER ?= $(shell command -v compute-sanitizer 2>/dev/null || echo $(CUDA_HOME)/bin/compute-sanitizer)

# ARCH: the GPU to build for. With a GPU, the one in this machine (nvcc's -arch=native); without
# one, sm_80, the oldest GPU both chapter 1 and chapter 2 run on (set ARCH=sm_75 for a T4, which
# runs chapter 1 only: chapter 2's launchers refuse it).
HAVE_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo 1)
ifeq ($(HAVE_GPU),1)
ARCH ?= native
else
ARCH ?= sm_80
endif

# Chapter 3 needs nvcc's sm_90a target (wgmma, setmaxnreg), which CUDA 12.0 and newer have (11.8
# has sm_90 but not sm_90a, and no nvcc lists the "a" targets, hence the version test). Without
# it, flash_hopper.cu is left out and FLASH_NO_HOPPER tells the API layer (lib/dispatch.cpp):
# flash_forward_fp16 / _bf16 then run chapter 2 on every GPU, and chapter 3's own calls throw
# std::runtime_error saying it was not built. `make HAVE_SM90A=` leaves it out on any toolkit.
NVCC_RELEASE := $(shell $(NVCC) --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
ifeq ($(origin HAVE_SM90A),undefined)
HAVE_SM90A := $(shell [ "0$(firstword $(subst ., ,$(NVCC_RELEASE)))" -ge 12 ] && \
                      $(NVCC) --list-gpu-code 2>/dev/null | grep -qx sm_90 && echo 1)
NVCC_WHY := nvcc $(NVCC_RELEASE) has no sm_90a target (CUDA 12.0 and newer have it)
NO_HOPPER_WHY := $(if $(NVCC_RELEASE),$(NVCC_WHY),no nvcc found ($(NVCC)))
else
NO_HOPPER_WHY := HAVE_SM90A=$(HAVE_SM90A) was given (HAVE_SM90A=1 builds it)
endif
ifneq ($(HAVE_SM90A),1)
LIB_DEFINES := -DFLASH_NO_HOPPER
ifneq ($(filter-out help clean plot,$(or $(MAKECMDGOALS),all)),)
$(info make: chapter 3 (flash_hopper.cu) is left out: $(NO_HOPPER_WHY); chapters 1 and 2 \
    build and run on every GPU)
endif
endif

# -lineinfo lets compute-sanitizer and Nsight Compute point at source lines; it costs no speed.
# DEFINES: the kernels' experiment knobs, e.g. make clean all DEFINES=-DFLASH_PLAIN_COPY.
# CPPFLAGS: where Catch2 is, if not installed (e.g. -I.deps/include).
NVCCFLAGS ?= -O3 -std=c++17 -arch=$(ARCH) -lineinfo -Xcompiler -Wall,-Wextra
INCLUDES  := -I. -Ilib -Itests -Ibench
CPPFLAGS  ?=
LDLIBS    ?= -lcublas
COMPILE    = $(NVCC) $(CPPFLAGS) $(INCLUDES) $(NVCCFLAGS) $(DEFINES) $(LIB_DEFINES)
# PyTorch compiles the library for its op (pytorch/flash_torch.py) without fp16's and bf16's
# implicit conversions and operators; make builds the library (not the tests) that way too, so
# that a kernel which needs them fails here, not in the op's build.
NO_HALF_IMPLICIT := -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
                    -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
B := build

# The library: each chapter's kernels, what they share (lib/checks.cpp) and the API layer that
# picks a chapter (lib/dispatch.cpp).
LIB_OBJS := $(B)/flash.o $(B)/flash_fp16.o $(B)/flash_decode.o $(B)/checks.o $(B)/dispatch.o
LIB_OBJS += $(B)/backward_passes.o
ifeq ($(HAVE_SM90A),1)
LIB_OBJS += $(B)/flash_hopper.o $(B)/flash_hopper_backward.o $(B)/flash_hopper_fp8.o
endif
# The tests: test_flash.cpp and every tests/test_*.cpp but the documentation checks (test_docs.cpp).
TEST_OBJS := $(B)/test_flash.o $(patsubst tests/%.cpp,$(B)/%.o,$(filter-out tests/test_docs.cpp,$(wildcard tests/test_*.cpp))) \
             $(B)/spin.o
DOCS_OBJS := $(B)/test_docs.o $(B)/test_util.o

# Catch2 v2 (the tests' framework): looked for before anything is compiled, so that a machine
# without it gets one line saying what to do rather than a compiler error.
CATCH_GOALS := all test test_flash check check_docs check-exercises stress sanitize ch1 ch2 ch3 ch4
ifneq ($(filter $(CATCH_GOALS),$(or $(MAKECMDGOALS),all)),)
ifneq ($(shell printf '\043include <catch2/catch.hpp>\n' | $(or $(CXX),c++) $(CPPFLAGS) -x c++ -E - >/dev/null 2>&1 && echo 1),1)
$(error Catch2 v2 not found (catch2/catch.hpp): sudo apt-get install catch2, or make CPPFLAGS=-I<the directory holding catch2/>)
endif
endif

.PHONY: all test check check-exercises stress run bench plot sanitize torch help clean ch1 ch2 ch3 ch4
all: test_flash flash_bench

help:
	@echo "Start with make test, then make run. Without an NVIDIA GPU, make test runs the CPU tests"
	@echo "(the GPU tests skip, saying so) and make run says that it needs a GPU."
	@echo ""
	@echo "  make test      build (in parallel) and run the default tests, CPU and GPU: every kernel,"
	@echo "                 type and feature at small and odd shapes"
	@echo "                 ($(TEST_TIMES))"
	@echo "  make ch1 .. ch4  one chapter's tests (ch1: flash.cu, fp32; ch2: flash_fp16.cu; ch3: the"
	@echo "                 Hopper files; ch4: GQA and the decode), building only what changed"
	@echo "  make run       the demo: one shape on the GPU, timed and checked against the CPU reference"
	@echo "  make all       build test_flash and flash_bench, run nothing"
	@echo "  make check     the documentation checks: README's figures, NOTES' quotes, cited data, exercises"
	@echo "  make check-exercises  whether every exercise log is current with its sources (remake: exercises/run.sh --stale)"
	@echo "  make stress    the exhaustive grids, long sequences and 100k keys (before a kernel change is done)"
	@echo "  make sanitize  the [sanitize] tests under compute-sanitizer's four tools"
	@echo "  make bench     the FlashAttention-2 benchmark protocol, into bench.csv; make plot draws it"
	@echo "  make torch     build the PyTorch op (pytorch/, torch >= 2.3); then: python3 -m pytest pytorch"
	@echo "  make clean     remove what the build made"
	@echo ""
	@echo "Variables (now):"
	@echo "  ARCH=$(ARCH): the GPU to build for (native where nvidia-smi sees one, else sm_80)"
	@echo "  HAVE_SM90A=$(HAVE_SM90A): 1 builds chapter 3 (sm_90a: CUDA 12.0+); HAVE_SM90A= leaves it out"
	@echo "  DEFINES=$(DEFINES): the kernels' experiment knobs, e.g. DEFINES=-DFLASH_FP16_PAD=0"
	@echo "  CPPFLAGS=$(CPPFLAGS): e.g. -I<dir holding catch2/> where Catch2 is not installed"

$(B):
	@mkdir -p $(B)
# The command the objects are compiled with, kept in build/flags: when it changes (another ARCH,
# DEFINES or HAVE_SM90A) every object is rebuilt, so that none of another build is linked in.
$(B)/flags: FORCE | $(B)
	@printf '%s\n' '$(COMPILE) $(NO_HALF_IMPLICIT)' | cmp -s - $@ || \
	    printf '%s\n' '$(COMPILE) $(NO_HALF_IMPLICIT)' >$@
FORCE:
# Which headers each object includes, as the compiler finds them while it compiles (build/NAME.d,
# -MMD): a change to lib/hopper.cuh recompiles chapter 3 only, not every test. An object whose .d
# is missing (a first build, or one by an older Makefile) is compiled again (the rule without a
# recipe below stands in for the .d, so make counts it as just made).
DEPFLAGS = -MMD -MP -MF $(@:.o=.d)
DEPS := $(patsubst %.o,%.d,$(LIB_OBJS) $(TEST_OBJS) $(DOCS_OBJS) $(B)/reference.o $(B)/bench.o \
          $(B)/standard.o $(B)/decode.o $(B)/flash_fp16_forward.o $(B)/flash_fp16_backward.o)
$(DEPS):
-include $(wildcard $(DEPS))
$(B)/%.o: %.cu $(B)/%.d $(B)/flags | $(B)
	$(COMPILE) $(NO_HALF_IMPLICIT) $(DEPFLAGS) -c $< -o $@
$(B)/%.o: %.cpp $(B)/%.d $(B)/flags | $(B)
	$(COMPILE) $(DEPFLAGS) -c $< -o $@
$(B)/%.o: lib/%.cpp $(B)/%.d $(B)/flags | $(B)
	$(COMPILE) $(NO_HALF_IMPLICIT) $(DEPFLAGS) -c $< -o $@
$(B)/%.o: lib/%.cu $(B)/%.d $(B)/flags | $(B)
	$(COMPILE) $(NO_HALF_IMPLICIT) $(DEPFLAGS) -c $< -o $@
$(B)/%.o: tests/%.cpp $(B)/%.d $(B)/flags | $(B)
	$(COMPILE) $(DEPFLAGS) -c $< -o $@
$(B)/%.o: tests/%.cu $(B)/%.d $(B)/flags | $(B)
	$(COMPILE) $(DEPFLAGS) -c $< -o $@
$(B)/%.o: bench/%.cu $(B)/%.d $(B)/flags | $(B)
	$(COMPILE) $(DEPFLAGS) -c $< -o $@
# Chapter 2 in two halves compiled at once, its forward's and its backward's host code (its
# kernels' instances are most of the build: flash_fp16.cu says how), joined into one object.
$(B)/flash_fp16_forward.o: flash_fp16.cu $(B)/flash_fp16_forward.d $(B)/flags | $(B)
	$(COMPILE) $(NO_HALF_IMPLICIT) $(DEPFLAGS) -DFLASH_FP16_FORWARD -c $< -o $@
$(B)/flash_fp16_backward.o: flash_fp16.cu $(B)/flash_fp16_backward.d $(B)/flags | $(B)
	$(COMPILE) $(NO_HALF_IMPLICIT) $(DEPFLAGS) -DFLASH_FP16_BACKWARD -c $< -o $@
$(B)/flash_fp16.o: $(B)/flash_fp16_forward.o $(B)/flash_fp16_backward.o
	ld -r $^ -o $@
# Chapter 3: wgmma exists only in the sm_90a target, whatever ARCH says (on another GPU its
# launcher refuses to run, and the kernel traps if it ever did).
$(B)/flash_hopper.o $(B)/flash_hopper_backward.o $(B)/flash_hopper_fp8.o: $(B)/%.o: %.cu $(B)/%.d \
    $(B)/flags | $(B)
	$(NVCC) $(CPPFLAGS) $(INCLUDES) $(filter-out -arch=%,$(NVCCFLAGS)) $(NO_HALF_IMPLICIT) \
	    $(DEFINES) -gencode=arch=compute_90a,code=sm_90a $(DEPFLAGS) -c $< -o $@

test_flash: $(TEST_OBJS) $(LIB_OBJS) $(B)/reference.o
	$(NVCC) $(NVCCFLAGS) $^ -o $@
check_docs: $(DOCS_OBJS) $(LIB_OBJS) $(B)/reference.o
	$(NVCC) $(NVCCFLAGS) $^ -o $@
flash_bench: $(B)/bench.o $(B)/standard.o $(LIB_OBJS) $(B)/reference.o
	$(NVCC) $(NVCCFLAGS) $^ -o $@ $(LDLIBS)

# Chapter 4's decode timing (bench/decode.cu): not part of all; lab/gpu-decode.sh runs it.
flash_decode_bench: $(B)/decode.o $(LIB_OBJS)
	$(NVCC) $(NVCCFLAGS) $^ -o $@

# The measured times of make test, for make help (lab/data/loop-h200.csv; README.md quotes them).
TEST_TIMES := on an H200 the build 90 s from clean, the tests 29-32 s; 256 s without a GPU, 2 cores

test: test_flash
	./test_flash
# One chapter's tests, make stress's twins left out (Catch2 test specs; the first build takes
# every file, later ones only what changed: after a one-line change to flash.cu, make ch1
# recompiles flash.cu and links).
ch1_spec := "* - fp32"~[stress],[tile]~[fp16]~[stress]
ch2_spec := [fp16]~[hopper]~[decode]~"* - fp32"~[stress]
ch3_spec := [hopper]~[stress]
ch4_spec := [gqa]~[stress],[decode]~[stress]
ch1 ch2 ch3 ch4: test_flash
	./test_flash '$($@_spec)'
# A student's make check with an exercise applied names it and how to undo it, nothing more (its
# log and NOTES' figures are meant to disagree with the changed kernel).
check:
	@for p in exercises/*.patch; do \
	    if git apply -R --check "$$p" 2>/dev/null; then \
	        echo "make check: exercise $$p is applied (git apply -R $$p undoes it); nothing checked"; \
	        exit 1; \
	    fi; \
	    git apply --check "$$p" 2>/dev/null || { \
	        echo "make check: exercise $$p no longer applies to the sources (remake its diff)"; \
	        exit 1; }; \
	done
	@$(MAKE) --no-print-directory check_docs
	./check_docs
# The maintainer's check: every exercise log still current with the sources it ran (remake the
# stale ones with exercises/run.sh --stale on a GPU).
check-exercises: check_docs
	./check_docs "[freshness]"
stress: test_flash
	./test_flash "[stress]"
# flash_bench exits 77 where there is no GPU, after one line saying so: nothing failed.
run: flash_bench
	@./flash_bench; status=$$?; [ $$status = 0 ] || [ $$status = 77 ]
bench: flash_bench
	./flash_bench --protocol --csv bench.csv
plot:
	gnuplot -e "csv='bench.csv'; out='bench.png'" bench/plot.gp
# The sanitizers slow kernels 10-100x: the tests' deadlines (tests/test_util.h) stretch 20x.
# initcheck runs with FLASH_ZERO_SCRATCH=1: every scratch zeroed first (lib/checks.h says why).
# Every tool runs, whatever the one before found; the last line names those that failed.
# Without compute-sanitizer or a GPU it says so in one line, before building anything.
sanitize:
	@command -v $(SANITIZER) >/dev/null 2>&1 || [ -x $(SANITIZER) ] || { echo "make sanitize: \
	compute-sanitizer not found ($(SANITIZER)); it comes with the CUDA Toolkit: nothing was run"; exit 1; }
	@[ "$(HAVE_GPU)" = 1 ] || { echo "make sanitize: no NVIDIA GPU here: the [sanitize] tests \
	need one; nothing was run"; exit 0; }
	@$(MAKE) --no-print-directory test_flash
	@failed=; for tool in memcheck racecheck synccheck initcheck; do \
	    echo "== compute-sanitizer --tool $$tool"; \
	    zero=; [ $$tool = initcheck ] && zero=FLASH_ZERO_SCRATCH=1; \
	    env $$zero FLASH_TEST_DEADLINE_SCALE=20 $(SANITIZER) --tool $$tool --error-exitcode 1 ./test_flash "[sanitize]" || \
	        failed="$$failed $$tool"; \
	done; \
	if [ -n "$$failed" ]; then echo "make sanitize: failed under$$failed (each tool's output is above)"; exit 1; fi; \
	echo "make sanitize: no tool found an error"
# Not part of all or test: the C++ half needs no Python. pytorch/flash_torch.py builds its extension
# on first use (cached in pytorch/.torch_build/); run as a script it builds now, or says in one line
# what is missing (torch >= 2.3 with CUDA, a GPU, nvcc, ninja).
torch:
	python3 pytorch/flash_torch.py
clean:
	rm -rf $(B) test_flash check_docs flash_bench flash_decode_bench .torch_build pytorch/.torch_build

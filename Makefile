# FlashAttention in CUDA C++, in three chapters: 1, fp32 on the CUDA cores (flash.cu); 2, fp16 and
# bf16 on the tensor cores (flash_fp16.cu); 3, Hopper's own instructions (flash_hopper.cu).
# `make help` lists the targets.

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

# Chapter 3 needs the sm_90a target (wgmma, setmaxnreg), which CUDA 12.0 and newer have. With an
# older toolkit it is left out: flash_forward_fp16/_bf16 then run chapter 2 on every GPU, and
# chapter 3's own calls throw std::runtime_error saying it was not built.
HAVE_SM90A := $(shell $(NVCC) --list-gpu-code 2>/dev/null | grep -qx 'sm_90a\|sm_90' && echo 1)
ifneq ($(HAVE_SM90A),1)
DEFINES += -DFLASH_NO_HOPPER
endif

# -lineinfo lets compute-sanitizer and Nsight Compute point at source lines; it costs no speed.
# DEFINES: the kernels' experiment knobs, e.g. make clean all DEFINES=-DFLASH_PLAIN_COPY.
# CPPFLAGS: where Catch2 is, if not installed (e.g. -I.deps/include).
NVCCFLAGS ?= -O3 -std=c++17 -arch=$(ARCH) -lineinfo -Xcompiler -Wall,-Wextra
INCLUDES  := -I. -Ilib -Itests -Ibench
CPPFLAGS  ?=
LDLIBS    ?= -lcublas
COMPILE    = $(NVCC) $(CPPFLAGS) $(INCLUDES) $(NVCCFLAGS) $(DEFINES)
B := build

# The library: each chapter's kernels and what they share (lib/: the argument checks).
LIB_OBJS := $(B)/flash.o $(B)/flash_fp16.o $(B)/checks.o
ifeq ($(HAVE_SM90A),1)
LIB_OBJS += $(B)/flash_hopper.o
endif
# The tests: test_flash.cpp and every tests/test_*.cpp but the documentation checks (test_docs.cpp).
TEST_OBJS := $(B)/test_flash.o $(patsubst tests/%.cpp,$(B)/%.o,$(filter-out tests/test_docs.cpp,$(wildcard tests/test_*.cpp)))
DOCS_OBJS := $(B)/test_docs.o $(B)/test_util.o
HEADERS   := flash.h reference.h $(wildcard lib/*.h tests/*.h bench/*.h)

.PHONY: all test check stress run bench plot sanitize torch help clean
all: test_flash flash_bench

help:
	@echo "make test      build and run the tests (about a minute; GPU tests skip, saying so, without a GPU)"
	@echo "make run       the demo: one shape on the GPU, timed and checked against the CPU reference"
	@echo "make check     the documentation checks: README's figures, NOTES' quotes, cited data, exercises"
	@echo "make stress    the long determinism and size tests (run before calling a kernel change done)"
	@echo "make sanitize  the [sanitize] tests under compute-sanitizer's four tools"
	@echo "make bench     the FlashAttention-2 benchmark protocol (writes bench.csv); make plot draws it"
	@echo "make torch     build the PyTorch op (pytorch/, torch >= 2.3); then: python3 -m pytest pytorch"
	@echo "make clean     remove what the build made"
	@echo "Variables: ARCH (now $(ARCH)), DEFINES, CPPFLAGS (e.g. -I<dir holding catch2/>)"

$(B):
	@mkdir -p $(B)
$(B)/%.o: %.cu $(HEADERS) | $(B)
	$(COMPILE) -c $< -o $@
$(B)/%.o: %.cpp $(HEADERS) | $(B)
	$(COMPILE) -c $< -o $@
$(B)/%.o: lib/%.cpp $(HEADERS) | $(B)
	$(COMPILE) -c $< -o $@
$(B)/%.o: tests/%.cpp $(HEADERS) | $(B)
	$(COMPILE) -c $< -o $@
$(B)/%.o: bench/%.cu $(HEADERS) | $(B)
	$(COMPILE) -c $< -o $@
# Chapter 3: wgmma exists only in the sm_90a target, whatever ARCH says (on another GPU its
# launcher refuses to run, and the kernel traps if it ever did).
$(B)/flash_hopper.o: flash_hopper.cu $(HEADERS) | $(B)
	$(NVCC) $(CPPFLAGS) $(INCLUDES) $(filter-out -arch=%,$(NVCCFLAGS)) $(DEFINES) \
	    -gencode=arch=compute_90a,code=sm_90a -c $< -o $@

test_flash: $(TEST_OBJS) $(LIB_OBJS) $(B)/reference.o
	$(NVCC) $(NVCCFLAGS) $^ -o $@
check_docs: $(DOCS_OBJS) $(LIB_OBJS) $(B)/reference.o
	$(NVCC) $(NVCCFLAGS) $^ -o $@
flash_bench: $(B)/bench.o $(B)/standard.o $(LIB_OBJS) $(B)/reference.o
	$(NVCC) $(NVCCFLAGS) $^ -o $@ $(LDLIBS)

test: test_flash
	./test_flash
check: check_docs
	./check_docs
stress: test_flash
	./test_flash "[stress]"
run: flash_bench
	./flash_bench
bench: flash_bench
	./flash_bench --protocol --csv bench.csv
plot:
	gnuplot -e "csv='bench.csv'; out='bench.png'" bench/plot.gp
sanitize: test_flash
	@for tool in memcheck racecheck synccheck initcheck; do \
	    echo "== compute-sanitizer --tool $$tool"; \
	    $(SANITIZER) --tool $$tool --error-exitcode 1 ./test_flash "[sanitize]" || exit 1; \
	done
# Not part of all or test: the C++ half needs no Python. pytorch/flash_torch.py builds its extension
# on first use (cached in pytorch/.torch_build/); run as a script it builds now, or says in one line
# what is missing (torch >= 2.3 with CUDA, a GPU, nvcc, ninja).
torch:
	python3 pytorch/flash_torch.py
clean:
	rm -rf $(B) test_flash check_docs flash_bench .torch_build pytorch/.torch_build

# Minimal FlashAttention in CUDA C++: chapter 1 fp32 (CUDA cores), chapter 2 fp16 (tensor cores).
#   make          build the test suite and the demo/benchmark
#   make test     build and run the test suite (GPU tests skip, with one line, when there is no GPU)
#   make run      the demo: one shape, timed, checked against the CPU reference
#   make bench    the FlashAttention-2 benchmark protocol, flash vs standard attention
#   make plot     bench.csv (written by make bench) -> bench.png (gnuplot)
#   make sanitize the [sanitize] GPU tests under compute-sanitizer: memcheck, racecheck,
#                 synccheck, initcheck (run this first after changing a kernel)
#   make torch    build flash_torch.py's PyTorch extension (then: pytest test_torch.py)
#   make clean
# Overridable: ARCH (default native; e.g. ARCH=sm_90), NVCC, CPPFLAGS (e.g. -I<dir with catch2/>),
# DEFINES (e.g. -DFLASH_MIN_BLOCKS_PER_SM=2).

CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(shell command -v nvcc 2>/dev/null || echo $(CUDA_HOME)/bin/nvcc)
ARCH      ?= native
# -lineinfo lets compute-sanitizer and Nsight Compute point at source lines; it costs no speed.
NVCCFLAGS ?= -O3 -std=c++17 -arch=$(ARCH) -lineinfo -Xcompiler -Wall,-Wextra $(DEFINES)
# DEFINES: flash.cu's experiment knobs, e.g. make clean all DEFINES=-DFLASH_PLAIN_COPY
DEFINES   ?=
CPPFLAGS  ?=
LDLIBS    ?= -lcublas

# The library: the kernels of each chapter and the checks they share.
# Chapter 1 (fp32, CUDA cores), chapter 2 (fp16/bf16, tensor cores), chapter 3 (Hopper's wgmma).
FLASH_OBJS := flash.o flash_fp16.o flash_hopper.o checks.o
# The tests: every test_*.cpp (test_flash.cpp, and any others it is split into).
TEST_OBJS := $(patsubst %.cpp,%.o,$(wildcard test_*.cpp))

.PHONY: all test run bench plot sanitize torch clean
SANITIZER ?= $(shell command -v compute-sanitizer 2>/dev/null || echo $(CUDA_HOME)/bin/compute-sanitizer)
all: test_flash flash_bench

# Every object from its one source; every object includes flash.h (the API) and checks.h (the
# library's inside: checks, element counts, FLASH_CUDA_CHECK), directly or through another header.
%.o: %.cu flash.h checks.h
	$(NVCC) $(CPPFLAGS) $(NVCCFLAGS) -c $< -o $@
%.o: %.cpp flash.h checks.h
	$(NVCC) $(CPPFLAGS) $(NVCCFLAGS) -c $< -o $@
# The headers beyond those two that objects include.
reference.o bench.o $(TEST_OBJS): reference.h
flash.o flash_fp16.o flash_hopper.o: log2_units.h
# Chapter 3: wgmma exists only in the sm_90a target, whatever ARCH says (on another GPU its
# launcher refuses to run, and the kernel traps if it ever did).
flash_hopper.o: flash_hopper.cu flash.h checks.h
	$(NVCC) $(CPPFLAGS) $(filter-out -arch=%,$(NVCCFLAGS)) -gencode=arch=compute_90a,code=sm_90a -c $< -o $@
bench.o standard.o: standard.h
$(TEST_OBJS): $(wildcard test_*.h)

test_flash: $(TEST_OBJS) $(FLASH_OBJS) reference.o
	$(NVCC) $(NVCCFLAGS) $^ -o $@
flash_bench: bench.o standard.o $(FLASH_OBJS) reference.o
	$(NVCC) $(NVCCFLAGS) $^ -o $@ $(LDLIBS)

test: test_flash
	./test_flash
run: flash_bench
	./flash_bench
bench: flash_bench
	./flash_bench --protocol --csv bench.csv
plot:
	gnuplot -e "csv='bench.csv'; out='bench.png'" plot.gp
sanitize: test_flash
	@for tool in memcheck racecheck synccheck initcheck; do \
	    echo "== compute-sanitizer --tool $$tool"; \
	    $(SANITIZER) --tool $$tool --error-exitcode 1 ./test_flash "[sanitize]" || exit 1; \
	done
# Not part of all or test: the C++ half needs no Python. flash_torch.py compiles its extension on
# first import (torch.utils.cpp_extension, cached in .torch_build/); this imports it once.
torch:
	python3 -c "import flash_torch; print('flash_torch: built in .torch_build/')"
clean:
	rm -f *.o test_flash flash_bench
	rm -rf .torch_build

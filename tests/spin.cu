// spin.cu: a kernel that really never finishes (within the test's patience): it spins on the
// GPU's nanosecond clock for `seconds`. For the deadline's own test (test_deadline.cpp), which
// runs it in a child process and checks that the run still ends within seconds.

#include "test_util.h"

namespace {
__global__ void spin_kernel(unsigned long long ns) {
    unsigned long long start = 0, now = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
}  // namespace

void launch_spinning_kernel(double seconds, cudaStream_t stream) {
    spin_kernel<<<1, 1, 0, stream>>>(static_cast<unsigned long long>(seconds * 1e9));
    FLASH_CUDA_CHECK(cudaGetLastError());
}

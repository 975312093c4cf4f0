// lab/tanh-error.cu: the error of the GPU's two tanh instructions against tanh in double, for
// softcap's t = tanh(y): tanh.approx.f32 (the kernels' fast_tanh), and the f16x2 path that would
// compute two scores' tanh in one instruction (y rounded to fp16, tanh.approx.f16x2, t back to
// fp32). The tests' tolerance carries softcap c 2^-10 for the tanh (tests/test_util.h): an
// absolute error of 2^-10 in t. Sweeps y over [-12, 12] (2^26 points; past 12 both give 1).
//   nvcc -O3 -std=c++17 -arch=native lab/tanh-error.cu -o tanh_error && ./tanh_error
// Prints the largest absolute error in t of each path, where it is, and its log2.
#include <cuda_fp16.h>

#include <cmath>
#include <cstring>
#include <cstdio>

#define CHECK(call)                                                                           \
    do {                                                                                      \
        cudaError_t e_ = (call);                                                              \
        if (e_ != cudaSuccess) {                                                              \
            std::fprintf(stderr, "%s failed at %s:%d: %s\n", #call, __FILE__, __LINE__,       \
                         cudaGetErrorString(e_));                                             \
            return 1;                                                                         \
        }                                                                                     \
    } while (0)

// The largest |error| a block saw, and its y, as (error bits, y bits): float errors are >= 0, so
// their bits order as they do, and one 64-bit atomicMax keeps the pair together.
__device__ void keep(unsigned long long* worst, float err, float y) {
    const unsigned long long v =
        (unsigned long long)__float_as_uint(err) << 32 | __float_as_uint(y);
    atomicMax(worst, v);
}

__global__ void sweep(unsigned long long* worst, long long n, float lo, float hi) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float y = lo + (hi - lo) * float(double(i) / double(n - 1));
        const double exact = tanh(double(y));
        float t32;
        asm("tanh.approx.f32 %0, %1;" : "=f"(t32) : "f"(y));
        __half2 x = __floats2half2_rn(y, -y);
        unsigned xi = *reinterpret_cast<unsigned*>(&x), ti;
        asm("tanh.approx.f16x2 %0, %1;" : "=r"(ti) : "r"(xi));
        const float2 t16 = __half22float2(*reinterpret_cast<__half2*>(&ti));
        keep(worst + 0, float(fabs(double(t32) - exact)), y);
        keep(worst + 1, float(fabs(double(t16.x) - exact)), y);
        keep(worst + 1, float(fabs(double(t16.y) + exact)), -y);
    }
}

int main() {
    unsigned long long* worst = nullptr;
    CHECK(cudaMalloc(&worst, 2 * sizeof(unsigned long long)));
    CHECK(cudaMemset(worst, 0, 2 * sizeof(unsigned long long)));
    sweep<<<1024, 256>>>(worst, 1ll << 26, -12.f, 12.f);
    CHECK(cudaGetLastError());
    unsigned long long h[2];
    CHECK(cudaMemcpy(h, worst, sizeof h, cudaMemcpyDeviceToHost));
    const char* names[2] = {"tanh.approx.f32", "fp16 y, tanh.approx.f16x2"};
    for (int k = 0; k < 2; ++k) {
        unsigned eb = unsigned(h[k] >> 32), yb = unsigned(h[k]);
        float e, y;
        std::memcpy(&e, &eb, 4);
        std::memcpy(&y, &yb, 4);
        std::printf("%-28s max |t - tanh(y)| = %.3e = 2^%.2f at y = %.6f\n", names[k], e,
                    std::log2(e), y);
    }
    CHECK(cudaFree(worst));
    return 0;
}

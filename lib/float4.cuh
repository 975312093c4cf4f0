// float4.cuh: the float4 arithmetic CUDA lacks, for chapter 1's kernels (flash.cu), whose threads
// keep their slices of a row in float4 registers: a dot product, a scaling, and y += a x.
#pragma once

__device__ __forceinline__ float dot4(float4 a, float4 b) {
    return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}
__device__ __forceinline__ float4 scale4(float4 a, float s) {
    return make_float4(a.x * s, a.y * s, a.z * s, a.w * s);
}
__device__ __forceinline__ void axpy4(float4& y, float a, float4 x) {  // y += a * x
    y.x += a * x.x;
    y.y += a * x.y;
    y.z += a * x.z;
    y.w += a * x.w;
}

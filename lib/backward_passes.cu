// backward_passes.cu: what both backwards on tensor cores run around their kernel, chapter 2's
// (flash_fp16.cu) and chapter 3's (flash_hopper_backward.cu): one scratch, laid out by BwdScratch,
// and two small passes over it, line 4 of FlashAttention-2's Algorithm 2 (D = rowsum(dO o O))
// before the kernel and dQ = dQacc scale in T after it (flash_backward_passes, declared with
// BackwardScratch in chapters.h). fp16 and bf16, on the CUDA cores: any GPU either chapter runs on.
#include "chapters.h"
#include "checks.h"
#include "flash.h"
#include "fragments.cuh"
#include "mask_policy.cuh"  // options_scale

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>


// Both passes walk heads along the grid's y (bh, of BH = batch * heads) and a head's rows along
// its x, so that a row's place in O, dO, dQ (chapter 5's strides: Rows) needs no division. A head
// has q_len rows, or, in a packed batch, its sequence's (q_rows.len); D is laid out as L (l_rows).

// Line 4, before the kernel: D = rowsum(dO o O), fp32, row by row of each head. A row is read by
// dot_threads(D) neighbouring threads, 16 bytes each a step, so that a warp reads whole rows (one
// thread a row would read 16 bytes of each of 32 rows a load, twice the memory traffic that
// needs: lab/chapter2.md, step 11); their sums meet over shuffles.
__host__ __device__ constexpr int dot_threads(int d) { return (d / 8) & -(d / 8); }  // 2 .. 32
template <typename T, int D>
__global__ void flash_backward_dot_fp16_kernel(const T* __restrict__ O, const T* __restrict__ dO,
                                               float* __restrict__ Dsum, int BH, int rows,
                                               const Rows o_rows, const Rows do_rows,
                                               const Rows q_rows, const Rows l_rows) {
    constexpr int TPR = dot_threads(D);
    const int lane = threadIdx.x % 32;
    for (int bh = blockIdx.y; bh < BH; bh += gridDim.y) {
        const T *O_h = O + o_rows.at(bh), *dO_h = dO + do_rows.at(bh);
        const int q_len = q_rows.len(bh, rows);
        float* D_h = Dsum + l_rows.at(bh, rows);
        // The warp's first row, then a grid's worth of rows on; every lane stays for the shuffles.
        for (int i0 = (blockIdx.x * blockDim.x + threadIdx.x) / 32 * (32 / TPR); i0 < q_len;
             i0 += gridDim.x * blockDim.x / TPR) {
            const int i = i0 + lane / TPR;
            float sum = 0.f;
            for (int c = lane % TPR * 8; c < D && i < q_len; c += 8 * TPR) {  // 8 elements each
                const uint4 o = *reinterpret_cast<const uint4*>(O_h + i * o_rows.row + c);
                const uint4 g = *reinterpret_cast<const uint4*>(dO_h + i * do_rows.row + c);
                for (int k = 0; k < 4; k++) {
                    const float2 a = float2_of(reinterpret_cast<const Pair<T>*>(&o)[k]);
                    const float2 b = float2_of(reinterpret_cast<const Pair<T>*>(&g)[k]);
                    sum += a.x * b.x + a.y * b.y;
                }
            }
            for (int x = TPR / 2; x > 0; x /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, x);
            if (i < q_len && lane % TPR == 0) D_h[i] = sum;
        }
    }
}

// After the kernel: dQ = dQacc scale in T (S was unscaled; scale 1/sqrt(d), or the options'), 4
// elements a thread a step (dQacc's rows where acc_rows says, in rows of D floats; dQ where its
// layout says). A row that saw no key (causal with q_len > kv_len, a window, an empty sequence's
// keys), whose L the forward set to -inf, was never added to: it gets 0.
template <typename T, int D>
__global__ void flash_backward_dq_fp16_kernel(const float* __restrict__ dQacc,
                                              const float* __restrict__ L, T* __restrict__ dQ,
                                              int BH, int rows, float scale, const Rows dq_rows,
                                              const Rows q_rows, const Rows l_rows,
                                              const Rows acc_rows) {
    for (int bh = blockIdx.y; bh < BH; bh += gridDim.y) {
        const size_t head = size_t(q_rows.len(bh, rows)) * D;  // elements of this head
        const float* acc = dQacc + size_t(acc_rows.at(bh, rows)) * D;
        const float* L_h = L + l_rows.at(bh, rows);
        for (size_t x = 4 * (blockIdx.x * size_t(blockDim.x) + threadIdx.x); x < head;
             x += 4 * size_t(gridDim.x) * blockDim.x) {
            const int row = int(x / D);
            T* to = dQ + dq_rows.at(bh) + row * dq_rows.row + x % D;
            const bool seen = L_h[row] != -INFINITY;
            const float4 a = seen ? *reinterpret_cast<const float4*>(acc + x) : float4{};
            reinterpret_cast<Pair<T>*>(to)[0] = pair_of<T>(a.x * scale, a.y * scale);
            reinterpret_cast<Pair<T>*>(to)[1] = pair_of<T>(a.z * scale, a.w * scale);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The backward's scratch, in this order: dQacc (B*H*q_len*d floats), the turns (one per head and
// Q tile, counted for the smallest Br, kBackwardMinBr, so that the size does not depend on the
// device or the chapter: B*H*ceil(q_len / 32) ints), the ticket, D (B*H*q_len floats). D's rows
// are L's: a packed batch's H*total_q (packed_shape's extents). dQacc holds either layout a
// chapter takes for a packed batch, L's rows (chapter 2) or [batch][heads][q_len] (chapter 3).
struct BwdScratch {
    size_t dq, turns, rows;                            // element counts
    BwdScratch(const AttentionShape& s, const AttentionShape& extents)
        : dq(std::max(q_elems(s), q_elems(extents))),
          turns(size_t(s.batch) * s.heads * ((s.q_len + kBackwardMinBr - 1) / kBackwardMinBr)),
          rows(l_elems(extents)) {}
    size_t bytes() const { return sizeof(float) * (dq + rows) + sizeof(int) * (turns + 1); }
};

size_t flash_backward_fp16_scratch_bytes(const AttentionShape& s) {
    validate_shape(s, kFlashFp16HeadDims, sizeof(__half));
    require(q_elems(s) < SIZE_MAX / 8, "shape: the fp16 backward's fp32 dQ would overflow size_t");
    return BwdScratch(s, s).bytes();
}

// The passes around a backward kernel (lib/chapters.h): the scratch as BwdScratch lays it out, its
// turns and ticket zeroed, line 4 (D) before the kernel, dQ = dQacc scale after it. Both passes
// walk the call's heads (batch * heads) and each head's rows (a packed batch's: its sequence's).
template <typename T>
static void backward_passes(const T* O, const T* dO, const float* L, T* dQ,
                            const AttentionShape& s, const Layout& lay, cudaStream_t stream,
                            const BackwardKernel& kernel, const AttentionOptions& o,
                            const Rows* acc) {
    const AttentionShape x = o.packed.cu_seqlens_q ? packed_shape(s, o.packed) : s;
    const BwdScratch scratch(s, x);
    const size_t turns = scratch.turns;
    const Rows acc_rows = acc ? *acc : lay.L;          // dQacc's rows: L's unless given
    // Element-wise passes: 256 threads a block, a head's work of n threads along x, the heads
    // along y, at most 64 blocks an SM's worth in all (grid-stride both ways).
    const int sms = flash_device_props().multiProcessorCount, BH = s.batch * s.heads;
    const auto grid = [&](size_t n) {
        const int y = std::min(BH, 65535);
        return dim3(unsigned(std::clamp<size_t>((n + 255) / 256, 1, std::max(64 * sms / y, 1))),
                    unsigned(y));
    };
    dispatch_head_dim<kFlashFp16HeadDims>(s.head_dim, [&](auto dim) {
        constexpr int D = decltype(dim)::value;
        with_scratch(scratch.bytes(), stream, [&](void* memory) {  // laid out as BwdScratch says
            BackwardScratch m;
            m.dQacc = static_cast<float*>(memory);
            m.turns = reinterpret_cast<int*>(m.dQacc + scratch.dq);
            m.next_ticket = m.turns + turns;
            m.D = reinterpret_cast<float*>(m.next_ticket + 1);
            // Zero bytes are the int 0 and the float +0: cudaMemsetAsync is right here. In order,
            // dQacc needs no zeroing: each dQ_i's first block stores. A kernel without the order
            // (o.deterministic false: chapter 3's) adds every part, so dQacc starts at 0 there
            // (chapter 2's, which keeps the order, stores over the zeros); dQacc, the turns and
            // the ticket are one range.
            const size_t counters = (turns + 1) * sizeof(int);
            cudaError_t err =
                o.deterministic
                    ? cudaMemsetAsync(m.turns, 0, counters, stream)
                    : cudaMemsetAsync(memory, 0, sizeof(float) * scratch.dq + counters, stream);
            if (err != cudaSuccess) return err;
            flash_backward_dot_fp16_kernel<T, D>
                <<<grid(size_t(s.q_len) * dot_threads(D)), 256, 0, stream>>>(
                    O, dO, m.D, BH, s.q_len, lay.O, lay.dO, lay.Q, lay.L);
            if ((err = cudaGetLastError()) != cudaSuccess) return err;
            if ((err = kernel(m)) != cudaSuccess) return err;
            flash_backward_dq_fp16_kernel<T, D><<<grid(size_t(s.q_len) * D / 4), 256, 0, stream>>>(
                m.dQacc, L, dQ, BH, s.q_len, options_scale(s, o), lay.dQ, lay.Q, lay.L, acc_rows);
            return cudaGetLastError();
        });
    });
}
void flash_backward_passes(const __half* O, const __half* dO, const float* L, __half* dQ,
                           const AttentionShape& s, const Layout& lay, cudaStream_t stream,
                           const BackwardKernel& kernel, const AttentionOptions& options,
                           const Rows* acc) {
    backward_passes(O, dO, L, dQ, s, lay, stream, kernel, options, acc);
}
void flash_backward_passes(const __nv_bfloat16* O, const __nv_bfloat16* dO, const float* L,
                           __nv_bfloat16* dQ, const AttentionShape& s, const Layout& lay,
                           cudaStream_t stream, const BackwardKernel& kernel,
                           const AttentionOptions& options, const Rows* acc) {
    backward_passes(O, dO, L, dQ, s, lay, stream, kernel, options, acc);
}

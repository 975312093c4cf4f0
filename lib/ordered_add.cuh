// ordered_add.cuh: the ordered add of dQ (FlashAttention-2 Algorithm 2, line 15), shared by both
// backwards on tensor cores: chapter 2's (flash_fp16.cu, where the order itself is explained
// before its kernel) and chapter 3's (flash_hopper_backward.cu). The blocks that add to one dQ_i
// do so in a fixed order, so that dQ is bitwise the same from call to call: each block takes a
// ticket as it starts (block_ticket), and a turn counter per (query head, Q tile) says how many
// blocks have added there. A warp waits until the counter reaches its block's place in the order
// (wait_turn), adds, and one thread passes the turn on once the whole block has (pass_turn). Why
// it cannot deadlock: NOTES.md section 14.
#pragma once

// The ordered add. block_ticket: this block's place in the order, for every thread.
__device__ __forceinline__ int block_ticket(int* next) {
    __shared__ int ticket;
    if (threadIdx.x == 0) ticket = atomicAdd(next, 1);
    __syncthreads();
    return ticket;
}
// Lane 0 spins until *turn == mine, then the warp goes on together. It polls with ld.relaxed (an
// acquire load would invalidate the SM's L1 each time), then reads once more with ld.acquire
// (PTX ISA, "Memory Consistency Model"): the adds the blocks before made, before they passed the
// turn, are then in memory before any of ours.
__device__ __forceinline__ void wait_turn(const int* turn, int mine) {
    int now = mine - 1;
    while (threadIdx.x % 32 == 0 && now != mine)
        asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];\n" : "=r"(now) : "l"(turn) : "memory");
    if (threadIdx.x % 32 == 0)
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(now) : "l"(turn) : "memory");
    __syncwarp();
}
// Passes the turn on (one thread, after a barrier that follows the block's adds); red.release:
// every write ordered before it (the other threads' adds, through the barrier) lands first. The
// release waits for them: a round trip to L2 for the thread's warp.
__device__ __forceinline__ void pass_turn(int* turn) {
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(turn) : "memory");
}

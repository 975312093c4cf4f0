"""ring_attention.py: attention over a sequence split across GPUs (context parallelism), a ring
of torch.distributed (NCCL) ranks around this project's kernels (flash_torch.py).

    import torch.distributed as dist
    from ring_attention import ring_attention, shard, unshard
    dist.init_process_group("nccl")                      # torchrun, one process a GPU
    q, k, v = (shard(t, rank, world) for t in (Q, K, V))  # this rank's part of the sequence
    o = ring_attention(q, k, v, causal=True)             # differentiable; o is this rank's part

q: (batch, heads, n_local, head_dim), k and v: (batch, kv_heads, n_local, head_dim), as
flash_torch.flash_attention takes them, each rank holding its own n_local positions of one
sequence of seq_len = the sum of the ranks' n_local. The positions a rank holds are fixed by
shard(): the sequence is cut into 2 * world chunks and rank r holds chunks r and 2 world - 1 - r,
in that order (the "zigzag": one early chunk and one late one, so that under the causal mask every
rank has the same work). Every tensor that lives along the sequence (tokens, positions, labels)
is sharded the same way; unshard() puts the parts back in order.

How it works (NOTES, chapter 4):
  forward   each rank keeps its queries; the K/V parts travel around the ring (rank r sends to
            r + 1 and receives from r - 1), the next part in flight while the kernel works on the
            one in hand. Each kernel call gives a partial (O_s, L_s) over the keys it saw; they are
            merged in fp32 through the logsumexp: L = log sum_s exp(L_s), O = sum_s exp(L_s - L) O_s
            (NOTES section 20's merge, the online softmax's rescale across GPUs).
  backward  the kernels' own backward, given the GLOBAL O and L: P = exp(S - L) is then each key's
            true probability, and D = rowsum(dO * O) the true D, so a call over one part of the keys
            returns that part's exact share of dQ, and the whole of dK, dV for those keys from these
            queries. dQ sums over the parts here; dK, dV (fp32) travel around the ring with K, V,
            each rank adding its share, and arrive at their owner after one full turn.
  causal    on rank r, for a query chunk i and a key chunk j: j after i is skipped, j = i (the
            diagonal) runs the causal kernel, j before i the full one. With the zigzag the rank's
            own two chunks form one causal call (its first chunk precedes its second, so the
            local mask is the global one); every other rank's part gives one full call of half
            the size: its first chunk against both of ours (it is earlier than both) or our
            second chunk against both of its (ours is later than both). Each step: the same work.

Uneven lengths: chunks differ by at most one position (the first seq_len % (2 world) chunks are
one longer), not padded: the kernels take any lengths, a padded key would need a mask they do not
have, and the diagonal calls stay square (q and k of one chunk have one length), which is what
the kernels' bottom-right causal alignment needs to be the global mask. seq_len >= 2 world.

The communication and the steps are separate: each rank's work is a generator (_forward_steps,
_backward_steps) that yields an Exchange (what it sends to the next rank, what it will receive
from the previous) and gets back a handle to wait on. Over NCCL the handle waits on
batch_isend_irecv's requests; simulate() runs `world` such generators in one process, handing the
messages across itself, which is how the CPU tests check the ring's schedule and arithmetic.
"""
import math

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable


# ----------------------------------------------------------------------------------------------
# Where each position lives: 2 * world chunks, rank r holds chunks r and 2 world - 1 - r.

def chunk_lengths(seq_len, world):
    """The 2 * world chunks' lengths: seq_len // (2 world), the first seq_len % (2 world) one
    longer."""
    if world < 1 or seq_len < 2 * world:
        raise ValueError(f"ring_attention: seq_len {seq_len} must be at least 2 * world = "
                         f"{2 * world} (each rank holds two non-empty chunks)")
    base, extra = divmod(seq_len, 2 * world)
    return [base + (c < extra) for c in range(2 * world)]


def shard_lengths(seq_len, world):
    """[(length of rank r's first chunk, of its second chunk) for r in range(world)]."""
    c = chunk_lengths(seq_len, world)
    return [(c[r], c[2 * world - 1 - r]) for r in range(world)]


def shard_positions(seq_len, world, rank):
    """The global positions rank holds, in the order it holds them."""
    c = chunk_lengths(seq_len, world)
    start = [sum(c[:i]) for i in range(2 * world)]
    first, second = rank, 2 * world - 1 - rank
    return (list(range(start[first], start[first] + c[first])) +
            list(range(start[second], start[second] + c[second])))


def shard(x, rank, world, dim=2):
    """Rank's part of x along dim (x holds the whole sequence there): its two chunks, joined."""
    c = chunk_lengths(x.shape[dim], world)
    start = [sum(c[:i]) for i in range(2 * world)]
    a, b = rank, 2 * world - 1 - rank
    return torch.cat([x.narrow(dim, start[a], c[a]), x.narrow(dim, start[b], c[b])], dim=dim)


def unshard(parts, dim=2):
    """The whole sequence from every rank's part (parts[r] from rank r), in order."""
    world = len(parts)
    seq_len = sum(p.shape[dim] for p in parts)
    lens = shard_lengths(seq_len, world)
    chunks = [None] * (2 * world)
    for r, p in enumerate(parts):
        if p.shape[dim] != sum(lens[r]):
            raise ValueError(f"unshard: part {r} has {p.shape[dim]} positions along dim {dim}, "
                             f"shard() gives it {sum(lens[r])} of {seq_len}")
        chunks[r] = p.narrow(dim, 0, lens[r][0])
        chunks[2 * world - 1 - r] = p.narrow(dim, lens[r][0], lens[r][1])
    return torch.cat(chunks, dim=dim)


def pairs(rank, src, lens, causal):
    """The kernel calls rank makes with the K/V part of rank src: [(query rows, key rows, causal)]
    as slices of the two ranks' local parts (lens: shard_lengths). Without the mask: all against
    all. With it (chunks a = rank, b = 2W-1-rank here; c = src, e = 2W-1-src there):
      src == rank: one causal call on the whole part (a before b, so the local mask is exact);
      src < rank:  c is before a and b, e after both: all our queries against c, full;
      src > rank:  c and e are both after a and before b: our b against all of src's, full."""
    n_q, n_k = sum(lens[rank]), sum(lens[src])
    if not causal:
        return [(slice(0, n_q), slice(0, n_k), False)]
    if src == rank:
        return [(slice(0, n_q), slice(0, n_k), True)]
    if src < rank:
        return [(slice(0, n_q), slice(0, lens[src][0]), False)]
    return [(slice(lens[rank][0], n_q), slice(0, n_k), False)]


# ----------------------------------------------------------------------------------------------
# The merge through L (NOTES section 20), in fp32, in place.

def merge_(o, lse, o_s, lse_s):
    """o, lse (fp32, written in place) := the merge of (o, lse) and a partial (o_s, lse_s) over
    other keys: L = log(e^L + e^L_s), O = e^(L - L_new) O + e^(L_s - L_new) O_s. A side that saw
    no key (L = -inf) has weight 0; both -inf leave O = 0, L = -inf (never -inf - -inf)."""
    new = torch.logaddexp(lse, lse_s)
    none = torch.isneginf(new)
    safe = torch.where(none, torch.zeros_like(new), new)
    w = torch.exp(lse - safe).masked_fill(none, 0.0)
    w_s = torch.exp(lse_s - safe).masked_fill(none, 0.0)
    o.mul_(w.unsqueeze(-1)).add_(o_s.to(o.dtype) * w_s.unsqueeze(-1))
    lse.copy_(new)


# ----------------------------------------------------------------------------------------------
# The steps of one rank, as generators that yield their communication.

class Exchange:
    """One ring step's messages: send (tensors, to the next rank) and recv ((shape, dtype) of each
    tensor coming from the previous rank, in the same order). The generator gets back a handle
    whose wait() returns the received tensors."""

    def __init__(self, send, recv):
        self.send, self.recv = list(send), list(recv)


def _acc(t):
    """The accumulators' dtype: fp32 (float64 for float64 inputs, the CPU tests' exact runs)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _spec(t, n):
    """(shape, dtype) of a tensor like t with n positions along dim 2."""
    return ((t.shape[0], t.shape[1], n, t.shape[3]), t.dtype)


def _forward_steps(q, k, v, causal, rank, world, lens, attend):
    """Rank's forward: yields world - 1 Exchanges, returns (O, L) in fp32 (_acc). attend(q, k, v,
    causal) -> (o, lse) is the kernel (flash_torch's forward, or a reference in the tests)."""
    n = [a + b for a, b in lens]
    o = torch.zeros(q.shape, dtype=_acc(q), device=q.device)
    lse = torch.full(q.shape[:3], -math.inf, dtype=_acc(q), device=q.device)
    kv = (k, v)
    for step in range(world):
        src = (rank - step) % world                 # whose K/V part is in hand
        if step + 1 < world:                        # the next part travels while we compute
            nxt = (rank - step - 1) % world
            handle = yield Exchange(kv, [_spec(k, n[nxt]), _spec(v, n[nxt])])
        for rows, keys, diag in pairs(rank, src, lens, causal):
            o_s, lse_s = attend(q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], diag)
            merge_(o[:, :, rows], lse[:, :, rows], o_s, lse_s)
        if step + 1 < world:
            kv = tuple(handle.wait())
    return o, lse


def _backward_steps(q, k, v, o, do, lse, causal, rank, world, lens, grad):
    """Rank's backward with the global o and lse: yields 2 world - 1 Exchanges, returns dq, dk,
    dv in fp32 (dk, dv of rank's own K/V part, summed over every rank's queries). grad(q, k, v,
    o, do, lse, causal) -> (dq, dk, dv) is the kernel's backward."""
    n = [a + b for a, b in lens]
    dq = torch.zeros(q.shape, dtype=_acc(q), device=q.device)
    kv = (k, v)
    for step in range(world):
        src = (rank - step) % world
        nxt = (rank - step - 1) % world             # the part that comes next (after the last
        if step + 1 < world:                        # step: our own dK, dV, home)
            kv_handle = yield Exchange(kv, [_spec(k, n[nxt]), _spec(v, n[nxt])])
        shares = []
        for rows, keys, diag in pairs(rank, src, lens, causal):
            dq_s, dk_s, dv_s = grad(q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys],
                                    o[:, :, rows], do[:, :, rows], lse[:, :, rows], diag)
            dq[:, :, rows] += dq_s
            shares.append((keys, dk_s, dv_s))
        if step == 0:                               # our own part: the accumulators start here
            dk = torch.zeros(kv[0].shape, dtype=_acc(q), device=q.device)
            dv = torch.zeros(kv[1].shape, dtype=_acc(q), device=q.device)
        else:                                       # src's, from the ranks before us on the ring
            dk, dv = dkv_handle.wait()
        for keys, dk_s, dv_s in shares:
            dk[:, :, keys] += dk_s
            dv[:, :, keys] += dv_s
        dkv_handle = yield Exchange([dk, dv], [_spec(dk, n[nxt]), _spec(dv, n[nxt])])
        if step + 1 < world:
            kv = tuple(kv_handle.wait())
    dk, dv = dkv_handle.wait()                      # our own, after one full turn
    return dq, dk, dv


class _Ready:
    """A handle whose tensors are already here (one process: world 1, or the simulation)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def wait(self):
        return self.tensors


def _run(steps, exchange):
    """Drive one rank's generator: each Exchange it yields goes to exchange(), the handle back."""
    try:
        ex = next(steps)
        while True:
            ex = steps.send(exchange(ex))
    except StopIteration as done:
        return done.value


def simulate(generators):
    """Run one generator per rank in this process, in lockstep, handing each rank what the
    previous one sent (copies, as the wire would). Returns each rank's result. The ranks must
    agree on the number of steps and on the shapes of what they send and receive."""
    world = len(generators)
    pending = []
    for g in generators:
        try:
            pending.append(next(g))
        except StopIteration as done:
            pending.append(done)
    while not all(isinstance(p, StopIteration) for p in pending):
        if any(isinstance(p, StopIteration) for p in pending):
            raise RuntimeError("simulate: the ranks disagree on the number of exchanges")
        handles = []
        for r in range(world):
            sent, want = pending[(r - 1) % world].send, pending[r].recv
            got = [(tuple(t.shape), t.dtype) for t in sent]
            if got != [(tuple(s), d) for s, d in want]:
                raise RuntimeError(f"simulate: rank {r} expects {want}, rank {(r - 1) % world} "
                                   f"sends {got}")
            handles.append(_Ready([t.clone() for t in sent]))
        for r, g in enumerate(generators):
            try:
                pending[r] = g.send(handles[r])
            except StopIteration as done:
                pending[r] = done
    return [p.value for p in pending]


# ----------------------------------------------------------------------------------------------
# Over NCCL.

_waits = None  # when a list: (start, end) CUDA events around each wait on a receive


class record_waits:
    """with record_waits() as w: ... ; then w.ms() (after a synchronize): the time this rank's
    stream stood waiting on the ring's receives, summed. Each wait is bracketed by two events
    on the current stream: the first completes when the work before it is done, the second when
    the data has arrived, so the gap is the time the GPU had nothing to do but wait."""

    def __enter__(self):
        global _waits
        self.events, _waits = [], []
        return self

    def __exit__(self, *exc):
        global _waits
        self.events, _waits = _waits, None

    def ms(self):
        return sum(a.elapsed_time(b) for a, b in self.events)


class _Pending:
    def __init__(self, requests, tensors):
        self.requests, self.tensors = requests, tensors

    def wait(self):
        if _waits is not None:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        for req in self.requests:
            req.wait()  # NCCL: the current stream waits for the transfer; the host does not
        if _waits is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            _waits.append((start, end))
        return self.tensors


class _Ring:
    """This rank's place on the ring of `group` (None: the default group) and the sequence's
    layout, from n_local (and seq_len, if the caller knows it; else one all_gather of the ranks'
    n_local, a few microseconds)."""

    def __init__(self, group, n_local, seq_len, device):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if seq_len is None:
            if self.world == 1:
                counts = [n_local]
            else:
                mine = torch.tensor([n_local], dtype=torch.int64, device=device)
                every = torch.empty(self.world, dtype=torch.int64, device=device)
                dist.all_gather_into_tensor(every, mine, group=group)
                counts = every.tolist()
            seq_len = sum(counts)
        self.lens = shard_lengths(seq_len, self.world)
        if sum(self.lens[self.rank]) != n_local:
            raise ValueError(f"ring_attention: rank {self.rank} holds {n_local} positions; shard() "
                             f"of a sequence of {seq_len} over {self.world} ranks gives it "
                             f"{sum(self.lens[self.rank])}")
        # The neighbours' ranks in the default group, as P2POp wants them.
        to_global = (lambda r: r) if group is None else (
            lambda r: dist.get_global_rank(group, r))
        self.next = to_global((self.rank + 1) % self.world)
        self.prev = to_global((self.rank - 1) % self.world)

    def __call__(self, ex):
        if self.world == 1:  # the one rank sends to itself: the tensors are already here
            return _Ready(ex.send)
        device = ex.send[0].device
        bufs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in ex.recv]
        ops = ([dist.P2POp(dist.isend, t, self.next, self.group) for t in ex.send] +
               [dist.P2POp(dist.irecv, b, self.prev, self.group) for b in bufs])
        return _Pending(dist.batch_isend_irecv(ops), bufs)


def _kernels():
    """flash_torch's forward and backward, on tensors the kernels can read (dense, aligned)."""
    import flash_torch  # here, not at the top: the helpers above need only torch (CPU tests)
    ext, readable = flash_torch.build(), flash_torch._readable

    def attend(q, k, v, causal):
        return ext.forward(readable(q), readable(k), readable(v), causal)

    def grad(q, k, v, o, do, lse, causal):
        return ext.backward(*(readable(t) for t in (q, k, v, o, do, lse)), causal)
    return attend, grad


class RingAttention(torch.autograd.Function):
    """The ring as one autograd node: forward saves this rank's q, k, v, its rows of the global o
    (in q's dtype, as flash_torch saves it) and L; backward runs the ring backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, group, seq_len):
        if q.shape[2] != k.shape[2] or k.shape != v.shape:
            raise ValueError(f"ring_attention: q is {tuple(q.shape)}, k {tuple(k.shape)}, v "
                             f"{tuple(v.shape)}: q, k and v must hold the same positions (self-"
                             "attention, sharded alike) and k, v one shape")
        ring = _Ring(group, q.shape[2], seq_len, q.device)
        attend, _ = _kernels()
        q, k, v = (t.contiguous() for t in (q, k, v))  # NCCL sends dense tensors
        o32, lse = _run(_forward_steps(q, k, v, bool(causal), ring.rank, ring.world, ring.lens,
                                       attend), ring)
        o = o32.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.ring, ctx.causal = ring, bool(causal)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @once_differentiable  # the kernels' gradients are not themselves differentiable
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        ring = ctx.ring
        _, grad = _kernels()
        dq, dk, dv = _run(_backward_steps(q, k, v, o, do.contiguous(), lse, ctx.causal,
                                          ring.rank, ring.world, ring.lens, grad), ring)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention_with_lse(q, k, v, causal=False, group=None, seq_len=None):
    """(o, lse) of this rank's queries over the whole sequence; lse fp32, (batch, heads, n_local)."""
    return RingAttention.apply(q, k, v, causal, group, seq_len)


def ring_attention(q, k, v, causal=False, group=None, seq_len=None):
    """softmax(q K^T / sqrt(d)) V for this rank's queries q over every rank's keys and values,
    differentiable in q, k, v. seq_len (optional): the whole sequence's length, which saves one
    all_gather a call."""
    return RingAttention.apply(q, k, v, causal, group, seq_len)[0]

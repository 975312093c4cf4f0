# lab/tanh-poly.py: the coefficients of lib/mask_policy.cuh's tanh_fma, tanh(y) = y q(y^2) for
# |y| <= 1: for 4 to 7 coefficients, the q of least maximum relative error (Remez exchange on
# z = y^2 in [0, 1], a grid of 20,001 points; plain Python, no numpy). tanh is odd, so y q(y^2)
# is exact at 0 and its relative error is q's against tanh(y) / y. Prints each count's
# coefficients (c0 first) and error.
#   python3 lab/tanh-poly.py
import math


def solve(A, b):  # Gauss-Jordan with partial pivoting
    n = len(b)
    M = [row[:] + [b[i]] for i, row in enumerate(A)]
    for i in range(n):
        p = max(range(i, n), key=lambda r: abs(M[r][i]))
        M[i], M[p] = M[p], M[i]
        for r in range(n):
            if r != i:
                f = M[r][i] / M[i][i]
                for c in range(i, n + 1):
                    M[r][c] -= f * M[i][c]
    return [M[i][n] / M[i][i] for i in range(n)]


def target(z):  # tanh(y) / y at z = y^2
    return math.tanh(math.sqrt(z)) / math.sqrt(z) if z > 0 else 1.0


def fit(terms, Z=1.0):
    n = terms + 1  # the coefficients and the levelled error E
    ref = [Z * (1 - math.cos(math.pi * i / (n - 1))) / 2 for i in range(n)]
    grid = [Z * i / 20000 for i in range(20001)]
    for _ in range(40):
        A, b = [], []
        for i, z in enumerate(ref):  # q(z) / g(z) - 1 = (-1)^i E at the reference points
            w = target(z)
            A.append([z**k / w for k in range(terms)] + [-((-1) ** i)])
            b.append(1.0)
        sol = solve(A, b)
        c = sol[:terms]
        errs = [sum(c[k] * z**k for k in range(terms)) / target(z) - 1 for z in grid]
        ext, i = [], 0  # the extreme point of each run of one sign
        while i < len(grid):
            j, best = i, i
            while j < len(grid) and (errs[j] > 0) == (errs[i] > 0):
                if abs(errs[j]) > abs(errs[best]):
                    best = j
                j += 1
            ext.append(best)
            i = j
        if len(ext) >= n:  # the n consecutive extremes whose smallest is largest
            pick = max((ext[k:k + n] for k in range(len(ext) - n + 1)),
                       key=lambda s: min(abs(errs[x]) for x in s))
            ref = [grid[x] for x in pick]
    return c, max(abs(e) for e in errs)


for terms in (4, 5, 6, 7):
    c, e = fit(terms)
    print(terms, ["%.9g" % x for x in c], "%.3g" % e, "2^%.1f" % math.log2(e))

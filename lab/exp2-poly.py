# lab/exp2-poly.py: the coefficients of lib/log2_units.h's exp2_fma, 2^f, f in [-1/2, 1/2]: for
# degrees 3 to 5, the polynomial with p(0) = 1 of least maximum relative error (Remez exchange on
# a grid of 20,001 points; plain Python, no numpy). Prints each degree's coefficients and error.
#   python3 lab/exp2-poly.py
import math
def solve(A,b):
    n=len(b); M=[row[:]+[b[i]] for i,row in enumerate(A)]
    for i in range(n):
        p=max(range(i,n),key=lambda r:abs(M[r][i])); M[i],M[p]=M[p],M[i]
        for r in range(n):
            if r!=i:
                f=M[r][i]/M[i][i]
                for c in range(i,n+1): M[r][c]-=f*M[i][c]
    return [M[i][n]/M[i][i] for i in range(n)]
def fit(deg):
    n=deg+1  # unknowns c1..cdeg, E
    ref=[-0.5+ (i)/(n-1) for i in range(n)]
    grid=[-0.5+i/20000 for i in range(20001)]
    for it in range(30):
        A=[];b=[]
        for i,f in enumerate(ref):
            w=2**f
            A.append([f**k/w for k in range(1,deg+1)]+[-(-1)**i]); b.append(1-1/w)
        sol=solve(A,b); c=[1.0]+sol[:deg]; E=sol[deg]
        err=lambda f: sum(c[k]*f**k for k in range(deg+1))/2**f-1
        es=[err(f) for f in grid]
        # find extrema: segments of constant sign
        ext=[];i=0
        while i<len(grid):
            j=i; s=es[i]>0; best=i
            while j<len(grid) and (es[j]>0)==s:
                if abs(es[j])>abs(es[best]): best=j
                j+=1
            ext.append(best); i=j
        if len(ext)>=n:
            # choose n consecutive with max min
            cand=max((ext[k:k+n] for k in range(len(ext)-n+1)), key=lambda s:min(abs(es[x]) for x in s))
            ref=[grid[x] for x in cand]
    return c, max(abs(e) for e in es)
for d in (3,4,5):
    c,e=fit(d); print(d, ["%.9g"%x for x in c], "%.3g"%e, "2^%.1f"%math.log2(e))

"""(seventeenth session) .venv/bin/python bench/results/cpu-2026-12-04-zen4-17th/attn_ablate.py [COMMIT]: the
decode attention kernel of COMMIT (default 8273be5, before the 128-key softmax steps) with parts taken
out, written to /tmp/ablate-*.c for bench/results/cpu-2026-12-03-spr-15th/attn_ab.py, e.g.
SH=15 ROUNDS=30 THR=1 PYTHONPATH=. .venv/bin/python bench/results/cpu-2026-12-03-spr-15th/attn_ab.py /tmp/ablate-*.c
(the outputs differ, of course: this is where the time goes, not a kernel)."""
import subprocess
import sys

commit = sys.argv[1] if len(sys.argv) > 1 else "8273be5"
src = subprocess.run(["git", "show", f"{commit}:prefixkv/csrc/cpu_ops.c"], check=True, capture_output=True,
                     text=True).stdout
PV = """    for (int t = 0; t < n; t++) {
        for (int c = 0; c < ND; c++) {
            const __m512 v = _mm512_loadu_ps(vt + (int64_t)t * D + 16 * c);
            for (int g = 0; g < GB; g++) av[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[g][t]), v, av[g][c]);
        }
    }"""
QK = """                dot[t] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kt + (int64_t)t * D));
                for (int c = 1; c < ND; c++)
                    dot[t] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kt + (int64_t)t * D + 16 * c), dot[t]);"""
HSUM = "__m512 raw = _mm512_mul_ps(hsum16(dot), _mm512_set1_ps(scale));"
EXPV = "pv[g] = _mm512_maskz_mov_ps(valid, v_exp(_mm512_sub_ps(sv[g], _mm512_set1_ps(bm[g]))));"
EXPS = "a[g] = expf(m[h0 + g] - bm[g]);"
for part in (PV, QK, HSUM, EXPV, EXPS):
    assert part in src, part
no_pv = src.replace(PV, "    (void)vt; (void)p;")
no_qk = src.replace(QK, "                dot[t] = _mm512_mul_ps(qv[t&3], _mm512_set1_ps(kt[t]));")
no_both = no_pv.replace(QK, "                dot[t] = _mm512_mul_ps(qv[t&3], _mm512_set1_ps(kt[t]));")
no_hsum = no_both.replace(HSUM, "__m512 raw = _mm512_mul_ps(dot[0], _mm512_set1_ps(scale));")
no_expv = no_hsum.replace(EXPV, "pv[g] = _mm512_maskz_mov_ps(valid, _mm512_sub_ps(sv[g], _mm512_set1_ps(bm[g])));")
no_exps = no_expv.replace(EXPS, "a[g] = (m[h0 + g] - bm[g]);")
for name, text in (("noPV", no_pv), ("noQK", no_qk), ("noPVQK", no_both), ("noPVQKhsum", no_hsum),
                   ("noPVQKhsumExpV", no_expv), ("noPVQKhsumExp", no_exps)):
    with open(f"/tmp/ablate-{name}.c", "w") as f:
        f.write(text)
    print(f"/tmp/ablate-{name}.c")

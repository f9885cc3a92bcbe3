"""(twenty-second session) python3 bench/results/cpu-2026-12-05-zen4-22nd/attn_ablate.py [SOURCE.c]
Writes /tmp/abl_{nohsum,nopv,nodots,noexp}.c: the decode kernel with one part removed (wrong results;
for timing only): the hsum16 tree (two lanes added instead), P.V, three of the four 16-lane FMA steps of
each score, the exponentials. Time each against the checkout with
HOT=1 JUNK=0 SH=256 PYTHONPATH=. .venv/bin/python bench/results/cpu-2026-12-05-zen4-21st/attn_ab.py /tmp/abl_X.c 256 10
(16 rows sharing 256 tokens, every layer the same cache: the blocks in L2)."""
import sys
s = open(sys.argv[1] if len(sys.argv) > 1 else "prefixkv/csrc/cpu_ops.c").read()
def var(name, a, b):
    assert s.count(a) == 1, (name, s.count(a))
    open(f"/tmp/abl_{name}.c", "w").write(s.replace(a, b))
var("nohsum", "__m512 raw = _mm512_mul_ps(hsum16(dot), _mm512_set1_ps(scale));",
    "__m512 raw = _mm512_mul_ps(_mm512_add_ps(dot[0], dot[15]), _mm512_set1_ps(scale));")
var("nopv", "                        switch ((kh + 1) * G - h0 < DECODE_GB ? (kh + 1) * G - h0 : DECODE_GB) {",
    "                        if (h0 >= 0) continue;\n"
    "                        switch ((kh + 1) * G - h0 < DECODE_GB ? (kh + 1) * G - h0 : DECODE_GB) {")
var("nodots", """                                dot[t] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kt));
                                for (int c = 1; c < ND; c++)
                                    dot[t] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kt + 16 * c), dot[t]);""",
    "                                dot[t] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kt));")
var("noexp", "v_exp(_mm512_sub_ps(_mm512_load_ps(p[h] + 16 * g), vbm))", "_mm512_sub_ps(_mm512_load_ps(p[h] + 16 * g), vbm)")

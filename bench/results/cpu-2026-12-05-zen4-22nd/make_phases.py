"""(twenty-second session) python3 bench/results/cpu-2026-12-05-zen4-22nd/make_phases.py [SOURCE.c] > /tmp/phases.c
This checkout's prefixkv/csrc/cpu_ops.c with a timer after each phase of decoder_layers_f32 (for phases.py)."""
import sys
src = sys.argv[1] if len(sys.argv) > 1 else "prefixkv/csrc/cpu_ops.c"
s = open(src).read()
start = s.index("int decoder_layers_f32(const decoder_layer_f32 *layers, int num_layers, const decoder_step_f32 *s) {")
end = s.index("/* The vector width the kernels above were built for")
body = s[start:end].replace("        for (int i = 0; i < num_layers; i++) {",
    "        const int tid = omp_get_thread_num(); double tp = omp_get_wtime(), tn;\n"
    "#define PH(k) do { tn = omp_get_wtime(); if (tid < 2) phase_t[tid][k] += tn - tp; tp = tn; } while (0)\n"
    "        for (int i = 0; i < num_layers; i++) {", 1)
out, k = [], 0
for ln in body.split("\n"):
    out.append(ln)
    st = ln.strip()
    if (st.endswith(";") and (st.startswith(("gemm_share(", "rope_rows_f32(", "silu_mul_rows(")) or "s->eps);" in st
                             or "s->nb1 * s->BS);" in st or "next_row + i);" in st)) or st == "#pragma omp barrier":
        out.append(f"            PH({k});")
        k += 1
pre = ("double phase_t[2][32];\nvoid phase_get(double *o) { memcpy(o, phase_t, sizeof(phase_t)); "
       "memset(phase_t, 0, sizeof(phase_t)); }\n")
print(s[:start] + pre + "\n".join(out) + s[end:])

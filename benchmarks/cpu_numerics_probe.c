/* x86 floating-point instructions on fixed inputs, each result's bytes hashed (FNV-1a 64) and the first
   results printed: RCPPS and RSQRTPS (approximations whose exact bits the architecture leaves to the
   implementation) beside DIVPS, SQRTPS and VFMADD231PS (exact IEEE results). Used by cpu_numerics_probe.py.
   cc -O2 -mavx2 -mfma -o cpu_numerics_probe.bin cpu_numerics_probe.c */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define N 4096
static float in[N], in2[N], out[N];

static uint64_t fnv(const void *p, size_t n) {
    const unsigned char *c = p;
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ c[i]) * 1099511628211ULL;
    return h;
}

static void report(const char *name, int last) {
    uint32_t u;
    memcpy(&u, &out[1], 4);
    printf("  \"%s\": \"%016llx (out[1] %08x)\"%s\n", name, (unsigned long long)fnv(out, sizeof out), u,
           last ? "" : ",");
}

int main(void) {
    uint32_t s = 12345;
    for (int i = 0; i < N; i++) {
        s = s * 1664525u + 1013904223u;
        in[i] = 0.001f + (float)(s >> 8) / (float)(1 << 16);
        s = s * 1664525u + 1013904223u;
        in2[i] = (float)(s >> 8) / (float)(1 << 24) - 0.5f;
    }
    printf("{\n");
    for (int i = 0; i < N; i += 8) _mm256_storeu_ps(out + i, _mm256_rcp_ps(_mm256_loadu_ps(in + i)));
    report("rcpps", 0);
    for (int i = 0; i < N; i += 8) _mm256_storeu_ps(out + i, _mm256_rsqrt_ps(_mm256_loadu_ps(in + i)));
    report("rsqrtps", 0);
    for (int i = 0; i < N; i += 8)
        _mm256_storeu_ps(out + i, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_loadu_ps(in + i)));
    report("divps", 0);
    for (int i = 0; i < N; i += 8) _mm256_storeu_ps(out + i, _mm256_sqrt_ps(_mm256_loadu_ps(in + i)));
    report("sqrtps", 0);
    for (int i = 0; i < N; i += 8)
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(_mm256_loadu_ps(in + i), _mm256_loadu_ps(in2 + i),
                                                  _mm256_loadu_ps(in2 + ((i + 8) % N))));
    report("vfmadd231ps", 1);
    printf("}\n");
    return 0;
}

/* Decode attention read in place from decode-slot rows, on CPU: see slot_kernel.py. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <immintrin.h>

/* exp(x) for x <= 0: 2^(x log2 e) as an integer power (built in the exponent bits) times 2^f,
   f in [0, 1), by a degree-6 polynomial (relative error ~2e-7, as float32's). */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.4426950408889634f;
    float fi = floorf(t);
    float f = t - fi;
    float p = 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022650e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    union { int32_t i; float f; } u;
    u.i = ((int32_t)fi + 127) << 23;
    return p * u.f;
}

/* sc[0..n) <- exp(sc - max); returns 1 / their sum */
static inline float softmax_unnormalised(float *sc, int64_t n) {
    float m = -FLT_MAX;
    #pragma omp simd reduction(max:m)
    for (int64_t j = 0; j < n; j++) m = sc[j] > m ? sc[j] : m;
    float sum = 0.0f;
    #pragma omp simd reduction(+:sum)
    for (int64_t j = 0; j < n; j++) { float e = exp_nonpos(sc[j] - m); sc[j] = e; sum += e; }
    return 1.0f / sum;
}

/* exp_nonpos on 8 lanes */
__attribute__((target("avx2,fma")))
static inline __m256 exp_nonpos_avx2(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
    const __m256 fi = _mm256_floor_ps(t);
    const __m256 f = _mm256_sub_ps(t, fi);
    __m256 p = _mm256_set1_ps(1.5353362e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3398874e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* softmax_unnormalised in AVX2: from the plain loops GCC 12 made neither vroundps nor a vector max, and this
   cut the kernel's time at 32 sequences by 30% */
__attribute__((target("avx2,fma")))
static inline float softmax_unnormalised_avx2(float *sc, int64_t n) {
    __m256 mv = _mm256_set1_ps(-FLT_MAX);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sc + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float m = _mm_cvtss_f32(m4);
    for (; j < n; j++) m = sc[j] > m ? sc[j] : m;
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        const __m256 e = exp_nonpos_avx2(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mb));
        _mm256_storeu_ps(sc + j, e);
        sv = _mm256_add_ps(sv, e);
    }
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sv), _mm256_extractf128_ps(sv, 1));
    s4 = _mm_hadd_ps(s4, s4);
    s4 = _mm_hadd_ps(s4, s4);
    float sum = _mm_cvtss_f32(s4);
    for (; j < n; j++) { const float e = exp_nonpos(sc[j] - m); sc[j] = e; sum += e; }
    return 1.0f / sum;
}

/* G query rows q[g*D..] (G <= 2) that see the same n keys/values K, V [n, D]: o[g*D..] (sc: scores, row g's
   at sc + g*ldsc). Two heads of one query that share a KV head share each key and value load. */
__attribute__((always_inline, target("avx2,fma")))
static inline void attend_rows_avx2(const float *q, const int G, const float *K, const float *V, int64_t n, float *o,
                                    int64_t D, float scale, float *sc, int64_t ldsc) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {  /* 4 keys' dot products, summed across lanes together */
        __m256 a[2][4];
        for (int g = 0; g < G; g++)
            for (int t = 0; t < 4; t++) a[g][t] = _mm256_setzero_ps();
        const float *k0 = K + j * D;
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 k_0 = _mm256_loadu_ps(k0 + d), k_1 = _mm256_loadu_ps(k0 + D + d),
                         k_2 = _mm256_loadu_ps(k0 + 2 * D + d), k_3 = _mm256_loadu_ps(k0 + 3 * D + d);
            for (int g = 0; g < G; g++) {
                const __m256 qv = _mm256_loadu_ps(q + g * D + d);
                a[g][0] = _mm256_fmadd_ps(qv, k_0, a[g][0]);
                a[g][1] = _mm256_fmadd_ps(qv, k_1, a[g][1]);
                a[g][2] = _mm256_fmadd_ps(qv, k_2, a[g][2]);
                a[g][3] = _mm256_fmadd_ps(qv, k_3, a[g][3]);
            }
        }
        for (int g = 0; g < G; g++) {
            __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
            __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(sc + g * ldsc + j, _mm_mul_ps(s4, _mm_set1_ps(scale)));
        }
    }
    for (; j < n; j++)
        for (int g = 0; g < G; g++) {
            __m256 a = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), _mm256_loadu_ps(K + j * D + d), a);
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            s = _mm_hadd_ps(s, s);
            s = _mm_hadd_ps(s, s);
            sc[g * ldsc + j] = _mm_cvtss_f32(s) * scale;
        }
    __m256 inv[2];
    for (int g = 0; g < G; g++) inv[g] = _mm256_set1_ps(softmax_unnormalised_avx2(sc + g * ldsc, n));
    for (int64_t d = 0; d < D; d += 32) {  /* up to 32 output lanes at a time: D % 8 == 0 */
        const int64_t w = D - d < 32 ? D - d : 32;
        __m256 acc[2][4];
        for (int g = 0; g < G; g++)
            for (int t = 0; t < 4; t++) acc[g][t] = _mm256_setzero_ps();
        for (int64_t jj = 0; jj < n; jj++) {
            const float *vj = V + jj * D + d;
            const __m256 v0 = _mm256_loadu_ps(vj);
            const __m256 v1 = w > 8 ? _mm256_loadu_ps(vj + 8) : v0;
            const __m256 v2 = w > 16 ? _mm256_loadu_ps(vj + 16) : v0;
            const __m256 v3 = w > 24 ? _mm256_loadu_ps(vj + 24) : v0;
            for (int g = 0; g < G; g++) {
                const __m256 p = _mm256_set1_ps(sc[g * ldsc + jj]);
                acc[g][0] = _mm256_fmadd_ps(p, v0, acc[g][0]);
                acc[g][1] = _mm256_fmadd_ps(p, v1, acc[g][1]);
                acc[g][2] = _mm256_fmadd_ps(p, v2, acc[g][2]);
                acc[g][3] = _mm256_fmadd_ps(p, v3, acc[g][3]);
            }
        }
        for (int g = 0; g < G; g++) {
            float *og = o + g * D + d;
            _mm256_storeu_ps(og, _mm256_mul_ps(acc[g][0], inv[g]));
            if (w > 8) _mm256_storeu_ps(og + 8, _mm256_mul_ps(acc[g][1], inv[g]));
            if (w > 16) _mm256_storeu_ps(og + 16, _mm256_mul_ps(acc[g][2], inv[g]));
            if (w > 24) _mm256_storeu_ps(og + 24, _mm256_mul_ps(acc[g][3], inv[g]));
        }
    }
}

/* One query row qr[0..D) over keys/values K, V [n, D]: o[0..D) (sc: n floats of scratch); the pair
   variant takes two rows, qr and o [2, D], and 2n floats of scratch. */
typedef void (*row_fn)(const float *qr, const float *K, const float *V, int64_t n, float *o, int64_t D,
                       float scale, float *sc);

__attribute__((target("avx2,fma")))
static void attend_row_avx2(const float *qr, const float *K, const float *V, int64_t n, float *o, int64_t D,
                            float scale, float *sc) {
    attend_rows_avx2(qr, 1, K, V, n, o, D, scale, sc, 0);
}

__attribute__((target("avx2,fma")))
static void attend_pair_avx2(const float *qr, const float *K, const float *V, int64_t n, float *o, int64_t D,
                             float scale, float *sc) {
    attend_rows_avx2(qr, 2, K, V, n, o, D, scale, sc, n);
}

static void attend_row_generic(const float *qr, const float *K, const float *V, int64_t n, float *o, int64_t D,
                               float scale, float *sc) {
    for (int64_t j = 0; j < n; j++) {
        float acc = 0.0f;
        for (int64_t d = 0; d < D; d++) acc += qr[d] * K[j * D + d];
        sc[j] = acc * scale;
    }
    const float inv = softmax_unnormalised(sc, n);
    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
    for (int64_t j = 0; j < n; j++)
        for (int64_t d = 0; d < D; d++) o[d] += sc[j] * V[j * D + d];
    for (int64_t d = 0; d < D; d++) o[d] *= inv;
}

/* q, out: [H, S, R, D] contiguous (R: the query rows of a sequence, its queries x the heads that
   share a KV head, query-major). k, v: the first sequence's keys / values of KV head 0; head h,
   sequence s, key j lie at h*hs + s*ss + j*D floats. nvis: [S, R / group], the keys each query
   sees (its position + 1). scratch: 2 x max(nvis) floats. */
void slot_attention(const float *q, const float *k, const float *v, const int64_t *nvis, float *out,
                    int64_t H, int64_t S, int64_t R, int64_t D, int64_t group, int64_t hs, int64_t ss,
                    float scale, float *scratch) {
    const int fast = D % 8 == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const row_fn attend_row = fast ? attend_row_avx2 : attend_row_generic;
    const row_fn attend_pair = fast ? attend_pair_avx2 : 0;
    const int64_t Q = R / group;
    for (int64_t h = 0; h < H; h++)
        for (int64_t s = 0; s < S; s++) {
            const int64_t off = h * hs + s * ss, row = (h * S + s) * R * D;
            for (int64_t r = 0; r < R;) {
                const int64_t n = nvis[s * Q + r / group];
                if (attend_pair && r % group + 1 < group) {  /* two heads of one query: one pass over its keys */
                    attend_pair(q + row + r * D, k + off, v + off, n, out + row + r * D, D, scale, scratch);
                    r += 2;
                } else {
                    attend_row(q + row + r * D, k + off, v + off, n, out + row + r * D, D, scale, scratch);
                    r += 1;
                }
            }
        }
}

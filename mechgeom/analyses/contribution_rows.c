/* The element-wise part of SPEC.md §A's metric family on a block of query rows, one pass per row.
 *
 * Built on first use by mechgeom/_native.py (`cc -O3 -shared`) and called through ctypes by
 * mechgeom/analyses/contribution_fused.py, which computes the two products below (one BLAS matmul per
 * block), checks every shape and gives the strides. The formulas are those of
 * mechgeom/analyses/contribution_geometry.py (SPEC.md §A), one function each there.
 *
 * Arrays are indexed [b, h, i, j] (batch, head, query, key) with element strides st[3s..3s+2] = (b, h, i)
 * for slot s and unit stride along the last axis. Slots (NULL: not wanted / not given):
 *   inputs   0 alpha [b h q k]   1 d1 = (z[i,h] M[h]) . v[j,h] [b h q k]   2 d2 = (o[i] W_O[h]^T) . v[j,h]
 *            3 vt_norm ‖vt[j,h]‖ [b h k]   4 inv_vt [b h k] (1/‖vt‖, 0 where ‖vt‖ = 0)
 *            5 inv_oh 1/‖o[i,h]‖ [b h q] (NaN: zero norm or modified head)   6 inv_ol 1/‖o[i]‖ [b q] (NaN: 0)
 *            7 keep [b h q] (0 for a modified head; NULL = every head kept)
 *            8 gram2 [b h g k]: G_j[h,g] on the diagonal, 2 G_j[h,g] above it (g > h)
 *   outputs  9 value_weighted  10 value_weighted_normalized  11 contribution  12 factor_norm_ratio
 *            13 factor_cos  14 head_share   [b h q k]
 *            15 attention_inter  16 value_weighted_inter  17 value_weighted_normalized_inter
 *            18 contribution_inter   [b q k]
 * Row i gets keys j < i + 1 (causal) or every key; a causal row is 0 from i + 1 up to q1 when `zeroed`
 * (the buffer is known to hold 0 after the block), else up to Q.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define N_SLOTS 19
#define CHUNK 512 /* keys per pass: the temporary rows stay in L1/L2 */
#define COPY(dst, src, n) memcpy((dst), (src), sizeof(*(dst)) * (n))

#define KERNEL(NAME, T)                                                                        \
void NAME(int64_t B, int64_t H, int64_t Q, int64_t q0, int64_t q1, int64_t row_start,               \
          int64_t row_step, int causal, int zeroed, void **ptr, const int64_t *st)                  \
{                                                                                                   \
    T *p_[N_SLOTS];                                                                                 \
    for (int s = 0; s < N_SLOTS; s++) p_[s] = (T *)ptr[s];                                           \
    const T nan_ = (T)NAN, inv_h = (T)1 / (T)H;                                                     \
    T tmp[6][CHUNK], att[CHUNK], ci[CHUNK], sq[CHUNK];                                              \
    const int want_vwi = p_[16] || p_[17];                                                          \
    for (int64_t b = 0; b < B; b++)                                                                 \
    for (int64_t i = q0 + row_start; i < q1; i += row_step) {                                       \
        const int64_t kend = causal ? i + 1 : Q, zend = causal ? (zeroed ? q1 : Q) : Q;             \
        const T iol = p_[6] ? p_[6][b * st[18] + i * st[20]] : (T)0, s2 = iol * iol;                \
        T *dst_i[4]; /* attention_inter, vw_inter, vwn_inter, c_inter rows */                       \
        for (int s = 0; s < 4; s++)                                                                 \
            dst_i[s] = p_[15 + s] ? p_[15 + s] + b * st[3 * (15 + s)] + i * st[3 * (15 + s) + 2] : 0; \
        for (int64_t j0 = 0; j0 < kend; j0 += CHUNK) {                                              \
            const int64_t n = kend - j0 < CHUNK ? kend - j0 : CHUNK;                                \
            if (p_[15]) memset(att, 0, sizeof(T) * n);                                              \
            if (p_[18]) memset(ci, 0, sizeof(T) * n);                                               \
            if (want_vwi) memset(sq, 0, sizeof(T) * n);                                             \
            for (int64_t h = 0; h < H; h++) {                                                       \
                const int64_t bh = b * st[0] + h * st[1];                                           \
                const T *a = p_[0] + bh + i * st[2] + j0;                                           \
                const T *vn = p_[3] ? p_[3] + b * st[9] + h * st[10] + j0 : 0;                      \
                const T ioh = p_[5] ? p_[5][b * st[15] + h * st[16] + i * st[17]] : (T)0;           \
                const T kp = p_[7] ? p_[7][b * st[21] + h * st[22] + i * st[23]] : (T)1;            \
                T *o[6]; /* the output rows, or temporary rows for outputs not wanted */            \
                for (int s = 0; s < 6; s++)                                                         \
                    o[s] = !p_[9 + s] ? tmp[s] : p_[9 + s] + b * st[3 * (9 + s)] +                 \
                           h * st[3 * (9 + s) + 1] + i * st[3 * (9 + s) + 2] + j0;                  \
                if (p_[9]) { /* alpha ‖vt‖; NaN for a modified head */                              \
                    const T m = kp == (T)0 ? nan_ : (T)1;                                           \
                    for (int64_t j = 0; j < n; j++) o[0][j] = a[j] * vn[j] * m;                    \
                }                                                                                   \
                if (p_[12]) /* ‖vt‖ / ‖o_h‖ */                                                      \
                    for (int64_t j = 0; j < n; j++) o[3][j] = vn[j] * ioh;                         \
                if (p_[10] || p_[11]) /* alpha ‖vt‖ / ‖o_h‖ */                                      \
                    for (int64_t j = 0; j < n; j++) o[1][j] = a[j] * (vn[j] * ioh);                \
                if (p_[13] || p_[11]) { /* cos = d1 / (‖o_h‖ ‖vt‖); c = (alpha ‖vt‖ / ‖o_h‖) cos */ \
                    const T *d1 = p_[1] + b * st[3] + h * st[4] + i * st[5] + j0;                   \
                    const T *ivt = p_[4] + b * st[12] + h * st[13] + j0;                            \
                    for (int64_t j = 0; j < n; j++) o[4][j] = d1[j] * ioh * ivt[j];                \
                    if (p_[11])                                                                     \
                        for (int64_t j = 0; j < n; j++) o[2][j] = o[1][j] * o[4][j];           \
                }                                                                                   \
                if (p_[14] || p_[18]) { /* alpha d2 / ‖o‖², 0 for a modified head */                \
                    const T *d2 = p_[2] + b * st[6] + h * st[7] + i * st[8] + j0;                   \
                    const T f = s2 * kp;                                                            \
                    for (int64_t j = 0; j < n; j++) o[5][j] = a[j] * (d2[j] * f);                  \
                    if (p_[18])                                                                     \
                        for (int64_t j = 0; j < n; j++) ci[j] += o[5][j];                          \
                }                                                                                   \
                if (p_[15])                                                                         \
                    for (int64_t j = 0; j < n; j++) att[j] += a[j];                                 \
                if (want_vwi && kp != (T)0) { /* alpha_h sum_{g >= h} (2) G_j[h,g] alpha_g */       \
                    for (int64_t g = h; g < H;) { /* up to four terms per pass over the row */      \
                        const T *ag[4], *gr[4];                                                     \
                        int m = 0;                                                                  \
                        for (; g < H && m < 4; g++) {                                               \
                            if (p_[7] && p_[7][b * st[21] + g * st[22] + i * st[23]] == (T)0) continue; \
                            ag[m] = p_[0] + b * st[0] + g * st[1] + i * st[2] + j0;                 \
                            gr[m++] = p_[8] + b * st[24] + h * st[25] + g * st[26] + j0;            \
                        }                                                                           \
                        if (m == 4)                                                                 \
                            for (int64_t j = 0; j < n; j++)                                         \
                                sq[j] += a[j] * (gr[0][j] * ag[0][j] + gr[1][j] * ag[1][j] +        \
                                                 gr[2][j] * ag[2][j] + gr[3][j] * ag[3][j]);        \
                        else                                                                        \
                            for (int r = 0; r < m; r++)                                             \
                                for (int64_t j = 0; j < n; j++) sq[j] += a[j] * (gr[r][j] * ag[r][j]); \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
            if (p_[15]) {                                                                           \
                for (int64_t j = 0; j < n; j++) att[j] *= inv_h;                                    \
                COPY(dst_i[0] + j0, att, n);                                                 \
            }                                                                                       \
            if (want_vwi) {                                                                         \
                for (int64_t j = 0; j < n; j++) sq[j] = sqrt(sq[j] > (T)0 ? sq[j] : (T)0);          \
                if (p_[16]) COPY(dst_i[1] + j0, sq, n);                                      \
                if (p_[17]) {                                                                       \
                    for (int64_t j = 0; j < n; j++) sq[j] *= iol;                                   \
                    COPY(dst_i[2] + j0, sq, n);                                              \
                }                                                                                   \
            }                                                                                       \
            if (p_[18]) COPY(dst_i[3] + j0, ci, n);                                          \
        }                                                                                           \
        for (int64_t j0 = kend; j0 < zend; j0 += CHUNK) { /* not sources: key > query */            \
            const int64_t n = zend - j0 < CHUNK ? zend - j0 : CHUNK;                                \
            for (int s = 9; s < 15; s++)                                                            \
                if (p_[s])                                                                          \
                    for (int64_t h = 0; h < H; h++)                                                 \
                        memset(p_[s] + b * st[3 * s] + h * st[3 * s + 1] + i * st[3 * s + 2] + j0, 0, sizeof(T) * n); \
            for (int s = 0; s < 4; s++)                                                             \
                if (dst_i[s]) memset(dst_i[s] + j0, 0, sizeof(T) * n);                        \
        }                                                                                           \
    }                                                                                               \
}

KERNEL(mg_contribution_rows_f32, float)
KERNEL(mg_contribution_rows_f64, double)

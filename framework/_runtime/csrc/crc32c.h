/* CRC32C (Castagnoli), as iSCSI, ext4 and the `crc32c` Python package compute it.
 *
 * No Python here: these run without the GIL. Call kvf_crc32c_init() once (with the GIL,
 * at module import) before anything else.
 */
#ifndef KVF_CRC32C_H
#define KVF_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* The ways to take a CRC32C, slower first; a CPU that runs one runs every one before it. */
enum kvf_crc32c_pass {
    KVF_CRC32C_TABLE,  /* a portable table (slicing by 8); a copy: memcpy, then its CRC */
    KVF_CRC32C_NARROW, /* the CRC32 instruction (SSE4.2), three streams; 8-byte stores */
    KVF_CRC32C_WIDE,   /* the same CRC; copies load and store 32 bytes at a time (AVX2) */
    KVF_CRC32C_FOLD,   /* carry-less products folding 128-bit lanes (AVX2, VPCLMULQDQ) */
    KVF_CRC32C_PASSES
};

/* Builds the tables and picks the fastest pass this CPU runs. Idempotent. */
void kvf_crc32c_init(void);

/* The pass kvf_crc32c and kvf_copy_crc32c take: the fastest this CPU runs. */
int kvf_crc32c_best(void);

/* A pass's name ("table", "narrow", "wide", "fold"), NULL for no pass. */
const char *kvf_crc32c_pass_name(int pass);

/* 1 when kvf_crc32c uses the CPU's CRC32 instruction (SSE4.2), 0 for the table. */
int kvf_crc32c_hardware(void);

/* The CRC32C of buf[0..len) continuing from `crc` (0 to start):
 * kvf_crc32c(kvf_crc32c(0, a, n), b, m) is the CRC of a followed by b. */
uint32_t kvf_crc32c(uint32_t crc, const void *buf, size_t len);

/* Copy len bytes from src to dest (not overlapping) and return the CRC32C of those bytes,
 * continuing from `crc`, in one pass: each word is checksummed as it is stored. */
uint32_t kvf_copy_crc32c(void *dest, const void *src, size_t len, uint32_t crc);

/* kvf_crc32c and kvf_copy_crc32c through a given pass, no later than kvf_crc32c_best()
 * (exposed so tests can check every pass a CPU runs). */
uint32_t kvf_crc32c_with(int pass, uint32_t crc, const void *buf, size_t len);
uint32_t kvf_copy_crc32c_with(int pass, void *dest, const void *src, size_t len, uint32_t crc);

/* The same, always through the portable table (exposed so tests can check it). */
uint32_t kvf_crc32c_table(uint32_t crc, const void *buf, size_t len);

#endif

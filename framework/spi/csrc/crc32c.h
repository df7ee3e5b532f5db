/* CRC32C (Castagnoli), as iSCSI, ext4 and the `crc32c` Python package compute it.
 *
 * No Python here: these run without the GIL. Call kvf_crc32c_init() once (with the GIL,
 * at module import) before anything else.
 */
#ifndef KVF_CRC32C_H
#define KVF_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Builds the tables and detects the CPU's CRC32 instruction. Idempotent. */
void kvf_crc32c_init(void);

/* 1 when kvf_crc32c uses the CPU's CRC32 instruction (SSE4.2), 0 for the table. */
int kvf_crc32c_hardware(void);

/* The CRC32C of buf[0..len) continuing from `crc` (0 to start):
 * kvf_crc32c(kvf_crc32c(0, a, n), b, m) is the CRC of a followed by b. */
uint32_t kvf_crc32c(uint32_t crc, const void *buf, size_t len);

/* Copy len bytes from src to dest (not overlapping) and return the CRC32C of those bytes,
 * continuing from `crc`, in one pass: each word is checksummed as it is stored. */
uint32_t kvf_copy_crc32c(void *dest, const void *src, size_t len, uint32_t crc);

/* 1 when kvf_copy_crc32c moves 32 bytes per load and store (AVX2), 0 for 8. */
int kvf_copy_crc32c_wide(void);

/* kvf_copy_crc32c with 8-byte loads and stores, as on a CPU without AVX2 (exposed so
 * tests can check it anywhere). */
uint32_t kvf_copy_crc32c_narrow(void *dest, const void *src, size_t len, uint32_t crc);

/* The same, always through the portable table (exposed so tests can check it). */
uint32_t kvf_crc32c_table(uint32_t crc, const void *buf, size_t len);

#endif

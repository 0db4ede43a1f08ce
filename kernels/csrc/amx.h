/* Intel AMX's tile state, for the kernels that multiply with tile instructions (Sapphire Rapids and later):
 * the tile configuration and whether this process may use the tile registers. */
#ifndef BATCHGEN_AMX_H
#define BATCHGEN_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define BATCHGEN_HAS_AMX 1 /* the CPU the build targets has AMX-INT8 (the plain-C build included) */
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Whether this process may use the tile registers: asked of Linux once per kernel file (ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA), and off while the environment variable `switch_name` starts with 0 (read on every call:
 * benchmarks compare both paths in one process). */
static inline int amx_permitted(const char *switch_name) {
    static volatile int state = 0; /* 0: not asked, 1: granted, -1: refused */
    const char *env = getenv(switch_name);
    if (env && env[0] == '0') return 0;
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return state == 1;
}
#endif

#endif

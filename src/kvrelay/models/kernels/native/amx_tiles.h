/*
 * What every AMX kernel of this directory shares: the tile configuration's layout, and the request for the tile
 * state, which Linux grants a process once (build.load_amx asks before it hands a kernel out).
 */
#ifndef KVRELAY_AMX_TILES_H
#define KVRELAY_AMX_TILES_H

#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Loads *config into the tile unit (LDTILECFG). Every kernel calls this, not GCC 12's _tile_loadconfig, whose asm
 * tells the compiler it reads 8 of the 64 bytes: it dropped the stores of the rows and columns, and the load of what
 * was left there faulted. */
static inline void load_tile_config(const TileConfig* config) { __asm__ volatile("ldtilecfg %0" ::"m"(*config)); }

/* 0 when this process may use the AMX tile state (asks Linux for it). */
int kvrelay_amx_request(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

#endif

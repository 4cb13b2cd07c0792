"""Every AMX kernel loads its tile configuration through ``amx_tiles.h``'s ``load_tile_config``.

GCC 12's ``_tile_loadconfig`` declares an 8-byte read of the 64-byte configuration, so the compiler may drop
the stores that set its rows and columns, and ``LDTILECFG`` then faults: it did, on every AMX CPU, for
``prefill_attention_amx.c``. The kernels' own tests run only where AMX does; this check runs on any CPU.
"""

from __future__ import annotations

from pathlib import Path

import kvrelay.models.kernels.native as native

SOURCES = Path(native.__file__).parent


def test_every_amx_kernel_loads_its_tile_configuration_through_load_tile_config() -> None:
    kernels = sorted(SOURCES.glob("*_amx.c"))
    assert len(kernels) >= 3, f"AMX kernels not found under {SOURCES}"
    for source in kernels:
        text = source.read_text()
        assert "_tile_loadconfig" not in text, f"{source.name} calls GCC's _tile_loadconfig; use load_tile_config"
        assert "load_tile_config(" in text, f"{source.name} loads no tile configuration"

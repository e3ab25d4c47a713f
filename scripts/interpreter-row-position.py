"""Why our GEMM kernels are not batch invariant under Triton's interpreter (docs/measured.md, "Bitwise").

Under TRITON_INTERPRET=1 a `tl.dot` is NumPy's matmul of the whole tile. This checks, for tile shapes the kernels
use, whether one row's product has the same bits (a) at every position in the tile and (b) at one position among
other companions' values. Run: python scripts/interpreter-row-position.py
"""

import numpy as np

rng = np.random.default_rng(0)
for rows, k, n in [(16, 32, 32), (32, 32, 64), (64, 32, 64), (16, 64, 96)]:
    b = rng.standard_normal((k, n)).astype(np.float32)
    row = rng.standard_normal(k).astype(np.float32)
    tile = np.zeros((rows, k), np.float32)
    tile[0] = row
    first = (tile @ b)[0]
    by_position = by_companions = 0
    for pos in range(rows):
        tile = np.zeros((rows, k), np.float32)
        tile[pos] = row  # the same row, elsewhere in the tile
        by_position += not np.array_equal((tile @ b)[pos], first)
        tile = rng.standard_normal((rows, k)).astype(np.float32)
        tile[0] = row  # the same row and place, other rows beside it
        by_companions += not np.array_equal((tile @ b)[0], first)
    print(f"tile {rows}x{k} @ {k}x{n}: the row's bits differ at {by_position}/{rows} positions, "
          f"and with other companions at its place in {by_companions}/{rows} tries")

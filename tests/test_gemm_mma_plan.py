"""gemm_mma.py's launch plan, on the CPU: the cluster size that fills the GPU once, and the variants'
shared-memory arithmetic (as the kernel's GM_* macros compute it)."""
import re

from minillm.cuda.gemm_mma import DEFAULT, MAX_T, SM_SHARED, SOURCE, Variant, split_for
from minillm.cuda.kernels import KERNEL_DIR


def test_split_fills_one_wave_and_keeps_stages_to_stream():
    sms = 132
    assert split_for(4096, 4096, sms) == 8          # Mistral o: 32 row tiles x 8 = 256 blocks, 2 an SM
    assert split_for(6144, 4096, sms) == 4          # q|k|v: 48 x 4 = 192 (x 8 would be two waves)
    assert split_for(28672, 4096, sms) == 1         # gate|up: 224 row tiles fill the GPU alone
    assert split_for(4096, 14336, sms) == 8
    assert split_for(576, 576, sms) == 2            # SmolLM2's o: 9 k stages, 2 a block at least MIN_K_TILES
    assert split_for(128, 64, sms) == 1             # one k stage: nothing to split
    for rows, n_in in ((4096, 4096), (6144, 4096), (28672, 4096), (32000, 4096)):
        s = split_for(rows, n_in, sms)
        assert -(-rows // DEFAULT.rows) * s <= sms * DEFAULT.blocks_per_sm


def test_variant_sizes_follow_the_kernel_macros():
    text = (KERNEL_DIR / f"{SOURCE}.cu").read_text()
    assert re.search(r"#define GM_MAX_T (\d+)", text).group(1) == str(MAX_T)
    for name, value in (("GM_WARPS", DEFAULT.warps), ("GM_BK", DEFAULT.bk), ("GM_STAGES", DEFAULT.stages),
                        ("GM_TW", DEFAULT.tw)):
        assert re.search(rf"#define {name} (\d+)", text).group(1) == str(value), name
    assert DEFAULT.smem == 4 * (128 + 64) * 64 * 2 and DEFAULT.blocks_per_sm == 2
    assert Variant(warps=8, tw=2).threads == 512 and Variant(warps=8).smem + 1024 <= SM_SHARED
    assert Variant(stages=3, tw=2).blocks_per_sm == 3

"""radiance_ar.diagnostics.sass_count: the opcode counter against hand-written SASS, and one real
offline sm_90 compile where Triton's nvdisasm is installed."""
import os

import pytest

from radiance_ar.diagnostics import sass_count

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 FMUL R2, R3, 0.5 ;
        /*0020*/                   FMUL.FTZ R4, R2, R2 ;
        /*0030*/               @P1 EXIT ;
        /*0040*/                   MUFU.RSQ R5, R4 ;
"""


def test_hot_path_counts_opcodes_without_modifiers_or_predicates_up_to_exit():
    assert sass_count.hot_path_opcodes(SASS) == {"LDC": 1, "FMUL": 2, "EXIT": 1}


def _nvdisasm_present() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                       "bin", "nvdisasm"))


@pytest.mark.skipif(not _nvdisasm_present(), reason="needs Triton's NVIDIA backend (nvdisasm)")
def test_encode_compiles_offline_to_its_sqrt_fast_path():
    counts = sass_count.hot_path_opcodes(sass_count.compile_sass("encode"))
    # one rsqrt and one float-to-int per value (32 per thread) on the hot path
    assert counts["MUFU"] >= 32 and counts["F2I"] >= 32 and counts["EXIT"] == 1

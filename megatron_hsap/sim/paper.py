"""Published figures the reproductions are compared with (pure data, each with its source).

HSAP paper (``shared/paper/hsap_paper.txt``): Tables 2–4 as printed (milliseconds; Table 4 in
tokens/s, parsed from the PDF text, which interleaves the pajama and ultrachat rows cell by
cell). MagiAttention: forward TFLOP/s per GPU on its varlen-causal H100 benchmark as quoted in
``shared/ANCHORS.md``.
"""

from __future__ import annotations

from megatron_hsap.plan.ir import Phase

__all__ = ["TABLE2", "TABLE3", "TABLE4", "MAGI_FWD", "MAGI_PUBLISHED", "TABLE4_TOPOLOGIES", "TABLE4_LENGTHS"]

# (SP size, max sequence length) -> (DistFlashAttn ms, SAP ms); A100, 16 heads of 128.
TABLE2: dict[tuple[int, int], tuple[float, float]] = {
    (2, 8192): (9.0, 7.9),
    (2, 16384): (24.5, 14.6),
    (4, 16384): (16.2, 11.1),
    (4, 32768): (36.2, 25.8),
    (8, 32768): (112.0, 73.0),
    (8, 65536): (218.1, 137.3),
    (16, 65536): (4373.7, 1912.3),
    (16, 131072): (8254.5, 3333.1),
}

# (tokens per GPU, GPUs) -> (Ulysses ms or None for OOM / P > H, DistFlashAttn ms, HSAP ms).
TABLE3: dict[tuple[int, int], tuple[float | None, float, float]] = {
    (4096, 8): (14.6, 20.46, 13.4),
    (4096, 16): (29.31, 54.58, 26.87),
    (4096, 64): (None, 282.82, 116.68),
    (8192, 8): (49.74, 60.57, 45.88),
    (8192, 16): (100.42, 136.99, 92.54),
    (8192, 64): (None, 613.12, 436.45),
    (16384, 8): (176.23, 205.29, 168.44),
    (16384, 16): (349.85, 436.65, 335.71),
    (16384, 64): (None, 1788.33, 1645.43),
    (32768, 8): (664.33, 763.13, 662.98),
    (32768, 16): (1367.85, 1545.35, 1350.28),
    (32768, 64): (None, 6427.15, 6156.32),
}

TABLE4_TOPOLOGIES = ("1x8", "2x4", "4x2", "8x1")
TABLE4_LENGTHS = (16384, 32768, 65536)
# dataset -> 12 cells (16K, 32K, 64K) × (1x8, 2x4, 4x2, 8x1) of (HSAP, packing, batching) tokens/s.
TABLE4: dict[str, list[tuple[float, float, float]]] = {
    "fineweb": [
        (2002.1, 1998.31, 1997.5), (2435.17, 2430.87, 2442.83), (2480.91, 2485.24, 2475.36), (2863.02, 2883.24, 2877.61),
        (3642.88, 2067.07, 1037.41), (3510.77, 2121.79, 1070.83), (3574.18, 2060.45, 1040.75), (3598.57, 2519.64, 1277.91),
        (3100.68, 1622.0, 97.67), (3267.28, 1611.48, 96.83), (3250.4, 1482.95, 88.79), (3459.34, 1900.28, 114.41),
    ],
    "slimpajama": [
        (2693.44, 2005.0, 2003.36), (2833.45, 2434.12, 2444.45), (3064.3, 2484.06, 2494.58), (3255.92, 2854.79, 2875.19),
        (3235.0, 2070.18, 2073.62), (3196.2, 2135.73, 2123.38), (3286.72, 2057.39, 2049.6), (3477.07, 2522.72, 2511.99),
        (3414.77, 1618.27, 1091.89), (3281.22, 1614.85, 1082.69), (3312.26, 1438.61, 970.22), (3487.24, 1851.67, 1243.12),
    ],
    "ultrachat": [
        (2709.42, 1765.25, 1766.04), (2859.2, 2166.41, 2162.06), (2901.98, 2191.22, 2196.04), (3008.3, 2530.93, 2541.83),
        (2129.07, 1200.87, 512.46), (2023.12, 1254.6, 539.04), (2125.67, 1213.83, 521.49), (2149.12, 1472.33, 629.15),
        (2994.03, 1251.3, 593.16), (2811.5, 1254.9, 589.35), (2819.46, 1150.47, 543.82), (2899.35, 1444.84, 678.12),
    ],
}


def table4_cell(dataset: str, T: int, topology: str) -> tuple[float, float, float]:
    return TABLE4[dataset][TABLE4_LENGTHS.index(T) * 4 + TABLE4_TOPOLOGIES.index(topology)]


# MagiAttention varlen-causal forward, TFLOP/s per GPU, H100 (ANCHORS.md).
MAGI_FWD: dict[int, dict[str, float]] = {
    8: {"magiattention": 459.0, "ring_p2p": 89.0, "ulysses": 278.0, "usp": 261.0, "megatron_hybrid_cp": 277.0},
    64: {"magiattention": 237.0, "ring_p2p": 29.0, "ulysses": 163.0, "usp": 191.0, "megatron_hybrid_cp": 161.0},
}


# MagiAttention's published varlen-causal H100 figures (TFLOP/s per GPU, read from its report;
# shared/workloads.md), keyed (GPUs, our method, phase). ring-p2p is TE's THD p2p ring
# (MagiAttention exps/dist_attn/baselines/ring_attn.py RingAttnP2P), ring-allgather its
# RingAttnAllGather (per-document zigzag), Megatron hybrid CP its hybrid_dcp.py.
MAGI_PUBLISHED: dict[tuple[int, str, str], float] = {
    (8, "te_thd_ring", Phase.FWD): 89.0, (8, "ulysses", Phase.FWD): 278.0, (8, "usp", Phase.FWD): 261.0,
    (8, "hybrid_cp", Phase.FWD): 277.0, (8, "allgather_kv_zigzag", Phase.FWD): 289.0, (8, "allgather_kv_zigzag", Phase.BWD): 179.0,
    (64, "te_thd_ring", Phase.FWD): 29.0, (64, "ulysses", Phase.FWD): 163.0, (64, "usp", Phase.FWD): 191.0,
    (64, "hybrid_cp", Phase.FWD): 161.0, (64, "allgather_kv_zigzag", Phase.FWD): 180.0, (64, "allgather_kv_zigzag", Phase.BWD): 55.0,
}
# MagiAttention itself on the same protocol (fwd, bwd), for the side-by-side column.
MAGI_SELF: dict[int, tuple[float, float]] = {8: (459.0, 360.0), 64: (237.0, 264.0)}

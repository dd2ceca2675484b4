"""Apple M-series chips for ``bench --predict``: memory bandwidth and GPU matmul
rate, each with its source."""

from dataclasses import dataclass
from typing import Optional

from ..errors import DFlashError


@dataclass(frozen=True)
class Chip:
    name: str
    gpu_cores: int
    bandwidth_gbs: float  # unified memory bandwidth, GB/s (vendor figure)
    fp32_tflops: float  # GPU shader FP32 peak; the matmul rate used (Apple GPUs run fp16 at the fp32 rate)
    neural_tflops: Optional[float]  # M5: the claimed GPU Neural Accelerator rate (used with neural=True)
    source: str

    def matmul_tflops(self, neural: bool = False) -> float:
        return self.neural_tflops if neural and self.neural_tflops else self.fp32_tflops


_APPLE_M1 = "Apple M1-family launch figures (TFLOPS and GB/s), tabulated at akunu.prabod.rathnayaka.me/part1/ch05-chip-generations.html"
_APPLE_M2 = "Apple M2-family launch figures: 100/200/400/800 GB/s; 3.6/6.8/13.6/27.2 TFLOPS (apple.com Mac Pro page: M2 Ultra 76-core 27.2 TFLOPS)"
_HMC = "bandwidth: Apple launch figures; FP32 = cores x 128 ALUs x 2 x GPU clock, clocks as listed by hmc-tech.com (M3 1398 MHz, M4 1578 MHz, M4 Max 1678 MHz)"
_M5 = ("bandwidth: Apple newsroom, M5 153 GB/s (Oct 2025), M5 Pro 307 GB/s, M5 Max 614 GB/s (Mar 2026); "
       "FP32 assumed at the M4 Max clock (unpublished); Neural Accelerator rate = 4x the M4 counterpart "
       "per Apple's 'over 4x peak GPU compute for AI', used only with --neural-accelerators")


def _fp32(cores: int, mhz: float) -> float:
    return round(cores * 128 * 2 * mhz / 1e6, 2)


CHIPS: tuple[Chip, ...] = (
    Chip("M1", 8, 68.25, 2.6, None, _APPLE_M1),
    Chip("M1 Pro", 16, 200, 5.2, None, _APPLE_M1),
    Chip("M1 Max", 32, 400, 10.4, None, _APPLE_M1),
    Chip("M1 Ultra", 64, 800, 21.0, None, _APPLE_M1),
    Chip("M2", 10, 100, 3.6, None, _APPLE_M2),
    Chip("M2 Pro", 19, 200, 6.8, None, _APPLE_M2),
    Chip("M2 Max", 38, 400, 13.6, None, _APPLE_M2),
    Chip("M2 Ultra", 76, 800, 27.2, None, _APPLE_M2),
    Chip("M3", 10, 100, _fp32(10, 1398), None, _HMC),
    Chip("M3 Pro", 18, 150, _fp32(18, 1398), None, _HMC),
    Chip("M3 Max", 40, 400, _fp32(40, 1398), None, _HMC),
    Chip("M3 Ultra", 80, 819, _fp32(80, 1398), None, _HMC),
    Chip("M4", 10, 120, _fp32(10, 1578), None, _HMC),
    Chip("M4 Pro", 20, 273, _fp32(20, 1578), None, _HMC),
    Chip("M4 Max", 40, 546, _fp32(40, 1678), None, _HMC),
    Chip("M5", 10, 153, _fp32(10, 1678), 4 * _fp32(10, 1578), _M5),
    Chip("M5 Pro", 20, 307, _fp32(20, 1678), 4 * _fp32(20, 1578), _M5),
    Chip("M5 Max", 40, 614, _fp32(40, 1678), 4 * _fp32(40, 1678), _M5),
)


def find_chips(names: Optional[list[str]]) -> list[Chip]:
    if not names:
        return list(CHIPS)
    by_name = {c.name.lower().replace(" ", ""): c for c in CHIPS}
    out = []
    for name in names:
        chip = by_name.get(name.lower().replace(" ", "").replace("-", ""))
        if chip is None:
            raise DFlashError(f"unknown chip '{name}'; known: " + ", ".join(c.name for c in CHIPS))
        out.append(chip)
    return out

"""GPU targets the offline gate compiles for, described by the limits that decide whether a kernel launches and how
many of its CTAs share an SM (CUDA C Programming Guide, "Technical Specifications per Compute Capability").

A target also answers the device queries a kernel wrapper makes (SM count) while launches are captured without a GPU
(see `spark_bench.triton_env.capture_target`).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as on the command line: sm_90a
    gpus: str  # what it stands for
    arch: int  # Triton's GPUTarget("cuda", arch, 32); arch 90 compiles for sm_90a, 100 for sm_100a
    sm_count: int  # of the largest part with this target
    smem_per_block: int  # bytes of shared memory one CTA may have (the opt-in maximum)
    smem_per_sm: int
    smem_reserved_per_block: int = 1024  # the driver's reservation per resident CTA
    regs_per_sm: int = 65536
    max_regs_per_thread: int = 255
    max_threads_per_block: int = 1024
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    reg_alloc_unit: int = 256  # registers are allocated per warp in units of 256

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.arch, 32)

    def ctas_per_sm(self, regs: int, warps: int, shared: int) -> int:
        """Resident CTAs per SM for a kernel using `regs` registers per thread, `warps` warps and `shared` bytes of
        dynamic shared memory (0 when it cannot launch at all)."""
        threads = warps * 32
        if threads > self.max_threads_per_block or shared > self.smem_per_block:
            return 0
        per_warp = -(-max(regs, 1) * 32 // self.reg_alloc_unit) * self.reg_alloc_unit
        by_regs = (self.regs_per_sm // per_warp) // warps
        by_threads = self.max_threads_per_sm // threads
        by_smem = self.smem_per_sm // (shared + self.smem_reserved_per_block)
        return max(0, min(self.max_blocks_per_sm, by_regs, by_threads, by_smem))


TARGETS = {
    t.name: t
    for t in (
        Target("sm_80", "A100", 80, sm_count=108, smem_per_block=166912, smem_per_sm=167936),
        Target("sm_90a", "H100/H200", 90, sm_count=132, smem_per_block=232448, smem_per_sm=233472),
        Target("sm_100a", "B200", 100, sm_count=148, smem_per_block=232448, smem_per_sm=233472),
    )
}
REQUIRED = "sm_90a"


def family(capability: str) -> str | None:
    """The target whose tables describe a GPU of compute capability "major.minor": sm_80 for 8.x (A100's limits;
    8.6 / 8.9 parts have less shared memory per SM), sm_90a for 9.x, sm_100a for 10.x; None for anything else."""
    major = str(capability).partition(".")[0]
    return {"8": "sm_80", "9": "sm_90a", "10": "sm_100a"}.get(major)


def parse_targets(text: str) -> list[Target]:
    """'sm_90a,sm_80' -> targets; raises ValueError naming the valid choices."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise ValueError(f"unknown target {', '.join(unknown) or repr(text)}; choose from {', '.join(TARGETS)}")
    return [TARGETS[n] for n in dict.fromkeys(names)]

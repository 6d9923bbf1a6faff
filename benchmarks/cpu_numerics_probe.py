"""Which floating-point results differ between two CPUs (or a CPU and an emulator such as qemu's TCG).

Prints one JSON object: the CPU (vendor, model, flags that select kernels), torch's kernel capability, and a
short sha256 of the bytes of each result, computed from fixed inputs with one thread: torch ops (matmul, exp,
softmax, GELU, LayerNorm, rsqrt, AdamW), one forward and backward of the tiny GPT-2 from a fixed seed, and,
when benchmarks/cpu_numerics_probe.c has been compiled beside this file (cpu_numerics_probe.bin, `cc -O2
-mavx2 -mfma`), the x86 instructions whose results the architecture leaves to the implementation (RCPPS and
RSQRTPS approximate 1/x and 1/sqrt(x) to 1.5 * 2^-12) next to exact ones (DIVPS, SQRTPS, VFMADD).
Run it on both machines and diff the outputs: an op whose hash differs is where their results part.

    .venv/bin/python benchmarks/cpu_numerics_probe.py [--bin PATH]
"""

import argparse
import hashlib
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def h(t) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:12]


def cpu() -> dict:
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        k, _, v = line.partition(":")
        k = k.strip()
        if k in ("vendor_id", "model name", "flags") and k not in info:
            info[k] = v.strip()
    flags = set(info.pop("flags", "").split())
    info["flags"] = sorted(flags & {"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"})
    return info


def torch_ops() -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1234)
    a, b = torch.randn(256, 64, generator=g), torch.randn(64, 512, generator=g)
    x = torch.randn(4096, generator=g)
    pos = x.abs() + 0.1
    out = {"matmul 256x64x512": h(a @ b), "exp": h(torch.exp(x)), "log": h(torch.log(pos)),
           "tanh": h(torch.tanh(x)), "softmax": h(F.softmax(a @ b, dim=-1)), "gelu": h(F.gelu(x)),
           "gelu tanh": h(F.gelu(x, approximate="tanh")), "layer_norm": h(F.layer_norm(a, (64,))),
           "rsqrt": h(torch.rsqrt(pos)), "sqrt": h(torch.sqrt(pos)), "div": h(1.0 / pos),
           "cross_entropy": h(F.cross_entropy(a @ b, torch.arange(256) % 512).reshape(1))}
    p = torch.nn.Parameter(torch.randn(4096, generator=g))
    opt = torch.optim.AdamW([p], lr=1e-3)
    for _ in range(3):
        p.grad = torch.randn(4096, generator=g)
        opt.step()
    out["adamw 3 steps"] = h(p)
    from testbed.train.model import build_model, logits_of

    model = build_model("tiny", 3)
    idx = torch.randint(0, 512, (4, 64), generator=g)
    loss = F.cross_entropy(logits_of(model, idx).flatten(0, 1), idx.roll(1).flatten())
    out["tiny forward loss"] = h(loss.reshape(1))
    loss.backward()
    out["tiny gradients"] = h(torch.cat([q.grad.reshape(-1) for q in model.parameters()]))
    return out


def instructions(binary: Path) -> dict:
    if not binary.exists():
        return {"skipped": f"{binary} not built (cc -O2 -mavx2 -mfma -o {binary} {binary.with_suffix('.c')})"}
    return json.loads(subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin", default=str(Path(__file__).with_name("cpu_numerics_probe.bin")))
    a = p.parse_args()
    print(json.dumps({"machine": platform.node(), "cpu": cpu(),
                      "torch_capability": torch.backends.cpu.get_cpu_capability(),
                      "instructions": instructions(Path(a.bin)), "torch": torch_ops()}, indent=1))


if __name__ == "__main__":
    main()

"""Compiles every Triton kernel of the engine for sm_80 and sm_90 with Triton's bundled ptxas, no GPU needed,
and prints one JSON line per configuration: registers and spill bytes as ptxas reports them.

Run as a script in a process WITHOUT `TRITON_INTERPRET=1` (the interpreter swaps Triton's library functions
for Python ones when `triton.language` is first imported, which the compiler cannot take):
test_triton_compile.py runs it in a subprocess. The configurations are the ones the backend launches for
the supported models: each kernel's constants come from the same `*_meta` function its launch calls.

Results are cached in `--cache` (a JSON file keyed by Triton's version, the kernel's source and the
configuration), so a second run compiles only what changed.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

DTYPES = {"float32": ("fp32", torch.float32), "bfloat16": ("bf16", torch.bfloat16), "float16": ("fp16", torch.float16)}
HEAD_DIMS = (64, 128)
# the decode kernel's GQA groups 1-8 pad to the same 16-row tile (GROUP_PAD / the dot's minimum), so their
# registers match: the two ends and 7 (Qwen2.5-0.5B's 14/2, not a power of two) stand for them
GROUPS = (1, 7, 8)
# the prompt kernel packs a KV head's whole group into its tile (rows, warps and the row -> head division
# differ per group), so every group 1-8 is compiled
PREFILL_GROUPS = tuple(range(1, 9))
ARCHS = (80, 90)
BLOCK_SIZE = 16
CUDA = torch.device("cuda")  # (only read for its type: nothing runs)


# the innermost strides (head dimension, table columns): 1 in every launch, which Triton specialises into a
# constant, as it does here
UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_tw", "stride_kcd", "stride_vcd")


def _signature(fn, ptr_types: dict[str, str], constants: dict) -> tuple[dict[str, str], dict, dict]:
    """(signature, constants with the unit strides, attributes): pointers and the other strides marked
    16-divisible, as Triton marks them at a launch over the pool's views (rows of 64 or 128 elements)."""
    sig, attrs, constants = {}, {}, dict(constants)
    for i, name in enumerate(fn.arg_names):
        if name in UNIT_STRIDES:
            constants[name] = 1
        if name in constants:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptr_types.get(name, ptr_types["*"])
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("scale", "eps"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, constants, attrs


def cases():
    """(kernel module function, name, pointer types, constants with launch options) of every configuration."""
    from pd.engine.attention import triton_decode, triton_kv_write, triton_ops, triton_prefill

    for dtype_name, (ty, dtype) in DTYPES.items():
        for head_dim in HEAD_DIMS:
            ints = {"table_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_ptr": "*i32", "slot_ptr": "*i64"}
            for group in GROUPS:
                meta = triton_decode.decode_meta(dtype, CUDA, group, head_dim, BLOCK_SIZE)
                yield triton_decode._decode_kernel, f"decode {dtype_name} d{head_dim} g{group}", {"*": f"*{ty}", **ints}, meta
            for group in PREFILL_GROUPS:
                meta = triton_prefill.prefill_meta(dtype, CUDA, group, head_dim, BLOCK_SIZE)
                yield (triton_prefill._prefill_kernel, f"prefill {dtype_name} d{head_dim} g{group}",
                       {"*": f"*{ty}", **ints}, meta)
            # split-KV (small batches): the decode kernel with 8 shares, and the kernel that combines them
            meta = triton_decode.decode_meta(dtype, CUDA, 7, head_dim, BLOCK_SIZE, splits=8)
            yield triton_decode._decode_kernel, f"decode {dtype_name} d{head_dim} g7 split8", {"*": f"*{ty}", **ints}, meta
            yield (triton_decode._decode_reduce_kernel, f"decode_reduce {dtype_name} d{head_dim} split8",
                   {"*": "*fp32", "out_ptr": f"*{ty}"}, triton_decode.reduce_meta(head_dim, 8))
            for kv_heads in (2, 8):
                meta = triton_kv_write.kv_write_meta(kv_heads, head_dim, BLOCK_SIZE)
                yield triton_kv_write._kv_write_kernel, f"kv_write {dtype_name} d{head_dim} h{kv_heads}", {"*": f"*{ty}", **ints}, meta
            for heads, kv_heads in ((14, 2), (32, 8)):
                meta = triton_ops.rope_meta(heads, kv_heads, head_dim)
                yield triton_ops._rope_kernel, f"rope {dtype_name} d{head_dim} {heads}/{kv_heads}", {"*": f"*{ty}"}, meta
        for hidden in (896, 4096):
            for residual in (False, True):
                meta = triton_ops.norm_meta(hidden, residual)
                yield (triton_ops._rms_norm_kernel, f"rms_norm {dtype_name} h{hidden}{' +residual' if residual else ''}",
                       {"*": f"*{ty}"}, meta)
        meta = triton_ops.silu_meta(4864)
        yield triton_ops._silu_mul_kernel, f"silu_and_mul {dtype_name}", {"*": f"*{ty}"}, meta


def compile_one(fn, ptr_types: dict[str, str], meta: dict, arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    options = {k: meta[k] for k in ("num_warps", "num_stages") if k in meta}
    constants = {k: v for k, v in meta.items() if k not in options}
    jitted = triton.jit(fn)
    sig, constants, attrs = _signature(jitted, ptr_types, constants)
    kernel = triton.compile(ASTSource(jitted, sig, constants, attrs), target=GPUTarget("cuda", arch, 32),
                            options=options)
    ptx = kernel.asm["ptx"]
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        # Triton's own ptxas for the architecture, as it ran it (it keeps no log): -v reports the resources
        log = subprocess.run([get_ptxas(arch).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={target}", src, "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return {"registers": regs, "spill_bytes": spills, "target": target}


def _key(fn, name: str, meta: dict, arch: int) -> str:
    import triton

    text = f"{triton.__version__}|{inspect.getsource(fn)}|{name}|{sorted(meta.items())}|{arch}"
    return hashlib.sha256(text.encode()).hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=None, help="JSON file of earlier results (read and updated)")
    parser.add_argument("--only", default="", help="compile only the configurations whose name holds this")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print(json.dumps({"error": "run without TRITON_INTERPRET=1"}))
        return 2
    cache = {}
    if args.cache and os.path.exists(args.cache):
        with open(args.cache) as f:
            cache = json.load(f)
    for fn, name, ptr_types, meta in cases():
        if args.only not in name:
            continue
        for arch in ARCHS:
            key = _key(fn, name, meta, arch)
            t0 = time.perf_counter()
            if key not in cache:
                cache[key] = compile_one(fn, ptr_types, meta, arch)
            row = {"kernel": name, "arch": arch, **cache[key], "seconds": round(time.perf_counter() - t0, 2),
                   "num_warps": meta.get("num_warps", 4), "num_stages": meta.get("num_stages", 3)}
            print(json.dumps(row), flush=True)
    if args.cache:
        with open(args.cache, "w") as f:
            json.dump(cache, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

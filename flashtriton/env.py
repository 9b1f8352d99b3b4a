"""``python -m flashtriton.env``: versions, the GPU, and which paths this machine takes."""

import platform
import sys


def report() -> str:
    import torch
    import triton

    import flashtriton
    from flashtriton import _env, configs

    lines = [f"flashtriton {flashtriton.__version__}", f"python {platform.python_version()}",
             f"torch {torch.__version__}", f"triton {triton.__version__}"]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(f"GPU: {props.name}, compute capability {props.major}.{props.minor}, "
                     f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
        lines.append("kernels: compiled Triton on the GPU")
    else:
        lines.append("GPU: none")
        lines.append("kernels: " + ("Triton interpreter on the CPU (TRITON_INTERPRET=1)"
                                    if _env.INTERPRET else
                                    "unavailable: no GPU and TRITON_INTERPRET is not set"))
    lines.append(f"autotuning: {'on' if _env.AUTOTUNE else 'off (one config per kernel)'}; "
                 f"forward candidates: {len(configs.candidates('fwd'))}")
    lines.append(f"TMA loads: {'on for sm_90+ GPUs' if _env.TMA else 'off'}; cached launches of "
                 f"compiled kernels: {'on' if _env.FAST_LAUNCH and not _env.INTERPRET else 'off'}")
    lines.append(f"Gluon forward and backward (Hopper, D=128): {'on' if _env.GLUON else 'off'}")
    lines.append(f"logging: FLASHTRITON_LOG={_env.LOG_LEVEL or 'unset'}")
    lines.append("paths: forward/backward (dense, varlen, window, softcap, ALiBi, SDPA masks, "
                 "dropout, score/mask mods, block masks), KV-cache decoding (contiguous, paged, "
                 "split-KV)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
    sys.exit(0)

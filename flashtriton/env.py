"""``python -m flashtriton.env``: versions, the GPU, and which paths THIS machine takes.

Each Hopper path is reported as this machine runs it: on, off by its switch, or not used here
(no GPU, the interpreter, or a GPU without the hardware it needs), with its switch's value."""

import platform
import sys


def _switch(name: str, on: bool) -> str:
    return f"{name}={'1' if on else '0'}"


def _path(name: str, switch: str, on: bool, why_not_here) -> str:
    """One path's line: ``why_not_here`` (None: this machine can run it) says why it is not used
    here whatever its switch; else the switch decides."""
    if why_not_here is not None:
        return f"{name}: not used here ({why_not_here}; {_switch(switch, on)})"
    return f"{name}: {'on' if on else 'off'} ({_switch(switch, on)})"


def report() -> str:
    import torch
    import triton

    import flashtriton
    from flashtriton import _env, configs, tuning

    lines = [f"flashtriton {flashtriton.__version__}", f"python {platform.python_version()}",
             f"torch {torch.__version__}", f"triton {triton.__version__}"]
    gpu = torch.cuda.is_available()
    major = minor = None
    if gpu:
        props = torch.cuda.get_device_properties(0)
        major, minor = torch.cuda.get_device_capability(0)
        lines.append(f"GPU: {props.name}, compute capability {major}.{minor} (sm_{major}{minor}), "
                     f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
        lines.append("kernels: " + ("Triton interpreter (TRITON_INTERPRET=1), not compiled"
                                    if _env.INTERPRET else "compiled Triton on the GPU"))
    else:
        lines.append("GPU: none")
        lines.append("kernels: " + ("Triton interpreter on the CPU (TRITON_INTERPRET=1)"
                                    if _env.INTERPRET else
                                    "unavailable: no GPU and TRITON_INTERPRET is not set"))
    compiled = gpu and not _env.INTERPRET  # compiled kernels launched on this machine's GPU
    runs = gpu or _env.INTERPRET  # any kernel runs here
    if not runs:
        how = "not used here (no kernel runs)"
    elif _env.INTERPRET:
        how = "off (the interpreter runs each kernel's default config)"
    elif _env.AUTOTUNE:
        how = "on (FLASHTRITON_AUTOTUNE=1: each new tuning key searches its tiles)"
    else:
        shipped = tuning.SHIPPED_DIR / f"sm{major}{minor}.json"
        tables = [str(p) for p in reversed(_env.TUNING_FILES)]
        tables += [f"{shipped.name} (shipped)"] if shipped.exists() else []
        named = ", then ".join(tables) if tables else (
            f"none for sm_{major}{minor}: each head-dim class's default tile")
        how = f"off (FLASHTRITON_AUTOTUNE=0); tiles from the tuning tables: {named}"
    lines.append(f"autotuning: {how}; forward candidates: {len(configs.candidates('fwd'))}")

    # Why each Hopper path is not used here whatever its switch (None: its switch decides),
    # as flashtriton.launch decides: TMA for sm_90+ (runtime._tma_capable, the interpreter
    # too), PDL for sm_90+ compiled (runtime.use_pdl), Gluon for sm_90 compiled (gluon_misfit).
    sm = f"sm_{major}{minor}" if gpu else None
    no_gpu = "no GPU"
    interp = "the interpreter runs the kernels"
    tma_not = no_gpu if not gpu else None if major >= 9 else f"this GPU is {sm}; TMA needs sm_90+"
    pdl_not = (no_gpu if not gpu else interp if _env.INTERPRET else None if major >= 9 else
               f"this GPU is {sm}; programmatic dependent launch needs sm_90+")
    from .launch import gluon_triton_misfit
    gluon_not = (no_gpu if not gpu else interp if _env.INTERPRET else
                 f"this GPU is {sm}; the Gluon kernels are for Hopper, sm_90, only" if major != 9
                 else gluon_triton_misfit())
    lines.append(_path("TMA loads (tensor descriptors, forward and backward)",
                       "FLASHTRITON_TMA", _env.TMA, tma_not))
    dims = lambda ds: ", ".join(map(str, ds))  # noqa: E731
    def from_len(table):  # the routes' head dims taken from a length, by length
        lengths = dict.fromkeys(table.values())
        return "".join(f"; D={dims(d for d in table if table[d] == n)} from {n} tokens"
                       for n in lengths)
    lines.append(_path(f"Gluon forward (D={dims(configs.GLUON_FWD_HEAD_DIMS)}"
                       f"{from_len(configs.GLUON_FWD_MIN_SEQLEN)}) and backward "
                       f"(D={dims(configs.GLUON_BWD_HEAD_DIMS)}"
                       f"{from_len(configs.GLUON_PADDED_BWD_MIN_SEQLEN)})",
                       "FLASHTRITON_GLUON",
                       _env.GLUON, gluon_not))
    lines.append(_path("programmatic dependent launch of the decoding kernels", "FLASHTRITON_PDL",
                       _env.PDL, pdl_not))
    lines.append(_path("cached launches of compiled kernels", "FLASHTRITON_FAST_LAUNCH",
                       _env.FAST_LAUNCH, None if compiled else no_gpu if not gpu else interp))
    lines.append(f"logging: {'FLASHTRITON_LOG=' + _env.LOG_LEVEL if _env.LOG_LEVEL else 'off'}")
    lines.append("paths: forward/backward (dense, varlen, window, softcap, ALiBi, SDPA masks, "
                 "dropout, score/mask mods, block masks), KV-cache decoding (contiguous, paged, "
                 "split-KV)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
    sys.exit(0)
